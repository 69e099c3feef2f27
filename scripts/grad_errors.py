"""Each gradient of a training step, flashopm and eager PyTorch against a float64 reference, and
against each other with the bench's allclose(atol=rtol=1e-4): which gradient fails that check,
and whose error it is.

    python scripts/grad_errors.py [B,S,N,C,H,D ...]   (default: the crop and (1,512,768,256,32,128))

Per gradient: normwise error against float64 of eager and of flashopm, the largest
|flashopm - eager| / (1e-4 + 1e-4 |eager|) (allclose passes at <= 1), the same ratio for eager and
for flashopm against float64, and the gradient's largest magnitude.
"""
import sys

import torch

import flashopm
from flashopm.reference import outer_product_mean_reference
from flashopm.testing import Shape, make_problem


def allclose_ratio(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / (1e-4 + 1e-4 |b|): allclose(a, b, 1e-4, 1e-4) holds iff this is <= 1."""
    a, b = a.double(), b.double()
    return float(((a - b).abs() / (1e-4 + 1e-4 * b.abs())).max())


def normwise(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm().clamp_min(1e-300))


def grads_of(fn, x, params: dict, grad_out, dtype):
    leaves = {"msa_repr": x.detach().to(dtype).requires_grad_()}
    leaves.update({k: v.detach().to(dtype).requires_grad_() for k, v in params.items()})
    out = fn(leaves)
    return dict(zip(leaves, torch.autograd.grad(out, list(leaves.values()), grad_out.to(dtype))))


def main():
    torch.backends.cuda.matmul.allow_tf32 = False
    flashopm.load()
    shapes = [Shape(*(int(v) for v in s.split(","))) for s in sys.argv[1:]] or [
        Shape(1, 128, 256, 256, 32, 128), Shape(1, 512, 768, 256, 32, 128)]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for sh in shapes:
        x, m, p = make_problem(sh, "masked_positions", seed=0)
        x, m = x.cuda(), m.cuda()
        p = {k: v.cuda() for k, v in p.items() if v is not None}
        grad_out = torch.randn(sh.B, sh.N, sh.N, sh.D, device="cuda", generator=torch.Generator("cuda").manual_seed(1))

        def ref_fn(mask):
            return lambda L: outer_product_mean_reference(
                L["msa_repr"], mask, L["ln_weight"], L["ln_bias"], L["w_a"], L["b_a"], L["w_b"], L["b_b"],
                L["w_out"], L["b_out"], 1e-5, 0, 1e-3)

        def new_fn(L):
            return flashopm.outer_product_mean(L["msa_repr"], m, L["ln_weight"], L["ln_bias"], L["w_a"], L["b_a"],
                                               L["w_b"], L["b_b"], L["w_out"], L["b_out"], ln_eps=1e-5)

        g64 = grads_of(ref_fn(m.double()), x, p, grad_out, torch.float64)
        g_eager = grads_of(ref_fn(m), x, p, grad_out, torch.float32)
        g_new = grads_of(new_fn, x, p, grad_out, torch.float32)
        print(f"\n{sh}")
        print(f"{'gradient':>10} {'err64 eager':>12} {'err64 ours':>12} {'ours~eager':>11} {'eager~64':>9} "
              f"{'ours~64':>9} {'max |g64|':>10}")
        for name in g64:
            r64 = g64[name]
            print(f"{name:>10} {normwise(g_eager[name], r64):12.3e} {normwise(g_new[name], r64):12.3e} "
                  f"{allclose_ratio(g_new[name], g_eager[name]):11.3f} {allclose_ratio(g_eager[name], r64):9.3f} "
                  f"{allclose_ratio(g_new[name], r64):9.3f} {float(r64.abs().max()):10.3e}", flush=True)
        del g64, g_eager, g_new
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
