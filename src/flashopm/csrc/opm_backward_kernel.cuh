// Backward of the outer-first contraction on tensor cores (mma.sync TF32, float32 sums; 3xTF32
// for float32 accuracy as in opm_tc_kernel.cuh).  Shapes and math in opm_params.h (BwdSideArgs,
// BwdWArgs).  Neither kernel writes a (pairs x H·H) tensor to global memory: each chains two
// GEMMs per tile with the intermediate in shared memory.
//
// Both kernels run one sequence of pipeline stages (kBwStages deep, cp.async) over all their
// tiles; each stage holds the operands of one k-chunk of 32 of either GEMM, so the loads of the
// next tile's first GEMM overlap the current tile's second.  With three terms every k-step's
// products are added to the running sums in float32 (see mma_split_add).
#pragma once

#include "opm_kernels.cuh"
#include "opm_mma.cuh"

namespace flashopm {

// grad_x[s, i, h1] for a block of TI rows i, HC values of h1 (TI·HC = 64 rows of GEMM 2) and
// kBwSB values of s, over the column tiles of its split (TJ columns j each, TJ·H = 128):
//   GEMM 1 (per tile): dO[(i,j), (h1,h2)] = sum_d g[i,j,d] W[d,h1,h2]      M = 64 pairs, N = 128, K = D
//   GEMM 2:            grad[(i,h1), s]   += sum_(j,h2) dO[(i,h1),(j,h2)] y[s,j,h2]    M = 64, N = kBwSB, K = 128
// Four warps side by side along n (64 x 32 each) in both GEMMs.
// Each thread's copy addresses come from bases and strides set once, with the step's (tile, chunk)
// kept as counters: rebuilt from the step index they cost ~560 instructions per step against ~900
// for the step's GEMM (and 4% more time at the training crop).
template <int kTerms, int kH>
__global__ void __launch_bounds__(kBwThreads, 2) opm_bwd_side_kernel(const BwdSideArgs p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  extern __shared__ float4 smem_f4[];
  float* smem = reinterpret_cast<float*>(smem_f4);
  float* Ds = smem + kBwStages * kBwSideStageFloats;  // dO of the current tile: [(il,h1c)][(jl,h2)], K-major
  constexpr int H = kH, HC = kBwSideCols / H, TI = kBwSideRows / HC, TJ = kBwSideCols / H;
  const int Nr = p.Nr, Nc = p.Nc, S = p.S, D = p.D, Dp = p.Dp;
  const int i0 = blockIdx.x * TI, hc0 = blockIdx.y * HC;
  const int zs = blockIdx.z / p.jsplits, split = blockIdx.z - zs * p.jsplits;
  const int b = zs / p.n_sblocks, s0 = (zs - b * p.n_sblocks) * kBwSB;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int wn = warp;
  const int n1 = (D + kBwK - 1) / kBwK;
  const int spt = n1 + kBwSideCols / kBwK;  // steps per tile: GEMM 1's chunks of d, then GEMM 2's of (j, h2)
  const int n_jt = (Nc + TJ - 1) / TJ;
  const int my_tiles = split < n_jt ? (n_jt - 1 - split) / p.jsplits + 1 : 0;  // tiles split, split + jsplits, ...
  const int total = my_tiles * spt;
  const int64_t HH = int64_t(H) * H;
  const float* g_b = p.g + int64_t(b) * p.gs_b;
  const float* y_b = p.y + int64_t(b) * S * Nc * H;

  // The thread's fixed part of each copy.  g: rows q = q0 + 16u (il = il0 + u·16/TJ, the same
  // jl), 16 bytes at k4g; W: rows k = kw0 + 4u at column n4w; y: rows sl = q0 + 16u at k4y, whose
  // element (s, j0 + jl, h2) with jl·H + h2 = k20 + k4y sits at s·Nc·H + j0·H + k20 + k4y.
  const int q0 = tid >> 3, k4 = (tid & 7) * 4, il0 = q0 / TJ, jlg = q0 - il0 * TJ, kw0 = tid >> 5;
  const float* g_row0 = g_b + int64_t(i0 + il0) * p.gs_r + int64_t(jlg) * p.gs_c + k4;
  const int64_t g_rstep = int64_t(16 / TJ) * p.gs_r, y_rstep = int64_t(16) * Nc * H;
  const float* w_row0 = p.w + kw0 * HH + hc0 * H + (tid & 31) * 4;
  const float* y_row0 = y_b + int64_t(s0 + q0) * Nc * H + k4;
  int ld_r = 0, ld_j0 = split * TJ;  // the next step to load: its chunk and its tile's first column
  auto load_step = [&](int buf) {
    float* X = smem + buf * kBwSideStageFloats;
    if (ld_r < n1) {
      const int d0 = ld_r * kBwK;
      const bool cols_ok = ld_j0 + jlg < Nc && d0 + k4 < Dp;
      const float* src = g_row0 + int64_t(ld_j0) * p.gs_c + d0;
#pragma unroll
      for (int u = 0; u < kBwSideRows * kBwK / 4 / kBwThreads; ++u) {  // g: 64 pairs x 32 d
        const bool ok = cols_ok && i0 + il0 + u * (16 / TJ) < Nr;
        cp_async16z(X + (q0 + 16 * u) * kBwLdK + k4, ok ? src + u * g_rstep : p.g, ok);
      }
      float* Y = X + kBwSideXFloats + kw0 * kBwLdN + (tid & 31) * 4;
      const float* w_src = w_row0 + d0 * HH;
#pragma unroll
      for (int u = 0; u < kBwK * kBwSideCols / 4 / kBwThreads; ++u) {  // W: 32 d x 128 (h1, h2)
        const bool ok = d0 + kw0 + 4 * u < D;
        cp_async16z(Y + 4 * u * kBwLdN, ok ? w_src + 4 * u * HH : p.w, ok);
      }
    } else {
      const int k20 = (ld_r - n1) * kBwK;
      const bool col_ok = ld_j0 + (k20 + k4) / H < Nc;
      const float* src = y_row0 + int64_t(ld_j0) * H + k20;
#pragma unroll
      for (int u = 0; u < kBwSB * kBwK / 4 / kBwThreads; ++u) {  // y: kBwSB s x 32 (j, h2)
        const bool ok = col_ok && s0 + q0 + 16 * u < S;
        cp_async16z(X + (q0 + 16 * u) * kBwLdK + k4, ok ? src + u * y_rstep : p.y, ok);
      }
    }
    if (++ld_r == spt) ld_r = 0, ld_j0 += p.jsplits * TJ;
  };

  float acc1[4][4][4], acc2[4][4][4];
  zero_tiles(acc1);
  zero_tiles(acc2);
#pragma unroll
  for (int st = 0; st < kBwStages - 1; ++st) {
    if (st < total) {
      load_step(st);
    }
    cp_async_commit();
  }
  // the current step's chunk (GEMM 1's chunks of d, then GEMM 2's of (j, h2)) and its stage; the
  // stage kBwStages - 1 steps ahead is the one before it
  int r = 0, buf = 0;
  for (int step = 0; step < total; ++step) {
    cp_async_wait<kBwStages - 2>();
    __syncthreads();
    if (step + kBwStages - 1 < total) load_step(buf == 0 ? kBwStages - 1 : buf - 1);
    cp_async_commit();
    const float* X = smem + buf * kBwSideStageFloats;
    if (r < n1) {
      warp_mma_tf32<kTerms, 4, 4, true, false, kBwK / 8>(acc1, X, kBwLdK, X + kBwSideXFloats + wn * 32, kBwLdN, g, t);
      if (r == n1 - 1) {
        // dO to shared memory as GEMM 2's A: pair q = il·TJ + jl, column n = h1c·H + h2
#pragma unroll
        for (int mt = 0; mt < 4; ++mt)
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int q = mt * 16 + g + 8 * half, il = q / TJ, jl = q - il * TJ;
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
              const int n = wn * 32 + nt * 8 + 2 * t, h1c = n / H, h2 = n - h1c * H;
              *reinterpret_cast<float2*>(Ds + (il * HC + h1c) * kBwLdDs + jl * H + h2) =
                  make_float2(acc1[mt][nt][2 * half], acc1[mt][nt][2 * half + 1]);
            }
          }
        zero_tiles(acc1);
      }
    } else {
      warp_mma_tf32<kTerms, 4, 4, true, true, kBwK / 8>(acc2, Ds + (r - n1) * kBwK, kBwLdDs, X + wn * 32 * kBwLdK,
                                                        kBwLdK, g, t);
    }
    r = r + 1 == spt ? 0 : r + 1;
    buf = buf + 1 == kBwStages ? 0 : buf + 1;
  }
  cp_async_wait_all();

  float* grad_b = p.grad + (int64_t(split) * p.B + b) * S * Nr * H;
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int m = mt * 16 + g + 8 * half, il = m / HC, i = i0 + il;
      if (i >= Nr) continue;
      float* dst = grad_b + int64_t(i) * H + hc0 + (m - il * HC);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int s = s0 + wn * 32 + nt * 8 + 2 * t + e;
          if (s < S) dst[int64_t(s) * Nr * H] = acc2[mt][nt][2 * half + e];
        }
    }
#else
  target_lacks_instructions();
#endif
}

