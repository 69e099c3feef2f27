"""Every op of flashopm: schema, CPU implementation, fake (meta) implementation and autograd, in
one place.

The schemas are defined here, at import, so that the CPU path, fake tensors and `torch.compile`
tracing work with no GPU and no build.  The CUDA implementations are registered from C++
(`csrc/opm_api.cpp`, `TORCH_LIBRARY_IMPL(flashopm, CUDA, ...)`; autograd on CUDA in
`csrc/opm_autograd.cpp`) when `_build.load()` loads the
extension, which keeps the eager call free of Python-side dispatch overhead.
"""
from __future__ import annotations

import torch

from . import _build
from .reference import (
    GRAD_INPUTS,
    contract_outer_blocks_backward,
    ROWS_GRAD_INPUTS,
    outer_product_mean_backward_reference,
    outer_product_mean_reference,
    outer_product_mean_rows_backward_reference,
    outer_product_mean_rows_reference,
)

# "outer" runs on tensor cores where it can (hidden_dim a multiple of 8, sm_80+), "outer-fma" on CUDA
# cores always.
ALGORITHMS = {"auto": 0, "outer": 1, "project": 2, "single": 3, "outer-fma": 4, "small-tc": 5}
# Float32 matmul precision, as torch.get_float32_matmul_precision() names it: "highest" keeps
# float32 accuracy (3xTF32 on tensor cores), "high" allows TF32, "medium" bfloat16 (run as TF32).
# The op's default, -1, reads PyTorch's setting when the op runs (in C++: no cost in eager mode,
# and nothing for torch.compile to trace).
PRECISIONS = {"highest": 0, "high": 1, "medium": 2}
FOLLOW_PYTORCH = -1
# Normalisations of the contracted sum, by the models that use them (see reference.py).
NORMALIZATIONS = {"row": 0, "openfold": 1, "boltz": 2}

