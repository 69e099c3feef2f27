// Second kernel of the two-launch path for small problems, float16 split form (hidden 16, 32 or
// 64; regions in SmallF16Layout, opm_params.h).  The same block and the same sums as
// opm_small_tc_kernel, with phases P and O on mma.sync m16n8k16:
//
// Block (d chunk, tile of TI rows i, batch b), 16 warps:
//   prologue  W's chunk into registers, its largest magnitude over the block, then split into
//             shared memory; bias, row denominators or pair counts (small_tc_stage_norm): nothing
//             here depends on the first kernel, so it overlaps it;
//   wait      griddepcontrol.wait (a and b complete and visible: kernel 1 wrote them already split
//             into float16 parts, in this kernel's shared-memory layouts, kAbF16Split);
//   copy      bulk copies, each counted by an mbarrier: the block's rows (i, s) of a, then all of
//             b's rows j and their exponents, which arrive while phase P runs;
//   phase P   for each d: P[(i, s), h2] = sum_h1 a[(i, s), h1] · W[d, h1·H + h2]   (M = TI·S, N = K = H)
//             stored split as rows (i, d) of k = (s, h2);
//   phase O   out[j, (i, d)] = sum_k b[j, k] · P[(i, d), k]                       (M = N, N = TI·Dc, K = S·H)
//             K split over warps, the parts summed in order by the epilogue;
//   epilogue  the scales taken out, normalisation and bias (small_tc_store_out).
//
// Scales (powers of two, kSplitTopExp): one for the block's chunk of W (e_w), and one per row
// (i, s) of a and per row (j, s) of b, chosen by kernel 1 from the row's largest magnitude.  Row
// i's common exponent e_i is the smallest of its e_(i, s): phase P multiplies row (i, s) of its
// sums by 2^(p_exp + e_i - e_(i, s)), p_exp from the bound |sum_h1 a'·W'| < H·2^30, so that
// one factor, 2^(e_w + p_exp + e_i), holds along phase O's K for each column (i, d).  Phase O
// sums each k-step (a single s) in a zeroed fragment and adds it to the accumulator times
// 2^(e_j - e_(j, s)), e_j the smallest of row j's: the accumulator then carries 2^e_j.  With every
// scaled operand below 2^15, the largest products are exact and the sums far from float32's
// range; values far below their row's largest lose bits only below 2^-25 of the scaled bound,
// under float32's rounding of the sums they enter.  Each thread takes the factors of its own rows
// from the copied exponents (a's copied with a's rows, as [TI][S4]), so that no pass over them
// stands between a's arrival and phase P, or between phases P and O (SmallTcArgs::f16_opts).
#pragma once

#include "opm_small_tc_kernel.cuh"

