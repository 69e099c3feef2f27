"""The launch route (csrc/opm_launch.cu): kernels go out through the driver's cuLaunchKernelEx with
handles looked up once, or through the runtime's cudaLaunchKernelEx.  The two routes must give
the same bits on every path (the small path's programmatic dependent launch, the cooperative
single launch, clusters, the tensor-core and CUDA-core kernels, 16-bit inputs, the backward),
under CUDA-graph capture, and from a thread that never touched the runtime.  On the small path a
call's launches go out as one launch of a CUDA graph of them (launch batches): the same bits as
the kernel launches, one graph per problem shape (a bounded cache), never inside a caller's
capture, safe from several threads.  The switches themselves run wherever the extension builds
(CI included); the rest on the GPU machine.
"""
import os
import subprocess
import sys
import threading

import pytest
import torch

import flashopm
from flashopm import _build
from flashopm.ops import ALGORITHMS, outer_product_mean_op
from flashopm.testing import Shape, capture_graph, make_problem, op_args

from conftest import requires_cuda, toolchain_or_skip


@pytest.fixture(scope="module")
def ext():
    toolchain_or_skip()
    return _build.extension()


def _switch_for_the_test(ext, name):
    """Yields a setter of the extension's launch switch `name` and restores its setting after."""
    switch = getattr(ext, name)
    before = switch()
    yield lambda enabled: switch(enabled)
    switch(before)


@pytest.fixture
def route(ext):
    """Sets the launch route (True: the driver's cuLaunchKernelEx) for a test."""
    yield from _switch_for_the_test(ext, "driver_launch")


@pytest.fixture
def graphs(ext):
    """Sets whether a call's launches may go out as one graph launch, for a test."""
    yield from _switch_for_the_test(ext, "graph_launch")


@pytest.mark.parametrize("name", ["driver_launch", "graph_launch"])
def test_switch_is_on_by_default_and_returns_the_previous_setting(ext, name):
    switch = getattr(ext, name)
    for setter in _switch_for_the_test(ext, name):
        assert switch() is True
        assert setter(False) is True
        assert switch() is False
        assert setter(True) is False
        assert switch() is True


@pytest.mark.parametrize("name", ["driver_launch", "graph_launch"])
def test_switch_rejects_other_arguments(ext, name):
    switch = getattr(ext, name)
    with pytest.raises(TypeError, match=f"{name}: expected enabled to be a bool, got int"):
        switch(1)
    with pytest.raises(TypeError, match=f"{name}: expected at most one argument .enabled., got 2"):
        switch(True, False)
    assert switch() is True