# Every schema of the library, by op name (also written into the KernelBench export).
SCHEMAS = {
    "outer_product_mean": (
        "outer_product_mean(Tensor msa_repr, Tensor msa_mask, Tensor ln_weight, Tensor ln_bias, "
        "float ln_eps, Tensor w_a, Tensor? b_a, Tensor w_b, Tensor? b_b, Tensor w_out, Tensor? b_out, "
        "int algorithm=0, int normalization=0, float norm_eps=0.001, int precision=-1) -> Tensor"
    ),
    # A call that does nothing, through the same dispatcher path: the floor of any op's host time.
    # Gradients for (msa_repr, ln_weight, ln_bias, w_a, b_a, w_b, b_b, w_out, b_out); entries not
    # asked for in output_mask (or for absent biases) are empty tensors.
    "outer_product_mean_backward": (
        "outer_product_mean_backward(Tensor grad_out, Tensor msa_repr, Tensor msa_mask, Tensor ln_weight, "
        "Tensor ln_bias, float ln_eps, Tensor w_a, Tensor? b_a, Tensor w_b, Tensor? b_b, Tensor w_out, "
        "Tensor? b_out, int normalization, float norm_eps, bool[] output_mask, int precision=-1) -> Tensor[]"
    ),
    # Rows row_offset .. row_offset + N_rows of the outer-product mean from projections already
    # computed: a (B, S, N_rows, H) of those residues, b (B, S, N, H) and mask (B, S, N) of all
    # residues -> (B, N_rows, N, D).  The residue-sharded OPM's local contraction.
    "outer_product_mean_rows": (
        "outer_product_mean_rows(Tensor a, Tensor b, Tensor mask, int row_offset, Tensor w_out, Tensor? b_out, "
        "int normalization=0, float norm_eps=0.001, int precision=-1) -> Tensor"
    ),
    # Gradients for (a, b, w_out, b_out); entries not asked for (or an absent bias) are empty.
    "outer_product_mean_rows_backward": (
        "outer_product_mean_rows_backward(Tensor grad_out, Tensor a, Tensor b, Tensor mask, int row_offset, "
        "Tensor w_out, Tensor? b_out, int normalization, float norm_eps, bool[] output_mask) -> Tensor[]"
    ),
    # Gradients of the outer-first contraction out = W_out vec(sum_s a[s,i] (x) b[s,j]) for the
    # output gradient grad (B, N_rows, N_cols, D), normalisation already applied: [grad_a
    # (B, S, N_rows, H), grad_b (B, S, N_cols, H), grad_w_out (D, H*H)], empty where not asked for.
    "outer_contract_backward": (
        "outer_contract_backward(Tensor grad, Tensor a, Tensor b, Tensor w_out, bool need_ab, bool need_w, "
        "int precision=-1) -> Tensor[]"
    ),
    "_noop": "_noop(Tensor x) -> ()",
    # The single-launch kernel's tiling for a problem size (CUDA only; for tests and the
    # benchmark): [rows i per block, columns d per block, blocks per cluster, shared memory bytes,
    # clusters resident at once], or [] when the problem does not fit in shared memory.
    "_single_launch_plan": "_single_launch_plan(Tensor like, int B, int S, int N, int C, int H, int D) -> int[]",
    # The two-launch path's tiling for a float32 problem under "highest" (CUDA only; for tests and
    # the benchmark): [rows i per block, columns d per block, 1 for the float16 split form], or []
    # when the path does not fit.
    "_small_tc_plan": "_small_tc_plan(Tensor like, int B, int S, int N, int H, int D) -> int[]",
    # The GPU of `like` and the kernel code that runs there (CUDA only; for tests and
    # contract_backward): [compute capability major, minor, what the kernels use there as
    # __CUDA_ARCH__ / 10 (below the capability's where the build holds only PTX of an older
    # target, which the driver compiles), 1 where the warpgroup-MMA (sm_90a) forms run, 1 where
    # the fused backward's kernels fit, the shared memory a block may opt in to (bytes)].
    "_device_code": "_device_code(Tensor like) -> int[]",
    # The waves form's trace of its last launch under FLASHOPM_WAVES_TRACE=cap (CUDA only; a timing
    # aid for scripts/waves_trace.py): (blocks, cap, 3) int64, per block a count and then records
    # (mark | wave << 8 | part << 32, %globaltimer ns, clock64), or empty where none ran.
    "_waves_trace": "_waves_trace(Tensor like) -> Tensor",
    # The tensor-core kernels' mma.sync column tile for a block that may take smem_optin bytes of
    # shared memory (host code; CPU or CUDA `like`; for tests): [columns, 1 with half the s per
    # stage, 1 with half the k per W chunk, 1 with phase 1 half as wide, the block's bytes], or []
    # where none fits.
    "_mma_sync_tile": "_mma_sync_tile(Tensor like, int H, int N, int Ti, bool operands16, int smem_optin) -> int[]",
    # Pair mask counts sum_s mask[b, s, row0 + r] mask[b, s, j] of rows row0 .. row0 + rows as the
    # OpenFold and Boltz conventions form them (CUDA only; for tests and timing): (B, rows, N)
    # float32.
    "_pair_counts": "_pair_counts(Tensor mask, int rows, int row0) -> Tensor",
    # The peak bound's bands for one batch element (host code; CPU or CUDA `like`; for tests):
    # [b kept, workspace bytes, bands, then (r0, rows, cols, s_part, in the output's tail) per
    # band], or [] where none fit.  norm_row_bytes: a band's normalisers per row, laid after its a
    # (OpenFold's and Boltz's pair counts; 0: none).  flags: 1 parts of s allowed, 2 blocks of
    # columns allowed, 4 the last block of columns holds a whole column tile.
    "_peak_band_plan": (
        "_peak_band_plan(Tensor like, int N, int S, int C, int H, int D, int row_floats, int elem, int x_elem, "
        "int out_elem, int ab_room, int norm_row_bytes, int ti, int tj, int sms, float wave_step_us, int flags) "
        "-> int[]"
    ),
    # LayerNorm, both projections and the mask of a bfloat16 or float16 model as its outer-first
    # contraction forms them (CUDA only; for tests and timing): [a, b], each (B, S, N, H) in
    # msa_repr's type: out[0] and out[1] where `out` (2, B, S, N, H) is given, else views of one
    # allocation.
    "_projections": (
        "_projections(Tensor msa_repr, Tensor msa_mask, Tensor ln_weight, Tensor ln_bias, float ln_eps, "
        "Tensor w_a, Tensor? b_a, Tensor w_b, Tensor? b_b, Tensor(a!)? out=None) -> Tensor[]"
    ),
}

