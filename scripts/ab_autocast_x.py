"""Mixed precision, float32 x handed to the op as it is against x cast to bfloat16 first (what the
autocast rule did before 16-bit models took float32 x): a training step (forward in a bfloat16
autocast region, backward outside it) or a forward call of ModelNew, the two timed in alternation
in one process (bench.paired_speedup), with the peak memory of each.

    python scripts/ab_autocast_x.py [B,S,N,C,H,D ...] [--mode training|forward] [--calls 20]
"""
import argparse

import torch

import flashopm
from ab_problems import gpu_problems
from flashopm.bench import paired_speedup, peak_extra_bytes, time_wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="*", default=["1,128,256,256,32,128"])
    ap.add_argument("--mode", default="training", choices=["training", "forward"])
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    for sh, x, m, _ in gpu_problems(args.shapes, f"bfloat16 autocast, {args.mode}"):
        model = flashopm.ModelNew(sh.C, sh.D, sh.H).cuda()
        x.requires_grad_(args.mode == "training")
        g = torch.randn(sh.B, sh.N, sh.N, sh.D, device="cuda", dtype=torch.bfloat16)
        leaves = [x, *model.parameters()]

        def step(cast_x):
            def run():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    out = model(x.to(torch.bfloat16) if cast_x else x, m)
                if args.mode == "training":
                    return torch.autograd.grad(out, leaves, g)
                return out
            return run

        with torch.set_grad_enabled(args.mode == "training"):
            kept, cast = step(False), step(True)
            peak_kept, _ = peak_extra_bytes(kept)
            peak_cast, _ = peak_extra_bytes(cast)
            t_kept = time_wall(kept, n=args.calls, warmup=3)
            t_cast = time_wall(cast, n=args.calls, warmup=3)
            ratio = paired_speedup(cast, kept, n=args.calls)
        print(f"{sh}: x kept {t_kept.median_us:.1f} us, peak {peak_kept / 2**30:.3f} GiB; x cast first "
              f"{t_cast.median_us:.1f} us, peak {peak_cast / 2**30:.3f} GiB; paired (cast / kept) {ratio:.3f}")


if __name__ == "__main__":
    main()
