"""Where the time of the two-launch tensor-core path goes, on a GPU.

Builds an instrumented copy of the extension (separate cache directory).  Thread 0 of every block
of the second kernel (two-launch form) records clock64() after a barrier at each phase boundary
and %globaltimer at entry, after the wait and at exit; thread 0 of every block of the first
kernel records %globaltimer at entry and exit and clock64() between its stages.  Prints, for an
eager call and a CUDA-graph replay, the median cycles per phase of each form and the kernels'
overlap; then the CUDA-graph time of the pair, of the first kernel alone, of the second alone,
of the pair launched as two plain kernels, and of the other forms.  The first kernel's blocks are
also grouped by the SM they ran on (how many of its blocks and of the second kernel's ran there).
PHASES_QUICK=1 leaves out the clocks of the forms other than the default.
PHASES_FUSED=1 times the chained form alone: in two launches, in one (FLASHOPM_SMALL_F16_FUSED=1), and
in two with the second kernel's W loads delayed (DBG_WDELAY, timing only).

    PYTHONPATH=src python scripts/small_tc_phases.py [B,S,N,C,H,D [TI,Dc ...]]

The anchors below are lines of opm_small_tc_kernel.cuh, opm_kernels.cuh and opm_api.cpp; when
those change, they may need to follow.
"""
import os
import sys

os.environ["FLASHOPM_CACHE_DIR"] = os.path.join(os.environ.get("TMPDIR", "/tmp"), "flashopm-small-tc-phases")
import torch

from flashopm import _build, ops
from patched_build import load_patched, patch, problem_from_argv


src = _build.read_sources()
k = src["opm_small_tc_kernel.cuh"]
BLK = "((blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x)"
CLK = lambda i: (f"\n  __syncthreads(); if (threadIdx.x == 0) g_tc_clk[{BLK} * 16 + {i}] = clock64();\n")  # noqa: E731
GT = lambda i: (f"\n  if (threadIdx.x == 0) {{ unsigned long long t_; asm volatile(\"mov.u64 %0, %globaltimer;\" : \"=l\"(t_));"  # noqa: E731
                f" g_tc_clk[{BLK} * 16 + {i}] = (long long)t_; }}\n")
k = patch(k, "template <int kTerms, bool kFused, bool kLocalA>\n__global__", "__device__ long long g_tc_clk[1 << 18];\n",
          before=True)
k = patch(k, "  float* den_s = smem + L.den;\n", GT(8) + CLK(0))
k = patch(k, "  if constexpr (kLocalA) {\n    small_tc_project_a(", CLK(6), before=True)
k = patch(k, "    small_tc_project_a(p, ti, as, L.lda, local_a, smem);\n", CLK(7))
k = patch(k, "    phase_p();\n  }\n", CLK(11))
k = patch(k, '    asm volatile("griddepcontrol.wait;\\n" ::: "memory");\n', GT(9) + CLK(1))
k = patch(k, "  if constexpr (!kLocalA) phase_p();\n", CLK(2), before=True)
k = patch(k, "  cp_async_wait_all();\n  __syncthreads();\n\n  if constexpr (kFma) {\n    // ---- phase O", CLK(3) + "\n",
          before=True)