// The side kernel's float16 split form (BwdSideArgs, kBsf* in opm_params.h): the tile and sums of
// opm_bwd_side_kernel on warpgroup MMAs, the block one warpgroup.  Per tile:
//   GEMM 1, per chunk of 32 d: each thread reads its A fragments of g (rows 16·warp + g, + 8) as
//     float32 from the stage, scales each row's chunk by the power of two of its largest magnitude
//     (four lanes hold a row's 32 values), splits them into float16 high and low parts in registers
//     and issues lo·hi + hi·lo + hi·hi (wgmma m64n128k16, A from registers, B = W's split slot)
//     into a zeroed accumulator, added to acc1 in float32 times the row's inverse scale (the tensor
//     core truncates as it accumulates, so no accumulator spans more than one chunk).
//   dO = acc1 times W's column scales, split per (row (i, h1), chunk of 32 (j, h2)) into shared
//     memory, the 16-byte pieces of chunk c rotated by c % 4 as y's are, so that the stores of a
//     warp (four chunks at once) meet no bank conflicts.
//   GEMM 2, per chunk: 6 wgmma m64n128k16 (both operands in shared memory) into a zeroed
//     accumulator, added to acc2 times the row's inverse scale; y's column scales in the epilogue.
// The loop runs tiles, then each tile's chunks, so that acc1 lives only through GEMM 1.
// kTerms = 1 (PyTorch's "high"): hi·hi alone, each operand rounded to float16's 11 bits after its
// power-of-two scale, TF32's rounding; the low parts are neither stored nor read.
// kGSplit (opm_bwd_side_f16_g_split_kernel): g arrives split once for both sides
// (opm_grad_scale_kernel's side form), each pair's chunk of 32 d as its 128 bytes of float16 high
// then low parts, and the chunk's factor 2^-e at g_inv[(offset of the chunk in g) / 32]: the copies
// place each 128-byte piece as W's rows are placed and GEMM 1 reads both operands from shared
// memory; the same parts and factors, so the same sums.
// The float16 split kernels' ring of kStages stages of kStageBytes each, filled by asynchronous
// copies kAhead steps ahead: load_step(stage) issues one step's copies into a stage; total steps in
// all.  With kAhead = kStages - 1 each step's copies go into the stage the previous step read, so
// that step's MMAs must be complete by the next step's barrier; with fewer, the stages of the
// kStages - 1 - kAhead steps before it may still be read by MMAs in flight.
template <int kStageBytes, int kStages = kBwStages, int kAhead = kStages - 1>
struct BwStageRing {
  static_assert(kAhead >= 1 && kAhead < kStages, "copies at least one step ahead, into a stage no step in flight reads");
  const char* smem;
  int total;
  int step = 0, buf = 0;
  template <typename LoadStep>
  __device__ __forceinline__ void prime(LoadStep& load_step) {
#pragma unroll
    for (int st = 0; st < kAhead; ++st) {
      if (st < total) load_step(st);
      cp_async_commit();
    }
  }
  // The current step's stage, once its copies (every thread's) are visible to the tensor cores;
  // the copies of the step kAhead ahead go out after the barrier.
  template <typename LoadStep>
  __device__ __forceinline__ const char* next(LoadStep& load_step) {
    cp_async_wait<kAhead - 1>();
    fence_proxy_async_smem();
    __syncthreads();
    if (step + kAhead < total) {
      if constexpr (kAhead == kStages - 1) load_step(buf == 0 ? kStages - 1 : buf - 1);
      else load_step(buf + kAhead < kStages ? buf + kAhead : buf + kAhead - kStages);
    }
    cp_async_commit();
    const char* st = smem + buf * kStageBytes;
    ++step;
    buf = buf + 1 == kStages ? 0 : buf + 1;
    return st;
  }
};

// One chunk of 32 k of a float16 split product into a fresh accumulator (64 x 128), waited for:
// both operands split slots (rows of 128 bytes, the 32 high parts then the 32 low parts, K-major
// in 1 KB swizzle atoms), A's 64 rows at a, B's 128 at b.
template <int kTerms>
__device__ __forceinline__ void split_slots_product(float (&part)[64], const char* a, const char* b) {
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 2; ++kk) {
    const uint64_t a_hi = wgmma_desc(a + 32 * kk, 16, 1024), a_lo = wgmma_desc(a + 64 + 32 * kk, 16, 1024);
    const uint64_t b_hi = wgmma_desc(b + 32 * kk, 16, 1024), b_lo = wgmma_desc(b + 64 + 32 * kk, 16, 1024);
    wgmma_split_m64n128k16<kTerms>(part, a_hi, a_lo, b_hi, b_lo, kk);
  }
  wgmma_commit();
  wgmma_wait<0>();
}

template <int kTerms, int kH, bool kGSplit>
__device__ __forceinline__ void bwd_side_f16(const BwdSideArgs& p, const float* __restrict__ g_inv) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(kTerms == 1 || kTerms == 3, "the high parts' products alone, or with both cross terms");
  static_assert(kH == 32, "the float16 split side kernel's dO chunks are one column j each");
  static_assert(kBwThreads == kBwSideCols, "one W column scale per thread");
  extern __shared__ float4 smem_f4[];
  char* smem = align_smem_1k(reinterpret_cast<char*>(smem_f4));
  char* dos = smem + kBwStages * kBsfStageBytes;  // dO split: chunk c (column jl = c) at c·8 KB
  float* do_inv = reinterpret_cast<float*>(dos + kBsfDoBytes);  // [row (il, h1c)][chunk]: 2^-e
  float* w_inv_s = do_inv + kBwSideRows * kBsfDoChunks;         // [column (h1c, h2)]: 2^-e
  constexpr int H = kH, HC = kBwSideCols / H, TI = kBwSideRows / HC, TJ = kBwSideCols / H;
  constexpr int kChunks2 = kBsfDoChunks;  // GEMM 2's chunks per tile
  const int Nr = p.Nr, Nc = p.Nc, S = p.S, D = p.D, Dp = p.Dp;
  const int i0 = blockIdx.x * TI, hc0 = blockIdx.y * HC;
  const int zs = blockIdx.z / p.jsplits, split = blockIdx.z - zs * p.jsplits;
  const int b = zs / p.n_sblocks, s0 = (zs - b * p.n_sblocks) * kBwSB;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int n1 = (D + kBwK - 1) / kBwK;
  const int spt = n1 + kChunks2;
  const int n_jt = (Nc + TJ - 1) / TJ;
  const int my_tiles = split < n_jt ? (n_jt - 1 - split) / p.jsplits + 1 : 0;
  const int total = my_tiles * spt;
  const int n_kc = Nc * H / 32;  // y's chunks of k

  w_inv_s[tid] = p.w_inv[hc0 * H + tid];

  // Copies.  g: rows q = q0 + 16u (il = il0 + u·16/TJ, the same jl), 16 bytes at k4.  Split slots
  // (W's chunk: columns hc0·H + row; y's: s = s0 + row): rows r = tid / 8 + 16u, 16-byte piece
  // tid % 8, swizzled as the 128-byte K-major atoms (16 rows on, the same phase: + 2 KB).
  const int q0 = tid >> 3, k4 = (tid & 7) * 4, il0 = q0 / TJ, jlg = q0 - il0 * TJ;
  const float* g_row0 = p.g + int64_t(b) * p.gs_b + int64_t(i0 + il0) * p.gs_r + int64_t(jlg) * p.gs_c + k4;
  const int64_t g_rstep = int64_t(16 / TJ) * p.gs_r;
  const int sr = tid >> 3, sp = tid & 7;
  const uint32_t slot_dst = uint32_t(sr >> 3) * 1024u + uint32_t(sr & 7) * 128u + uint32_t((sp ^ (sr & 7)) << 4);
  const uint32_t* w_src0 = p.w_split + (int64_t(hc0) * H + sr) * 32 + sp * 4;
  const uint32_t* y_src0 = p.y_split + (int64_t(b) * n_kc * S + s0 + sr) * 32 + sp * 4;
  int ld_r = 0, ld_j0 = split * TJ;  // the next step to load: its chunk and its tile's first column
  auto load_step = [&](int buf) {
    char* st = smem + buf * kBsfStageBytes;
    if (ld_r < n1) {
      const int d0 = ld_r * kBwK;
      float* G = reinterpret_cast<float*>(st + kBsfSlotBytes);
      const bool cols_ok = ld_j0 + jlg < Nc && d0 + k4 < Dp;
      const float* src = g_row0 + int64_t(ld_j0) * p.gs_c + d0;
#pragma unroll
      for (int u = 0; u < kBwSideRows * kBwK / 4 / kBwThreads; ++u) {  // g: 64 pairs x 32 d
        const bool ok = cols_ok && i0 + il0 + u * (16 / TJ) < Nr;
        // split: row q0 + 16u is the slot's row sr + 16u, its 16-byte piece sp = k4 / 4 (with one
        // term the low pieces too: skipping them took the loop from 309 to 412 instructions)
        if constexpr (kGSplit) cp_async16z(st + kBsfSlotBytes + slot_dst + 2048u * u, ok ? src + u * g_rstep : p.g, ok);
        else cp_async16z(G + (q0 + 16 * u) * kBsfGLd + k4, ok ? src + u * g_rstep : p.g, ok);
      }
      const uint32_t* w_src = w_src0 + int64_t(ld_r) * H * H * 32;  // chunks padded with zeros past D
#pragma unroll
      for (int u = 0; u < kBwSideCols / 16; ++u) cp_async16z(st + slot_dst + 2048u * u, w_src + u * 16 * 32, true);
    } else {
      const int c = ld_j0 * H / 32 + (ld_r - n1);
      const bool c_ok = c < n_kc;
      const uint32_t* y_src = y_src0 + int64_t(c) * S * 32;
#pragma unroll
      for (int u = 0; u < kBwSB / 16; ++u) {
        const bool ok = c_ok && s0 + sr + 16 * u < S;
        cp_async16z(st + slot_dst + 2048u * u, ok ? y_src + u * 16 * 32 : p.y_split, ok);
      }
    }
    if (++ld_r == spt) ld_r = 0, ld_j0 += p.jsplits * TJ;
  };

  BwStageRing<kBsfStageBytes> ring{smem, total};
  ring.prime(load_step);
  const auto next_stage = [&]() { return ring.next(load_step); };

  float acc2[64];
