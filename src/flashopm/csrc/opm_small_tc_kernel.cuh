// Second kernel of the two-launch path for small problems (see SmallTcArgs in opm_params.h).
//
// Block (d chunk, tile of TI rows i, batch b), 16 warps:
//   prologue   W fragments of each warp's first k-steps (FMA form: W's chunk into shared memory),
//              bias, row denominators or pair counts: nothing here depends on the first kernel,
//              so it overlaps it;
//   wait       griddepcontrol.wait (the projections are complete and visible); or, launched
//              cooperatively (kFused), the block LayerNorms and projects its share of all rows
//              (b, s, n) into a and b itself and the grid synchronises (one launch; all blocks
//              resident at once);
//   load       a[b, i0 : i0 + TI] (TI·S·H) and b[b, :] (N·S·H) into shared memory, b
//              arriving while phase P runs;
//   kLocalA    (FMA form) the block LayerNorms and projects its own rows of a in the prologue and
//              runs phase P there too, before the wait: the first kernel computes b alone, and
//              after the wait only b's copy, phase O and the epilogue remain;
//   phase P    P[(h2, d), (i, s)] = sum_h1 W[d, h1·H + h2] · a[i, s, h1]      A = W (global), B = a
//              (stored as P[i][d][s][h2])
//   phase O    out[i, j, d] = sum_k b[j, k] · P[i, d, k],  k = (s, h2)          A = b, B = P
//              one GEMM with columns (i, d), K split over warps when there are too few tiles of
//              rows j and groups of columns; parts summed in a fixed order;
//   epilogue   normalisation and bias, 16-byte stores along d.
// Phases P and O come in two forms: kTerms = 3 or 1, mma.sync (3xTF32 or TF32) with W going from
// global memory into the fragments; kTerms = 0, float32 FMAs on 4 x 4 register tiles, with W's
// chunk, a, b and P transposed in shared memory (small_tc_fma_layout) so that every operand is a
// float4 read.  In the mma.sync form, fragment rows of phase P are permuted (row g holds m = 2g,
// row g + 8 holds m = 2g + 1) so that each thread's two A values per column are adjacent in W and
// load as one 8-byte word.
#pragma once

#include <cooperative_groups.h>

#include "opm_kernels.cuh"
#include "opm_mma.cuh"

namespace flashopm {

// W fragments of one k-step for four 16-row tiles of phase P: w[u][0] = (row g, col t) and
// (row g + 8, col t), w[u][1] the same at col t + 4.  Rows past the chunk's valid d are zero.
__device__ __forceinline__ void small_tc_load_w(const SmallTcArgs& p, int d0, int mt0, int ks, int g, int t,
                                                float2 (&w)[4][2]) {
  const int H = p.H;
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const int m = (mt0 + u) * 16 + 2 * g;
    const int dl = m / H, h2 = m - dl * H;
    const int d = d0 + dl;
    if (d < p.D) {
      const float* src = p.w_out + int64_t(d) * H * H + (ks * 8 + t) * H + h2;
      w[u][0] = __ldg(reinterpret_cast<const float2*>(src));
      w[u][1] = __ldg(reinterpret_cast<const float2*>(src + 4 * H));
    } else {
      w[u][0] = w[u][1] = make_float2(0.f, 0.f);
    }
  }
}

// acc[u][v] = sum over k in [k0, k1), in order, of x_k[u]·y_k[v], where x_k is the kU floats at
// x + k·x_ld and y_k the float4 at y + k·y_ld (shared memory, float4 reads): one kU x 4 register
// tile of the FMA form.
template <int kU>
__device__ __forceinline__ void fma_outer_tile(float (&acc)[kU][4], const float* x, int x_ld, const float* y, int y_ld,
                                               int k0, int k1) {
  static_assert(kU % 4 == 0, "rows of the tile come in float4");
  constexpr int kUnroll = kU == 4 ? 4 : 2;  // 8-row tiles: fewer loads in flight, within 128 registers
#pragma unroll
  for (int u = 0; u < kU; ++u)
#pragma unroll
    for (int v = 0; v < 4; ++v) acc[u][v] = 0.f;
#pragma unroll kUnroll
  for (int k = k0; k < k1; ++k) {
    float xv[kU];
#pragma unroll
    for (int g = 0; g < kU / 4; ++g) {
      const float4 x4 = *reinterpret_cast<const float4*>(x + k * x_ld + 4 * g);
      xv[4 * g] = x4.x, xv[4 * g + 1] = x4.y, xv[4 * g + 2] = x4.z, xv[4 * g + 3] = x4.w;
    }
    const float4 y4 = *reinterpret_cast<const float4*>(y + k * y_ld);
    const float yv[4] = {y4.x, y4.y, y4.z, y4.w};
#pragma unroll
    for (int u = 0; u < kU; ++u)
#pragma unroll
      for (int v = 0; v < 4; ++v) acc[u][v] = fmaf(xv[u], yv[v], acc[u][v]);
  }
}

template <int kTerms>
__device__ __forceinline__ void split4(const float (&v)[4], uint32_t (&hi)[4], uint32_t (&lo)[4]) {
#pragma unroll
  for (int e = 0; e < 4; ++e) split_tf32<kTerms>(v[e], hi[e], lo[e]);
}

