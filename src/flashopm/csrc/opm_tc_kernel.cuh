// Outer-first contraction on tensor cores (sm_80+ mma.sync, TF32 with float32 accumulation).
//
// Same tile and math as opm_outer_fused_kernel (a tile of Ti x Tj pairs (i, j) per block):
//   phase 1: O[(i,h1), (j,h2)] = sum_s a[s,i,h1] b[s,j,h2]      M = Ti·H <= 128, N = Tj·H <= 256, K = S
//   phase 2: out[(i,j), d]     = sum_{h1,h2} O[(i,j),(h1,h2)] W[d, h1·H + h2]      K = H², per 128 d
// O never leaves shared memory.  Float32 accuracy comes from 3xTF32: each operand is split as
// x = hi + lo (hi = tf32(x), lo = tf32(x - hi)) and acc += lo·hi + hi·lo + hi·hi, which drops
// only lo·lo (relative 2^-22) and keeps the error of a float32 GEMM.  kTerms = 1 is plain TF32
// (hi·hi), PyTorch's "high" float32 matmul precision.
//
// kHalfSplit (with kWgmma, kWgmma2, kTerms = 3): float32 accuracy from float16 MMAs instead.  a,
// b and W come split by opm_split_rows_f16_kernel / opm_split_w_f16_kernel into float16 high and
// low parts of values scaled by powers of two (see kSplitTopExp), O is split likewise as phase 1
// stores it, and each product is lo·hi + hi·lo + hi·hi on float16 wgmma (twice the TF32 rate);
// the epilogue takes the scales out exactly (scalbnf).
//
// kWgmma (sm_90a): phase 1 on warpgroup MMAs (two warpgroups of 64 rows x 256 columns,
// wgmma.m64n256k8 TF32) reading a and b from stages filled by cp.async in the K-major layouts
// of AbKind (TF32 operands have no MN-major form): rounded to TF32 by the projection kernel for
// one term; for three, split into high and low parts, B's in shared memory by the threads that
// copied them and A's in registers (wgmma with A from registers).  kWgmma2: phase 2 on wgmma too.
//
// Requires H % 8 == 0 (a k-step of 8 never crosses h1 in phase 2, and every row of a tile is
// 16-byte aligned for cp.async) and 16-byte aligned a, b and W.
#pragma once

#include <cooperative_groups.h>

#include "opm_kernels.cuh"
#include "opm_mma.cuh"

namespace flashopm {

// One stage of the float16 split form's phase 1 for this warpgroup: acc += A·B over the stage's
// 32 s (rows of 32 s: high parts in bytes 0-63, low parts in 64-127, +4 in 16-byte units; a k step
// of 16 s 32 bytes), each half of the columns' products in a zeroed accumulator added in float32
// (the truncation of the tensor core's accumulation, as for 3xTF32), small terms first.
__device__ __forceinline__ void split16_stage_products(float (&acc)[128], uint64_t da, uint64_t db) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float part[64];
    const uint64_t dbh = db + half * (128 * 128 >> 4);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      wgmma_m64n128k16_f16(part, da + 4 + 2 * kk, dbh + 2 * kk, kk);
      wgmma_m64n128k16_f16(part, da + 2 * kk, dbh + 4 + 2 * kk, 1);
      wgmma_m64n128k16_f16(part, da + 2 * kk, dbh + 2 * kk, 1);
    }
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int e = 0; e < 64; ++e) acc[64 * half + e] += part[e];
  }
}

// W·diag(gamma) for both projections in shared memory as the float16 split projection reads it:
// per (side, h) the row scaled by 2^w_e (split_scale_exp of its largest magnitude) and split into
// high and low parts, [side][high, low][h][kFpLdW] (zeros from C to Cp); w_fac = 2^(-w_e - kFpVExp),
// which takes both scales out; w_bias = bias + W·beta (LayerNorm's bias folded in).  Every thread of
// the block calls it (one barrier inside); w_e is scratch of 2·kFpH ints.
__device__ __forceinline__ void stage_w_split_f16(const FusedProjArgs& f, __half* wsp, int* w_e, float* w_fac,
                                                  float* w_bias) {
  const int tid = threadIdx.x, C = f.C, Cp = (C + 15) & ~15;
  if (tid < 2 * kFpH) {
    const int side = tid / kFpH, h = tid - side * kFpH;
    const float* w = (side ? f.wb : f.wa) + int64_t(h) * C;
    const float* bias = side ? f.bb : f.ba;
    float m = 0.f, bsum = bias ? bias[h] : 0.f;
    for (int c = 0; c < C; ++c) {
      m = fmaxf(m, fabsf(w[c] * f.ln_w[c]));
      bsum = fmaf(w[c], f.ln_b[c], bsum);
    }
    const int e = split_scale_exp(m);
    w_e[tid] = e;
    w_fac[tid] = scalbnf(1.f, -e - kFpVExp);  // down to 2^-139: a subnormal power of two, exact
    w_bias[tid] = bsum;
  }
  __syncthreads();
  for (int idx = tid; idx < 2 * kFpH * (Cp / 2); idx += blockDim.x) {
    const int sh = idx / (Cp / 2), c = 2 * (idx - sh * (Cp / 2));
    const int side = sh / kFpH, h = sh - side * kFpH;
    const float* w = (side ? f.wb : f.wa) + int64_t(h) * C;
    const float sc = exp2_int(w_e[sh]);
    uint32_t hi, lo;
    split_f16x2(c < C ? w[c] * f.ln_w[c] * sc : 0.f, c + 1 < C ? w[c + 1] * f.ln_w[c + 1] * sc : 0.f, hi, lo);
    *reinterpret_cast<uint32_t*>(wsp + ((side * 2 + 0) * kFpH + h) * kFpLdW + c) = hi;
    *reinterpret_cast<uint32_t*>(wsp + ((side * 2 + 1) * kFpH + h) * kFpLdW + c) = lo;
  }
}

// Two units of 8 s of one side projected on mma.sync m16n8k16 in the float16 split form: pacc[mt][un]
// = sum_c W'[h, c]·v[s, c] for h = 16mt + g (+8) and s = the unit's 2t (+1), where W' is one side's
// rows as stage_w_split_f16 leaves them (w_hi, w_lo) and v = (x - mean)·rstd·2^kFpVExp is formed
// from x's rows as the B fragments are read (x row xrow[un] of xs, ld_x floats apart, its statistics
// stat[un] = (mean, rstd·2^kFpVExp); zeros from C to Cp, where W' is zero too).
__device__ __forceinline__ void project_units_f16(const float* xs, int ld_x, const int (&xrow)[2],
                                                  const float2 (&stat)[2], const __half* w_hi,
                                                  const __half* w_lo, int Cp, float (&pacc)[2][2][4]) {
  const int lane = threadIdx.x & 31, t = lane & 3;
  zero_tiles(pacc);
  for (int kk = 0; kk < Cp / 16; ++kk) {
    const int c = 16 * kk + 2 * t;
    uint32_t b_hi[2][2], b_lo[2][2];
#pragma unroll
    for (int un = 0; un < 2; ++un) {
      const float* yr = xs + xrow[un] * ld_x + c;
      const float2 v0 = *reinterpret_cast<const float2*>(yr);
      const float2 v1 = *reinterpret_cast<const float2*>(yr + 8);
      split_f16x2((v0.x - stat[un].x) * stat[un].y, (v0.y - stat[un].x) * stat[un].y, b_hi[un][0], b_lo[un][0]);
      split_f16x2((v1.x - stat[un].x) * stat[un].y, (v1.y - stat[un].x) * stat[un].y, b_hi[un][1], b_lo[un][1]);
    }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      // rows h = 16mt + (lane & 7) + 8((lane >> 3) & 1), columns 16kk + 8(lane >> 4): the four
      // 8 x 8 pieces of the A fragment in mma's order
      const int lrow = (16 * mt + (lane & 7) + 8 * ((lane >> 3) & 1)) * kFpLdW + 16 * kk + 8 * (lane >> 4);
      uint32_t a_hi[4], a_lo[4];
      ldmatrix_x4(a_hi, w_hi + lrow);
      ldmatrix_x4(a_lo, w_lo + lrow);
      mma_f16_split_add<2>(pacc[mt], a_hi, a_lo, b_hi, b_lo, 2);
    }
  }
}

// Unit un of project_units_f16's sums finished and split: for h = 16mt + g + 8hh and the unit's s
// pair (2t, 2t + 1), (pacc·w_fac[h] + w_bias[h])·f (f0, f1: each row's mask times its residue's
// power of two, the same bits as the one product after the other) as float16 high and low parts
// hi[mt][hh], lo[mt][hh].  w_fac and w_bias are one side's (stage_w_split_f16).
__device__ __forceinline__ void finish_projected_unit(const float (&pacc)[2][2][4], int un, const float* w_fac,
                                                      const float* w_bias, float f0, float f1, uint32_t (&hi)[2][2],
                                                      uint32_t (&lo)[2][2]) {
  const int g = (threadIdx.x & 31) >> 2;
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int h = 16 * mt + g + 8 * hh;
      const float fw = w_fac[h], bias = w_bias[h];
      split_f16x2(fmaf(pacc[mt][un][2 * hh], fw, bias) * f0, fmaf(pacc[mt][un][2 * hh + 1], fw, bias) * f1,
                  hi[mt][hh], lo[mt][hh]);
    }
}

