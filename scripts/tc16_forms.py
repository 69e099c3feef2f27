"""The 16-bit tensor-core kernel's forms side by side on a GPU: mma.sync throughout
(FLASHOPM_TC16_MMA_SYNC=1), phase 1 on wgmma (=phase2), and both phases on wgmma (the default
where the tile allows).  For each shape: bfloat16 inputs and float32 under "medium", wall time per
call (median of CUDA events, L2 flushed) and each form's normwise error against float32 PyTorch on
the same inputs.

    PYTHONPATH=src python scripts/tc16_forms.py [B,S,N,C,H,D ...]
"""
import os
import sys

import torch

import flashopm
from flashopm.bench import time_wall, warm_gpu
from flashopm.testing import Shape, make_problem, reference

FORMS = {"mma.sync": "1", "wgmma phase 1": "phase2", "wgmma both": ""}


def main(argv: list[str]) -> None:
    shapes = [Shape(*map(int, a.split(","))) for a in argv] or [Shape(1, 512, 768, 256, 32, 128),
                                                                Shape(1, 512, 1536, 256, 32, 128)]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    flashopm.load()
    warm_gpu()
    for shape in shapes:
        x, m, p = make_problem(shape, "masked_positions", seed=1)
        for label, dtype, precision in (("bfloat16", torch.bfloat16, None), ("float32 medium", torch.float32, "medium")):
            xd, md = x.to(dtype).cuda(), m.to(dtype).cuda()
            pd = {k: None if v is None else v.to(dtype).cuda() for k, v in p.items()}
            ref = reference(xd, md, pd, dtype=torch.float32) if shape.N <= 768 else None

            def call():
                return flashopm.outer_product_mean(xd, md, pd["ln_weight"], pd["ln_bias"], pd["w_a"], pd["b_a"],
                                                   pd["w_b"], pd["b_b"], pd["w_out"], pd["b_out"], precision=precision)

            for form, env in FORMS.items():
                os.environ["FLASHOPM_TC16_MMA_SYNC"] = env
                out = call()
                err = float("nan") if ref is None else ((out.float() - ref).norm() / ref.norm()).item()
                t = time_wall(call, n=5, warmup=1)
                print(f"{shape}  {label:15s} {form:14s} {t.median_us / 1e3:8.2f} ms  error {err:.3g}", flush=True)
                del out
            os.environ.pop("FLASHOPM_TC16_MMA_SYNC")
            del xd, md, pd, ref
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])
