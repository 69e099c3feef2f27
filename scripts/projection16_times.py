"""The LayerNorm/projection stage of a 16-bit model by kernel: the register-resident form (the
default, opm_project_regs_kernel), the row-tiled kernel (FLASHOPM_PROJECT_REGS=0) and the streamed
one (FLASHOPM_PROJECT_STREAM=1), in one process, the forms taking turns call by call so that they
meet the same clocks.  For each shape: the median device time of the projection's launch in one
forward call of the op (torch.profiler; one launch for all rows, no peak bound), the bandwidth that
makes of x read and a and b written once, and the wall time of the stage alone
(torch.ops.flashopm._projections, CUDA events, L2 flushed before each call); then how far each
form's a and b are from the default's.

    python scripts/projection16_times.py [B,S,N,C,H,D ...] [--dtype bfloat16] [--calls 10]
                                         [--forms regs,rows,stream]
"""
import argparse
import os
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

import flashopm
from flashopm.bench import warm_gpu
from flashopm.testing import PARAM_ORDER, Shape, make_problem

FORMS = {
    "regs": {},
    "rows": {"FLASHOPM_PROJECT_REGS": "0"},
    "stream": {"FLASHOPM_PROJECT_STREAM": "1"},
}
SWITCHES = ("FLASHOPM_PROJECT_REGS", "FLASHOPM_PROJECT_STREAM", "FLASHOPM_PEAK_BOUND")


def with_form(form, fn):
    saved = {k: os.environ.pop(k) for k in SWITCHES if k in os.environ}
    os.environ.update(FORMS[form])
    try:
        return fn()
    finally:
        for k in FORMS[form]:
            os.environ.pop(k, None)
        os.environ.update(saved)


def projection_kernels(call):
    """(name, device time in us) of each projection launch of one call."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return [(e.name, e.device_time) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and "opm_project_" in e.name]


def stage_ms(stage, flush):
    """Wall time (ms) of one call of the projection stage alone, L2 flushed before it."""
    flush.add_(1)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    stage()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="*", default=["1,512,1536,256,32,128"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--forms", default="regs,rows,stream")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    forms = args.forms.split(",")
    flashopm.load()
    warm_gpu()
    props = torch.cuda.get_device_properties(0)
    flush = torch.empty(2 * props.L2_cache_size // 4 + 1, device="cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}, forms {forms}", flush=True)
    for text in args.shapes:
        sh = Shape(*map(int, text.split(",")))
        x, m, p = make_problem(sh, "masked_positions", seed=1)
        x, m = x.cuda().to(dtype), m.cuda().to(dtype)
        p = {k: v.cuda().to(dtype) for k, v in p.items()}

        def call():
            with torch.no_grad():
                return flashopm.outer_product_mean(x, m, *(p[k] for k in PARAM_ORDER), algorithm="outer")

        def stage():
            return torch.ops.flashopm._projections(x, m, p["ln_weight"], p["ln_bias"], 1e-5, p["w_a"], p["b_a"],
                                                   p["w_b"], p["b_b"])

        for form in forms:  # a first call each: builds, plans, allocations
            with_form(form, call)
            with_form(form, stage)
        kernel_us = {f: [] for f in forms}
        wall_ms = {f: [] for f in forms}
        names = {}
        for _ in range(args.calls):
            for form in forms:
                launches = with_form(form, lambda: projection_kernels(call))
                names[form] = sorted({n.split("(")[0] for n, _ in launches})
                kernel_us[form].append(sum(t for _, t in launches))
                wall_ms[form].append(with_form(form, lambda: stage_ms(stage, flush)))
        bytes_moved = sh.B * sh.S * sh.N * (sh.C + 2 * sh.H) * dtype.itemsize
        base = statistics.median(kernel_us[forms[0]])
        for form in forms:
            us = statistics.median(kernel_us[form])
            print(f"{sh} {form:>6}: projection {us:8.1f} us ({bytes_moved / us / 1e6:5.2f} TB/s, "
                  f"{us / base:5.2f}x {forms[0]}), stage alone {statistics.median(wall_ms[form]):.3f} ms; "
                  f"{', '.join(names[form])}", flush=True)
        ref = with_form(forms[0], stage)
        for form in forms[1:]:
            other = with_form(form, stage)
            diffs = [(o.float() - r.float()).abs().max().item() for o, r in zip(other, ref)]
            scale = max(r.float().abs().max().item() for r in ref)
            print(f"{sh} {form:>6}: a, b at most {max(diffs):.3g} from {forms[0]}'s (largest |a|, |b| {scale:.3g})",
                  flush=True)


if __name__ == "__main__":
    main()
