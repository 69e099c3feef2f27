"""Wall time per call of the op as the package on the path builds it (see ab_variants.sh), with its
error against float32 PyTorch on the same inputs where that reference fits (N <= 768); for
problems under 1 ms, also the GPU time per call from CUDA-graph replay (host time left out).

    PYTHONPATH=src python scripts/ab_time.py LABEL [B,S,N,C,H,D ...] [--dtype bfloat16]
"""
import argparse

import torch

import flashopm
from flashopm.bench import time_graph, time_wall, warm_gpu
from flashopm.testing import Shape, make_problem, reference


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("label")
    ap.add_argument("shapes", nargs="*", default=["1,512,1536,256,32,128", "1,512,768,256,32,128"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--precision", default=None, choices=["highest", "high", "medium"])
    args = ap.parse_intermixed_args()  # shapes before or after the options
    dtype = getattr(torch, args.dtype)
    flashopm.load()
    warm_gpu()
    for text in args.shapes:
        shape = Shape(*map(int, text.split(",")))
        x, m, p = make_problem(shape, "masked_positions", seed=1)
        xd, md = x.to(dtype).cuda(), m.to(dtype).cuda()
        pd = {k: None if v is None else v.to(dtype).cuda() for k, v in p.items()}

        def call():
            return flashopm.outer_product_mean(xd, md, pd["ln_weight"], pd["ln_bias"], pd["w_a"], pd["b_a"], pd["w_b"],
                                               pd["b_b"], pd["w_out"], pd["b_out"], precision=args.precision)

        out = call()
        err = float("nan")
        if shape.N <= 768:
            ref = reference(xd, md, pd, dtype=torch.float32)
            err = ((out.float() - ref).norm() / ref.norm()).item()
        t = time_wall(call, n=10, warmup=2)
        graph = ""
        if t.median_us < 1e3:
            g = time_graph(call, n=50)
            graph = f"  GPU {g.median_us:8.2f} us (graph)" if g is not None else ""
        print(f"{args.label:8s} {shape}  {args.dtype:9s} {t.median_us / 1e3:8.3f} ms{graph}  error {err:.3g}",
              flush=True)


if __name__ == "__main__":
    main()