def test_environment_variable_selects_the_runtime_route(ext):
    code = "from flashopm import _build; print(_build.extension().driver_launch())"
    env = dict(os.environ, FLASHOPM_RUNTIME_LAUNCH="1", PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"


def _cuda_args(shape, mask="masked_positions", dtype=torch.float32, seed=5):
    x, m, p = make_problem(shape, mask, seed=seed)
    return op_args(x.to("cuda", dtype), m.cuda(), {k: v.to("cuda", dtype) for k, v in p.items()})


def _both_routes(route, fn):
    route(False)
    by_runtime = fn()
    route(True)
    by_driver = fn()
    torch.cuda.synchronize()
    return by_runtime, by_driver


# (shape, algorithm, dtype, environment): one case per launch form the forward has
FORWARD_CASES = [
    (Shape(2, 8, 32, 64, 32, 64), "auto", torch.float32, {}),  # two launches, programmatic dependent
    (Shape(2, 8, 32, 64, 32, 64), "small-tc", torch.float32, {"FLASHOPM_SMALL_TC_FUSED": "1"}),  # cooperative
    (Shape(2, 8, 32, 64, 32, 64), "auto", torch.float32, {"FLASHOPM_SMALL_F16_FUSED": "1"}),  # ... chained form
    (Shape(1, 3, 7, 17, 8, 5), "single", torch.float32, {}),  # clusters
    (Shape(1, 64, 97, 64, 32, 128), "outer", torch.float32, {}),  # tensor cores
    (Shape(1, 5, 33, 17, 12, 9), "outer-fma", torch.float32, {}),  # CUDA cores
    (Shape(1, 4, 20, 16, 8, 6), "project", torch.float32, {}),
    (Shape(1, 64, 97, 64, 32, 128), "auto", torch.bfloat16, {}),
    (Shape(2, 8, 32, 64, 32, 64), "auto", torch.float16, {}),
]


@requires_cuda
@pytest.mark.parametrize("shape, algorithm, dtype, env", FORWARD_CASES)
def test_forward_bits_are_the_same_on_both_routes(route, monkeypatch, shape, algorithm, dtype, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = _cuda_args(shape, dtype=dtype)
    by_runtime, by_driver = _both_routes(route, lambda: outer_product_mean_op(*args, ALGORITHMS[algorithm]))
    assert by_driver.isfinite().all()
    torch.testing.assert_close(by_driver, by_runtime, rtol=0, atol=0)


@requires_cuda
@pytest.mark.parametrize("shape", [Shape(2, 8, 32, 64, 32, 64), Shape(1, 64, 97, 64, 32, 128)])
def test_gradients_are_the_same_on_both_routes(route, shape):
    args = _cuda_args(shape)
    grad_out = None

    def step():
        nonlocal grad_out
        leaves = [a.detach().requires_grad_(a.is_floating_point() and i != 1) if isinstance(a, torch.Tensor) else a
                  for i, a in enumerate(args)]
        out = outer_product_mean_op(*leaves)
        if grad_out is None:
            grad_out = torch.randn_like(out)
        out.backward(grad_out)
        return torch.cat([t.grad.flatten() for t in leaves if isinstance(t, torch.Tensor) and t.grad is not None])

    by_runtime, by_driver = _both_routes(route, step)
    assert by_driver.isfinite().all()
    torch.testing.assert_close(by_driver, by_runtime, rtol=0, atol=0)


@requires_cuda
def test_graph_capture_on_the_driver_route(route):
    route(True)
    torch.manual_seed(0)
    model = flashopm.ModelNew(*flashopm.get_init_inputs()).cuda()
    x, m = [t.cuda() for t in flashopm.get_inputs()]
    m = torch.rand_like(m)

    def forward():
        with torch.no_grad():
            return model(x, m)

    graph, out = capture_graph(forward)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    route(False)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x, m), rtol=0, atol=0)


@requires_cuda
def test_a_new_thread_launches_and_gets_the_same_bits(route):
    """A thread's first call finds no current context until the runtime makes the device's primary
    context current; the driver route must then take the runtime's launch or a valid handle."""
    route(True)
    args = _cuda_args(Shape(2, 8, 32, 64, 32, 64))
    expect = outer_product_mean_op(*args)
    results, errors = [], []

    def work():
        try:
            results.append(outer_product_mean_op(*args))
            results.append(outer_product_mean_op(*args))
            torch.cuda.synchronize()
        except Exception as exc:  # reported below, on the test's thread
            errors.append(exc)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert not errors, errors
    for out in results:
        torch.testing.assert_close(out, expect, rtol=0, atol=0)