#pragma unroll
  for (int e = 0; e < 64; ++e) acc2[e] = 0.f;
  for (int tile = 0; tile < my_tiles; ++tile) {
    // ---- GEMM 1: acc1[(pair), (h1c, h2)], rows 16·warp + g (+8), columns 8j + 2t (+1) ----
    float acc1[64];
#pragma unroll
    for (int e = 0; e < 64; ++e) acc1[e] = 0.f;
    if constexpr (kGSplit) {
      // rows 16·warp + g (+8): pair (il, jl); each chunk's factor 2^-e at the pair's g offset / 32
      const int j0 = (split + tile * p.jsplits) * TJ;
      const float* inv_row[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int q = 16 * warp + g + 8 * half, il = q / TJ, jl = q - il * TJ;
        inv_row[half] = i0 + il < Nr && j0 + jl < Nc
                            ? g_inv + ((int64_t(b) * p.gs_b + int64_t(i0 + il) * p.gs_r + int64_t(j0 + jl) * p.gs_c) >> 5)
                            : nullptr;
      }
      for (int r = 0; r < n1; ++r) {
        const char* st = next_stage();
        const char* gsl = st + kBsfSlotBytes;
        const float inv0 = inv_row[0] ? inv_row[0][r] : 0.f, inv1 = inv_row[1] ? inv_row[1][r] : 0.f;
        float part[64];
        split_slots_product<kTerms>(part, gsl, st);
#pragma unroll
        for (int j = 0; j < 16; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc1[4 * j + e] = fmaf(part[4 * j + e], e < 2 ? inv0 : inv1, acc1[4 * j + e]);
      }
    } else {
      for (int r = 0; r < n1; ++r) {
        const char* st = next_stage();
        const float* G = reinterpret_cast<const float*>(st + kBsfSlotBytes) + (16 * warp + g) * kBsfGLd + 2 * t;
        float2 v[2][2][2];  // [row half][k step][k + 8x]
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
          for (int kk = 0; kk < 2; ++kk)
#pragma unroll
            for (int x = 0; x < 2; ++x)
              v[half][kk][x] = *reinterpret_cast<const float2*>(G + 8 * half * kBsfGLd + 16 * kk + 8 * x);
        uint32_t a_hi[2][4], a_lo[2][4];
        float inv[2];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          float m = 0.f;
#pragma unroll
          for (int kk = 0; kk < 2; ++kk)
#pragma unroll
            for (int x = 0; x < 2; ++x) m = fmaxf(m, fmaxf(fabsf(v[half][kk][x].x), fabsf(v[half][kk][x].y)));
          m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
          m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
          const int e = split_scale_exp_bits(m);
          const float f = exp2_int(e);
          inv[half] = exp2_int(-e);
#pragma unroll
          for (int kk = 0; kk < 2; ++kk)
#pragma unroll
            for (int x = 0; x < 2; ++x)
              split_f16x2(v[half][kk][x].x * f, v[half][kk][x].y * f, a_hi[kk][half + 2 * x], a_lo[kk][half + 2 * x]);
        }
        float part[64];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
          const uint64_t w_hi = wgmma_desc(st + 32 * kk, 16, 1024), w_lo = wgmma_desc(st + 64 + 32 * kk, 16, 1024);
          if constexpr (kTerms == 3) {
            wgmma_m64n128k16_f16_rs(part, a_lo[kk], w_hi, kk);
            wgmma_m64n128k16_f16_rs(part, a_hi[kk], w_lo, 1);
          }
          wgmma_m64n128k16_f16_rs(part, a_hi[kk], w_hi, kTerms == 3 ? 1 : kk);
        }
        wgmma_commit();
        wgmma_wait<0>();
#pragma unroll
        for (int j = 0; j < 16; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc1[4 * j + e] = fmaf(part[4 * j + e], inv[e >> 1], acc1[4 * j + e]);
      }
    }

    // ---- dO into shared memory: row (il, h1c), chunk jl, k = h2 ----
    // acc1's row q = 16·warp + g + 8·half is pair (il, jl) = (q / TJ, q % TJ); column 8j + 2t + e is
    // (h1c, h2) = (j / 4, 8 (j % 4) + 2t + e).  A row's chunk is four lanes' 8 values.
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const float2 f = *reinterpret_cast<const float2*>(w_inv_s + 8 * j + 2 * t);
#pragma unroll
      for (int half = 0; half < 2; ++half) acc1[4 * j + 2 * half] *= f.x, acc1[4 * j + 2 * half + 1] *= f.y;
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int q = 16 * warp + g + 8 * half, il = q / TJ, jl = q - il * TJ;
      char* dc = dos + jl * (kBwSideRows * 128);
#pragma unroll
      for (int h1c = 0; h1c < HC; ++h1c) {
        float m = 0.f;
#pragma unroll
        for (int jj = 0; jj < 4; ++jj)
          m = fmaxf(m, fmaxf(fabsf(acc1[4 * (4 * h1c + jj) + 2 * half]), fabsf(acc1[4 * (4 * h1c + jj) + 2 * half + 1])));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
        const int e = split_scale_exp_bits(m);
        const float f = exp2_int(e);
        const int row = il * HC + h1c;
        if (t == 0) do_inv[row * kChunks2 + jl] = exp2_int(-e);
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          const int j = 4 * h1c + jj, pos = (8 * jj + 2 * t + 8 * jl) & 31;
          uint32_t hi, lo;
          split_f16x2(acc1[4 * j + 2 * half] * f, acc1[4 * j + 2 * half + 1] * f, hi, lo);
          *reinterpret_cast<uint32_t*>(dc + kmajor_split16_offset(row, pos, 1024, 0)) = hi;
          if constexpr (kTerms == 3) *reinterpret_cast<uint32_t*>(dc + kmajor_split16_offset(row, pos, 1024, 1)) = lo;
        }
      }
    }
    fence_proxy_async_smem();  // dO visible to the tensor cores after the next step's barrier

    // ---- GEMM 2: acc2[(il, h1c), s] += dO chunk · y chunk ----
#pragma unroll 1
    for (int c = 0; c < kChunks2; ++c) {
      const char* st = next_stage();
      const char* dc = dos + c * (kBwSideRows * 128);
      float part[64];
      split_slots_product<kTerms>(part, dc, st);
      const float f0 = do_inv[(16 * warp + g) * kChunks2 + c], f1 = do_inv[(16 * warp + g + 8) * kChunks2 + c];
#pragma unroll
      for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc2[4 * j + e] = fmaf(part[4 * j + e], e < 2 ? f0 : f1, acc2[4 * j + e]);
    }
  }
  cp_async_wait_all();

  // acc2: row m = 16·warp + g + 8·half = (il, h1c), column s0 + 8j + 2t + e; y's scale out.
  float* grad_b = p.grad + (int64_t(split) * p.B + b) * S * Nr * H;
  const float* y_inv = p.y_inv + int64_t(b) * S;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int m = 16 * warp + g + 8 * half, il = m / HC, i = i0 + il;
    if (i >= Nr) continue;
    float* dst = grad_b + int64_t(i) * H + hc0 + (m - il * HC);
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int s = s0 + 8 * j + 2 * t + e;
        if (s < S) dst[int64_t(s) * Nr * H] = acc2[4 * j + 2 * half + e] * y_inv[s];
      }
  }
#else
  target_lacks_instructions();
#endif
}

template <int kTerms, int kH>
__global__ void __launch_bounds__(kBwThreads, 2) opm_bwd_side_f16_kernel(const BwdSideArgs p) {
  bwd_side_f16<kTerms, kH, false>(p, nullptr);
}
template <int kTerms, int kH>
__global__ void __launch_bounds__(kBwThreads, 2) opm_bwd_side_f16_g_split_kernel(const BwdSideArgs p,
                                                                                 const float* __restrict__ g_inv) {
  bwd_side_f16<kTerms, kH, true>(p, g_inv);
}

// W (D, H·H) float32 as opm_bwd_side_f16_kernel reads it (BwdSideArgs::w_split, w_inv): column
// n = h1·H + h2 of this side's view (swap: W[d, h2·H + h1]) scaled by 2^e_n, split_scale_exp of
// its largest magnitude over d (2^-e_n to w_inv[n]); per chunk c of 32 d, row (c, n) of 128 bytes:
// the 32 float16 high parts, then the 32 low parts (zero past D).  Blocks of 8 warps over 32
// columns (lane = column): the warps share the maxima, then take the chunks in turn.
__global__ void __launch_bounds__(256) opm_split_side_w_kernel(const float* __restrict__ w,
                                                              uint32_t* __restrict__ w_split,
                                                              float* __restrict__ w_inv, int H, int D, bool swap) {
  __shared__ float red[8][32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, HH = H * H;
  const int n = blockIdx.x * 32 + lane;  // HH is a multiple of 32 (H = 32)
  const int col = swap ? (n % H) * H + n / H : n;
  float m = 0.f;
  for (int d = warp; d < D; d += 8) m = fmaxf(m, fabsf(w[int64_t(d) * HH + col]));
  red[warp][lane] = m;
  __syncthreads();
#pragma unroll
  for (int k = 0; k < 8; ++k) m = fmaxf(m, red[k][lane]);
  const int e = split_scale_exp(m);
  const float f = exp2_int(e);
  if (warp == 0) w_inv[n] = exp2_int(-e);
  const int n_dc = (D + 31) / 32;
  for (int c = warp; c < n_dc; c += 8) {
    uint4* row = reinterpret_cast<uint4*>(w_split + (int64_t(c) * HH + n) * 32);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      float v[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const int d = 32 * c + 8 * q + k;
        v[k] = d < D ? w[int64_t(d) * HH + col] * f : 0.f;
      }
      uint4 hi, lo;
      split_f16x2(v[0], v[1], hi.x, lo.x);
      split_f16x2(v[2], v[3], hi.y, lo.y);
      split_f16x2(v[4], v[5], hi.z, lo.z);
      split_f16x2(v[6], v[7], hi.w, lo.w);
      row[q] = hi;
      row[4 + q] = lo;
    }
  }
}

