"""The extension's direct entries into flashopm::outer_product_mean (csrc/opm_python.cpp).

They must be the op, minus the schema's argument parsing: the same result bits, the same errors,
autograd, the profiler's record of the op, and NotImplemented wherever torch.ops has to decide
(tensor subclasses, __torch_function__ modes, arguments of other types).  The modules entry reads
the parameters from a module's submodules and must decline wherever they are not plain entries.
On CUDA, where no dispatcher layer has work to do, the entries call the op's CUDA kernel
themselves: that must give the same bits, and every layer (autocast, dispatch modes, the
profiler, views with a lazy negation, gradients) must still see the call.  On the CPU the entries
reach the op's CPU implementation through the dispatcher, so those tests run wherever the
extension builds (CI included); the CUDA ones on the GPU machine.
"""
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import flashopm
from flashopm import _build
from flashopm.modules import _SUBMODULES
from flashopm.ops import outer_product_mean_op
from flashopm.testing import Shape, make_problem, op_args

from conftest import requires_cuda, toolchain_or_skip


@pytest.fixture(scope="module")
def entry():
    toolchain_or_skip()
    _build.load()
    assert _build.op_entry is not None
    return _build.op_entry


def _op_args(device="cpu", shape=Shape(2, 3, 7, 17, 8, 5), mask="masked_positions", biases=True):
    args = op_args(*make_problem(shape, mask, seed=3))
    if not biases:
        args[6] = args[8] = args[10] = None
    return [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]


@pytest.mark.parametrize("biases", [True, False])
@pytest.mark.parametrize("extra", [(), (0,), (0, 1), (0, 1, 0.25), (0, 2, 1e-3, 0)])
def test_entry_matches_torch_ops_bitwise(entry, biases, extra):
    args = _op_args(biases=biases) + list(extra)
    got = entry(*args)
    assert got is not NotImplemented
    torch.testing.assert_close(got, outer_product_mean_op(*args), rtol=0, atol=0)


def test_entry_takes_parameters_and_int_eps(entry):
    args = _op_args()
    args[2] = torch.nn.Parameter(args[2])
    args[4] = 0  # the schema's float takes a Python int
    got = entry(*args)
    assert got is not NotImplemented
    torch.testing.assert_close(got, outer_product_mean_op(*args), rtol=0, atol=0)


class _Subclass(torch.Tensor):
    pass


class _Recording:
    """A mode that records the functions it sees and runs them unchanged."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def _run(self, func, args, kwargs):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


class _Recorder(_Recording, TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self._run(func, args, kwargs)


def test_entry_declines_what_torch_ops_must_decide(entry):
    args = _op_args()
    declined = [
        args[:10],  # too few arguments
        args + [0, 0, 1e-3, -1, 7],  # too many
        [args[0].as_subclass(_Subclass)] + args[1:],  # a tensor subclass
        args[:4] + [torch.tensor(1e-5)] + args[5:],  # a tensor where the schema has a float
        args[:4] + ["1e-5"] + args[5:],
        args + [1.0],  # a float where the schema has an int
        args + [True],  # bool is not int here
        args + [2**70],  # past int64
        args[:6] + [0] + args[7:],  # not a tensor or None where the schema has Tensor?
    ]
    for call_args in declined:
        assert entry(*call_args) is NotImplemented
    mode = _Recorder()
    with mode:
        assert entry(*args) is NotImplemented
    assert mode.seen == []  # declining runs nothing


def test_call_helper_sees_torch_function_modes_through_torch_ops():
    """Where the entry declines, the helper's torch.ops call reaches the mode."""
    args = _op_args()
    mode = _Recorder()
    with mode:
        out = flashopm.ops.call_outer_product_mean(*args)
    assert out.shape == (2, 7, 7, 5)
    assert torch.ops.flashopm.outer_product_mean.default in mode.seen


@pytest.mark.parametrize(
    "bad, error",
    [
        (lambda a: a.__setitem__(1, a[1][:, :, :-1]), ValueError),  # mask (B, S, N-1)
        (lambda a: a.__setitem__(0, a[0][0]), ValueError),  # msa_repr 3-D
        (lambda a: a.__setitem__(5, a[5][:, :-1]), ValueError),  # w_a (H, C-1)
        (lambda a: a.append(9), ValueError),  # algorithm 9
    ],
)
def test_entry_raises_the_ops_errors(entry, bad, error):
    args = _op_args()
    bad(args)
    with pytest.raises(error) as from_ops:
        outer_product_mean_op(*args)
    with pytest.raises(error) as from_entry:
        entry(*args)
    assert str(from_entry.value) == str(from_ops.value)


