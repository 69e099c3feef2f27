"""flashopm::outer_product_mean_rows, the rows of the outer-product mean from projections (the
residue-sharded OPM's local contraction): against slices of the full reference, on the CPU and
on a GPU (both contraction kernels, every normalisation), gradients, opcheck and bad input."""
import pytest
import torch

import flashopm
from conftest import requires_cuda
from flashopm.functional import outer_product_mean_rows
from flashopm.reference import contract_outer_blocks, masked_projections, output_divisor
from flashopm.testing import Shape, make_problem, rel_error

NORMS = ["row", "openfold", "boltz"]
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]


def _problem(shape, mask_kind, seed, device, dtype=torch.float32):
    x, m, p = make_problem(shape, mask_kind, seed=seed)
    p = {k: v.to(device, dtype) for k, v in p.items()}
    x, m = x.to(device, dtype), m.to(device)
    mf = m.to(dtype)
    a, b = masked_projections(x, mf, p["ln_weight"], p["ln_bias"], p["w_a"], p["b_a"], p["w_b"], p["b_b"])
    return a, b, m, p


def _full(a, b, m, p, normalization, dtype=torch.float64):
    """All rows, from the projections, in `dtype` (the reference the rows must match)."""
    kind = flashopm.ops.NORMALIZATIONS[normalization]
    a, b, mf = a.to(dtype), b.to(dtype), m.to(dtype)
    acc = contract_outer_blocks(a, b, p["w_out"].to(dtype))
    den = output_divisor(mf, mf, kind, 1e-3)
    bias = p["b_out"].to(dtype)
    return (acc + bias) / den if kind == 1 else acc / den + bias


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("normalization", NORMS)
@pytest.mark.parametrize("shape", [Shape(2, 5, 13, 9, 8, 6), Shape(1, 3, 11, 7, 5, 4), Shape(1, 130, 40, 16, 32, 33)],
                         ids=str)
