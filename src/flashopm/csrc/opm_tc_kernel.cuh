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
// Requires H % 8 == 0 (a k-step of 8 never crosses h1 in phase 2, and every row of a tile is
// 16-byte aligned for cp.async) and 16-byte aligned a, b and W.
#pragma once

#include "opm_kernels.cuh"
#include "opm_mma.cuh"

namespace flashopm {

template <int kTerms>
__global__ void __launch_bounds__(kTcThreads, 1) opm_outer_tc_kernel(const OuterArgs p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  extern __shared__ float4 smem_f4[];
  float* smem = reinterpret_cast<float*>(smem_f4);
  const TcLayout L = tc_layout(p.H, p.Ti, p.Tj);
  float* den_s = smem + L.den;
  int64_t* row_off = reinterpret_cast<int64_t*>(smem + L.rows);         // [kTcRoundRows]
  float* norm_arg = reinterpret_cast<float*>(row_off + kTcRoundRows);   // [kTcRoundRows]
  const int H = p.H, N = p.N, S = p.S, D = p.D, Ti = p.Ti, Tj = p.Tj;
  const int P = Ti * Tj;
  const int b = blockIdx.z;
  int col_tile, row_tile;
  grouped_tile(col_tile, row_tile);
  const int i0 = row_tile * Ti, j0 = col_tile * Tj;  // i0 local to this row block
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;  // fragment coordinates (PTX: groupID, threadID_in_group)
  const int64_t NH = int64_t(N) * H, NaH = int64_t(p.Na) * H;

  // ---------------- phase 1: warps 2 (m) x 4 (n), 64 x 64 each ----------------
  const int wm = warp & 1, wn = warp >> 1;
  float acc[4][8][4];
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;

  const int a_lim = min(Ti * H, (p.Na - i0) * H);  // valid columns of the tile (multiples of 8)
  const int b_lim = min(Tj * H, (N - j0) * H);
  const float* a_base = static_cast<const float*>(p.a) + int64_t(b) * S * NaH + int64_t(i0) * H;
  const float* b_base = static_cast<const float*>(p.b) + int64_t(b) * S * NH + int64_t(j0) * H;
  const float* w_out = static_cast<const float*>(p.w_out);

  auto load_stage = [&](int buf, int s0) {
    float* As = smem + buf * kTcStageFloats;  // [BK][LdA]
    float* Bs = As + kTcBK * kTcLdA;          // [BK][LdB]
#pragma unroll
    for (int u = 0; u < kTcBK * kTcMT / 4 / kTcThreads; ++u) {
      const int idx = tid + u * kTcThreads;
      const int k = idx / (kTcMT / 4), m = (idx % (kTcMT / 4)) * 4;
      const bool ok = (s0 + k < S) && (m < a_lim);
      cp_async16z(&As[k * kTcLdA + m], ok ? a_base + int64_t(s0 + k) * NaH + m : a_base, ok);
    }
#pragma unroll
    for (int u = 0; u < kTcBK * kTcNT / 4 / kTcThreads; ++u) {
      const int idx = tid + u * kTcThreads;
      const int k = idx / (kTcNT / 4), n = (idx % (kTcNT / 4)) * 4;
      const bool ok = (s0 + k < S) && (n < b_lim);
      cp_async16z(&Bs[k * kTcLdB + n], ok ? b_base + int64_t(s0 + k) * NH + n : b_base, ok);
    }
  };

  const int n_k = (S + kTcBK - 1) / kTcBK;
#pragma unroll
  for (int st = 0; st < kTcStages - 1; ++st) {
    if (st < n_k) load_stage(st, st * kTcBK);
    cp_async_commit();
  }
  // Row denominators of the tile (read in the epilogue, after several barriers), computed while
  // the first stages are in flight; the other conventions' pair counts come in p.pair.
  if (p.norm.kind == kNormRow) {
    for (int il = warp; il < Ti; il += kTcThreads / 32) {
      const float den = mask_denominator(p.mask, b, min(i0 + il, p.Na - 1) + p.i_offset, S, lane);
      if (lane == 0) den_s[il] = den;
    }
  }

  for (int kt = 0; kt < n_k; ++kt) {
    cp_async_wait<kTcStages - 2>();
    __syncthreads();
    const int next = kt + kTcStages - 1;
    if (next < n_k) load_stage(next % kTcStages, next * kTcBK);
    cp_async_commit();
    const float* As = smem + (kt % kTcStages) * kTcStageFloats + wm * 64 + g;
    const float* Bs = smem + (kt % kTcStages) * kTcStageFloats + kTcBK * kTcLdA + wn * 64 + g;
#pragma unroll
    for (int kk = 0; kk < kTcBK; kk += 8) {
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
      for (int nt = 0; nt < 8; ++nt) {
        const float* bp = Bs + (kk + t) * kTcLdB + nt * 8;
        uint32_t bh0, bh1, bl0 = 0, bl1 = 0;
        split_tf32<kTerms>(bp[0], bh0, bl0);
        split_tf32<kTerms>(bp[4 * kTcLdB], bh1, bl1);
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) mma_split_add<kTerms>(acc[mt][nt], a_hi[mt], a_lo[mt], bh0, bh1, bl0, bl1);
      }
    }
  }
  cp_async_wait_all();
  __syncthreads();  // every warp done with the stages: O may overwrite them