def test_entry_gradients_match_torch_ops(entry):
    args = _op_args()
    for i in (0, 2, 3, 5, 6, 7, 8, 9, 10):
        args[i].requires_grad_(True)
    grad = torch.randn(2, 7, 7, 5, dtype=torch.float64).float()
    tensors = [args[i] for i in (0, 2, 3, 5, 6, 7, 8, 9, 10)]
    from_ops = torch.autograd.grad(outer_product_mean_op(*args), tensors, grad)
    from_entry = torch.autograd.grad(entry(*args), tensors, grad)
    for g_ops, g_entry in zip(from_ops, from_entry):
        torch.testing.assert_close(g_entry, g_ops, rtol=0, atol=0)


def test_entry_under_inference_mode_and_no_grad(entry):
    args = _op_args()
    args[0].requires_grad_(True)
    with torch.inference_mode():
        out = entry(*args)
        assert out.is_inference() and not out.requires_grad
    with torch.no_grad():
        assert not entry(*args).requires_grad
    assert entry(*args).requires_grad


def test_profiler_records_the_op_through_the_entry(entry):
    args = _op_args()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        entry(*args)
    assert any(e.name == "flashopm::outer_product_mean" for e in prof.events())


# ---- the modules entry: ModelNew's parameters read from its submodules ----


def _spec_module(shape=Shape(2, 3, 7, 17, 8, 5), seed=4):
    torch.manual_seed(seed)
    model = flashopm.ModelNew(shape.C, shape.D, shape.H)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # LayerNorm's parameters off their ones and zeros
    x, m, _ = make_problem(shape, "masked_positions", seed=seed)
    return model, x, m


def _module_op_args(model):
    ln, pa, pb, po = model.layer_norm, model.proj_a, model.proj_b, model.out_proj
    return [ln.weight, ln.bias, ln.eps, pa.weight, pa.bias, pb.weight, pb.bias, po.weight, po.bias]


@pytest.mark.parametrize("extra", [(), (0,), (0, 0, 1e-3, 0)])
def test_modules_entry_matches_torch_ops_bitwise(entry, extra):
    model, x, m = _spec_module()
    got = _build.modules_entry(model._modules, _SUBMODULES, x, m, *extra)
    assert got is not NotImplemented
    expected = outer_product_mean_op(x, m, *_module_op_args(model), *extra)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    model.proj_a.bias = None  # absent biases pass as None
    model.out_proj.bias = None
    got = _build.modules_entry(model._modules, _SUBMODULES, x, m)
    torch.testing.assert_close(got, outer_product_mean_op(x, m, *_module_op_args(model)), rtol=0, atol=0)


def test_modules_entry_gradients_match_torch_ops(entry):
    model, x, m = _spec_module()
    x.requires_grad_(True)
    tensors = [x, *model.parameters()]
    grad = torch.randn(2, 7, 7, 5)
    from_entry = torch.autograd.grad(_build.modules_entry(model._modules, _SUBMODULES, x, m), tensors, grad)
    from_ops = torch.autograd.grad(outer_product_mean_op(x, m, *_module_op_args(model)), tensors, grad)
    for g_entry, g_ops in zip(from_entry, from_ops):
        torch.testing.assert_close(g_entry, g_ops, rtol=0, atol=0)


