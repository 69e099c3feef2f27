"""Read bandwidth of the GPU for buffers that fit in L2 and for ones that do not: each size read
whole by a sum reduction, repeated back to back, timed with CUDA events (median of 5 batches).
    usage: python scripts/l2_bandwidth.py [MiB ...]"""
import sys

import torch

sizes = [int(a) for a in sys.argv[1:]] or [4, 8, 16, 24, 32, 48, 512]
print(torch.cuda.get_device_name(), "L2", torch.cuda.get_device_properties(0).L2_cache_size >> 20, "MiB")
for mib in sizes:
    x = torch.rand(mib << 18, device="cuda")  # float32: 2^18 per MiB
    reps = max(2, min(200, 4096 // mib))
    for _ in range(3):
        x.sum()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            x.sum()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / reps)
    t = sorted(times)[2]
    print(f"{mib:5d} MiB: {t * 1e3:8.2f} us per read, {x.numel() * 4 / t / 1e9:7.2f} TB/s", flush=True)
