"""What the A/B scripts share: the extension loaded, the GPU warmed, one header line, then each
shape's problem (msa_repr, mask and parameters, on the GPU) in turn."""
import torch

import flashopm
from flashopm.bench import warm_gpu
from flashopm.testing import Shape, make_problem


def gpu_problems(shapes, header: str, seed: int = 1):
    """Yields (shape, x, mask, params) for each "B,S,N,C,H,D" of `shapes`, after printing
    "<GPU>, torch <version>, <header>"."""
    flashopm.load()
    warm_gpu()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {header}")
    for text in shapes:
        sh = Shape(*map(int, text.split(",")))
        x, m, p = make_problem(sh, "masked_positions", seed=seed)
        yield sh, x.cuda(), m.cuda(), {k: v.cuda() for k, v in p.items()}
