// Second kernel of the two-launch path for small problems, the chained float16 split form
// (hidden 32, N <= 48; regions in SmallF16ChainLayout, opm_params.h).  The same sums as
// opm_small_f16_kernel, but phase P's tile never leaves the registers: for a pair of h2 and eight
// s, P's accumulator fragment (rows (h2, d), columns s) is element for element phase O's B
// fragment for k = (h2 pair, eight s), so each warp item runs both products in one loop over k.
//
// Block (d chunk, tile of TI rows i, batch b), 16 warps:
//   prologue  W's chunk into registers in 4 x 4 units of (h1, h2), its largest magnitude over the
//             block, then split into rows (h2, d) of h1; bias, row denominators or pair counts;
//   wait      griddepcontrol.wait (kernel 1 wrote a and b split, b's rows along k = (s/8, h2, s%8));
//             or, fused (one cooperative launch), the block's first warps project its share of the
//             rows as kernel 1 would, while the others split W, then the grid's barrier;
//   copies    bulk copies: the block's rows (i, s) of a and their exponents, then b and its; in
//             clusters of two blocks along d (pair_copies), half of each by each block, into both;
//   items     (two rows i, eight d, a part of k) per warp: per k-step (h2 pair, s chunk)
//               P[(h2, d), s] = sum_h1 W[d, h1·H + h2] · a[(i, s), h1]   M = 16, N = 8, K = H
//             times 2^(p_exp + e_i - e_(i, s)) per column s, split into float16 parts, then
//               out[j, d] += sum_k b[j, k] · P[k, d]                     M = N16, N = 8, K = 16
//             with b's rows scaled by 2^(e_j - e_(j, s)) in its fragments (exact powers of two);
//             the K parts summed in order by the epilogue;
//   epilogue  the scales taken out, normalisation and bias (small_f16_store_out).
// Scales as in opm_small_f16_kernel: every scaled operand below 2^15, one factor
// 2^(e_j + e_i + e_w + p_exp) per output.  b's per-row factors move into its float16 parts
// because a k-step now spans eight s; a part that falls below float16's normal range loses bits
// only below 2^-24 of its row's largest scaled value, under float32's rounding of the sums.
#pragma once

#include <cooperative_groups.h>
#include <cuda_fp16.h>

#include "opm_small_f16_kernel.cuh"

namespace flashopm {

// Component e (0-3) of v.
__device__ __forceinline__ float f4_at(const float4& v, int e) {
  return e == 0 ? v.x : e == 1 ? v.y : e == 2 ? v.z : v.w;
}

// a · f for two halves packed in 32 bits, f two halves as well.
__device__ __forceinline__ uint32_t hmul2_bits(uint32_t a, uint32_t f) {
  const __half2 r = __hmul2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&f));
  return *reinterpret_cast<const uint32_t*>(&r);
}