def test_rows_match_the_full_reference(device, normalization, shape):
    a, b, m, p = _problem(shape, "masked_positions", seed=11, device=device)
    full = _full(a, b, m, p, normalization)
    full32 = _full(a, b, m, p, normalization, torch.float32)
    N = shape.N
    for r0, r1 in [(0, N), (0, 1), (3, 8), (N - 1, N), (N // 2, N)]:
        poison_ptr = None
        if device == "cuda":  # the output must reuse this NaN-filled block: every element is written
            poison = torch.full((shape.B * (r1 - r0) * N * shape.D,), float("nan"), device=device)
            poison_ptr = poison.data_ptr()
            del poison
        out = outer_product_mean_rows(a[:, :, r0:r1], b, m, r0, p["w_out"], p["b_out"], normalization=normalization)
        assert poison_ptr is None or out.data_ptr() == poison_ptr
        assert out.shape == (shape.B, r1 - r0, N, shape.D)
        assert not out.isnan().any()
        torch.testing.assert_close(out, full32[:, r0:r1], atol=1e-4, rtol=1e-4)
        err, eager_err = rel_error(out, full[:, r0:r1]), rel_error(full32[:, r0:r1], full[:, r0:r1])
        assert err <= 2 * eager_err + 4 * torch.finfo(torch.float32).eps


@pytest.mark.parametrize("device", DEVICES)
def test_rows_bool_mask_without_bias(device):
    shape = Shape(2, 4, 9, 6, 8, 5)
    a, b, m, p = _problem(shape, "bool", seed=12, device=device)
    p["b_out"] = None
    out = outer_product_mean_rows(a[:, :, 2:6], b, m, 2, p["w_out"], None, normalization="boltz")
    mf = m.double()
    expect = contract_outer_blocks(a.double(), b.double(), p["w_out"].double()) / output_divisor(mf, mf, 2, 1e-3)
    torch.testing.assert_close(out.double(), expect[:, 2:6], atol=1e-4, rtol=1e-4)


def test_rows_gradcheck_float64():
    shape = Shape(2, 3, 6, 5, 3, 4)
    a, b, m, p = _problem(shape, "fractional", seed=13, device="cpu", dtype=torch.float64)
    a = a[:, :, 1:4].detach().clone().requires_grad_()
    b = b.detach().requires_grad_()
    w, bo = p["w_out"].requires_grad_(), p["b_out"].requires_grad_()
    for normalization in NORMS:
        assert torch.autograd.gradcheck(
            lambda a, b, w, bo: outer_product_mean_rows(a, b, m.double(), 1, w, bo, normalization=normalization),
            (a, b, w, bo))


@pytest.mark.parametrize("device", DEVICES)
def test_rows_opcheck(device):
    if device == "cuda":
        flashopm.load()
    shape = Shape(2, 3, 7, 5, 8, 3)
    a, b, m, p = _problem(shape, "masked_positions", seed=14, device=device)
    a = a[:, :, 2:5].detach().clone().requires_grad_()
    w = p["w_out"].requires_grad_()
    torch.library.opcheck(torch.ops.flashopm.outer_product_mean_rows.default, (a, b, m, 2, w, p["b_out"], 1, 1e-3))


@requires_cuda
@pytest.mark.parametrize("normalization", NORMS)
def test_rows_gradients_on_gpu(normalization):
    shape = Shape(1, 6, 12, 8, 8, 5)
    a, b, m, p = _problem(shape, "masked_positions", seed=15, device="cuda")
    leaves = [a[:, :, 4:9].detach().clone(), b.detach().clone(), p["w_out"], p["b_out"]]
    g = torch.randn(1, 5, 12, 5, device="cuda")
    grads = {}
    for dev in ("cuda", "cpu"):
        t = [v.detach().to(dev).double() if dev == "cpu" else v.detach().clone() for v in leaves]
        t = [v.requires_grad_() for v in t]
        out = outer_product_mean_rows(t[0], t[1], m.to(dev), 4, t[2], t[3], normalization=normalization)
        grads[dev] = torch.autograd.grad(out, t, g.to(dev, out.dtype))
    for ours, ref in zip(grads["cuda"], grads["cpu"]):
        torch.testing.assert_close(ours.double().cpu(), ref, atol=1e-4, rtol=1e-4)


@requires_cuda
def test_rows_precision_high_and_fma_path_agree():
    # hidden 8: tensor cores ("highest" and "high"); hidden 5: the CUDA-core kernel
    for H in (8, 5):
        shape = Shape(1, 20, 24, 8, H, 7)
        a, b, m, p = _problem(shape, "masked_positions", seed=16, device="cuda")
        full = _full(a, b, m, p, "row")
        for precision, tol in (("highest", 1e-4), ("high", 5e-3)):
            out = outer_product_mean_rows(a[:, :, 5:20], b, m, 5, p["w_out"], p["b_out"], precision=precision)
            torch.testing.assert_close(out.double(), full[:, 5:20], atol=tol, rtol=tol)


requires_sm90 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="the warpgroup-MMA forms need an sm_90 GPU",
)


@requires_sm90
@pytest.mark.parametrize("form", ["wgmma", "wgmma_tf32", "mma_sync"])
@pytest.mark.parametrize("precision", ["highest", "high"])
def test_rows_tensor_core_forms(form, precision, monkeypatch):
    """Each form of the float32 tensor-core kernel for the rows: on wgmma from K-major copies of a
    and b (the float16 split form under "highest" by default, 3xTF32 with wgmma_tf32, TF32 under
    "high"), or mma.sync from a and b as given. Float32's bars under "highest", TF32's tolerance
    under "high", every element written, for blocks of rows cut at tile edges and S across chunks."""
    monkeypatch.setenv("FLASHOPM_TC_FORM", form)
    shape = Shape(2, 45, 33, 16, 16, 20)
    a, b, m, p = _problem(shape, "masked_positions", seed=17, device="cuda")
    full = _full(a, b, m, p, "openfold")
    full32 = _full(a, b, m, p, "openfold", torch.float32)
    N = shape.N
    for r0, r1 in [(0, N), (5, 6), (7, 30)]:
        poison = torch.full((shape.B * (r1 - r0) * N * shape.D,), float("nan"), device="cuda")
        poison_ptr = poison.data_ptr()
        del poison
        out = outer_product_mean_rows(a[:, :, r0:r1], b, m, r0, p["w_out"], p["b_out"], normalization="openfold",
                                      precision=precision)
        assert out.data_ptr() == poison_ptr
        assert not out.isnan().any()
        if precision == "highest":
            torch.testing.assert_close(out, full32[:, r0:r1], atol=1e-4, rtol=1e-4)
            err, eager_err = rel_error(out, full[:, r0:r1]), rel_error(full32[:, r0:r1], full[:, r0:r1])
            assert err <= 2 * eager_err + 4 * torch.finfo(torch.float32).eps
        else:
            torch.testing.assert_close(out.double(), full[:, r0:r1], atol=5e-3, rtol=5e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_rows_bad_input(device):
    shape = Shape(1, 2, 5, 4, 3, 2)
    a, b, m, p = _problem(shape, "ones", seed=17, device=device)
    w = p["w_out"]
    if device == "cuda":
        flashopm.load()
    with pytest.raises((ValueError, RuntimeError), match=r"rows \[row_offset, row_offset \+ N_rows\) = \[4, 7\)"):
        outer_product_mean_rows(a[:, :, :3], b, m, 4, w, None)
    with pytest.raises((ValueError, RuntimeError), match="a must have shape"):
        outer_product_mean_rows(a[:, :1, :3], b, m, 0, w, None)
    with pytest.raises((ValueError, RuntimeError), match="mask must have shape"):
        outer_product_mean_rows(a, b, m[:, :, :4], 0, w, None)
    with pytest.raises((ValueError, RuntimeError), match="out_proj weight must have shape"):
        outer_product_mean_rows(a, b, m, 0, w[:, :4], None)


def test_contract_outer_blocks_is_blocking_invariant():
    a, b = torch.randn(2, 3, 7, 4, dtype=torch.float64), torch.randn(2, 3, 9, 4, dtype=torch.float64)
    w = torch.randn(5, 16, dtype=torch.float64)
    torch.testing.assert_close(contract_outer_blocks(a, b, w, chunk_elems=1), contract_outer_blocks(a, b, w))