_lib = torch.library.Library("flashopm", "DEF")
for _schema in SCHEMAS.values():
    _lib.define(_schema)

_MASK_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.bool)


def _check_modes(precision, normalization):
    if precision not in (FOLLOW_PYTORCH, 0, 1, 2):
        raise ValueError(
            f"flashopm: precision must be -1 (PyTorch's setting), 0 (highest), 1 (high) or 2 (medium), got {precision}"
        )
    if normalization not in (0, 1, 2):
        raise ValueError(f"flashopm: normalization must be 0 (row), 1 (openfold) or 2 (boltz), got {normalization}")


def model_dtype(msa_repr, w_a):
    """The type the op computes in and returns: msa_repr's, or the parameters' 16-bit type where
    msa_repr is float32 (a mixed-precision region casts the parameters; LayerNorm reads float32 x)."""
    if msa_repr.dtype == torch.float32 and w_a.dtype in (torch.float16, torch.bfloat16):
        return w_a.dtype
    return msa_repr.dtype


def check_inputs(msa_repr, msa_mask, ln_weight, ln_bias, w_a, b_a, w_b, b_b, w_out, b_out, algorithm=0,
                 normalization=0, precision=FOLLOW_PYTORCH):
    """Shape/device/dtype checks of the CPU and fake paths (the CUDA path checks in C++, alike)."""
    if msa_repr.dim() != 4:
        raise ValueError(
            f"flashopm: msa_repr must have shape (B, S, N, msa_dim), got {msa_repr.dim()} dims {tuple(msa_repr.shape)}"
        )
    if msa_mask.dim() != 3:
        raise ValueError(
            f"flashopm: msa_mask must have shape (B, S, N), got {msa_mask.dim()} dims {tuple(msa_mask.shape)}"
        )
    if msa_mask.device != msa_repr.device:
        raise ValueError(f"flashopm: msa_mask is on {msa_mask.device} but msa_repr is on {msa_repr.device}")
    if not msa_repr.dtype.is_floating_point:
        raise ValueError(f"flashopm: msa_repr must be a floating-point tensor, got {msa_repr.dtype}")
    B, S, N, C = msa_repr.shape
    if tuple(msa_mask.shape) != (B, S, N):
        raise ValueError(
            f"flashopm: msa_mask must have shape (B, S, N) = {(B, S, N)} to match msa_repr, got {tuple(msa_mask.shape)}"
        )
    if msa_mask.dtype not in _MASK_DTYPES:
        raise ValueError(f"flashopm: msa_mask must be a floating-point or bool tensor, got {msa_mask.dtype}")
    if C < 1:
        raise ValueError(f"flashopm: msa_dim must be >= 1, got {C}")
    if w_a.dim() != 2:
        raise ValueError(f"flashopm: proj_a weight must be 2-D (hidden, msa_dim), got {tuple(w_a.shape)}")
    H = w_a.shape[0]
    if w_out.dim() != 2:
        raise ValueError(f"flashopm: out_proj weight must be 2-D (pair_dim, hidden^2), got {tuple(w_out.shape)}")
    D = w_out.shape[0]
    params = [
        ("layer_norm weight", ln_weight, (C,)),
        ("layer_norm bias", ln_bias, (C,)),
        ("proj_a weight", w_a, (H, C)),
        ("proj_b weight", w_b, (H, C)),
        ("out_proj weight", w_out, (D, H * H)),
        ("proj_a bias", b_a, (H,)),
        ("proj_b bias", b_b, (H,)),
        ("out_proj bias", b_out, (D,)),
    ]
    model = model_dtype(msa_repr, w_a)
    like = "msa_repr" if model == msa_repr.dtype else "proj_a weight"
    for name, t, shape in params:
        if t is None:
            continue
        if tuple(t.shape) != shape:
            raise ValueError(f"flashopm: {name} must have shape {list(shape)}, got {list(t.shape)}")
        if t.device != msa_repr.device:
            raise ValueError(f"flashopm: {name} is on {t.device} but msa_repr is on {msa_repr.device}")
        if t.dtype != model:
            raise ValueError(f"flashopm: {name} must have dtype {model} like {like}, got {t.dtype}")
    if algorithm not in ALGORITHMS.values():
        raise ValueError(
            "flashopm: algorithm must be 0 (auto), 1 (outer-first), 2 (project-first), 3 (single launch), "
            f"4 (outer-first on CUDA cores) or 5 (two launches on tensor cores, small problems), got {algorithm}"
        )
    _check_modes(precision, normalization)
    return B, S, N, C, H, D