// The fused form's projections, run by the block's first kSmallF16FusedProjWarps warps: rows
// [r0, r1) of the B·S·N rows (b, s, n), a warp per row at a time, into the workspace in
// kAbF16Split, as opm_prep_kernel's whole-weights form computes and stores them (the same
// statistics, the same products in the same order: the same bits).  W_a's and W_b's rows are
// staged whole at ws (ldw = round_up4_odd_quad(C) floats apart), each warp's normalised row at
// xs + warp·C.  Needs hidden 32, float32 x, C % 4 == 0, C <= kPrepWholeMaxC, the weights 16-byte
// aligned (checked by the launcher).
__device__ __forceinline__ void small_f16_project_rows(const PrepArgs& p, int64_t r0, int64_t r1, float* ws,
                                                       float* xs) {
  constexpr int kThreads = 32 * kSmallF16FusedProjWarps, kH = 32;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int C = p.C, ldw = round_up4_odd_quad(C);
  {
    // Thread t copies column quad t % 16 of rows t / 16 + (kThreads / 16)·k, W_a's then W_b's.
    const int quad = tid & 15;
    if (4 * quad < C)
      for (int o = tid >> 4; o < 2 * kH; o += kThreads / 16) {
        const float* src = (o < kH ? p.wa + int64_t(o) * C : p.wb + int64_t(o - kH) * C) + 4 * quad;
        cp_async_n<16>(ws + o * ldw + 4 * quad, src, true);
      }
    cp_async_commit();
  }
  float lnw[kPrepCachedChunks], lnb[kPrepCachedChunks];
#pragma unroll
  for (int j = 0; j < kPrepCachedChunks; ++j) {
    const int c = j * kPrepKC + lane;
    lnw[j] = c < C ? p.ln_w[c] : 0.f;
    lnb[j] = c < C ? p.ln_b[c] : 0.f;
  }
  const float bias_a = p.ba ? p.ba[lane] : 0.f, bias_b = p.bb ? p.bb[lane] : 0.f;
  const int64_t SN = int64_t(p.S) * p.N;
  float* const xrow_s = xs + warp * C;
  int b = 0, s = 0, n = 0;
  float mask_v = 0.f;
  // Row r's position, mask value and normalised features (into xrow_s).
  const auto normalise = [&](int64_t r) {
    b = int(r / SN);
    s = int((r - b * SN) / p.N);
    n = int(r - b * SN - int64_t(s) * p.N);
    const float* const x = static_cast<const float*>(p.x) + int64_t(b) * p.x_sb + int64_t(s) * p.x_ss + int64_t(n) * p.x_sn;
    float x_c[kPrepCachedChunks];
#pragma unroll
    for (int j = 0; j < kPrepCachedChunks; ++j) {
      const int c = j * kPrepKC + lane;
      x_c[j] = c < C ? x[c] : 0.f;
    }
    mask_v = mask_at(p.mask, b, s, n);
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < kPrepCachedChunks; ++j)
      if (j * kPrepKC + lane < C) sum += x_c[j];
    const float mean = warp_sum(sum) / C;
    float sq = 0.f;
#pragma unroll
    for (int j = 0; j < kPrepCachedChunks; ++j)
      if (j * kPrepKC + lane < C) {
        const float d = x_c[j] - mean;
        sq += d * d;
      }
    const float rstd = rsqrtf(warp_sum(sq) / C + p.ln_eps);
#pragma unroll
    for (int j = 0; j < kPrepCachedChunks; ++j) {
      const int c = j * kPrepKC + lane;
      if (c < C) xrow_s[c] = (x_c[j] - mean) * rstd * lnw[j] + lnb[j];
    }
  };
  int64_t r = r0 + warp;
  if (r < r1) normalise(r);  // the first row's loads and statistics overlap the weights' copies
  cp_async_wait_all();
  named_barrier(2, kThreads);  // every projecting thread's weight copies, and each warp's row
  for (; r < r1; r += kSmallF16FusedProjWarps) {
    float acc[2] = {0.f, 0.f};
    whole_row_products<2>(xrow_s, ws, ldw, C, lane, acc);
    const float va = (acc[0] + bias_a) * mask_v, vb = (acc[1] + bias_b) * mask_v;
    float max_a = fabsf(va), max_b = fabsf(vb);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      max_a = fmaxf(max_a, __shfl_xor_sync(0xffffffffu, max_a, off));
      max_b = fmaxf(max_b, __shfl_xor_sync(0xffffffffu, max_b, off));
    }
    const int e_a = split_scale_exp_bits(max_a), e_b = split_scale_exp_bits(max_b);
    const int64_t row = int64_t(n) * p.S + s;
    __half* const a_row = static_cast<__half*>(p.a_out) + b * p.a_sb + row * p.a_ss;
    __half* const b_base = static_cast<__half*>(p.b_out);
    store_split_f16(a_row + lane, p.a_lo_off, va * exp2_int(e_a));
    store_split_f16(b_base + ab_row_offset(p.b_sb, p.b_sc, p.b_ss, p.b_sn, p.s_chunk, b, s, n) + lane * p.b_hs,
                    p.b_lo_off, vb * exp2_int(e_b));
    if (p.s_chunk > 0 && s == p.S - 1)
      for (int sp = p.S; sp % p.s_chunk != 0; ++sp)  // b's positions past S, to its chunk's end: zeros
        store_split_f16(b_base + ab_row_offset(p.b_sb, p.b_sc, p.b_ss, p.b_sn, p.s_chunk, b, sp, n) + lane * p.b_hs,
                        p.b_lo_off, 0.f);
    if (lane == 0) {
      p.a_exp[b * p.a_exp_sb + int64_t(n) * p.a_exp_sn + s] = e_a;
      p.b_exp[b * p.b_exp_sb + row] = e_b;
    }
    if (r + kSmallF16FusedProjWarps < r1) {
      __syncwarp();  // the row is consumed before the next one overwrites it
      normalise(r + kSmallF16FusedProjWarps);
      __syncwarp();
    }
  }
}

