// Small problems on tensor cores (see SmallTcArgs in opm_params.h).
//
// Block (d chunk, tile of TI rows i, batch b), 16 warps:
//   prologue   W fragments of each warp's first k-steps, bias, row denominators or pair counts:
//              none of it depends on a or b, so it overlaps the front end;
//   front end  one launch: x rows in, LayerNorm, this block's rows of a and its share of b's
//              rows, cluster barrier, the peers' shares of b read from their shared memory;
//              two launches: griddepcontrol.wait (the projection kernel's results are complete
//              and visible), then a[b, i0 : i0 + TI] (TI·S·H) and b[b, :] (N·S·H) copied in;
//   phase P    P[(h2, d), (i, s)] = sum_h1 W[d, h1·H + h2] · a[i, s, h1]      A = W (global), B = a
//              (stored as P[i][d][s][h2])
//   phase O    out[i, j, d] = sum_k b[j, k] · P[i, d, k],  k = (s, h2)          A = b, B = P
//              K split over warps when TI and N give too few row tiles; parts summed in a fixed
//              order;
//   epilogue   normalisation and bias, 16-byte stores along d.
// Fragment rows of phase P are permuted (row g holds m = 2g, row g + 8 holds m = 2g + 1) so that
// each thread's two A values per column are adjacent in W and load as one 8-byte word.
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

template <int kTerms>
__device__ __forceinline__ void split4(const float (&v)[4], uint32_t (&hi)[4], uint32_t (&lo)[4]) {
#pragma unroll
  for (int e = 0; e < 4; ++e) split_tf32<kTerms>(v[e], hi[e], lo[e]);
}

