"""Just-in-time build of the CUDA extension with `torch.utils.cpp_extension.load_inline`.

The build is lazy (first CUDA call), cached on disk under a name that hashes the sources, the
torch and CUDA versions and the target architectures, and safe when several processes build at
once (an exclusive file lock around the build).  Loading the library registers the CUDA kernel of
`torch.ops.flashopm.outer_product_mean` with the dispatcher; the schema itself lives in `ops.py`.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import torch

CSRC_DIR = Path(__file__).resolve().parent / "csrc"
SOURCES = ("opm_params.h", "opm_kernels.cuh", "opm_mma.cuh", "opm_small_kernel.cuh", "opm_small_tc_kernel.cuh",
           "opm_small_f16_kernel.cuh", "opm_small_f16_chain_kernel.cuh", "opm_tc_kernel.cuh", "opm_tc16_kernel.cuh",
           "opm_backward_kernel.cuh", "opm_ln_backward_kernel.cuh", "opm_launch.cu", "opm_op_handles.h", "opm_api.cpp",
           "opm_backward_api.cpp", "opm_autograd.cpp", "opm_python.cpp")
NVCC_FLAGS = ("-O3", "-lineinfo", "--expt-relaxed-constexpr")

_lock = threading.Lock()
_library_path: str | None = None  # set once the extension is loaded
# The extension module's `outer_product_mean`: torch.ops.flashopm.outer_product_mean without the
# schema's argument parsing, NotImplemented where a call needs it (csrc/opm_python.cpp).  None
# until the extension is loaded.
op_entry = None
# Its `outer_product_mean_modules`: the same with the parameters read from a module's submodules.
modules_entry = None
_module = None  # the extension module itself


class BuildError(RuntimeError):
    """The CUDA extension could not be built or loaded."""


def is_loaded() -> bool:
    return _library_path is not None


def load_op_entry():
    """`op_entry`, building and loading the extension first if needed."""
    load()
    return op_entry


def load_modules_entry():
    """`modules_entry`, building and loading the extension first if needed."""
    load()
    return modules_entry


def extension():
    """The extension module (csrc/opm_python.cpp), building and loading it first if needed."""
    load()
    return _module


def cache_root() -> Path:
    """Where built extensions live: $FLASHOPM_CACHE_DIR, else ~/.cache/flashopm."""
    env = os.environ.get("FLASHOPM_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "flashopm"


# The oldest GPUs the kernels run on: every kernel family copies with cp.async and multiplies on
# the tensor cores' TF32 or 16-bit MMAs, which sm_80 introduced.
MIN_CAPABILITY = (8, 0)


def arch_list() -> list[str]:
    """Target architectures: $FLASHOPM_CUDA_ARCH_LIST if set (flashopm's own, for environments
    whose TORCH_CUDA_ARCH_LIST names many GPUs: each target adds minutes of build), else
    $TORCH_CUDA_ARCH_LIST if set, less the targets older than MIN_CAPABILITY, else the current
    device's capability."""
    oldest = ".".join(map(str, MIN_CAPABILITY))
    own = os.environ.get("FLASHOPM_CUDA_ARCH_LIST", "").strip()
    if own:
        archs = [a for a in re.split(r"[;\s]+", own) if a]
        old = [a for a in archs if parse_arch(a)[:2] < MIN_CAPABILITY]
        if old:
            raise BuildError(f"flashopm: FLASHOPM_CUDA_ARCH_LIST names {', '.join(old)}; "
                             f"flashopm's kernels need compute capability {oldest} or newer")
        return archs
    torchs = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if torchs:
        archs = [a for a in re.split(r"[;\s]+", torchs) if a]
        kept = [a for a in archs if parse_arch(a)[:2] >= MIN_CAPABILITY]
        if not kept:
            raise BuildError(f"flashopm: TORCH_CUDA_ARCH_LIST ({torchs}) names no GPU of compute capability "
                             f"{oldest} or newer, which flashopm's kernels need; set FLASHOPM_CUDA_ARCH_LIST")
        return kept
    if not torch.cuda.is_available():
        raise BuildError(
            "flashopm: no CUDA device is visible and TORCH_CUDA_ARCH_LIST is not set; "
            "set it (e.g. TORCH_CUDA_ARCH_LIST=9.0) to build without a GPU"
        )
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < MIN_CAPABILITY:
        raise BuildError(f"flashopm: this GPU ({torch.cuda.get_device_name()}) has compute capability "
                         f"{major}.{minor}; flashopm's CUDA kernels need {oldest} or newer")
    return [f"{major}.{minor}"]


