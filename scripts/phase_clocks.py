"""Per-phase clock64 breakdown of the single-launch kernel, on a GPU.

Builds an instrumented copy of the extension (separate cache directory): thread 0 of every block
records clock64() after a barrier at each phase boundary; prints the median cycles per phase over
the blocks, and the CUDA-graph time, for the automatic tiling and for any forced ones.

    PYTHONPATH=src python scripts/phase_clocks.py B,S,N,C,H,D [TI,Dc,CL ...]

The anchors below are lines of opm_small_kernel.cuh; when the kernel changes, they may need to
follow.
"""
import os, sys, statistics
os.environ["FLASHOPM_CACHE_DIR"] = os.path.join(os.environ.get("TMPDIR", "/tmp"), "flashopm-phase-clocks")
import torch
import flashopm
from flashopm import _build, ops

src = _build.read_sources()
k = src["opm_small_kernel.cuh"]
def ins_after(text, anchor, add):
    assert anchor in text, anchor
    return text.replace(anchor, anchor + add, 1)
def ins_before(text, anchor, add):
    assert anchor in text, anchor
    return text.replace(anchor, add + anchor, 1)
M = lambda i: f"\n  __syncthreads(); if (threadIdx.x == 0) g_phase_clk[((blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x) * 16 + {i}] = clock64();\n"
k = ins_before(k, "template <bool kVecB>", "__device__ long long g_phase_clk[1 << 16];\n")
k = ins_after(k, "  cluster_arrive_relaxed();\n", M(0))
k = ins_before(k, "  // Masks (any dtype", M(1))
k = ins_after(k, "  cp_async_wait<1>();\n  __syncthreads();\n", M(2))
k = ins_before(k, "  // ---- the four contractions", M(3))
k = ins_before(k, "    if (job == 0 && !has_rows) continue;", "    if (job == 1) { " + M(4) + " }\n")
k = ins_before(k, "      // ---- push this block's rows", M(5))
k = ins_after(k, "      cluster_wait();  // every peer has started (its shared memory exists)\n", M(6))
k = ins_before(k, "      cp_async_wait_all();\n      cluster_barrier();", M(7))
k = ins_after(k, "      if (!has_rows) return;\n", M(8))
k = ins_before(k, "    GemmShape g;", "    if (job == 3) { " + M(9) + " }\n")
idx = k.rindex("#endif\n}")
k = k[:idx] + M(10) + k[idx:]
src["opm_small_kernel.cuh"] = k
l = src["opm_launch.cu"]
l = l.replace("\n}  // namespace flashopm", "\nvoid dbg_copy_clk(void* dst) { C10_CUDA_CHECK(cudaMemcpyFromSymbol(dst, g_phase_clk, sizeof(g_phase_clk), 0, cudaMemcpyDeviceToDevice)); void* a; C10_CUDA_CHECK(cudaGetSymbolAddress(&a, g_phase_clk)); C10_CUDA_CHECK(cudaMemset(a, 0, sizeof(g_phase_clk))); }\n}  // namespace flashopm")
l = l.replace('#include "opm_small_kernel.cuh"', k)
src["opm_launch.cu"] = l
a = src["opm_api.cpp"]
a = a.replace("namespace flashopm {\nnamespace {", "namespace flashopm {\nvoid dbg_copy_clk(void*);\nnamespace {", 1)
a = ins_before(a, "    launch_small(sa, small.smem_bytes, stream);", """    if (const char* e = std::getenv("DBG_PLAN")) {
      int ti, dc, cl; if (std::sscanf(e, "%d,%d,%d", &ti, &dc, &cl) == 3) {
        sa.TI = ti; sa.Dc = dc; sa.CL = cl; sa.n_itiles = int((N + ti - 1) / ti);
        small.smem_bytes = small_layout(int(S), int(N), int(C), int(H), ti, dc, cl).total * 4;
      }
    }
""")
a = a.replace('TORCH_LIBRARY_IMPL(flashopm, CUDA, m) {', '''at::Tensor dbg_clk(const at::Tensor& like) {
  at::Tensor t = at::empty({1 << 16}, like.options().dtype(at::kLong));
  flashopm::dbg_copy_clk(t.data_ptr());
  return t;
}
TORCH_LIBRARY_IMPL(flashopm, CUDA, m) {
  m.impl("_dbg_clk", &dbg_clk);''')
a = a.replace("#include <algorithm>", "#include <algorithm>\n#include <cstdio>\n#include <cstdlib>")
src["opm_api.cpp"] = a
ops._lib.define("_dbg_clk(Tensor like) -> Tensor")
_build.read_sources = lambda: src
_build.load()
if not torch.cuda.is_available(): sys.exit(0)

torch.manual_seed(0)
shape = tuple(int(v) for v in sys.argv[1].split(",")) if len(sys.argv) > 1 else (2, 8, 32, 64, 32, 64)
B, S, N, C, H, D = shape
model = flashopm.ModelNew(C, D, H).cuda()
x = torch.randn(B, S, N, C, device="cuda"); m = (torch.rand(B, S, N, device="cuda") > 0.2).float()
plans = [None] + sys.argv[2:]
from flashopm.bench import time_graph
print("shape", shape, "auto plan", torch.ops.flashopm._single_launch_plan(x, *shape))
names = ["issue async", "mask loads+wait", "den+LN", "proj a", "proj b", "cluster wait", "push", "cluster sync", "P", "O"]
for plan in plans:
    if plan: os.environ["DBG_PLAN"] = plan
    else: os.environ.pop("DBG_PLAN", None)
    for _ in range(3): out = model(x, m)
    torch.cuda.synchronize()
    torch.ops.flashopm._dbg_clk(x)
    out = model(x, m)
    torch.cuda.synchronize()
    clk = torch.ops.flashopm._dbg_clk(x).cpu().view(-1, 16)
    rows = clk[(clk[:, 10] > 0)]
    d = (rows[:, 1:11] - rows[:, 0:10]).double()
    tot = (rows[:, 10] - rows[:, 0]).double()
    g = time_graph(lambda: model(x, m), n=50)
    print(f"plan {plan or 'auto'}: graph {g}, blocks with rows {len(rows)}, total cycles median {tot.median().item():.0f}")
    print("   " + "  ".join(f"{n}={d[:, i].median().item():.0f}" for i, n in enumerate(names)))
