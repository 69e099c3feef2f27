"""GPU time of the pair-count kernel (OpenFold's and Boltz's divisors sum_s m[s,i] m[s,j]) per mask
kind, in its tensor-core form (the default) and its float32 FMA form (FLASHOPM_PAIR_COUNT_MMA=0),
through torch.ops.flashopm._pair_counts: the kernel's mean time over 20 calls (torch.profiler),
and the tensor-core form's speed-up.  Masks: 0/1 in bfloat16, float32 and bool, and fractions in
float32 (whose low bfloat16 pieces take five more products a k-step).
    usage: python scripts/pair_count_times.py [B,S,N ...]   (default 1,512,1536)"""
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import flashopm

CALLS = 20


def kernel_us(mask):
    """Mean GPU time of the pair-count kernel per call, and the kernel's name."""
    N = mask.shape[2]
    for _ in range(3):
        torch.ops.flashopm._pair_counts(mask, N, 0)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            torch.ops.flashopm._pair_counts(mask, N, 0)
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if "opm_pair_count" in e.key and e.device_time_total > 0]
    assert len(rows) == 1, [e.key for e in rows]
    return rows[0].device_time_total / CALLS, rows[0].key


def masks(B, S, N):
    g = torch.Generator().manual_seed(0)
    binary = torch.rand(B, S, N, generator=g) < 0.7
    fractions = torch.where(binary, torch.rand(B, S, N, generator=g), torch.zeros(()))
    return {
        "bfloat16 0/1": binary.to(torch.bfloat16),
        "float32 0/1": binary.float(),
        "bool": binary,
        "float32 fractions": fractions,
    }


def main(shapes):
    flashopm.load()
    print(torch.cuda.get_device_name(), flush=True)
    for B, S, N in shapes:
        for name, mask in masks(B, S, N).items():
            mask = mask.cuda()
            times = {}
            for form, setting in (("fma", "0"), ("mma", None)):
                if setting is None:
                    os.environ.pop("FLASHOPM_PAIR_COUNT_MMA", None)
                else:
                    os.environ["FLASHOPM_PAIR_COUNT_MMA"] = setting
                times[form], kernel = kernel_us(mask)
                print(f"({B},{S},{N}) {name:>17} {form}: {times[form]:8.1f} us  {kernel[:90]}", flush=True)
            print(f"({B},{S},{N}) {name:>17} tensor cores {times['fma'] / times['mma']:.2f}x faster", flush=True)
    os.environ.pop("FLASHOPM_PAIR_COUNT_MMA", None)


if __name__ == "__main__":
    shapes = [tuple(int(v) for v in a.split(",")) for a in sys.argv[1:]] or [(1, 512, 1536)]
    main(shapes)