k = patch(k, "  small_tc_store_out<false>(", CLK(4), before=True)
k = k.replace("      if (warp < ti) row_denominator(warp);", "      if (warp < ti && p.norm.eps != 1.f) row_denominator(warp);", 1)
assert "p.norm.eps != 1.f" in k
k = k.replace("    if (warp < items_p) load_w_batch(", "    if (warp < items_p && p.norm.eps != 2.f) load_w_batch(", 1)
k = k.replace("      if (item != warp) load_w_batch(mt0, 0);", "      if (item != warp || p.norm.eps == 2.f) load_w_batch(mt0, 0);", 1)
k = k.replace("      const float inv_den = 1.f / den_s[il];", "      const float inv_den = p.norm.eps == 1.f ? 1.f : 1.f / den_s[il];", 1)
idx = k.rindex("#endif\n}")
k = k[:idx] + CLK(5) + GT(10) + k[idx:]
src["opm_small_tc_kernel.cuh"] = k
# The float16 split form (opm_small_f16_kernel.cuh includes the header above, whose g_tc_clk it uses):
# slot 12 marks the end of its prologue, so that its rows tell the forms apart.
f = src["opm_small_f16_kernel.cuh"]
f = patch(f, "  // ---- prologue: independent of the first kernel ----\n", GT(8) + CLK(0), before=True)
f = patch(f, '  asm volatile("griddepcontrol.wait;\\n" ::: "memory");\n', CLK(12), before=True)
f = patch(f, '  asm volatile("griddepcontrol.wait;\\n" ::: "memory");\n', GT(9) + CLK(1))
f = patch(f, "  // ---- phase P: items", CLK(2), before=True)
f = patch(f, "  // ---- phase O: items", CLK(3), before=True)
f = patch(f, "  // out' = out", CLK(4), before=True)
# Thread 0 stores the SM its block runs on, plus one, at slot i of the block's `stride` slots of arr
SMID = lambda arr, stride, i: (f"\n  if (threadIdx.x == 0) {{ unsigned s_; asm volatile(\"mov.u32 %0, %smid;\" : \"=r\"(s_));"  # noqa: E731
                                f" {arr}[{BLK} * {stride} + {i}] = (long long)s_ + 1; }}\n")
# Thread 0's own clocks inside the phases (no barrier): after a's copies arrive (slot 6), after its
# phase-P item's MMAs (13) and stores (14), after b's copies arrive (15).
T0 = lambda i: f"\n  if (threadIdx.x == 0) g_tc_clk[{BLK} * 16 + {i}] = clock64();\n"  # noqa: E731
f = patch(f, "  mbarrier_wait_parity(a_bar, 0);\n", T0(6))
f = patch(f, "        // acc[n] = (row g | g + 8, columns 2t, 2t + 1) of n tile n", T0(13), before=True)
f = patch(f, "  // ---- b's exponents (copied while phase P ran)", T0(14), before=True)
f = patch(f, "  mbarrier_wait_parity(b_bar, 0);\n", T0(15))
# DBG_KNOB=4: the float16 split form without b's copies (b's values undefined: timing only)
f = f.replace("    mbarrier_arrive_expect_tx(b_bar, 2u * b_bytes + unsigned(L.NS4) * 4u);\n"
              "    bulk_copy_g2s(b_hi, b_src, b_bytes, b_bar);\n    bulk_copy_g2s(b_lo, b_src + p.b16_lo, b_bytes, b_bar);\n",
              "    const bool copy_b_ = p.norm.eps != 4.f;\n"
              "    mbarrier_arrive_expect_tx(b_bar, (copy_b_ ? 2u * b_bytes : 0u) + unsigned(L.NS4) * 4u);\n"
              "    if (copy_b_) { bulk_copy_g2s(b_hi, b_src, b_bytes, b_bar); bulk_copy_g2s(b_lo, b_src + p.b16_lo, b_bytes, b_bar); }\n", 1)
assert "copy_b_" in f
idx = f.rindex("#endif\n}")
f = f[:idx] + CLK(5) + GT(10) + f[idx:]
src["opm_small_f16_kernel.cuh"] = f
# The chained float16 split form: slot 11 marks it (-5); thread 0's clocks after a's copies arrive
# (6), after its first pair of phase-P tiles is split (13), after b's copies arrive (15), after its items (14).
c = src["opm_small_f16_chain_kernel.cuh"]
c = patch(c, "  // ---- prologue: independent of the first kernel ----\n", GT(8) + CLK(0)
          + f"\n  if (threadIdx.x == 0) g_tc_clk[{BLK} * 16 + 11] = -5;\n", before=True)