// One-launch front end.  Rows of x: this block's rows of a (r = il·S + s, padded to R8), then its
// share of b's rows (g = j·S + s for g in [rank·Rb, rank·Rb + Rb)).  Each is LayerNormed in
// shared memory and projected: a with Wa into `as`, the share of b with Wb into this block's own
// `bs`, where every block of the cluster then reads it (16-byte loads from distributed shared
// memory, after a cluster barrier).  Returns with a and b complete in shared memory; the caller
// must end with cluster_wait() (peers may still be reading this block's share until then).
// Padding rows of as and bs must be zero already.
__device__ __forceinline__ void small_tc_front_end(const SmallTcArgs& p, const SmallTcLayout& L, float* smem,
                                                   int b, int i0, int ti) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank());
  const int g0 = rank * L.Rb;
  const int S = p.S, N = p.N, C = p.C, H = p.H;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int R = L.R8 + L.Rb;
  float* as = smem + L.a;
  float* bs = smem + L.b;
  float* xs = smem + L.xs;      // [R][ldx]
  float* wta = smem + L.wta;    // [C][ldw]   Wa^T
  float* wtb = smem + L.wtb;    // [C][ldw]   Wb^T
  float* mrow = smem + L.mrow;  // [R]
  float* gam = smem + L.gam;    // [C]
  float* bet = smem + L.bet;    // [C]
  float* bab = smem + L.bab;    // [2][H]     ba, bb (zero when absent)
  // (s, n) of row r, and whether it exists
  auto row_of = [&](int r, int& s, int& n) -> bool {
    if (r < L.R8) {
      const int il = r / S;
      s = r - il * S;
      n = i0 + il;
      return r < ti * S;
    }
    const int g = g0 + (r - L.R8);
    n = g / S;
    s = g - n * S;
    return g < N * S;
  };

  // ---- everything the front end reads, in flight at once ----
  const bool vec_x = (C % 4) == 0 && ((p.x_sb | p.x_ss | p.x_sn) % 4) == 0 &&
                     (reinterpret_cast<uintptr_t>(p.x) & 15) == 0;
  const int per_row = vec_x ? C / 4 : C;
  for (int idx = tid; idx < R * per_row; idx += kSmallTcThreads) {
    const int r = idx / per_row, q = idx - r * per_row;
    int s, n;
    const bool valid = row_of(r, s, n);
    const float* src = p.x + int64_t(b) * p.x_sb + int64_t(s) * p.x_ss + int64_t(n) * p.x_sn;
    if (vec_x)
      cp_async16z(&xs[r * L.ldx + 4 * q], valid ? src + 4 * q : p.x, valid);
    else
      cp_async4(&xs[r * L.ldx + q], valid ? src + q : p.x, valid);
  }
  for (int idx = tid; idx < H * C; idx += kSmallTcThreads) {
    const int h = idx / C, c = idx - h * C;
    cp_async4(&wta[c * L.ldw + h], p.wa + idx, true);
    cp_async4(&wtb[c * L.ldw + h], p.wb + idx, true);
  }
  for (int c = tid; c < C; c += kSmallTcThreads) {
    cp_async4(&gam[c], p.ln_w + c, true);
    cp_async4(&bet[c], p.ln_b + c, true);
  }
  for (int h = tid; h < H; h += kSmallTcThreads) {
    cp_async4(&bab[h], p.ba != nullptr ? p.ba + h : p.wa, p.ba != nullptr);
    cp_async4(&bab[H + h], p.bb != nullptr ? p.bb + h : p.wb, p.bb != nullptr);
  }
  cp_async_commit();
  for (int r = tid; r < R; r += kSmallTcThreads) {
    int s, n;
    mrow[r] = row_of(r, s, n) ? mask_at(p.mask, b, s, n) : 0.f;
  }
  cp_async_wait_all();
  __syncthreads();

  // ---- LayerNorm in place, one warp per row (two passes over the row, as the projection kernel) ----
  for (int r = warp; r < R; r += kSmallTcWarps) {
    int s, n;
    if (!row_of(r, s, n)) continue;
    float* xr = xs + r * L.ldx;
    float sum = 0.f;
    for (int c = lane; c < C; c += 32) sum += xr[c];
    const float mean = warp_sum(sum) / C;
    float sq = 0.f;
    for (int c = lane; c < C; c += 32) {
      const float dv = xr[c] - mean;
      sq += dv * dv;
    }
    const float rstd = rsqrtf(warp_sum(sq) / C + p.ln_eps);
    for (int c = lane; c < C; c += 32) xr[c] = (xr[c] - mean) * rstd * gam[c] + bet[c];
  }
  __syncthreads();

  // ---- projections: thread item = (4 rows, one h); sums over C in chunks of 32, in order ----
  const int a_groups = L.R8 / 4;
  for (int item = tid; item < (R / 4) * H; item += kSmallTcThreads) {
    const int rg = item / H, h = item - rg * H;
    const bool is_a = rg < a_groups;
    const int r0 = 4 * rg;
    if (is_a ? r0 >= ti * S : g0 + r0 - L.R8 >= N * S) continue;
    const float* wt = (is_a ? wta : wtb) + h;
    const float* xr = xs + r0 * L.ldx;
    float acc[4] = {0.f, 0.f, 0.f, 0.f}, part[4] = {0.f, 0.f, 0.f, 0.f};
    const int c4 = C / 4;
    for (int q = 0; q < c4; ++q) {
      const float w0 = wt[(4 * q) * L.ldw], w1 = wt[(4 * q + 1) * L.ldw];
      const float w2 = wt[(4 * q + 2) * L.ldw], w3 = wt[(4 * q + 3) * L.ldw];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const float4 xv = *reinterpret_cast<const float4*>(xr + r * L.ldx + 4 * q);
        part[r] = fmaf(xv.x, w0, part[r]);
        part[r] = fmaf(xv.y, w1, part[r]);
        part[r] = fmaf(xv.z, w2, part[r]);
        part[r] = fmaf(xv.w, w3, part[r]);
      }
      if ((q & 7) == 7) {
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[r] += part[r], part[r] = 0.f;
      }
    }
    for (int c = 4 * c4; c < C; ++c) {
      const float w = wt[c * L.ldw];
#pragma unroll
      for (int r = 0; r < 4; ++r) part[r] = fmaf(xr[r * L.ldx + c], w, part[r]);
    }
    const float bias = bab[(is_a ? 0 : H) + h];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const float v = (acc[r] + part[r] + bias) * mrow[r0 + r];
      if (is_a) {
        if (r0 + r < ti * S) as[(r0 + r) * L.lda + h] = v;
      } else {
        const int g = g0 + r0 + r - L.R8;
        if (g >= N * S) break;
        const int j = g / S, s = g - j * S;
        bs[j * L.ldb + s * H + h] = v;
      }
    }
  }
  // ---- the peers' shares of b, 16 bytes at a time (a share is whole rows (j, s) of H floats) ----
  cluster_sync();
  const int h4 = H / 4;
  for (int idx = tid; idx < N * S * h4; idx += kSmallTcThreads) {
    const int g = idx / h4, hq = idx - g * h4;
    const int owner = g / L.Rb;
    if (owner == rank || ti == 0) continue;
    const int j = g / S, s = g - j * S;
    float* dst = bs + j * L.ldb + s * H + 4 * hq;
    *reinterpret_cast<float4*>(dst) = *reinterpret_cast<const float4*>(cluster.map_shared_rank(dst, owner));
  }
  cluster_arrive();  // this block is done reading its peers
  __syncthreads();
