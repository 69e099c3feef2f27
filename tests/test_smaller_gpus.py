"""The forms that GPUs with less shared memory than sm_90's take, run on this GPU.

A block may take 227 KB of shared memory on an H100 or H200, 163 KB (166912 bytes) on an A100
and 99 KB (101376 bytes) on sm_86, sm_89 and sm_120 GPUs.  FLASHOPM_SMEM_LIMIT makes flashopm
plan as on such a GPU and caps every kernel's shared memory at it, so that a launch past it fails
here as it would there.  flashopm reads it once per process: each limit runs in a process of its
own, this file run as a script, which prints one JSON line per case and saves the outputs that
the bits test compares.  Built with FLASHOPM_CUDA_ARCH_LIST="8.0+PTX" on an sm_90 GPU, the same
cases run the code an A100 runs (the driver compiles its PTX; no clusters, programmatic launches
or warpgroup MMAs).  The planner's choices themselves are checked on the host, GPU or not.

Each case is held to the foundation's rules: float32 "highest" within allclose(1e-4) of the
float32 reference and at most 2x eager float32's error against float64; "high" at most 2x eager
TF32's; a bfloat16 model at most 2x eager bfloat16's against float32; gradients at most 2x
eager's against float64.
"""
import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from conftest import requires_cuda, toolchain_or_skip

H200_SMEM = 232448
A100_SMEM = 166912
SMALL_SMEM = 101376  # sm_86, sm_89, sm_120

# (B, S, N, C, H, D): tiles past N and not whole, every hidden size the tensor cores take, one
# they do not (5), the specification's shape
SHAPES = [(1, 24, 70, 48, 32, 40), (2, 9, 33, 20, 16, 24), (1, 5, 20, 16, 64, 8), (1, 7, 45, 16, 8, 12),
          (2, 8, 32, 64, 32, 64), (1, 3, 7, 17, 5, 9)]
TRAINING_SHAPES = [(1, 24, 70, 48, 32, 40), (2, 9, 33, 20, 16, 24), (1, 5, 20, 16, 64, 8)]


def _problem(shape, seed, mask_kind="masked_positions"):
    from flashopm.testing import Shape, make_problem

    x, m, p = make_problem(Shape(*shape), mask_kind, seed=seed)
    return x.cuda(), m.cuda(), {k: v.cuda() for k, v in p.items()}


def _params(p, dtype):
    from flashopm.testing import PARAM_ORDER

    return [p[k].to(dtype) for k in PARAM_ORDER]


def _reference(x, m, p, dtype, normalization="row", tf32=False):
    from flashopm.ops import NORMALIZATIONS
    from flashopm.testing import reference

    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        return reference(x, m, p, dtype=dtype, normalization=NORMALIZATIONS[normalization])
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def _forward_case(shape, algorithm, precision, normalization, dtype):
    import flashopm
    from flashopm.testing import rel_error

    x, m, p = _problem(shape, seed=sum(shape))
    if dtype != torch.float32:  # against float32 on the same rounded inputs, next to eager in dtype
        xd, md, pd = x.to(dtype), m.to(dtype), {k: v.to(dtype) for k, v in p.items()}
        out = flashopm.outer_product_mean(xd, md, *_params(pd, dtype), algorithm=algorithm,
                                          normalization=normalization, precision=precision)
        truth = _reference(xd, md, pd, torch.float32, normalization)
        eager = _reference(xd, md, pd, None, normalization)
        err, eager_err = rel_error(out.float(), truth), rel_error(eager.float(), truth)
        return {"err": err, "eager_err": eager_err, "ok": err <= max(2 * eager_err, 2 * torch.finfo(dtype).eps)}
    out = flashopm.outer_product_mean(x, m, *_params(p, dtype), algorithm=algorithm, normalization=normalization,
                                      precision=precision)
    truth = _reference(x, m, p, torch.float64, normalization)
    eager = _reference(x, m, p, None, normalization, tf32=precision == "high")
    err, eager_err = rel_error(out, truth), rel_error(eager, truth)
    ok = err <= 2 * eager_err + 1e-7
    if precision == "highest":
        ok = ok and torch.allclose(out, _reference(x, m, p, None, normalization), atol=1e-4, rtol=1e-4)
    return {"err": err, "eager_err": eager_err, "ok": bool(ok)}