// kJT: m tiles of 16 rows j, exactly N16 / 16 (no predicates on them).  kWhole: every block's
// tile is whole (N % TI == 0, TI % 2 == 0, N % 16 == 0, S % 8 == 0, D % Dc == 0), so that no row
// i, j or position s of an item needs a test.  kFused: one cooperative launch (SmallTcArgs::fused),
// the rows projected by the block's first warps and a grid barrier in place of the wait; a
// template parameter so that the two-launch form's code carries none of it.
template <int kJT, bool kWhole, bool kFused>
__device__ __forceinline__ void small_f16_chain_body(const SmallTcArgs& p) {
  static_assert(kJT >= 1 && kJT <= 3, "the chained form takes one to three m tiles of j (N <= 48)");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // The next kernel on the stream may become resident now if it was launched as our programmatic
  // dependent (the next call's projections; p.trigger_next): it waits for our end before it reads
  // anything.
  if (p.trigger_next == 1) asm volatile("griddepcontrol.launch_dependents;\n" ::);
  constexpr int kH = 32, kHH = kH * kH, kKS = kH / 16, kIG = kSmallF16ChainIG;
  constexpr int kLgH = 5;
  extern __shared__ float4 smem_f4[];
  char* smem = reinterpret_cast<char*>(smem_f4);
  const int S = p.S, N = p.N, TI = p.TI, Dc = p.Dc;
  const SmallF16ChainLayout L = small_f16_chain_layout(S, N, kH, TI, Dc);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int d0 = blockIdx.x * Dc, i0 = blockIdx.y * TI, b = blockIdx.z;
  const int ti = min(TI, N - i0);        // rows i of this block
  const int dvalid = min(Dc, p.D - d0);  // columns d of this block
  __half* const w_hi = reinterpret_cast<__half*>(smem + L.w);
  __half* const w_lo = w_hi + L.wq;
  // W's row (h2, d): each quad of h2 kSmallF16ChainSkew halves further on
  const auto w_row = [&](int h2, int d) { return (h2 * Dc + d) * L.ldw + (h2 >> 2) * kSmallF16ChainSkew; };
  __half* const a_hi = reinterpret_cast<__half*>(smem + L.a);
  __half* const a_lo = a_hi + L.RA * L.lda;
  __half* const zero_row = reinterpret_cast<__half*>(smem + L.zero);
  __half* const b_hi = reinterpret_cast<__half*>(smem + L.b);
  __half* const b_lo = b_hi + L.N16 * L.ldk;
  int* const e_b_st = reinterpret_cast<int*>(smem + L.e_b_st);  // exponents of b's rows (j, s), [N][S]
  int* const e_a_st = reinterpret_cast<int*>(smem + L.e_a_st);  // of the block's rows (i, s) of a, [TI][S4]
  float* const red = reinterpret_cast<float*>(smem + L.red);
  float* const pair_s = reinterpret_cast<float*>(smem + L.pair);
  float* const bias_s = reinterpret_cast<float*>(smem + L.bias);
  float* const den_s = reinterpret_cast<float*>(smem + L.den);
  int* const e_a_s = reinterpret_cast<int*>(smem + L.e_a);
  int* const e_b_s = reinterpret_cast<int*>(smem + L.e_b);
  uint64_t* const a_bar = reinterpret_cast<uint64_t*>(smem + L.bars);  // a's bytes have arrived
  uint64_t* const b_bar = a_bar + 1;                                    // b's and its exponents
  // The W maximum's warp values: e_b is first written after the barrier that ends W's split.
  float* const scratch = reinterpret_cast<float*>(e_b_s);

  // ---- prologue: independent of the first kernel ----
  if (tid == 0) {
    mbarrier_init(a_bar, 1);
    mbarrier_init(b_bar, 1);
  }
  // Two-launch form in clusters of two blocks along d (SmallTcArgs::pair_copies): the pair's rows of
  // a and b are the same, so each block copies half of them into both; the peer's mbarriers must be
  // initialised before the first copy lands there (the cluster barrier's wait, before the copies).
  const bool pair_copies = !kFused && p.pair_copies;
  if (pair_copies) asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
  // Fused (one cooperative launch, no first kernel): the first kSmallF16FusedProjWarps warps project
  // the block's share of all the rows (b, s, n) into the workspace, the others split W's chunk.
  const bool proj_warp = kFused && warp < kSmallF16FusedProjWarps;
  const int w_first = kFused ? 32 * kSmallF16FusedProjWarps : 0;  // W's threads: w_first and up
  const int w_threads = kSmallTcThreads - w_first, wt = tid - w_first;
  if (proj_warp) {
    const int64_t rows = int64_t(p.B) * S * N, blocks = int64_t(gridDim.x) * gridDim.y * gridDim.z;
    const int64_t id = blockIdx.x + int64_t(gridDim.x) * (blockIdx.y + int64_t(gridDim.y) * blockIdx.z);
    float* const ws = reinterpret_cast<float*>(smem + L.red);  // the items' sums come after the barrier
    small_f16_project_rows(p.prep, rows * id / blocks, rows * (id + 1) / blocks, ws,
                           ws + 64 * round_up4_odd_quad(p.prep.C));
    // Other blocks read these rows with bulk copies (the async proxy) after the grid's barrier.
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
  }
  // Units of 4 x 4 (h1, h2) of W's chunk: unit u is h2 quad u % 8, then h1 quad, then d, so that a
  // warp's loads are whole 128-byte rows of W and its stores of one h2 (eight quads of h2 on
  // skewed rows, four h1 quads each) fall in distinct banks.
  const float4* const w_src = reinterpret_cast<const float4*>(p.w_out + int64_t(d0) * kHH);
  const int units = dvalid * (kH / 4) * (kH / 4);
  const auto unit_at = [&](int u, int& d, int& q1, int& q2) {
    q2 = u & (kH / 4 - 1);
    q1 = (u >> (kLgH - 2)) & (kH / 4 - 1);
    d = u >> (2 * (kLgH - 2));
  };
  const auto load_unit = [&](int u, float4 (&v)[4]) {
    int d, q1, q2;
    unit_at(u, d, q1, q2);
#pragma unroll
    for (int r = 0; r < 4; ++r) v[r] = __ldg(w_src + ((d * kHH + (4 * q1 + r) * kH + 4 * q2) >> 2));
  };
  float4 wv[4];
  const bool has_unit = !proj_warp && wt < units;
  if (has_unit) load_unit(wt, wv);
  // den_s: reciprocals; fused, by W's warps only (the projecting warps have the longer way)
  small_tc_stage_norm<true, kFused ? kSmallF16FusedProjWarps : 0>(p, b, i0, d0, ti, L.N16, bias_s, den_s, pair_s);
  float w_max = 0.f;
  if (has_unit)
#pragma unroll
    for (int r = 0; r < 4; ++r) w_max = abs_max4(w_max, wv[r]);
  for (int u = wt + w_threads; !proj_warp && u < units; u += w_threads) {
    float4 v[4];
    load_unit(u, v);
#pragma unroll
    for (int r = 0; r < 4; ++r) w_max = abs_max4(w_max, v[r]);
  }
  // W's largest magnitude: over the block, or (fused) over W's warps, whose values stay in scratch
  // for the projecting warps to read after the block's barrier below.
  const auto fused_w_max = [&] {
    float m = 0.f;
    for (int w = kSmallF16FusedProjWarps; w < kSmallTcWarps; ++w) m = fmaxf(m, scratch[w]);
    return m;
  };
  int e_w = 0;
  if constexpr (!kFused) {
    e_w = split_scale_exp_bits(block_abs_max(w_max, scratch));
  } else if (!proj_warp) {  // (fused)
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) w_max = fmaxf(w_max, __shfl_xor_sync(0xffffffffu, w_max, o));
    if (lane == 0) scratch[warp] = w_max;
    named_barrier(1, w_threads);
    e_w = split_scale_exp_bits(fused_w_max());
  }
  const float f_w = exp2_int(e_w);
  const auto store_unit = [&](int u, const float4 (&v)[4]) {
    int d, q1, q2;
    unit_at(u, d, q1, q2);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float4 col = make_float4(f4_at(v[0], e), f4_at(v[1], e), f4_at(v[2], e), f4_at(v[3], e));
      store_split4(w_hi, w_lo, w_row(4 * q2 + e, d) + 4 * q1, col, f_w);
    }
  };
  if (has_unit) store_unit(wt, wv);
  for (int u = wt + w_threads; !proj_warp && u < units; u += w_threads) {
    float4 v[4];
    load_unit(u, v);
    store_unit(u, v);
  }
  // Rows (h2, d) of d past D: zeros (their columns of the output are never stored).
  const int dpad = Dc - dvalid;
  for (int idx = tid; idx < kH * dpad * (kH / 4); idx += kSmallTcThreads) {
    const int q1 = idx & (kH / 4 - 1), rest = idx >> (kLgH - 2);
    const int h2 = rest / dpad, d = dvalid + rest - h2 * dpad;
    const int off = w_row(h2, d) + 4 * q1;
    *reinterpret_cast<uint2*>(w_hi + off) = make_uint2(0u, 0u);
    *reinterpret_cast<uint2*>(w_lo + off) = make_uint2(0u, 0u);
  }
  // The row that a's fragments read for s past S (or i past the tile): zeros.
  for (int idx = tid; idx < L.lda / 8; idx += kSmallTcThreads)
    *reinterpret_cast<uint4*>(zero_row + 8 * idx) = make_uint4(0u, 0u, 0u, 0u);
  __syncthreads();

  if constexpr (kFused) {
    if (proj_warp) e_w = split_scale_exp_bits(fused_w_max());
    cooperative_groups::this_grid().sync();  // every block's rows of a and b stored and visible
  } else {
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    if (pair_copies) asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
  }

  // ---- copies: a's rows (i, s) of this block and all of b's, as kernel 1 (or the grid) split them ----
  if (tid == 0) {
    if constexpr (kFused) asm volatile("fence.proxy.async.global;\n" ::: "memory");  // generic stores, then bulk reads
    const int64_t a_row0 = (int64_t(b) * N + i0) * S;
    const unsigned a_bytes = unsigned(ti * S * L.lda) * 2u, b_bytes = unsigned(N * L.ldk) * 2u;
    const unsigned ea_bytes = unsigned(ti * L.S4) * 4u;
    const __half* const a_src = static_cast<const __half*>(p.a16) + a_row0 * L.lda;
    const __half* const b_src = static_cast<const __half*>(p.b16) + int64_t(b) * N * L.ldk;
    mbarrier_arrive_expect_tx(a_bar, 2u * a_bytes + ea_bytes);
    mbarrier_arrive_expect_tx(b_bar, 2u * b_bytes + unsigned(L.NS4) * 4u);
    const auto copy = [&](void* dst, const void* src, unsigned bytes, uint64_t* bar) {
      if (!pair_copies) {
        bulk_copy_g2s(dst, src, bytes, bar);
        return;
      }
      // This block's half (rank 0 the first, at a 16-byte boundary), into both blocks.
      unsigned rank;
      asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
      const unsigned half = bytes / 32u * 16u, lo = rank == 0 ? 0u : half, hi = rank == 0 ? half : bytes;
      if (hi > lo)
        bulk_copy_g2s_multicast(static_cast<char*>(dst) + lo, static_cast<const char*>(src) + lo, hi - lo, bar, 3);
    };
    copy(a_hi, a_src, a_bytes, a_bar);
    copy(a_lo, a_src + p.a16_lo, a_bytes, a_bar);
    copy(e_a_st, p.a_exp + (int64_t(b) * N + i0) * L.S4, ea_bytes, a_bar);
    copy(b_hi, b_src, b_bytes, b_bar);
    copy(b_lo, b_src + p.b16_lo, b_bytes, b_bar);
    copy(e_b_st, p.b_exp + int64_t(b) * L.NS4, unsigned(L.NS4) * 4u, b_bar);
  }
  const int p_exp = -(kSplitTopExp + 1) - kLgH;  // |P'| < H·2^30·2^p_exp = 2^15
  // Items (row pair ig, chunk of eight d doct, K part kp), kp fastest; the counts are powers of
  // two, so the item's coordinates and its k-steps come from shifts.
  const int n_doct = Dc / 8, n_ig = (TI + kIG - 1) / kIG, kparts = L.kparts;
  const int lg_kparts = 31 - __clz(kparts), lg_doct = 31 - __clz(n_doct);
  const int ksteps = kH / 2 * (L.S8 / 8);  // k-steps (h2 pair, chunk of eight s), h2 pairs fastest
  // Fragment rows of this lane: W's rows (h2 = 2·hp + (lane / 8) % 2, d = 8·doct + lane % 8) at h1
  // 8·(lane / 16) (+ 16 per k16 step); a's row s = 8·sc + lane % 8 at h1 8·(lane / 8); b's row
  // j = 16·mt + lane % 16 at k 8·(lane / 16).
  const int w_lane = (((lane >> 3) & 1) * Dc + (lane & 7)) * L.ldw + (lane >> 4) * 8;
  const int b_lane = (lane & 15) * L.ldk + (lane >> 4) * 8;

  for (int item = warp; item < n_ig * n_doct * kparts; item += kSmallTcWarps) {
    const int kp = item & (kparts - 1), rest = item >> lg_kparts;
    const int doct = rest & (n_doct - 1), ig = rest >> lg_doct;
    const int ia = ig * kIG;
    if (!kWhole && (ia >= ti || 8 * doct >= dvalid)) continue;
    const int k0 = (ksteps >> lg_kparts) * kp, k1 = k0 + (ksteps >> lg_kparts);  // kparts divides ksteps
    mbarrier_wait_parity_suspend(a_bar, 0);
    // Rows i's common exponents (the smallest of their rows (i, s)), from the copied exponents.
    int e_i[kIG];
#pragma unroll
    for (int i = 0; i < kIG; ++i) {
      e_i[i] = kWhole || ia + i < ti ? min_exp_row_any(e_a_st + (ia + i) * L.S4, S, true) : 0;
      if (kp == 0 && doct == 0 && lane == 0 && (kWhole || ia + i < ti)) e_a_s[ia + i] = e_i[i];
    }
    float acc[kJT][kIG][4];
#pragma unroll
    for (int mt = 0; mt < kJT; ++mt)
#pragma unroll
      for (int i = 0; i < kIG; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mt][i][e] = 0.f;
    uint32_t ah[kIG][4], al[kIG][4];  // a's B fragments of the current chunk of s: k16 step kk in [2kk], [2kk + 1]
    float fp[kIG][2];                 // phase P's factors of columns s = 8·sc + 2t, + 1
    uint32_t fb[kJT][2];              // b's factors (two halves: s = 8·sc + 2t, + 1) of rows g, g + 8
    int e_j[kJT][2];
    bool b_arrived = false;
    int cur_sc = -1;
    const auto b_factors = [&](int sc) {
      const int s0 = 8 * sc + 2 * t;
#pragma unroll
      for (int mt = 0; mt < kJT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int j = 16 * mt + g + 8 * r;
          float f0 = 0.f, f1 = 0.f;
          if (kWhole || j < N) {
            if (kWhole || s0 < S) f0 = exp2_int_or_zero(e_j[mt][r] - e_b_st[j * S + s0]);
            if (kWhole || s0 + 1 < S) f1 = exp2_int_or_zero(e_j[mt][r] - e_b_st[j * S + s0 + 1]);
          }
          const __half2 h = __floats2half2_rn(f0, f1);
          fb[mt][r] = *reinterpret_cast<const uint32_t*>(&h);
        }
    };
    // k-steps in pairs: both P tiles first (independent chains, and b's copy more time to land),
    // then both steps of phase O.
    int fb_sc = -1;
    for (int kb = k0; kb < k1; kb += 2) {
      uint32_t ph[2][kIG][2], pl[2][kIG][2];
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        if (kb + u < k1) {
          const int ks = kb + u, sc = ks >> (kLgH - 1), hp = ks & (kH / 2 - 1);
          if (sc != cur_sc) {
            cur_sc = sc;
            const int s = 8 * sc + (lane & 7);
#pragma unroll
            for (int i = 0; i < kIG; ++i) {
              const bool ok = kWhole || (ia + i < ti && s < S);
              const int off = ((ia + i) * S + s) * L.lda;
              ldmatrix_x4(ah[i], (ok ? a_hi + off : zero_row) + (lane >> 3) * 8);
              ldmatrix_x4(al[i], (ok ? a_lo + off : zero_row) + (lane >> 3) * 8);
#pragma unroll
              for (int c = 0; c < 2; ++c) {
                const int sf = 8 * sc + 2 * t + c;
                fp[i][c] = kWhole || (ia + i < ti && sf < S)
                               ? exp2_int_or_zero(p_exp + e_i[i] - e_a_st[(ia + i) * L.S4 + sf])
                               : 0.f;
              }
            }
          }
          // Phase P: rows (h2 pair, eight d) of W as A, the item's rows i as n tiles.
          float c[kIG][4];
#pragma unroll
          for (int i = 0; i < kIG; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) c[i][e] = 0.f;
          const int w_off = w_lane + (2 * hp * Dc + 8 * doct) * L.ldw + (hp >> 1) * kSmallF16ChainSkew;
#pragma unroll
          for (int kk = 0; kk < kKS; ++kk) {
            uint32_t wh[4], wl[4], bh[kIG][2], bl[kIG][2];
            ldmatrix_x4(wh, w_hi + w_off + 16 * kk);
            ldmatrix_x4(wl, w_lo + w_off + 16 * kk);
#pragma unroll
            for (int i = 0; i < kIG; ++i) {
              bh[i][0] = ah[i][2 * kk], bh[i][1] = ah[i][2 * kk + 1];
              bl[i][0] = al[i][2 * kk], bl[i][1] = al[i][2 * kk + 1];
            }
            mma_f16_split_add<kIG>(c, wh, wl, bh, bl, kIG);
          }
          // P's fragment scaled per column s and split: rows (h2 = 2hp, d = g) give k = (2hp, s),
          // rows g + 8 (h2 = 2hp + 1) give k + 8: phase O's B fragment for n = d.
#pragma unroll
          for (int i = 0; i < kIG; ++i) {
            split_f16x2(c[i][0] * fp[i][0], c[i][1] * fp[i][1], ph[u][i][0], pl[u][i][0]);
            split_f16x2(c[i][2] * fp[i][0], c[i][3] * fp[i][1], ph[u][i][1], pl[u][i][1]);
          }
        }
      }
      if (!b_arrived) {
        mbarrier_wait_parity_suspend(b_bar, 0);
        b_arrived = true;
#pragma unroll
        for (int mt = 0; mt < kJT; ++mt)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int j = 16 * mt + g + 8 * r;
            e_j[mt][r] = kWhole || j < N ? min_exp_row_any(e_b_st + j * S, S, S % 4 == 0) : 0;
            if (ig == 0 && doct == 0 && kp == 0 && t == 0 && (kWhole || j < N)) e_b_s[j] = e_j[mt][r];
          }
      }
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        if (kb + u < k1) {
          const int ks = kb + u, sc = ks >> (kLgH - 1), hp = ks & (kH / 2 - 1);
          if (sc != fb_sc) {
            fb_sc = sc;
            b_factors(sc);
          }
          // Phase O: b's rows j as A (k = (h2 pair, eight s) contiguous), P's fragments as B.
          const int kpos = 8 * kH * sc + 16 * hp;
#pragma unroll
          for (int mt = 0; mt < kJT; ++mt) {
            uint32_t bh[4], bl[4];
            ldmatrix_x4(bh, b_hi + b_lane + 16 * mt * L.ldk + kpos);
            ldmatrix_x4(bl, b_lo + b_lane + 16 * mt * L.ldk + kpos);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              bh[e] = hmul2_bits(bh[e], fb[mt][e & 1]);
              bl[e] = hmul2_bits(bl[e], fb[mt][e & 1]);
            }
            mma_f16_split_add<kIG>(acc[mt], bh, bl, ph[u], pl[u], kIG);
          }
        }
      }
    }
    // The item's part of the sums: rows j, columns (i, d) of the K part kp.
