"""The row-tiled projection kernel's time against its rows per block (FLASHOPM_PROJ_ROWS = 128, 64,
32): for each msa_dim and number of rows B·S·N (N = 128, S from the rows), the median over a few
calls of opm_project_rows_kernel's device time in one forward call of the op (the whole problem's
projection is one launch when no peak bound is set).  With --bound, a peak bound (e.g. 1.1) and
the given shapes instead: every projection launch of one call, in order, for each setting.
(FLASHOPM_PROJECT_STREAM=1 would take the streamed kernel for 16-bit x, whose rows per tile are
fixed, and 16-bit x takes the register-resident kernel by default: the sweep leaves the first unset
and sets FLASHOPM_PROJECT_REGS=0.  scripts/projection16_times.py times the 16-bit forms.)

    python scripts/projection_rows_sweep.py [--msa-dims 64,256] [--rows 9216,16384,...]
                                            [--precision highest] [--dtype float32]
    python scripts/projection_rows_sweep.py --bound 1.1 1,128,256,256,32,128 ...
"""
import argparse
import os
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

import flashopm
from flashopm.testing import PARAM_ORDER, Shape, make_problem

os.environ.pop("FLASHOPM_PROJECT_STREAM", None)
os.environ["FLASHOPM_PROJECT_REGS"] = "0"

SETTINGS = ("128", "64", "32")


def projection_times(call):
    """Device times (us) of the projection launches of one call, in order."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    events = [e for e in prof.events()
              if e.device_type == torch.autograd.DeviceType.CUDA and "opm_project_rows_kernel" in e.name]
    events.sort(key=lambda e: e.time_range.start)
    return [e.device_time for e in events]


def problem(shape, dtype, precision):
    x, m, p = make_problem(shape, "masked_positions", seed=0)
    x, m = x.cuda().to(dtype), m.cuda().to(dtype)
    p = {k: v.cuda().to(dtype) for k, v in p.items()}
    return lambda: flashopm.outer_product_mean(x, m, *(p[k] for k in PARAM_ORDER), algorithm="outer",
                                               precision=precision)


def with_rows(rows, call):
    os.environ["FLASHOPM_PROJ_ROWS"] = rows
    try:
        return call()
    finally:
        del os.environ["FLASHOPM_PROJ_ROWS"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="*")
    ap.add_argument("--msa-dims", default="64,256")
    ap.add_argument("--rows", default="9216,16384,24576,32768,49152,65536,131072,262144,1048576")
    ap.add_argument("--precision", default="highest")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--bound", default=None)
    ap.add_argument("--calls", type=int, default=5)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    flashopm.load()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}, {args.precision}, "
          f"bound {args.bound}", flush=True)
    if args.bound:
        os.environ["FLASHOPM_PEAK_BOUND"] = args.bound
        for text in args.shapes:
            shape = Shape(*map(int, text.split(",")))
            call = problem(shape, dtype, args.precision)
            for rows in SETTINGS:
                with torch.no_grad():
                    for _ in range(2):
                        with_rows(rows, call)
                    runs = [with_rows(rows, lambda: projection_times(call)) for _ in range(args.calls)]
                med = [statistics.median(t) for t in zip(*runs)]
                print(f"{shape} rows/block {rows:>3}: {sum(med):8.1f} us in {len(med)} launches: "
                      + " ".join(f"{t:.1f}" for t in med), flush=True)
        return
    print(f"{'C':>4} {'rows':>8} " + " ".join(f"{'us @' + r:>9}" for r in SETTINGS), flush=True)
    for C in map(int, args.msa_dims.split(",")):
        for total in map(int, args.rows.split(",")):
            shape = Shape(1, max(1, total // 128), 128, C, 32, 128)
            call = problem(shape, dtype, args.precision)
            med = {}
            with torch.no_grad():
                for rows in SETTINGS:
                    for _ in range(2):
                        with_rows(rows, call)
                    med[rows] = statistics.median(sum(with_rows(rows, lambda: projection_times(call)))
                                                  for _ in range(args.calls))
            print(f"{C:>4} {shape.S * shape.N:>8} " + " ".join(f"{med[r]:9.1f}" for r in SETTINGS), flush=True)


if __name__ == "__main__":
    main()
