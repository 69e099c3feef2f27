"""Times of the outer-first contraction's backward (grad_a, grad_b, grad_W): the fused kernels
(flashopm::outer_contract_backward) next to PyTorch in blocks of rows, with FLOP rates.
    usage: python scripts/backward_times.py [B,S,N,H,D ...]"""
import sys

import torch

import flashopm
from flashopm.ops import outer_contract_backward_op
from flashopm.reference import contract_outer_blocks_backward


def time_ms(fn, n=10):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def main():
    flashopm.load()
    shapes = [tuple(int(v) for v in s.split(",")) for s in sys.argv[1:]] or [(1, 128, 256, 32, 128), (1, 512, 768, 32, 128)]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for B, S, N, H, D in shapes:
        a = torch.randn(B, S, N, H, device="cuda")
        b = torch.randn(B, S, N, H, device="cuda")
        w = torch.randn(D, H * H, device="cuda") / H
        g = torch.randn(B, N, N, D, device="cuda")
        # three contractions of 2 B N^2 H^2 (S + D) FLOPs each: grad_a, grad_b (dO recomputed), grad_W (O recomputed)
        flop = 3 * 2 * B * N * N * H * H * (S + D)
        row = [f"B{B} S{S} N{N} H{H} D{D}"]
        for name, fn in (
            ("fused highest", lambda: outer_contract_backward_op(g, a, b, w, True, True, 0)),
            ("fused high", lambda: outer_contract_backward_op(g, a, b, w, True, True, 1)),
            ("fused grad_a,b only", lambda: outer_contract_backward_op(g, a, b, w, True, False, 0)),
            ("fused grad_W only", lambda: outer_contract_backward_op(g, a, b, w, False, True, 0)),
            ("pytorch blocks", lambda: contract_outer_blocks_backward(g, a, b, w, True, True)),
        ):
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            ms = time_ms(fn, 5 if name.startswith("pytorch") else 10)
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            row.append(f"{name}: {ms:.3f} ms ({flop / ms / 1e9:.0f} TFLOP/s of the fused count), peak +{peak:.0f} MiB")
        print("\n  ".join(row), flush=True)


if __name__ == "__main__":
    main()
