"""What a lone call's launches cost in wall time (CUDA events around the call, a synchronize
between calls, no L2 flush): an empty op, then empty kernels of 128 blocks of 512 threads launched
plainly, with the programmatic-dependency attribute, as a cooperative launch, in clusters of two,
and as pairs (the second as the first's programmatic dependent, or in plain stream order), a
captured graph of such a pair, the pair with 512-byte parameters launched directly or as a graph
whose nodes take new parameters per call, and ModelNew at the specification's shape: one graph
launch of its two kernels (the default), two kernel launches (FLASHOPM_GRAPH_LAUNCH=0), one
cooperative launch (FLASHOPM_SMALL_F16_FUSED=1), and a captured graph of one call.  All in
alternation, medians and 10th/90th percentiles; then a new shape's first call (its graph is
built), and the time per call back to back (host time, and time to the GPU's end).  First, which
launch attributes a graph's nodes may carry and still take new parameters.

    python scripts/launch_latency.py [--rounds 300]
"""
import argparse
import os
import statistics
import time

import torch
from torch.utils.cpp_extension import load_inline

import flashopm
import flashopm._build
from flashopm.bench import warm_gpu
from flashopm.testing import Shape, make_problem

SOURCE = r"""
#include <cuda_runtime.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <string>

__global__ void empty_kernel() {}
__global__ void waiting_kernel() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }

// A parameter block of the size of the op's own (a few hundred bytes), for the graph's pair.
struct Params {
  long long v[64];
};
__global__ void empty_kernel_p(const Params p) {
  if (p.v[0] == 1) asm volatile("trap;");
}
__global__ void waiting_kernel_p(const Params p) {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  if (p.v[1] == 1) asm volatile("trap;");
}

// The pair (the second a programmatic dependent) as a graph captured once, its two nodes' parameters
// set before each launch (as an op would set its tensors' addresses).
struct PairGraph {
  cudaGraphExec_t exec = nullptr;
  cudaGraphNode_t first = nullptr, second = nullptr;
};

// The pair's grid, its blocks of 512 threads, and its parameters.
cudaLaunchConfig_t pair_config(int64_t blocks, cudaStream_t stream) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(unsigned(blocks));
  cfg.blockDim = dim3(512);
  cfg.stream = stream;
  return cfg;
}
Params pair_params(int64_t value) {
  Params p{};
  p.v[2] = value;
  return p;
}

void graph_pair(int64_t blocks, int64_t value) {
  static PairGraph g;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  Params p = pair_params(value);
  cudaLaunchConfig_t cfg = pair_config(blocks, nullptr);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  if (g.exec == nullptr) {
    cudaStream_t cs;
    C10_CUDA_CHECK(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
    cudaGraph_t graph;
    C10_CUDA_CHECK(cudaStreamBeginCapture(cs, cudaStreamCaptureModeThreadLocal));
    cfg.stream = cs;
    C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, empty_kernel_p, p));
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, waiting_kernel_p, p));
    C10_CUDA_CHECK(cudaStreamEndCapture(cs, &graph));
    size_t n = 2;
    cudaGraphNode_t nodes[2];
    C10_CUDA_CHECK(cudaGraphGetNodes(graph, nodes, &n));
    TORCH_CHECK(n == 2, "expected two nodes");
    cudaKernelNodeParams kp{};
    C10_CUDA_CHECK(cudaGraphKernelNodeGetParams(nodes[0], &kp));
    const bool first0 = kp.func == reinterpret_cast<void*>(empty_kernel_p);
    g.first = first0 ? nodes[0] : nodes[1];
    g.second = first0 ? nodes[1] : nodes[0];
    C10_CUDA_CHECK(cudaGraphInstantiate(&g.exec, graph, 0));
    C10_CUDA_CHECK(cudaStreamDestroy(cs));
  }
  void* args[] = {&p};
  cudaKernelNodeParams kp{};
  kp.gridDim = cfg.gridDim;
  kp.blockDim = cfg.blockDim;
  kp.kernelParams = args;
  kp.func = reinterpret_cast<void*>(empty_kernel_p);
  C10_CUDA_CHECK(cudaGraphExecKernelNodeSetParams(g.exec, g.first, &kp));
  kp.func = reinterpret_cast<void*>(waiting_kernel_p);
  C10_CUDA_CHECK(cudaGraphExecKernelNodeSetParams(g.exec, g.second, &kp));
  C10_CUDA_CHECK(cudaGraphLaunch(g.exec, stream));
}

// Which launch attributes a graph's nodes may carry and still take new parameters: the pair as
// above, with (bit 1) the first launch a programmatic dependent, (bit 2) the second in clusters of
// two, (bit 4) 64 KB of dynamic shared memory each.  Returns "" or the failing step.
__global__ void smem_kernel_p(const Params p) {
  extern __shared__ float s_[];
  if (p.v[0] == 1) s_[threadIdx.x] = 1.f;
}
std::string graph_pair_variant(int64_t variant) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  Params p{};
  const size_t smem = (variant & 4) ? 65536 : 0;
  if (smem) C10_CUDA_CHECK(cudaFuncSetAttribute(smem_kernel_p, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  auto k1 = smem ? smem_kernel_p : empty_kernel_p;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(128);
  cfg.blockDim = dim3(512);
  cfg.dynamicSmemBytes = smem;
  cudaLaunchAttribute a1[1], a2[2];
  a1[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  a1[0].val.programmaticStreamSerializationAllowed = 1;
  a2[0] = a1[0];
  a2[1].id = cudaLaunchAttributeClusterDimension;
  a2[1].val.clusterDim.x = 2;
  a2[1].val.clusterDim.y = 1;
  a2[1].val.clusterDim.z = 1;
  cudaStream_t cs;
  C10_CUDA_CHECK(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
  cudaGraph_t graph;
  C10_CUDA_CHECK(cudaStreamBeginCapture(cs, cudaStreamCaptureModeThreadLocal));
  cfg.stream = cs;
  cfg.attrs = a1;
  cfg.numAttrs = (variant & 1) ? 1 : 0;
  cudaError_t e1 = cudaLaunchKernelEx(&cfg, k1, p);
  cfg.attrs = a2;
  cfg.numAttrs = (variant & 2) ? 2 : 1;
  cudaError_t e2 = cudaLaunchKernelEx(&cfg, smem ? smem_kernel_p : waiting_kernel_p, p);
  C10_CUDA_CHECK(cudaStreamEndCapture(cs, &graph));
  C10_CUDA_CHECK(cudaStreamDestroy(cs));
  if (e1 != cudaSuccess || e2 != cudaSuccess) { (void)cudaGetLastError(); return "capture launch"; }
  cudaGraphNode_t root = nullptr, next[2];
  cudaGraphEdgeData edges[2] = {};
  size_t n = 1;
  C10_CUDA_CHECK(cudaGraphGetRootNodes(graph, &root, &n));
  n = 2;
  C10_CUDA_CHECK(cudaGraphNodeGetDependentNodes(root, next, edges, &n));
  cudaGraphExec_t exec;
  C10_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  std::string result;
  void* args[] = {&p};
  cudaKernelNodeParams kp{};
  kp.gridDim = cfg.gridDim;
  kp.blockDim = cfg.blockDim;
  kp.sharedMemBytes = unsigned(smem);
  kp.kernelParams = args;
  kp.func = reinterpret_cast<void*>(k1);
  cudaError_t e = cudaGraphExecKernelNodeSetParams(exec, root, &kp);
  if (e != cudaSuccess) result += std::string("first node: ") + cudaGetErrorString(e) + "; ";
  kp.func = reinterpret_cast<void*>(smem ? smem_kernel_p : waiting_kernel_p);
  e = cudaGraphExecKernelNodeSetParams(exec, next[0], &kp);
  if (e != cudaSuccess) result += std::string("second node: ") + cudaGetErrorString(e) + "; ";
  if (result.empty()) {
    e = cudaGraphLaunch(exec, stream);
    if (e != cudaSuccess) result += std::string("launch: ") + cudaGetErrorString(e);
  }
  (void)cudaGetLastError();
  C10_CUDA_CHECK(cudaStreamSynchronize(stream));
  (void)cudaGraphExecDestroy(exec);
  (void)cudaGraphDestroy(graph);
  return result;
}

// The same pair launched directly, with the same parameters.
void direct_pair(int64_t blocks, int64_t value) {
  const Params p = pair_params(value);
  cudaLaunchConfig_t cfg = pair_config(blocks, c10::cuda::getCurrentCUDAStream().stream());
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, empty_kernel_p, p));
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, waiting_kernel_p, p));
}

// mode 0 <<<>>>; 1 cudaLaunchKernelEx, no attributes; 2 programmatic dependent; 3 cooperative;
// 4 clusters of two; 5 a pair, the second a programmatic dependent; 6 a pair in stream order.
void launch(int64_t mode, int64_t blocks) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(unsigned(blocks));
  cfg.blockDim = dim3(512);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  cfg.attrs = attr;
  cfg.numAttrs = 0;
  if (mode == 0) {
    empty_kernel<<<unsigned(blocks), 512, 0, stream>>>();
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  if (mode == 2) {
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.numAttrs = 1;
  } else if (mode == 3) {
    attr[0].id = cudaLaunchAttributeCooperative;
    attr[0].val.cooperative = 1;
    cfg.numAttrs = 1;
  } else if (mode == 4) {
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = 2;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.numAttrs = 1;
  }
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, empty_kernel));
  if (mode == 5 || mode == 6) {
    if (mode == 5) {
      attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attr[0].val.programmaticStreamSerializationAllowed = 1;
      cfg.numAttrs = 1;
    }
    C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, waiting_kernel));
  }
}
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=300)
    args = ap.parse_args()
    ext = load_inline("flashopm_launch_latency", cpp_sources="void launch(int64_t mode, int64_t blocks);\n"
                      "void graph_pair(int64_t blocks, int64_t value);\nvoid direct_pair(int64_t blocks, int64_t value);\n"
                      "std::string graph_pair_variant(int64_t variant);",
                      cuda_sources=SOURCE, functions=["launch", "graph_pair", "direct_pair", "graph_pair_variant"], extra_cuda_cflags=["-O2"], verbose=False)
    flashopm.load()
    warm_gpu()
    for variant in range(8):
        print(f"graph of a pair, attributes {variant}: new parameters {ext.graph_pair_variant(variant) or 'taken'}")
    sh = Shape(2, 8, 32, 64, 32, 64)
    x, m, _ = make_problem(sh, "masked_positions", seed=1)
    x, m = x.cuda(), m.cuda()
    model = flashopm.ModelNew(sh.C, sh.D, sh.H).cuda()
    dummy = torch.empty(1, device="cuda")

    def with_env(**env):
        def call():
            os.environ.update(env)
            model(x, m)
            for var in env:
                os.environ.pop(var)
        return call

    pair_graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ext.launch(5, 128)
        torch.cuda.synchronize()
        with torch.cuda.graph(pair_graph, stream=s):
            ext.launch(5, 128)
    torch.cuda.current_stream().wait_stream(s)
    model_graph = torch.cuda.CUDAGraph()
    with torch.no_grad():
        with torch.cuda.stream(s):
            model(x, m)
            torch.cuda.synchronize()
            with torch.cuda.graph(model_graph, stream=s):
                model(x, m)
    torch.cuda.current_stream().wait_stream(s)

    cases = {
        "empty op (torch.ops.flashopm._noop)": lambda: torch.ops.flashopm._noop.default(dummy),
        "1 block, <<<>>>": lambda: ext.launch(0, 1),
        "128 blocks, <<<>>>": lambda: ext.launch(0, 128),
        "128 blocks, cudaLaunchKernelEx": lambda: ext.launch(1, 128),
        "128 blocks, programmatic dependent": lambda: ext.launch(2, 128),
        "128 blocks, cooperative": lambda: ext.launch(3, 128),
        "128 blocks, clusters of two": lambda: ext.launch(4, 128),
        "pair, second a programmatic dependent": lambda: ext.launch(5, 128),
        "pair, stream order": lambda: ext.launch(6, 128),
        "graph of the pair (replay)": pair_graph.replay,
        "pair with 512-byte parameters, launched directly": lambda: ext.direct_pair(128, 3),
        "the same as a graph, parameters set per call": lambda: ext.graph_pair(128, 3),
        "ModelNew (default)": lambda: model(x, m),
        "ModelNew, env writes around": with_env(FLASHOPM_UNUSED_SWITCH="1"),
        "ModelNew, two kernel launches (FLASHOPM_GRAPH_LAUNCH=0)": with_env(FLASHOPM_GRAPH_LAUNCH="0"),
        "ModelNew, one launch (FLASHOPM_SMALL_F16_FUSED=1)": with_env(FLASHOPM_SMALL_F16_FUSED="1"),
        "ModelNew, one kernel launch (FUSED=1, GRAPH_LAUNCH=0)": with_env(FLASHOPM_SMALL_F16_FUSED="1",
                                                                           FLASHOPM_GRAPH_LAUNCH="0"),
        "ModelNew, first kernel in stream order (FLASHOPM_PREP_PDL=0)": with_env(FLASHOPM_PREP_PDL="0"),
        "ModelNew, no clusters (FLASHOPM_SMALL_PAIR_COPIES=0)": with_env(FLASHOPM_SMALL_PAIR_COPIES="0"),
        "ModelNew, graph of one call (replay)": model_graph.replay,
    }
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = {k: [] for k in cases}
    with torch.no_grad():
        for fn in cases.values():
            for _ in range(10):
                fn()
        torch.cuda.synchronize()
        for r in range(args.rounds):
            names = list(cases) if r % 2 == 0 else list(reversed(cases))
            for name in names:
                torch.cuda.synchronize()
                start.record()
                cases[name]()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end) * 1e3)
    ext_main = flashopm._build.extension()
    print(f"graphs built, graph launches: {ext_main.graph_launch_counts()}")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; wall per call in us (events around "
          f"the call, a synchronize between calls), {args.rounds} rounds in alternation")
    base = statistics.median(times["empty op (torch.ops.flashopm._noop)"])
    for name, t in times.items():
        t = sorted(t)
        med = statistics.median(t)
        print(f"  {name:55s} median {med:7.2f}  p10 {t[len(t) // 10]:7.2f}  p90 {t[9 * len(t) // 10]:7.2f}"
              f"  ({med / base:.2f}x the empty op)")
    # A problem shape's first call builds its graph: host time of first calls, graph launches on and off.
    print("first call of a new shape, host us (median over 8 shapes): ", end="")
    for env in ({}, {"FLASHOPM_GRAPH_LAUNCH": "0"}):
        firsts = []
        for k in range(8):
            shk = Shape(1, 8, 24 + k, 16, 32, 16 + 8 * k + (0 if env else 4))
            xk, mk, _ = make_problem(shk, "masked_positions", seed=k)
            xk, mk = xk.cuda(), mk.cuda()
            modk = flashopm.ModelNew(shk.C, shk.D, shk.H).cuda()
            torch.cuda.synchronize()
            os.environ.update(env)
            with torch.no_grad():
                t0 = time.perf_counter()
                modk(xk, mk)
                firsts.append((time.perf_counter() - t0) * 1e6)
            for var in env:
                os.environ.pop(var)
            torch.cuda.synchronize()
        print(f"{'graph launch' if not env else 'kernel launches'} {statistics.median(firsts):.1f}", end="  ")
    print()
    # Back to back, 200 calls without a synchronize: the host's time per call (to the last call's
    # return) and the time per call to the end of the GPU's work (host or GPU bound, whichever is
    # longer, with the launches' gaps).
    print("back to back, us per call (medians of 20 loops of 200 calls): host time, to the GPU's end")
    with torch.no_grad():
        for name, fn in cases.items():
            host, done = [], []
            for _ in range(20):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(200):
                    fn()
                host.append((time.perf_counter() - t0) / 200 * 1e6)
                torch.cuda.synchronize()
                done.append((time.perf_counter() - t0) / 200 * 1e6)
            print(f"  {name:55s} {statistics.median(host):7.2f}  {statistics.median(done):7.2f}")
    print(f"graphs built, graph launches: {ext_main.graph_launch_counts()}")

if __name__ == "__main__":
    main()