#endif
}

template <int kTerms, bool kOneLaunch>
__global__ void __launch_bounds__(kSmallTcThreads, 1) opm_small_tc_kernel(const SmallTcArgs p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ float4 smem_f4[];
  float* smem = reinterpret_cast<float*>(smem_f4);
  const int S = p.S, N = p.N, H = p.H, TI = p.TI, Dc = p.Dc;
  const SmallTcLayout L = small_tc_layout(S, N, p.C, H, TI, Dc, p.CL);
  const int SH = S * H;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int d0 = blockIdx.x * Dc, i0 = blockIdx.y * TI, b = blockIdx.z;
  const int ti = max(0, min(TI, N - i0));  // rows i of this block (none in a cluster's padding tiles)
  float* as = smem + L.a;      // [R8][lda]        a[b, i0 + r / S, r % S, h1], rows past ti·S zero
  float* bs = smem + L.b;      // [N16][ldb]       b[b, j, s·H + h2], rows j >= N zero
  float* ps = smem + L.p;      // [TI·Dc][ldp]     P[i][d][s·ldps + h2]
  float* red = smem + L.red;   // [kparts][TI][N16][ldr]
  float* pair_s = smem + L.pair;  // [TI][N16]
  float* bias_s = smem + L.bias;
  float* den_s = smem + L.den;

  // ---- prologue: independent of a and b ----
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
  if (ti > 0 && warp < items_p) load_w_batch((warp % groups_p) * 4, 0);
  for (int dl = tid; dl < Dc; dl += kSmallTcThreads)
    bias_s[dl] = (p.bias != nullptr && d0 + dl < p.D) ? p.bias[d0 + dl] : 0.f;
  if (p.norm.kind == kNormRow) {
    if (warp < ti) {
      const float den = mask_denominator(p.mask, b, i0 + warp, S, lane);
      if (lane == 0) den_s[warp] = den;
    }
  } else {
    for (int idx = tid; idx < ti * L.N16; idx += kSmallTcThreads) {
      const int il = idx / L.N16, j = idx - il * L.N16;
      float sum = 0.f;  // sum_s m[s, i] m[s, j], in order of s
      if (j < N)
        for (int s = 0; s < S; ++s) sum += mask_at(p.mask, b, s, i0 + il) * mask_at(p.mask, b, s, j);
      pair_s[idx] = sum;
    }
  }
  // Zero padding rows (never written by the copies below).
  for (int idx = tid; idx < (L.R8 - ti * S) * L.lda; idx += kSmallTcThreads) as[ti * S * L.lda + idx] = 0.f;
  for (int idx = tid; idx < (L.N16 - N) * L.ldb; idx += kSmallTcThreads) bs[N * L.ldb + idx] = 0.f;

  if constexpr (kOneLaunch) {
    small_tc_front_end(p, L, smem, b, i0, ti);
    if (ti == 0) {
      cluster_wait();
      return;
    }
  } else {
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    // a[b, i0 : i0 + ti] and b[b, :] (rows of H and S·H floats)
    const int h4 = H / 4, q_row = SH / 4;
    const float* a_src = p.a + (int64_t(b) * N + i0) * SH;
    for (int idx = tid; idx < ti * S * h4; idx += kSmallTcThreads) {
      const int r = idx / h4, h = 4 * (idx - r * h4);
      cp_async16(&as[r * L.lda + h], a_src + int64_t(r) * H + h);
    }
    const float* b_src = p.b + int64_t(b) * N * SH;
    for (int idx = tid; idx < N * q_row; idx += kSmallTcThreads) {
      const int j = idx / q_row, k = 4 * (idx - j * q_row);
      cp_async16(&bs[j * L.ldb + k], b_src + int64_t(j) * SH + k);
    }
    cp_async_commit();
    cp_async_wait_all();
    __syncthreads();
  }

  // ---- phase P ----
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
  __syncthreads();

  // ---- phase O ----
  const int mtiles_o = L.N16 / 16, ksteps_o = SH / 8, ntiles_o = Dc / 8;
  for (int item = warp; item < TI * mtiles_o * L.kparts; item += kSmallTcWarps) {
    const int kp = item / (TI * mtiles_o), rest = item - kp * TI * mtiles_o;
    const int il = rest / mtiles_o, mt = rest - il * mtiles_o;
    if (il >= ti) continue;
    const int k0 = ksteps_o * kp / L.kparts, k1 = ksteps_o * (kp + 1) / L.kparts;
    float acc[kSmallTcMaxDc / 8][4];
#pragma unroll
    for (int n = 0; n < kSmallTcMaxDc / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;
    const float* brow = bs + (mt * 16 + g) * L.ldb + t;
    const float* prow = ps + (il * Dc + g) * L.ldp + t;
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
    float* r0 = red + ((kp * TI + il) * L.N16 + mt * 16 + g) * L.ldr + 2 * t;
#pragma unroll
    for (int n = 0; n < kSmallTcMaxDc / 8; ++n) {
      if (n < ntiles_o) {
        *reinterpret_cast<float2*>(r0 + n * 8) = make_float2(acc[n][0], acc[n][1]);
        *reinterpret_cast<float2*>(r0 + 8 * L.ldr + n * 8) = make_float2(acc[n][2], acc[n][3]);
      }
    }
  }
  __syncthreads();

  // ---- epilogue: sum the K parts in order, normalise, store rows of Dc floats ----
  const int dvalid = min(Dc, p.D - d0);
  const int quads = Dc / 4;
  const bool vec_out = (p.D % 4) == 0;
  for (int idx = tid; idx < ti * N * quads; idx += kSmallTcThreads) {
    const int row = idx / quads, dl = 4 * (idx - row * quads);  // row = il·N + j
    if (dl >= dvalid) continue;
    const int il = row / N, j = row - il * N;
    const float* src = red + (il * L.N16 + j) * L.ldr + dl;
    float4 v = *reinterpret_cast<const float4*>(src);
    for (int kp = 1; kp < L.kparts; ++kp) {
      const float4 w = *reinterpret_cast<const float4*>(src + kp * TI * L.N16 * L.ldr);
      v.x += w.x, v.y += w.y, v.z += w.z, v.w += w.w;
    }
    float r[4] = {v.x, v.y, v.z, v.w};
    if (p.norm.kind == kNormRow) {
      const float inv_den = 1.f / den_s[il];
#pragma unroll
      for (int c = 0; c < 4; ++c) r[c] = r[c] * inv_den + bias_s[dl + c];
    } else {
      const float pair = pair_s[il * L.N16 + j];
#pragma unroll
      for (int c = 0; c < 4; ++c) r[c] = normalise(r[c], bias_s[dl + c], 0.f, pair, p.norm);
    }
    float* dst = p.out + ((int64_t(b) * N + i0 + il) * N + j) * p.D + d0 + dl;
    if (vec_out && dl + 4 <= dvalid) {
      *reinterpret_cast<float4*>(dst) = make_float4(r[0], r[1], r[2], r[3]);
    } else {
      for (int c = 0; c < 4 && dl + c < dvalid; ++c) dst[c] = r[c];
    }
  }
  if constexpr (kOneLaunch) cluster_wait();  // no peer reads this block's share of b any more
#endif
}

}  // namespace flashopm
