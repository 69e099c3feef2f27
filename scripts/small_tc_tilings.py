"""The small-problem path under each tiling (FLASHOPM_SMALL_TC_TILE), in its float32 FMA form and its
mma.sync form (FLASHOPM_SMALL_TC_FMA=0), each in two launches and in one cooperative launch where it
applies (FLASHOPM_SMALL_TC_FUSED=1), and the FMA form with each block projecting its own rows of a
(FLASHOPM_SMALL_TC_LOCAL_A=1): GPU time per call from CUDA-graph replay, and each kernel's
time per call under torch.profiler.

    PYTHONPATH=src python scripts/small_tc_tilings.py [B,S,N,C,H,D] [TI,Dc ...]

TILINGS_FORMS=fma,fma-local-a (names from FORMS) limits the forms.
"""
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import flashopm
from flashopm.bench import time_graph, warm_gpu
from flashopm.testing import Shape, make_problem

CALLS = 50
FORMS = {"fma": {}, "fma-local-a": {"FLASHOPM_SMALL_TC_LOCAL_A": "1"}, "fma-one": {"FLASHOPM_SMALL_TC_FUSED": "1"},
         "mma": {"FLASHOPM_SMALL_TC_FMA": "0"}, "mma-one": {"FLASHOPM_SMALL_TC_FMA": "0", "FLASHOPM_SMALL_TC_FUSED": "1"}}
ENV_KEYS = ("FLASHOPM_SMALL_TC_FUSED", "FLASHOPM_SMALL_TC_FMA", "FLASHOPM_SMALL_TC_LOCAL_A")


def kernel_us(call):
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            call()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / CALLS) for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r[1])


def main(args):
    shape = Shape(*map(int, args[0].split(","))) if args else Shape(2, 8, 32, 64, 32, 64)
    tiles = args[1:] or ["auto", "1,32", "2,16", "4,8"]
    forms = os.environ.get("TILINGS_FORMS", ",".join(FORMS)).split(",")
    flashopm.load()
    warm_gpu()
    x, m, p = make_problem(shape, "masked_positions", seed=1)
    x, m = x.cuda(), m.cuda()
    p = {k: None if v is None else v.cuda() for k, v in p.items()}

    def call():
        return flashopm.outer_product_mean(x, m, p["ln_weight"], p["ln_bias"], p["w_a"], p["b_a"], p["w_b"], p["b_b"],
                                           p["w_out"], p["b_out"], algorithm="small-tc")

    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  {shape}")
    ref = None
    for tile in tiles:
        for form in forms:
            env = FORMS[form]
            if tile == "auto":
                os.environ.pop("FLASHOPM_SMALL_TC_TILE", None)
            else:
                os.environ["FLASHOPM_SMALL_TC_TILE"] = tile
            for k in ENV_KEYS:
                os.environ.pop(k, None)
            os.environ.update(env)
            out = call()
            ref = out if ref is None else ref
            diff = (out - ref).abs().max().item()
            g = time_graph(call, n=100)
            kernels = "  ".join(f"{k[:34]} {t:.2f}" for k, t in kernel_us(call))
            print(f"tile {tile:5s} {form:7s}  graph {g.median_us:6.2f} us [{g.p10_us:.2f}, {g.p90_us:.2f}]  max diff vs "
                  f"first {diff:.2e}  kernels (us/call): {kernels}", flush=True)
    for k in ENV_KEYS:
        os.environ.pop(k, None)
    os.environ.pop("FLASHOPM_SMALL_TC_TILE", None)


if __name__ == "__main__":
    main(sys.argv[1:])
