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
