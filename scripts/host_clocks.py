"""Where the host time of one forward call goes, stage by stage, on a GPU machine.

Builds an instrumented copy of the extension (separate cache directory) whose host code stores
std::chrono::steady_clock at fixed points of a call: the extension's modules entry (ModelNew's
forward), the autograd kernel (where the dispatcher runs), the CUDA kernel's checks, allocations
and plan, and each launch (the launch call alone, and what comes before it).  steady_clock and
time.perf_counter_ns read the same clock, so the Python side's share before and after the C++
entry comes out too.  Prints the median of each stage over many calls, for ModelNew under no_grad
and with gradients on, warm (calls back to back) and the way the benchmark times a call (an L2
flush and a synchronize before each call, CUDA events around it; wall time less host time is then
what the GPU and the events add after the host is done).

    PYTHONPATH=src python scripts/host_clocks.py [B,S,N,C,H,D]

The anchors below are lines of opm_python.cpp, opm_autograd.cpp, opm_api.cpp and opm_launch.cu;
when those change, they may need to follow.
"""
import os
import statistics
import sys
import time

os.environ["FLASHOPM_CACHE_DIR"] = os.path.join(os.environ.get("TMPDIR", "/tmp"), "flashopm-host-clocks")
import torch

from flashopm import _build
from patched_build import load_patched, patch, problem_from_argv


CLOCK_DECL = """
#ifndef FLASHOPM_HOST_CLOCKS
#define FLASHOPM_HOST_CLOCKS
#include <chrono>
namespace flashopm {
inline long long g_host_clk[32];
inline void host_clk(int i) { g_host_clk[i] = std::chrono::steady_clock::now().time_since_epoch().count(); }
}  // namespace flashopm
#endif
"""
CLK = lambda i: f"\n  ::flashopm::host_clk({i});\n"  # noqa: E731

src = _build.read_sources()
for header in ("opm_params.h", "opm_op_handles.h"):
    src[header] = patch(src[header], "#pragma once\n", CLOCK_DECL)

p = src["opm_python.cpp"]
p = patch(p, "  if (nargs < 4 || nargs > 8) return not_implemented();\n", CLK(0), before=True)
p = patch(p, "    pybind11::gil_scoped_release no_gil;\n", CLK(1), before=True)
p = patch(p, "                              f.algorithm, f.normalization, f.norm_eps, f.precision);\n    }\n", CLK(2))
p = p.replace("  return THPVariable_Wrap(std::move(out));\n",
              CLK(3) + "  PyObject* wrapped = THPVariable_Wrap(std::move(out));\n" + CLK(4) + "  return wrapped;\n", 1)
p = patch(p, "PyMethodDef module_methods[] = {\n", """
PyObject* host_clocks(PyObject*, PyObject*) {
  PyObject* t = PyTuple_New(32);
  for (int i = 0; i < 32; ++i) {
    PyTuple_SET_ITEM(t, i, PyLong_FromLongLong(::flashopm::g_host_clk[i]));
    ::flashopm::g_host_clk[i] = 0;
  }
  return t;
}
""", before=True)
p = patch(p, "PyMethodDef module_methods[] = {\n", '    {"host_clocks", host_clocks, METH_NOARGS, "the clocks of the last call"},\n')
src["opm_python.cpp"] = p

g = src["opm_autograd.cpp"]
g = patch(g, "  // Inference (no_grad, or nothing requires grad) skips building a graph node altogether.\n", CLK(5),
          before=True)
g = patch(g, "  return OuterProductMeanFunction::apply(", CLK(22), before=True)
src["opm_autograd.cpp"] = g

a = src["opm_api.cpp"]
a = patch(a, "  // ---- argument checks (messages name the argument, expected vs got) ----\n", CLK(6), before=True)
a = patch(a, "  const c10::cuda::CUDAGuard guard(msa_in.device());\n", CLK(7), before=True)
a = patch(a, "  const at::Tensor msa = msa_in.stride(3) == 1", CLK(8), before=True)
a = patch(a, "  const std::optional<at::Tensor> &b_a = params.t[3], &b_b = params.t[5], &b_out = params.t[7];\n", CLK(9))
a = patch(a, "  const bool small_tc_ok = small_tc.TI > 0", CLK(10), before=True)
a = patch(a, "    const size_t ws_bytes = size_t(b_elems + a_elems) * sizeof(float);\n", CLK(23), before=True)
a = patch(a, "    float* const b_ws = static_cast<float*>(ws);\n", CLK(11), before=True)
a = patch(a, "    if (!fused) run_prep(pa, false, dev, stream);\n", CLK(12), before=True)
a = patch(a, "    if (!fused) run_prep(pa, false, dev, stream);\n", CLK(13))
a = patch(a, "    launch_small_tc(ta, tc_terms, stream);\n    return out;\n", CLK(14), before=True)
a = a.replace("    launch_small_tc(ta, tc_terms, stream);\n    return out;\n",
              "    launch_small_tc(ta, tc_terms, stream);\n" + CLK(15) + "    return out;\n", 1)
src["opm_api.cpp"] = a

k = src["opm_launch.cu"]
k = patch(k, "  launch_kernel<kernel, SmemSetup::kOptInMaxCarveout>(cfg, args);\n", CLK(17), before=True)
k = patch(k, "  launch_kernel<kernel, SmemSetup::kOptInMaxCarveout>(cfg, args);\n", CLK(18))
k = patch(k, "void launch_small_tc_t(const cudaLaunchConfig_t& cfg, const SmallTcArgs& args) {\n", CLK(19))
k = patch(k, "  launch_kernel<Kernel, SmemSetup::kOptIn>(cfg, args);\n}\n\n// The chained", CLK(20), before=True)
k = k.replace("  launch_kernel<Kernel, SmemSetup::kOptIn>(cfg, args);\n}\n\n// The chained",
              "  launch_kernel<Kernel, SmemSetup::kOptIn>(cfg, args);\n" + CLK(21) + "}\n\n// The chained", 1)