// y (B, S, Nc, H) float32, contiguous, as opm_bwd_side_f16_kernel reads it (BwdSideArgs::y_split,
// y_inv): row (b, s) scaled by 2^e, split_scale_exp of its largest magnitude over its K = Nc·H values
// (2^-e to y_inv[b·S + s]); chunk c of 32 consecutive k = j·H + h2 as the row ((b·n_kc + c)·S + s)
// of 128 bytes, 16 bytes of high parts per 8 k, then the low parts 64 bytes on, the piece of
// k % 32 / 8 at position (k % 32 / 8 + c) % 4.  One block of 128 threads per row (b, s).
__global__ void __launch_bounds__(128) opm_split_side_y_kernel(const float* __restrict__ y,
                                                              uint32_t* __restrict__ y_split,
                                                              float* __restrict__ y_inv, int S, int K) {
  __shared__ float red[4];
  const int64_t row = blockIdx.x;
  const int b = int(row / S), s = int(row - int64_t(b) * S), tid = threadIdx.x;
  const float4* src = reinterpret_cast<const float4*>(y + row * K);
  float m = 0.f;
  for (int k4 = tid; k4 < K / 4; k4 += 128) {
    const float4 v = src[k4];
    m = fmaxf(m, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  if ((tid & 31) == 0) red[tid >> 5] = m;
  __syncthreads();
  m = fmaxf(fmaxf(red[0], red[1]), fmaxf(red[2], red[3]));
  const int e = split_scale_exp(m);
  const float f = exp2_int(e);
  if (tid == 0) y_inv[row] = exp2_int(-e);
  const int n_kc = K / 32;
  for (int piece = tid; piece < n_kc * 4; piece += 128) {
    const int c = piece >> 2, q = piece & 3;
    const float4 v0 = src[8 * c + 2 * q], v1 = src[8 * c + 2 * q + 1];
    uint4 hi, lo;
    split_f16x2(v0.x * f, v0.y * f, hi.x, lo.x);
    split_f16x2(v0.z * f, v0.w * f, hi.y, lo.y);
    split_f16x2(v1.x * f, v1.y * f, hi.z, lo.z);
    split_f16x2(v1.z * f, v1.w * f, hi.w, lo.w);
    uint4* dst = reinterpret_cast<uint4*>(y_split + ((int64_t(b) * n_kc + c) * S + s) * 32);
    const int pos = (q + c) & 3;
    dst[pos] = hi;
    dst[4 + pos] = lo;
  }
}

// Partial grad_W[d, (h1,h2)] for HC values of h1 (HC·H = 64 columns k), 128 values of d, over
// every tile of TI x TJ pairs (TI = H, TJ·H = 64) this split owns (tiles split, split + splits, ...):
//   GEMM 1 (per tile): O[(i,h1), (j,h2)] = sum_s a[s,i,h1] b[s,j,h2]        M = 64, N = 64, K = S
//   GEMM 2:            acc[k, d]        += sum_(i,j) O[(i,j), k] g[i,j,d]    M = 64, N = 128, K = 64 pairs
// Four warps: 2 x 2 tiles of 32 x 32 in GEMM 1, side by side along d (64 x 32 each) in GEMM 2.
// Copy addresses as in the side kernel: bases set once per tile, the step's chunk as a counter (the
// step index decomposed with 64-bit divisions every step cost 7-11% more time).
template <int kTerms, int kH>
__global__ void __launch_bounds__(kBwThreads, 2) opm_bwd_w_kernel(const BwdWArgs p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  extern __shared__ float4 smem_f4[];
  float* smem = reinterpret_cast<float*>(smem_f4);
  float* Os = smem + kBwStages * kBwWStageFloats;  // O of the current tile: [pair][(h1c,h2)], M-major for GEMM 2
  constexpr int H = kH, HC = kBwWCols / H, TI = H, TJ = kBwWCols / H;
  constexpr int kPiece = HC < 4 ? HC : 4;  // floats of a per copy: consecutive h1 of one row i
  const int Nr = p.Nr, Nc = p.Nc, S = p.S, D = p.D, Dp = p.Dp;
  const int hc0 = blockIdx.x * HC, d0 = blockIdx.y * kBwWDG;
  const int split = blockIdx.z, splits = gridDim.z;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int wm = warp & 1, wn = warp >> 1;  // GEMM 1; GEMM 2 splits d by warp
  const int n_it = (Nr + TI - 1) / TI, n_jt = (Nc + TJ - 1) / TJ;
  const int64_t tiles = int64_t(p.B) * n_it * n_jt;
  const int my_tiles = split < tiles ? int((tiles - 1 - split) / splits + 1) : 0;
  const int n1 = (S + kBwK - 1) / kBwK;
  const int spt = n1 + kBwWPairs / kBwK;  // GEMM 1's chunks of s, then GEMM 2's of pairs
  const int total = my_tiles * spt;  // < 2^31: plan_contract_backward checks

  // The thread's fixed part of each copy.  a: rows k = ka0 + u·(128/P) of P pieces each, at
  // column m; b: rows kb0 + 8u at n4b; g: rows kg0 + 4u (pairs q of the chunk; jl = kg0 % TJ in
  // every one) at n4g.  The tile's bases are set when the tile starts.
  constexpr int P = kBwWCols / kPiece;
  const int ka0 = tid / P, ma = (tid % P) * kPiece, ila = ma / HC, hma = ma - ila * HC;
  const int kb0 = tid >> 4, n4b = (tid & 15) * 4, kg0 = tid >> 5, n4g = (tid & 31) * 4;
  const int jlg = kg0 % TJ, ilg0 = kg0 / TJ;
  const int64_t NrH = int64_t(Nr) * H, NcH = int64_t(Nc) * H, NcDp = int64_t(Nc) * Dp;
  int ld_r = 0, ld_i0 = 0, ld_j0 = 0;
  int ld_tl = 0;  // the next step's tile among this split's: split + ld_tl·splits
  const float *a_tile = p.a, *b_tile = p.b, *g_tile = p.g;
  const auto start_tile = [&]() {
    // splits as gridDim.z here, once per tile: a register holding it was spilled and reloaded
    // every step
    const int64_t tile = split + int64_t(ld_tl) * gridDim.z;
    const int bb = int(tile / (int64_t(n_it) * n_jt));
    const int rem = int(tile - int64_t(bb) * n_it * n_jt), it = rem / n_jt;
    ld_i0 = it * TI, ld_j0 = (rem - it * n_jt) * TJ;
    a_tile = p.a + (int64_t(bb) * S * Nr + ld_i0 + ila) * H + hc0 + hma + ka0 * NrH;
    b_tile = p.b + (int64_t(bb) * S * Nc + ld_j0) * H + n4b + kb0 * NcH;
    g_tile = p.g + ((int64_t(bb) * Nr + ld_i0 + ilg0) * Nc + ld_j0 + jlg) * Dp + d0 + n4g;
  };
  auto load_step = [&](int buf) {
    float* X = smem + buf * kBwWStageFloats;
    if (ld_r == 0) start_tile();
    if (ld_r < n1) {
      const int sk0 = ld_r * kBwK;
      const float* a_src = a_tile + sk0 * NrH;
      const bool a_ok = ld_i0 + ila < Nr;
#pragma unroll
      for (int u = 0; u < kBwK * P / kBwThreads; ++u) {  // a: 32 s x 64 (il, h1c)
        const bool ok = a_ok && sk0 + ka0 + u * (kBwThreads / P) < S;
        cp_async_n<kPiece * 4>(X + (ka0 + u * (kBwThreads / P)) * kBwLd64 + ma,
                               ok ? a_src + u * (kBwThreads / P) * NrH : p.a, ok);
      }
      float* Y = X + kBwK * kBwLd64;
      const float* b_src = b_tile + sk0 * NcH;
      const bool b_ok = ld_j0 + n4b / H < Nc;
#pragma unroll
      for (int u = 0; u < kBwK * kBwWCols / 4 / kBwThreads; ++u) {  // b: 32 s x 64 (jl, h2)
        const bool ok = b_ok && sk0 + kb0 + 8 * u < S;
        cp_async16z(Y + (kb0 + 8 * u) * kBwLd64 + n4b, ok ? b_src + 8 * u * NcH : p.b, ok);
      }
    } else {
      const int q0 = (ld_r - n1) * kBwK;  // the chunk's first pair: il = q0 / TJ + (kg0 + 4u) / TJ
      const float* g_src = g_tile + (q0 / TJ) * NcDp;
      const bool g_ok = ld_j0 + jlg < Nc && d0 + n4g < Dp;
#pragma unroll
      for (int u = 0; u < kBwK * kBwWDG / 4 / kBwThreads; ++u) {  // g: 32 pairs x 128 d
        const bool ok = g_ok && ld_i0 + (q0 + kg0 + 4 * u) / TJ < Nr;
        cp_async16z(X + (kg0 + 4 * u) * kBwWGLd + n4g, ok ? g_src + (4 * u / TJ) * NcDp : p.g, ok);
      }
    }
    if (++ld_r == spt) ld_r = 0, ++ld_tl;
  };

  float acc1[2][4][4], accw[4][4][4];
  zero_tiles(acc1);
  zero_tiles(accw);
#pragma unroll
  for (int st = 0; st < kBwStages - 1; ++st) {
    if (st < total) {
      load_step(st);
    }
    cp_async_commit();
  }
  // the current step's chunk (GEMM 1's chunks of s, then GEMM 2's of pairs) and its stage, as in
  // the side kernel
  int r = 0, buf = 0;
  for (int step = 0; step < total; ++step) {
    cp_async_wait<kBwStages - 2>();
    __syncthreads();
    if (step + kBwStages - 1 < total) load_step(buf == 0 ? kBwStages - 1 : buf - 1);
    cp_async_commit();
    const float* X = smem + buf * kBwWStageFloats;
    if (r < n1) {
      // the last chunk of s: its k-steps of 8 that hold s < S
      const int k_lim = r == n1 - 1 ? (S - r * kBwK + 7) / 8 : kBwK / 8;
      if (k_lim == kBwK / 8)
        warp_mma_tf32<kTerms, 2, 4, false, false, kBwK / 8>(acc1, X + wm * 32, kBwLd64,
                                                            X + kBwK * kBwLd64 + wn * 32, kBwLd64, g, t);
      else
        warp_mma_tf32<kTerms, 2, 4, false, false, kBwK / 8>(acc1, X + wm * 32, kBwLd64,
                                                            X + kBwK * kBwLd64 + wn * 32, kBwLd64, g, t, k_lim);
      if (r == n1 - 1) {
        // O to shared memory as GEMM 2's A: row (pair q = il·TJ + jl), column k = h1c·H + h2
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int m = wm * 32 + mt * 16 + g + 8 * half, il = m / HC, h1c = m - il * HC;
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
              const int n = wn * 32 + nt * 8 + 2 * t, jl = n / H, h2 = n - jl * H;
              *reinterpret_cast<float2*>(Os + (il * TJ + jl) * kBwLd64 + h1c * H + h2) =
                  make_float2(acc1[mt][nt][2 * half], acc1[mt][nt][2 * half + 1]);
            }
          }
        zero_tiles(acc1);
      }
    } else {
      warp_mma_tf32<kTerms, 4, 4, false, false, kBwK / 8>(accw, Os + (r - n1) * kBwK * kBwLd64, kBwLd64,
                                                          X + warp * 32, kBwWGLd, g, t);
    }
    r = r + 1 == spt ? 0 : r + 1;
    buf = buf + 1 == kBwStages ? 0 : buf + 1;
  }
  cp_async_wait_all();

  const int64_t HH = int64_t(H) * H;
  float* ws = p.ws + int64_t(split) * D * HH + hc0 * H;
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int k = mt * 16 + g + 8 * half;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int d = d0 + warp * 32 + nt * 8 + 2 * t + e;
          if (d < D) ws[int64_t(d) * HH + k] = accw[mt][nt][2 * half + e];
        }
    }