// sum_c x[c]·w[c·w_ld] in chunks of kPrepKC features, each chunk's products added in order, then
// the chunks' sums in order: opm_prep_kernel's order (accurate at large msa_dim).
__device__ __forceinline__ float chunked_dot(const float* x, const float* w, int w_ld, int C) {
  float acc = 0.f;
  for (int c0 = 0; c0 < C; c0 += kPrepKC) {
    const int ce = min(C, c0 + kPrepKC);
    float part = 0.f;
#pragma unroll 8
    for (int c = c0; c < ce; ++c) part = fmaf(x[c], w[c * w_ld], part);
    acc += part;
  }
  return acc;
}

// The fused form's projection weights, transposed into shared memory as wt[c][o] (o < H: W_a,
// else W_b; row stride 2H + 1, so that lanes along o read distinct banks), with 4-byte
// asynchronous copies along c (coalesced reads of W's rows); issued first so that their latency
// overlaps the prologue and the LayerNorm statistics.
__device__ __forceinline__ void small_tc_stage_proj_weights(const PrepArgs& q, float* wt) {
  const int C = q.C, H = q.H, ld = 2 * H + 1;
  for (int idx = threadIdx.x; idx < 2 * H * C; idx += kSmallTcThreads) {
    const int o = idx / C, c = idx - o * C;
    const float* src = o < H ? q.wa + int64_t(o) * C + c : q.wb + int64_t(o - H) * C + c;
    cp_async4(&wt[c * ld + o], src, true);
  }
  cp_async_commit();
}

// LayerNorm, projections and mask of rows [r_begin, r_end) of (b, s, n), r = (b·S + s)·N + n,
// into a and b as (B, N, S, H), in passes of one row per warp: the normalised rows go to xn
// ([kSmallTcWarps][C] floats), then one thread per output (row, h of a or b) takes its dot
// product with wt (staged by small_tc_stage_proj_weights).  The sums are those of
// opm_prep_kernel (chunks of 32 features, in order).
__device__ __forceinline__ void small_tc_project_rows(const PrepArgs& q, float* a_out, float* b_out, int64_t r_begin,
                                                      int64_t r_end, const float* wt, float* xn) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int S = q.S, N = q.N, C = q.C, H = q.H, H2 = 2 * q.H, ld = 2 * q.H + 1;
  const float* x = static_cast<const float*>(q.x);
  for (int64_t r0 = r_begin; r0 < r_end; r0 += kSmallTcWarps) {
    const int nr = int(min(int64_t(kSmallTcWarps), r_end - r0));
    if (warp < nr) {
      const int64_t r = r0 + warp, bs = r / N;
      const int n = int(r - bs * N), s = int(bs % S), bi = int(bs / S);
      const float* xr = x + int64_t(bi) * q.x_sb + int64_t(s) * q.x_ss + int64_t(n) * q.x_sn;
      float mean, rstd;
      warp_layernorm_stats([&](int c) { return xr[c]; }, C, q.ln_eps, lane, mean, rstd);
      for (int c = lane; c < C; c += 32) xn[warp * C + c] = (xr[c] - mean) * rstd * q.ln_w[c] + q.ln_b[c];
    }
    cp_async_wait_all();
    __syncthreads();
    for (int idx = tid; idx < nr * H2; idx += kSmallTcThreads) {
      const int rl = idx / H2, o = idx - rl * H2;
      const bool is_a = o < H;
      const int h = is_a ? o : o - H;
      const float acc = chunked_dot(xn + rl * C, wt + o, ld, C);
      const int64_t r = r0 + rl, bs = r / N;
      const int n = int(r - bs * N), s = int(bs % S), bi = int(bs / S);
      const float* bias = is_a ? q.ba : q.bb;
      const float v = (acc + (bias ? bias[h] : 0.f)) * mask_at(q.mask, bi, s, n);
      (is_a ? a_out : b_out)[((int64_t(bi) * N + n) * S + s) * H + h] = v;
    }
    __syncthreads();
  }
}

