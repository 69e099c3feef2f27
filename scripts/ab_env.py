"""A/B of flashopm's environment switches in one process: a training step (or a forward call)
with VAR=VALUE (several: VAR=VALUE,VAR2=VALUE2) and without, timed in alternation
(bench.paired_speedup), so that both sides meet the same host and the same clocks.  The switches
are read when the op runs, so the variables are set and unset around each call.

    python scripts/ab_env.py VAR=VALUE[,VAR2=VALUE2] [B,S,N,C,H,D ...] [--dtype bfloat16]
                             [--precision high] [--mode training|forward] [--calls 20] [--no-l2-flush]
"""
import argparse
import os

import torch

import flashopm
from flashopm.bench import paired_speedup, time_wall, warm_gpu
from flashopm.testing import Shape, make_problem


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("switch", help="VAR=VALUE, or several separated by commas")
    ap.add_argument("shapes", nargs="*", default=["1,128,256,256,32,128"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--precision", default="highest", choices=["highest", "high", "medium"])
    ap.add_argument("--mode", default="training", choices=["training", "forward"])
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--no-l2-flush", action="store_true", help="a synchronize alone between calls")
    args = ap.parse_intermixed_args()
    switches = dict(item.split("=", 1) for item in args.switch.split(","))
    dtype = getattr(torch, args.dtype)
    torch.set_float32_matmul_precision(args.precision)
    flashopm.load()
    warm_gpu()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}, {args.precision}, {args.mode}, "
          f"L2 {'kept' if args.no_l2_flush else 'flushed'} between calls")
    for text in args.shapes:
        sh = Shape(*map(int, text.split(",")))
        x, m, p = make_problem(sh, "masked_positions", seed=1)
        model = flashopm.ModelNew(sh.C, sh.D, sh.H)
        with torch.no_grad():
            for mod, (w, b) in zip((model.layer_norm, model.proj_a, model.proj_b, model.out_proj),
                                   (("ln_weight", "ln_bias"), ("w_a", "b_a"), ("w_b", "b_b"), ("w_out", "b_out"))):
                mod.weight.copy_(p[w])
                mod.bias.copy_(p[b])
        model = model.to("cuda", dtype)
        x, m = x.to("cuda", dtype).requires_grad_(args.mode == "training"), m.to("cuda", dtype)
        g = torch.randn(sh.B, sh.N, sh.N, sh.D, device="cuda", dtype=dtype)
        leaves = [x, *model.parameters()]

        def step():
            if args.mode == "forward":
                with torch.no_grad():
                    return model(x, m)
            return torch.autograd.grad(model(x, m), leaves, g)

        def with_switch():
            os.environ.update(switches)
            try:
                return step()
            finally:
                for var in switches:
                    del os.environ[var]

        for var in switches:
            os.environ.pop(var, None)
        a, b = step(), with_switch()
        same = all(torch.equal(u, v) for u, v in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)))
        flush = not args.no_l2_flush
        t_off = time_wall(step, n=args.calls, warmup=3, flush_l2=flush)
        t_on = time_wall(with_switch, n=args.calls, warmup=3, flush_l2=flush)
        ratio = paired_speedup(step, with_switch, n=args.calls, flush_l2=flush)
        print(f"{sh}: without {t_off.median_us:9.1f} us, with {args.switch} {t_on.median_us:9.1f} us; "
              f"paired (without / with) {ratio:.3f}; same bits: {same}", flush=True)


if __name__ == "__main__":
    main()
