"""Time of the tensor-core outer-first path per normalisation convention at (1, 512, N, 256, 32,
128) (CUDA events, mean of 5 calls after 2 warm-up calls), for comparing the epilogues' cost; also
the target of `ncu --kernel-name regex:opm_outer_tc` runs.  `bfloat16` or `float16` runs the
inputs and parameters in that type; `kernels` adds each convention's GPU time by kernel
(torch.profiler, one call), to say which kernel a convention's extra time sits in; `bounded`
runs every call under flashopm.peak_memory_bound(1.1).

    python scripts/convention_times.py [N ...] row openfold boltz [bfloat16] [kernels] [bounded]   (N: 384)
"""
import contextlib
import sys

import torch

import flashopm
from flashopm.testing import Shape, make_problem


def time_ms(x, m, p, norm, calls=5):
    def call():
        return flashopm.outer_product_mean(x, m, p["ln_weight"], p["ln_bias"], p["w_a"], p["b_a"], p["w_b"],
                                           p["b_b"], p["w_out"], p["b_out"], algorithm="outer", normalization=norm)
    for _ in range(2):
        call()
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    for _ in range(calls):
        call()
    ev[1].record()
    ev[1].synchronize()
    return ev[0].elapsed_time(ev[1]) / calls


def kernel_times(x, m, p, norm):
    """GPU time by kernel name (microseconds) and launches of one call, longest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        time_ms(x, m, p, norm, calls=1)
    rows = [(e.key, e.device_time_total, e.count) for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r[1])


def main(sizes, norms, dtype, by_kernel, bounded):
    flashopm.load()
    with flashopm.peak_memory_bound(1.1) if bounded else contextlib.nullcontext():
        run(sizes, norms, dtype, by_kernel, "bounded" if bounded else "")


def run(sizes, norms, dtype, by_kernel, label):
    for n in sizes:
        sh = Shape(1, 512, n, 256, 32, 128)
        x, m, p = make_problem(sh, "masked_positions", seed=0)
        x, m = x.cuda().to(dtype), m.cuda()
        p = {k: None if v is None else v.cuda().to(dtype) for k, v in p.items()}
        times = {norm: time_ms(x, m, p, norm) for norm in norms}
        base = times.get("row")
        for norm, t in times.items():
            rel = f"  {t / base - 1:+6.1%} vs row" if base else ""
            print(f"N={n:5d} {str(dtype)[6:]:>8} {norm:>9}: {t:8.3f} ms{rel} {label}", flush=True)
            if by_kernel:
                for name, us, count in kernel_times(x, m, p, norm)[:10]:
                    print(f"      {us:10.1f} us  x{count:<4d} {name[:100]}", flush=True)
        del x, m, p


if __name__ == "__main__":
    args = sys.argv[1:]
    dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16}
    dtype = next((dtypes[a] for a in args if a in dtypes), torch.float32)
    words = [a for a in args if not a.isdigit() and a not in dtypes and a not in ("kernels", "bounded")]
    main([int(a) for a in args if a.isdigit()] or [384], words, dtype, "kernels" in args, "bounded" in args)
