"""The fused projection's error against the default path's on one problem: max |out - ref32|,
allclose(1e-4) and the normwise error against float64, for eager float32, the default and
FLASHOPM_FUSED_PROJECTION=1.
    usage: python scripts/fused_errors.py B,S,N,C,H,D [--scale 10] [--no-b-bias] [--seed 33]"""
import argparse
import os

import torch

import flashopm
from flashopm.testing import PARAM_ORDER, Shape, make_problem, reference, rel_error

ap = argparse.ArgumentParser()
ap.add_argument("shape")
ap.add_argument("--scale", type=float, default=1.0)
ap.add_argument("--no-b-bias", action="store_true")
ap.add_argument("--seed", type=int, default=33)
ap.add_argument("--normalization", default="row")
args = ap.parse_args()
torch.backends.cuda.matmul.allow_tf32 = False
sh = Shape(*map(int, args.shape.split(",")))
x, m, p = make_problem(sh, "masked_positions", seed=args.seed, scale=args.scale)
if args.no_b_bias:
    p["b_b"] = None
x, m = x.cuda(), m.cuda()
p = {k: None if v is None else v.cuda() for k, v in p.items()}
code = flashopm.ops.NORMALIZATIONS[args.normalization]
ref32 = reference(x, m, p, normalization=code)
ref64 = reference(x, m, p, dtype=torch.float64, normalization=code)


def run(fused):
    os.environ["FLASHOPM_FUSED_PROJECTION"] = "1" if fused else "0"
    return flashopm.outer_product_mean(x, m, *(p[k] for k in PARAM_ORDER), algorithm="outer",
                                       normalization=args.normalization, precision="highest")


print(f"{sh} scale {args.scale} |ref| max {ref64.abs().max().item():.3g}")
for name, out in (("eager", ref32), ("default", run(False)), ("fused", run(True))):
    d = (out.double() - ref32.double()).abs()
    tol = 1e-4 + 1e-4 * ref32.double().abs()
    print(f"{name:8s} max|out-ref32| {d.max().item():.3g}  over tol {(d > tol).sum().item():5d}  "
          f"normwise vs fp64 {rel_error(out, ref64):.3g}  max|out-ref64| {(out.double() - ref64).abs().max().item():.3g}")