def _mask_in_type(msa_mask, dtype):
    """A float mask in the model's type, so that the PyTorch math keeps that type throughout (a mask
    of another float type would promote a and b past the parameters' type); bool masks as given."""
    return msa_mask.to(dtype) if msa_mask.is_floating_point() and msa_mask.dtype != dtype else msa_mask


@torch.library.impl(_lib, "outer_product_mean", "CPU")
def _outer_product_mean_cpu(msa_repr, msa_mask, ln_weight, ln_bias, ln_eps, w_a, b_a, w_b, b_b, w_out, b_out,
                            algorithm=0, normalization=0, norm_eps=1e-3, precision=FOLLOW_PYTORCH):
    check_inputs(msa_repr, msa_mask, ln_weight, ln_bias, w_a, b_a, w_b, b_b, w_out, b_out, algorithm, normalization,
                 precision)
    msa_mask = _mask_in_type(msa_mask, model_dtype(msa_repr, w_a))
    out = outer_product_mean_reference(msa_repr, msa_mask, ln_weight, ln_bias, w_a, b_a, w_b, b_b, w_out, b_out, ln_eps,
                                       normalization, norm_eps)
    # The einsum path can return a non-contiguous view for degenerate sizes; the op promises a
    # fresh contiguous tensor like the CUDA kernel's.
    return out.contiguous()


@torch.library.register_fake("flashopm::outer_product_mean")
def _outer_product_mean_fake(msa_repr, msa_mask, ln_weight, ln_bias, ln_eps, w_a, b_a, w_b, b_b, w_out, b_out,
                             algorithm=0, normalization=0, norm_eps=1e-3, precision=FOLLOW_PYTORCH):
    B, S, N, C, H, D = check_inputs(msa_repr, msa_mask, ln_weight, ln_bias, w_a, b_a, w_b, b_b, w_out, b_out, algorithm,
                                    normalization, precision)
    if msa_repr.device.type == "cuda":
        _build.load()  # the compiled graph will call the CUDA kernel: have it registered by then
    return msa_repr.new_empty((B, N, N, D), dtype=model_dtype(msa_repr, w_a))


outer_product_mean_op = torch.ops.flashopm.outer_product_mean.default


def call_outer_product_mean(msa_repr, msa_mask, *args):
    """`outer_product_mean_op(msa_repr, msa_mask, *args)`: on CUDA tensors in eager mode through the
    extension's direct entry (the same op and dispatcher layers without the schema's argument
    parsing, which at small sizes costs more host time than the kernels take), building the
    extension on first use; torch.ops wherever the entry declines (tensor subclasses,
    __torch_function__ modes, other argument types) and under torch.compile, which traces the op."""
    if msa_repr.is_cuda and not torch.compiler.is_compiling():
        out = (_build.op_entry or _build.load_op_entry())(msa_repr, msa_mask, *args)
        if out is not NotImplemented:
            return out
    return outer_product_mean_op(msa_repr, msa_mask, *args)


# ---- backward ----
# The LayerNorm and projection parts in PyTorch, the three contractions over the (pairs x H*H)
# intermediate in outer_contract_backward (fused CUDA kernels; PyTorch in blocks of rows on the
# CPU).  On CUDA the whole backward is registered from C++ (csrc/opm_backward_api.cpp, the same
# math), which takes precedence over this composite one.


def _grads_as_tensors(grads, like):
    return [g if g is not None else like[0].new_empty(0) for g in grads]