// Phase 1 of the float16 split form with a and b formed in the block from x (FusedProjArgs), acc
// as the workspace form leaves it.  LayerNorm folds into the projection: a = m·(v·(W·diag(gamma))ᵀ
// + W·beta + bias) with v = (x - mean)·rstd, the statistics from the first kernel.  Per stage of
// kFpS s: the x rows of the tile's residues (a's kFpResA, then b's kFpResB) and their statistics
// copied in; v·2^kFpVExp formed as the B fragments are read, v·Wᵀ on mma.sync m16n8k16 in the
// float16 split form with W's rows h as A (scaled per h), so that each thread holds pairs of
// consecutive s of one (n, h); then the scales out, the bias, the mask (as the projection kernels
// form a), the residue's exponent, and the split into the operand stage at the places
// opm_split_rows_f16_kernel gives the workspace's rows; then the stage's wgmma as the workspace
// form runs it.
__device__ __forceinline__ void fused_phase1_f16(const OuterArgs& p, char* smem_c, float (&acc)[128], int b, int i0,
                                                 int j0) {
  const FusedProjArgs& f = p.fp;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int wg = warp >> 2;
  const int C = f.C, Cp = (C + 15) & ~15, S = p.S;
  const int n_k = (S + kFpS - 1) / kFpS;
  static_assert(kFpResA == 4 && kFpResB == 8, "thirds of four residues: a's, then b's in two");
  float* xs = reinterpret_cast<float*>(smem_c + kFpXOff);
  __half* wsp = reinterpret_cast<__half*>(smem_c + kFpWOff);  // [side][high, low][h][kFpLdW]
  const float2* row_st = reinterpret_cast<const float2*>(smem_c + kFpStatOff);  // (mean, rstd·2^kFpVExp)
  float* row_m = reinterpret_cast<float*>(smem_c + kFpRowMOff);
  int* w_e = reinterpret_cast<int*>(smem_c + kFpWEOff);  // [side][h]
  float* w_bias = reinterpret_cast<float*>(smem_c + kFpBiasOff);
  int* res_e = reinterpret_cast<int*>(smem_c + kFpResEOff);
  float* w_fac = reinterpret_cast<float*>(smem_c + kFpWFacOff);  // [side][h]: 2^(-w_e - kFpVExp)
  char* const stage = smem_c;

  // Residue r of the tile: x's residue n, and whether it exists (a tile at the edge has fewer)
  auto residue = [&](int r, int& n) -> bool {
    if (r < kFpResA) {
      n = p.i_offset + i0 + r;
      return r < p.Ti && i0 + r < p.Na;
    }
    n = j0 + (r - kFpResA);
    return r - kFpResA < p.Tj && n < p.N;
  };
  constexpr int kStatPieces = kFpS * 8 / 16;  // a residue's statistics of a stage: 256 contiguous bytes
  // x's rows and statistics of residues 4·third .. 4·third + 3 for stage kt (the rows one third of
  // the projection reads: 128 rows from row 128·third), one group of copies.  This thread copies
  // 16-byte piece xq of rows xr + 16u (u < 8: residue u / 2 of the third, s = xr + 16(u % 2)),
  // zeros past C: fixed offsets, so that a copy costs a few instructions.
  const int xq = tid & 15, xr = tid >> 4;
  const float* const x_q = f.x + int64_t(b) * f.x_sb + 4 * xq;
  const bool q_in = 4 * xq < C;
  auto issue_x = [&](int kt, int third) {
    if (kt < n_k && !(f.skip & 1)) {
      const int s0 = kt * kFpS;
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const int res = 4 * third + (u >> 1), sl = xr + 16 * (u & 1), s = s0 + sl;
        int n;
        const bool ok = q_in && residue(res, n) && s < S;
        const float* src = ok ? x_q + int64_t(s) * f.x_ss + int64_t(n) * f.x_sn : f.x;
        cp_async16z(xs + (res * kFpS + sl) * kFpLdX + 4 * xq, src, ok);
      }
      if (tid < 4 * kStatPieces) {
        const int res = 4 * third + tid / kStatPieces, q = tid % kStatPieces;
        int n;
        const bool ok = residue(res, n);
        const float* src = ok ? f.row_stats + ((int64_t(b) * p.N + n) * f.s_pad + s0) * 2 + 4 * q : f.row_stats;
        cp_async16z(smem_c + kFpStatOff + (res * kFpS) * 8 + 16 * q, src, ok);
      }
    }
    cp_async_commit();  // empty past the last stage: the wait counts stay the same
  };
  for (int third = 0; third < 3; ++third) issue_x(0, third);

  // W·diag(gamma)'s rows scaled per (side, h) and split; the biases with W·beta; the residues'
  // exponents
  if (tid >= 2 * kFpH && tid < 2 * kFpH + kFpResA + kFpResB) {
    const int r = tid - 2 * kFpH;
    int n;
    const bool ok = residue(r, n);
    res_e[r] = !ok ? 0 : r < kFpResA ? p.a_exp[int64_t(b) * p.Na + i0 + r] : p.b_exp[int64_t(b) * p.N + n];
  }
  stage_w_split_f16(f, wsp, w_e, w_fac, w_bias);
  // the stage's mask values, loaded before the wait for its copies (their latencies overlap)
  constexpr int kMaskPerThread = (kFpRows + kTcThreads - 1) / kTcThreads;
  auto load_masks = [&](int kt, float (&mk)[kMaskPerThread]) {
#pragma unroll
    for (int k = 0; k < kMaskPerThread; ++k) {
      const int r = tid + k * kTcThreads;
      const int res = r / kFpS, s = kt * kFpS + (r - res * kFpS);
      int n;
      mk[k] = r < kFpRows && residue(res, n) && s < S ? mask_at(p.mask, b, s, n) : 0.f;
    }
  };
  // The projection of the stage's rows into the operand stage, a third at a time.  Units of
  // (residue, 8 s): a's 16, then b's 32; warp w takes the pair of units q = w + 8·third.
  auto project_third = [&](int third) {
    const int q = warp + 8 * third;
    const int side = q < 8 ? 0 : 1;
    const int u0 = side == 0 ? 2 * q : 2 * (q - 8);
    const __half* w_hi = wsp + (side * 2 + 0) * kFpH * kFpLdW;
    const __half* w_lo = wsp + (side * 2 + 1) * kFpH * kFpLdW;
    int xrow[2];
    float2 stat[2];
#pragma unroll
    for (int un = 0; un < 2; ++un) {
      const int u = u0 + un;
      xrow[un] = ((side ? kFpResA : 0) + u / 4) * kFpS + (u % 4) * 8 + g;
      stat[un] = row_st[xrow[un]];
    }
    float pacc[2][2][4];
    project_units_f16(xs, kFpLdX, xrow, stat, w_hi, w_lo, Cp, pacc);
    // pacc[mt][un]: rows h = 16mt + g (+8), columns s = 8(u % 4) + 2t (+1) of the unit's residue.
    // Operand row side_res·kFpH + h lies in 8-row group 4·side_res + 2mt + hh at row g, its
    // pieces of s swizzled by g.
    char* const st_side = stage + (side ? kTcWgABytes : 0) + g * 128 + 4 * t;
#pragma unroll
    for (int un = 0; un < 2; ++un) {
      const int u = u0 + un, side_res = u / 4, sq = u % 4;
      const int res = (side ? kFpResA : 0) + side_res;
      const int r0 = res * kFpS + sq * 8 + 2 * t;
      const float fn = exp2_int(res_e[res]);
      uint32_t hi[2][2], lo[2][2];
      finish_projected_unit(pacc, un, w_fac + side * kFpH, w_bias + side * kFpH, row_m[r0] * fn, row_m[r0 + 1] * fn,
                            hi, lo);
      char* const rb = st_side + side_res * 4 * 1024;
      const int hi_off = (sq ^ g) << 4, lo_off = ((4 + sq) ^ g) << 4;
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          char* const rbh = rb + (2 * mt + hh) * 1024;
          *reinterpret_cast<uint32_t*>(rbh + hi_off) = hi[mt][hh];
          *reinterpret_cast<uint32_t*>(rbh + lo_off) = lo[mt][hh];
        }
    }
  };

  const uint64_t desc_a0 = wgmma_desc(stage + wg * 64 * 128, 16, 1024);
  const uint64_t desc_b0 = wgmma_desc(stage + kTcWgABytes, 16, 1024);
#pragma unroll
  for (int e = 0; e < 128; ++e) acc[e] = 0.f;
  // Each third of x's buffer is copied for the next stage as soon as its projection is done, so
  // its copy runs behind the other two thirds' projections and the stage's wgmma.  Groups in
  // flight at each wait: this stage's thirds not yet projected, then the next stage's issued.
  for (int kt = 0; kt < n_k; ++kt) {
    float mk[kMaskPerThread];
    load_masks(kt, mk);
#pragma unroll 1
    for (int third = 0; third < 3; ++third) {
      if (third == 0) {
        cp_async_wait<2>();
#pragma unroll
        for (int k = 0; k < kMaskPerThread; ++k)
          if (tid + k * kTcThreads < kFpRows) row_m[tid + k * kTcThreads] = mk[k];
      } else {
        cp_async_wait<1>();
      }
      // this third in; the one before it read (third 0: every warpgroup's multiply of the last
      // stage retired)
      __syncthreads();
      if (third > 0) issue_x(kt + 1, third - 1);
      if (!(f.skip & 4)) project_third(third);
    }
    fence_proxy_async_smem();  // this thread's operand stores, visible to the tensor cores
    __syncthreads();           // the operand stage whole; third 2 read
    issue_x(kt + 1, 2);
    if (!(f.skip & 8)) split16_stage_products(acc, desc_a0, desc_b0);
  }
  cp_async_wait_all();
  __syncthreads();  // every warp done with the stages: O may overwrite them
}

// The waves form's wave (WaveArgs), formed alike in every block: its batch element, its residues
// (rows i_lo .. i_lo + nr as a, columns j_lo .. j_lo + nc as b), whether this block has a tile in
// it, and where its part buffers lie (part q at region, or with two buffers at region + (q & 1)·half).
struct WaveTile {
  int w;  // the wave's index in the launch
  int b, i_lo, j_lo, nr, nc;
  int ga, gb;  // a's slots and b's slot pairs per chunk (the wave's row and column tiles)
  bool has_tile;
  bool single;  // one part buffer: the whole region (else part q in half q & 1)
  bool a_kept;  // a for all of s already in the buffer (the band's wave before it): b's tasks alone
  bool next_single;  // the next wave takes one buffer (its first stores wait for this wave's reads)
  bool own_rows;     // the region lies in the wave's own rows: its output stores wait for every read
  char* region;
  int64_t row_stride;  // bytes between the region's rows
  int slots_row;       // slots a region row (even)
  int half_slots;      // the second buffer's first slot (even)
  int chunks_per_part;
};

// Slot k of a wave's region (kWvSlotBytes each, slots_row a row).
__device__ __forceinline__ char* wave_slot(char* region, int64_t row_stride, int slots_row, int k) {
  const int row = k / slots_row;
  return region + int64_t(row) * row_stride + int64_t(k - row * slots_row) * kWvSlotBytes;
}

// Where a block is in the waves form's sequence: the parts so far, and (thread 0) the arrival at the
// grid barrier that the next one-buffer part waits on before its stores.
struct WaveCursor {
  int q;
  cooperative_groups::grid_group::arrival_token token;
  bool pending;  // arrived, not yet waited
};

// Where the wave's region lies in its own rows: every block's reads of its last part done before
// this block's output stores (the arrival made after its chunks).
__device__ __forceinline__ void wave_wait_reads(const WaveTile& wt, WaveCursor& cur) {
  if (wt.own_rows && cur.pending) {
    cooperative_groups::this_grid().barrier_wait(
        static_cast<cooperative_groups::grid_group::arrival_token&&>(cur.token));
    cur.pending = false;
  }
}

// A trace point of the waves form (WaveArgs::trace; timing aid): thread 0 appends one record to
// its block's.
__device__ __forceinline__ void wave_mark(const WaveArgs& wv, int mark, int w, int q) {
  if (wv.trace != nullptr && threadIdx.x == 0) {
    long long* const base = wv.trace + int64_t(blockIdx.x) * wv.trace_cap * 3;
    const long long n = base[0];
    if (n + 1 < wv.trace_cap) {
      unsigned long long gt;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(gt));
      long long* const e = base + 3 * (n + 1);
      e[0] = mark | (int64_t(w) << 8) | (int64_t(q) << 32);
      e[1] = static_cast<long long>(gt);
      e[2] = clock64();
      base[0] = n + 1;
    }
  }
}