#else
  target_lacks_instructions();
#endif
}

// g's split for the W kernel's GEMM 2, two rows at a time: lanes 2l and 2l + 1 hold d = dd and dd + 1
// (their values vq, vq1 at rows q, q + 1, and their scale f); the even lane gets row q's (d, d + 1)
// as one float16 pair, the odd lane row q + 1's, through one shuffle.
__device__ __forceinline__ void split_adjacent_d(float vq, float vq1, float f, bool odd, uint32_t& hi, uint32_t& lo) {
  const float x = __shfl_xor_sync(0xffffffffu, (odd ? vq : vq1) * f, 1);
  const float v0 = odd ? x : vq * f, v1 = odd ? vq1 * f : x;  // d = dd, dd + 1
  split_f16x2(v0, v1, hi, lo);
}

// The W kernel's float16 split form (BwdWArgs, kBwf* in opm_params.h): the tile and sums of
// opm_bwd_w_kernel on warpgroup MMAs, the block one warpgroup.  Per tile of 32 i x 2 j:
//   GEMM 1, per chunk of 32 s: O'[(il, h1c), (jl, h2)] = sum_s a'·b' (a and b split per residue,
//     both K-major), six wgmma m64n64k16 into a zeroed accumulator added to acc1 in float32.
//   O'·2^o_exp (its bound) split into shared memory as [pair][k], GEMM 2's B (MN-major).
//   GEMM 2, per chunk of 32 pairs: each thread takes one row d of g's float32 chunk, times the
//     pairs' factors 2^-(e_i + e_j), scales it by the power of two of its largest magnitude and
//     splits it (pairs of adjacent d through a shuffle) as A (MN-major, [pair][d]); two halves of
//     64 d, six wgmma m64n64k16 each, into zeroed accumulators added to acc in float32 times the
//     row's inverse scale.  The tile's O' is the same for both chunks.
// kTerms = 1: hi·hi alone in both GEMMs (TF32's rounding, as for the side kernel).
// kGSplit: g arrives split (opm_split_w_g_kernel, the same arithmetic once per chunk instead of in
// each of the 16 blocks along h1): GEMM 2's step copies the chunk's pieces to where A has them and
// reads its row factors from p.g_inv_split, so the step is the copies and the MMAs; the same bits.
// kOverlap: GEMM 1's chunks in pairs, the second issued before the first is retired (two
// accumulators), so the tensor cores work through the second's barrier and the first's
// retirement; the ring then has kBwfOverlapStages stages, copies still two steps ahead, so that no
// copy lands in a stage an MMA in flight reads.  The same sums in the same order: the same bits.
template <int kTerms, int kH, bool kGSplit = false, bool kOverlap = false>
__global__ void __launch_bounds__(kBwThreads, 2) opm_bwd_w_f16_kernel(const BwdWArgs p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(kTerms == 1 || kTerms == 3, "the high parts' products alone, or with both cross terms");
  static_assert(kH == 32, "the float16 split W kernel splits a and b with one lane per h");
  static_assert(kBwThreads == kBwWDG, "one row d of g's chunk per thread");
  constexpr int kStages = kOverlap ? kBwfOverlapStages : kBwStages;
  extern __shared__ float4 smem_f4[];
  char* smem = align_smem_1k(reinterpret_cast<char*>(smem_f4));
  char* gs = smem + kStages * kBwfStageBytes;  // g split: [part][d / 64][pair (32)][128 bytes]
  char* os = gs + kBwfGsBytes;                   // O' split: [part][pair (64)][128 bytes: 64 k]
  float* pair_f = reinterpret_cast<float*>(os + kBwfOsBytes);  // [pair]: 2^-(e_i + e_j)
  float* g_inv = pair_f + 64;                                  // [d]: 2^-e of the chunk's row d
  constexpr int H = kH, HC = kBwWCols / H, TI = H, TJ = kBwWCols / H;
  constexpr int kChunks2 = kBwWPairs / 32;
  constexpr uint32_t kHalf = 8192;  // the low parts' offset in gs and os
  const int Nr = p.Nr, Nc = p.Nc, S = p.S, D = p.D, Dp = p.Dp;
  const int hc0 = blockIdx.x * HC, d0 = blockIdx.y * kBwWDG;
  const int split = blockIdx.z;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int n_it = (Nr + TI - 1) / TI, n_jt = (Nc + TJ - 1) / TJ;
  const int64_t tiles = int64_t(p.B) * n_it * n_jt;
  const int my_tiles = split < tiles ? int((tiles - 1 - split) / gridDim.z + 1) : 0;
  const int n1 = (S + 31) / 32;  // chunks of s
  const int spt = n1 + kChunks2;
  const int total = my_tiles * spt;  // < 2^31: plan_contract_backward checks
  const int lg = 32 - __clz(S - 1);  // 2^lg >= S
  const float o_scale = exp2_int(-(kSplitTopExp + 1) - lg);  // |O'| < S·2^30 <= 2^(30 + lg)

  // Copies.  a: rows r = sr + 16u = (il, h1c) = (r / 2, r % 2); b: rows r = (jl, h2), consecutive
  // rows of b's split; each 16-byte piece sp, swizzled as K-major atoms (+16 rows: + 2 KB).  g: pairs
  // q = kg0 + 4u of the chunk (jl = kg0 % 2), 16 bytes at n4g, rows of 128 floats.
  const int sr = tid >> 3, sp = tid & 7;
  const uint32_t slot_dst = uint32_t(sr >> 3) * 1024u + uint32_t(sr & 7) * 128u + uint32_t((sp ^ (sr & 7)) << 4);
  const int kg0 = tid >> 5, n4g = (tid & 31) * 4, jlg = kg0 & 1;
  const int64_t a_cstride = int64_t(Nr) * H * 32, b_cstride = int64_t(Nc) * H * 32;
  int ld_r = 0, ld_tl = 0, ld_i0 = 0, ld_j0 = 0;
  const uint32_t *a_tile = p.a_split, *b_tile = p.b_split;
  const float* g_tile = p.g;
  const auto start_tile = [&]() {
    const int64_t tile = split + int64_t(ld_tl) * gridDim.z;
    const int bb = int(tile / (int64_t(n_it) * n_jt));
    const int rem = int(tile - int64_t(bb) * n_it * n_jt), it = rem / n_jt;
    ld_i0 = it * TI, ld_j0 = (rem - it * n_jt) * TJ;
    a_tile = p.a_split + ((int64_t(bb) * n1 * Nr + ld_i0 + (sr >> 1)) * H + hc0 + (sr & 1)) * 32 + sp * 4;
    b_tile = p.b_split + ((int64_t(bb) * n1 * Nc + ld_j0) * H + sr) * 32 + sp * 4;
    g_tile = p.g + ((int64_t(bb) * Nr + ld_i0 + (kg0 >> 1)) * Nc + ld_j0 + jlg) * Dp + d0 + n4g;
  };
  auto load_step = [&](int buf) {
    char* st = smem + buf * kBwfStageBytes;
    if (ld_r == 0) start_tile();
    if (ld_r < n1) {
      const uint32_t* a_src = a_tile + ld_r * a_cstride;
      const uint32_t* b_src = b_tile + ld_r * b_cstride;
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const bool a_ok = ld_i0 + (sr >> 1) + 8 * u < Nr;
        cp_async16z(st + slot_dst + 2048u * u, a_ok ? a_src + u * 8 * H * 32 : p.a_split, a_ok);
        const bool b_ok = ld_j0 + (sr + 16 * u) / H < Nc;
        cp_async16z(st + 8192 + slot_dst + 2048u * u, b_ok ? b_src + u * 16 * 32 : p.b_split, b_ok);
      }
    } else {
      const int q0 = (ld_r - n1) * 32;  // the chunk's first pair: il = q0 / 2 + kg0 / 2 + 2u
      const float* g_src = g_tile + int64_t(q0 / TJ) * Nc * Dp;
      const bool g_ok = ld_j0 + jlg < Nc && d0 + n4g < Dp;
      if constexpr (kGSplit) {
        // piece pc = (part, half of 64 d, group of 8 d) of pair row q, to A's (part, half, row q,
        // swizzled 16-byte column); with one term the low parts stay where they are
        const int pc = tid & 31;
        if (kTerms == 3 || pc < 16) {
          const uint32_t part_half = uint32_t(pc >> 4) * kHalf + uint32_t((pc >> 3) & 1) * 4096u;
#pragma unroll
          for (int u = 0; u < 8; ++u) {
            const int q = kg0 + 4 * u;
            const bool ok = g_ok && ld_i0 + q0 / TJ + (kg0 >> 1) + 2 * u < Nr;
            cp_async16z(st + part_half + uint32_t(q >> 3) * 1024u + uint32_t(q & 7) * 128u +
                            uint32_t(((pc & 7) ^ (q & 7)) << 4),
                        ok ? g_src + int64_t(2 * u) * Nc * Dp : p.g, ok);
          }
        }
      } else {
        float* X = reinterpret_cast<float*>(st);
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          const bool ok = g_ok && ld_i0 + q0 / TJ + (kg0 >> 1) + 2 * u < Nr;
          cp_async16z(X + (kg0 + 4 * u) * kBwWDG + n4g, ok ? g_src + int64_t(2 * u) * Nc * Dp : p.g, ok);
        }
      }
    }
    if (++ld_r == spt) ld_r = 0, ++ld_tl;
  };

  BwStageRing<kBwfStageBytes, kStages, kBwStages - 1> ring{smem, total};
  ring.prime(load_step);
  const auto next_stage = [&]() { return ring.next(load_step); };

  float acc[2][32];  // rows d = d0 + 64h + 16·warp + g (+8), columns k = hc0·H + 8j + 2t (+1)
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int e = 0; e < 32; ++e) acc[h][e] = 0.f;
  for (int tl = 0; tl < my_tiles; ++tl) {
    const int64_t tile = split + int64_t(tl) * gridDim.z;
    if constexpr (!kGSplit) {
      // the tile's pair factors, read by the conversions after the next barrier (the last readers
      // of the previous tile's passed a barrier since)
      const int bb = int(tile / (int64_t(n_it) * n_jt));
      const int rem = int(tile - int64_t(bb) * n_it * n_jt), it = rem / n_jt;
      const int i = it * TI + (tid >> 1), j = (rem - it * n_jt) * TJ + (tid & 1);
      if (tid < kBwWPairs)
        pair_f[tid] = i < Nr && j < Nc ? p.a_inv[int64_t(bb) * Nr + i] * p.b_inv[int64_t(bb) * Nc + j] : 0.f;
    }
    // ---- GEMM 1 ----
    float acc1[32];
#pragma unroll
    for (int e = 0; e < 32; ++e) acc1[e] = 0.f;
    // chunk r's products into part, issued and committed (a zeroed accumulator: the first MMA's
    // scale-d is 0), and added to acc1 once complete
    const auto issue_chunk = [&](float (&part)[32]) {
      const char* st = next_stage();
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
        const uint64_t a_hi = wgmma_desc(st + 32 * kk, 16, 1024), a_lo = wgmma_desc(st + 64 + 32 * kk, 16, 1024);
        const uint64_t b_hi = wgmma_desc(st + 8192 + 32 * kk, 16, 1024),
                       b_lo = wgmma_desc(st + 8192 + 64 + 32 * kk, 16, 1024);
        wgmma_split_m64n64k16<kTerms, 0, 0>(part, a_hi, a_lo, b_hi, b_lo, kk);
      }
      wgmma_commit();
    };
    const auto retire = [&](const float (&part)[32]) {
#pragma unroll
      for (int e = 0; e < 32; ++e) acc1[e] += part[e];
    };
    if constexpr (kOverlap) {
      // Chunks in pairs: r's MMAs run through r + 1's barrier and issue, r + 1's through r's
      // retirement.  Each pass ends with nothing in flight: with an accumulator in flight across
      // the loop's back edge, ptxas serializes the MMAs (C7514).
      float part0[32], part1[32];
      int r = 0;
      for (; r + 1 < n1; r += 2) {
        issue_chunk(part0);
        issue_chunk(part1);
        wgmma_wait<1>();
        retire(part0);
        wgmma_wait<0>();
        retire(part1);
      }
      if (r < n1) {  // n1 odd: the last chunk alone
        issue_chunk(part0);
        wgmma_wait<0>();
        retire(part0);
      }
    } else {
      for (int r = 0; r < n1; ++r) {
        float part[32];
        issue_chunk(part);
        wgmma_wait<0>();
        retire(part);
      }
    }

    // ---- O' into shared memory: acc1's row m = 16·warp + g + 8·half is (il, h1c) = (m / 2, m % 2),
    // column 8j + 2t + e is (jl, h2) = (j / 4, 8 (j % 4) + 2t + e); pair il·2 + jl, k h1c·H + h2 ----
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int m = 16 * warp + g + 8 * half;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int pr = (m & ~1) + (j >> 2), k = (m & 1) * H + 8 * (j & 3) + 2 * t;
        const uint32_t off = uint32_t(pr >> 3) * 1024u + uint32_t(pr & 7) * 128u +
                             uint32_t(((k >> 3) ^ (pr & 7)) << 4) + uint32_t(k & 7) * 2u;
        uint32_t hi, lo;
        split_f16x2(acc1[4 * j + 2 * half] * o_scale, acc1[4 * j + 2 * half + 1] * o_scale, hi, lo);
        *reinterpret_cast<uint32_t*>(os + off) = hi;
        if constexpr (kTerms == 3) *reinterpret_cast<uint32_t*>(os + kHalf + off) = lo;
      }
    }
    fence_proxy_async_smem();

    // ---- GEMM 2 ----