# CPU only: on CUDA the C++ kernels are the implementation (no silent fallback to PyTorch).
@torch.library.impl(_lib, "outer_contract_backward", "CPU")
def _outer_contract_backward_impl(grad, a, b, w_out, need_ab, need_w, precision=FOLLOW_PYTORCH):
    grads = contract_outer_blocks_backward(grad, a, b, w_out, need_ab, need_w)
    return [t if t is not None else a.new_empty(0) for t in grads]


@torch.library.register_fake("flashopm::outer_contract_backward")
def _outer_contract_backward_fake(grad, a, b, w_out, need_ab, need_w, precision=FOLLOW_PYTORCH):
    D, HH = w_out.shape
    return [a.new_empty(a.shape) if need_ab else a.new_empty(0), b.new_empty(b.shape) if need_ab else a.new_empty(0),
            a.new_empty((D, HH)) if need_w else a.new_empty(0)]


outer_contract_backward_op = torch.ops.flashopm.outer_contract_backward.default

# hidden_dim values the fused CUDA backward supports (a block owns 128 columns (h1, h2)), and the
# deepest MSA it is used for: it recomputes dO for every 128 values of s, which past S = 256 costs
# more than PyTorch's blocks in the kernels' mma.sync forms (csrc/opm_backward_api.cpp keeps the
# fused kernels past S = 256 where it knows their float16 split forms run).
FUSED_BACKWARD_HIDDEN = (16, 32, 64)
FUSED_BACKWARD_MAX_S = 256


_fused_backward_fits: dict[int, bool] = {}


def fused_backward_fits(device: torch.device) -> bool:
    """The fused backward's kernels run on this GPU (compute capability 8.0 or newer, and the
    shared memory they take: not on 99 KB GPUs such as sm_86 and sm_89)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _fused_backward_fits:
        _build.load()
        like = torch.empty(0, device=torch.device("cuda", index))
        _fused_backward_fits[index] = bool(torch.ops.flashopm._device_code(like)[4])
    return _fused_backward_fits[index]


def contract_backward(g, a, b, w_out, need_ab, need_w):
    """(grad_a, grad_b, grad_w_out) of the outer-first contraction, None where not needed: the
    fused CUDA kernels for float32 CUDA tensors with hidden_dim 16, 32 or 64 and S <= 256 where
    they fit the GPU, else PyTorch in blocks of rows (reference.contract_outer_blocks_backward)."""
    if (g.is_cuda and a.dtype == torch.float32 and a.shape[-1] in FUSED_BACKWARD_HIDDEN
            and a.shape[1] <= FUSED_BACKWARD_MAX_S and fused_backward_fits(g.device)):
        ga, gb, gw = outer_contract_backward_op(g, a, b, w_out, need_ab, need_w)
        return (ga if need_ab else None, gb if need_ab else None, gw if need_w else None)
    return contract_outer_blocks_backward(g, a, b, w_out, need_ab, need_w)


@torch.library.impl(_lib, "outer_product_mean_backward", "CompositeExplicitAutograd")
def _outer_product_mean_backward_impl(grad_out, msa_repr, msa_mask, ln_weight, ln_bias, ln_eps, w_a, b_a, w_b, b_b,
                                      w_out, b_out, normalization, norm_eps, output_mask, precision=FOLLOW_PYTORCH):
    if len(output_mask) != len(GRAD_INPUTS):
        raise ValueError(f"flashopm: output_mask must have {len(GRAD_INPUTS)} entries, got {len(output_mask)}")
    # The reference's sums run in its own types (float32 for 16-bit inputs): an autocast region
    # around the backward must not recast its matmuls.
    with torch.autocast(msa_repr.device.type, enabled=False):
        grads = outer_product_mean_backward_reference(
            grad_out, msa_repr, msa_mask, ln_weight, ln_bias, w_a, b_a, w_b, b_b, w_out, b_out, ln_eps,
            normalization, norm_eps, tuple(output_mask), contract_backward=contract_backward,
        )
    return _grads_as_tensors(grads, (msa_repr, ln_weight, ln_bias, w_a, b_a, w_b, b_b, w_out, b_out))


@torch.library.register_fake("flashopm::outer_product_mean_backward")
def _outer_product_mean_backward_fake(grad_out, msa_repr, msa_mask, ln_weight, ln_bias, ln_eps, w_a, b_a, w_b, b_b,
                                      w_out, b_out, normalization, norm_eps, output_mask, precision=FOLLOW_PYTORCH):
    inputs = (msa_repr, ln_weight, ln_bias, w_a, b_a, w_b, b_b, w_out, b_out)
    return [
        t.new_empty(t.shape) if (need and t is not None) else msa_repr.new_empty(0)
        for need, t in zip(output_mask, inputs)
    ]


def _setup_context(ctx, inputs, output):
    msa_repr, msa_mask, ln_weight, ln_bias, ln_eps, w_a, b_a, w_b, b_b, w_out, b_out = inputs[:11]
    ctx.num_inputs = len(inputs)
    ctx.ln_eps = ln_eps
    ctx.normalization = inputs[12] if len(inputs) > 12 else 0
    ctx.norm_eps = inputs[13] if len(inputs) > 13 else 1e-3
    ctx.precision = inputs[14] if len(inputs) > 14 else FOLLOW_PYTORCH
    ctx.has_bias = (b_a is not None, b_b is not None, b_out is not None)
    ctx.save_for_backward(msa_repr, msa_mask, ln_weight, ln_bias, w_a, b_a, w_b, b_b, w_out, b_out)


# positions of the differentiable inputs in the op's argument list
_GRAD_POSITIONS = (0, 2, 3, 5, 6, 7, 8, 9, 10)


SECOND_DERIVATIVE_MESSAGE = (
    "flashopm: the gradients of the outer-product mean are not differentiable again: a second derivative "
    "through it (create_graph=True followed by a backward through those gradients, e.g. a gradient penalty) "
    "is not supported")


class _SecondDerivativeError(torch.autograd.Function):
    """forward(n, *tensors) -> tensors[:n]: the gradients of a backward run with create_graph=True,
    as outputs of a node whose inputs are what they were computed from (tensors[n:]), so that a
    second derivative reaches the node, which raises (PyTorch's fallback for an op without a
    derivative would only warn and take the missing terms as zero)."""

    @staticmethod
    def forward(ctx, n, *tensors):
        return tensors[:n]

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(SECOND_DERIVATIVE_MESSAGE)


def _call_backward_op(op, args, sources):
    """op(*args), the gradients of a backward; under create_graph=True computed without a graph of
    their own and marked by _SecondDerivativeError as depending on `sources` (the tensors they were
    computed from; None entries and those that need no gradient are left out)."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return op(*args)
    with torch.no_grad():
        grads = op(*args)
    sources = [t for t in sources if t is not None and t.requires_grad]
    return list(_SecondDerivativeError.apply(len(grads), *grads, *sources)) if sources else grads


