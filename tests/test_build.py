"""The CUDA source compiles with load_inline and registers the op's CUDA kernel.

Runs wherever torch is a CUDA build and nvcc is found, GPU or not (CI builds it on a CPU machine
with TORCH_CUDA_ARCH_LIST set).
"""
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashopm import _build

from conftest import requires_cuda, toolchain_or_skip


def test_gencode_flags():
    assert _build.gencode_flags(["9.0"]) == ["-gencode=arch=compute_90a,code=sm_90a", "-DFLASHOPM_SM90A"]
    assert _build.gencode_flags(["8.0"]) == ["-gencode=arch=compute_80,code=sm_80"]
    assert _build.gencode_flags(["8.0", "9.0a+PTX"]) == [
        "-gencode=arch=compute_80,code=sm_80",
        "-gencode=arch=compute_90a,code=sm_90a",
        "-gencode=arch=compute_90,code=compute_90",
        "-DFLASHOPM_SM90A",
    ]
    assert _build.gencode_flags(["8.0+PTX"]) == [
        "-gencode=arch=compute_80,code=sm_80",
        "-gencode=arch=compute_80,code=compute_80",
    ]
    assert _build.gencode_flags(["10.0", "12.0"]) == [
        "-gencode=arch=compute_100,code=sm_100",
        "-gencode=arch=compute_120,code=sm_120",
    ]
    with pytest.raises(_build.BuildError, match="cannot read architecture 'sm90'"):
        _build.gencode_flags(["sm90"])


@pytest.mark.parametrize("archs, capability, expected", [
    (["9.0"], (9, 0), (90, "sass")),
    (["9.0"], (10, 0), None),  # sm_90a machine code runs on 9.0 alone
    (["9.0+PTX"], (10, 0), (90, "ptx")),
    (["8.0"], (8, 6), (80, "sass")),  # sm_80 machine code runs on 8.x
    (["8.0", "8.6"], (8, 6), (86, "sass")),
    (["8.0", "8.6"], (8, 0), (80, "sass")),
    (["8.6"], (8, 0), None),
    (["8.6+PTX"], (8, 0), None),  # PTX newer than the GPU
    (["8.0"], (9, 0), None),
    (["8.0+PTX"], (9, 0), (80, "ptx")),  # what the sm_80 forms run on an H100 or H200
    (["8.0+PTX", "9.0"], (9, 0), (90, "sass")),
    (["8.0+PTX", "8.6+PTX"], (12, 0), (86, "ptx")),
    (["10.0a"], (10, 3), None),
    (["10.0"], (10, 3), (100, "sass")),
])
def test_code_for_device(archs, capability, expected):
    assert _build.code_for_device(archs, capability) == expected


def test_flashopm_arch_list_comes_before_torch_s(monkeypatch):
    # (targets older than 8.0 in torch's list are left out: the kernels need cp.async and the
    # TF32 MMAs; nvcc refuses those there)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "7.0 7.5 8.0 8.6 8.9 9.0+PTX")
    monkeypatch.delenv("FLASHOPM_CUDA_ARCH_LIST", raising=False)
    assert _build.arch_list() == ["8.0", "8.6", "8.9", "9.0+PTX"]
    monkeypatch.setenv("FLASHOPM_CUDA_ARCH_LIST", "9.0")
    assert _build.arch_list() == ["9.0"]
    monkeypatch.setenv("FLASHOPM_CUDA_ARCH_LIST", "  ")
    assert _build.arch_list() == ["8.0", "8.6", "8.9", "9.0+PTX"]


def test_targets_older_than_the_kernels_need_are_refused(monkeypatch):
    monkeypatch.setenv("FLASHOPM_CUDA_ARCH_LIST", "7.5;9.0")
    with pytest.raises(_build.BuildError, match=r"FLASHOPM_CUDA_ARCH_LIST names 7\.5; .* 8\.0 or newer"):
        _build.arch_list()
    monkeypatch.delenv("FLASHOPM_CUDA_ARCH_LIST")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "7.0 7.5")
    with pytest.raises(_build.BuildError, match=r"names no GPU of compute capability 8\.0 or newer"):
        _build.arch_list()
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla T4")
    with pytest.raises(_build.BuildError, match=r"Tesla T4\) has compute capability 7\.5; .* need 8\.0 or newer"):
        _build.arch_list()


def test_every_source_file_is_hashed():
    """A file of csrc/ left out of SOURCES would not change the cache name: stale builds."""
    on_disk = {p.name for p in _build.CSRC_DIR.iterdir() if p.suffix in (".h", ".cuh", ".cu", ".cpp")}
    assert on_disk == set(_build.SOURCES)


def test_extension_name_hashes_sources_and_arch():
    src = _build.read_sources()
    base = _build.extension_name(src, ["9.0"])
    assert base == _build.extension_name(dict(src), ["9.0"])
    assert base != _build.extension_name(src, ["8.0"])
    changed = dict(src)
    changed["opm_launch.cu"] += "\n// changed\n"
    assert base != _build.extension_name(changed, ["9.0"])


