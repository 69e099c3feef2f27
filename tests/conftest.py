import os

import pytest
import torch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def toolchain_or_skip():
    """Skips unless the extension can be built here: a CUDA build of torch, nvcc of its major
    version, and a GPU or TORCH_CUDA_ARCH_LIST.  With FLASHOPM_REQUIRE_BUILD=1 (CI) a missing
    toolchain fails instead."""
    from flashopm import _build

    try:
        _build.check_toolchain()
    except _build.BuildError as exc:
        if os.environ.get("FLASHOPM_REQUIRE_BUILD") == "1":
            raise
        pytest.skip(str(exc))
    if not torch.cuda.is_available() and not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        pytest.skip("no GPU and no TORCH_CUDA_ARCH_LIST")


def poison_output_block(call):
    """Fills with NaN the block of GPU memory that the next `call()`'s output will take, and returns
    its address, for the caller to check that the output landed there.  A first call says how large
    the output's storage is (the small path keeps its workspace past the output's elements, so the
    workspace is poisoned too); the caching allocator hands a freed block of that size out again
    for a request of that size.  All-ones bytes are a NaN in every float type."""
    nbytes = call().untyped_storage().nbytes()
    block = torch.full((nbytes,), 255, dtype=torch.uint8, device="cuda")
    ptr = block.data_ptr()
    del block
    return ptr


def flashopm_kernels(fn):
    """Names of flashopm's CUDA kernels that fn() runs (torch.profiler), one per kernel."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.key for e in prof.key_averages() if "flashopm::" in e.key and e.device_time_total > 0]


def split_form_gpu_or_skip():
    """Builds or loads the extension; skips where the float16 split form does not run (not sm_90)."""
    import flashopm

    flashopm.load()
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the float16 split form runs on sm_90 GPUs")


def call_outer_highest(x, m, p, normalization):
    """flashopm's op on the outer-first path in float32 "highest" (p: the parameters by name)."""
    import flashopm
    from flashopm.testing import PARAM_ORDER

    return flashopm.outer_product_mean(x, m, *(p[k] for k in PARAM_ORDER), algorithm="outer",
                                       normalization=normalization, precision="highest")


def peak_extra(fn):
    """Bytes fn() asks for at its peak beyond what was allocated before (its output included),
    and fn()'s result."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_stats()["requested_bytes.all.current"]
    out = fn()
    torch.cuda.synchronize()
    return torch.cuda.memory_stats()["requested_bytes.all.peak"] - base, out


FP64_FLOOR = 4 * torch.finfo(torch.float32).eps


def check_against_the_references(call, ref32, ref64):
    """call() into a NaN-poisoned block: every element written, allclose(1e-4) against the float32
    reference, normwise error against float64 within twice eager float32's, and the same bits on
    a second call."""
    from flashopm.testing import rel_error

    poison_ptr = poison_output_block(call)
    out = call()
    assert out.data_ptr() == poison_ptr, "the poisoned block was not reused; the check proves nothing"
    assert not out.isnan().any(), "NaN in the output: an element was not written"
    torch.testing.assert_close(out, ref32, atol=1e-4, rtol=1e-4)
    err, err_eager = rel_error(out, ref64), rel_error(ref32, ref64)
    assert err <= max(2 * err_eager, FP64_FLOOR), f"error {err:.3g} against eager float32's {err_eager:.3g}"
    assert torch.equal(out, call()), "two identical calls differ: a race"


def check_form_against_the_references(call, shape, normalization, mask_kind, seed, kernel_marker):
    """A form asked for by a setting (call(x, m, params, normalization) with it set): on fresh
    data it runs (a kernel whose name holds kernel_marker, and no projection kernel of the
    default path), then check_against_the_references."""
    import flashopm
    from flashopm.testing import make_problem, reference

    x, m, p = make_problem(shape, mask_kind, seed=seed)
    xc, mc, pc = x.cuda(), m.cuda(), {k: v.cuda() for k, v in p.items()}
    code = flashopm.ops.NORMALIZATIONS[normalization]
    ref32 = reference(xc, mc, pc, normalization=code)
    ref64 = reference(xc, mc, pc, dtype=torch.float64, normalization=code)
    kernels = flashopm_kernels(lambda: call(xc, mc, pc, normalization))
    assert any(kernel_marker in k for k in kernels), f"the form did not run: {kernels}"
    assert not any("project_rows" in k or "opm_prep" in k for k in kernels), kernels
    check_against_the_references(lambda: call(xc, mc, pc, normalization), ref32, ref64)


def check_deep_msa_within_the_memory_bound(call, seed):
    """(1,1024,256,64,32,128), OpenFold's convention: a and b for all s would be twice the output;
    call's peak extra memory (the output included), after a first call, stays within 1.1x it."""
    from flashopm.testing import Shape, make_problem

    shape = Shape(1, 1024, 256, 64, 32, 128)
    x, m, p = make_problem(shape, "masked_positions", seed=seed)
    xc, mc, pc = x.cuda(), m.cuda(), {k: v.cuda() for k, v in p.items()}
    call(xc, mc, pc, "openfold")
    extra, _ = peak_extra(lambda: call(xc, mc, pc, "openfold"))
    assert extra <= 1.1 * shape.out_bytes, f"peak extra {extra} B vs output {shape.out_bytes} B"