def _backward(ctx, grad_out):
    saved = ctx.saved_tensors  # unpacked once: non-reentrant checkpointing allows no second unpack
    msa_repr, msa_mask, ln_weight, ln_bias, w_a, b_a, w_b, b_b, w_out, b_out = saved
    needs = [bool(ctx.needs_input_grad[i]) for i in _GRAD_POSITIONS]
    grads = [None] * ctx.num_inputs
    if not any(needs):
        return tuple(grads)
    computed = _call_backward_op(
        outer_product_mean_backward_op,
        (grad_out.contiguous(), msa_repr, msa_mask, ln_weight, ln_bias, ctx.ln_eps, w_a, b_a, w_b, b_b, w_out, b_out,
         ctx.normalization, ctx.norm_eps, needs, ctx.precision),
        (grad_out, *saved),
    )
    for pos, need, g in zip(_GRAD_POSITIONS, needs, computed):
        grads[pos] = g if need else None
    return tuple(grads)


torch.library.register_autograd("flashopm::outer_product_mean", _backward, setup_context=_setup_context)

outer_product_mean_backward_op = torch.ops.flashopm.outer_product_mean_backward.default

# Under torch.autocast the op runs as the reference's layers run there: its linear layers and
# einsum take the region's type (bfloat16 or float16) and return it, so the op takes the parameters
# in that type and returns that type, which selects its 16-bit kernels (products in that type,
# float32 sums).  float32 msa_repr stays float32 (the reference's LayerNorm runs in float32 there;
# the op's reads x in its own type), other msa_repr is cast.  The mask is not cast, as the
# reference multiplies by it in its own type.  float64 tensors are not cast, as autocast leaves
# them.  The type is read when the op runs (torch.get_autocast_dtype), so one registration serves
# every region.  The tensors cast are the differentiable inputs (_GRAD_POSITIONS).  On CUDA the
# dispatcher's kernel is C++ (csrc/opm_autograd.cpp, the same rule without a Python frame per
# call), registered with the op's CUDA kernel when the extension loads; the Python one here serves
# torch.compile's tracing there.
def _register_autocast(device_type: str, dispatcher_kernel: bool) -> None:
    key_name = "Autocast" + torch._C._dispatch_key_for_device(device_type)
    key = getattr(torch._C.DispatchKey, key_name)

    def run_cast(*args):
        dtype = torch.get_autocast_dtype(device_type)
        args = list(args)
        for k in _GRAD_POSITIONS:
            t = args[k]
            if (t is not None and t.is_floating_point() and t.device.type == device_type
                    and t.dtype not in (torch.float64, dtype) and not (k == 0 and t.dtype == torch.float32)):
                args[k] = t.to(dtype)
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key)):
            return outer_product_mean_op(*args)

    # the Python dispatcher's kernel (torch.compile's tracing) and the dispatcher's
    if outer_product_mean_op.has_kernel_for_dispatch_key(key):
        outer_product_mean_op.py_kernels.pop(key)
    outer_product_mean_op.py_impl(key)(run_cast)
    if dispatcher_kernel:
        _lib.impl("outer_product_mean", lambda _keyset, *args: run_cast(*args), key_name, with_keyset=True)