c = patch(c, '  asm volatile("griddepcontrol.wait;\\n" ::: "memory");\n', CLK(12), before=True)
c = patch(c, "  // ---- prologue: independent of the first kernel ----\n", SMID("g_tc_clk", 16, 3))  # its SM, slot 3
c = patch(c, '  asm volatile("griddepcontrol.wait;\\n" ::: "memory");\n', GT(9) + CLK(1))
c = patch(c, "    mbarrier_wait_parity_suspend(a_bar, 0);\n", T0(6))
c = patch(c, "      if (!b_arrived) {\n        mbarrier_wait_parity_suspend(b_bar, 0);\n",
          "\n  if (threadIdx.x == 0 && !b_arrived) g_tc_clk[" + BLK + " * 16 + 13] = clock64();\n", before=True)
c = patch(c, "        mbarrier_wait_parity_suspend(b_bar, 0);\n", T0(15))
c = patch(c, "    // The item's part of the sums: rows j", T0(14), before=True)
c = patch(c, "  // out' = out", CLK(4), before=True)
# The one-launch form (FLASHOPM_SMALL_F16_FUSED=1): thread 0 (a projecting warp's) after its
# projections (slot 7); the block's clock (12) and %globaltimer (2) before the grid's barrier, after
# it (1, 9).
c = patch(c, "        ws + 64 * round_up4_odd_quad(p.prep.C));\n", T0(7))
c = patch(c, "    cooperative_groups::this_grid().sync();", CLK(12) + GT(2), before=True)
c = patch(c, "    cooperative_groups::this_grid().sync();  // every block's rows of a and b stored and visible\n", GT(9) + CLK(1))
# DBG_WDELAY=k: the two-launch form's W loads issued k x 100 ns after the block's entry (timing only:
# how much the first kernel gains from W's traffic coming later; passed as trigger_next = 100 + k).
c = patch(c, "  if (has_unit) load_unit(wt, wv);\n", "  if (p.trigger_next >= 100) __nanosleep(100u * unsigned(p.trigger_next - 100));\n",
          before=True)
idx = c.rindex("#endif\n}")
c = c[:idx] + CLK(5) + GT(10) + c[idx:]
src["opm_small_f16_chain_kernel.cuh"] = c
kk = src["opm_kernels.cuh"]
PB = "((blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x)"
PGT = lambda i: (f"\n  if (threadIdx.x == 0) {{ unsigned long long t_; asm volatile(\"mov.u64 %0, %globaltimer;\" : \"=l\"(t_));"  # noqa: E731
                 f" g_prep_t[{PB} * 8 + {i}] = (long long)t_; }}\n")
PCLK = lambda i: f"\n  if (threadIdx.x == 0) g_prep_t[{PB} * 8 + {i}] = clock64();\n"  # noqa: E731
kk = patch(kk, "template <int Q, int RW, bool kProjectW, typename XT, bool kWholeW = false>", "__device__ long long g_prep_t[1 << 16];\n",
           before=True)
kk = patch(kk, "  const int n_base = nblk * block_rows;\n", PGT(0) + PCLK(2))
# slot 6: the SM the block ran on, plus one; slot 7: thread 0's clock once the weights and rows are
# in shared memory (the whole-weights form)
kk = patch(kk, "  const int n_base = nblk * block_rows;\n", SMID("g_prep_t", 8, 6))
kk = patch(kk, "    __syncthreads();  // every thread's weight copies, and this warp's row\n", PCLK(7))
# DBG_K1NOW=1: the whole-weights form without its weight copies (results undefined: timing only)
kk = kk.replace("  if (p.weights_late) {\n    if constexpr (kWholeW) stage_whole_weights();",
                "  if (p.weights_late == 2) cp_async_commit();\n  else if (p.weights_late) {\n    if constexpr (kWholeW) stage_whole_weights();", 1)
assert "p.weights_late == 2" in kk
kk = patch(kk, "  float acc[RW][Q];\n", PCLK(3), before=True)
kk = patch(kk, "  if constexpr (!kProjectW) {\n    if (p.ab_kind == kAbF16Split) {", PCLK(4), before=True)
kk = patch(kk, "      }\n      return;\n    }\n  }\n", PCLK(5) + PGT(1), before=True)
kk = patch(kk, "  // Bias, mask, store.  In project-first", PCLK(4), before=True)
kk = patch(kk, "  if constexpr (kProjectW) {\n    // c[b, s, h1, n, d]", PCLK(5) + PGT(1), before=True)
src["opm_kernels.cuh"] = kk
lc = src["opm_launch.cu"]
lc = lc.replace("    attr[0].val.programmaticStreamSerializationAllowed = 1;",
                "    attr[0].val.programmaticStreamSerializationAllowed = std::getenv(\"DBG_NOPDL\") ? 0 : 1;", 1)
