"""Command line: `python -m flashopm [check|bench|export-kernelbench|plot|info]` (or `flashopm ...`).

check              the KernelBench protocol on the specification (seeded modules, several seeds,
                   random masks), then the spec shape's speed next to eager PyTorch; on a machine
                   without a GPU, the CPU path.
bench              flashopm next to eager PyTorch and torch.compile (default and reduce-overhead)
                   at the spec and AlphaFold-scale shapes, forward, backward or both (--mode);
                   writes results.json, results.csv and results.png to --out.
bench-sharded      the residue-sharded OPM over 1, 2, 4, 8 processes (one GPU each, NCCL; or CPU
                   processes with gloo): strong and weak scaling, communication share and memory
                   per process; writes sharded.json and sharded.csv to --out.
export-kernelbench one self-contained file defining ModelNew for a KernelBench-style harness.
plot               redraws results.png from a results.json.
info               GPU, versions, build cache.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import json
import os
import platform
import sys
from pathlib import Path

import torch

from . import _build
from .functional import peak_memory_bound
from .modules import ModelNew
from .ops import NORMALIZATIONS
from .reference import Model, get_init_inputs, get_inputs
from .testing import Shape, make_problem, max_abs_error, reference, rel_error

DEFAULT_SHAPES = [
    Shape(2, 8, 32, 64, 32, 64),
    Shape(1, 128, 256, 256, 32, 128),
    Shape(1, 1024, 256, 64, 32, 128),
    Shape(1, 512, 768, 256, 32, 128),
    Shape(1, 512, 1536, 256, 32, 128),
]


def environment() -> dict:
    env = {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "tf32": torch.backends.cuda.matmul.allow_tf32,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count)
    else:
        env["gpu"] = None
    return env


def _spec_pair(seed: int, device: str):
    torch.manual_seed(seed)
    ref = Model(*get_init_inputs()).to(device=device, dtype=torch.float32)
    torch.manual_seed(seed)
    new = ModelNew(*get_init_inputs()).to(device=device, dtype=torch.float32)
    return ref, new


def cmd_check(args) -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        print("flashopm check: no CUDA GPU visible; checking the CPU path only")
    worst, ok = 0.0, True
    for seed in range(args.seeds):
        ref, new = _spec_pair(seed, device)
        torch.manual_seed(1000 + seed)
        x, m = [t.to(device) for t in get_inputs()]
        masks = {"given": m, "random": (torch.rand_like(m) < 0.7).float() * torch.rand_like(m)}
        masks["random"][:, :, 0] = 0.0  # a position masked over all of S
        for name, mask in masks.items():
            expect = ref(x, mask)
            out = new(x, mask)
            err = max_abs_error(out, expect)
            good = out.shape == expect.shape and torch.allclose(out, expect, atol=1e-4, rtol=1e-4)
            worst = max(worst, err)
            ok &= good
            print(f"  seed {seed} mask {name:6s}: max |err| {err:.2e} {'ok' if good else 'FAIL'}")
    print(f"flashopm check ({device}): {'PASS' if ok else 'FAIL'}, worst max |err| {worst:.2e} (allclose atol=rtol=1e-4)")
    if device == "cuda":
        ref, new = _spec_pair(0, device)
        x, m = [t.to(device) for t in get_inputs()]
        from .bench import time_graph, time_wall, warm_gpu

        warm_gpu()
        t_ref, t_new = time_wall(lambda: ref(x, m)), time_wall(lambda: new(x, m))
        g_ref, g_new = time_graph(lambda: ref(x, m)), time_graph(lambda: new(x, m))
        print(f"spec shape (2,8,32,64,32,64), wall per call: eager {t_ref}, flashopm {t_new} "
              f"-> {t_ref.median_us / t_new.median_us:.1f}x")
        print(f"GPU time (CUDA graph): eager {g_ref.median_us:.1f} us, flashopm {g_new.median_us:.1f} us")
    return 0 if ok else 1


def _parse_shapes(text: str | None) -> list[Shape]:
    if not text:
        return DEFAULT_SHAPES
    shapes = []
    for part in text.split(";"):
        vals = [int(v) for v in part.strip().strip("()").split(",")]
        if len(vals) != 6:
            raise SystemExit(f"--shapes: expected B,S,N,C,H,D; got {part!r}")
        shapes.append(Shape(*vals))
    return shapes


# eager first: the others are checked against it.  "-tf32": under torch.set_float32_matmul_precision("high"),
# "-medium": under "medium" (flashopm: bfloat16 operands; PyTorch's CUDA matmuls treat it as "high");
# a backward or training step runs under the setting as a whole.
IMPLS = ("eager", "flashopm", "compile", "compile-ro", "chunked", "eager-tf32", "flashopm-tf32", "flashopm-medium",
         "eager-amp", "flashopm-amp", "compile-amp", "flashopm-bounded", "flashopm-tf32-bounded")
PRECISION_SUFFIXES = {"-tf32": "high", "-medium": "medium"}
# "-amp": the float32 model's forward in a bfloat16 autocast region (mixed-precision training: the
# backward runs outside it, as torch.autograd.grad is called there).
AUTOCAST_SUFFIX, AUTOCAST_DTYPE = "-amp", torch.bfloat16
# "-bounded": flashopm's forward (or its "-tf32" form) with its peak extra memory bounded
# (peak_memory_bound, a factor of the output's size, the output included), compared with eager.
BOUND_SUFFIX, PEAK_BOUND = "-bounded", 1.1
DEFAULT_IMPLS = ("eager", "flashopm", "compile", "compile-ro")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Which module is measured: the specification's, or the OpenFold / Boltz convention (flashopm's
# module next to the pure-PyTorch einsum formulation of that model, and its chunked form).
MODULES = ("spec", "openfold", "boltz")
CHUNK_SIZE = 4  # OpenFold's default chunk size
# What one timed call does: the forward; the backward alone (through one retained forward graph);
# or a training step's forward and backward.  Gradients: msa_repr and every parameter.
MODES = ("forward", "backward", "training")
# FLOPs of a call relative to the forward's: the backward of each contraction is two of its size.
MODE_FLOPS = {"forward": 1.0, "backward": 2.0, "training": 3.0}


def _models(shape: Shape, p: dict, dtype: torch.dtype, module: str = "spec", device: str = "cuda"):
    """The reference module with the problem's parameters, and flashopm's with the same state."""
    from .modules import BoltzOuterProductMean, OpenFoldOuterProductMean
    from .reference import BoltzOuterProductMeanReference, OpenFoldOuterProductMeanReference

    C, H, D = shape.C, shape.H, shape.D
    if module == "spec":
        ref, new = Model(C, D, H), ModelNew(C, D, H)
        layers = (ref.layer_norm, ref.proj_a, ref.proj_b, ref.out_proj)
    elif module == "openfold":
        ref, new = OpenFoldOuterProductMeanReference(C, D, H), OpenFoldOuterProductMean(C, D, H)
        layers = (ref.layer_norm, ref.linear_1, ref.linear_2, ref.linear_out)
    elif module == "boltz":
        ref, new = BoltzOuterProductMeanReference(C, H, D), BoltzOuterProductMean(C, H, D)
        layers = (ref.norm, ref.proj_a, ref.proj_b, ref.proj_o)
    else:
        raise SystemExit(f"--module: expected one of {', '.join(MODULES)}, got {module!r}")
    with torch.no_grad():
        for mod, (w, b) in zip(layers, (("ln_weight", "ln_bias"), ("w_a", "b_a"), ("w_b", "b_b"), ("w_out", "b_out"))):
            mod.weight.copy_(p[w])
            if mod.bias is not None:
                mod.bias.copy_(p[b])
    ref = ref.to(device=device, dtype=dtype)
    new.load_state_dict(ref.state_dict())
    return ref, new.to(device=device, dtype=dtype)


@contextlib.contextmanager
def _matmul_precision(precision: str):
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def _with_matmul_precision(fn, precision: str):
    def call(x, m):
        with _matmul_precision(precision):
            return fn(x, m)

    call.matmul_precision, call.inner = precision, fn
    return call


def _with_autocast(fn, dtype: torch.dtype):
    def call(x, m):
        with torch.autocast("cuda", dtype=dtype):
            return fn(x, m)

    call.autocast_dtype = dtype
    return call


def _with_peak_bound(fn, factor: float):
    def call(x, m):
        with peak_memory_bound(factor):
            return fn(x, m)

    return call


def _callable(impl: str, ref, new, dtype: torch.dtype = torch.float32):
    if impl.endswith(BOUND_SUFFIX):
        inner = _callable(impl[: -len(BOUND_SUFFIX)], ref, new, dtype)
        return None if inner is None else _with_peak_bound(inner, PEAK_BOUND)
    if impl.endswith(AUTOCAST_SUFFIX):
        if dtype != torch.float32:
            return None  # a float32 model's mixed precision
        return _with_autocast(_callable(impl[: -len(AUTOCAST_SUFFIX)], ref, new), AUTOCAST_DTYPE)
    for suffix, precision in PRECISION_SUFFIXES.items():
        if impl.endswith(suffix):
            if dtype != torch.float32:
                return None  # a float32 setting
            return _with_matmul_precision(_callable(impl[: -len(suffix)], ref, new), precision)
    if impl == "flashopm":
        return new
    if impl == "eager":
        return ref
    if impl == "chunked":
        if isinstance(ref, Model):
            return None  # the specification's module has no chunked form
        return lambda x, m: ref(x, m, chunk_size=CHUNK_SIZE)
    if impl == "compile":
        return torch.compile(ref)
    if impl == "compile-ro":
        return torch.compile(ref, mode="reduce-overhead")
    raise SystemExit(f"--impls: unknown implementation {impl!r}; expected some of {', '.join(IMPLS)}")


def _grads_reference64(shape: Shape, x, m, p: dict, grad_out, normalization: int) -> list[torch.Tensor]:
    """Float64 gradients of (msa_repr, then the parameters present) through the reference."""
    from .reference import outer_product_mean_reference

    leaves = {"x": x.detach().double().requires_grad_()}
    leaves.update({k: v.detach().double().cuda().requires_grad_() for k, v in p.items() if v is not None})
    get = lambda k: leaves.get(k)  # noqa: E731
    out = outer_product_mean_reference(leaves["x"], m.double(), get("ln_weight"), get("ln_bias"), get("w_a"),
                                       get("b_a"), get("w_b"), get("b_b"), get("w_out"), get("b_out"), 1e-5,
                                       normalization, 1e-3)
    return list(torch.autograd.grad(out, list(leaves.values()), grad_out.double()))


def _grads_error(grads, ref64) -> float:
    """Normwise relative error of all gradients together."""
    num = sum(float((g.double() - r).norm() ** 2) for g, r in zip(grads, ref64))
    den = sum(float(r.norm() ** 2) for r in ref64)
    return (num / max(den, 1e-300)) ** 0.5


def _timed_call(fn, x, m, mode: str, leaves: list, grad_out):
    precision = getattr(fn, "matmul_precision", None)
    if precision is not None and mode != "forward":
        # The whole step under the setting: PyTorch reads it when each matmul runs, the backward's too.
        with _matmul_precision(precision):
            step = _timed_call(fn.inner, x, m, mode, leaves, grad_out)

        def step_under_precision():
            with _matmul_precision(precision):
                return step()

        return step_under_precision
    if mode == "forward":
        return lambda: fn(x, m)
    if getattr(fn, "autocast_dtype", None) is not None:
        grad_out = grad_out.to(fn.autocast_dtype)  # the output's type
    if mode == "training":
        return lambda: torch.autograd.grad(fn(x, m), leaves, grad_out)
    out = fn(x, m)  # the backward alone, through this graph each time
    return lambda: torch.autograd.grad(out, leaves, grad_out, retain_graph=True)


def bench_shape(shape: Shape, impls: list[str], n_calls: int, fp64_max_n: int, dtype: torch.dtype,
                progress=None, module: str = "spec", mode: str = "forward", flush_l2: bool = True) -> list[dict]:
    """One row per implementation: wall and graph time, memory, error, TFLOP/s (or a status).  Wall
    times are taken after a synchronize, and after an L2 flush where `flush_l2`."""
    from .bench import is_oom, paired_speedup, peak_extra_bytes, time_graph_amortised, time_wall, warm_gpu

    x, m, p = make_problem(shape, "masked_positions", seed=0)
    ref, new = _models(shape, p, dtype, module)
    normalization = NORMALIZATIONS["row" if module == "spec" else module]
    if module == "boltz":
        p = dict(p, b_a=None, b_b=None)
    x, m = x.to("cuda", dtype), m.to("cuda", dtype)
    inputs_bytes = sum(t.numel() * t.element_size() for t in (x, m, *ref.parameters()))
    grad_out = None
    if mode != "forward":
        x.requires_grad_()
        grad_out = torch.randn(shape.B, shape.N, shape.N, shape.D, device="cuda",
                               generator=torch.Generator("cuda").manual_seed(1)).to(dtype)
    ref64 = None
    if shape.N <= fp64_max_n:
        if mode == "forward":
            ref64 = reference(x.double(), m.double(), {k: None if v is None else v.cuda() for k, v in p.items()},
                              dtype=torch.float64, normalization=normalization)
        else:
            ref64 = _grads_reference64(shape, x, m, p, grad_out, normalization)
    rows, eager_out, calls = [], None, {}
    for impl in impls:
        if progress:
            progress(f"{shape} {impl}")
        row = {"shape": str(shape), **shape.__dict__, "impl": impl, "dtype": str(dtype).replace("torch.", ""),
               "module": module, "mode": mode}
        fn = _callable(impl, ref, new, dtype)
        if fn is None or (mode != "forward" and impl == "compile-ro"):
            continue  # reduce-overhead: forward only here
        owner = new if impl.startswith("flashopm") else ref
        leaves = [x, *owner.parameters()]
        try:
            with torch.set_grad_enabled(mode != "forward"):
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                extra, out = peak_extra_bytes(_timed_call(fn, x, m, mode, leaves, grad_out))
                out = out.clone() if mode == "forward" else [g.detach().clone() for g in out]
                call = _timed_call(fn, x, m, mode, leaves, grad_out)
                warm_gpu()
                wall = time_wall(call, n=n_calls, warmup=3, flush_l2=flush_l2)
                # GPU time without host gaps matters for short calls only (and 100 replays of a long one
                # would take minutes)
                graph, graph_calls = (time_graph_amortised(call)
                                      if mode == "forward" and impl.startswith(("flashopm", "eager"))
                                      and wall.median_us < 20_000 else (None, 0))
                if impl.startswith(("flashopm", "eager")) and mode != "backward" and wall.median_us < 20_000:
                    calls[impl] = call  # for the paired timing below (these closures hold no tensors of their own)
                del call
        except Exception as exc:  # a peer's OOM or unsupported dtype is a result; anything else is a bug
            if is_oom(exc):
                row.update(status="OOM")
            elif impl == "flashopm" and dtype != torch.float32 and "float32" in str(exc):
                row.update(status="unsupported dtype")
            else:
                raise
            torch.cuda.empty_cache()
            rows.append(row)
            continue
        if impl == "eager":
            eager_out = out
        out_itemsize = AUTOCAST_DTYPE.itemsize if impl.endswith(AUTOCAST_SUFFIX) else x.element_size()
        row.update(
            status="ok",
            calls=wall.n,
            wall_us=wall.median_us,
            wall_p10_us=wall.p10_us,
            wall_p90_us=wall.p90_us,
            graph_us=graph.median_us if graph else None,
            graph_calls=graph_calls if graph else None,
            peak_bytes=extra + inputs_bytes,  # what one call holds in a fresh process
            peak_extra_bytes=extra,
            extra_over_output=extra / (shape.out_bytes * out_itemsize / 4),
            tflops=MODE_FLOPS[mode] * shape.flops / (wall.median_us * 1e-6) / 1e12,
        )
        if ref64 is not None:
            if mode == "forward":
                row.update(rel_err_fp64=rel_error(out, ref64), max_abs_err_fp64=max_abs_error(out, ref64))
            else:
                row.update(rel_err_fp64=_grads_error(out, ref64))
        # allclose(1e-4) to eager is a float32 criterion; in half types err64 says more (eager's own
        # error there is ~1e-2)
        if eager_out is not None and impl != "eager" and dtype == torch.float32 and not impl.endswith(AUTOCAST_SUFFIX):
            outs, refs = (out, eager_out) if mode != "forward" else ([out], [eager_out])
            row["allclose_eager_1e-4"] = all(
                bool(torch.allclose(a.float(), b.float(), atol=1e-4, rtol=1e-4)) for a, b in zip(outs, refs))
        del out
        rows.append(row)
    # Speed-up over eager from calls timed in alternation (bench.paired_speedup), for calls under
    # 20 ms: the blocks of calls above meet the host at different moments, which moves the ratio of
    # short calls by more than the kernels do.
    for row in rows:
        impl = row["impl"]
        base = _eager_peer(impl)
        if impl.startswith("flashopm") and impl in calls and base in calls and row.get("status") == "ok":
            with torch.set_grad_enabled(mode != "forward"):
                row["x_eager_paired"] = paired_speedup(calls[base], calls[impl], n=n_calls, flush_l2=flush_l2)
    calls.clear()
    del eager_out, ref64
    torch.cuda.empty_cache()
    return rows


def cmd_bench(args) -> int:
    if not torch.cuda.is_available():
        print("flashopm bench: needs a CUDA GPU")
        return 2
    from .bench import gemm_tflops, time_wall
    from .plot import render

    dtype = DTYPES[args.dtype]
    impls = args.impls.split(",") if args.impls else list(DEFAULT_IMPLS) + (["chunked"] if args.module != "spec" else [])
    for impl in impls:
        if impl not in IMPLS:
            raise SystemExit(f"--impls: unknown implementation {impl!r}; expected some of {', '.join(IMPLS)}")
    shapes = _parse_shapes(args.shapes)
    env = environment()
    env["dtype"] = args.dtype
    env["module"] = args.module
    env["mode"] = args.mode
    env["l2_flush"] = not args.no_l2_flush
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    _build.load()
    dummy = torch.empty(1, device="cuda")
    env["empty_extension_call_us"] = time_wall(lambda: torch.ops.flashopm._noop.default(dummy), n=200,
                                               flush_l2=env["l2_flush"]).median_us
    # The ceilings every rate below is read against, measured now on this GPU (cuBLAS, 8192^3).
    env["gemm_tflops"] = {
        "fp32": gemm_tflops(torch.float32),
        "tf32": gemm_tflops(torch.float32, tf32=True),
        "bf16": gemm_tflops(torch.bfloat16),
    }
    total, done = len(shapes) * len(impls), [0]

    def progress(what: str) -> None:
        done[0] += 1
        width = 30
        filled = width * done[0] // total
        print(f"\r[{'#' * filled}{'.' * (width - filled)}] {done[0]}/{total} {what:48s}", end="", file=sys.stderr,
              flush=True)

    rows = []
    results = {"environment": env, "results": rows}
    for shape in shapes:
        rows += bench_shape(shape, impls, args.calls, args.fp64_max_n, dtype, progress, args.module, args.mode,
                            env["l2_flush"])
        _write_results(results, out_dir)  # after every shape: a run cut short keeps what it measured
    print(file=sys.stderr)
    render(results, out_dir / "results.png")
    g = env["gemm_tflops"]
    timing = "after an L2 flush and a synchronize" if env["l2_flush"] else "after a synchronize"
    print(f"{env['gpu']}, torch {env['torch']} (CUDA {env['cuda']}), {env['date']}, {args.dtype}, {args.mode}; "
          f"wall {timing}; empty extension call {env['empty_extension_call_us']:.1f} us; GEMM ceilings (cuBLAS) "
          f"fp32 {g['fp32']:.1f}, tf32 {g['tf32']:.1f}, bf16 {g['bf16']:.1f} TFLOP/s")
    print(_table(rows))
    print(f"wrote {out_dir / 'results.json'}, results.csv, results.png")
    return 0


def _write_results(results: dict, out_dir: Path) -> None:
    rows = results["results"]
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(out_dir / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def cmd_bench_sharded(args) -> int:
    from .bench_sharded import cases_for, run, table

    if args.backend == "nccl" and not torch.cuda.is_available():
        print("flashopm bench-sharded: the nccl backend needs CUDA GPUs (--backend gloo runs on CPU processes)")
        return 2
    worlds = [int(v) for v in args.worlds.split(",")]
    sizes = [int(v) for v in args.sizes.split(",")]
    rows = run(cases_for(worlds, sizes, args.S, args.C, args.H, args.D), args.backend, args.calls)
    env = environment()
    env.update(backend=args.backend, gpus=torch.cuda.device_count() if torch.cuda.is_available() else 0)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "sharded.json").write_text(json.dumps({"environment": env, "results": rows}, indent=1))
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(out_dir / "sharded.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    print(f"{env['gpu']}, torch {env['torch']}, {env['date']}, backend {args.backend}, float32")
    print(table(rows))
    print(f"wrote {out_dir / 'sharded.json'}, sharded.csv")
    return 0


def cmd_export(args) -> int:
    from .export import export_kernelbench

    print(f"wrote {export_kernelbench(args.path)}")
    return 0


def cmd_plot(args) -> int:
    from .plot import render

    results = json.loads(Path(args.results).read_text())
    out = args.out or str(Path(args.results).with_suffix(".png"))
    print(f"wrote {render(results, out)}")
    return 0


def _fmt_row(r: dict, eager_us: float | None = None) -> str:
    if r.get("status") != "ok":
        return f"{r['shape']:28s} {r['impl']:13s} {r.get('status')}"
    g = f"{r['graph_us']:10.2f}" if r.get("graph_us") else f"{'-':>10s}"
    e = f"{r['rel_err_fp64']:.1e}" if "rel_err_fp64" in r else "-"
    sp = f"{eager_us / r['wall_us']:6.2f}" if eager_us else f"{'-':>6s}"
    pp = f"{r['x_eager_paired']:6.2f}" if "x_eager_paired" in r else f"{'-':>6s}"
    ok = {True: "yes", False: "NO"}.get(r.get("allclose_eager_1e-4"), "-")
    return (f"{r['shape']:28s} {r['impl']:13s} {r['wall_us']:11.1f} {sp} {pp} {g} {r['peak_bytes'] / 2**30:8.2f} "
            f"{r['extra_over_output']:6.2f} {r['tflops']:7.2f} {e:>8s} {ok:>5s}")


def _table(rows: list[dict]) -> str:
    head = (f"{'shape':28s} {'impl':13s} {'wall us':>11s} {'x eag':>6s} {'paired':>6s} {'graph us':>10s} {'peak GiB':>8s} "
            f"{'x out':>6s} {'TFLOP/s':>7s} {'err64':>8s} {'1e-4':>5s}")
    eager = {(r["shape"], r["impl"]): r["wall_us"] for r in rows if r["impl"].startswith("eager") and r.get("status") == "ok"}
    return "\n".join([head] + [_fmt_row(r, eager.get((r["shape"], _eager_peer(r["impl"])))) for r in rows])


def _eager_peer(impl: str) -> str:
    """The eager row a row is compared with: flashopm-tf32 with eager-tf32, the autocast rows with
    eager-amp, the others with eager."""
    if impl.endswith(AUTOCAST_SUFFIX):
        return "eager" + AUTOCAST_SUFFIX
    if impl.endswith(BOUND_SUFFIX):
        return "eager"
    return "eager" + impl[len("flashopm"):] if impl.startswith("flashopm") else "eager"


def _describe_code(archs: list[str], capability: tuple[int, int]) -> str:
    """What a build for `archs` runs on a GPU of `capability`, in words."""
    found = _build.code_for_device(archs, capability)
    cc = f"{capability[0]}.{capability[1]}"
    if found is None:
        return f"nothing: no target in the list runs on compute capability {cc}; add {cc} to it"
    arch, kind = found
    what = f"sm_{arch}{'a' if arch == 90 and kind == 'sass' else ''} machine code" if kind == "sass" else \
        f"compute_{arch} PTX, compiled by the driver"
    if arch < 10 * capability[0] + capability[1]:
        what += f" (older than the GPU's {cc}: forms that need newer instructions stay off)"
    return what


def cmd_build(args) -> int:
    if args.arch_list:
        os.environ["FLASHOPM_CUDA_ARCH_LIST"] = args.arch_list
    try:
        print(_build.load(verbose=args.verbose))
    except _build.BuildError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


def cmd_info(args) -> int:
    env = environment()
    for k, v in env.items():
        print(f"{k:12s} {v}")
    print(f"{'cache':12s} {_build.cache_root()}")
    try:
        home = _build.check_toolchain()
        print(f"{'nvcc':12s} {home} (CUDA {'.'.join(map(str, _build.nvcc_version(home)))})")
        archs = _build.arch_list()
        name = _build.extension_name(_build.read_sources(), archs)
        built = (_build.cache_root() / name / f"{name}.so").exists()
        print(f"{'extension':12s} {name} ({'built' if built else 'not built yet'})")
        print(f"{'archs':12s} {';'.join(archs)} ({' '.join(_build.gencode_flags(archs))})")
        if torch.cuda.is_available():
            print(f"{'runs here':12s} {_describe_code(archs, torch.cuda.get_device_capability())}")
            if built:  # what the loaded code reports (loading builds nothing here)
                _build.load()
                _, _, arch, wgmma, fused_bwd, smem = torch.ops.flashopm._device_code(torch.empty(0, device="cuda"))
                print(f"{'loaded':12s} kernels for sm_{arch}, warpgroup MMAs {'on' if wgmma else 'off'}, fused "
                      f"backward {'on' if fused_bwd else 'off'}, {smem} bytes of shared memory per block")
    except _build.BuildError as exc:
        print(f"{'toolchain':12s} {exc}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="flashopm", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd")
    c = sub.add_parser("check", help="check ModelNew against the reference (and time the spec shape)")
    c.add_argument("--seeds", type=int, default=5)
    b = sub.add_parser("bench", help="benchmark next to eager PyTorch and torch.compile")
    b.add_argument("--shapes", help='"B,S,N,C,H,D;..." (default: spec and AlphaFold-scale shapes)')
    b.add_argument("--impls", help=f"some of {','.join(IMPLS)} (default: all that apply)")
    b.add_argument("--module", default="spec", choices=MODULES,
                   help="the specification's module, or the OpenFold / Boltz convention")
    b.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    b.add_argument("--mode", default="forward", choices=MODES,
                   help="time the forward, the backward alone, or forward and backward (a training step)")
    b.add_argument("--calls", type=int, default=100, help="timed calls per implementation and shape")
    b.add_argument("--no-l2-flush", action="store_true",
                   help="time each call after a synchronize alone (by default also after writing a buffer "
                        "twice the L2 cache, as KernelBench does)")
    b.add_argument("--fp64-max-n", type=int, default=768, help="largest N checked against an fp64 reference")
    b.add_argument("--out", default="bench-results")
    bs = sub.add_parser("bench-sharded", help="scaling of the residue-sharded OPM over processes")
    bs.add_argument("--worlds", default="1,2,4,8", help="process counts (one GPU each with nccl)")
    bs.add_argument("--sizes", default="4096,8192", help="N of the strong series and the start of the weak ones")
    bs.add_argument("--S", type=int, default=512)
    bs.add_argument("--C", type=int, default=256)
    bs.add_argument("--H", type=int, default=32)
    bs.add_argument("--D", type=int, default=128)
    bs.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    bs.add_argument("--calls", type=int, default=3, help="timed calls per case")
    bs.add_argument("--out", default="bench-sharded")
    e = sub.add_parser("export-kernelbench", help="write a self-contained ModelNew file")
    e.add_argument("path")
    pl = sub.add_parser("plot", help="redraw the chart of a results.json")
    pl.add_argument("results")
    pl.add_argument("--out", help="PNG path (default: next to the JSON)")
    sub.add_parser("info", help="GPU, versions and build cache")
    bd = sub.add_parser("build", help="build the CUDA extension into the cache now (where nvcc is), for the "
                                      "architectures of --arch-list, else FLASHOPM_CUDA_ARCH_LIST, "
                                      "TORCH_CUDA_ARCH_LIST or this GPU")
    bd.add_argument("--arch-list", help='e.g. "8.0;9.0": FLASHOPM_CUDA_ARCH_LIST for this build (set the same '
                                        "where it is loaded, or it looks for a build of its own list)")
    bd.add_argument("--verbose", action="store_true", help="show the compiler's commands")
    args = parser.parse_args(argv)
    if args.cmd is None:
        args = parser.parse_args(["check", *(argv or sys.argv[1:])])
    commands = {"check": cmd_check, "bench": cmd_bench, "bench-sharded": cmd_bench_sharded,
                "export-kernelbench": cmd_export, "plot": cmd_plot, "info": cmd_info, "build": cmd_build}
    return commands[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