#pragma unroll 1
    for (int c = 0; c < kChunks2; ++c) {
      const char* st = next_stage();
      // A: g's split chunk, in the stage (kGSplit) or converted from it into gs; f: its rows' factors
      const char* ga = kGSplit ? st : gs;
      float f_row[2][2];
      if constexpr (kGSplit) {
        const float* gi = p.g_inv_split + ((tile * kChunks2 + c) * gridDim.y + blockIdx.y) * kBwWDG;
#pragma unroll
        for (int h = 0; h < 2; ++h) f_row[h][0] = gi[64 * h + 16 * warp + g], f_row[h][1] = gi[64 * h + 16 * warp + g + 8];
      } else {
        const float* raw = reinterpret_cast<const float*>(st) + tid;
        const float* pf = pair_f + 32 * c;
        float v[32];
        float m = 0.f;
#pragma unroll
        for (int q = 0; q < 32; ++q) {
          v[q] = raw[q * kBwWDG] * pf[q];
          m = fmaxf(m, fabsf(v[q]));
        }
        const int e = split_scale_exp_bits(m);
        const float f = exp2_int(e);
        g_inv[tid] = exp2_int(-e);
        const bool odd = lane & 1;
        const int dd = tid & ~1;
        const uint32_t d_off = uint32_t(dd >> 6) * 4096u + uint32_t(dd & 7) * 2u;
#pragma unroll
        for (int q = 0; q < 32; q += 2) {
          const int row = q + (odd ? 1 : 0);
          const uint32_t off = d_off + uint32_t(row >> 3) * 1024u + uint32_t(row & 7) * 128u +
                               uint32_t((((dd & 63) >> 3) ^ (row & 7)) << 4);
          uint32_t hi, lo;
          split_adjacent_d(v[q], v[q + 1], f, odd, hi, lo);
          *reinterpret_cast<uint32_t*>(gs + off) = hi;
          if constexpr (kTerms == 3) *reinterpret_cast<uint32_t*>(gs + kHalf + off) = lo;
        }
        fence_proxy_async_smem();
        __syncthreads();
      }
      float part[2][32];
      wgmma_fence();
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
          const uint64_t g_hi = wgmma_desc(ga + h * 4096 + kk * 2048, 4096, 1024),
                         g_lo = wgmma_desc(ga + kHalf + h * 4096 + kk * 2048, 4096, 1024);
          const uint64_t o_hi = wgmma_desc(os + c * 4096 + kk * 2048, 4096, 1024),
                         o_lo = wgmma_desc(os + kHalf + c * 4096 + kk * 2048, 4096, 1024);
          wgmma_split_m64n64k16<kTerms, 1, 1>(part[h], g_hi, g_lo, o_hi, o_lo, kk);
        }
      wgmma_commit();
      wgmma_wait<0>();
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float f0 = kGSplit ? f_row[h][0] : g_inv[64 * h + 16 * warp + g];
        const float f1 = kGSplit ? f_row[h][1] : g_inv[64 * h + 16 * warp + g + 8];
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[h][4 * j + e] = fmaf(part[h][4 * j + e], e < 2 ? f0 : f1, acc[h][4 * j + e]);
      }
    }
  }
  cp_async_wait_all();

  const float o_unscale = exp2_int(kSplitTopExp + 1 + lg);
  const int64_t HH = int64_t(H) * H;
  float* ws = p.ws + int64_t(split) * D * HH + hc0 * H;
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int d = d0 + 64 * h + 16 * warp + g + 8 * half;
      if (d >= D) continue;
#pragma unroll
      for (int j = 0; j < 8; ++j)
        *reinterpret_cast<float2*>(ws + int64_t(d) * HH + 8 * j + 2 * t) =
            make_float2(acc[h][4 * j + 2 * half] * o_unscale, acc[h][4 * j + 2 * half + 1] * o_unscale);
    }
