"""Times the outer-first kernels where one phase dominates, to split the time between them.

    python scripts/phase_times.py    (prints one line per case; CUDA events, median of 5)
Phase 1 (the outer product over S) scales with S, phase 2 (the projection to D) with D.
"""
import torch

import flashopm
from flashopm.testing import Shape, make_problem

CASES = [Shape(1, 512, 768, 64, 32, 128), Shape(1, 512, 768, 64, 32, 8), Shape(1, 32, 768, 64, 32, 128)]
for precision in ("highest", "high"):
    for shape in CASES:
        x, m, p = make_problem(shape, "masked_positions", seed=0)
        x, m, p = x.cuda(), m.cuda(), {k: v.cuda() for k, v in p.items()}

        def call():
            return flashopm.outer_product_mean(x, m, p["ln_weight"], p["ln_bias"], p["w_a"], p["b_a"], p["w_b"],
                                               p["b_b"], p["w_out"], p["b_out"], algorithm="outer",
                                               precision=precision)

        call()
        times = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            call()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        t = sorted(times)[2]
        phase1 = 2 * shape.N**2 * shape.H**2 * shape.S
        phase2 = 2 * shape.N**2 * shape.H**2 * shape.D
        print(f"{precision:8s} {shape}: {t:8.3f} ms  phase1 {phase1 / 1e9:6.1f} GFLOP  phase2 {phase2 / 1e9:6.1f} GFLOP"
              f"  {shape.flops / t / 1e9:6.1f} TFLOP/s", flush=True)
