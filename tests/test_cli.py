"""The command line's pieces: the KernelBench export, the chart, the argument parsing."""
import ast
import inspect
import json
import os
import re
import struct

import pytest
import torch

import flashopm
from conftest import requires_cuda
from flashopm.__main__ import _parse_shapes, main
from flashopm.export import export_kernelbench
from flashopm.plot import render
from flashopm.testing import Shape


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return export_kernelbench(tmp_path_factory.mktemp("kb") / "model_new.py")


def test_export_is_self_contained_and_harness_safe(exported):
    text = exported.read_text()
    tree = ast.parse(text)
    assert not re.search(r"try|except|pass", text), "harnesses reject these words anywhere in the file"
    imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = {a.name for n in imports for a in n.names} | {n.module for n in imports if isinstance(n, ast.ImportFrom)}
    assert not any(name and name.startswith("flashopm") for name in names)
    calls = [n for n in tree.body if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)]
    assert any(getattr(c.value.func, "id", None) == "load_inline" for c in calls), "load_inline at module level"
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    assert "ModelNew" in classes
    methods = {f.name: f for f in classes["ModelNew"].body if isinstance(f, ast.FunctionDef)}
    init_args = [a.arg for a in methods["__init__"].args.args]
    assert init_args == ["self", "msa_dim", "pair_dim", "hidden_dim"]
    assert ast.literal_eval(methods["__init__"].args.defaults[0]) == 32
    assert [a.arg for a in methods["forward"].args.args] == ["self", "msa_repr", "msa_mask"]
    # the same signature as the package's ModelNew
    assert list(inspect.signature(flashopm.ModelNew.__init__).parameters) == init_args


@requires_cuda
def test_export_runs_like_the_reference(exported):
    namespace = {"__name__": "kernelbench_model_new"}
    exec(compile(exported.read_text(), str(exported), "exec"), namespace)
    for seed in range(2):
        torch.manual_seed(seed)
        ref = flashopm.Model(*flashopm.get_init_inputs()).cuda()
        torch.manual_seed(seed)
        new = namespace["ModelNew"](*flashopm.get_init_inputs()).cuda()
        x, m = [t.cuda() for t in flashopm.get_inputs()]
        m[:, :, 3] = 0.0
        torch.testing.assert_close(new(x, m), ref(x, m), atol=1e-4, rtol=1e-4)