src["opm_launch.cu"] = k

load_patched(src)
if not torch.cuda.is_available():
    sys.exit(0)

from flashopm.bench import L2Flusher, warm_gpu  # noqa: E402

# The extension module (a module-level function's __self__).
host_clocks = _build.op_entry.__self__.host_clocks

shape, model, x, m = problem_from_argv()

# (label, from, to): slots of the C++ clocks; "py0" / "py1" are Python's clocks around the call.
STAGES = (
    ("Python before the entry (__call__, forward, parameters)", "py0", 0),
    ("entry: read the arguments", 0, 1),
    ("release the GIL, to the CUDA kernel (either way)", 1, 6),
    ("release the GIL, dispatch to the autograd kernel", 1, 5),
    ("autograd kernel to the CUDA kernel (no_grad: dispatch)", 5, 6),
    ("checks", 6, 7),
    ("device guard, empty problems", 7, 8),
    ("parameters, contraction order, plan", 8, 10),
    ("small path's forms and workspace layout", 10, 23),
    ("output and workspace from the allocator", 23, 11),
    ("first kernel's arguments", 11, 12),
    ("run_prep before the launch (decisions, env)", 12, 17),
    ("first kernel: shared-memory opt-in check and launch", 17, 18),
    ("after the first launch", 18, 13),
    ("second kernel's arguments", 13, 14),
    ("launch_small_tc before the launch", 14, 20),
    ("second kernel: shared-memory opt-in check and launch", 20, 21),
    ("after the second launch", 21, 15),
    ("return: workspace freed, dispatcher, autograd", 15, 2),
    ("take the GIL back", 2, 3),
    ("wrap the output", 3, 4),
    ("Python after the entry", 4, "py1"),
)


def one_call(timer_events=None, flusher=None):
    if flusher is not None:
        flusher()
        torch.cuda.synchronize()
    if timer_events is not None:
        timer_events[0].record()
    t0 = time.perf_counter_ns()
    model(x, m)
    t1 = time.perf_counter_ns()
    if timer_events is not None:
        timer_events[1].record()
        timer_events[1].synchronize()
    c = host_clocks()
    clk = {i: c[i] for i in range(32)}
    clk["py0"], clk["py1"] = t0, t1
    wall = timer_events[0].elapsed_time(timer_events[1]) * 1e3 if timer_events is not None else None
    return clk, wall


def report(label, grad, benchmark_style, calls=300):
    flusher = L2Flusher() if benchmark_style else None
    events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if benchmark_style else None
    rows = []
    with torch.set_grad_enabled(grad):
        for _ in range(20):
            one_call(events, flusher)
        torch.cuda.synchronize()
        for _ in range(calls):
            rows.append(one_call(events, flusher))
    torch.cuda.synchronize()
    print(f"--- {label} ({calls} calls; medians in us)")
    ok = [r for r in rows if r[0][21] > 0 and r[0][18] > 0]
    if not ok:
        print("  the two-launch path did not run")
        return
    for name, lo, hi in STAGES:
        vals = [(r[0][hi] - r[0][lo]) / 1e3 for r in ok if r[0][hi] > 0 and r[0][lo] > 0]
        if vals:
            print(f"  {name:<58} {statistics.median(vals):7.2f}")
    total = [(r[0]["py1"] - r[0]["py0"]) / 1e3 for r in ok]
    to_launch2 = [(r[0][21] - r[0]["py0"]) / 1e3 for r in ok]
    print(f"  {'total host time of the call':<58} {statistics.median(total):7.2f}")
    print(f"  {'host time to the end of the second launch':<58} {statistics.median(to_launch2):7.2f}")
    if benchmark_style:
        walls = [r[1] for r in ok]
        share = [w - t for w, t in zip(walls, to_launch2)]
        print(f"  {'wall time (CUDA events)':<58} {statistics.median(walls):7.2f}")
        print(f"  {'wall less host time to the second launch':<58} {statistics.median(share):7.2f}")


def empty_wall(n=300):
    flusher = L2Flusher()
    dummy = torch.empty(1, device="cuda")
    noop = torch.ops.flashopm._noop.default
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    walls, hosts = [], []
    for _ in range(n):
        flusher()
        torch.cuda.synchronize()
        start.record()
        t0 = time.perf_counter_ns()
        noop(dummy)
        t1 = time.perf_counter_ns()
        end.record()
        end.synchronize()
        walls.append(start.elapsed_time(end) * 1e3)
        hosts.append((t1 - t0) / 1e3)
    print(f"--- empty extension call, benchmark style: wall {statistics.median(walls):.2f} us, "
          f"host {statistics.median(hosts):.2f} us")


print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  shape {shape}")
warm_gpu()
empty_wall()
# Both launch routes (the extension's driver_launch switch): the driver's cuLaunchKernelEx with
# the handles looked up once, and the runtime's cudaLaunchKernelEx.
driver_launch = _build.extension().driver_launch
for driver in (True, False):
    driver_launch(driver)
    route = "driver launches" if driver else "runtime launches"
    report(f"ModelNew, {route}, no_grad, calls back to back", False, False)
    report(f"ModelNew, {route}, gradients on, calls back to back", True, False)
    report(f"ModelNew, {route}, no_grad, benchmark style (L2 flush, synchronize, events)", False, True)
    report(f"ModelNew, {route}, gradients on, benchmark style (L2 flush, synchronize, events)", True, True)
driver_launch(True)