lc = lc.replace("#include <array>", "#include <array>\n#include <cstdlib>", 1)
lc = lc.replace("\n}  // namespace flashopm", """
void dbg_copy_tc(void* dst, void* dst2) {
  C10_CUDA_CHECK(cudaMemcpyFromSymbol(dst, g_tc_clk, sizeof(g_tc_clk), 0, cudaMemcpyDeviceToDevice));
  C10_CUDA_CHECK(cudaMemcpyFromSymbol(dst2, g_prep_t, sizeof(g_prep_t), 0, cudaMemcpyDeviceToDevice));
  void* a; C10_CUDA_CHECK(cudaGetSymbolAddress(&a, g_tc_clk)); C10_CUDA_CHECK(cudaMemset(a, 0, sizeof(g_tc_clk)));
  C10_CUDA_CHECK(cudaGetSymbolAddress(&a, g_prep_t)); C10_CUDA_CHECK(cudaMemset(a, 0, sizeof(g_prep_t)));
}
}  // namespace flashopm""")
src["opm_launch.cu"] = lc
a = src["opm_api.cpp"]
a = a.replace("namespace flashopm {\nnamespace {", "namespace flashopm {\nvoid dbg_copy_tc(void*, void*);\nnamespace {", 1)
a = patch(a, "    if (!fused) run_prep(pa, false, dev, stream);\n\n    SmallTcArgs ta{};",
          "    const char* skip_ = std::getenv(\"DBG_SKIP\");\n", before=True)
a = a.replace("    if (!fused) run_prep(pa, false, dev, stream);\n\n    SmallTcArgs ta{};",
              "    if (!fused && (!skip_ || std::string(skip_) != \"k1\")) run_prep(pa, false, dev, stream);\n\n"
              "    SmallTcArgs ta{};", 1)
a = a.replace("    launch_small_tc(ta, tc_terms, stream);\n",
              "    if (!skip_ || std::string(skip_) != \"k2\") launch_small_tc(ta, tc_terms, stream);\n", 1)
# Knobs of this build: DBG_PLAN="TI,Dc" forces a tiling; DBG_KNOB=1 skips the row denominators
# (den = 1), DBG_KNOB=2 issues no W loads before the wait (passed in norm.eps, unused by the row
# convention).
a = patch(a, "    ta.f16_opts = 3;\n", "    if (const char* e_ = std::getenv(\"DBG_WDELAY\")) ta.trigger_next = 100 + std::atoi(e_);\n",
          before=True)
a = patch(a, "    ta.Dc = small_tc.Dc;\n", """    if (const char* e = std::getenv("DBG_PLAN")) std::sscanf(e, "%d,%d", &ta.TI, &ta.Dc);
    if (const char* e = std::getenv("DBG_KNOB")) if (ta.norm.kind == kNormRow) ta.norm.eps = float(std::atoi(e));
""")
a = a.replace('TORCH_LIBRARY_IMPL(flashopm, CUDA, m) {', '''at::Tensor dbg_tc(const at::Tensor& like) {
  at::Tensor t = at::zeros({(1 << 18) + (1 << 16)}, like.options().dtype(at::kLong));
  flashopm::dbg_copy_tc(t.data_ptr(), static_cast<long long*>(t.data_ptr()) + (1 << 18));
  return t;
}
TORCH_LIBRARY_IMPL(flashopm, CUDA, m) {
  m.impl("_dbg_tc", &dbg_tc);''')
a = a.replace('  args.weights_late = !env_is("FLASHOPM_PREP_WEIGHTS_FIRST", "1");',
              '  args.weights_late = std::getenv("DBG_K1NOW") ? 2 : !env_is("FLASHOPM_PREP_WEIGHTS_FIRST", "1");', 1)
