import torch, flashopm
from flashopm.testing import PARAM_ORDER, Shape, make_problem
x, m, p = make_problem(Shape(1, 512, 1536, 256, 32, 128), "masked_positions", seed=1)
x, m = x.cuda().bfloat16(), m.cuda().bfloat16()
p = {k: None if v is None else v.cuda().bfloat16() for k, v in p.items()}
for _ in range(2):
    flashopm.outer_product_mean(x, m, *(p[k] for k in PARAM_ORDER), algorithm="outer")
torch.cuda.synchronize()