#pragma unroll
    for (int mt = 0; mt < kJT; ++mt)
#pragma unroll
      for (int i = 0; i < kIG; ++i)
        if (kWhole || ia + i < ti) {
          float* const r0 = red + (kp * L.N16 + 16 * mt + g) * L.ldr + (ia + i) * Dc + 8 * doct + 2 * t;
          *reinterpret_cast<float2*>(r0) = make_float2(acc[mt][i][0], acc[mt][i][1]);
          *reinterpret_cast<float2*>(r0 + 8 * L.ldr) = make_float2(acc[mt][i][2], acc[mt][i][3]);
        }
  }
  __syncthreads();
  if (p.trigger_next == 2) asm volatile("griddepcontrol.launch_dependents;\n" ::);
  // (pair_copies) every copy into this block has landed: the peer may exit once it knows that
  if (pair_copies) asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");

  // out' = out·2^(e_b[j] + e_a[i] + e_w + p_exp)
  small_f16_store_out(p, red, L.ldr, L.N16, L.kparts, bias_s, den_s, pair_s, b, i0, d0, ti, e_a_s, e_b_s,
                      e_w + p_exp);
  // (pair_copies) no block exits while its copies into the peer may still be landing
  if (pair_copies) asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
#else
  target_lacks_instructions();
#endif
}

// The two-launch form: at most 112 registers, because 512 x 112 leaves room on an SM for a block of
// the first kernel (128 x 56), so that this kernel's blocks start beside it, as its programmatic
// dependent, and stage W before the first kernel ends; with 128 they can start only once it ends.
// Four m tiles would need 128 (spills of 144 bytes at 112), which is why the form stops at three.
template <int kJT, bool kWhole>
__global__ void __maxnreg__(112) opm_small_f16_chain_kernel(const SmallTcArgs p) {
  small_f16_chain_body<kJT, kWhole, false>(p);
}

// The one-launch form: no first kernel to leave room for, so the whole register file (at 112 its
// projections and items spilled 64-104 bytes).
template <int kJT, bool kWhole>
__global__ void __launch_bounds__(kSmallTcThreads, 1) opm_small_f16_chain_fused_kernel(const SmallTcArgs p) {
  small_f16_chain_body<kJT, kWhole, true>(p);
}

}  // namespace flashopm