// Phase 1 of the waves form for this block's tile (i0, j0; a_lim and b_lim its valid operand rows),
// acc as the workspace form leaves it (zeroed here).  Per part of s (chunks_per_part chunks of 32):
// this block's share of the wave's projection into the part's buffer, a grid barrier (every block,
// with a tile or without), then the part's chunks into acc as the workspace form adds them.  q
// counts the parts of the launch.  With two buffers a part's is the one the part before last used,
// which every block finished reading before it reached the last barrier; with one (wt.single) the
// part's first stores wait at a grid barrier that each block arrived at as soon as its reads of the
// part before were done (before its phase 2 and stores, where that part ended a wave), so that
// the wait is for the slowest block's reads, not its epilogue.
//
// The projection: tasks of 32 rows (a residue's s of one chunk), a's then b's, block blk taking
// tasks blk, blk + G, ...; a batch of kWvSlots at a time, one per warp, their x rows copied into the
// stage area while the batch before is projected.  Each row's LayerNorm statistics (one row per
// thread, as the first kernel forms them), then the task's a or b on mma.sync as the fused
// projection forms it (project_units_f16: LayerNorm folded into W and the bias), times the mask
// and 2^e, split into float16 high and low parts, staged in the warp's own x rows and stored
// whole at the task's place in the part buffer: per chunk, rows (n, h) of 128 bytes (32 high parts
// of s, then 32 low), a's nr·32 rows and then b's nc·32, so a task's 32 rows are one 4 KB run.
// The residue's exponent comes from a bound on its values (opm_bound_exponents_kernel).
__device__ __forceinline__ void waves_phase1_f16(const OuterArgs& p, char* smem_c, char* wv_smem, float (&acc)[128],
                                                 const WaveTile& wt, int i0, int j0, int a_lim, int b_lim,
                                                 WaveCursor& cur) {
  int& q = cur.q;
  const cooperative_groups::grid_group grid = cooperative_groups::this_grid();
  const FusedProjArgs& f = p.fp;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, wg = warp >> 2;
  const int g = lane >> 2, t = lane & 3;
  const int C = f.C, Cp = (C + 15) & ~15, S = p.S, N = p.N, b = wt.b;
  const int n_chunks = (S + 31) >> 5;
  const int G = gridDim.x, blk = blockIdx.x;
  static_assert(kWvRows == kTcThreads, "a batch row per thread for the statistics");
  float* const xs0 = reinterpret_cast<float*>(smem_c);  // batch k's rows at xs0 + (k & 1)·kWvRows·kWvLdX
  const __half* wsp = reinterpret_cast<const __half*>(wv_smem + kWvWOff);
  const float* w_fac = reinterpret_cast<const float*>(wv_smem + kWvFacOff);
  const float* w_bias = reinterpret_cast<const float*>(wv_smem + kWvBiasOff);
  float2* row_st = reinterpret_cast<float2*>(wv_smem + kWvStatOff);
  float* row_m = reinterpret_cast<float*>(wv_smem + kWvMaskOff);
#pragma unroll
  for (int e = 0; e < 128; ++e) acc[e] = 0.f;
  for (int c0 = 0; c0 < n_chunks; c0 += wt.chunks_per_part, ++q) {
    wave_mark(p.wv, kMarkPart, wt.w, q);
    const int nch = min(wt.chunks_per_part, n_chunks - c0);
    // one buffer: the wait for every block's arrival after its reads of the part before comes just
    // before this block's first stores, so that its first copies and statistics run meanwhile
    // (unless the wave before waited for them already, before its output stores)
    bool may_store = !(wt.single && q > 0 && cur.pending);
    // the part's slots: a's chunk by chunk from slot_a, then b's pairs from slot_b (even)
    const int slot_a = wt.single ? 0 : (q & 1) * wt.half_slots;
    const int slot_b = slot_a + ((nch * wt.ga + 1) & ~1);
    const int a_tasks = wt.a_kept ? 0 : wt.nr * nch, n_tasks = a_tasks + wt.nc * nch;
    const int mine = blk < n_tasks ? (n_tasks - blk + G - 1) / G : 0;
    const int n_batches = (mine + kWvSlots - 1) / kWvSlots;
    // task m of this block: side (0 a, 1 b), residue within the wave's, chunk within the part
    auto task_of = [&](int m, int& side, int& n_loc, int& ch) {
      int tk = blk + G * m;
      side = tk >= a_tasks;
      if (side) tk -= a_tasks;
      n_loc = tk / nch;
      ch = tk - n_loc * nch;
    };
    // x's rows of batch bi (row r = 32·slot + s within the chunk) into its buffer, one group of
    // copies (empty past the last batch), zeros past C, past S and past this block's tasks: warp w
    // copies slot w's rows (16-byte piece lane % 16 of rows lane / 16 + 2k), its task looked up once.
    auto issue_batch = [&](int bi) {
      if (bi < n_batches && !(p.wv.skip & 4)) {
        float* xs = xs0 + (bi & 1) * (kWvRows * kWvLdX);
        const int pq = lane & 15, m = bi * kWvSlots + warp;
        int side = 0, n_loc = 0, ch = 0;
        const bool task_ok = m < mine;
        if (task_ok) task_of(m, side, n_loc, ch);
        const int s0 = (c0 + ch) * 32 + (lane >> 4), n = (side ? wt.j_lo : wt.i_lo) + n_loc;
        const bool col_ok = task_ok && 4 * pq < C;
        const float* src = f.x + int64_t(b) * f.x_sb + int64_t(s0) * f.x_ss + int64_t(n) * f.x_sn + 4 * pq;
        float* const dst = xs + (32 * warp + (lane >> 4)) * kWvLdX + 4 * pq;
        const int64_t step = 2 * f.x_ss;
#pragma unroll
        for (int k = 0; k < 16; ++k) {
          const bool ok = col_ok && s0 + 2 * k < S;
          cp_async16z(dst + 2 * k * kWvLdX, ok ? src + k * step : f.x, ok);
        }
      }
      cp_async_commit();
    };
    issue_batch(0);
    for (int bi = 0; bi < n_batches; ++bi) {
      const int m0 = bi * kWvSlots;
      const float* xs = xs0 + (bi & 1) * (kWvRows * kWvLdX);
      // this thread's row (r = tid): its mask value and its residue's scale, loaded while the
      // batch's copies land
      const int r = tid;
      float mk = 0.f, fe = 0.f;
      if (m0 + (r >> 5) < mine && !(p.wv.skip & 1)) {
        int side, n_loc, ch;
        task_of(m0 + (r >> 5), side, n_loc, ch);
        const int s = (c0 + ch) * 32 + (r & 31), n = (side ? wt.j_lo : wt.i_lo) + n_loc;
        if (s < S) mk = mask_at(p.mask, b, s, n);
        fe = exp2_int((side ? p.b_exp : p.a_exp)[int64_t(b) * N + n]);
      }
      cp_async_wait_all();
      // batch bi's rows in; batch bi - 1's rows and the rows' factors read, so batch bi + 1 may
      // take its buffer
      __syncthreads();
      wave_mark(p.wv, kMarkBatchIn, wt.w, q);
      issue_batch(bi + 1);
      wave_mark(p.wv, kMarkBatchIssued, wt.w, q);
      if (!(p.wv.skip & 1)) {
        // the row's LayerNorm statistics: the mean as the row's first value plus the mean
        // difference from it in four partial sums (as the first kernel forms them)
        const float* row = xs + r * kWvLdX;
        const float v0 = row[0];
        float part[4] = {0.f, 0.f, 0.f, 0.f};
        for (int c4 = 0; c4 < C / 4; ++c4) {
          const float4 v = *reinterpret_cast<const float4*>(row + 4 * c4);
          part[0] += v.x - v0;
          part[1] += v.y - v0;
          part[2] += v.z - v0;
          part[3] += v.w - v0;
        }
        const float mean = v0 + ((part[0] + part[1]) + (part[2] + part[3])) / C;
#pragma unroll
        for (int k = 0; k < 4; ++k) part[k] = 0.f;
        for (int c4 = 0; c4 < C / 4; ++c4) {
          const float4 v = *reinterpret_cast<const float4*>(row + 4 * c4);
          const float d0 = v.x - mean, d1 = v.y - mean, d2 = v.z - mean, d3 = v.w - mean;
          part[0] = fmaf(d0, d0, part[0]);
          part[1] = fmaf(d1, d1, part[1]);
          part[2] = fmaf(d2, d2, part[2]);
          part[3] = fmaf(d3, d3, part[3]);
        }
        const float rstd = rsqrtf(((part[0] + part[1]) + (part[2] + part[3])) / C + f.ln_eps);
        row_st[r] = make_float2(mean, rstd * exp2_int(kFpVExp));
        // mask times the residue's power of two: the same bits as the one product after the other
        row_m[r] = mk * fe;
      }
      __syncthreads();  // the batch's statistics and factors
      if (!may_store) {
        wave_mark(p.wv, kMarkStoreWait, wt.w, q);
        grid.barrier_wait(static_cast<cooperative_groups::grid_group::arrival_token&&>(cur.token));
        cur.pending = false;
        wave_mark(p.wv, kMarkStoreGo, wt.w, q);
        may_store = true;
      }
      wave_mark(p.wv, kMarkBatchStats, wt.w, q);
      if (!(p.wv.skip & 1) && m0 + warp < mine) {
        // warp w: task slot w, in two halves of 16 s (units of 8 s: 2·half, 2·half + 1)
        int side, n_loc, ch;
        task_of(m0 + warp, side, n_loc, ch);
        const __half* w_hi = wsp + (side * 2 + 0) * kFpH * kFpLdW;
        const __half* w_lo = wsp + (side * 2 + 1) * kFpH * kFpLdW;
        const int slot = side ? slot_b + 2 * (ch * wt.gb + (n_loc >> 3)) + ((n_loc >> 2) & 1) : slot_a + ch * wt.ga + (n_loc >> 2);
        char* const rows =
            wave_slot(wt.region, wt.row_stride, wt.slots_row, slot) + (n_loc & 3) * kWvTaskBytes;
        // The task's rows staged in the warp's own x rows (its alone: its statistics and its
        // projection read them) and stored whole, not 16 bytes of 8 rows a store
        static_assert(16 * kWvLdX * 4 >= kWvTaskBytes, "half of a warp's x rows hold the task's rows");
        char* const stage = reinterpret_cast<char*>(xs0 + (bi & 1) * (kWvRows * kWvLdX) + 32 * warp * kWvLdX);
#pragma unroll 1
        for (int half = 0; half < 2; ++half) {
          int xrow[2];
          float2 stat[2];
#pragma unroll
          for (int un = 0; un < 2; ++un) {
            xrow[un] = 32 * warp + 8 * (2 * half + un) + g;
            stat[un] = row_st[xrow[un]];
          }
          float pacc[2][2][4];
          project_units_f16(xs, kWvLdX, xrow, stat, w_hi, w_lo, Cp, pacc);
          // the warp's x rows 0-15, read by half 0 alone, take the task's rows from here on
          if (half == 0) __syncwarp();
          // pacc[mt][un]: rows h = 16mt + g (+8), s = 8(2·half + un) + 2t (+1) of the task's chunk
#pragma unroll
          for (int un = 0; un < 2; ++un) {
            const int sl = 8 * (2 * half + un) + 2 * t, r0 = 32 * warp + sl;
            uint32_t hi[2][2], lo[2][2];
            finish_projected_unit(pacc, un, w_fac + side * kFpH, w_bias + side * kFpH, row_m[r0], row_m[r0 + 1], hi,
                                  lo);
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
              for (int hh = 0; hh < 2; ++hh) {
                const int h = 16 * mt + g + 8 * hh;
                // 16-byte piece 2·half + un (high) and 4 + that (low) of row h, swizzled by h % 8 so
                // that the eight rows of one store instruction fall in different banks
                char* const sp = stage + h * 128 + 4 * t;
                *reinterpret_cast<uint32_t*>(sp + (((2 * half + un) ^ (h & 7)) << 4)) = hi[mt][hh];
                *reinterpret_cast<uint32_t*>(sp + (((4 + 2 * half + un) ^ (h & 7)) << 4)) = lo[mt][hh];
              }
          }
        }
        // the task's 32 rows of 128 bytes, contiguous in the part buffer, in 512-byte stores
        __syncwarp();
#pragma unroll
        for (int it = 0; it < 8; ++it) {
          const int idx = it * 32 + lane, h = idx >> 3, c = idx & 7;
          const uint4 v = *reinterpret_cast<const uint4*>(stage + h * 128 + ((c ^ (h & 7)) << 4));
          *reinterpret_cast<uint4*>(rows + h * 128 + c * 16) = v;
        }
      }
      wave_mark(p.wv, kMarkBatchDone, wt.w, q);
    }
    cp_async_wait_all();
    wave_mark(p.wv, kMarkProjected, wt.w, q);
    if (!may_store) {
      // no batch here: the wait all the same
      grid.barrier_wait(static_cast<cooperative_groups::grid_group::arrival_token&&>(cur.token));
      cur.pending = false;
    }
    // every block's rows of the part stored and visible (the copies below read through L2)
    grid.sync();
    wave_mark(p.wv, kMarkBarrier, wt.w, q);
    if (wt.has_tile && !(p.wv.skip & 2)) {
      // the part's chunks, as the workspace form's phase 1 takes them (piece pq of rows pr + 32u)
      constexpr int kPieces = 8, kPassRows = kTcThreads / kPieces;
      const int pr = tid / kPieces, pq = tid % kPieces;
      // the tile's a slot and b slot pair of each chunk (a tile's rows, then its columns: Ti = 4
      // and Tj = 8 residues of 32 rows)
      static_assert(kTcMT == 4 * kFpH && kTcNT == 8 * kFpH, "a tile's a in one slot, its b in two");
      // (stepped chunk by chunk, wrapping to the region's next row, so that no division lies
      // between a chunk's barrier and its products)
      char* const region = wt.region;
      const int slots_row = wt.slots_row, ga = wt.ga, gb2 = 2 * wt.gb;
      // (a row's bytes past its slots: under 2^31, as a row of the output is)
      const int wrap = wt.own_rows ? int(wt.row_stride - int64_t(slots_row) * kWvSlotBytes) : 0;
      const int a_slot = slot_a + ((i0 - wt.i_lo) >> 2), b_slot = slot_b + 2 * ((j0 - wt.j_lo) >> 3);
      const int piece = pr * 128 + pq * 16;
      const char* a_src = wave_slot(region, wt.row_stride, slots_row, a_slot) + piece;
      const char* b_src = wave_slot(region, wt.row_stride, slots_row, b_slot) + piece;
      int a_col = a_slot % slots_row, b_col = b_slot % slots_row;
      auto step = [&](const char*& src, int& col, int by) {
        src += int64_t(by) * kWvSlotBytes;
        col += by;
        while (col >= slots_row) {
          col -= slots_row;
          src += wrap;
        }
      };
      const uint32_t stage0 = static_cast<uint32_t>(__cvta_generic_to_shared(smem_c));
      const uint32_t piece0 = (pr >> 3) * 1024 + (pr & 7) * 128 + ((pq ^ (pr & 7)) << 4);
      constexpr uint32_t kPassBytes = kPassRows * 128;
      int issued = 0;
      auto issue_stage = [&]() {
        if (issued < nch) {
          const uint32_t st = stage0 + uint32_t((issued % kTcWgStages) * kTcWgStageBytes) + piece0;
#pragma unroll
          for (int u = 0; u < kTcMT / kPassRows; ++u) {
            const bool ok = pr + kPassRows * u < a_lim;
            cp_async16z_shared(st + u * kPassBytes, ok ? a_src + kPassRows * u * 128 : region, ok);
          }
#pragma unroll
          for (int u = 0; u < kTcNT / kPassRows; ++u) {
            const bool ok = pr + kPassRows * u < b_lim;
            cp_async16z_shared(st + kTcWgABytes + u * kPassBytes, ok ? b_src + kPassRows * u * 128 : region, ok);
          }
          step(a_src, a_col, ga);
          step(b_src, b_col, gb2);
        }
        ++issued;
      };
#pragma unroll
      for (int st = 0; st < kTcWgAhead; ++st) {
        issue_stage();
        cp_async_commit();
      }
      const uint64_t desc_a0 = wgmma_desc(smem_c + wg * 64 * 128, 16, 1024);
      const uint64_t desc_b0 = wgmma_desc(smem_c + kTcWgABytes, 16, 1024);
      for (int kt = 0; kt < nch; ++kt) {
        cp_async_wait<kTcWgAhead - 1>();
        fence_proxy_async_smem();  // this thread's copies, visible to the tensor cores
        __syncthreads();
        // the stage refilled now was last read by chunk kt - 2's products, retired before the barrier
        issue_stage();
        cp_async_commit();
        const uint64_t off = uint64_t((kt % kTcWgStages) * (kTcWgStageBytes >> 4));
        split16_stage_products(acc, desc_a0 + off, desc_b0 + off);
      }
      cp_async_wait_all();
    }
    __syncthreads();  // the stages read: the next part's projection (or O) may overwrite them
    wave_mark(p.wv, kMarkChunks, wt.w, q);
    // this block's reads of the part done: the arrival that the next part's stores wait on where
    // that part (this wave's next, or the next wave's first) takes one buffer
    // (or, where the wave's region lies in its own rows, that its output stores wait on)
    if (c0 + nch < n_chunks ? wt.single : (wt.next_single || wt.own_rows)) {
      cur.token = grid.barrier_arrive();
      cur.pending = true;
    }
  }
}