#else
  target_lacks_instructions();
#endif
}

// g (B, Nr, Nc, Dp) float32 split in place for opm_bwd_w_f16_kernel<kTerms, 32, true>: per unit (a
// tile's chunk c of 32 pairs q, i = i0 + 16c + q / 2 and j = j0 + q % 2, for one block of kBwWDG
// d), each d's 32 values times the pairs' factors 2^-(e_i + e_j), scaled by the power of two of
// their largest magnitude (2^-e to g_inv[unit·kBwWDG + d]) and split, with the arithmetic of the
// W kernel's own conversion (so the same parts).  Pair q's kBwWDG floats of the block then hold 32
// pieces of 16 bytes: piece (part, half of 64 d, group of 8 d) = (pc / 16, pc / 8 % 2, pc % 8), the
// 8 float16 parts of its group; with one term the low pieces keep what was there.  One block per
// unit (every unit whole: w_g_split_fits), a thread per d: all reads before one barrier, all
// writes after it, so the unit's bytes are rewritten in place.
template <int kTerms>
__global__ void __launch_bounds__(kBwWDG) opm_split_w_g_kernel(const BwdWArgs p, float* __restrict__ g,
                                                              float* __restrict__ g_inv) {
  constexpr int H = 32, TI = H, TJ = kBwWCols / H, kChunks2 = kBwWPairs / 32;
  const int Nr = p.Nr, Nc = p.Nc, Dp = p.Dp;
  const int n_it = Nr / TI, n_jt = Nc / TJ;
  const int64_t chunk = blockIdx.x;  // tile · kChunks2 + c
  const int64_t tile = chunk / kChunks2;
  const int c = int(chunk - tile * kChunks2);
  const int bb = int(tile / (int64_t(n_it) * n_jt));
  const int rem = int(tile - int64_t(bb) * n_it * n_jt), it = rem / n_jt;
  const int i0 = it * TI + 16 * c, j0 = (rem - it * n_jt) * TJ;
  const int d = threadIdx.x, lane = d & 31;
  const int64_t row_stride = int64_t(Nc) * Dp;  // pair q at (q / 2)·row_stride + (q % 2)·Dp
  float* base = g + (int64_t(bb) * Nr + i0) * row_stride + int64_t(j0) * Dp + int64_t(blockIdx.y) * kBwWDG;
  const float* a_inv = p.a_inv + int64_t(bb) * Nr + i0;
  const float* b_inv = p.b_inv + int64_t(bb) * Nc + j0;
  float v[32];
  float m = 0.f;
#pragma unroll
  for (int q = 0; q < 32; ++q) {
    const float pf = a_inv[q >> 1] * b_inv[q & 1];
    v[q] = base[(q >> 1) * row_stride + (q & 1) * Dp + d] * pf;
    m = fmaxf(m, fabsf(v[q]));
  }
  const int e = split_scale_exp_bits(m);
  const float f = exp2_int(e);
  g_inv[(chunk * gridDim.y + blockIdx.y) * kBwWDG + d] = exp2_int(-e);
  const bool odd = lane & 1;
  const int dd = d & ~1;
  uint32_t hi[16], lo[16];
#pragma unroll
  for (int q = 0; q < 32; q += 2) split_adjacent_d(v[q], v[q + 1], f, odd, hi[q / 2], lo[q / 2]);
  __syncthreads();  // every read of the unit done
  char* bytes = reinterpret_cast<char*>(base);
  const int piece = ((dd >> 6) << 3) + ((dd & 63) >> 3);  // of the high parts; the low parts' + 16
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    const int row = 2 * k + (odd ? 1 : 0);
    char* dst = bytes + ((row >> 1) * row_stride + (row & 1) * Dp) * 4 + piece * 16 + (dd & 7) * 2;
    *reinterpret_cast<uint32_t*>(dst) = hi[k];
    if constexpr (kTerms == 3) *reinterpret_cast<uint32_t*>(dst + 16 * 16) = lo[k];
  }
}

// a or b (B, S, N, H) float32, contiguous, as opm_bwd_w_f16_kernel reads it (BwdWArgs::a_split,
// a_inv; b_split, b_inv): residue (b, n) scaled by 2^e, split_scale_exp of its largest magnitude
// over (s, h) (2^-e to inv[b·N + n], 0 for a residue of zeros); chunk c of 32 s as rows
// ((b·n_sc + c)·N + n)·H + h of 128 bytes: the 32 float16 high parts, then the 32 low parts (zero
// past S).  One block of 8 warps per residue (lane = h, H = 32), the warps over s for the largest
// magnitude and over the chunks for the splits: one warp per residue left 2 warps per SM at the
// training crop, waiting on one load after another (22 us a launch).
__global__ void __launch_bounds__(256) opm_split_ab_f16_kernel(const float* __restrict__ x,
                                                              uint32_t* __restrict__ out,
                                                              float* __restrict__ inv, int S, int N) {
  constexpr int H = 32, kWarps = 8;
  __shared__ float red[kWarps];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t res = blockIdx.x;
  const int b = int(res / N), n = int(res - int64_t(b) * N);
  const int64_t s_stride = int64_t(N) * H;
  const float* src = x + (int64_t(b) * S * N + n) * H + lane;
  float m = 0.f;
#pragma unroll 4
  for (int s = warp; s < S; s += kWarps) m = fmaxf(m, fabsf(src[s * s_stride]));
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  if (lane == 0) red[warp] = m;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kWarps; ++w) m = fmaxf(m, red[w]);
  const int e = split_scale_exp(m);
  const float f = exp2_int(e);
  // A residue of zeros (masked at every s) gives the W kernel's pairs with it the factor 0: their
  // O is 0, and g's values there (large where OpenFold's normaliser is eps) must not set the
  // scale of the other pairs' values in their chunk.
  if (threadIdx.x == 0) inv[res] = m > 0.f ? exp2_int(-e) : 0.f;
  const int n_sc = (S + 31) / 32;
  for (int c = warp; c < n_sc; c += kWarps) {
    float v[32];
#pragma unroll
    for (int k = 0; k < 32; ++k) {
      const int s = 32 * c + k;
      v[k] = s < S ? src[s * s_stride] * f : 0.f;
    }
    uint4* row = reinterpret_cast<uint4*>(out + (((int64_t(b) * n_sc + c) * N + n) * H + lane) * 32);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      uint4 hi, lo;
      split_f16x2(v[8 * q], v[8 * q + 1], hi.x, lo.x);
      split_f16x2(v[8 * q + 2], v[8 * q + 3], hi.y, lo.y);
      split_f16x2(v[8 * q + 4], v[8 * q + 5], hi.z, lo.z);
      split_f16x2(v[8 * q + 6], v[8 * q + 7], hi.w, lo.w);
      row[q] = hi;
      row[4 + q] = lo;
    }
  }
}

// Four consecutive elements (idx a multiple of 4, aligned) of a float32, float16 or bfloat16 tensor.
__device__ __forceinline__ void load4_as_float(const void* base, int64_t idx, int kind, float (&v)[4]) {
  if (kind == kMaskFloat) {
    const float4 f = __ldcs(reinterpret_cast<const float4*>(static_cast<const float*>(base) + idx));
    v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
    return;
  }
  const uint2 raw = __ldcs(reinterpret_cast<const uint2*>(static_cast<const char*>(base) + idx * 2));
  const uint32_t w[2] = {raw.x, raw.y};
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const float2 f = kind == kMaskHalf ? __half22float2(*reinterpret_cast<const __half2*>(&w[k]))
                                       : __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[k]));
    v[2 * k] = f.x, v[2 * k + 1] = f.y;
  }
}