_register_autocast("cpu", dispatcher_kernel=True)
_register_autocast("cuda", dispatcher_kernel=False)


# ---- rows of the outer-product mean from projections (the sharded OPM's local contraction) ----


def check_rows_inputs(a, b, mask, row_offset, w_out, b_out, normalization=0, precision=FOLLOW_PYTORCH):
    """Shape/device/dtype checks of the rows op's CPU and fake paths (the CUDA path checks in C++)."""
    if a.dim() != 4:
        raise ValueError(f"flashopm: a must have shape (B, S, N_rows, hidden), got {a.dim()} dims {tuple(a.shape)}")
    if b.dim() != 4:
        raise ValueError(f"flashopm: b must have shape (B, S, N, hidden), got {b.dim()} dims {tuple(b.shape)}")
    B, S, N, H = b.shape
    Nr = a.shape[2]
    if (a.shape[0], a.shape[1], a.shape[3]) != (B, S, H):
        raise ValueError(f"flashopm: a must have shape (B, S, N_rows, hidden) = ({B}, {S}, N_rows, {H}) to match b, "
                         f"got {tuple(a.shape)}")
    if tuple(mask.shape) != (B, S, N):
        raise ValueError(f"flashopm: mask must have shape (B, S, N) = {(B, S, N)} to match b, got {tuple(mask.shape)}")
    if mask.dtype not in _MASK_DTYPES:
        raise ValueError(f"flashopm: mask must be a floating-point or bool tensor, got {mask.dtype}")
    if not (0 <= row_offset and row_offset + Nr <= N):
        raise ValueError(f"flashopm: rows [row_offset, row_offset + N_rows) = [{row_offset}, {row_offset + Nr}) "
                         f"must lie in [0, N) with N = {N}")
    if not a.dtype.is_floating_point:
        raise ValueError(f"flashopm: a must be a floating-point tensor, got {a.dtype}")
    if w_out.dim() != 2 or w_out.shape[1] != H * H:
        raise ValueError(f"flashopm: out_proj weight must have shape [pair_dim, {H * H}], got {list(w_out.shape)}")
    D = w_out.shape[0]
    for name, t, shape in (("b", b, (B, S, N, H)), ("mask", mask, (B, S, N)), ("out_proj weight", w_out, (D, H * H)),
                           ("out_proj bias", b_out, (D,))):
        if t is None:
            continue
        if t.device != a.device:
            raise ValueError(f"flashopm: {name} is on {t.device} but a is on {a.device}")
        if name != "mask" and t.dtype != a.dtype:
            raise ValueError(f"flashopm: {name} must have dtype {a.dtype} like a, got {t.dtype}")
        if tuple(t.shape) != shape:
            raise ValueError(f"flashopm: {name} must have shape {list(shape)}, got {list(t.shape)}")
    _check_modes(precision, normalization)
    return B, S, N, Nr, H, D