// kBK, kKC, kNT: s per stage and columns (j, h2) of phase 1's mma.sync form, k per W chunk of phase
// 2's (kTcBK, kTcKC, kTcNT; kTcBKSmall, kTcKCSmall, kTcNTNarrow on GPUs with less shared memory
// than sm_90's; kNT >= Tj·H).
// One tile of opm_outer_tc_kernel: the grid's (blockIdx.z, grouped_tile), or for the waves form
// (kWaves) the wave's tile wave_row_tile, wave_col_tile of batch element wave_b, with its wave wt
// and part counter (null otherwise).
template <int kTerms, bool kWgmma, bool kWgmma2, bool kHalfSplit, int kBK, int kKC, int kNT, bool kFused, bool kWaves>
__device__ __forceinline__ void outer_tc_tile(const OuterArgs& p, int wave_b, int wave_col_tile, int wave_row_tile,
                                              const WaveTile* wt, WaveCursor* cursor) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  static_assert(!kWaves || (kHalfSplit && !kFused), "the waves form on the float16 split form alone");
  static_assert(!kWgmma2 || (kWgmma && (kTerms == 1 || kHalfSplit)), "phase 2 on wgmma: TF32 after phase 1 on wgmma");
  static_assert(!kHalfSplit || (kWgmma2 && kTerms == 3), "the float16 split form runs both phases on wgmma");
  static_assert(kBK == kTcBK || (kBK == kTcBKSmall && !kWgmma), "half stages for the mma.sync form alone");
  static_assert(kKC == kTcKC || (kKC == kTcKCSmall && !kWgmma), "half W chunks for the mma.sync form alone");
  static_assert(kNT == kTcNT || (kNT == kTcNTNarrow && !kWgmma), "a narrower phase 1 for the mma.sync form alone");
  static_assert(!kFused || kHalfSplit, "the fused projection on the float16 split form alone");
  extern __shared__ float4 smem_f4[];
  float* smem = reinterpret_cast<float*>(smem_f4);
  if constexpr (kWgmma)  // the swizzle follows address bits 4-9: stages from a 1 KB boundary
    smem = reinterpret_cast<float*>(align_smem_1k(reinterpret_cast<char*>(smem)));
  const TcLayout L = tc_layout(p.H, p.Ti, p.Tj, kWgmma, kWgmma2, kBK, kKC, kNT);
  float* den_s = smem + L.den;
  int64_t* row_off = reinterpret_cast<int64_t*>(smem + L.rows);         // [kTcRoundRows]
  float* norm_arg = reinterpret_cast<float*>(row_off + kTcRoundRows);   // [kTcRoundRows]
  const int H = p.H, N = p.N, S = p.S, D = p.D, Ti = p.Ti, Tj = p.Tj;
  const int P = Ti * Tj;
  const int b = kWaves ? wave_b : int(blockIdx.z);
  int col_tile = wave_col_tile, row_tile = wave_row_tile;
  if constexpr (!kWaves) grouped_tile(col_tile, row_tile);
  const int i0 = row_tile * Ti, j0 = col_tile * Tj;  // i0 local to this row block
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;  // fragment coordinates (PTX: groupID, threadID_in_group)
  const int64_t NH = int64_t(N) * H, NaH = int64_t(p.Na) * H;

  // Row denominators of the tile (read in the epilogue, after several barriers), formed while
  // the first stages are in flight; the other conventions' pair counts come in p.pair.
  auto form_row_denominators = [&]() {
    if (p.norm.kind == kNormRow) {
      for (int il = warp; il < Ti; il += kTcThreads / 32) {
        const float den = mask_denominator(p.mask, b, min(i0 + il, p.Na - 1) + p.i_offset, p.S_mask, lane);
        if (lane == 0) den_s[il] = den;
      }
    }
  };
  const float* w_out = static_cast<const float*>(p.w_out);
  float* Os = smem;  // phase 2's O tile, over the stages once phase 1 is done with them
  const int a_lim = min(Ti * H, (p.Na - i0) * H);  // valid rows (i, h1) of A: multiples of 8
  const int b_lim = min(Tj * H, (N - j0) * H);      // valid rows (j, h2) of B
  if constexpr (kWgmma) {
    // ---------------- phase 1 on wgmma: warpgroup wg takes rows 64wg .. 64wg + 63 (i, h1) ----------------
    // a is (B, chunks, Na·H, kRow) and b (B, chunks, N·H, kRow) floats (AbKind), so a stage's A
    // and B are contiguous runs of rows in global memory.  In shared memory each row takes 128
    // bytes, swizzled (16-byte piece q of row r at piece q ^ (r % 8)): 32 TF32 values of s for one
    // term; for three, B's rows hold 16 s of high parts, then the same 16 s of low parts, which
    // this thread forms from the values it copied (so no barrier comes between the copy and the
    // split), and A's rows 16 s as they are, split by the threads that read them into registers.
    // This thread copies piece pq of rows pr + kPassRows·u.
    const int wg = warp >> 2;
    float acc[128];
    if constexpr (kWaves) {
      if (wt->has_tile) form_row_denominators();
      char* smem_c = reinterpret_cast<char*>(smem);
      waves_phase1_f16(p, smem_c, smem_c + (L.total - 256) * 4, acc, *wt, i0, j0, a_lim, b_lim, *cursor);
      if (!wt->has_tile) {
        wave_wait_reads(*wt, *cursor);
        return;
      }
    } else if constexpr (kFused) {
      form_row_denominators();
      fused_phase1_f16(p, reinterpret_cast<char*>(smem), acc, b, i0, j0);
    } else {
    constexpr int kRow = kHalfSplit ? ab_kind_row_floats(kAbF32Rows32) : kmajor_row_floats(kTerms);
    constexpr int kPieces = kRow / 4, kPassRows = kTcThreads / kPieces;
    const int n_k = (S + kRow - 1) / kRow;
    const int64_t a_chunk = NaH * kRow, b_chunk = NH * kRow;  // floats per chunk
    const int pr = tid / kPieces, pq = tid % kPieces;
    const float* a_k = static_cast<const float*>(p.a);
    const float* b_k = static_cast<const float*>(p.b);
    const float* a_src = a_k + int64_t(b) * n_k * a_chunk + (int64_t(i0) * H + pr) * kRow + pq * 4;
    const float* b_src = b_k + int64_t(b) * n_k * b_chunk + (int64_t(j0) * H + pr) * kRow + pq * 4;
    char* smem_c = reinterpret_cast<char*>(smem);
    const uint32_t stage0 = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    // this thread's first piece, relative to a stage; row pr + kPassRows·u is kPassRows·128·u further
    const uint32_t piece0 = (pr >> 3) * 1024 + (pr & 7) * 128 + ((pq ^ (pr & 7)) << 4);
    constexpr uint32_t kPassBytes = kPassRows * 128;
    int issued = 0;
    // The next chunk into its ring buffer; nothing past the last (the caller still commits a
    // group, empty, to keep the wait counts).
    auto issue_stage = [&]() {
      if (issued < n_k) {
        const uint32_t st = stage0 + uint32_t((issued % kTcWgStages) * kTcWgStageBytes) + piece0;
#pragma unroll
        for (int u = 0; u < kTcMT / kPassRows; ++u) {
          const bool ok = pr + kPassRows * u < a_lim;
          cp_async16z_shared(st + u * kPassBytes, ok ? a_src + kPassRows * u * kRow : a_k, ok);
        }
#pragma unroll
        for (int u = 0; u < kTcNT / kPassRows; ++u) {
          const bool ok = pr + kPassRows * u < b_lim;
          cp_async16z_shared(st + kTcWgABytes + u * kPassBytes, ok ? b_src + kPassRows * u * kRow : b_k, ok);
        }
        a_src += a_chunk;
        b_src += b_chunk;
      }
      ++issued;
    };
    // 3xTF32: the pieces of B this thread copied into buffer `buf` become their high parts
    // (hi = x rounded to nearest TF32, as split_tf32<3> forms it) and, in the other half of the row
    // (address bit 6 flipped: piece q ^ 4), their low parts lo = x - hi.
    auto split_stage = [&](int buf) {
      char* st = smem_c + buf * kTcWgStageBytes + piece0;
      auto split_piece = [&](char* piece) {
        float4& x = *reinterpret_cast<float4*>(piece);
        const float4 v = x;
        float4 hi, lo;
        hi.x = __uint_as_float((__float_as_uint(v.x) + 0x1000u) & 0xffffe000u);
        hi.y = __uint_as_float((__float_as_uint(v.y) + 0x1000u) & 0xffffe000u);
        hi.z = __uint_as_float((__float_as_uint(v.z) + 0x1000u) & 0xffffe000u);
        hi.w = __uint_as_float((__float_as_uint(v.w) + 0x1000u) & 0xffffe000u);
        lo.x = v.x - hi.x;
        lo.y = v.y - hi.y;
        lo.z = v.z - hi.z;
        lo.w = v.w - hi.w;
        x = hi;
        *reinterpret_cast<float4*>(smem_c + ((static_cast<uint32_t>(piece - smem_c)) ^ 64u)) = lo;
      };
#pragma unroll
      for (int u = 0; u < kTcNT / kPassRows; ++u) split_piece(st + kTcWgABytes + u * kPassBytes);
    };
    // 3xTF32, A from registers: this thread's A fragments of a stage (rows ra, ra + 8 of its warp's
    // 16, s = t, t + 4, t + 8, t + 12) read raw and split as split_piece splits B.  Lanes of a warp
    // read 8 rows x 4 consecutive floats of a piece, swizzled apart: no bank conflicts.
    const int ra = wg * 64 + (warp & 3) * 16 + g;
    auto load_a_split = [&](int buf, uint32_t (&a_hi)[2][4], uint32_t (&a_lo)[2][4]) {
      const char* st = smem_c + buf * kTcWgStageBytes;
#pragma unroll
      for (int kk = 0; kk < 2; ++kk)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = ra + 8 * (e & 1), q = 2 * kk + (e >> 1);  // q: piece of s = 8kk + t (+4)
          const float v = *reinterpret_cast<const float*>(st + r * 128 + ((q ^ (r & 7)) << 4) + t * 4);
          const uint32_t hi = (__float_as_uint(v) + 0x1000u) & 0xffffe000u;
          a_hi[kk][e] = hi;
          a_lo[kk][e] = __float_as_uint(v - __uint_as_float(hi));
        }
    };
#pragma unroll
    for (int st = 0; st < kTcWgAhead; ++st) {
      issue_stage();
      cp_async_commit();
    }
    form_row_denominators();

    // Stage 0's descriptors; another stage's or k step's differ in the start address alone (16-byte
    // units): a k step of 8 TF32 is 32 bytes along the row, the low parts start 64 bytes in.
    const uint64_t desc_a0 = wgmma_desc(smem + wg * 64 * 32, 16, 1024);
    const uint64_t desc_b0 = wgmma_desc(reinterpret_cast<char*>(smem) + kTcWgABytes, 16, 1024);
#pragma unroll
    for (int e = 0; e < 128; ++e) acc[e] = 0.f;
    for (int kt = 0; kt < n_k; ++kt) {
      cp_async_wait<kTcWgAhead - 1>();
      if constexpr (kTerms == 3 && !kHalfSplit) split_stage(kt % kTcWgStages);
      fence_proxy_async_smem();  // this thread's copies (and splits), visible to the tensor cores
      __syncthreads();
      // The buffer refilled now was last read by the group of chunk kt - 2, which every
      // warpgroup retired before the barrier (one group stays in flight).
      issue_stage();
      cp_async_commit();
      const uint64_t off = uint64_t((kt % kTcWgStages) * (kTcWgStageBytes >> 4));
      const uint64_t da = desc_a0 + off, db = desc_b0 + off;
      if constexpr (kHalfSplit) {
        split16_stage_products(acc, da, db);
      } else if constexpr (kTerms == 3) {
        // The tensor core's accumulation truncates relative to the accumulator's magnitude (see
        // mma_split_add): each stage's products go to a zeroed accumulator, half of the columns
        // at a time (registers), which is then added to the running sum in float32.  The small
        // terms first, as mma_split orders them.  A comes from registers (load_a_split).
        uint32_t a_hi[2][4], a_lo[2][4];
        load_a_split(kt % kTcWgStages, a_hi, a_lo);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          float part[64];
          const uint64_t dbh = db + half * (128 * 128 >> 4);  // B rows 128·half ..
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < 2; ++kk) {
            wgmma_m64n128k8_tf32_rs(part, a_hi[kk], dbh + 4 + 2 * kk, kk);
            wgmma_m64n128k8_tf32_rs(part, a_lo[kk], dbh + 2 * kk, 1);
            wgmma_m64n128k8_tf32_rs(part, a_hi[kk], dbh + 2 * kk, 1);
          }
          wgmma_commit();
          wgmma_wait<0>();
#pragma unroll
          for (int e = 0; e < 64; ++e) acc[64 * half + e] += part[e];
        }
      } else {
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) wgmma_m64n256k8_tf32(acc, da + 2 * kk, db + 2 * kk);
        wgmma_commit();
        wgmma_wait<1>();
      }
    }
    wgmma_wait<0>();
    cp_async_wait_all();
    __syncthreads();  // every warp done with the stages: O may overwrite them
    }

    // O as [pair][h1·H + h2], pair = il·Tj + jl.  acc[4j + 2half + e] is row m = 64wg + 16(warp % 4)
    // + g + 8half, column 8j + 2t + e, i.e. column tile jl = j / (H / 8) (H is a multiple of 8);
    // for H = 8·kHB with kHB a power of two the tile and offset fold to constants.
    auto store_o = [&](auto hb_const) {
      constexpr int kHB = decltype(hb_const)::value;
      const int hb = kHB > 0 ? kHB : H >> 3;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int m = wg * 64 + (warp & 3) * 16 + g + 8 * half;
        const int il = m / H;
        if (il < Ti) {
          float* orow = Os + il * Tj * L.ldo + (m - il * H) * H + 2 * t;
#pragma unroll
          for (int j = 0; j < 32; ++j) {
            const int jl = j / hb;
            if (jl < Tj)
              *reinterpret_cast<float2*>(orow + jl * L.ldo + 8 * (j - jl * hb)) =
                  make_float2(acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]);
          }
        }
      }
    };
    // Phase 2 on wgmma: O rounded to TF32 as phase 2's B operand, K-major, pair groups of 8 rows
    // H²·32 bytes apart, k = o_k_order(h1, h2): the 8 rows h1 (lane / 4) by 8 columns h2 of a
    // warp's store fill two 128-byte rows (no bank conflicts).
    auto store_o_kmajor = [&](auto hb_const) {
      constexpr int kHB = decltype(hb_const)::value;
      const int hb = kHB > 0 ? kHB : H >> 3;
      const uint32_t sbo = uint32_t(H) * H * 32;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int m = wg * 64 + (warp & 3) * 16 + g + 8 * half;
        const int il = m / H;
        if (il < Ti) {
          const int h1 = m - il * H;
#pragma unroll
          for (int j = 0; j < 32; ++j) {
            const int jl = j / hb;
            if (jl < Tj) {
              const int k = o_k_order(h1, 8 * (j - jl * hb) + 2 * t, hb);
              *reinterpret_cast<float2*>(reinterpret_cast<char*>(Os) + kmajor_tf32_offset(il * Tj + jl, k, sbo)) =
                  make_float2(__uint_as_float(to_tf32(acc[4 * j + 2 * half])),
                              __uint_as_float(to_tf32(acc[4 * j + 2 * half + 1])));
            }
          }
        }
      }
    };
    // The float16 split form: O·2^o_exp (exact; below 2^15 by the bound on |sum_s a'b'|) as
    // float16 high and low parts at the positions store_o_kmajor gives its TF32 values (each row
    // of 32 k: 64 bytes of high parts, then the low parts).
    auto store_o_split16 = [&](auto hb_const) {
      constexpr int kHB = decltype(hb_const)::value;
      const int hb = kHB > 0 ? kHB : H >> 3;
      const uint32_t sbo = uint32_t(H) * H * 32;
      char* os = reinterpret_cast<char*>(Os);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int m = wg * 64 + (warp & 3) * 16 + g + 8 * half;
        const int il = m / H;
        if (il < Ti) {
          const int h1 = m - il * H;
#pragma unroll
          for (int j = 0; j < 32; ++j) {
            const int jl = j / hb;
            if (jl < Tj) {
              const int k = o_k_order(h1, 8 * (j - jl * hb) + 2 * t, hb), row = il * Tj + jl;
              uint32_t hi, lo;
              split_f16x2(acc[4 * j + 2 * half] * p.o_scale, acc[4 * j + 2 * half + 1] * p.o_scale, hi, lo);
              *reinterpret_cast<uint32_t*>(os + kmajor_split16_offset(row, k, sbo, 0)) = hi;
              *reinterpret_cast<uint32_t*>(os + kmajor_split16_offset(row, k, sbo, 1)) = lo;
            }
          }
        }
      }
    };
    if constexpr (kHalfSplit) {
      switch (H) {
        case 8: store_o_split16(std::integral_constant<int, 1>{}); break;
        case 16: store_o_split16(std::integral_constant<int, 2>{}); break;
        case 32: store_o_split16(std::integral_constant<int, 4>{}); break;
        default: store_o_split16(std::integral_constant<int, 0>{});
      }
    } else if constexpr (kWgmma2) {
      switch (H) {
        case 8: store_o_kmajor(std::integral_constant<int, 1>{}); break;
        case 16: store_o_kmajor(std::integral_constant<int, 2>{}); break;
        case 32: store_o_kmajor(std::integral_constant<int, 4>{}); break;
        default: store_o_kmajor(std::integral_constant<int, 0>{});
      }
    } else {
      switch (H) {
        case 8: store_o(std::integral_constant<int, 1>{}); break;
        case 16: store_o(std::integral_constant<int, 2>{}); break;
        case 32: store_o(std::integral_constant<int, 4>{}); break;
        case 64: store_o(std::integral_constant<int, 8>{}); break;
        default: store_o(std::integral_constant<int, 0>{});
      }
    }
  } else {
  // ---------------- phase 1: warps 2 (m) x 4 (n), 64 x kNT / 4 each ----------------
  const int wm = warp & 1, wn = warp >> 1;
  constexpr int kLdB = tc_ld_b(kNT);
  constexpr int kWarpN = kNT / 4, kNTiles = kWarpN / 8;
  float acc[4][kNTiles][4];
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;

  const float* a_base = static_cast<const float*>(p.a) + int64_t(b) * S * NaH + int64_t(i0) * H;
  const float* b_base = static_cast<const float*>(p.b) + int64_t(b) * S * NH + int64_t(j0) * H;

  constexpr int kStageFloats = tc_stage_floats(kBK, kNT);
  auto load_stage = [&](int buf, int s0) {
    float* As = smem + buf * kStageFloats;  // [BK][LdA]
    float* Bs = As + kBK * kTcLdA;          // [BK][LdB]
#pragma unroll
    for (int u = 0; u < kBK * kTcMT / 4 / kTcThreads; ++u) {
      const int idx = tid + u * kTcThreads;
      const int k = idx / (kTcMT / 4), m = (idx % (kTcMT / 4)) * 4;
      const bool ok = (s0 + k < S) && (m < a_lim);
      cp_async16z(&As[k * kTcLdA + m], ok ? a_base + int64_t(s0 + k) * NaH + m : a_base, ok);
    }
#pragma unroll
    for (int u = 0; u < kBK * kNT / 4 / kTcThreads; ++u) {
      const int idx = tid + u * kTcThreads;
      const int k = idx / (kNT / 4), n = (idx % (kNT / 4)) * 4;
      const bool ok = (s0 + k < S) && (n < b_lim);
      cp_async16z(&Bs[k * kLdB + n], ok ? b_base + int64_t(s0 + k) * NH + n : b_base, ok);
    }
  };

  const int n_k = (S + kBK - 1) / kBK;
#pragma unroll
  for (int st = 0; st < kTcStages - 1; ++st) {
    if (st < n_k) load_stage(st, st * kBK);
    cp_async_commit();
  }
  form_row_denominators();

  for (int kt = 0; kt < n_k; ++kt) {
    cp_async_wait<kTcStages - 2>();
    __syncthreads();
    const int next = kt + kTcStages - 1;
    if (next < n_k) load_stage(next % kTcStages, next * kBK);
    cp_async_commit();
    const float* As = smem + (kt % kTcStages) * kStageFloats + wm * 64 + g;
    const float* Bs = smem + (kt % kTcStages) * kStageFloats + kBK * kTcLdA + wn * kWarpN + g;
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 8) {
      uint32_t a_hi[4][4], a_lo[4][4];
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
        const float* ap = As + (kk + t) * kTcLdA + mt * 16;
        split_tf32<kTerms>(ap[0], a_hi[mt][0], a_lo[mt][0]);
        split_tf32<kTerms>(ap[8], a_hi[mt][1], a_lo[mt][1]);
        split_tf32<kTerms>(ap[4 * kTcLdA], a_hi[mt][2], a_lo[mt][2]);
        split_tf32<kTerms>(ap[4 * kTcLdA + 8], a_hi[mt][3], a_lo[mt][3]);
      }
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
        const float* bp = Bs + (kk + t) * kLdB + nt * 8;
        uint32_t bh0, bh1, bl0 = 0, bl1 = 0;
        split_tf32<kTerms>(bp[0], bh0, bl0);
        split_tf32<kTerms>(bp[4 * kLdB], bh1, bl1);
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) mma_split_add<kTerms>(acc[mt][nt], a_hi[mt], a_lo[mt], bh0, bh1, bl0, bl1);
      }
    }
  }
  cp_async_wait_all();
  __syncthreads();  // every warp done with the stages: O may overwrite them

  // O as [pair][h1·H + h2], pair = il·Tj + jl: a k-step of phase 2 reads 8 consecutive floats
  // of 16 pairs, conflict-free with the row stride H² + 4.
  {
    int jl_of[kNTiles], h2_of[kNTiles];
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
      const int n = wn * kWarpN + nt * 8 + 2 * t;
      jl_of[nt] = n / H;
      h2_of[nt] = n - jl_of[nt] * H;
    }
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int m = wm * 64 + mt * 16 + g + 8 * half;
        const int il = m / H, h1 = m - il * H;
        if (il >= Ti) continue;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
          if (jl_of[nt] >= Tj) continue;
          float* dst = Os + (il * Tj + jl_of[nt]) * L.ldo + h1 * H + h2_of[nt];
          *reinterpret_cast<float2*>(dst) = make_float2(acc[mt][nt][2 * half], acc[mt][nt][2 * half + 1]);
        }
      }
  }

  }

  const int K2 = H * H;
  // Output rows and normaliser arguments of the round of pairs r0 .. r0 + kTcRoundRows, for
  // store_round.  Staged at the round's start, once its first W chunks are on their way: the pair
  // counts' loads (from L2 or memory) then wait beside those chunks instead of before the epilogue.
  auto stage_round_rows = [&](int r0) {
    if (tid < kTcRoundRows) {
      const int pr = r0 + tid;
      const int il = pr / Tj, jl = pr - il * Tj;
      stage_pair_row<false>(p, tid, pr < P && i0 + il < p.Na && j0 + jl < N, b, i0, il, j0, jl, N, D, den_s,
                            row_off, norm_arg);
    }
  };
  if constexpr (kWgmma2) {
    // ---------------- phase 2 on wgmma: out[(i,j), d]ᵀ = W · Oᵀ, warpgroup wg taking d 64wg .. 64wg+63
    // of each group of kTcDG, a round of kTcRoundRows pairs at a time.  W comes rounded to TF32
    // (opm_round_tf32_kernel, once per call: every block reads all of it).
    const int n_kc = K2 / 32;
    const int wg = warp >> 2;
    const float* w_blk = static_cast<const float*>(p.w_blocked);
    const uint32_t o_sbo = uint32_t(K2) * 32;
    char* smem_c = reinterpret_cast<char*>(smem);
    char* w_st = smem_c + L.w * 4;
    // This thread's pieces of a chunk: rows d = tid/8 + 32u, 16-byte piece tid % 8 of the row.
    const int wc = tid & 7, wr = tid >> 3;
    const uint32_t w_dst = uint32_t(wr >> 3) * 1024u + uint32_t(wr & 7) * 128u + uint32_t((wc ^ (wr & 7)) << 4);
    constexpr int kAhead2 = kTcWg2Stages - 2;
    for (int dg = 0; dg < D; dg += kTcDG) {
      bool d_ok[kTcDG / 32];
#pragma unroll
      for (int u = 0; u < kTcDG / 32; ++u) d_ok[u] = dg + wr + 32 * u < D;
      for (int r0 = 0; r0 < P; r0 += kTcRoundRows) {
        const float* w_src = w_blk + int64_t(dg + wr) * K2 + wc * 4;  // chunk 0 of this thread's rows
        auto issue_w = [&](int kc) {
          if (kc < n_kc) {
            char* st = w_st + (kc % kTcWg2Stages) * kTcWg2ChunkBytes + w_dst;
#pragma unroll
            for (int u = 0; u < kTcDG / 32; ++u)
              cp_async16z(st + u * 4096, d_ok[u] ? w_src + int64_t(32 * u) * K2 + kc * 32 : w_blk, d_ok[u]);
          }
        };
        __syncthreads();  // O written / the previous round's partial sums consumed
#pragma unroll
        for (int kc = 0; kc < kAhead2; ++kc) {
          issue_w(kc);
          cp_async_commit();
        }
        stage_round_rows(r0);
        float acc2[16], part2[16];
#pragma unroll
        for (int e = 0; e < 16; ++e) acc2[e] = part2[e] = 0.f;
        const char* o_round = smem_c + (r0 >> 3) * o_sbo;
        for (int kc = 0; kc < n_kc; ++kc) {
          cp_async_wait<kAhead2 - 1>();
          fence_proxy_async_smem();  // this thread's copies, visible to the tensor cores
          __syncthreads();
          // The stage refilled now was last read by the group of chunk kc - 2, which every
          // warpgroup retired before the barrier (one group stays in flight).
          issue_w(kc + kAhead2);
          cp_async_commit();
          const char* st = w_st + (kc % kTcWg2Stages) * kTcWg2ChunkBytes + wg * 64 * 128;
          wgmma_fence();
          if constexpr (kHalfSplit) {
            // Two chunks' products (12 MMAs) in a zeroed accumulator, then added in float32: the
            // even chunk starts it, the odd one waits for both and adds (n_kc is even).
            const char* oc = o_round + kc * 1024;
#pragma unroll
            for (int kk = 0; kk < 2; ++kk) {
              const uint64_t w_hi = wgmma_desc(st + kk * 32, 16, 1024), w_lo = wgmma_desc(st + 64 + kk * 32, 16, 1024);
              const uint64_t o_hi = wgmma_desc(oc + kk * 32, 16, o_sbo), o_lo = wgmma_desc(oc + 64 + kk * 32, 16, o_sbo);
              wgmma_m64n32k16_f16(part2, w_lo, o_hi, kk == 0 ? (kc & 1) : 1);
              wgmma_m64n32k16_f16(part2, w_hi, o_lo, 1);
              wgmma_m64n32k16_f16(part2, w_hi, o_hi, 1);
            }
            wgmma_commit();
            if (kc & 1) {
              wgmma_wait<0>();
#pragma unroll
              for (int e = 0; e < 16; ++e) acc2[e] += part2[e];
            }
          } else {
#pragma unroll
            for (int kk = 0; kk < 4; ++kk)
              wgmma_m64n32k8_tf32(acc2, wgmma_desc(st + kk * 32, 16, 1024),
                                  wgmma_desc(o_round + kc * 1024 + kk * 32, 16, o_sbo));
            wgmma_commit();
            wgmma_wait<1>();
          }
        }
        wgmma_wait<0>();
        cp_async_wait_all();
        __syncthreads();  // every W read done: the stage area takes the sums
        float* red = reinterpret_cast<float*>(w_st);  // [kTcRoundRows pairs][kTcDG + 4]
        constexpr int kRedLd = kTcDG + 4;
        // acc2: rows d = 64wg + 16(warp % 4) + g (+8), columns (pairs) 8j + 2t (+1)
        if constexpr (kHalfSplit) {
          // the scales out: 2^-(o_exp + a's exponent of row i + b's of column j + W's of row d)
          int w_e[2];
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int d = dg + wg * 64 + (warp & 3) * 16 + g + 8 * half;
            w_e[half] = d < D ? p.w_exp[d] : 0;
          }
#pragma unroll
          for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int pr = min(r0 + 8 * j + 2 * t + e, P - 1);
              const int il = pr / Tj, jl = pr - il * Tj;
              const int pair_e = -p.o_exp - p.a_exp[int64_t(b) * p.Na + min(i0 + il, p.Na - 1)] -
                                 p.b_exp[int64_t(b) * N + min(j0 + jl, N - 1)];
#pragma unroll
              for (int half = 0; half < 2; ++half)
                acc2[4 * j + 2 * half + e] = scalbnf(acc2[4 * j + 2 * half + e], pair_e - w_e[half]);
            }
        }
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int d = wg * 64 + (warp & 3) * 16 + g + 8 * half, pr = 8 * j + 2 * t;
            red[pr * kRedLd + d] = acc2[4 * j + 2 * half];
            red[(pr + 1) * kRedLd + d] = acc2[4 * j + 2 * half + 1];
          }
        __syncthreads();
        if constexpr (kWaves) wave_wait_reads(*wt, *cursor);
        store_round<kTcRoundRows, false>(p, red, kRedLd, row_off, norm_arg, dg, tid, kTcThreads);
      }
    }
    return;
  }

  // ---------------- phase 2: warps 4 (32 d each) x 2 (halves of each k chunk) ----------------
  constexpr int kLdW = tc_ld_w(kKC);
  constexpr int kStepsPerHalf = kKC / 16;  // k-steps of 8 per warp half of a chunk
  const int n_kc = K2 / kKC;
  const int dw = warp & 3, kh = warp >> 2;
  float* Wst = smem + L.w;  // [kTcWStages][DG][LdW]; after the k loop, the partial sums [32][DG + 4]

  auto load_w = [&](int buf, int dg, int kc0) {
    float* Ws = Wst + buf * kTcDG * kLdW;
#pragma unroll
    for (int u = 0; u < kTcDG * kKC / 4 / kTcThreads; ++u) {
      const int idx = tid + u * kTcThreads;
      const int dl = idx / (kKC / 4), k = (idx % (kKC / 4)) * 4;
      const bool ok = dg + dl < D;
      cp_async16z(&Ws[dl * kLdW + k], ok ? w_out + int64_t(dg + dl) * K2 + kc0 + k : w_out, ok);
    }
  };

  for (int dg = 0; dg < D; dg += kTcDG) {
    for (int r0 = 0; r0 < P; r0 += kTcRoundRows) {
      float acc2[2][4][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc2[mt][nt][e] = 0.f;
      // A rows of this warp's fragments (pairs past P read row P-1: computed, never stored)
      const float* orow[2][2];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half)
          orow[mt][half] = Os + min(r0 + mt * 16 + g + 8 * half, P - 1) * L.ldo + t;

      __syncthreads();  // O written / previous round's W and partial sums consumed
      // kTcWStages - 1 chunks of W in flight ahead of the one multiplied (W comes from L2)
#pragma unroll
      for (int st = 0; st < kTcWStages - 1; ++st) {
        if (st < n_kc) load_w(st, dg, st * kKC);
        cp_async_commit();
      }
      stage_round_rows(r0);
      for (int kc = 0; kc < n_kc; ++kc) {
        cp_async_wait<kTcWStages - 2>();
        __syncthreads();
        const int next = kc + kTcWStages - 1;
        if (next < n_kc) load_w(next % kTcWStages, dg, next * kKC);
        cp_async_commit();
        const float* Ws = Wst + (kc % kTcWStages) * kTcDG * kLdW + (dw * 32 + g) * kLdW + t;
        // this chunk's sum in its own fragments (see mma_split_add), added in float32 below
        float part[2][4][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) part[mt][nt][e] = 0.f;
#pragma unroll
        for (int ks = 0; ks < kStepsPerHalf; ++ks) {
          const int kl = (kStepsPerHalf * kh + ks) * 8;  // k within the chunk
          const int k = kc * kKC + kl;
          uint32_t a_hi[2][4], a_lo[2][4];
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
            split_tf32<kTerms>(orow[mt][0][k], a_hi[mt][0], a_lo[mt][0]);
            split_tf32<kTerms>(orow[mt][1][k], a_hi[mt][1], a_lo[mt][1]);
            split_tf32<kTerms>(orow[mt][0][k + 4], a_hi[mt][2], a_lo[mt][2]);
            split_tf32<kTerms>(orow[mt][1][k + 4], a_hi[mt][3], a_lo[mt][3]);
          }
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) {
            const float* wp = Ws + nt * 8 * kLdW + kl;
            uint32_t bh0, bh1, bl0 = 0, bl1 = 0;
            split_tf32<kTerms>(wp[0], bh0, bl0);
            split_tf32<kTerms>(wp[4], bh1, bl1);
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) mma_split<kTerms>(part[mt][nt], a_hi[mt], a_lo[mt], bh0, bh1, bl0, bl1);
          }
        }
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc2[mt][nt][e] += part[mt][nt][e];
      }
      cp_async_wait_all();
      __syncthreads();  // all W reads done: the stage area takes the partial sums
      float* red = Wst;  // [32 pairs][kTcDG + 4]
      constexpr int kRedLd = kTcDG + 4;
      sum_k_halves<2>(red, kRedLd, acc2, kh, dw * 32, g, t);
      store_round<kTcRoundRows, false>(p, red, kRedLd, row_off, norm_arg, dg, tid, kTcThreads);
    }
  }