// The local-a form's inputs to its projections, in shared memory (the regions of b, P and the K
// parts, not used before phase P; small_tc_local_a_layout): W_a as wa[h][c], the block's rows of x
// (b, s, i0 + il) as xs[il·S + s][c], LayerNorm's weight and bias, and b_a (zeros if none), in one
// group of asynchronous copies, 16-byte ones where msa_dim and the addresses allow (A.vec).
// Columns from msa_dim to the next multiple of 4 are zero in wa, so that the projection's float4
// loop may run over them (xs's are zeroed by the LayerNorm pass).
__device__ __forceinline__ void small_tc_stage_a_inputs(const SmallTcArgs& p, int b, int i0, int ti,
                                                        const SmallTcLocalA& A, float* smem) {
  const PrepArgs& q = p.prep;
  const int C = q.C, C4 = round_up4(C), H = q.H, S = q.S, tid = threadIdx.x, rows = ti * S;
  float* wa = smem + A.wa;
  float* xs = smem + A.xs;
  const float* x = static_cast<const float*>(q.x) + int64_t(b) * q.x_sb + int64_t(i0) * q.x_sn;
  if (A.vec) {
    const int q_row = C / 4;
    for (int idx = tid; idx < H * q_row; idx += kSmallTcThreads) {
      const int h = idx / q_row, c = 4 * (idx - h * q_row);
      cp_async16(&wa[h * A.ldwa + c], q.wa + int64_t(h) * C + c);
    }
    for (int idx = tid; idx < rows * q_row; idx += kSmallTcThreads) {
      const int r = idx / q_row, c = 4 * (idx - r * q_row), il = r / S, s = r - il * S;
      cp_async16(&xs[r * A.ldx + c], x + int64_t(s) * q.x_ss + int64_t(il) * q.x_sn + c);
    }
    for (int idx = tid; idx < 2 * q_row; idx += kSmallTcThreads) {
      const int c = 4 * (idx < q_row ? idx : idx - q_row);
      if (idx < q_row) cp_async16(smem + A.lnw + c, q.ln_w + c);
      else cp_async16(smem + A.lnb + c, q.ln_b + c);
    }
  } else {
    for (int idx = tid; idx < H * C4; idx += kSmallTcThreads) {
      const int h = idx / C4, c = idx - h * C4;
      if (c < C) cp_async4(&wa[h * A.ldwa + c], q.wa + int64_t(h) * C + c, true);
      else wa[h * A.ldwa + c] = 0.f;
    }
    for (int idx = tid; idx < rows * C; idx += kSmallTcThreads) {
      const int r = idx / C, c = idx - r * C, il = r / S, s = r - il * S;
      cp_async4(&xs[r * A.ldx + c], x + int64_t(s) * q.x_ss + int64_t(il) * q.x_sn + c, true);
    }
    for (int c = tid; c < C; c += kSmallTcThreads) {
      cp_async4(smem + A.lnw + c, q.ln_w + c, true);
      cp_async4(smem + A.lnb + c, q.ln_b + c, true);
    }
  }
  for (int h = tid; h < H; h += kSmallTcThreads) {
    if (q.ba != nullptr) cp_async4(smem + A.ba + h, q.ba + h, true);
    else smem[A.ba + h] = 0.f;
  }
  cp_async_commit();
}

// W's chunk transposed into shared memory, ws[k][dl] (rows d past D zero), through registers in
// batches of kSmallTcWBatch float4 per thread (16-byte global loads rather than 4-byte
// asynchronous copies, which cost the local-a form its head start: run 113).  The first batch is
// loaded by small_tc_w_chunk_load at the kernel's start, so that its latency overlaps the other
// loads; small_tc_w_chunk_store stores it and loads and stores the rest.  Lanes run along dl
// first: the transposing stores meet at most 2-way bank conflicts (ldw = 4 mod 8).  Needs
// H·H % 4 == 0 and W 16-byte aligned (small_tc_local_a).
constexpr int kSmallTcWBatch = 4;
__device__ __forceinline__ void small_tc_w_chunk_load(const SmallTcArgs& p, int d0, int Dc, int base,
                                                      float4 (&v)[kSmallTcWBatch]) {
  const int HH = p.H * p.H, items = Dc * (HH / 4);
#pragma unroll
  for (int u = 0; u < kSmallTcWBatch; ++u) {
    const int idx = base + u * kSmallTcThreads, dl = idx % Dc;
    v[u] = idx < items && d0 + dl < p.D
               ? __ldg(reinterpret_cast<const float4*>(p.w_out + int64_t(d0 + dl) * HH) + idx / Dc)
               : make_float4(0.f, 0.f, 0.f, 0.f);
  }
}
__device__ __forceinline__ void small_tc_w_chunk_store(const SmallTcArgs& p, int d0, int Dc, int ldw, float* ws,
                                                       float4 (&v)[kSmallTcWBatch]) {
  const int items = Dc * (p.H * p.H / 4);
  for (int base = threadIdx.x;; ) {
#pragma unroll
    for (int u = 0; u < kSmallTcWBatch; ++u) {
      const int idx = base + u * kSmallTcThreads;
      if (idx < items) {
        const int dl = idx % Dc, k = 4 * (idx / Dc);
        ws[k * ldw + dl] = v[u].x;
        ws[(k + 1) * ldw + dl] = v[u].y;
        ws[(k + 2) * ldw + dl] = v[u].z;
        ws[(k + 3) * ldw + dl] = v[u].w;
      }
    }
    base += kSmallTcWBatch * kSmallTcThreads;
    if (base >= items) break;
    small_tc_w_chunk_load(p, d0, Dc, base, v);
  }
}