// g = grad_out / divisor (GradScaleArgs), over chunks of p.chunk_rows rows (b, i) per block: the
// chunk's row divisors first (a warp per row), then its pairs.  With by_pair, thread tid takes
// column slot tid % D4 (four columns where vec4 allows, else one) of the chunk's pairs tid / D4,
// + slots, ..., so that its columns are the same in every row; with bias_part or bias_out it also
// sums them for the bias gradient, in float64 and in a fixed order (one rounding at the end, and the
// same bits on every call).  Otherwise the chunk's values are strided over the threads.  Each
// thread loads kGradScaleBatch pairs before it stores any: g may alias nothing the loads read, but
// the compiler cannot know that, and one load in flight per thread left a single block waiting on
// memory latency for ~120 us at the specification's shape.
// kSideSplit (launch_grad_scale_side_split): each pair's chunk of 32 columns, eight consecutive
// threads' values, is split in its own bytes for the side kernels instead of stored as float32.
template <bool kSideSplit>
__global__ void __launch_bounds__(kGradScaleThreads) opm_grad_scale_kernel(const GradScaleArgs p) {
  constexpr int kBatch = kGradScaleBatch, kWarps = kGradScaleThreads / 32;
  __shared__ float row_den[kGradScaleMaxChunkRows];
  __shared__ double bias_s[kGradScaleThreads * 4];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, N = p.N, D = p.D;
  const bool by_row = p.norm.kind == kNormRow, openfold = p.norm.kind == kNormOpenFold;
  const int per = p.vec4 ? 4 : 1, D4 = D / per;
  const int slots = p.by_pair ? kGradScaleThreads / D4 : 0;
  const int col = p.by_pair ? tid % D4 : 0, slot = p.by_pair ? tid / D4 : 0;
  const bool sums = p.bias_part != nullptr || p.bias_out != nullptr;
  double bsum[4] = {0.0, 0.0, 0.0, 0.0};
  const int64_t rows = int64_t(p.B) * N, chunks = (rows + p.chunk_rows - 1) / p.chunk_rows;
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    const int64_t r0 = c * p.chunk_rows;
    const int nr = int(min(int64_t(p.chunk_rows), rows - r0));
    if (by_row) {
      __syncthreads();  // every thread has read the previous chunk's divisors
      for (int q = warp; q < nr; q += kWarps) {
        const int64_t r = r0 + q;
        const int b = int(r / N), i = int(r - int64_t(b) * N);
        const float den = mask_denominator(p.mask, b, i, p.S, lane);
        if (lane == 0) row_den[q] = den;
      }
      __syncthreads();
    }
    const int64_t pair0 = r0 * N;  // the chunk's first pair (b, i, j), its values contiguous from pair0 * D
    // divisor of the chunk's pair q (row q / N)
    const auto divisor = [&](int q) {
      if (by_row) return row_den[q / N];
      const float pc = p.pair[pair0 + q];
      return openfold ? p.norm.eps + pc : fmaxf(pc, 1.f);
    };
    const int pairs = nr * N;  // < 2^31: chunk_rows * N is checked on the host
    if (p.by_pair) {  // block-uniform
      if (slot >= slots) continue;
      for (int q0 = slot; q0 < pairs; q0 += slots * kBatch) {
        float v[kBatch][4], den[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const int q = q0 + u * slots;
          if (q >= pairs) break;
          const int64_t e = (pair0 + q) * D + col * per;
          den[u] = divisor(q);
          if (p.vec4) {
            load4_as_float(p.go, e, p.go_kind, v[u]);
          } else {
            v[u][0] = load_mask(p.go, e, p.go_kind);
          }
        }
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const int q = q0 + u * slots;
          if (q >= pairs) break;
          const int64_t e = (pair0 + q) * D + col * per;
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            if (k == 1 && !p.vec4) break;
            if (sums && !openfold) bsum[k] += double(v[u][k]);
            v[u][k] = v[u][k] / den[u];
            if (sums && openfold) bsum[k] += double(v[u][k]);
          }
          if constexpr (kSideSplit) {
            // the side kernels' arithmetic: the chunk's largest magnitude, its power of two, the splits
            const unsigned group = 0xffu << (lane & 24);
            float m = fmaxf(fmaxf(fabsf(v[u][0]), fabsf(v[u][1])), fmaxf(fabsf(v[u][2]), fabsf(v[u][3])));
            m = fmaxf(m, __shfl_xor_sync(group, m, 1));
            m = fmaxf(m, __shfl_xor_sync(group, m, 2));
            m = fmaxf(m, __shfl_xor_sync(group, m, 4));
            const int ex = split_scale_exp_bits(m);
            const float f = exp2_int(ex);
            uint2 hi, lo;
            split_f16x2(v[u][0] * f, v[u][1] * f, hi.x, lo.x);
            split_f16x2(v[u][2] * f, v[u][3] * f, hi.y, lo.y);
            const int k8 = col & 7;
            char* chunk = static_cast<char*>(p.g) + (e - 4 * k8) * 4;
            *reinterpret_cast<uint2*>(chunk + 8 * k8) = hi;
            *reinterpret_cast<uint2*>(chunk + 64 + 8 * k8) = lo;
            if (k8 == 0) p.side_inv[e >> 5] = exp2_int(-ex);
          } else {
            if (p.vec4) store_out4(p.g, e, v[u], p.g_kind);
            else store_out(p.g, e, v[u][0], p.g_kind);
          }
        }
      }
    } else {
      // the chunk's values strided over the threads, kBatch pieces at a time
      const int step = per * kGradScaleThreads;
      const int64_t chunk_elems = int64_t(pairs) * D, e0 = pair0 * D;
      for (int64_t f0 = int64_t(per) * tid; f0 < chunk_elems; f0 += int64_t(step) * kBatch) {
        float v[kBatch][4], den[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const int64_t f = f0 + int64_t(u) * step;
          if (f >= chunk_elems) break;
          den[u] = divisor(int(f / D));  // vec4: D % 4 == 0, so the four share a pair
          if (p.vec4) load4_as_float(p.go, e0 + f, p.go_kind, v[u]);
          else v[u][0] = load_mask(p.go, e0 + f, p.go_kind);
        }
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const int64_t f = f0 + int64_t(u) * step;
          if (f >= chunk_elems) break;
#pragma unroll
          for (int k = 0; k < 4; ++k)
            if (k < per) v[u][k] = v[u][k] / den[u];
          if (p.vec4) store_out4(p.g, e0 + f, v[u], p.g_kind);
          else store_out(p.g, e0 + f, v[u][0], p.g_kind);
        }
      }
    }
  }
  if (!sums) return;  // grid-uniform
  // The block's sum of each column: its slots' sums in slot order.
#pragma unroll
  for (int k = 0; k < 4; ++k) bias_s[tid * 4 + k] = bsum[k];
  __syncthreads();
  for (int d = tid; d < D; d += kGradScaleThreads) {
    const int c = d / per, k = d - c * per;
    double sum = 0.0;
    for (int q = 0; q < slots; ++q) sum += bias_s[(q * D4 + c) * 4 + k];
    if (p.bias_out != nullptr) p.bias_out[d] = float(sum);
    else p.bias_part[int64_t(blockIdx.x) * D + d] = sum;
  }
}

// bias[d] = sum over blocks of part[block][d], in block order, rounded once.
__global__ void __launch_bounds__(kGradScaleThreads) opm_bias_grad_reduce_kernel(const double* part, int blocks,
                                                                                int D, float* bias) {
  const int d = blockIdx.x * kGradScaleThreads + threadIdx.x;
  if (d >= D) return;
  double sum = 0.0;
  for (int k = 0; k < blocks; ++k) sum += part[int64_t(k) * D + d];
  bias[d] = float(sum);
}

// SumPartsArgs: tensor blockIdx.y, its elements grid-strided along x, four at a time where n and
// both pointers keep 16-byte vectors aligned (the same sums in the same order, a quarter of the
// load instructions and four times the bytes in flight per thread).
__global__ void __launch_bounds__(kSumPartsThreads) opm_sum_parts_kernel(const SumPartsArgs p) {
  const int k = blockIdx.y;
  const int64_t n = p.n[k];
  const int parts = p.parts[k];
  const float* __restrict__ in = p.in[k];
  float* __restrict__ out = p.out[k];
  const int64_t stride = int64_t(gridDim.x) * kSumPartsThreads;
  if (n % 4 == 0 && reinterpret_cast<uintptr_t>(in) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0) {
    const int64_t n4 = n / 4;
    const float4* in4 = reinterpret_cast<const float4*>(in);
    for (int64_t e = int64_t(blockIdx.x) * kSumPartsThreads + threadIdx.x; e < n4; e += stride) {
      float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
      for (int q = 0; q < parts; ++q) {
        const float4 v = __ldg(in4 + int64_t(q) * n4 + e);
        sum.x += v.x, sum.y += v.y, sum.z += v.z, sum.w += v.w;
      }
      reinterpret_cast<float4*>(out)[e] = sum;
    }
    return;
  }
  for (int64_t e = int64_t(blockIdx.x) * kSumPartsThreads + threadIdx.x; e < n; e += stride) {
    float sum = 0.f;
#pragma unroll 4
    for (int q = 0; q < parts; ++q) sum += in[int64_t(q) * n + e];
    out[e] = sum;
  }
}

// y[d, h2, h1] = x[d, h1, h2] for n = D·H·H elements: out_proj's weight as grad_b's side kernel reads
// it.  Consecutive threads write consecutive elements.
__global__ void __launch_bounds__(kSumPartsThreads) opm_transpose_hh_kernel(const float* __restrict__ x,
                                                                           float* __restrict__ y, int H, int64_t n) {
  const int64_t HH = int64_t(H) * H;
  for (int64_t o = int64_t(blockIdx.x) * kSumPartsThreads + threadIdx.x; o < n;
       o += int64_t(gridDim.x) * kSumPartsThreads) {
    const int64_t d = o / HH;
    const int r = int(o - d * HH), h2 = r / H, h1 = r - h2 * H;
    y[o] = x[d * HH + int64_t(h1) * H + h2];
  }
}

// SwapMiddleArgs: y[p, u, v, :] = x[p, v, u, :], each run of `run` 16-byte pieces moved whole.
// A thread moves kSwapPieces pieces of the output, consecutive threads consecutive pieces, so the
// stores are coalesced and every load reads whole runs (a run is >= 16 bytes); the loads are
// issued before the stores.  Index is 32-bit when the pieces fit (its divisions are a few times
// cheaper than 64-bit ones, and they are most of this kernel's instructions).
template <typename Index>
__global__ void __launch_bounds__(kSwapThreads) opm_swap_middle_kernel(const SwapMiddleArgs p) {
  const uint4* __restrict__ x = static_cast<const uint4*>(p.x);
  uint4* __restrict__ y = static_cast<uint4*>(p.y);
  const Index run = Index(p.run), U = Index(p.U), V = Index(p.V), total = Index(p.total);
  const int64_t stride = int64_t(gridDim.x) * kSwapThreads * kSwapPieces;
  for (int64_t base = int64_t(blockIdx.x) * kSwapThreads * kSwapPieces + threadIdx.x; base < p.total;
       base += stride) {
    uint4 v[kSwapPieces];
#pragma unroll
    for (int k = 0; k < kSwapPieces; ++k) {
      const Index o = Index(base + int64_t(k) * kSwapThreads);
      if (o < total) {
        // o = ((pp * U + u) * V + vv) * run + r  ->  source ((pp * V + vv) * U + u) * run + r
        const Index q = o / run, r = o - q * run;
        const Index t = q / V, vv = q - t * V;
        const Index pp = t / U, u = t - pp * U;
        v[k] = x[((int64_t(pp) * V + vv) * U + u) * run + r];
      }
    }
#pragma unroll
    for (int k = 0; k < kSwapPieces; ++k) {
      const int64_t o = base + int64_t(k) * kSwapThreads;
      if (o < p.total) y[o] = v[k];
    }
  }
}

}  // namespace flashopm