def _training_case(shape):
    import flashopm
    from flashopm.testing import rel_error

    x, m, p = _problem(shape, seed=3 * sum(shape))
    g = torch.randn(shape[0], shape[2], shape[2], shape[5], device="cuda")

    def grads(dtype, fused):
        leaves = [t.detach().to(dtype).clone().requires_grad_() for t in [x, *_params(p, dtype)]]
        if fused:
            out = flashopm.outer_product_mean(leaves[0], m, *leaves[1:], precision="highest")
        else:
            from flashopm.reference import outer_product_mean_reference

            out = outer_product_mean_reference(leaves[0], m.to(dtype), *leaves[1:], 1e-5, 0, 1e-3)
        out.backward(g.to(dtype))
        return [t.grad for t in leaves]

    truth, eager, ours = grads(torch.float64, False), grads(torch.float32, False), grads(torch.float32, True)
    errs = [(rel_error(o, t), rel_error(e, t)) for o, e, t in zip(ours, eager, truth)]
    return {"err": max(e for e, _ in errs), "ok": all(e <= 2 * ee + 1e-6 for e, ee in errs)}


def _rows_case(shape):
    from flashopm.functional import outer_product_mean_rows
    from flashopm.reference import outer_product_mean_rows_reference
    from flashopm.testing import rel_error

    B, S, N, C, H, D = shape
    gen = torch.Generator().manual_seed(11)
    a, b = (torch.randn(B, S, n, H, generator=gen).cuda() for n in (N // 2, N))
    m = (torch.rand(B, S, N, generator=gen) < 0.8).float().cuda()
    w, bias = torch.randn(D, H * H, generator=gen).cuda() / H, torch.randn(D, generator=gen).cuda()
    out = outer_product_mean_rows(a, b, m, 3, w, bias, precision="highest")
    ref = outer_product_mean_rows_reference(a.double(), b.double(), m.double(), 3, w.double(), bias.double())
    return {"err": rel_error(out, ref), "ok": rel_error(out, ref) < 1e-6}


# The tensor-core kernels' mma.sync forms sum in the same order whatever their column tile, stage
# depth and phase-1 width: the narrower forms of smaller GPUs give the full tile's bits (in
# float32 with the same W chunks: half ones change the partial sums).
BITS_SHAPES = [(1, 24, 70, 48, 32, 40), (2, 9, 33, 20, 16, 24), (1, 5, 20, 16, 64, 8)]


def bits_outputs(before_shape=None) -> dict[str, torch.Tensor]:
    """The mma.sync forms' outputs ("outer") for BITS_SHAPES: float32 under both precisions, and a
    bfloat16 model, by case name; before_shape(shape) runs before each shape's calls."""
    import flashopm

    outs = {}
    for shape in BITS_SHAPES:
        if before_shape is not None:
            before_shape(shape)
        x, m, p = _problem(shape, seed=7 + sum(shape))
        for precision in ("highest", "high"):
            out = flashopm.outer_product_mean(x, m, *_params(p, torch.float32), algorithm="outer",
                                              precision=precision)
            outs[f"{shape} {precision}"] = out.cpu()
        bf = torch.bfloat16
        out = flashopm.outer_product_mean(x.to(bf), m.to(bf), *_params(p, bf), algorithm="outer")
        outs[f"{shape} bfloat16"] = out.cpu()
    return outs


def run_cases() -> list[dict]:
    import flashopm

    flashopm.load()
    code = torch.ops.flashopm._device_code(torch.empty(0, device="cuda"))
    results = [{"case": "device", "code": list(code), "ok": True}]

    def record(name, fn, *args):
        try:
            results.append({"case": name, **fn(*args)})
        except RuntimeError as exc:  # a launch past the limit, or a form refused
            results.append({"case": name, "ok": False, "error": str(exc).splitlines()[0]})

    for shape in SHAPES:
        # ("outer" asks for the outer-first kernels: for a hidden size the tensor cores do not take,
        # the CUDA-core one, which needs 162 KB)
        for algorithm in ("auto", "outer") if shape[4] % 8 == 0 else ("auto",):
            record(f"forward {shape} {algorithm}", _forward_case, shape, algorithm, "highest", "row", torch.float32)
        record(f"forward {shape} high", _forward_case, shape, "auto", "high", "row", torch.float32)
    for normalization in ("openfold", "boltz"):
        record(f"forward {normalization}", _forward_case, SHAPES[0], "auto", "highest", normalization, torch.float32)
    for shape in SHAPES[:2]:
        record(f"forward {shape} bfloat16", _forward_case, shape, "auto", None, "row", torch.bfloat16)
    for shape in TRAINING_SHAPES:
        record(f"training {shape}", _training_case, shape)
    record("rows", _rows_case, SHAPES[0])
    torch.cuda.synchronize()
    return results


@pytest.mark.parametrize("limit, H, operands16, expected", [
    # [columns, half stages, half W chunks, narrow phase 1, bytes] at N = 256
    # (scripts/smem_table.py lists every layout)
    (H200_SMEM, 32, False, [8, 0, 0, 0, 187280]),
    (H200_SMEM, 32, True, [8, 0, 0, 0, 220416]),
    (A100_SMEM, 32, False, [8, 0, 1, 0, 162704]),
    (A100_SMEM, 32, True, [4, 0, 0, 1, 138240]),
    (A100_SMEM, 8, False, [16, 0, 0, 1, 125376]),
    (SMALL_SMEM, 32, False, [4, 1, 1, 1, 96912]),
    (SMALL_SMEM, 32, True, [2, 1, 0, 1, 89088]),
    (SMALL_SMEM, 64, False, [2, 1, 1, 1, 96720]),
    (SMALL_SMEM, 64, True, [1, 1, 0, 1, 88896]),
    (SMALL_SMEM, 8, False, [16, 1, 1, 1, 100800]),
    (60000, 32, False, [1, 1, 1, 1, 52624]),
    (50000, 32, False, []),
])
def test_the_column_tile_is_the_widest_that_fits(limit, H, operands16, expected):
    """The planner's choice on the host (no GPU needed): the widest column tile whose block fits,
    at each width full stages and W chunks first, then half stages, then half W chunks; phase 1
    half as wide where the tile's columns fit in it."""
    toolchain_or_skip()
    from flashopm import _build

    _build.load()
    assert torch.ops.flashopm._mma_sync_tile(torch.empty(0), H, 256, 128 // H, operands16, limit) == expected


def test_the_column_tile_stays_within_the_limit_and_n():
    toolchain_or_skip()
    from flashopm import _build

    _build.load()
    for limit in (H200_SMEM, A100_SMEM, SMALL_SMEM):
        for H in (8, 16, 24, 32, 40, 48, 56, 64):
            for N in (1, 2, 3, 7, 33, 256):
                for operands16 in (False, True):
                    Ti = min(128 // H, N)
                    got = torch.ops.flashopm._mma_sync_tile(torch.empty(0), H, N, Ti, operands16, limit)
                    assert got, (limit, H, N, operands16)  # every hidden size fits 99 KB at one column
                    cols, half_stages, half_w, narrow, size = got
                    assert 1 <= cols <= min(256 // H, N) and size <= limit, (limit, H, N, operands16, got)
                    assert (half_stages == half_w == 0 or limit < H200_SMEM), (limit, H, N, got)
                    assert not (operands16 and half_w) and narrow == int(cols * H <= 128), got


def test_the_column_tile_query_refuses_what_the_kernels_do_not_take():
    toolchain_or_skip()
    from flashopm import _build

    _build.load()
    with pytest.raises(RuntimeError, match="_mma_sync_tile needs hidden a multiple of 8"):
        torch.ops.flashopm._mma_sync_tile(torch.empty(0), 12, 64, 4, False, A100_SMEM)


@functools.lru_cache(maxsize=None)
def _run_with_limit(limit: int) -> tuple[dict[str, dict], dict[str, torch.Tensor]]:
    """This file as a script under FLASHOPM_SMEM_LIMIT=limit (once per limit): its cases' results
    by name, and the outputs of bits_outputs()."""
    env = dict(os.environ, FLASHOPM_SMEM_LIMIT=str(limit), PYTHONPATH=os.pathsep.join(sys.path))
    with tempfile.TemporaryDirectory() as tmp:
        bits_path = Path(tmp, "bits.pt")
        out = subprocess.run([sys.executable, str(Path(__file__).resolve()), str(bits_path)], env=env,
                             capture_output=True, text=True, timeout=900)
        assert out.returncode == 0, out.stderr[-4000:]
        bits = torch.load(bits_path)
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return {r["case"]: r for r in lines}, bits


@requires_cuda
@pytest.mark.parametrize("value", ["abc", "1000", "12KB"])
def test_a_limit_that_is_not_a_number_of_bytes_is_refused(value):
    toolchain_or_skip()
    code = ("import flashopm, torch\n"
            "x = torch.randn(1, 4, 8, 16, device='cuda')\n"
            "m = flashopm.ModelNew(16, 8, 8).cuda()\n"
            "m(x, torch.ones(1, 4, 8, device='cuda'))\n")
    env = dict(os.environ, FLASHOPM_SMEM_LIMIT=value, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode != 0
    assert f"FLASHOPM_SMEM_LIMIT must be a number of bytes of at least 49152, got '{value}'" in out.stderr


@requires_cuda
@pytest.mark.parametrize("limit", [A100_SMEM, SMALL_SMEM])
def test_forms_for_less_shared_memory_match_the_reference(limit):
    toolchain_or_skip()
    results = dict(_run_with_limit(limit)[0])
    major, minor, arch, wgmma, fused_backward, smem = results.pop("device")["code"]
    assert smem == min(limit, getattr(torch.cuda.get_device_properties(0), "shared_memory_per_block_optin", limit))
    # the fused backward's mma.sync kernels take 111 KB: an A100 runs them, a 99 KB GPU the blocks
    assert fused_backward == int(limit >= A100_SMEM and arch >= 80)
    failed = {name: r for name, r in results.items() if not r["ok"]}
    assert not failed, failed


@requires_cuda
@pytest.mark.parametrize("limit", [A100_SMEM, SMALL_SMEM])
def test_narrower_forms_keep_the_bits(limit, monkeypatch):
    toolchain_or_skip()
    theirs = _run_with_limit(limit)[1]
    # this process: the mma.sync forms at the full tile and stages
    monkeypatch.setenv("FLASHOPM_TC_FORM", "mma_sync")
    monkeypatch.setenv("FLASHOPM_TC16_MMA_SYNC", "1")

    def same_w_chunks(shape):  # the W chunks the limited process took for this shape
        B, S, N, C, H, D = shape
        tile = torch.ops.flashopm._mma_sync_tile(torch.empty(0), H, N, min(128 // H, N), False, limit)
        if tile[2]:
            monkeypatch.setenv("FLASHOPM_TC_W_CHUNK", "16")
        else:
            monkeypatch.delenv("FLASHOPM_TC_W_CHUNK", raising=False)

    ours = bits_outputs(same_w_chunks)
    assert theirs.keys() == ours.keys()
    for name, out in ours.items():
        assert torch.equal(out, theirs[name]), name


if __name__ == "__main__":
    for result in run_cases():
        print(json.dumps(result), flush=True)
    if len(sys.argv) > 1:
        torch.save(bits_outputs(), sys.argv[1])