def test_split_compile_is_an_option_with_its_own_cache_name(monkeypatch):
    src = _build.read_sources()
    monkeypatch.delenv("FLASHOPM_SPLIT_COMPILE", raising=False)
    base = _build.extension_name(src, ["9.0"])
    assert "--split-compile=0" not in _build.nvcc_flags()
    monkeypatch.setenv("FLASHOPM_SPLIT_COMPILE", "1")
    assert "--split-compile=0" in _build.nvcc_flags()
    assert _build.extension_name(src, ["9.0"]) != base


def test_import_compiles_nothing():
    import subprocess
    import sys

    code = "import flashopm, flashopm._build as b; assert not b.is_loaded(); print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok" and "compiling" not in out.stderr


def test_cuda_extension_builds_and_registers_the_op():
    toolchain_or_skip()
    path = _build.load()
    assert os.path.exists(path)
    assert torch._C._dispatch_has_kernel_for_dispatch_key("flashopm::outer_product_mean", "CUDA")
    assert _build.is_loaded()


@requires_cuda
def test_the_kernels_use_what_the_code_the_driver_loaded_has():
    """The extension reads the architecture of the code the driver loaded for the GPU (the
    build's machine code for it, or PTX of an older target that the driver compiled) and keeps the
    forms that need newer instructions off: the same answer as the build list gives.  Built with
    FLASHOPM_CUDA_ARCH_LIST="8.0+PTX" on an sm_90 GPU, every test then runs the sm_80 forms."""
    toolchain_or_skip()
    _build.load()
    x = torch.empty(1, device="cuda")
    major, minor, arch, wgmma, _, _ = torch.ops.flashopm._device_code(x)
    assert (major, minor) == torch.cuda.get_device_capability()
    expected = _build.code_for_device(_build.arch_list(), (major, minor))
    assert expected is not None
    assert arch == expected[0]
    sm90a = "-DFLASHOPM_SM90A" in _build.gencode_flags(_build.arch_list())
    assert wgmma == int(sm90a and (major, minor) == (9, 0) and arch == 90)


def test_a_built_extension_loads_without_the_toolkit():
    """A library in the cache is imported as it is: no nvcc, ninja or build step, so that a cache
    built on a machine with the toolkit serves machines without one."""
    toolchain_or_skip()
    _build.load()  # built (or found) here first
    code = (
        "import flashopm._build as b, torch\n"
        "def missing(*a, **k):\n"
        "    raise b.BuildError('no toolkit here')\n"
        "b.cuda_home = b.check_toolchain = b._load_inline = missing\n"
        "print(b.load())\n"
        "assert torch._C._dispatch_has_kernel_for_dispatch_key('flashopm::outer_product_mean', 'CUDA')\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith(".so") and "compiling" not in out.stderr


def test_nvcc_major_mismatch_is_reported(monkeypatch):
    if torch.version.cuda is None:
        pytest.skip("needs a CUDA build of torch")
    monkeypatch.setattr(_build, "cuda_home", lambda: "/opt/some-cuda")
    monkeypatch.setattr(_build, "nvcc_version", lambda home: (1, 0))
    with pytest.raises(_build.BuildError, match=r"nvcc at /opt/some-cuda is CUDA 1\.0 but torch .* CUDA"):
        _build.check_toolchain()


def _cuobjdump():
    """cuobjdump from the toolkit, or from triton's wheel (which carries one where a toolkit does not)."""
    candidates = [Path(_build.cuda_home(), "bin", "cuobjdump")]
    try:
        import triton.backends.nvidia as triton_nvidia

        candidates.append(Path(triton_nvidia.__file__).parent / "bin" / "cuobjdump")
    except ImportError:
        pass
    for path in candidates:
        if path.exists():
            return path
    pytest.skip("no cuobjdump (neither the toolkit nor triton has one)")


def test_small_path_kernels_fit_one_sm_together():
    """The small path's second kernel starts as the first kernel's programmatic dependent and stages
    W while the first kernel runs, but only if one block of each fits an SM's 64K registers: 512
    threads of the chained form (up to three m tiles of j) or of the staged form, beside 128 of the
    first kernel (one row per warp, at most two projection outputs per lane).  Registers are
    allocated to a warp in units of 8 per thread.  (The chained form's one-launch kernel,
    opm_small_f16_chain_fused_kernel, has no first kernel beside it.)"""
    toolchain_or_skip()
    path = _build.load()
    out = subprocess.run([str(_cuobjdump()), "-res-usage", path], capture_output=True, text=True, check=True).stdout
    regs = {name: int(r) for name, r in re.findall(r"Function (\S+):\s*\n\s*REG:(\d+)", out)}
    second = {n: r for n, r in regs.items()
              if re.match(r"_ZN8flashopm26opm_small_f16_chain_kernelILi[123]ELb[01]EEEvNS_11SmallTcArgsE$", n)
              or n == "_ZN8flashopm20opm_small_f16_kernelENS_11SmallTcArgsE"}
    first = {n: r for n, r in regs.items() if re.match(r"_ZN8flashopm15opm_prep_kernelILi[12]ELi1ELb0E", n)}
    assert len(second) == 7 and first, (sorted(second), sorted(first))
    alloc = lambda r: math.ceil(r / 8) * 8  # noqa: E731
    for name_2, r2 in second.items():
        for name_1, r1 in first.items():
            assert alloc(r2) * 512 + alloc(r1) * 128 <= 65536, (name_2, r2, name_1, r1)
