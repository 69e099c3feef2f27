"""Command line: `python -m flashopm [check|bench|info]`.

check  the KernelBench protocol on the specification (seeded modules, several seeds, random masks),
       then the spec shape's speed next to eager PyTorch; on a machine without a GPU, the CPU path.
bench  flashopm next to eager PyTorch (and torch.compile) at the spec and AlphaFold-scale shapes;
       writes results.json / results.csv to --out.
info   GPU, versions, build cache.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import platform
import sys
from pathlib import Path

import torch

from . import _build
from .modules import ModelNew
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


def bench_shape(shape: Shape, impls: list[str], n_calls: int, fp64_max_n: int) -> list[dict]:
    from .bench import is_oom, peak_extra_bytes, time_graph, time_wall, warm_gpu

    x, m, p = make_problem(shape, "ones", seed=0)
    torch.manual_seed(0)
    ref = Model(shape.C, shape.D, shape.H)
    with torch.no_grad():
        for mod, (w, b) in (
            (ref.layer_norm, ("ln_weight", "ln_bias")),
            (ref.proj_a, ("w_a", "b_a")),
            (ref.proj_b, ("w_b", "b_b")),
            (ref.out_proj, ("w_out", "b_out")),
        ):
            mod.weight.copy_(p[w])
            mod.bias.copy_(p[b])
    ref = ref.cuda()
    new = ModelNew(shape.C, shape.D, shape.H).cuda()
    new.load_state_dict(ref.state_dict())
    x, m = x.cuda(), m.cuda()
    ref64 = None
    if shape.N <= fp64_max_n:
        ref64 = reference(x, m, {k: v.cuda() for k, v in p.items()}, dtype=torch.float64)
    n = max(5, min(n_calls, int(2e6 / max(1.0, shape.flops / 1e6))))  # fewer calls for big shapes
    rows, eager_out = [], None
    for impl in impls:
        fn = {"flashopm": new, "eager": ref}.get(impl)
        if impl == "compile":
            fn = torch.compile(ref)
        row = {"shape": str(shape), **shape.__dict__, "impl": impl}
        try:
            with torch.no_grad():
                extra, out = peak_extra_bytes(lambda: fn(x, m))
                warm_gpu()
                wall = time_wall(lambda: fn(x, m), n=n, warmup=2)
                graph = time_graph(lambda: fn(x, m), n=min(n, 20)) if impl != "compile" else None
        except Exception as exc:  # report OOM as a result, re-raise anything else
            if not is_oom(exc):
                raise
            torch.cuda.empty_cache()
            row.update(status="OOM")
            rows.append(row)
            continue
        if impl == "eager":
            eager_out = out
        row.update(
            status="ok",
            wall_us=wall.median_us,
            wall_p10_us=wall.p10_us,
            wall_p90_us=wall.p90_us,
            graph_us=graph.median_us if graph else None,
            peak_extra_bytes=extra,
            extra_over_output=extra / shape.out_bytes,
            tflops=shape.flops / (wall.median_us * 1e-6) / 1e12,
        )
        if ref64 is not None:
            row.update(rel_err_fp64=rel_error(out, ref64), max_abs_err_fp64=max_abs_error(out, ref64))
        if eager_out is not None and impl != "eager":
            row["allclose_eager_1e-4"] = bool(torch.allclose(out, eager_out, atol=1e-4, rtol=1e-4))
        del out
        rows.append(row)
    del eager_out, ref64
    torch.cuda.empty_cache()
    return rows


def cmd_bench(args) -> int:
    if not torch.cuda.is_available():
        print("flashopm bench: needs a CUDA GPU")
        return 2
    from .bench import time_wall

    env = environment()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    _build.load()
    dummy = torch.empty(1, device="cuda")
    env["empty_extension_call_us"] = time_wall(lambda: torch.ops.flashopm._noop(dummy), n=200).median_us
    impls = args.impls.split(",")
    rows = []
    for shape in _parse_shapes(args.shapes):
        rows += bench_shape(shape, impls, args.calls, args.fp64_max_n)
        for r in rows[-len(impls):]:
            print(_fmt_row(r), flush=True)
    (out_dir / "results.json").write_text(json.dumps({"environment": env, "results": rows}, indent=1))
    keys = sorted({k for r in rows for k in r})
    with open(out_dir / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    print(f"\n{env['gpu']}, torch {env['torch']} (CUDA {env['cuda']}), {env['date']}; "
          f"empty extension call {env['empty_extension_call_us']:.1f} us")
    print(_table(rows))
    return 0


def _fmt_row(r: dict) -> str:
    if r.get("status") != "ok":
        return f"{r['shape']:28s} {r['impl']:9s} {r.get('status')}"
    g = f"{r['graph_us']:10.1f}" if r.get("graph_us") else f"{'-':>10s}"
    e = f"{r['rel_err_fp64']:.1e}" if "rel_err_fp64" in r else "-"
    return (f"{r['shape']:28s} {r['impl']:9s} {r['wall_us']:11.1f} {g} {r['peak_extra_bytes'] / 2**20:10.1f} "
            f"{r['extra_over_output']:6.2f} {r['tflops']:7.2f} {e:>8s}")


def _table(rows: list[dict]) -> str:
    head = (f"{'shape':28s} {'impl':9s} {'wall us':>11s} {'graph us':>10s} {'extra MiB':>10s} {'x out':>6s} "
            f"{'TFLOP/s':>7s} {'err64':>8s}")
    return "\n".join([head] + [_fmt_row(r) for r in rows])


def cmd_info(args) -> int:
    env = environment()
    for k, v in env.items():
        print(f"{k:12s} {v}")
    print(f"{'cache':12s} {_build.cache_root()}")
    try:
        home = _build.check_toolchain()
        print(f"{'nvcc':12s} {home} (CUDA {'.'.join(map(str, _build.nvcc_version(home)))})")
        name = _build.extension_name(_build.read_sources(), _build.arch_list())
        built = (_build.cache_root() / name / f"{name}.so").exists()
        print(f"{'extension':12s} {name} ({'built' if built else 'not built yet'})")
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
    b.add_argument("--impls", default="flashopm,eager,compile")
    b.add_argument("--calls", type=int, default=100)
    b.add_argument("--fp64-max-n", type=int, default=768, help="largest N checked against an fp64 reference")
    b.add_argument("--out", default="bench-results")
    sub.add_parser("info", help="GPU, versions and build cache")
    args = parser.parse_args(argv)
    if args.cmd is None:
        args = parser.parse_args(["check", *(argv or sys.argv[1:])])
    return {"check": cmd_check, "bench": cmd_bench, "info": cmd_info}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