def check_left_out_where_it_cannot_run(call, kernel_marker, seed):
    """msa_dim 17 (rows not 16-byte aligned) or hidden 16: a setting that asks for a form of the
    float16 split kernel at hidden 32 and 16-byte rows is ignored (no kernel whose name holds
    kernel_marker runs) and the result still passes allclose(1e-4)."""
    from flashopm.testing import Shape, make_problem, reference

    for shape in (Shape(1, 40, 33, 17, 32, 64), Shape(1, 40, 33, 64, 16, 64)):
        x, m, p = make_problem(shape, "binary", seed=seed)
        xc, mc, pc = x.cuda(), m.cuda(), {k: v.cuda() for k, v in p.items()}
        kernels = flashopm_kernels(lambda: call(xc, mc, pc, "row"))
        assert not any(kernel_marker in k for k in kernels), kernels
        torch.testing.assert_close(call(xc, mc, pc, "row"), reference(xc, mc, pc), atol=1e-4, rtol=1e-4)


def with_setting(monkeypatch, name, value, call):
    """call with the environment variable name set to value, then set back to what it was."""
    before = os.environ.get(name)

    def wrapped(*args):
        monkeypatch.setenv(name, value)
        try:
            return call(*args)
        finally:
            if before is None:
                monkeypatch.delenv(name)
            else:
                monkeypatch.setenv(name, before)

    return wrapped


def check_large_weights_strided_x_and_no_bias(call, call_default, seed):
    """Weights x10, x a slice of a wider tensor (rows C + 4 floats apart), proj_b without a bias
    (Boltz's): call's error against float64 within twice eager float32's and call_default's
    (not allclose(1e-4): outputs reach ~950 and eager float32 itself is 6.5e-4 off float64), and
    the strided x gives the contiguous copy's bits.  call(x, m, params, normalization)."""
    from flashopm.testing import Shape, make_problem, reference, rel_error

    shape = Shape(2, 40, 29, 60, 32, 64)
    x, m, p = make_problem(shape, "masked_positions", seed=seed, scale=10.0)
    p["b_b"] = None
    pc = {k: None if v is None else v.cuda() for k, v in p.items()}
    wide = torch.randn(shape.B, shape.S, shape.N, shape.C + 4, device="cuda")
    wide[..., : shape.C] = x.cuda()
    xs, mc = wide[..., : shape.C], m.cuda()
    assert not xs.is_contiguous()
    ref32 = reference(xs, mc, pc)
    ref64 = reference(xs, mc, pc, dtype=torch.float64)
    out = call(xs, mc, pc, "row")
    err = rel_error(out, ref64)
    assert err <= max(2 * rel_error(ref32, ref64), FP64_FLOOR), err
    assert err <= max(2 * rel_error(call_default(xs, mc, pc, "row"), ref64), FP64_FLOOR), err
    assert torch.equal(out, call(xs.contiguous(), mc, pc, "row"))


def check_rows_far_from_zero_and_constant_rows(call, seed):
    """Rows whose mean is 600 standard deviations from zero and constant rows (variance 0:
    LayerNorm gives its bias): the error against float64 within twice eager float32's (whose own
    rounding of x - mean is the limit here, so no allclose against it)."""
    from flashopm.testing import Shape, make_problem

    shape = Shape(1, 45, 21, 64, 32, 32)
    x, m, p = make_problem(shape, "masked_positions", seed=seed)
    x = 30.0 + 0.05 * x
    x[:, ::7, 3] = 7.0
    x[:, 5, ::4] = -2.5
    check_finite_within_twice_eager(call, x.cuda(), m.cuda(), {k: v.cuda() for k, v in p.items()})


def check_finite_within_twice_eager(call, x, m, p):
    """call(x, m, p, "row") finite, and its error against float64 within twice eager float32's (no
    allclose against eager, whose own rounding is the limit on such inputs)."""
    from flashopm.testing import reference, rel_error

    ref32 = reference(x, m, p)
    ref64 = reference(x, m, p, dtype=torch.float64)
    out = call(x, m, p, "row")
    assert out.isfinite().all()
    err, err_eager = rel_error(out, ref64), rel_error(ref32, ref64)
    assert err <= max(2 * err_eager, FP64_FLOOR), f"error {err:.3g} against eager float32's {err_eager:.3g}"


@pytest.fixture(autouse=True)
def _exact_fp32_matmul():
    """References run in true fp32 (no TF32), whatever the process default is."""
    prev = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = prev


def f16_backward_form_or_skip(monkeypatch):
    """FLASHOPM_BWD_FORM=f16_split for the calls that follow (the fused backward's contractions in
    their float16 split forms, which run by default only on large problems); skips where those
    forms cannot run (no sm_90 GPU, or no sm_90a code in the extension)."""
    import flashopm
    from flashopm.ops import outer_contract_backward_op

    flashopm.load()
    monkeypatch.setenv("FLASHOPM_BWD_FORM", "f16_split")
    g, a, b, w = (torch.randn(*s, device="cuda") for s in ((1, 3, 4, 5), (1, 2, 3, 32), (1, 2, 4, 32), (5, 1024)))
    try:
        outer_contract_backward_op(g, a, b, w, True, True)
    except RuntimeError as exc:
        if "needs hidden_dim 32" not in str(exc):
            raise
        pytest.skip(str(exc))