// LayerNorm, projection and mask of the staged rows (small_tc_stage_a_inputs' copy group, the only
// one in flight; the rows' mask values in A.mask) into the FMA form's transposed a:
// as[h][il·S + s].  One warp per row normalises it in place (the padding columns set to zero),
// then each thread takes one h for two rows, float4 reads of wa (rows 4 mod 8 floats apart:
// conflict-free) and of x (one row per warp: broadcast).  Nothing here reads global memory.  The
// sums are those of opm_prep_kernel (lane-strided statistics; chunks of kPrepKC features, each in
// order, then the chunks in order).
__device__ __forceinline__ void small_tc_project_a(const SmallTcArgs& p, int ti, float* as, int lda,
                                                   const SmallTcLocalA& A, float* smem) {
  const PrepArgs& q = p.prep;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int S = q.S, C = q.C, C4 = round_up4(C), H = q.H, rows = ti * S;
  float* xs = smem + A.xs;
  const float* mk = smem + A.mask;
  const float* lnw = smem + A.lnw;
  const float* lnb = smem + A.lnb;
  cp_async_wait_all();
  __syncthreads();
  for (int r = warp; r < rows; r += kSmallTcWarps) {
    float* xr = xs + r * A.ldx;
    float mean, rstd;
    warp_layernorm_stats([&](int c) { return xr[c]; }, C, q.ln_eps, lane, mean, rstd);
    for (int c = lane; c < C4; c += 32) xr[c] = c < C ? (xr[c] - mean) * rstd * lnw[c] + lnb[c] : 0.f;
  }
  __syncthreads();
  const float* wa = smem + A.wa;
  const int pairs = (rows + 1) / 2;
  for (int idx = tid; idx < pairs * H; idx += kSmallTcThreads) {
    const int rp = idx / H, h = idx - rp * H, r0 = 2 * rp, r1 = min(r0 + 1, rows - 1);
    const float* w = wa + h * A.ldwa;
    const float* x0 = xs + r0 * A.ldx;
    const float* x1 = xs + r1 * A.ldx;
    float acc0 = 0.f, acc1 = 0.f;
    for (int c0 = 0; c0 < C4; c0 += kPrepKC) {
      const int ce = min(C4, c0 + kPrepKC);
      float part0 = 0.f, part1 = 0.f;
#pragma unroll 4
      for (int c = c0; c < ce; c += 4) {
        const float4 wv = *reinterpret_cast<const float4*>(w + c);
        const float4 xa = *reinterpret_cast<const float4*>(x0 + c);
        const float4 xb = *reinterpret_cast<const float4*>(x1 + c);
        part0 = fmaf(xa.x, wv.x, part0), part1 = fmaf(xb.x, wv.x, part1);
        part0 = fmaf(xa.y, wv.y, part0), part1 = fmaf(xb.y, wv.y, part1);
        part0 = fmaf(xa.z, wv.z, part0), part1 = fmaf(xb.z, wv.z, part1);
        part0 = fmaf(xa.w, wv.w, part0), part1 = fmaf(xb.w, wv.w, part1);
      }
      acc0 += part0, acc1 += part1;
    }
    const float bias = smem[A.ba + h];
    as[h * lda + r0] = (acc0 + bias) * mk[r0];
    if (r0 + 1 < rows) as[h * lda + r0 + 1] = (acc1 + bias) * mk[r0 + 1];
  }
}

// The epilogue's inputs, independent of the first kernel: the chunk's bias (zeros past D), and the
// block's row denominators (kNormRow) or pair counts sum_s m[s, i] m[s, j] ([ti][N16], in order of s).
// kReciprocal: den_s holds 1 / den, the factor the epilogue multiplies by (the same bits as its
// taking the reciprocal there).  Warps from kFirstWarp on do the work, so that warps with
// something longer to do first (the one-launch form's projections) stay off it.
template <bool kReciprocal = false, int kFirstWarp = 0>
__device__ __forceinline__ void small_tc_stage_norm(const SmallTcArgs& p, int b, int i0, int d0, int ti, int N16,
                                                    float* bias_s, float* den_s, float* pair_s) {
  constexpr int kThreads = kSmallTcThreads - 32 * kFirstWarp;
  const int tid = int(threadIdx.x) - 32 * kFirstWarp, warp = tid >> 5, lane = threadIdx.x & 31;
  if (kFirstWarp > 0 && tid < 0) return;
  const int S = p.S, N = p.N;
  for (int dl = tid; dl < p.Dc; dl += kThreads)
    bias_s[dl] = (p.bias != nullptr && d0 + dl < p.D) ? p.bias[d0 + dl] : 0.f;
  const auto row_denominator = [&](int il) {
    const float den = mask_denominator(p.mask, b, i0 + il, S, lane);
    if (lane == 0) den_s[il] = kReciprocal ? 1.f / den : den;
  };
  if (p.norm.kind == kNormRow) {
    if constexpr (kFirstWarp == 0) {
      if (warp < ti) row_denominator(warp);  // ti <= kSmallTcWarps
    } else {
      for (int il = warp; il < ti; il += kThreads / 32) row_denominator(il);
    }
  } else {
    for (int idx = tid; idx < ti * N16; idx += kThreads) {
      const int il = idx / N16, j = idx - il * N16;
      float sum = 0.f;  // sum_s m[s, i] m[s, j], in order of s
      if (j < N)
        for (int s = 0; s < S; ++s) sum += mask_at(p.mask, b, s, i0 + il) * mask_at(p.mask, b, s, j);
      pair_s[idx] = sum;
    }
  }
}

