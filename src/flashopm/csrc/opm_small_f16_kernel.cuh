// Second kernel of the two-launch path for small problems, float16 split form (hidden 16, 32 or
// 64; regions in SmallF16Layout, opm_params.h).  The same block and the same sums as
// opm_small_tc_kernel, with phases P and O on mma.sync m16n8k16:
//
// Block (d chunk, tile of TI rows i, batch b), 16 warps:
//   prologue  W's chunk into registers, its largest magnitude over the block, then split into
//             shared memory; bias, row denominators or pair counts (small_tc_stage_norm): nothing
//             here depends on the first kernel, so it overlaps it;
//   wait      griddepcontrol.wait (a and b, as (B, N, S, H), complete and visible);
//   copy      each warp copies its row of a (row i: warp i) into shared memory, scales and splits
//             it as soon as it arrives (no block barrier); b's rows, the same for every block of
//             a batch, arrive in bulk copies counted by an mbarrier: in a cluster of blocks along
//             the tiles of i, each block copies a share of them into every block of the cluster
//             (multicast), so that L2 serves b once per cluster; b's rows are split after phase
//             P, so that their copies overlap it (rows j = warp + 16k by warp);
//   phase P   for each d: P[(i, s), h2] = sum_h1 a[(i, s), h1] · W[d, h1·H + h2]   (M = TI·S, N = K = H)
//             stored split as rows (i, d) of k = (s, h2);
//   phase O   out[j, (i, d)] = sum_k b[j, k] · P[(i, d), k]                       (M = N, N = TI·Dc, K = S·H)
//             K split over warps, the parts summed in order by the epilogue;
//   epilogue  the scales taken out, normalisation and bias (small_tc_store_out).
//
// Scales (powers of two, kSplitTopExp): one for the block's chunk of W (e_w), one per row i of a
// (e_a[i], over s and h1) and one per row j of b (e_b[j], over s and h2); P from the bound
// |sum_h1 a'·W'| < H·2^30, so that one factor holds along phase O's K for each column (i, d).
// With every scaled operand below 2^15, the largest products are exact and the sums far from
// float32's range; values far below their row's largest lose bits only below 2^-25 of the scaled
// bound, under float32's rounding of the sums they enter.
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