  // O as [pair][h1·H + h2], pair = il·Tj + jl: a k-step of phase 2 reads 8 consecutive floats
  // of 16 pairs, conflict-free with the row stride H² + 4.
  float* Os = smem;
  {
    int jl_of[8], h2_of[8];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const int n = wn * 64 + nt * 8 + 2 * t;
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
        for (int nt = 0; nt < 8; ++nt) {
          if (jl_of[nt] >= Tj) continue;
          float* dst = Os + (il * Tj + jl_of[nt]) * L.ldo + h1 * H + h2_of[nt];
          *reinterpret_cast<float2*>(dst) = make_float2(acc[mt][nt][2 * half], acc[mt][nt][2 * half + 1]);
        }
      }
  }

  // ---------------- phase 2: warps 4 (32 d each) x 2 (halves of each k chunk) ----------------
  const int K2 = H * H;
  const int n_kc = K2 / kTcKC;
  const int dw = warp & 3, kh = warp >> 2;
  float* Wst = smem + L.w;  // [kTcWStages][DG][LdW]; after the k loop, the partial sums [32][DG + 4]

  auto load_w = [&](int buf, int dg, int kc0) {
    float* Ws = Wst + buf * kTcDG * kTcLdW;
#pragma unroll
    for (int u = 0; u < kTcDG * kTcKC / 4 / kTcThreads; ++u) {
      const int idx = tid + u * kTcThreads;
      const int dl = idx / (kTcKC / 4), k = (idx % (kTcKC / 4)) * 4;
      const bool ok = dg + dl < D;
      cp_async16z(&Ws[dl * kTcLdW + k], ok ? w_out + int64_t(dg + dl) * K2 + kc0 + k : w_out, ok);
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
        if (st < n_kc) load_w(st, dg, st * kTcKC);
        cp_async_commit();
      }
      for (int kc = 0; kc < n_kc; ++kc) {
        cp_async_wait<kTcWStages - 2>();
        __syncthreads();
        const int next = kc + kTcWStages - 1;
        if (next < n_kc) load_w(next % kTcWStages, dg, next * kTcKC);
        cp_async_commit();
        const float* Ws = Wst + (kc % kTcWStages) * kTcDG * kTcLdW + (dw * 32 + g) * kTcLdW + t;
        // this chunk's sum in its own fragments (see mma_split_add), added in float32 below
        float part[2][4][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) part[mt][nt][e] = 0.f;
#pragma unroll
        for (int ks = 0; ks < 2; ++ks) {
          const int kl = (2 * kh + ks) * 8;  // k within the chunk
          const int k = kc * kTcKC + kl;
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
            const float* wp = Ws + nt * 8 * kTcLdW + kl;
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
      if (tid < kTcRoundRows) {
        const int pr = r0 + tid;
        const int il = pr / Tj, jl = pr - il * Tj;
        stage_pair_row<false>(p, tid, pr < P && i0 + il < p.Na && j0 + jl < N, b, i0, il, j0, jl, N, D,
                     den_s, row_off, norm_arg);
      }
      sum_k_halves<2>(red, kRedLd, acc2, kh, dw * 32, g, t);
      store_round<kTcRoundRows, false>(p, red, kRedLd, row_off, norm_arg, dg, tid, kTcThreads);
    }
  }
#endif
}

}  // namespace flashopm