namespace flashopm {

constexpr int kSmallF16VecW = 4;  // float4 of W's chunk per thread kept in registers (more are loaded again)

__device__ __forceinline__ float abs_max4(float m, const float4& v) {
  return fmaxf(fmaxf(m, fmaxf(fabsf(v.x), fabsf(v.y))), fmaxf(fabsf(v.z), fabsf(v.w)));
}

// The thread's first kV float4 of n4 (float4 tid, tid + T, ...; zeros past n4).
template <int kV, typename Load>
__device__ __forceinline__ void load_own_vec4(Load load, int n4, float4 (&v)[kV]) {
#pragma unroll
  for (int k = 0; k < kV; ++k) {
    const int idx = threadIdx.x + k * kSmallTcThreads;
    v[k] = idx < n4 ? load(idx) : make_float4(0.f, 0.f, 0.f, 0.f);
  }
}

// Largest magnitude of the thread's share of n4 float4, the first kV from v (NaN ignored: it
// propagates through the split values, not through the scale).
template <int kV, typename Load>
__device__ __forceinline__ float own_abs_max(Load load, int n4, const float4 (&v)[kV]) {
  float m = 0.f;
#pragma unroll
  for (int k = 0; k < kV; ++k) m = abs_max4(m, v[k]);
  for (int idx = threadIdx.x + kV * kSmallTcThreads; idx < n4; idx += kSmallTcThreads) m = abs_max4(m, load(idx));
  return m;
}

// The largest of each thread's m over the block (scratch: a warp's worth of floats; one barrier).
__device__ __forceinline__ float block_abs_max(float m, float* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = m;
  __syncthreads();
  m = 0.f;
  for (int w = 0; w < kSmallTcWarps; ++w) m = fmaxf(m, scratch[w]);
  return m;
}

// Four consecutive values times f (a power of two) split into float16 high and low parts, stored
// as four halves at hi + off and lo + off.
__device__ __forceinline__ void store_split4(__half* hi, __half* lo, int off, const float4& v, float f) {
  uint32_t h0, l0, h1, l1;
  split_f16x2(v.x * f, v.y * f, h0, l0);
  split_f16x2(v.z * f, v.w * f, h1, l1);
  *reinterpret_cast<uint2*>(hi + off) = make_uint2(h0, h1);
  *reinterpret_cast<uint2*>(lo + off) = make_uint2(l0, l1);
}

// Rows of `len` floats (len % 4 == 0), n4 float4 in all, scaled by f and split into rows of ld
// halves: float4 idx lands at (4·idx / len)·ld + 4·idx % len.  The thread's float4 lie a fixed
// step apart, so its row and column advance by fixed amounts: one division per thread.
template <int kV, typename Load>
__device__ __forceinline__ void split_rows(Load load, int n4, const float4 (&v)[kV], float f, int len, int ld,
                                           __half* hi, __half* lo) {
  constexpr int kStep = 4 * kSmallTcThreads;
  const int step_row = kStep / len, step_col = kStep - step_row * len;
  int row = 4 * int(threadIdx.x) / len, col = 4 * int(threadIdx.x) - row * len;
  const auto advance = [&] {
    row += step_row, col += step_col;
    if (col >= len) col -= len, ++row;
  };
#pragma unroll
  for (int k = 0; k < kV; ++k) {
    if (int(threadIdx.x) + k * kSmallTcThreads < n4) store_split4(hi, lo, row * ld + col, v[k], f);
    advance();
  }
  for (int idx = threadIdx.x + kV * kSmallTcThreads; idx < n4; idx += kSmallTcThreads) {
    store_split4(hi, lo, row * ld + col, load(idx), f);
    advance();
  }
}

// The smallest of n exponents row[0 .. n) (kSplitMaxExp if none), in 16-byte loads where vec (row
// 16-byte aligned): all the loads go out before the first minimum waits for one.
__device__ __forceinline__ int min_exp_row(const int* row, int n, bool vec) {
  int m = kSplitMaxExp;
  if (vec) {
    const int4* const row4 = reinterpret_cast<const int4*>(row);
#pragma unroll 4
    for (int q = 0; q < (n + 3) / 4; ++q) {
      const int4 v = row4[q];
      m = min(m, v.x);  // 4q < n
      if (4 * q + 1 < n) m = min(m, v.y);
      if (4 * q + 2 < n) m = min(m, v.z);
      if (4 * q + 3 < n) m = min(m, v.w);
    }
  } else {
#pragma unroll 4
    for (int q = 0; q < n; ++q) m = min(m, row[q]);
  }
  return m;
}

// The same, where n is a multiple of 4 and row 16-byte aligned without tests on the positions.
__device__ __forceinline__ int min_exp_row_any(const int* row, int n, bool aligned) {
  if (!(aligned && n % 4 == 0)) return min_exp_row(row, n, aligned);
  int m = kSplitMaxExp;
  const int4* const row4 = reinterpret_cast<const int4*>(row);
#pragma unroll 4
  for (int q = 0; q < n / 4; ++q) {
    const int4 v = row4[q];
    m = min(m, min(min(v.x, v.y), min(v.z, v.w)));
  }
  return m;
}

// The float16 split forms' epilogue: small_tc_store_out<true, 2>'s sums, scales, normalisation and
// stores, bit for bit, in fewer instructions: kNormRow's den_s holds reciprocals
// (small_tc_stage_norm<true>), an item's output offset is its row (il·N + j) of the block's tile
// times D, and the K parts' addresses step by one stride.
__device__ __forceinline__ void small_f16_store_out(const SmallTcArgs& p, const float* red, int ldr, int N16,
                                                    int kparts, const float* bias_s, const float* inv_den_s,
                                                    const float* pair_s, int b, int i0, int d0, int ti,
                                                    const int* e_a, const int* e_b, int e_common) {
  const int N = p.N, Dc = p.Dc, D = p.D;
  const int dvalid = min(Dc, D - d0);
  const int lg_items = 30 - __clz(Dc);  // two columns per item: Dc / 2 = 2^lg_items items per row
  const int stride = N16 * ldr;
  const bool vec_out = D % 2 == 0;
  const bool row_norm = p.norm.kind == kNormRow;
  const SmallDiv div_n(N);
  const int64_t out0 = (int64_t(b) * N + i0) * N * D + d0;  // the block's tile: rows (il·N + j) of D
  for (int idx = threadIdx.x; idx < (ti * N) << lg_items; idx += kSmallTcThreads) {
    const int row = idx >> lg_items, dl = 2 * (idx - (row << lg_items));  // row = il·N + j
    if (dl >= dvalid) continue;
    const int il = div_n(row), j = row - il * N;
    const float* const src = red + j * ldr + il * Dc + dl;
    // The K parts in order, each load predicated on the count (a loop over a count known here
    // only would hold a register of its own through the items, and their allocation is tight)
    float2 v = *reinterpret_cast<const float2*>(src);
    {
      float2 part[kSmallTcWarps];
      const float* q = src;
#pragma unroll
      for (int kp = 1; kp < kSmallTcWarps; ++kp) {
        q += stride;
        if (kp < kparts) part[kp] = *reinterpret_cast<const float2*>(q);
      }
#pragma unroll
      for (int kp = 1; kp < kSmallTcWarps; ++kp)
        if (kp < kparts) v.x += part[kp].x, v.y += part[kp].y;
    }
    float r[2] = {v.x, v.y};
    const int e = e_b[j] + e_a[il] + e_common;
    if (e >= -126 && e <= 126) {
      const float factor = exp2_int(-e);
      r[0] *= factor, r[1] *= factor;
    } else {
      r[0] = scalbnf(r[0], -e), r[1] = scalbnf(r[1], -e);
    }
    if (row_norm) {
      const float inv_den = inv_den_s[il];
      r[0] = r[0] * inv_den + bias_s[dl], r[1] = r[1] * inv_den + bias_s[dl + 1];
    } else {
      const float pair = pair_s[il * N16 + j];
      r[0] = normalise(r[0], bias_s[dl], 0.f, pair, p.norm), r[1] = normalise(r[1], bias_s[dl + 1], 0.f, pair, p.norm);
    }
    const int64_t dst = out0 + int64_t(row) * D + dl;
    if (vec_out && dl + 2 <= dvalid) {
      store_out2(p.out, dst, r[0], r[1], p.out_kind);
    } else {
      for (int c = 0; c < 2 && dl + c < dvalid; ++c) store_out(p.out, dst + c, r[c], p.out_kind);
    }
  }
}

__global__ void __maxnreg__(96) opm_small_f16_kernel(const SmallTcArgs p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // The next kernel on the stream may become resident now if it was launched as our programmatic
  // dependent (the next call's projections; p.trigger_next): it waits for our end before it reads
  // anything.
  if (p.trigger_next != 0) asm volatile("griddepcontrol.launch_dependents;\n" ::);
  extern __shared__ float4 smem_f4[];
  char* smem = reinterpret_cast<char*>(smem_f4);
  const int S = p.S, N = p.N, H = p.H, TI = p.TI, Dc = p.Dc, SH = S * H, HH = H * H;
  const int lg_h = 31 - __clz(H), hk = H + 8;  // H = 2^lg_h; k blocks of H padded to hk
  const SmallF16Layout L = small_f16_layout(S, N, H, TI, Dc);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int d0 = blockIdx.x * Dc, i0 = blockIdx.y * TI, b = blockIdx.z;
  const int ti = min(TI, N - i0);        // rows i of this block
  const int dvalid = min(Dc, p.D - d0);  // columns d of this block
  __half* const w_hi = reinterpret_cast<__half*>(smem + L.w);
  __half* const w_lo = w_hi + Dc * H * L.ldw;
  __half* const a_hi = reinterpret_cast<__half*>(smem + L.a);
  __half* const a_lo = a_hi + L.R16 * L.lda;
  __half* const b_hi = reinterpret_cast<__half*>(smem + L.b);
  __half* const b_lo = b_hi + L.N16 * L.ldk;
  __half* const p_hi = reinterpret_cast<__half*>(smem + L.p);
  __half* const p_lo = p_hi + L.NP * L.ldk;
  int* const e_b_st = reinterpret_cast<int*>(smem + L.e_b_st);  // exponents of b's rows (j, s)
  int* const e_a_st = reinterpret_cast<int*>(smem + L.e_a_st);  // of the block's rows (i, s) of a, [TI][S4]
  const int S4 = round_up4(S);
  const bool own_a_factors = (p.f16_opts & 2) != 0, own_b_factors = (p.f16_opts & 1) != 0;
  float* const p_f = reinterpret_cast<float*>(smem + L.p_f);     // [R16] phase P's row factors
  float* const b_f = reinterpret_cast<float*>(smem + L.b_f);     // [S][N16] phase O's factors
  float* const red = reinterpret_cast<float*>(smem + L.red);
  float* const pair_s = reinterpret_cast<float*>(smem + L.pair);
  float* const bias_s = reinterpret_cast<float*>(smem + L.bias);
  float* const den_s = reinterpret_cast<float*>(smem + L.den);
  int* const e_a_s = reinterpret_cast<int*>(smem + L.e_a);
  int* const e_b_s = reinterpret_cast<int*>(smem + L.e_b);
  uint64_t* const a_bar = reinterpret_cast<uint64_t*>(smem + L.bars);  // a's bytes have arrived
  uint64_t* const b_bar = a_bar + 1;                                    // b's and its exponents
  // The W maximum's warp values: e_b is first written after the barrier that ends a's splits.
  float* const scratch = reinterpret_cast<float*>(e_b_s);

  // ---- prologue: independent of the first kernel ----
  if (tid == 0) {
    mbarrier_init(a_bar, 1);
    mbarrier_init(b_bar, 1);
  }
  const float4* const w_src = reinterpret_cast<const float4*>(p.w_out + int64_t(d0) * HH);
  const auto load_w = [&](int idx) { return __ldg(w_src + idx); };
  const int w4 = dvalid * HH / 4;
  float4 wv[kSmallF16VecW];
  load_own_vec4(load_w, w4, wv);
  small_tc_stage_norm(p, b, i0, d0, ti, L.N16, bias_s, den_s, pair_s);
  const int e_w = split_scale_exp_bits(block_abs_max(own_abs_max(load_w, w4, wv), scratch));
  split_rows(load_w, w4, wv, exp2_int(e_w), H, L.ldw, w_hi, w_lo);
  // Rows of d past D: zeros (their columns of P and of the output are never stored).
  for (int idx = tid; idx < (Dc - dvalid) * HH / 4; idx += kSmallTcThreads) {
    const int flat = dvalid * HH + 4 * idx, row = flat >> lg_h;
    const int off = row * L.ldw + (flat & (H - 1));
    *reinterpret_cast<uint2*>(w_hi + off) = make_uint2(0u, 0u);
    *reinterpret_cast<uint2*>(w_lo + off) = make_uint2(0u, 0u);
  }

  asm volatile("griddepcontrol.wait;\n" ::: "memory");

  // ---- copies: a's rows (i, s) of this block and all of b's, as kernel 1 split them ----
  if (tid == 0) {
    const int64_t a_row0 = (int64_t(b) * N + i0) * S;
    const unsigned a_bytes = unsigned(ti * S * L.lda) * 2u, b_bytes = unsigned(N * L.ldk) * 2u;
    const unsigned ea_bytes = unsigned(ti * S4) * 4u;
    const __half* const a_src = static_cast<const __half*>(p.a16) + a_row0 * L.lda;
    const __half* const b_src = static_cast<const __half*>(p.b16) + int64_t(b) * N * L.ldk;
    mbarrier_arrive_expect_tx(a_bar, 2u * a_bytes + ea_bytes);
    bulk_copy_g2s(a_hi, a_src, a_bytes, a_bar);
    bulk_copy_g2s(a_lo, a_src + p.a16_lo, a_bytes, a_bar);
    bulk_copy_g2s(e_a_st, p.a_exp + (int64_t(b) * N + i0) * S4, ea_bytes, a_bar);
    mbarrier_arrive_expect_tx(b_bar, 2u * b_bytes + unsigned(L.NS4) * 4u);
    bulk_copy_g2s(b_hi, b_src, b_bytes, b_bar);
    bulk_copy_g2s(b_lo, b_src + p.b16_lo, b_bytes, b_bar);
    bulk_copy_g2s(e_b_st, p.b_exp + int64_t(b) * L.NS4, unsigned(L.NS4) * 4u, b_bar);
  }
  const int p_exp = -(kSplitTopExp + 1) - lg_h;  // |P'| < H·2^30·2^p_exp = 2^15
  // Row i's common exponent e_i, the smallest of its rows (i, s) (the largest magnitude); phase P
  // takes each row's own scale out and puts e_i in: factor 2^(p_exp + e_i - e_(i,s)) <= 2^p_exp.
  if (warp < ti && !own_a_factors) {
    const int* const e_src = p.a_exp + (int64_t(b) * N + i0 + warp) * S4;
    int e_min = kSplitMaxExp;
    for (int s = lane; s < S; s += 32) e_min = min(e_min, e_src[s]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) e_min = min(e_min, __shfl_xor_sync(0xffffffffu, e_min, o));
    for (int s = lane; s < S; s += 32) p_f[warp * S + s] = exp2_int_or_zero(p_exp + e_min - e_src[s]);
    if (lane == 0) e_a_s[warp] = e_min;
  }
  mbarrier_wait_parity(a_bar, 0);
  __syncthreads();

  // ---- phase P: items (d, 16 rows (i, s), 32 columns h2), k-steps of 16 h1 ----
  {
    const int mtiles = L.R16 / 16, hgroups = (H + 31) / 32;
    const SmallDiv div_mtiles(mtiles), div_s(S);
    for (int item = warp; item < Dc * mtiles * hgroups; item += kSmallTcWarps) {
      const int hg = hgroups == 1 ? 0 : item & 1, rest = hgroups == 1 ? item : item >> 1;
      const int dl = div_mtiles(rest), mt = rest - dl * mtiles;
      const int n_valid = min(4, (H - hg * 32) / 8);  // even: H % 16 == 0
      // n tiles past n_valid are skipped; the whole group (the common case) without predicates
      const auto item_p = [&](auto nv) {
        float acc[4][4];
#pragma unroll
        for (int n = 0; n < 4; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;
        const int a_off = (mt * 16 + (lane & 15)) * L.lda + (lane >> 4) * 8;
        const int mi = lane >> 3;  // ldmatrix.trans of W: matrices (k 0-7 | 8-15) x (n tile 2q | 2q + 1)
        const int w_off = (dl * H + (mi & 1) * 8 + (lane & 7)) * L.ldw + hg * 32 + (mi >> 1) * 8;
        for (int ks = 0; ks < H / 16; ++ks) {
          uint32_t ah[4], al[4], bh[4][2], bl[4][2];
          ldmatrix_x4(ah, a_hi + a_off + ks * 16);
          ldmatrix_x4(al, a_lo + a_off + ks * 16);
#pragma unroll
          for (int q = 0; q < 2; ++q) {
            if (2 * q < nv) {
              uint32_t r[4];
              const int off = w_off + ks * 16 * L.ldw + q * 16;
              ldmatrix_x4_trans(r, w_hi + off);
              bh[2 * q][0] = r[0], bh[2 * q][1] = r[1], bh[2 * q + 1][0] = r[2], bh[2 * q + 1][1] = r[3];
              ldmatrix_x4_trans(r, w_lo + off);
              bl[2 * q][0] = r[0], bl[2 * q][1] = r[1], bl[2 * q + 1][0] = r[2], bl[2 * q + 1][1] = r[3];
            }
          }
          mma_f16_split_add<4>(acc, ah, al, bh, bl, nv);
        }
        // acc[n] = (row g | g + 8, columns 2t, 2t + 1) of n tile n: rows r = (i, s), columns h2.
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = mt * 16 + g + 8 * half;
          if (r >= ti * S) continue;
          const int il = div_s(r), s = r - il * S;
          const int row_off = (il * Dc + dl) * L.ldk + s * hk + hg * 32 + 2 * t;
          float f;
          if (own_a_factors) {
            // The thread's own factor from the copied exponents of row i: no pass over them
            // between a's arrival and phase P.
            const int* const e_row = e_a_st + il * S4;
            const int e_min = min_exp_row(e_row, S, true);
            f = exp2_int_or_zero(p_exp + e_min - e_row[s]);
            if (t == 0 && s == 0) e_a_s[il] = e_min;
          } else {
            f = p_f[r];
          }
#pragma unroll
          for (int n = 0; n < 4; ++n) {
            if (n < nv) {
              uint32_t hi, lo;
              split_f16x2(acc[n][2 * half] * f, acc[n][2 * half + 1] * f, hi, lo);
              *reinterpret_cast<uint32_t*>(p_hi + row_off + n * 8) = hi;
              *reinterpret_cast<uint32_t*>(p_lo + row_off + n * 8) = lo;
            }
          }
        }
      };
      if (n_valid == 4) item_p(std::integral_constant<int, 4>{});
      else item_p(n_valid);
    }
  }

  // ---- b's exponents (copied while phase P ran): row j's common e_j, the smallest of its rows
  // (j, s); phase O scales each k-step's sums over row (j, s) by 2^(e_j - e_(j, s)) <= 1 ----
  mbarrier_wait_parity(b_bar, 0);
  for (int j = warp; j < L.N16 && !own_b_factors; j += kSmallTcWarps) {
    if (j < N) {
      int e_min = kSplitMaxExp;
      for (int s = lane; s < S; s += 32) e_min = min(e_min, e_b_st[j * S + s]);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) e_min = min(e_min, __shfl_xor_sync(0xffffffffu, e_min, o));
      for (int s = lane; s < S; s += 32) b_f[s * L.N16 + j] = exp2_int_or_zero(e_min - e_b_st[j * S + s]);
      if (lane == 0) e_b_s[j] = e_min;
    } else {
      for (int s = lane; s < S; s += 32) b_f[s * L.N16 + j] = 0.f;  // rows past N: never stored
    }
  }
  __syncthreads();