// Epilogue: out[b, i0 + il, j, d0 + dl] = normalise(sum over the K parts, in order, of
// red[kp][j][il·Dc + dl]), kOut consecutive columns d per thread item, in vector stores where D
// allows.  kOut = 4: the parts read one after another; kOut = 2: twice the items (every thread of
// the block busy at the spec shape), each item's parts read at once before they are added (the
// same sums in the same order).  kScaled: the sums carry a factor 2^(e_b[j] + e_a[il] + e_common)
// (the float16 split form's scales), taken out exactly first.
template <bool kScaled, int kOut = 4>
__device__ __forceinline__ void small_tc_store_out(const SmallTcArgs& p, const float* red, int ldr, int N16,
                                                   int kparts, const float* bias_s, const float* den_s,
                                                   const float* pair_s, int b, int i0, int d0, int ti,
                                                   const int* e_a = nullptr, const int* e_b = nullptr,
                                                   int e_common = 0) {
  static_assert(kOut == 4 || kOut == 2, "the epilogue stores 4 or 2 columns per item");
  const int N = p.N, Dc = p.Dc;
  const int dvalid = min(Dc, p.D - d0);
  const int lg_items = (kOut == 4 ? 29 : 30) - __clz(Dc);  // Dc / kOut = 2^lg_items
  const bool vec_out = (p.D % kOut) == 0;
  const SmallDiv div_n(N);
  for (int idx = threadIdx.x; idx < (ti * N) << lg_items; idx += kSmallTcThreads) {
    const int row = idx >> lg_items, dl = kOut * (idx - (row << lg_items));  // row = il·N + j
    if (dl >= dvalid) continue;
    const int il = div_n(row), j = row - il * N;
    const float* src = red + j * ldr + il * Dc + dl;
    float r[kOut];
    if constexpr (kOut == 4) {
      float4 v = *reinterpret_cast<const float4*>(src);
      for (int kp = 1; kp < kparts; ++kp) {
        const float4 w = *reinterpret_cast<const float4*>(src + kp * N16 * ldr);
        v.x += w.x, v.y += w.y, v.z += w.z, v.w += w.w;
      }
      r[0] = v.x, r[1] = v.y, r[2] = v.z, r[3] = v.w;
    } else {
      float2 part[kSmallTcWarps];
#pragma unroll
      for (int kp = 0; kp < kSmallTcWarps; ++kp)
        if (kp < kparts) part[kp] = *reinterpret_cast<const float2*>(src + kp * N16 * ldr);
      r[0] = part[0].x, r[1] = part[0].y;
#pragma unroll
      for (int kp = 1; kp < kSmallTcWarps; ++kp)
        if (kp < kparts) r[0] += part[kp].x, r[1] += part[kp].y;
    }
    if constexpr (kScaled) {
      // 2^-e as one factor where it is a normal float (the same rounding as scalbnf)
      const int e = e_b[j] + e_a[il] + e_common;
      if (e >= -126 && e <= 126) {
        const float factor = exp2_int(-e);
#pragma unroll
        for (int c = 0; c < kOut; ++c) r[c] *= factor;
      } else {
#pragma unroll
        for (int c = 0; c < kOut; ++c) r[c] = scalbnf(r[c], -e);
      }
    }
    if (p.norm.kind == kNormRow) {
      const float inv_den = 1.f / den_s[il];
#pragma unroll
      for (int c = 0; c < kOut; ++c) r[c] = r[c] * inv_den + bias_s[dl + c];
    } else {
      const float pair = pair_s[il * N16 + j];
#pragma unroll
      for (int c = 0; c < kOut; ++c) r[c] = normalise(r[c], bias_s[dl + c], 0.f, pair, p.norm);
    }
    const int64_t dst = ((int64_t(b) * N + i0 + il) * N + j) * p.D + d0 + dl;
    if (vec_out && dl + kOut <= dvalid) {
      if constexpr (kOut == 4) store_out4(p.out, dst, r, p.out_kind);
      else store_out2(p.out, dst, r[0], r[1], p.out_kind);
    } else {
      for (int c = 0; c < kOut && dl + c < dvalid; ++c) store_out(p.out, dst + c, r[c], p.out_kind);
    }
  }
}