def parse_arch(arch: str) -> tuple[int, int, str, bool]:
    """'8.6' -> (8, 6, '', False); '9.0' -> (9, 0, 'a', False): 9.0 is always built as sm_90a;
    '10.0a+PTX' -> (10, 0, 'a', True)."""
    m = re.fullmatch(r"(\d+)\.(\d+)([af]?)(\+PTX)?", arch)
    if not m:
        raise BuildError(f"flashopm: cannot read architecture {arch!r} in the architecture list")
    major, minor = int(m.group(1)), int(m.group(2))
    suffix = m.group(3) or ("a" if (major, minor) == (9, 0) else "")
    return major, minor, suffix, m.group(4) is not None


def gencode_flags(archs: list[str]) -> list[str]:
    """'8.0' -> sm_80 machine code; '9.0' and '9.0a' -> sm_90a (the warpgroup MMAs exist only in
    the arch-specific target, whose code runs on every compute capability 9.0 GPU); '+PTX' adds
    PTX for the portable target.  With sm_90a code the kernels are told so (FLASHOPM_SM90A)."""
    flags = []
    for arch in archs:
        major, minor, suffix, ptx = parse_arch(arch)
        cc = f"{major}{minor}"
        flags.append(f"-gencode=arch=compute_{cc}{suffix},code=sm_{cc}{suffix}")
        if ptx:
            flags.append(f"-gencode=arch=compute_{cc},code=compute_{cc}")
    if any("code=sm_90a" in f for f in flags):
        flags.append("-DFLASHOPM_SM90A")
    return flags


def code_for_device(archs: list[str], capability: tuple[int, int]) -> tuple[int, str] | None:
    """What the driver runs on a GPU of `capability` from a build for `archs`: (the target as
    __CUDA_ARCH__ / 10, "sass" for machine code or "ptx" for PTX it compiles), or None where the
    build holds nothing that GPU runs.  Machine code for X.Y runs on X.Z for Z >= Y, that of an
    arch-specific target (X.Ya, 9.0 among them) on X.Y alone; without any, the newest PTX not newer
    than the GPU.  Where the target is below the GPU's own, the kernels lack what it adds (sm_90's
    clusters and programmatic launches, sm_90a's warpgroup MMAs) and flashopm runs its other forms."""
    major, minor = capability
    sass, ptx = [], []
    for arch in archs:
        a_major, a_minor, suffix, with_ptx = parse_arch(arch)
        runs = a_major == major and (a_minor == minor if suffix == "a" else a_minor <= minor)
        if runs:
            sass.append(10 * a_major + a_minor)
        if with_ptx and (a_major, a_minor) <= (major, minor):
            ptx.append(10 * a_major + a_minor)
    if sass:
        return max(sass), "sass"
    if ptx:
        return max(ptx), "ptx"
    return None


def cuda_home() -> str:
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None or not Path(CUDA_HOME, "bin", "nvcc").exists():
        raise BuildError(
            "flashopm: the CUDA toolkit was not found; set CUDA_HOME to its folder "
            "(the one holding bin/nvcc, e.g. /usr/local/cuda)"
        )
    return CUDA_HOME


def nvcc_version(home: str) -> tuple[int, int]:
    out = subprocess.run(
        [str(Path(home, "bin", "nvcc")), "--version"], capture_output=True, text=True, check=False
    ).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    if not m:
        raise BuildError(f"flashopm: could not read the version of {home}/bin/nvcc:\n{out}")
    return int(m.group(1)), int(m.group(2))


def check_toolchain() -> str:
    """Returns CUDA_HOME after checking that nvcc's major version matches torch's CUDA."""
    if torch.version.cuda is None:
        raise BuildError(
            f"flashopm: this torch ({torch.__version__}) is a CPU-only build; "
            "the CUDA kernels need a CUDA build of torch"
        )
    home = cuda_home()
    nv_major, nv_minor = nvcc_version(home)
    torch_major = int(torch.version.cuda.split(".")[0])
    if nv_major != torch_major:
        raise BuildError(
            f"flashopm: nvcc at {home} is CUDA {nv_major}.{nv_minor} but torch {torch.__version__} "
            f"was built with CUDA {torch.version.cuda}; the major versions must match "
            "(point CUDA_HOME at a matching toolkit)"
        )
    return home


