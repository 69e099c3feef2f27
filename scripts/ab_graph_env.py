"""A/B of one of flashopm's environment switches on the GPU time of forward calls (CUDA-graph
replay, bench.time_graph): graphs captured with VAR=VALUE and without it, in alternation over
several rounds (the switches are read when a call is captured), so that both sides meet the same
clocks.  Prints each round's GPU time per call and the medians.  With --between, each call is
preceded by a one-block ATen kernel (an in-place add on a small tensor), as in a model where the
call follows another layer's kernel rather than itself; its own time is in both sides' figures.

    python scripts/ab_graph_env.py VAR=VALUE [B,S,N,C,H,D ...] [--rounds 6] [--between]
"""
import argparse
import os
import statistics

import torch

import flashopm
from ab_problems import gpu_problems
from flashopm.bench import time_graph


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("switch", help="VAR=VALUE")
    ap.add_argument("shapes", nargs="*", default=["2,8,32,64,32,64"])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--between", action="store_true", help="a small ATen kernel before each call")
    args = ap.parse_intermixed_args()
    var, value = args.switch.split("=", 1)
    for sh, x, m, p in gpu_problems(args.shapes, "GPU time per call, us"):
        other = torch.zeros(256, device="cuda")

        def call():
            if args.between:
                other.add_(1.0)
            return flashopm.outer_product_mean(x, m, p["ln_weight"], p["ln_bias"], p["w_a"], p["b_a"], p["w_b"],
                                               p["b_b"], p["w_out"], p["b_out"])

        without, with_ = [], []
        for r in range(args.rounds):
            for on in ((False, True) if r % 2 == 0 else (True, False)):
                if on:
                    os.environ[var] = value
                try:
                    t = time_graph(call)
                finally:
                    os.environ.pop(var, None)
                (with_ if on else without).append(t.median_us)
        same = torch.equal(call(), call())
        print(f"{sh}{' after an add' if args.between else ''}: without {statistics.median(without):7.2f} ({', '.join(f'{v:.2f}' for v in without)}); "
              f"with {var}={value} {statistics.median(with_):7.2f} ({', '.join(f'{v:.2f}' for v in with_)}); "
              f"repeatable: {same}", flush=True)


if __name__ == "__main__":
    main()