#endif
}

// The waves form's loop (WaveArgs): waves in order of batch element, band of rows, block of columns;
// in each, block blockIdx.x takes tile (blockIdx.x / columns, blockIdx.x % columns) of the wave if
// it has one.  Every block computes the same waves, regions and parts, so every block reaches every
// grid barrier.
template <int kTerms, bool kWgmma, bool kWgmma2, bool kHalfSplit, int kBK, int kKC, int kNT>
__device__ __forceinline__ void outer_tc_waves(const OuterArgs& p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  extern __shared__ float4 smem_f4[];
  char* smem_c = align_smem_1k(reinterpret_cast<char*>(smem_f4));
  const TcLayout L = tc_layout(p.H, p.Ti, p.Tj, kWgmma, kWgmma2, kBK, kKC, kNT);
  // past the tile's space (which the tiles leave alone), from a 16-byte boundary (ldmatrix's rows)
  char* wv_smem = smem_c + ((int64_t(L.total - 256) * 4 + 15) & ~int64_t(15));
  const FusedProjArgs& f = p.fp;
  const WaveArgs& wv = p.wv;
  const int N = p.N;
  stage_w_split_f16(f, reinterpret_cast<__half*>(wv_smem + kWvWOff), reinterpret_cast<int*>(wv_smem + kWvWeOff),
                    reinterpret_cast<float*>(wv_smem + kWvFacOff), reinterpret_cast<float*>(wv_smem + kWvBiasOff));
  const int tiles_i = (N + p.Ti - 1) / p.Ti, tiles_j = (N + p.Tj - 1) / p.Tj;
  const int waves_i = (tiles_i + wv.wave_r - 1) / wv.wave_r, waves_j = (tiles_j + wv.wave_c - 1) / wv.wave_c;
  const int n_chunks = (p.S + 31) >> 5;
  float* const out_f = static_cast<float*>(p.out);
  const uintptr_t out_end = reinterpret_cast<uintptr_t>(out_f + int64_t(p.B) * N * p.out_N * p.D);
  // wave w's residues, tile, part buffers and parts (as every block forms them)
  auto plan = [&](int w, WaveTile& wt, int& row_tile, int& col_tile) {
    wt.w = w;
    wt.b = w / (waves_i * waves_j);
    const int wi = (w / waves_j) % waves_i, wj = w % waves_j;
    const int ti0 = wi * wv.wave_r, tj0 = wj * wv.wave_c;
    const int nti = min(wv.wave_r, tiles_i - ti0), ntj = min(wv.wave_c, tiles_j - tj0);
    wt.i_lo = ti0 * p.Ti;
    wt.j_lo = tj0 * p.Tj;
    wt.nr = min(nti * p.Ti, N - wt.i_lo);
    wt.nc = min(ntj * p.Tj, N - wt.j_lo);
    wt.has_tile = int(blockIdx.x) < nti * ntj;
    row_tile = ti0 + int(blockIdx.x) / ntj;
    col_tile = tj0 + int(blockIdx.x) % ntj;
    // the part buffers in slots (a slot per 4 residues of a, a pair per 8 of b, each chunk),
    // whichever holds the most: the workspace; the output's rows after this band (contiguous); or
    // the band's own rows from the wave's first column on, each row's free bytes a run of whole
    // slot pairs, its output stores then waiting for every block's reads (the last band has no
    // rows after it, but its own are unwritten past the columns of its waves before)
    wt.ga = (wt.nr + 3) >> 2;
    wt.gb = (wt.nc + 7) >> 3;
    char* region = wv.ws;
    int64_t row_stride = 0;
    int slots_row = 1 << 30;
    int64_t slots = wv.ws_bytes / kWvSlotBytes;
    wt.own_rows = false;
    if (wv.use_out) {
      const uintptr_t start =
          (reinterpret_cast<uintptr_t>(out_f + (int64_t(wt.b) * N + wt.i_lo + wt.nr) * p.out_N * p.D) + 255) &
          ~uintptr_t(255);
      if (start < out_end && int64_t(out_end - start) / kWvSlotBytes > slots) {
        region = reinterpret_cast<char*>(start);
        slots = int64_t(out_end - start) / kWvSlotBytes;
      }
      const int64_t row_bytes = int64_t(p.out_N) * p.D * 4;
      if (wv.own_rows && row_bytes % 16 == 0 && row_bytes < (int64_t(1) << 31)) {
        const uintptr_t first =
            reinterpret_cast<uintptr_t>(out_f + ((int64_t(wt.b) * N + wt.i_lo) * p.out_N + wt.j_lo) * p.D);
        const uintptr_t first_16 = (first + 15) & ~uintptr_t(15);
        const int64_t free_row = int64_t(p.out_N - wt.j_lo) * p.D * 4 - int64_t(first_16 - first);
        const int per_row = int(free_row / kWvSlotBytes) & ~1;
        if (per_row >= 2 && int64_t(per_row) * wt.nr > slots) {
          region = reinterpret_cast<char*>(first_16);
          row_stride = row_bytes;
          slots_row = per_row;
          slots = int64_t(per_row) * wt.nr;
          wt.own_rows = true;
        }
      }
    }
    wt.region = region;
    wt.row_stride = row_stride;
    wt.slots_row = slots_row;
    // one buffer where it takes at most three quarters of two buffers' parts (each of its parts
    // costs one more grid barrier, which is less than a part), or where it takes all of s in one
    // part (so that the band's next wave may keep a: a barrier is less than a's projection); a
    // part of n chunks takes ((n·ga + 1) & ~1) + 2n·gb slots
    const int64_t chunk_slots = wt.ga + 2 * wt.gb;
    const int64_t half_slots = (slots / 2) & ~int64_t(1);
    auto chunks_in = [&](int64_t room) {
      int64_t n = min(int64_t(n_chunks), room / chunk_slots);
      if (((n * wt.ga + 1) & ~int64_t(1)) + 2 * n * wt.gb > room) --n;
      return int(max(int64_t(1), n));
    };
    const int per_1 = chunks_in(slots), per_2 = chunks_in(half_slots);
    const int parts_1 = (n_chunks + per_1 - 1) / per_1, parts_2 = (n_chunks + per_2 - 1) / per_2;
    wt.single = wv.bufs == 1 || (wv.bufs == 0 && (4 * parts_1 <= 3 * parts_2 || (parts_1 == 1 && !wv.fresh_a)));
    wt.half_slots = int(min(half_slots, int64_t(1) << 30));
    wt.chunks_per_part = wt.single ? per_1 : per_2;
    return wj;
  };
  const int n_waves = p.B * waves_i * waves_j;
  const char* prev_region = nullptr;
  bool prev_single = false;
  // the last wave's a, where it took all of s in one part of the region's single buffer
  bool prev_all_s = false;
  WaveCursor cur{0, 0, false};
  int& q = cur.q;
  for (int w = 0; w < n_waves; ++w) {
    WaveTile wt;
    int row_tile, col_tile;
    const int wj = plan(w, wt, row_tile, col_tile);
    wt.next_single = false;
    if (w + 1 < n_waves) {
      WaveTile next;
      int next_row, next_col;
      plan(w + 1, next, next_row, next_col);
      wt.next_single = next.single;
    }
    // a new region may overlap the last one's buffers, which slower blocks may still be reading, and
    // two buffers after one may overlap the last part's (one buffer waits at its every part)
    if (w > 0 && !wt.single && (wt.region != prev_region || prev_single)) cooperative_groups::this_grid().sync();
    // a stays where the band's wave before left it (its buffer's start, all of s): the waves
    // between write the band's rows of the output alone, and b's buffer after it waits for the
    // one buffer's barrier (the wave before in the band, wj - 1, has the same rows and, unless
    // a region lies in its own rows, the same region)
    const bool all_s = wt.single && wt.chunks_per_part >= n_chunks;
    wt.a_kept = !wv.fresh_a && all_s && prev_all_s && wj > 0 && wt.region == prev_region;
    prev_region = wt.region;
    prev_single = wt.single;
    prev_all_s = all_s;
    wave_mark(wv, kMarkWave, w, q);
    if (wt.a_kept) wave_mark(wv, kMarkKeptA, w, q);
    if (wt.own_rows) wave_mark(wv, kMarkOwnRows, w, q);
    outer_tc_tile<kTerms, kWgmma, kWgmma2, kHalfSplit, kBK, kKC, kNT, false, true>(p, wt.b, col_tile, row_tile, &wt,
                                                                                    &cur);
    wave_mark(wv, kMarkWaveEnd, w, q);
  }
#endif
}