def test_modules_entry_declines_what_it_cannot_read(entry):
    from torch.nn.utils import parametrize

    class _Scale(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    model, x, m = _spec_module()
    mods = model._modules
    declined = [
        (mods, _SUBMODULES[:3], x, m),  # three names
        (mods, list(_SUBMODULES), x, m),  # not a tuple
        (mods, ("layer_norm", "proj_a", "proj_b", "missing"), x, m),
        (dict(mods), ("layer_norm", "proj_a", "proj_b", 7), x, m),
        (list(mods.values()), _SUBMODULES, x, m),  # not a dict
        (mods, _SUBMODULES, x.as_subclass(_Subclass), m),
        (mods, _SUBMODULES, x, m, 1.0),  # a float where the schema has an int
        (mods, _SUBMODULES, x, m, 0, 0, 1e-3, 0, 0),  # too many
    ]
    for call_args in declined:
        assert _build.modules_entry(*call_args) is NotImplemented
    no_ln_bias = flashopm.ModelNew(17, 5, 8)
    no_ln_bias.layer_norm.bias = None
    assert _build.modules_entry(no_ln_bias._modules, _SUBMODULES, x, m) is NotImplemented
    string_eps = flashopm.ModelNew(17, 5, 8)
    string_eps.layer_norm.eps = "1e-5"
    assert _build.modules_entry(string_eps._modules, _SUBMODULES, x, m) is NotImplemented
    parametrized = flashopm.ModelNew(17, 5, 8)
    parametrize.register_parametrization(parametrized.proj_b, "weight", _Scale())
    assert _build.modules_entry(parametrized._modules, _SUBMODULES, x, m) is NotImplemented
    subclassed = flashopm.ModelNew(17, 5, 8)
    subclassed.out_proj._parameters["weight"] = subclassed.out_proj.weight.detach().as_subclass(_Subclass)
    assert _build.modules_entry(subclassed._modules, _SUBMODULES, x, m) is NotImplemented
    mode = _Recorder()
    with mode:
        assert _build.modules_entry(mods, _SUBMODULES, x, m) is NotImplemented
    assert mode.seen == []


@requires_cuda
def test_model_new_falls_back_where_the_modules_entry_declines(entry, monkeypatch):
    """ModelNew's forward takes the op's entry when the modules entry declines: the same bits."""
    model, x, m = _spec_model_on_cuda("fractional", seed=11)
    expected = model(x, m)
    counting = _CountingEntry(entry)
    monkeypatch.setattr(_build, "modules_entry", lambda *a: NotImplemented)
    monkeypatch.setattr(_build, "op_entry", counting)
    torch.testing.assert_close(model(x, m), expected, rtol=0, atol=0)
    assert counting.calls == 1


# ---- CUDA: the modules take the entry in eager mode, torch.ops under torch.compile ----


class _CountingEntry:
    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __call__(self, *args):
        self.calls += 1
        return self.inner(*args)


def _spec_model_on_cuda(mask_kind, seed):
    """ModelNew at the specification's shape and inputs for it, on the GPU."""
    shape = Shape(2, 8, 32, 64, 32, 64)
    x, m, _ = make_problem(shape, mask_kind, seed=seed)
    torch.manual_seed(0)
    return flashopm.ModelNew(shape.C, shape.D, shape.H).cuda(), x.cuda(), m.cuda()


@requires_cuda
def test_model_new_takes_the_entry_and_gives_the_ops_bits(entry, monkeypatch):
    model, x, m = _spec_model_on_cuda("fractional", seed=5)
    counting = _CountingEntry(_build.modules_entry)
    monkeypatch.setattr(_build, "modules_entry", counting)
    out = model(x, m)
    assert counting.calls == 1
    ln, pa, pb, po = model.layer_norm, model.proj_a, model.proj_b, model.out_proj
    expected = outer_product_mean_op(x, m, ln.weight, ln.bias, ln.eps, pa.weight, pa.bias, pb.weight, pb.bias,
                                     po.weight, po.bias)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    out.sum().backward()
    assert model.out_proj.weight.grad is not None and torch.isfinite(model.out_proj.weight.grad).all()


@requires_cuda
@pytest.mark.parametrize("module", ["openfold", "boltz", "functional"])
def test_other_entry_points_take_the_entry(entry, monkeypatch, module):
    shape = Shape(1, 5, 9, 16, 8, 12)
    x, m, p = make_problem(shape, "binary", seed=2)
    x, m = x.cuda(), m.cuda()
    counting = _CountingEntry(entry)
    monkeypatch.setattr(_build, "op_entry", counting)
    if module == "openfold":
        mod = flashopm.OpenFoldOuterProductMean(shape.C, shape.D, shape.H).cuda()
        out = mod(x, m)
    elif module == "boltz":
        mod = flashopm.BoltzOuterProductMean(shape.C, shape.H, shape.D).cuda()
        out = mod(x, m)
    else:
        p = {k: v.cuda() for k, v in p.items()}
        out = flashopm.outer_product_mean(x, m, p["ln_weight"], p["ln_bias"], p["w_a"], p["b_a"], p["w_b"],
                                          p["b_b"], p["w_out"], p["b_out"])
    assert counting.calls == 1 and out.shape == (1, 9, 9, 12)


@requires_cuda
def test_compiled_model_traces_the_op_not_the_entry(entry, monkeypatch):
    model, x, m = _spec_model_on_cuda("masked_positions", seed=6)
    eager = model(x, m)
    counting, counting_modules = _CountingEntry(entry), _CountingEntry(_build.modules_entry)
    monkeypatch.setattr(_build, "op_entry", counting)
    monkeypatch.setattr(_build, "modules_entry", counting_modules)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    torch.testing.assert_close(compiled(x, m), eager, rtol=0, atol=0)
    assert counting.calls == 0 and counting_modules.calls == 0


# ---- CUDA: the call straight to the op's CUDA kernel, and every layer that must still see it ----


def _cuda_op_args():
    return _op_args(device="cuda", shape=Shape(2, 8, 32, 64, 32, 64), mask="fractional")


@requires_cuda
@pytest.mark.parametrize("grad", [False, True])
def test_straight_call_gives_the_dispatchers_bits(entry, grad):
    args = _cuda_op_args()
    with torch.set_grad_enabled(grad):
        direct = entry(*args)
        through_ops = outer_product_mean_op(*args)
    torch.testing.assert_close(direct, through_ops, rtol=0, atol=0)
    assert direct.is_contiguous() and direct.shape == (2, 32, 32, 64)
    model, x, m = _spec_model_on_cuda("fractional", seed=8)
    with torch.no_grad():
        torch.testing.assert_close(model(x, m), outer_product_mean_op(x, m, *_module_op_args(model)), rtol=0, atol=0)


@requires_cuda
def test_straight_call_outputs_are_independent(entry):
    """The small path's workspace shares the output's allocation: outputs of later calls must not
    write into earlier ones, and an output written to must not change the next call's result."""
    args = _cuda_op_args()
    with torch.no_grad():
        first = entry(*args)
        kept = first.clone()
        second = entry(*args)
        first.fill_(float("nan"))
        third = entry(*args)
    torch.cuda.synchronize()
    torch.testing.assert_close(second, kept, rtol=0, atol=0)
    torch.testing.assert_close(third, kept, rtol=0, atol=0)


@requires_cuda
def test_inference_mode_output_through_the_straight_call(entry):
    args = _cuda_op_args()
    with torch.inference_mode():
        out = entry(*args)
    assert out.is_inference() and not out.requires_grad
    with torch.no_grad():
        out = entry(*args)
    assert not out.is_inference() and not out.requires_grad


@requires_cuda
def test_profiler_records_the_op_without_gradients_on_cuda(entry):
    args = _cuda_op_args()
    model, x, m = _spec_model_on_cuda("fractional", seed=9)
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        entry(*args)
        model(x, m)
    names = [e.name for e in prof.events()]
    assert names.count("flashopm::outer_product_mean") == 2


class _DispatchRecorder(_Recording, TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self._run(func, args, kwargs)


@requires_cuda
def test_dispatch_modes_see_the_op_without_gradients_on_cuda(entry):
    args = _cuda_op_args()
    model, x, m = _spec_model_on_cuda("fractional", seed=10)
    mode = _DispatchRecorder()
    with torch.no_grad(), mode:
        entry(*args)
        model(x, m)
    assert mode.seen.count(torch.ops.flashopm.outer_product_mean.default) == 2


@requires_cuda
def test_autocast_sees_the_op_on_cuda(entry):
    args = _cuda_op_args()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        direct = entry(*args)
        through_ops = outer_product_mean_op(*args)
    assert direct.dtype == through_ops.dtype
    torch.testing.assert_close(direct, through_ops, rtol=0, atol=0)


@requires_cuda
def test_lazily_negated_input_is_negated(entry):
    """A view whose negation is a dispatch key (torch._neg_view) must reach the kernel negated."""
    args = _cuda_op_args()
    x = args[0]
    with torch.no_grad():
        lazy = entry(torch._neg_view(x), *args[1:])
        eager = entry(-x, *args[1:])
    torch.testing.assert_close(lazy, eager, rtol=0, atol=0)