@torch.library.impl(_lib, "outer_product_mean_rows", "CPU")
def _outer_product_mean_rows_cpu(a, b, mask, row_offset, w_out, b_out, normalization=0, norm_eps=1e-3,
                                 precision=FOLLOW_PYTORCH):
    check_rows_inputs(a, b, mask, row_offset, w_out, b_out, normalization, precision)
    return outer_product_mean_rows_reference(a, b, mask, row_offset, w_out, b_out, normalization,
                                             norm_eps).contiguous()


@torch.library.register_fake("flashopm::outer_product_mean_rows")
def _outer_product_mean_rows_fake(a, b, mask, row_offset, w_out, b_out, normalization=0, norm_eps=1e-3,
                                  precision=FOLLOW_PYTORCH):
    B, S, N, Nr, H, D = check_rows_inputs(a, b, mask, row_offset, w_out, b_out, normalization, precision)
    if a.device.type == "cuda":
        _build.load()
    return a.new_empty((B, Nr, N, D))


@torch.library.impl(_lib, "outer_product_mean_rows_backward", "CompositeExplicitAutograd")
def _outer_product_mean_rows_backward_impl(grad_out, a, b, mask, row_offset, w_out, b_out, normalization, norm_eps,
                                           output_mask):
    if len(output_mask) != len(ROWS_GRAD_INPUTS):
        raise ValueError(f"flashopm: output_mask must have {len(ROWS_GRAD_INPUTS)} entries, got {len(output_mask)}")
    grads = outer_product_mean_rows_backward_reference(grad_out, a, b, mask, row_offset, w_out, b_out, normalization,
                                                       norm_eps, tuple(output_mask),
                                                       contract_backward=contract_backward)
    return _grads_as_tensors(grads, (a, b, w_out, b_out))


@torch.library.register_fake("flashopm::outer_product_mean_rows_backward")
def _outer_product_mean_rows_backward_fake(grad_out, a, b, mask, row_offset, w_out, b_out, normalization, norm_eps,
                                           output_mask):
    return [t.new_empty(t.shape) if (need and t is not None) else a.new_empty(0)
            for need, t in zip(output_mask, (a, b, w_out, b_out))]


def _rows_setup_context(ctx, inputs, output):
    a, b, mask, row_offset, w_out, b_out = inputs[:6]
    ctx.num_inputs = len(inputs)
    ctx.row_offset = row_offset
    ctx.normalization = inputs[6] if len(inputs) > 6 else 0
    ctx.norm_eps = inputs[7] if len(inputs) > 7 else 1e-3
    ctx.save_for_backward(a, b, mask, w_out, b_out)


_ROWS_GRAD_POSITIONS = (0, 1, 4, 5)  # a, b, w_out, b_out in the op's arguments


def _rows_backward(ctx, grad_out):
    saved = ctx.saved_tensors  # unpacked once, as in _backward
    a, b, mask, w_out, b_out = saved
    needs = [bool(ctx.needs_input_grad[i]) for i in _ROWS_GRAD_POSITIONS]
    grads = [None] * ctx.num_inputs
    if not any(needs):
        return tuple(grads)
    computed = _call_backward_op(outer_product_mean_rows_backward_op,
                                 (grad_out.contiguous(), a, b, mask, ctx.row_offset, w_out, b_out, ctx.normalization,
                                  ctx.norm_eps, needs),
                                 (grad_out, *saved))
    for pos, need, g in zip(_ROWS_GRAD_POSITIONS, needs, computed):
        grads[pos] = g if need else None
    return tuple(grads)


torch.library.register_autograd("flashopm::outer_product_mean_rows", _rows_backward, setup_context=_rows_setup_context)

outer_product_mean_rows_op = torch.ops.flashopm.outer_product_mean_rows.default
outer_product_mean_rows_backward_op = torch.ops.flashopm.outer_product_mean_rows_backward.default