def _second_call_params(D, seed, H=32):
    """Fresh LayerNorm and projection parameters, and the output bias, for `_second_call_args`."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *size: torch.randn(*size, generator=gen).cuda()  # noqa: E731
    return 1.0 + 0.1 * rand(D), 0.1 * rand(D), rand(H, D) / 8, rand(H), rand(H, D) / 8, rand(H), rand(D)


def _second_call_args(out1, params, H=32):
    """A call at (B, S, N, C) = (B1, N1, N1, D1) whose x, mask and output weight are views of the
    previous call's output: x is that output, the mask its channel 1 (a strided view, values of
    either sign), the output weight its first D·H·H elements."""
    D = out1.shape[-1]
    ln_w, ln_b, w_a, b_a, w_b, b_b, b_out = params
    w_out = out1.reshape(-1)[: D * H * H].view(D, H * H)
    return [out1, out1[..., 1], ln_w, ln_b, 1e-5, w_a, b_a, w_b, b_b, w_out, b_out]


@requires_cuda
@pytest.mark.parametrize("fused", ["0", "1"])
@pytest.mark.parametrize("trigger", ["0", "1", "2"])
@pytest.mark.parametrize("normalization", [0, 1, 2])
@pytest.mark.parametrize("capture", [False, True])
def test_back_to_back_calls_read_the_previous_call_s_output_complete(monkeypatch, fused, trigger, normalization,
                                                                     capture):
    """On the small path the first kernel starts as the previous kernel's programmatic dependent,
    and the second kernel may let its successor start before it ends (FLASHOPM_SMALL_TRIGGER: at
    its start, before its epilogue, or not before it ends), so that calls back to back overlap. The
    first kernel must still read x and the weights, and the second the output weight and the mask,
    only once the kernel before has ended: here they are all the previous call's output, which is
    written last. The results must be the bits of the same calls made with a synchronize between."""
    monkeypatch.setenv("FLASHOPM_SMALL_TRIGGER", trigger)
    monkeypatch.setenv("FLASHOPM_SMALL_F16_FUSED", fused)  # the chained form in one cooperative launch
    shape1 = Shape(2, 8, 32, 64, 32, 64)
    for seed in range(3):
        args1 = _cuda_args(shape1, seed=seed)
        params2 = _second_call_params(shape1.D, seed)

        def both_calls():
            out1 = outer_product_mean_op(*args1, 0, normalization)
            return out1, outer_product_mean_op(*_second_call_args(out1, params2), 0, normalization)

        if capture:
            graph, (out1, out2) = capture_graph(both_calls)
            args1[0].copy_(torch.randn_like(args1[0]))
            graph.replay()
        else:
            out1, out2 = both_calls()
        torch.cuda.synchronize()
        expect1 = outer_product_mean_op(*args1, 0, normalization)
        torch.cuda.synchronize()
        expect2 = outer_product_mean_op(*_second_call_args(expect1.clone(), params2), 0, normalization)
        torch.cuda.synchronize()
        assert out2.isfinite().all()
        torch.testing.assert_close(out1, expect1, rtol=0, atol=0)
        torch.testing.assert_close(out2, expect2, rtol=0, atol=0)


# ---- the small path's launches as one CUDA-graph launch (opm_launch.cu, launch batches) ----

def _runtime_calls(fn):
    """Names of the CUDA runtime calls made by fn() (the profiler's cuda_runtime events)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events()}


@requires_cuda
@pytest.mark.parametrize("env", [{}, {"FLASHOPM_SMALL_PAIR_COPIES": "0"}, {"FLASHOPM_SMALL_F16_CHAIN": "0"}])
def test_the_small_path_goes_out_as_one_graph_launch_unless_switched_off(ext, graphs, monkeypatch, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = _cuda_args(Shape(2, 8, 32, 64, 32, 64))
    graphs(True)
    failed = ext.graph_launch_counts()[2]
    outer_product_mean_op(*args)  # the graph is built on the first call (if not by an earlier test)
    built, launched, failed_now, why = ext.graph_launch_counts()
    assert failed_now == failed, why
    assert built >= 1
    assert "cudaGraphLaunch" in _runtime_calls(lambda: outer_product_mean_op(*args))
    assert ext.graph_launch_counts()[:3] == (built, launched + 1, failed)  # launched again, not built again
    graphs(False)
    assert "cudaGraphLaunch" not in _runtime_calls(lambda: outer_product_mean_op(*args))
    graphs(True)
    monkeypatch.setenv("FLASHOPM_GRAPH_LAUNCH", "0")
    assert "cudaGraphLaunch" not in _runtime_calls(lambda: outer_product_mean_op(*args))
    assert ext.graph_launch_counts()[:3] == (built, launched + 1, failed)


@requires_cuda
def test_a_cooperative_launch_goes_out_as_it_is(ext, graphs, monkeypatch):
    """The one-launch form is a cooperative launch, which is not batched (its graph form is not
    tested): it is launched directly, with or without the graph switch."""
    monkeypatch.setenv("FLASHOPM_SMALL_F16_FUSED", "1")
    args = _cuda_args(Shape(2, 8, 32, 64, 32, 64))
    graphs(True)
    counts = ext.graph_launch_counts()
    out = outer_product_mean_op(*args)
    assert "cudaGraphLaunch" not in _runtime_calls(lambda: outer_product_mean_op(*args))
    assert ext.graph_launch_counts() == counts
    monkeypatch.delenv("FLASHOPM_SMALL_F16_FUSED")
    torch.testing.assert_close(out, outer_product_mean_op(*args), rtol=0, atol=0)


@requires_cuda
@pytest.mark.parametrize("shape, algorithm, dtype, env", FORWARD_CASES)
@pytest.mark.parametrize("driver", [True, False])
def test_forward_bits_are_the_same_with_and_without_the_graph_launch(route, graphs, monkeypatch, shape, algorithm,
                                                                     dtype, env, driver):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    route(driver)
    args = _cuda_args(shape, dtype=dtype)
    graphs(False)
    direct = outer_product_mean_op(*args, ALGORITHMS[algorithm])
    graphs(True)
    by_graph = [outer_product_mean_op(*args, ALGORITHMS[algorithm]) for _ in range(2)]  # built, then reused
    torch.cuda.synchronize()
    assert direct.isfinite().all()
    for out in by_graph:
        torch.testing.assert_close(out, direct, rtol=0, atol=0)


# Small-path shapes, more than a device's cache of graphs holds (32), each with its own grids.
_MANY_SHAPES = [Shape(b, s, n, 16, 32, d) for b in (1, 2) for s in (1, 8) for n in (5, 16, 32)
                for d in (16, 24, 40, 64)][:40]


@requires_cuda
def test_more_problem_shapes_than_the_graph_cache_holds(ext, graphs):
    """Each shape's launches make their own graph; past the cache's size the least recently used
    go, and a shape seen again builds its graph anew.  Every call must give the direct launches'
    bits, on the first pass and on the second."""
    cases = []
    for k, shape in enumerate(_MANY_SHAPES):
        args = _cuda_args(shape, seed=k)
        graphs(False)
        cases.append((args, outer_product_mean_op(*args)))
    graphs(True)
    built = []
    for _ in range(2):
        before = ext.graph_launch_counts()[0]
        for args, direct in cases:
            torch.testing.assert_close(outer_product_mean_op(*args), direct, rtol=0, atol=0)
        built.append(ext.graph_launch_counts()[0] - before)
    # more graphs than the cache holds, so that it evicts; cycling through them, the least recently
    # used is always the next one needed, so the second pass builds each again
    assert built[0] > 32
    assert built[1] == built[0]


@requires_cuda
def test_graph_launches_from_two_threads_on_their_own_streams(graphs):
    """The same graph launched by two threads at once, each on its own stream, with its own
    parameters: each call gets its own inputs' result."""
    graphs(True)
    shape = Shape(2, 8, 32, 64, 32, 64)
    cases = [_cuda_args(shape, seed=s) for s in range(2)]
    graphs(False)
    expect = [outer_product_mean_op(*args) for args in cases]
    graphs(True)
    torch.cuda.synchronize()
    results, errors = [[], []], []

    def work(k):
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                for _ in range(50):
                    results[k].append(outer_product_mean_op(*cases[k]))
            stream.synchronize()
        except Exception as exc:  # reported below, on the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for k in range(2):
        assert len(results[k]) == 50
        for out in results[k]:
            torch.testing.assert_close(out, expect[k], rtol=0, atol=0)


@requires_cuda
def test_a_captured_call_joins_the_caller_s_graph(ext, graphs):
    """Under stream capture the launches go into the caller's graph as they are (no graph launch
    inside a capture): the replay follows new inputs."""
    graphs(True)
    args = _cuda_args(Shape(2, 8, 32, 64, 32, 64))
    launched = ext.graph_launch_counts()[1]
    graph, out = capture_graph(lambda: outer_product_mean_op(*args))
    # one graph launch: capture_graph's warm-up call on a side stream; none from the captured call
    assert ext.graph_launch_counts()[1] == launched + 1
    args[0].copy_(torch.randn_like(args[0]))
    assert "cudaGraphLaunch" in _runtime_calls(graph.replay)  # the caller's own
    assert ext.graph_launch_counts()[1] == launched + 1
    graphs(False)
    torch.testing.assert_close(out, outer_product_mean_op(*args), rtol=0, atol=0)