  // ---- phase O: items (16 rows j, kSmallF16GroupN n tiles of columns (i, d), part of K) ----
  {
    const int mtiles = L.N16 / 16, ksteps = SH / 16;
    const int tiles_n = ti * Dc / 8;  // columns of rows i past N are not formed
    const int groups = (TI * Dc / 8 + kSmallF16GroupN - 1) / kSmallF16GroupN;
    const SmallDiv div_items(groups * mtiles), div_mtiles(mtiles);
    for (int item = warp; item < groups * mtiles * L.kparts; item += kSmallTcWarps) {
      const int kp = div_items(item), rest = item - kp * groups * mtiles;
      const int cg = div_mtiles(rest), mt = rest - cg * mtiles;
      const int n_valid = min(kSmallF16GroupN, tiles_n - cg * kSmallF16GroupN);
      if (n_valid <= 0) continue;
      const int k0 = ksteps * kp / L.kparts, k1 = ksteps * (kp + 1) / L.kparts;
      const auto item_o = [&](auto nv) {
        float acc[kSmallF16GroupN][4];
#pragma unroll
        for (int n = 0; n < kSmallF16GroupN; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;
        // Rows j0 = 16·mt + g and j0 + 8: their common exponents (the smallest of their rows (j, s)),
        // the thread's own when own_b_factors (rows past N: factor 0, never stored).
        const int j0 = mt * 16 + g, j1 = j0 + 8;
        int e_j0 = kSplitMaxExp, e_j1 = kSplitMaxExp;
        if (own_b_factors) {
          if (j0 < N) e_j0 = min_exp_row(e_b_st + j0 * S, S, S % 4 == 0);
          if (j1 < N) e_j1 = min_exp_row(e_b_st + j1 * S, S, S % 4 == 0);
          if (t == 0 && kp == 0 && cg == 0) {
            if (j0 < N) e_b_s[j0] = e_j0;
            if (j1 < N) e_b_s[j1] = e_j1;
          }
        }
        const int a_off = (mt * 16 + (lane & 15)) * L.ldk + (lane >> 4) * 8;
        const int mi = lane >> 3;  // ldmatrix of P: matrices (n tile 2q | 2q + 1) x (k 0-7 | 8-15)
        const int p_off = ((cg * kSmallF16GroupN + (mi >> 1)) * 8 + (lane & 7)) * L.ldk + (mi & 1) * 8;
        for (int ks = k0; ks < k1; ++ks) {
          const int kpos = (ks * 16 >> lg_h) * hk + (ks * 16 & (H - 1));  // k = 16·ks in the padded blocks
          uint32_t ah[4], al[4], bh[kSmallF16GroupN][2], bl[kSmallF16GroupN][2];
          ldmatrix_x4(ah, b_hi + a_off + kpos);
          ldmatrix_x4(al, b_lo + a_off + kpos);
#pragma unroll
          for (int q = 0; q < kSmallF16GroupN / 2; ++q) {
            if (2 * q < nv) {
              uint32_t r[4];
              const int off = p_off + q * 16 * L.ldk + kpos;
              ldmatrix_x4(r, p_hi + off);
              bh[2 * q][0] = r[0], bh[2 * q][1] = r[1], bh[2 * q + 1][0] = r[2], bh[2 * q + 1][1] = r[3];
              ldmatrix_x4(r, p_lo + off);
              bl[2 * q][0] = r[0], bl[2 * q][1] = r[1], bl[2 * q + 1][0] = r[2], bl[2 * q + 1][1] = r[3];
            }
          }
          const int s = ks * 16 >> lg_h;
          float f0, f8;
          if (own_b_factors) {
            f0 = j0 < N ? exp2_int_or_zero(e_j0 - e_b_st[j0 * S + s]) : 0.f;
            f8 = j1 < N ? exp2_int_or_zero(e_j1 - e_b_st[j1 * S + s]) : 0.f;
          } else {
            const float* const f = b_f + s * L.N16 + mt * 16 + g;
            f0 = f[0], f8 = f[8];
          }
          mma_f16_split_fma_rows<kSmallF16GroupN>(acc, ah, al, bh, bl, nv, f0, f8);
        }
        float* const r0 = red + (kp * L.N16 + mt * 16 + g) * L.ldr + cg * kSmallF16GroupN * 8 + 2 * t;
#pragma unroll
        for (int n = 0; n < kSmallF16GroupN; ++n) {
          if (n < nv) {
            *reinterpret_cast<float2*>(r0 + n * 8) = make_float2(acc[n][0], acc[n][1]);
            *reinterpret_cast<float2*>(r0 + 8 * L.ldr + n * 8) = make_float2(acc[n][2], acc[n][3]);
          }
        }
      };
      if (n_valid == kSmallF16GroupN) item_o(std::integral_constant<int, kSmallF16GroupN>{});
      else item_o(n_valid);
    }
  }
  __syncthreads();

  // out' = out·2^(e_b[j] + e_a[i] + e_w + p_exp)
  // Items of two columns: at the spec shape every thread of the block has one (run 203).
  small_tc_store_out<true, 2>(p, red, L.ldr, L.N16, L.kparts, bias_s, den_s, pair_s, b, i0, d0, ti, e_a_s, e_b_s,
                              e_w + p_exp);
#else
  target_lacks_instructions();
#endif
}

}  // namespace flashopm