def read_sources() -> dict[str, str]:
    return {name: (CSRC_DIR / name).read_text() for name in SOURCES}


def nvcc_flags() -> list[str]:
    """NVCC_FLAGS, and --split-compile=0 where FLASHOPM_SPLIT_COMPILE=1: the device code optimised on
    every CPU core (107 against 72 s on two cores; the machine code of some kernels differs, so it
    stays an option until their speed is compared)."""
    flags = list(NVCC_FLAGS)
    if os.environ.get("FLASHOPM_SPLIT_COMPILE") == "1":
        flags.append("--split-compile=0")
    return flags


def extension_name(sources: dict[str, str], archs: list[str]) -> str:
    h = hashlib.sha256()
    for name, text in sorted(sources.items()):
        h.update(name.encode())
        h.update(text.encode())
    for part in (torch.__version__, str(torch.version.cuda), ";".join(archs), " ".join(nvcc_flags())):
        h.update(part.encode())
    return f"flashopm_ext_{h.hexdigest()[:16]}"


def load(verbose: bool = False) -> str:
    """Builds (if needed) and loads the extension; returns the path of the shared library.

    A library already in the cache is imported as it is, with no toolkit: a cache built where
    nvcc is (`python -m flashopm build`, FLASHOPM_CACHE_DIR on a shared file system) serves
    machines without one that have the same torch."""
    global _library_path, op_entry, modules_entry, _module
    with _lock:
        if _library_path is not None:
            return _library_path
        if torch.version.cuda is None:
            check_toolchain()  # says that this torch is a CPU-only build
        archs = arch_list()
        sources = read_sources()
        name = extension_name(sources, archs)
        build_dir = cache_root() / name
        build_dir.mkdir(parents=True, exist_ok=True)
        library = build_dir / f"{name}.so"
        with open(build_dir / "flashopm.lock", "w") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            try:
                if library.exists():
                    try:
                        module = _import_built(name, library)
                    except ImportError as exc:
                        raise BuildError(f"flashopm: the built extension {library} could not be loaded ({exc}); "
                                         f"delete {build_dir} to build it again") from exc
                else:
                    check_toolchain()
                    print(
                        f"flashopm: compiling the CUDA extension for sm {','.join(archs)} "
                        f"into {build_dir} (once; a few minutes)",
                        file=sys.stderr,
                        flush=True,
                    )
                    # torch's own build lock: under ours nobody else is building, so a leftover
                    # one is stale (its process died) and would block forever.
                    (build_dir / "lock").unlink(missing_ok=True)
                    module = _load_inline(name, sources, archs, build_dir, verbose)
            except BuildError:
                raise
            except Exception as exc:  # the compiler's message is in exc
                raise BuildError(f"flashopm: building the CUDA extension failed:\n{exc}") from exc
            finally:
                fcntl.flock(lock_file, fcntl.LOCK_UN)
        op_entry = module.outer_product_mean
        modules_entry = module.outer_product_mean_modules
        _module = module
        _library_path = module.__file__
        return _library_path


def _import_built(name: str, library: Path):
    """Imports a library the cache holds (loading it registers the CUDA kernels), as load_inline
    would once its build had nothing left to do, without the toolkit that a build needs."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_inline(name: str, sources: dict[str, str], archs: list[str], build_dir: Path, verbose: bool):
    """Builds if needed and imports the extension module (loading it registers the CUDA kernels)."""
    from torch.utils.cpp_extension import load_inline

    return load_inline(
        name=name,
        cpp_sources=[sources[f] for f in ("opm_api.cpp", "opm_backward_api.cpp", "opm_autograd.cpp", "opm_python.cpp")],
        cuda_sources=[sources["opm_launch.cu"]],
        extra_include_paths=[str(CSRC_DIR)],
        extra_cflags=["-O3"],
        extra_cuda_cflags=[*nvcc_flags(), *gencode_flags(archs)],
        build_directory=str(build_dir),
        is_python_module=True,
        no_implicit_headers=True,
        verbose=verbose,
    )