// kWaves: the waves form (WaveArgs), one cooperative launch of one block per SM.
template <int kTerms, bool kWgmma, bool kWgmma2, bool kHalfSplit = false, int kBK = kTcBK, int kKC = kTcKC,
          int kNT = kTcNT, bool kFused = false, bool kWaves = false>
__global__ void __launch_bounds__(kTcThreads, 1) opm_outer_tc_kernel(const OuterArgs p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (kWaves) {
    outer_tc_waves<kTerms, kWgmma, kWgmma2, kHalfSplit, kBK, kKC, kNT>(p);
  } else {
    outer_tc_tile<kTerms, kWgmma, kWgmma2, kHalfSplit, kBK, kKC, kNT, kFused, false>(p, 0, 0, 0, nullptr, nullptr);
  }
#else
  target_lacks_instructions();
#endif
}

// Rounds w_blocked to TF32 in place (round to nearest, ties away, as split_tf32<1> and the
// mma.sync form do), so that phase 2 on wgmma reads it as it arrives.
__global__ void opm_round_tf32_kernel(float* __restrict__ w, int64_t n) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    w[i] = __uint_as_float(to_tf32(w[i]));
#else
  target_lacks_instructions();
#endif
}

// a or b in the kAbF32Rows32 layout (per batch, chunks of 32 s; per chunk, rows (n, h) of 32
// floats), rewritten in place for the float16 split form: each residue n's values scaled by 2^e
// (split_scale_exp of their largest magnitude over s and h, written to exp_out[b·rows_n + n]),
// each row of 32 floats becoming 32 float16 high parts and then the 32 low parts.  One block per
// residue, its warps taking every (blockDim / 32)-th chunk: a pass for the largest magnitude
// (reduced over the block), then a pass over each chunk that reads all of the chunk's rows it takes
// (four rows per step, 8 lanes per row) before it writes any: the loads of a chunk are in flight
// together, and a row is read whole before its lanes overwrite it.  (One warp per residue left
// most SMs idle for deep MSAs: 32 chunks each, a few hundred residues.)
__global__ void opm_split_rows_f16_kernel(float* __restrict__ buf, int* __restrict__ exp_out, int B, int rows_n,
                                          int H, int n_chunks) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  __shared__ float red[32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const int64_t row = blockIdx.x;  // b·rows_n + n
  const int64_t bi = row / rows_n, n = row - bi * rows_n;
  const int64_t chunk = int64_t(rows_n) * H * 32;  // floats per chunk
  float* base = buf + bi * n_chunks * chunk + n * H * 32;
  float m = 0.f;
  for (int c = warp; c < n_chunks; c += warps) {
    const float4* src = reinterpret_cast<const float4*>(base + c * chunk);
#pragma unroll 8
    for (int q = lane; q < H * 8; q += 32) {
      const float4 v = src[q];
      m = fmaxf(m, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  if (lane == 0) red[warp] = m;
  __syncthreads();  // every warp's maximum; the reads of the first pass are done before any write
  m = 0.f;
  for (int w = 0; w < warps; ++w) m = fmaxf(m, red[w]);
  const int e = split_scale_exp(m);
  if (threadIdx.x == 0) exp_out[row] = e;
  const float f = exp2_int(e);
  const int q = lane & 7;
  constexpr int kSteps = 8;  // 4·kSteps rows per batch: all of a chunk for H <= 32
  for (int c = warp; c < n_chunks; c += warps) {
    float* ch = base + c * chunk;
    for (int hb = 0; hb < H; hb += 4 * kSteps) {
      float4 v[kSteps];
#pragma unroll
      for (int t = 0; t < kSteps; ++t) {
        const int h = hb + 4 * t + (lane >> 3);
        v[t] = h < H ? reinterpret_cast<const float4*>(ch + int64_t(h) * 32)[q] : make_float4(0.f, 0.f, 0.f, 0.f);
      }
      __syncwarp();
#pragma unroll
      for (int t = 0; t < kSteps; ++t) {
        const int h = hb + 4 * t + (lane >> 3);
        if (h < H) {
          char* r = reinterpret_cast<char*>(ch + int64_t(h) * 32);
          uint2 hi, lo;
          split_f16x2(v[t].x * f, v[t].y * f, hi.x, lo.x);
          split_f16x2(v[t].z * f, v[t].w * f, hi.y, lo.y);
          *reinterpret_cast<uint2*>(r + 8 * q) = hi;
          *reinterpret_cast<uint2*>(r + 64 + 8 * q) = lo;
        }
      }
      __syncwarp();
    }
  }
#else
  target_lacks_instructions();
#endif
}

// W (D, H²) float32 as the float16 split form's phase 2 reads it: row d scaled by 2^w_exp[d]
// (split_scale_exp over the row), k in o_k_order's order, each chunk of 32 k as 32 float16 high
// parts and then the 32 low parts (128 bytes: the slots of 32 floats).  One block per row d.
__global__ void opm_split_w_f16_kernel(const float* __restrict__ w, uint32_t* __restrict__ w_split,
                                       int* __restrict__ w_exp, int H) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  __shared__ float red[32];
  const int d = blockIdx.x, tid = threadIdx.x, K2 = H * H, hb = H >> 3;
  const float* row = w + int64_t(d) * K2;
  float m = 0.f;
  for (int k = tid; k < K2; k += blockDim.x) m = fmaxf(m, fabsf(row[k]));
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  if ((tid & 31) == 0) red[tid >> 5] = m;
  __syncthreads();
  if (tid < 32) {
    m = tid < int(blockDim.x >> 5) ? red[tid] : 0.f;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    if (tid == 0) red[0] = m;
  }
  __syncthreads();
  const int e = split_scale_exp(red[0]);
  if (tid == 0) w_exp[d] = e;
  const float f = exp2_int(e);
  uint32_t* out = w_split + int64_t(d) * K2;  // 32-bit slots: a pair of halves each
  for (int idx = tid; idx < K2 / 2; idx += blockDim.x) {
    const int pos = 2 * idx, blk = pos >> 6;  // pos = o_k_order(h1, h2), h2 even
    const int h1 = (blk / hb) * 8 + ((pos >> 3) & 7), h2 = (blk % hb) * 8 + (pos & 7);
    uint32_t hi, lo;
    split_f16x2(row[h1 * H + h2] * f, row[h1 * H + h2 + 1] * f, hi, lo);
    out[(pos >> 5) * 32 + ((pos & 31) >> 1)] = hi;
    out[(pos >> 5) * 32 + 16 + ((pos & 31) >> 1)] = lo;
  }
#else
  target_lacks_instructions();
#endif
}


// The fused projection's first kernel (FusedExponentArgs): one block per residue (b, n), a row s
// per lane (the warp's 32 rows together).  LayerNorm's statistics in two passes over the row in
// registers, stored for the contraction (FusedProjArgs::row_stats, zeros past S); then a[s, n, h]
// and b[s, n, h] in float32 FMAs against W's rows read from shared memory (one address for the
// whole warp), for the largest magnitudes alone: nothing of a or b is stored.  C % 4 == 0.
__global__ void __launch_bounds__(256) opm_fused_exponents_kernel(const FusedExponentArgs p) {
  const FusedProjArgs& f = p.in;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  __shared__ float4 w_s[2 * kFpH][kFpMaxC / 4];  // [side·kFpH + h][c / 4], zeros past C
  __shared__ float ln_s[2][kFpMaxC];             // LayerNorm's weight and bias, zeros past C
  __shared__ float bias_s[2 * kFpH];
  __shared__ float red[2][8];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int64_t row = blockIdx.x;
  const int b = int(row / p.N), n = int(row - int64_t(b) * p.N);
  const int C = f.C;
  float* w_f = reinterpret_cast<float*>(w_s);
  for (int i = tid; i < 2 * kFpH * kFpMaxC; i += blockDim.x) {
    const int sh = i / kFpMaxC, c = i - sh * kFpMaxC, side = sh / kFpH, h = sh - side * kFpH;
    w_f[i] = c < C ? (side ? f.wb : f.wa)[h * C + c] : 0.f;
  }
  if (tid < 2 * kFpMaxC) {
    const int c = tid % kFpMaxC;
    ln_s[tid / kFpMaxC][c] = c < C ? (tid < kFpMaxC ? f.ln_w : f.ln_b)[c] : 0.f;
  } else if (tid < 2 * kFpMaxC + 2 * kFpH) {
    const int sh = tid - 2 * kFpMaxC, side = sh / kFpH, h = sh - side * kFpH;
    const float* bias = side ? f.bb : f.ba;
    bias_s[sh] = bias ? bias[h] : 0.f;
  }
  float2* stats = reinterpret_cast<float2*>(f.row_stats) + row * f.s_pad;
  for (int s = p.S + tid; s < f.s_pad; s += blockDim.x) stats[s] = make_float2(0.f, 0.f);
  __syncthreads();
  float ma = 0.f, mb = 0.f;
  for (int s0 = 32 * warp; s0 < p.S; s0 += 32 * 8) {
    const int s = s0 + lane;
    const bool ok = s < p.S;
    const float* xr = f.x + int64_t(b) * f.x_sb + int64_t(ok ? s : 0) * f.x_ss + int64_t(n) * f.x_sn;
    float v[kFpMaxC];
#pragma unroll
    for (int q = 0; q < kFpMaxC / 4; ++q) {
      const float4 x4 = ok && 4 * q < C ? *reinterpret_cast<const float4*>(xr + 4 * q) : make_float4(0.f, 0.f, 0.f, 0.f);
      v[4 * q] = x4.x;
      v[4 * q + 1] = x4.y;
      v[4 * q + 2] = x4.z;
      v[4 * q + 3] = x4.w;
    }
    const float m = ok ? mask_at(p.mask, b, s, n) : 0.f;
    // the mean as v[0] plus the mean difference from it, in four partial sums: rows far from zero
    // (|mean| >> std) keep the bits that x - mean then shows
    float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int c = 0; c < kFpMaxC; ++c) part[c & 3] += c < C ? v[c] - v[0] : 0.f;
    const float mean = v[0] + ((part[0] + part[1]) + (part[2] + part[3])) / C;
#pragma unroll
    for (int k = 0; k < 4; ++k) part[k] = 0.f;
#pragma unroll
    for (int c = 0; c < kFpMaxC; ++c) {
      const float d = c < C ? v[c] - mean : 0.f;
      part[c & 3] = fmaf(d, d, part[c & 3]);
    }
    const float rstd = rsqrtf(((part[0] + part[1]) + (part[2] + part[3])) / C + f.ln_eps);
    if (ok) stats[s] = make_float2(mean, rstd * exp2_int(kFpVExp));
#pragma unroll
    for (int c = 0; c < kFpMaxC; ++c) v[c] = c < C ? (v[c] - mean) * rstd * ln_s[0][c] + ln_s[1][c] : 0.f;
#pragma unroll 2
    for (int sh = 0; sh < 2 * kFpH; ++sh) {
      float acc = bias_s[sh];
#pragma unroll
      for (int q = 0; q < kFpMaxC / 4; ++q) {
        if (4 * q < C) {
          const float4 w4 = w_s[sh][q];
          acc = fmaf(v[4 * q], w4.x, acc);
          acc = fmaf(v[4 * q + 1], w4.y, acc);
          acc = fmaf(v[4 * q + 2], w4.z, acc);
          acc = fmaf(v[4 * q + 3], w4.w, acc);
        }
      }
      const float mag = fabsf(acc * m);
      if (sh < kFpH) ma = fmaxf(ma, mag);
      else mb = fmaxf(mb, mag);
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    ma = fmaxf(ma, __shfl_xor_sync(0xffffffffu, ma, off));
    mb = fmaxf(mb, __shfl_xor_sync(0xffffffffu, mb, off));
  }
  if (lane == 0) {
    red[0][warp] = ma;
    red[1][warp] = mb;
  }
  __syncthreads();
  if (tid == 0) {
    float a = 0.f, bb = 0.f;
    for (int w = 0; w < 8; ++w) {
      a = fmaxf(a, red[0][w]);
      bb = fmaxf(bb, red[1][w]);
    }
    p.a_exp[row] = split_scale_exp(a);
    p.b_exp[row] = split_scale_exp(bb);
  }
#else
  target_lacks_instructions();
#endif
}

// The waves form's scale exponents from a bound on a and b rather than from their values, so that
// x is not read twice.  With LayerNorm folded in, a[s, n, h] = m[s, n]·(v·W'_h + bias'_h), W' =
// W·diag(gamma), bias' = bias + W·beta, v = (x - mean)·rstd with ||v||² = C·var/(var + eps) <= C; so
// |a[s, n, h]| <= max_s |m[s, n]|·M with M = max_h (|bias'_h| + sqrt(C)·||W'_h||), likewise b.  The
// rounding of the values and of M lies far inside the factor of two that split_scale_exp leaves
// below float16's largest value.  One block of 32 warps per batch element and 32 residues: lane n,
// warps over s (coalesced along n); warps 0 and 1 form M for a and b, a lane per h.
__global__ void __launch_bounds__(1024) opm_bound_exponents_kernel(const FusedExponentArgs p) {
  const FusedProjArgs& f = p.in;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  static_assert(kFpH == 32, "a lane per h");
  __shared__ float red[32][33];
  __shared__ float bound[2];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int blocks_n = (p.N + 31) / 32;
  const int b = int(blockIdx.x) / blocks_n, n = (int(blockIdx.x) - b * blocks_n) * 32 + lane;
  const int C = f.C;
  if (warp < 2) {
    const float* w = (warp ? f.wb : f.wa) + int64_t(lane) * C;
    const float* bias = warp ? f.bb : f.ba;
    float ss = 0.f, bsum = bias ? bias[lane] : 0.f;
    for (int c = 0; c < C; ++c) {
      const float wg = w[c] * f.ln_w[c];
      ss = fmaf(wg, wg, ss);
      bsum = fmaf(w[c], f.ln_b[c], bsum);
    }
    float m = fabsf(bsum) + sqrtf(float(C) * ss);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    if (lane == 0) bound[warp] = m;
  }
  float mm = 0.f;
  if (n < p.N) {
    // four loads in flight per lane: the loop is latency-bound
    int s = warp;
    for (; s + 3 * 32 < p.S; s += 4 * 32) {
      float v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) v[u] = mask_at(p.mask, b, s + 32 * u, n);
#pragma unroll
      for (int u = 0; u < 4; ++u) mm = fmaxf(mm, fabsf(v[u]));
    }
    for (; s < p.S; s += 32) mm = fmaxf(mm, fabsf(mask_at(p.mask, b, s, n)));
  }
  red[warp][lane] = mm;
  __syncthreads();
  if (warp == 0 && n < p.N) {
    float m = 0.f;
    for (int w = 0; w < 32; ++w) m = fmaxf(m, red[w][lane]);
    p.a_exp[int64_t(b) * p.N + n] = split_scale_exp(m * bound[0]);
    p.b_exp[int64_t(b) * p.N + n] = split_scale_exp(m * bound[1]);
  }
#else
  target_lacks_instructions();
#endif
}

}  // namespace flashopm