def test_plot_writes_a_png(tmp_path):
    rows = []
    for shape in (Shape(2, 8, 32, 64, 32, 64), Shape(1, 128, 256, 256, 32, 128)):
        for impl, wall, extra in (("flashopm", 50.0, 1.2), ("eager", 400.0, 17.0), ("compile", 300.0, 9.0)):
            rows.append({"shape": str(shape), **shape.__dict__, "impl": impl, "status": "ok", "wall_us": wall,
                         "extra_over_output": extra})
    rows.append({"shape": "x", "B": 1, "S": 512, "N": 8192, "C": 1, "H": 1, "D": 1, "impl": "eager",
                 "status": "OOM"})
    env = {"gpu": "Test GPU", "torch": torch.__version__, "date": "2026-11-29"}
    path = render({"environment": env, "results": rows}, tmp_path / "r.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert width >= 900 and height == 760


def test_parse_shapes():
    assert _parse_shapes("1,2,3,4,5,6; (2,8,32,64,32,64)") == [Shape(1, 2, 3, 4, 5, 6), Shape(2, 8, 32, 64, 32, 64)]
    with pytest.raises(SystemExit, match="expected B,S,N,C,H,D"):
        _parse_shapes("1,2,3")


def test_benchmark_times_the_wall_without_the_l2_flush_when_asked(tmp_path):
    """--no-l2-flush: each call timed after a synchronize alone (CUDA events around it); the results
    say which way the wall was taken.  Without a GPU the command says it needs one."""
    code = main(["bench", "--no-l2-flush", "--shapes", "1,2,5,8,8,4", "--impls", "eager,flashopm", "--calls", "3",
                 "--out", str(tmp_path)])
    if not torch.cuda.is_available():
        assert code == 2
        return
    assert code == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["environment"]["l2_flush"] is False
    assert [r["impl"] for r in results["results"]] == ["eager", "flashopm"]


def test_info_runs_anywhere(capsys):
    assert main(["info"]) == 0
    assert "torch" in capsys.readouterr().out


def test_info_says_what_the_build_runs_on_a_gpu():
    from flashopm.__main__ import _describe_code

    assert _describe_code(["9.0"], (9, 0)) == "sm_90a machine code"
    assert _describe_code(["8.0", "8.6"], (8, 9)) == "sm_86 machine code (older than the GPU's 8.9: forms that need newer instructions stay off)"
    assert _describe_code(["8.0+PTX"], (9, 0)).startswith("compute_80 PTX, compiled by the driver (older than")
    assert _describe_code(["9.0"], (10, 0)) == "nothing: no target in the list runs on compute capability 10.0; add 10.0 to it"


@pytest.mark.parametrize("module", ["spec", "openfold", "boltz"])
def test_benchmark_builds_matching_implementations(module):
    """The modules the benchmark times compute the same function (on the CPU here)."""
    from flashopm.__main__ import _callable, _models
    from flashopm.testing import make_problem

    shape = Shape(1, 4, 9, 12, 3, 5)
    x, m, p = make_problem(shape, "masked_positions", seed=0)
    ref, new = _models(shape, p, torch.float32, module, device="cpu")
    expect = ref(x, m)
    for impl in ("flashopm", "chunked"):
        fn = _callable(impl, ref, new)
        if fn is None:
            assert module == "spec" and impl == "chunked"
            continue
        torch.testing.assert_close(fn(x, m), expect, rtol=1e-4, atol=1e-4)


def test_benchmark_bounded_row_sets_the_bound_for_its_call_only(monkeypatch):
    """flashopm-bounded runs flashopm's module under peak_memory_bound (FLASHOPM_PEAK_BOUND set for the
    call alone), and is compared with eager."""
    from flashopm.__main__ import PEAK_BOUND, _callable, _eager_peer, _models
    from flashopm.testing import make_problem

    shape = Shape(1, 4, 9, 12, 3, 5)
    x, m, p = make_problem(shape, "masked_positions", seed=0)
    ref, new = _models(shape, p, torch.float32, "spec", device="cpu")
    seen = []
    monkeypatch.setattr(new, "forward", lambda *a: seen.append(os.environ.get("FLASHOPM_PEAK_BOUND")) or ref(*a))
    monkeypatch.setenv("FLASHOPM_PEAK_BOUND", "2.5")
    torch.testing.assert_close(_callable("flashopm-bounded", ref, new)(x, m), ref(x, m))
    assert seen == [repr(PEAK_BOUND)] and os.environ["FLASHOPM_PEAK_BOUND"] == "2.5"
    monkeypatch.delenv("FLASHOPM_PEAK_BOUND")
    _callable("flashopm-bounded", ref, new)(x, m)
    assert seen == [repr(PEAK_BOUND)] * 2 and "FLASHOPM_PEAK_BOUND" not in os.environ
    assert _eager_peer("flashopm-bounded") == "eager"


def test_benchmark_tf32_bounded_row_sets_both(monkeypatch):
    """flashopm-tf32-bounded runs flashopm's module under "high" precision and the peak bound
    together, and is compared with eager float32 (issue figures: TF32 against eager float32)."""
    from flashopm.__main__ import PEAK_BOUND, _callable, _eager_peer, _models
    from flashopm.testing import make_problem

    shape = Shape(1, 4, 9, 12, 3, 5)
    x, m, p = make_problem(shape, "masked_positions", seed=0)
    ref, new = _models(shape, p, torch.float32, "spec", device="cpu")
    seen = []
    monkeypatch.setattr(new, "forward", lambda *a: seen.append(
        (os.environ.get("FLASHOPM_PEAK_BOUND"), torch.get_float32_matmul_precision())) or ref(*a))
    before = torch.get_float32_matmul_precision()
    torch.testing.assert_close(_callable("flashopm-tf32-bounded", ref, new)(x, m), ref(x, m))
    assert seen == [(repr(PEAK_BOUND), "high")]
    assert torch.get_float32_matmul_precision() == before and "FLASHOPM_PEAK_BOUND" not in os.environ
    assert _callable("flashopm-tf32-bounded", ref, new, torch.bfloat16) is None
    assert _eager_peer("flashopm-tf32-bounded") == "eager"


@pytest.mark.parametrize("mode", ["backward", "training"])
def test_benchmark_gradient_modes_match_the_reference(mode):
    """The calls the benchmark times in its gradient modes give the reference's gradients (CPU)."""
    from flashopm.__main__ import _callable, _models, _timed_call
    from flashopm.testing import make_problem

    shape = Shape(1, 3, 6, 5, 4, 3)
    x, m, p = make_problem(shape, "masked_positions", seed=1)
    x.requires_grad_()
    ref, new = _models(shape, p, torch.float32, "spec", device="cpu")
    grad_out = torch.randn(1, 6, 6, 3, generator=torch.Generator().manual_seed(2))
    grads = {}
    for impl, owner in (("eager", ref), ("flashopm", new)):
        call = _timed_call(_callable(impl, ref, new), x, m, mode, [x, *owner.parameters()], grad_out)
        grads[impl] = call()
        assert len(grads[impl]) == 1 + len(list(owner.parameters()))
    for a, b in zip(grads["eager"], grads["flashopm"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@requires_cuda
def test_benchmark_training_mode_on_gpu():
    from flashopm.__main__ import bench_shape

    rows = bench_shape(Shape(1, 4, 16, 8, 8, 8), ["eager", "flashopm"], 3, 64, torch.float32, mode="training")
    assert [r["status"] for r in rows] == ["ok", "ok"]
    eager, ours = rows
    assert ours["allclose_eager_1e-4"] and ours["rel_err_fp64"] <= 2 * eager["rel_err_fp64"] + 1e-6
