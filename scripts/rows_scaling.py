"""Compute side of the residue-sharded OPM on one GPU: time of the local contraction
(`outer_product_mean_rows`) for the rows one rank of a group of P holds, against all rows.

    python scripts/rows_scaling.py [N ...]     (default 4096 8192; S = 512, C = 256, H = 32, D = 128)

Prints, per N and P, the time of a rank's share and the compute-only parallel efficiency
t(all rows) / (P · t(share)); communication (the all-gather of b) is not included.
"""
import sys

import torch

import flashopm
from flashopm.bench import time_wall
from flashopm.functional import outer_product_mean_rows


def time_ms(fn, calls=3):
    return time_wall(fn, n=calls, warmup=1, flush_l2=False).median_us / 1e3


def main(sizes):
    flashopm.load()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  float32 highest")
    g = torch.Generator("cuda").manual_seed(0)
    S, H, D = 512, 32, 128
    for N in sizes:
        a = torch.randn(1, S, N, H, device="cuda", generator=g)
        mask = (torch.rand(1, S, N, device="cuda", generator=g) > 0.1).float()
        a = a * mask[..., None]
        w = torch.randn(D, H * H, device="cuda", generator=g) / H
        bias = torch.randn(D, device="cuda", generator=g)
        base = None
        for P in (1, 2, 4, 8):
            rows = N // P
            a_rows = a[:, :, :rows].contiguous()
            t = time_ms(lambda: outer_product_mean_rows(a_rows, a, mask, 0, w, bias))
            del a_rows
            base = base or t
            print(f"N={N:5d} P={P}: rows {rows:5d}  {t:9.1f} ms   efficiency {base / (P * t):5.2f}")
            torch.cuda.empty_cache()
        del a, mask


if __name__ == "__main__":
    main([int(v) for v in sys.argv[1:]] or [4096, 8192])