assert "DBG_K1NOW" in a
a = a.replace("#include <algorithm>", "#include <algorithm>\n#include <cstdio>\n#include <cstdlib>\n#include <string>", 1)
src["opm_api.cpp"] = a
ops._lib.define("_dbg_tc(Tensor like) -> Tensor")
load_patched(src)
if not torch.cuda.is_available():
    sys.exit(0)

from flashopm.bench import time_graph  # noqa: E402
from flashopm.testing import capture_graph  # noqa: E402

shape, model, x, m = problem_from_argv()


def clocks(label, graph=False):
    """Per-phase clocks of one call, eager (the host's time between the launches included) or as a
    CUDA-graph replay (the launches as the GPU runs them back to back)."""
    call = lambda: model(x, m)  # noqa: E731
    if graph:
        call = capture_graph(call)[0].replay
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    torch.ops.flashopm._dbg_tc(x)
    call()
    torch.cuda.synchronize()
    raw = torch.ops.flashopm._dbg_tc(x).cpu()
    tc = raw[: 1 << 18].view(-1, 16)
    tc = tc[tc[:, 8] > 0].double()
    if len(tc) == 0:
        sys.exit(f"shape {shape}: the two-launch path did not run")
    prep = raw[1 << 18:].view(-1, 8)
    prep = prep[prep[:, 0] > 0].double()
    med = lambda hi, lo: (tc[:, hi] - tc[:, lo]).median().item()  # noqa: E731
    if (tc[:, 11] == -5).all():  # the chained float16 split form
        phases = [("prologue", med(12, 0)), ("wait", med(1, 12)), ("items", med(4, 1)), ("epilogue", med(5, 4)),
                  ("[thread 0: a arrives", med(6, 1)), ("first P tile", med(13, 6)), ("b arrives", med(15, 13)),
                  ("rest of its items", med(14, 15)), ("barrier]", med(4, 14))]
    elif (tc[:, 12] > 0).all():  # the float16 split form
        phases = [("prologue", med(12, 0)), ("wait", med(1, 12)), ("copy and split a", med(2, 1)),
                  ("phase P, split b", med(3, 2)), ("phase O", med(4, 3)), ("epilogue", med(5, 4)),
                  ("[thread 0: a arrives", med(6, 1)), ("P's MMAs", med(13, 2)), ("P's stores", med(14, 13)),
                  ("b arrives", med(15, 14)), ("b's factors and barrier]", med(3, 15))]
    elif (tc[:, 7] > 0).all():  # local a: prologue, projection of a and phase P come before the wait
        phases = [("prologue", med(6, 0)), ("project a", med(7, 6)), ("phase P", med(11, 7)), ("wait", med(1, 11)),
                  ("issue b copies", med(2, 1)), ("phase O (b arriving)", med(4, 2)), ("epilogue", med(5, 4))]
    else:
        phases = [("prologue+wait", med(1, 0)), ("load a", med(2, 1)), ("phase P (b arriving)", med(3, 2)),
                  ("phase O", med(4, 3)), ("epilogue", med(5, 4))]
    phases.append(("total", med(5, 0)))
    mode = "graph replay" if graph else "eager"
    print(f"{label} ({mode}), shape {shape}: {len(tc)} blocks in the second kernel, {len(prep)} in the first")
    print("  second kernel, cycles (median over blocks): " + "  ".join(f"{n}={c:.0f}" for n, c in phases))
    pm = lambda hi, lo: (prep[:, hi] - prep[:, lo]).median().item()  # noqa: E731
    print(f"  first kernel, cycles (median, thread 0): statistics={pm(3, 2):.0f}  projections={pm(4, 3):.0f}  "
          f"stores={pm(5, 4):.0f}  total={pm(5, 2):.0f}")
    if len(prep) == 0:  # one launch: the grid's barrier in place of the first kernel and the wait
        t0 = tc[:, 8].min()
        print(f"  one launch, cycles (median): thread 0's projections={med(7, 0):.0f}, block before the barrier="
              f"{med(12, 0):.0f}, barrier={med(1, 12):.0f}")
        print(f"  ns from the first block's entry: entry {tc[:, 8].min() - t0:.0f}..{tc[:, 8].max() - t0:.0f}, "
              f"at the barrier {tc[:, 2].min() - t0:.0f}..{tc[:, 2].max() - t0:.0f}, past it {tc[:, 9].min() - t0:.0f}.."
              f"{tc[:, 9].max() - t0:.0f}, exit {tc[:, 10].min() - t0:.0f}..{tc[:, 10].max() - t0:.0f}")
        return
    t0 = prep[:, 0].min()
    print(f"  ns from the first kernel's first block start: first kernel blocks start {prep[:, 0].min() - t0:.0f}.."
          f"{prep[:, 0].max() - t0:.0f}, end {prep[:, 1].min() - t0:.0f}..{prep[:, 1].max() - t0:.0f}; "
          f"second kernel entry {tc[:, 8].min() - t0:.0f}..{tc[:, 8].max() - t0:.0f}, past the wait "
          f"{tc[:, 9].min() - t0:.0f}..{tc[:, 9].max() - t0:.0f}, exit {tc[:, 10].min() - t0:.0f}..{tc[:, 10].max() - t0:.0f}")
    if (prep[:, 6] > 0).all():
        # The first kernel's blocks by their end, against what else ran on their SM
        k1_per_sm, k2_per_sm = {}, {}
        for sm in prep[:, 6].long().tolist():
            k1_per_sm[sm] = k1_per_sm.get(sm, 0) + 1
        if (tc[:, 11] == -5).all() and (tc[:, 3] > 0).all():
            for sm in tc[:, 3].long().tolist():
                k2_per_sm[sm] = k2_per_sm.get(sm, 0) + 1
        groups = {}
        for row in prep.tolist():
            sm = int(row[6])
            key = (k1_per_sm[sm], k2_per_sm.get(sm, 0))
            groups.setdefault(key, []).append(row)
        for (n1, n2), rows in sorted(groups.items()):
            ends = sorted(r[1] - t0 for r in rows)
            tot = sorted(r[5] - r[2] for r in rows)
            wts = sorted(r[7] - r[2] for r in rows if r[7] > 0)
            mid = lambda v: v[len(v) // 2] if v else float("nan")  # noqa: E731
            print(f"    first-kernel blocks on SMs with {n1} of its blocks and {n2} of the second's: {len(rows)}, end "
                  f"{ends[0]:.0f}..{ends[-1]:.0f} ns (median {mid(ends):.0f}), cycles median {mid(tot):.0f} "
                  f"(weights and rows staged at {mid(wts):.0f})")


with torch.no_grad():
    if os.environ.get("PHASES_FUSED"):  # the chained form in two launches and in one
        forms = [({}, "two launches"), ({"FLASHOPM_SMALL_F16_FUSED": "1"}, "one launch")]
        forms += [({"DBG_WDELAY": k}, f"two launches, W's loads {k}00 ns late") for k in ("5", "10", "15", "20")]
        for graph in (False, True):
            for env, what in forms:
                os.environ.update(env)
                clocks(what, graph)
                for var in env:
                    os.environ.pop(var)
        for rnd in range(3):
            for env, what in forms + [({"DBG_SKIP": "k2"}, "the first kernel alone")]:
                os.environ.update(env)
                print(f"graph, {what}: {time_graph(lambda: model(x, m), n=50)}")
                for var in env:
                    os.environ.pop(var)
        sys.exit(0)
    for graph in (False, True):
        clocks("default form", graph)
        os.environ["FLASHOPM_PREP_WHOLE_W"] = "0"
        clocks("default form, the first kernel's weights in chunks", graph)
        os.environ.pop("FLASHOPM_PREP_WHOLE_W")
        for env, what in [({"FLASHOPM_PREP_WARPS": "8"}, "the first kernel at 8 warps per block"),
                          ({"DBG_K1NOW": "1"}, "the first kernel without its weight copies (timing only)")]:
            os.environ.update(env)
            clocks("default form, " + what, graph)
            for var in env:
                os.environ.pop(var)
        if os.environ.get("PHASES_QUICK"):
            continue
        os.environ["FLASHOPM_SMALL_F16_CHAIN"] = "0"
        clocks("staged float16 split form", graph)
        os.environ.pop("FLASHOPM_SMALL_F16_CHAIN")
        os.environ["FLASHOPM_SMALL_TC_F16"] = "0"
        clocks("FMA form", graph)
        os.environ.pop("FLASHOPM_SMALL_TC_F16")
        os.environ["FLASHOPM_SMALL_TC_LOCAL_A"] = "1"
        clocks("FMA form, each block projecting its rows of a", graph)
        os.environ.pop("FLASHOPM_SMALL_TC_LOCAL_A")
        os.environ["FLASHOPM_SMALL_TC_FMA"] = "0"
        clocks("mma.sync form", graph)
        os.environ.pop("FLASHOPM_SMALL_TC_FMA")
        os.environ["DBG_KNOB"] = "4"
        clocks("default form without b's copies (timing only)", graph)
        os.environ.pop("DBG_KNOB")
    variants = [({}, "both kernels"), ({"DBG_SKIP": "k1"}, "without the first kernel"),
                ({"DBG_SKIP": "k2"}, "without the second kernel"),
                ({"FLASHOPM_SMALL_F16_CHAIN": "0"}, "staged float16 split form"),
                ({"FLASHOPM_SMALL_F16_CHAIN": "0", "DBG_SKIP": "k1"}, "staged float16 split form without the first kernel"),
                ({"FLASHOPM_SMALL_F16_CHAIN": "0", "DBG_SKIP": "k2"}, "staged float16 split form without the second kernel"),
                ({"FLASHOPM_PREP_WHOLE_W": "0"}, "the first kernel's weights in chunks"),
                ({"FLASHOPM_PREP_WHOLE_W": "0", "DBG_SKIP": "k2"}, "the first kernel alone, its weights in chunks"),
                ({"FLASHOPM_PREP_WARPS": "8"}, "the first kernel at 8 warps per block"),
                ({"FLASHOPM_PREP_WARPS": "8", "DBG_SKIP": "k2"}, "the first kernel alone at 8 warps per block"),
                ({"DBG_K1NOW": "1"}, "the first kernel without its weight copies (timing only)"),
                ({"DBG_K1NOW": "1", "DBG_SKIP": "k2"}, "the first kernel alone without its weight copies"),
                ({"DBG_NOPDL": "1"}, "second kernel launched without programmatic dependency"),
                ({"DBG_KNOB": "1"}, "no row denominators"),
                ({"DBG_KNOB": "4"}, "float16 split form without b's copies (timing only)"),
                ({"FLASHOPM_SMALL_TC_F16": "0"}, "FMA form"),
                ({"FLASHOPM_SMALL_TC_LOCAL_A": "1"}, "FMA form, each block projecting its rows of a"),
                ({"FLASHOPM_SMALL_TC_FMA": "0"}, "mma.sync form"),
                ({"FLASHOPM_SMALL_TC_FMA": "0", "DBG_KNOB": "2"}, "mma.sync form, no W loads before the wait")]
    variants += [({"DBG_PLAN": plan}, f"tiling TI,Dc = {plan}") for plan in sys.argv[2:]]
    for env, what in variants:
        for var in ("DBG_SKIP", "DBG_NOPDL", "DBG_KNOB", "DBG_PLAN", "DBG_K1NOW", "FLASHOPM_PREP_WARPS",
                    "FLASHOPM_SMALL_TC_FMA", "FLASHOPM_SMALL_TC_LOCAL_A", "FLASHOPM_SMALL_TC_F16", "FLASHOPM_SMALL_F16_CHAIN", "FLASHOPM_PREP_WHOLE_W"):
            os.environ.pop(var, None)
        os.environ.update(env)
        print(f"graph, {what}: {time_graph(lambda: model(x, m), n=50)}")