template <int kTerms, bool kFused, bool kLocalA>
__global__ void __launch_bounds__(kSmallTcThreads, 1) opm_small_tc_kernel(const SmallTcArgs p) {
  static_assert(!kLocalA || (kTerms == 0 && !kFused), "the local-a form is a form of the two-launch FMA kernel");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // The next kernel on the stream may become resident now if it was launched as our programmatic
  // dependent (the next call's projections; p.trigger_next): it waits for our end before it reads
  // anything.
  if (p.trigger_next != 0) asm volatile("griddepcontrol.launch_dependents;\n" ::);
  extern __shared__ float4 smem_f4[];
  float* smem = reinterpret_cast<float*>(smem_f4);
  const int S = p.S, N = p.N, H = p.H, TI = p.TI, Dc = p.Dc;
  constexpr bool kFma = kTerms == 0;
  const SmallTcLayout L = kFma ? small_tc_fma_layout(S, N, H, TI, Dc) : small_tc_layout(S, N, H, TI, Dc);
  const int SH = S * H;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int d0 = blockIdx.x * Dc, i0 = blockIdx.y * TI, b = blockIdx.z;
  const int ti = min(TI, N - i0);  // rows i of this block
  // mma.sync form (the FMA form's layout: small_tc_fma_layout)
  float* as = smem + L.a;      // [R8][lda]        a[b, i0 + r / S, r % S, h1], rows past ti·S zero
  float* bs = smem + L.b;      // [N16][ldb]       b[b, j, s·H + h2], rows j >= N zero
  float* ps = smem + L.p;      // [TI·Dc][ldp]     P[i][d][s·ldps + h2]
  float* red = smem + L.red;   // [kparts][N16][ldr]
  float* pair_s = smem + L.pair;  // [TI][N16]
  float* bias_s = smem + L.bias;
  float* den_s = smem + L.den;

  // ---- prologue: independent of the first kernel ----
  // The fused form's scratch, in P and the K parts (not used before phase P): wt, then xn.
  float* proj_wt = ps;
  float* proj_xn = ps + small_tc_proj_wt_floats(p.prep.C, H);
  if constexpr (kFused) small_tc_stage_proj_weights(p.prep, proj_wt);
  const int groups_p = Dc * H / 64;  // four 16-row tiles of phase P per item
  const int items_p = groups_p * (L.R8 / 8);
  const int ksteps_p = H / 8;
  // W fragments of up to kSmallTcKBatch k-steps in flight at once (the first batch of a warp's
  // first item before the wait): phase P is otherwise bound by the latency of these loads.
  float2 wf[kSmallTcKBatch][4][2];
  auto load_w_batch = [&](int mt0, int ks0) {
#pragma unroll
    for (int kb = 0; kb < kSmallTcKBatch; ++kb)
      if (ks0 + kb < ksteps_p) small_tc_load_w(p, d0, mt0, ks0 + kb, g, t, wf[kb]);
  };
  // The local-a form has everything before phase P to do before the first kernel ends: every
  // independent global load goes out first (W's first batch, the copies of the projections'
  // inputs, the rows' mask values), and only then is anything stored.
  const SmallTcLocalA local_a = small_tc_local_a_layout(L, p.prep.C, H, TI * S, p.local_a_vec);
  float4 w_first[kSmallTcWBatch];
  float mask_row = 0.f;  // the mask value of row tid (TI·S <= kSmallTcThreads: small_tc_local_a)
  if constexpr (kLocalA) {
    small_tc_w_chunk_load(p, d0, Dc, tid, w_first);
    small_tc_stage_a_inputs(p, b, i0, ti, local_a, smem);
    if (tid < ti * S) mask_row = mask_at(p.mask, b, tid % S, i0 + tid / S);
  } else if constexpr (kFma) {
    // W's chunk transposed into shared memory, w[k][d] (rows d past D zero), one copy group.
    float* ws = smem + L.w;
    const int HH = H * H;
    for (int dl = 0; dl < Dc; ++dl) {
      const bool ok = d0 + dl < p.D;
      const float* src = p.w_out + (ok ? int64_t(d0 + dl) * HH : 0);
      for (int k = tid; k < HH; k += kSmallTcThreads) cp_async4(&ws[k * L.ldw + dl], src + k, ok);
    }
    cp_async_commit();
  } else {
    if (warp < items_p) load_w_batch((warp % groups_p) * 4, 0);
  }
  small_tc_stage_norm(p, b, i0, d0, ti, L.N16, bias_s, den_s, pair_s);
  if constexpr (kLocalA) {
    small_tc_w_chunk_store(p, d0, Dc, L.ldw, smem + L.w, w_first);
    if (tid < ti * S) smem[local_a.mask + tid] = mask_row;
  }
  if constexpr (!kFma) {
    // Zero padding rows (never written by the copies below).
    for (int idx = tid; idx < (L.R8 - ti * S) * L.lda; idx += kSmallTcThreads) as[ti * S * L.lda + idx] = 0.f;
    for (int idx = tid; idx < (L.N16 - N) * L.ldb; idx += kSmallTcThreads) bs[N * L.ldb + idx] = 0.f;
  }

  // ---- phase P (before the wait in the local-a form) ----
  const auto phase_p = [&]() {
    if constexpr (kFma) {
      // Thread tile: 4 columns d x 4 columns (i, s) at one h2, over h1 in order.  Lanes along the
      // groups of (i, s) first, then h2: a warp's reads of a are consecutive float4 (one
      // wavefront for up to 8 groups) and those of W's chunk a few rows h2 (ldw = 4 mod 8: one
      // wavefront for up to 8 rows), rather than 32 rows of W (four wavefronts) per 16 FMAs.
      const float* ws = smem + L.w;
      const int dgroups = Dc / 4, ngroups = round_up4(TI * S) / 4;
      for (int tile = tid; tile < H * dgroups * ngroups; tile += kSmallTcThreads) {
        const int ng = tile % ngroups, rest = tile / ngroups;
        const int h2 = rest % H, dg = rest / H;
        float acc[4][4];  // [(i, s)][d]
        fma_outer_tile<4>(acc, as + ng * 4, L.lda, ws + h2 * L.ldw + dg * 4, H * L.ldw, 0, H);
        // Columns n = ng·4 + v are (il, s) = divmod(n, S): one division per tile, then steps.
        const int n0 = ng * 4;
        int il = n0 / S, s = n0 - il * S;
#pragma unroll
        for (int v = 0; v < 4; ++v) {
          if (n0 + v < ti * S)
            st_shared_v4(ps + (s * H + h2) * L.ldp + il * Dc + dg * 4, acc[v][0], acc[v][1], acc[v][2], acc[v][3]);
          if (++s == S) s = 0, ++il;
        }
      }
    } else {
      for (int item = warp; item < items_p; item += kSmallTcWarps) {
        const int nt = item / groups_p, mt0 = (item - nt * groups_p) * 4;
        float acc[4][4];
#pragma unroll
        for (int u = 0; u < 4; ++u)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[u][e] = 0.f;
        if (item != warp) load_w_batch(mt0, 0);
        for (int ks0 = 0; ks0 < ksteps_p; ks0 += kSmallTcKBatch) {
          if (ks0 > 0) load_w_batch(mt0, ks0);
#pragma unroll
          for (int kb = 0; kb < kSmallTcKBatch; ++kb) {
            const int ks = ks0 + kb;
            if (ks >= ksteps_p) break;
            const float* arow = as + (nt * 8 + g) * L.lda + ks * 8 + t;
            uint32_t bh0, bh1, bl0, bl1;
            split_tf32<kTerms>(arow[0], bh0, bl0);
            split_tf32<kTerms>(arow[4], bh1, bl1);
#pragma unroll
            for (int u = 0; u < 4; ++u) {
              const float av[4] = {wf[kb][u][0].x, wf[kb][u][0].y, wf[kb][u][1].x, wf[kb][u][1].y};
              uint32_t ah[4], al[4];
              split4<kTerms>(av, ah, al);
              mma_split_add<kTerms>(acc[u], ah, al, bh0, bh1, bl0, bl1);
            }
          }
        }
        // acc[u] = C[(row g | g + 8), (col 2t | 2t + 1)]: rows m = 2g, 2g + 1 (same d), cols r = (i, s).
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int m = (mt0 + u) * 16 + 2 * g;
          const int dl = m / H, h2 = m - dl * H;
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int r = nt * 8 + 2 * t + c;
            if (r < ti * S) {
              const int il = r / S, s = r - il * S;
              *reinterpret_cast<float2*>(ps + (il * Dc + dl) * L.ldp + s * L.ldps + h2) =
                  make_float2(acc[u][c], acc[u][2 + c]);
            }
          }
        }
      }
    }
  };

  if constexpr (kLocalA) {
    small_tc_project_a(p, ti, as, L.lda, local_a, smem);
    __syncthreads();
    phase_p();
  }

  if constexpr (kFused) {
    // ps and red are not used before phase P: the normalised rows pass through them.
    const int64_t rows = int64_t(p.B) * S * N;
    const int64_t blocks = int64_t(gridDim.x) * gridDim.y * gridDim.z;
    const int64_t id = (int64_t(blockIdx.z) * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    small_tc_project_rows(p.prep, p.a, p.b, rows * id / blocks, rows * (id + 1) / blocks, proj_wt, proj_xn);
    cooperative_groups::this_grid().sync();  // a and b complete and visible to every block
  } else {
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
  }

  // ---- a[b, i0 : i0 + ti] and b[b, :] into shared memory (rows of H and S·H floats); phase P
  // needs only a, so b is waited for after it ----
  if constexpr (kFma && !kFused) {
    // The first kernel's kAbF32HStride layouts, rows in 16-byte pieces: a[b] as (H, NS4) (the
    // block's columns (i, s) are contiguous in each row; 4-byte pieces where TI·S leaves their
    // start unaligned), b[b] as (S·H, N4).  Columns past ti·S and N, read along with the last
    // pieces, only reach P's and the output's columns that are never stored.
    if constexpr (!kLocalA) {
      const int cols = ti * S, NS4 = round_up4(N * S);
      const float* a_src = p.a + int64_t(b) * H * NS4 + int64_t(i0) * S;
      if ((TI * S) % 4 == 0) {
        const int q_row = (cols + 3) / 4;
        for (int idx = tid; idx < H * q_row; idx += kSmallTcThreads) {
          const int h = idx / q_row, c = 4 * (idx - h * q_row);
          cp_async16(&as[h * L.lda + c], a_src + int64_t(h) * NS4 + c);
        }
      } else {
        for (int idx = tid; idx < H * cols; idx += kSmallTcThreads) {
          const int h = idx / cols, c = idx - h * cols;
          cp_async4(&as[h * L.lda + c], a_src + int64_t(h) * NS4 + c, true);
        }
      }
      cp_async_commit();
    }
    const int N4 = round_up4(N), q_row = N4 / 4;
    const float* b_src = p.b + int64_t(b) * SH * N4;
    for (int idx = tid; idx < SH * q_row; idx += kSmallTcThreads) {
      const int k = idx / q_row, j = 4 * (idx - k * q_row);
      cp_async16(&bs[k * L.ldb + j], b_src + int64_t(k) * N4 + j);
    }
    cp_async_commit();
    if constexpr (!kLocalA) {
      cp_async_wait<1>();
      __syncthreads();
    }
  } else if constexpr (kFma) {
    // (fused: a and b as (B, N, S, H)) Transposed: a[h1][(i, s)], b[(s, h2)][j].  Columns past
    // ti·S and N are left as they are: they only reach P's and the output's columns that are
    // never stored.
    const float* a_src = p.a + (int64_t(b) * N + i0) * SH;
    for (int idx = tid; idx < ti * SH; idx += kSmallTcThreads) {
      const int r = idx / H, h = idx - r * H;
      cp_async4(&as[h * L.lda + r], a_src + idx, true);
    }
    cp_async_commit();
    const float* b_src = p.b + int64_t(b) * N * SH;
    for (int idx = tid; idx < N * SH; idx += kSmallTcThreads) {
      const int j = idx / SH, k = idx - j * SH;
      cp_async4(&bs[k * L.ldb + j], b_src + idx, true);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
  } else {
    const int h4 = H / 4, q_row = SH / 4;
    const float* a_src = p.a + (int64_t(b) * N + i0) * SH;
    for (int idx = tid; idx < ti * S * h4; idx += kSmallTcThreads) {
      const int r = idx / h4, h = 4 * (idx - r * h4);
      cp_async16(&as[r * L.lda + h], a_src + int64_t(r) * H + h);
    }
    cp_async_commit();
    const float* b_src = p.b + int64_t(b) * N * SH;
    for (int idx = tid; idx < N * q_row; idx += kSmallTcThreads) {
      const int j = idx / q_row, k = 4 * (idx - j * q_row);
      cp_async16(&bs[j * L.ldb + k], b_src + int64_t(j) * SH + k);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
  }

  if constexpr (!kLocalA) phase_p();
  cp_async_wait_all();
  __syncthreads();

  if constexpr (kFma) {
    // ---- phase O, FMA form: thread tile kR rows j x 4 columns (i, d), K split in kparts (rows j
    // past N, read up to the tile's end, land in rows of the K parts that are not stored) ----
    constexpr int kR = kSmallFmaRowsO;
    const int cols_o = ti * Dc, cgroups = TI * Dc / 4, jgroups = (N + kR - 1) / kR;
    for (int item = tid; item < cgroups * jgroups * L.kparts; item += kSmallTcThreads) {
      const int cg = item % cgroups, rest = item / cgroups;
      const int jg = rest % jgroups, kp = rest / jgroups;
      if (cg * 4 >= cols_o) continue;
      const int k0 = SH * kp / L.kparts, k1 = SH * (kp + 1) / L.kparts;
      float acc[kR][4];  // [j][(i, d)]
      fma_outer_tile<kR>(acc, bs + jg * kR, L.ldb, ps + cg * 4, L.ldp, k0, k1);
      float* r0 = red + (kp * L.N16 + jg * kR) * L.ldr + cg * 4;
#pragma unroll
      for (int u = 0; u < kR; ++u)
        st_shared_v4(r0 + u * L.ldr, acc[u][0], acc[u][1], acc[u][2], acc[u][3]);
    }
  } else {
    // ---- phase O: one GEMM per block, its columns c = il·Dc + dl (P's rows), so that every A
    // fragment of b serves up to kSmallTcMaxDc columns whatever the split between TI and Dc ----
    const int mtiles_o = L.N16 / 16, ksteps_o = SH / 8;
    const int cols_o = ti * Dc;  // columns of rows i past N are not formed
    const int groups_o = small_tc_col_groups(TI, Dc);
    for (int item = warp; item < groups_o * mtiles_o * L.kparts; item += kSmallTcWarps) {
      const int kp = item / (groups_o * mtiles_o), rest = item - kp * groups_o * mtiles_o;
      const int cg = rest / mtiles_o, mt = rest - cg * mtiles_o;
      const int c0 = cg * kSmallTcMaxDc;
      if (c0 >= cols_o) continue;
      const int ntiles_o = min(kSmallTcMaxDc, cols_o - c0) / 8;
      const int k0 = ksteps_o * kp / L.kparts, k1 = ksteps_o * (kp + 1) / L.kparts;
      float acc[kSmallTcMaxDc / 8][4];
#pragma unroll
      for (int n = 0; n < kSmallTcMaxDc / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;
      const float* brow = bs + (mt * 16 + g) * L.ldb + t;
      const float* prow = ps + (c0 + g) * L.ldp + t;
      for (int kk = k0; kk < k1; ++kk) {
        const float* bk = brow + kk * 8;
        const float av[4] = {bk[0], bk[8 * L.ldb], bk[4], bk[8 * L.ldb + 4]};
        uint32_t ah[4], al[4];
        split4<kTerms>(av, ah, al);
        const int s = (kk * 8) / H, h2 = kk * 8 - s * H;
        const float* pk = prow + s * L.ldps + h2;
#pragma unroll
        for (int n = 0; n < kSmallTcMaxDc / 8; ++n) {
          if (n < ntiles_o) {
            uint32_t bh0, bh1, bl0, bl1;
            split_tf32<kTerms>(pk[n * 8 * L.ldp], bh0, bl0);
            split_tf32<kTerms>(pk[n * 8 * L.ldp + 4], bh1, bl1);
            mma_split_add<kTerms>(acc[n], ah, al, bh0, bh1, bl0, bl1);
          }
        }
      }
      float* r0 = red + (kp * L.N16 + mt * 16 + g) * L.ldr + c0 + 2 * t;
#pragma unroll
      for (int n = 0; n < kSmallTcMaxDc / 8; ++n) {
        if (n < ntiles_o) {
          *reinterpret_cast<float2*>(r0 + n * 8) = make_float2(acc[n][0], acc[n][1]);
          *reinterpret_cast<float2*>(r0 + 8 * L.ldr + n * 8) = make_float2(acc[n][2], acc[n][3]);
        }
      }
    }
  }
  __syncthreads();

  small_tc_store_out<false>(p, red, L.ldr, L.N16, L.kparts, bias_s, den_s, pair_s, b, i0, d0, ti);
#else
  target_lacks_instructions();
#endif
}

}  // namespace flashopm