// Row `row` of `len` floats (len = S·H, H = 2^lg_h) at src (shared memory) scaled by 2^e and split
// into 16-bit rows at hi / lo + off(s, h) (four halves per float4), e from the row's largest
// magnitude: by one warp, without a block barrier.  Returns e.
template <typename Off>
__device__ __forceinline__ int split_row_warp(const float* src, int len, int lg_h, __half* hi, __half* lo, Off off) {
  const int lane = threadIdx.x & 31;
  const float4* src4 = reinterpret_cast<const float4*>(src);
  float m = 0.f;
  for (int c = lane; c < len / 4; c += 32) m = abs_max4(m, src4[c]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  const int e = split_scale_exp_bits(m);
  const float f = exp2_int(e);
  const int hmask = (1 << lg_h) - 1;
  for (int c = lane; c < len / 4; c += 32) {
    const int col = 4 * c;
    store_split4(hi, lo, off(col >> lg_h, col & hmask), src4[c], f);
  }
  return e;
}

// Waits for this thread's copies (a compiler barrier too: shared-memory reads stay after it).
__device__ __forceinline__ void cp_async_wait_pending0() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

__global__ void __maxnreg__(96) opm_small_f16_kernel(const SmallTcArgs p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
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
  float* const a_st = reinterpret_cast<float*>(smem + L.a_st);
  float* const b_st = reinterpret_cast<float*>(smem + L.b_st);
  float* const red = reinterpret_cast<float*>(smem + L.red);
  float* const pair_s = reinterpret_cast<float*>(smem + L.pair);
  float* const bias_s = reinterpret_cast<float*>(smem + L.bias);
  float* const den_s = reinterpret_cast<float*>(smem + L.den);
  int* const e_a_s = reinterpret_cast<int*>(smem + L.e_a);
  int* const e_b_s = reinterpret_cast<int*>(smem + L.e_b);
  uint64_t* const b_bar = reinterpret_cast<uint64_t*>(smem + L.bar);  // b's bytes have arrived
  // The W maximum's warp values: e_b is first written after the barrier that ends a's splits.
  float* const scratch = reinterpret_cast<float*>(e_b_s);

  // ---- prologue: independent of the first kernel ----
  const unsigned cl_blocks = cluster_blocks();
  if (tid == 0) mbarrier_init(b_bar, 1);
  // The peers' copies into this block count on its mbarrier: initialised before any is issued.
  if (cl_blocks > 1) cluster_arrive_release();
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

  // ---- copies: warp w takes row i0 + w of a (w < ti) and rows j = w + 16k of b ----
  const int sh4 = SH / 4;
  if (warp < ti) {
    const float* src = p.a + (int64_t(b) * N + i0 + warp) * SH;
    for (int c = lane; c < sh4; c += 32) cp_async16(a_st + warp * SH + 4 * c, src + 4 * c);
  }
  cp_async_commit();
  if (cl_blocks > 1) cluster_wait_acquire();
  if (tid == 0) {
    // This block's share of b's rows, [j0, j1), into every block of the cluster; N·SH·4 bytes
    // arrive here in all.
    const unsigned rank = cluster_rank();
    const int j0 = int(int64_t(N) * rank / cl_blocks), j1 = int(int64_t(N) * (rank + 1) / cl_blocks);
    mbarrier_arrive_expect_tx(b_bar, unsigned(N) * unsigned(SH) * 4u);
    if (j1 > j0)
      bulk_copy_g2s(b_st + j0 * SH, p.b + (int64_t(b) * N + j0) * SH, unsigned(j1 - j0) * unsigned(SH) * 4u, b_bar,
                    static_cast<unsigned short>((1u << cl_blocks) - 1u));
  }
  cp_async_wait_pending0();
  __syncwarp();
  if (warp < ti) {
    const int e = split_row_warp(a_st + warp * SH, SH, lg_h, a_hi, a_lo,
                                 [&](int s, int h) { return (warp * S + s) * L.lda + h; });
    if (lane == 0) e_a_s[warp] = e;
  }
  __syncthreads();

  // ---- phase P: items (d, 16 rows (i, s), 32 columns h2), k-steps of 16 h1 ----
  const int p_exp = -(kSplitTopExp + 1) - lg_h;  // |P'| < H·2^30·2^p_exp = 2^15
  {
    const float p_scale = exp2_int(p_exp);
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
#pragma unroll
          for (int n = 0; n < 4; ++n) {
            if (n < nv) {
              uint32_t hi, lo;
              split_f16x2(acc[n][2 * half] * p_scale, acc[n][2 * half + 1] * p_scale, hi, lo);
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

  // ---- b's rows, copied while phase P ran ----
  mbarrier_wait_parity(b_bar, 0);
  for (int j = warp; j < N; j += kSmallTcWarps) {
    const int e = split_row_warp(b_st + j * SH, SH, lg_h, b_hi, b_lo,
                                 [&](int s, int h) { return j * L.ldk + s * hk + h; });
    if (lane == 0) e_b_s[j] = e;
  }
  // Every block of the cluster has all of b's rows (no copy into it is still in flight) once
  // every block has passed this point: the barrier's wait before the exit.
  if (cl_blocks > 1) cluster_arrive_relaxed();
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
          mma_f16_split_add<kSmallF16GroupN>(acc, ah, al, bh, bl, nv);
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
  small_tc_store_out<true>(p, red, L.ldr, L.N16, L.kparts, bias_s, den_s, pair_s, b, i0, d0, ti, e_a_s, e_b_s,
                           e_w + p_exp);
  if (cl_blocks > 1) cluster_wait();
#endif
}

}  // namespace flashopm
