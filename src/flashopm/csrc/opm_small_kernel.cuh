// The single-launch path for small problems (the latency-bound regime, e.g. the spec shape).
//
// One kernel does everything, project-first:
//   a, b   = (LayerNorm(x) · Wa^T + ba) * m, (likewise b)              per block, from x in smem
//   P[i,s,h2,d] = sum_h1 a[s,i,h1] · W[d, h1*H + h2]                    (TI rows i, Dc columns d)
//   out[i,j,d]  = (sum_{s,h2} b[s,j,h2] · P[i,s,h2,d]) / den[i] + bias[d]   (or a pair
//                 normalisation of OpenFold or Boltz: see NormKind)
// Block (tile of TI rows i, chunk of Dc columns d, batch b) needs b for all (s, j).  Blocks of a
// thread-block cluster (along the i tiles) split that projection: each computes S·N/CL rows and
// pushes them into every peer's shared memory (distributed shared memory, sm_90), so the
// projection of b is done once per cluster rather than once per block.  Nothing but the output
// touches global memory; all operands stay in shared memory; every contraction is a register-
// tiled (4×4) shared-memory GEMM with a fixed summation order (bitwise-repeatable).
#pragma once

#include <cooperative_groups.h>

#include "opm_kernels.cuh"

namespace flashopm {


// C[m][n] = sum_k At[k][m] · Bk[k][n] over a block of kSmallThreads threads, in 4×4 register
// tiles.  Operands in shared memory: tile (tm, tn) reads a float4 at ptrs.a + k·lda, and its
// four B values at ptrs.b + k·ldb (+ c·b_gather when b_gather != 0, else one float4): the
// gather reads an operand in the layout it arrived in, where transposing it would cost bank
// conflicts.  K is split over otherwise idle threads (partial sums added in a fixed order);
// within a thread the sum is two-level (chunks of 64) for accuracy at large K.
// `epi(tm, tn, acc)` gets acc[r][c] = C[4tm + r][4tn + c].  Every thread must call this.
// Everything here is run-time (no template per use): one copy of the code serves every
// contraction of the kernel, which keeps the kernel small enough for the instruction cache.
struct TilePtrs {
  const float* a;
  const float* b;
};

struct GemmShape {
  int tiles_m, tiles_n, K, lda, ldb, b_gather;
  bool m_fastest;
  float* part;  // (ksplit - 1) · tiles · 16 floats when K is split
};

// Shared-memory loads through 32-bit shared addresses: operand pointers reach the GEMM through
// a run-time switch, where the compiler loses their address space and would emit generic loads.
__device__ __forceinline__ unsigned shared_addr(const float* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ float4 ld_shared4(unsigned a) {
  float4 v;
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(a));
  return v;
}
__device__ __forceinline__ float ld_shared1(unsigned a) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(a));
  return v;
}

template <bool kGather>
__device__ __forceinline__ void load_operands(unsigned a, unsigned b, unsigned gather_bytes, float (&ar)[4],
                                              float (&br)[4]) {
  const float4 av = ld_shared4(a);
  ar[0] = av.x, ar[1] = av.y, ar[2] = av.z, ar[3] = av.w;
  if (kGather) {
#pragma unroll
    for (int c = 0; c < 4; ++c) br[c] = ld_shared1(b + c * gather_bytes);
  } else {
    const float4 bv = ld_shared4(b);
    br[0] = bv.x, br[1] = bv.y, br[2] = bv.z, br[3] = bv.w;
  }
}

// acc += sum over k in [k0, k1) of a[k] (x) b[k].  The operands of step k+1 are loaded while
// step k computes (few warps per scheduler would leave the shared-memory latency exposed).
template <bool kGather>
__device__ __forceinline__ void tile_mac(float (&acc)[4][4], const float* a_ptr, int lda, const float* b_ptr,
                                         int ldb, int b_gather, int k0, int k1) {
  if (k0 >= k1) return;
  const unsigned lda_b = unsigned(lda) * 4u, ldb_b = unsigned(ldb) * 4u, gather_b = unsigned(b_gather) * 4u;
  unsigned a = shared_addr(a_ptr) + unsigned(k0) * lda_b;
  unsigned b = shared_addr(b_ptr) + unsigned(k0) * ldb_b;
  float ar[4], br[4];
  load_operands<kGather>(a, b, gather_b, ar, br);
  for (int kc = k0; kc < k1; kc += 64) {
    float t[4][4];
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int c = 0; c < 4; ++c) t[r][c] = 0.f;
    const int ke = min(kc + 64, k1);
#pragma unroll 4
    for (int k = kc; k < ke; ++k) {
      const bool more = k + 1 < k1;  // the last step re-reads its own operands, no branch
      a += more ? lda_b : 0u;
      b += more ? ldb_b : 0u;
      float an[4], bn[4];
      load_operands<kGather>(a, b, gather_b, an, bn);
#pragma unroll
      for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int c = 0; c < 4; ++c) t[r][c] = fmaf(ar[r], br[c], t[r][c]);
#pragma unroll
      for (int c = 0; c < 4; ++c) ar[c] = an[c], br[c] = bn[c];
    }
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[r][c] += t[r][c];
  }
}

template <typename PtrsFn, typename Epilogue>
__device__ __forceinline__ void block_gemm_4x4(const GemmShape& g, PtrsFn ptrs_of, Epilogue epi) {
  const int tiles = g.tiles_m * g.tiles_n;
  const int ksplit = small_gemm_ksplit(tiles, g.K);
  const int items = tiles * ksplit;
  auto split_tile = [&](int t, int& tm, int& tn) {
    if (g.m_fastest) {
      tn = t / g.tiles_m;
      tm = t - tn * g.tiles_m;
    } else {
      tm = t / g.tiles_n;
      tn = t - tm * g.tiles_n;
    }
  };
  float acc[4][4];
  int own_tile = -1;  // K split: the tile whose part 0 this thread holds
  for (int item = threadIdx.x; item < items; item += kSmallThreads) {
    const int kp = item / tiles, t = item - kp * tiles;
    int tm, tn;
    split_tile(t, tm, tn);
    const TilePtrs p = ptrs_of(tm, tn);
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[r][c] = 0.f;
    const int k0 = g.K * kp / ksplit, k1 = g.K * (kp + 1) / ksplit;
    if (g.b_gather != 0)
      tile_mac<true>(acc, p.a, g.lda, p.b, g.ldb, g.b_gather, k0, k1);
    else
      tile_mac<false>(acc, p.a, g.lda, p.b, g.ldb, 0, k0, k1);
    if (ksplit == 1) {
      epi(tm, tn, acc);
    } else if (kp > 0) {
#pragma unroll
      for (int e = 0; e < 16; ++e) g.part[(e * (ksplit - 1) + kp - 1) * tiles + t] = acc[e / 4][e % 4];
    } else {
      own_tile = t;
    }
  }
  if (ksplit > 1) {
    __syncthreads();
    if (own_tile >= 0) {
      for (int q = 1; q < ksplit; ++q)
#pragma unroll
        for (int e = 0; e < 16; ++e) acc[e / 4][e % 4] += g.part[(e * (ksplit - 1) + q - 1) * tiles + own_tile];
      int tm, tn;
      split_tile(own_tile, tm, tn);
      epi(tm, tn, acc);
    }
  }
}

template <bool kVecB>  // kVecB: N % 4 == 0, so 4 consecutive rows of b are 4 consecutive j
__global__ void __launch_bounds__(kSmallThreads, 1) opm_small_kernel(const SmallArgs p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  extern __shared__ float4 smem_f4[];
  float* smem = reinterpret_cast<float*>(smem_f4);
  const SmallLayout L = small_layout(p.S, p.N, p.C, p.H, p.TI, p.Dc, p.CL);
  const int S = p.S, N = p.N, C = p.C, H = p.H, Dc = p.Dc, TI = p.TI;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int b = blockIdx.z;
  const int itile = blockIdx.x, d0 = blockIdx.y * Dc;
  const int i0 = itile * TI;
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank());
  const int g_base = rank * L.Rb;  // first b row (flat s·N + n) this block projects
  const bool has_rows = itile < p.n_itiles;

  cluster_arrive_relaxed();

  float* bT = smem + L.bT;       // [S*H][N4]      b, transposed (k = s*H + h, then j)
  float* aT = smem + L.aT;       // [H][MP4]       a, transposed (rows m = i*S + s)
  float* Ws = smem + L.w;        // [Dc][H*H]      W slice, as in global memory
  float* den = smem + L.den;     // [TI]
  float* bias_o = smem + L.bias; // [Dc]
  float* mask_a = smem + L.mask_a;  // [MP4]
  float* Xt = smem + L.xt;       // [C][ldx]       normalised x rows (a rows, then b rows), transposed
  float* Xs = smem + L.xs;       // [R][ldxr]      x rows as loaded (aliases bloc and part_proj)
  float* Was = smem + L.wa;      // [H][ldc]       Wa as in global memory
  float* Wbs = smem + L.wb;      // [H][ldc]
  float* gam = smem + L.gam;     // [C]
  float* bet = smem + L.bet;     // [C]
  float* ba = smem + L.ba;       // [H4]
  float* bb = smem + L.bb;       // [H4]
  float* mask_b = smem + L.mask_b;  // [Rb]
  float* bloc = smem + L.bloc;   // [H][Rb]        this block's rows of b, before the push
  float* part_proj = smem + L.part_proj;
  float* Pm = smem + L.p;        // [TI*S*H][Dc]   P, aliasing the projection scratch
  float* part_po = smem + L.part_po;

  // ---- asynchronous loads: everything the block reads from global memory, in flight at once ----
  // x rows as they are in memory (16-byte copies when aligned); LayerNorm transposes them.
  const int R = L.MP4 + L.Rb;  // rows: this block's a rows, then its b rows
  const bool vec_x = (C % 4) == 0 && ((p.x_sb | p.x_ss | p.x_sn) % 4) == 0 &&
                     (reinterpret_cast<uintptr_t>(p.x) & 15) == 0;
  const int per_row = vec_x ? C / 4 : C;
  for (int idx = tid; idx < R * per_row; idx += kSmallThreads) {
    const int r = idx / per_row, q = idx - r * per_row;
    int s = 0, n = 0;
    bool valid;
    if (r < L.MP4) {
      const int il = r / S;
      s = r - il * S;
      n = i0 + il;
      valid = r < L.MP && n < N;
    } else {
      const int g = g_base + (r - L.MP4);
      s = g / N;
      n = g - s * N;
      valid = g < S * N;
    }
    const float* src = p.x + int64_t(b) * p.x_sb + int64_t(s) * p.x_ss + int64_t(n) * p.x_sn;
    if (vec_x)
      cp_async16z(&Xs[r * L.ldxr + 4 * q], valid ? src + 4 * q : p.x, valid);
    else
      cp_async4(&Xs[r * L.ldxr + q], valid ? src + q : p.x, valid);
  }
  // Projection weights in their own layout (rows of ldc): 16-byte copies when aligned.
  const bool vec_w = (C % 4) == 0 && ((reinterpret_cast<uintptr_t>(p.wa) | reinterpret_cast<uintptr_t>(p.wb)) & 15) == 0;
  if (vec_w) {
    const int C_4 = C / 4;
    for (int idx = tid; idx < H * C_4; idx += kSmallThreads) {
      const int h = idx / C_4, c = 4 * (idx - h * C_4);
      cp_async16(&Was[h * L.ldc + c], p.wa + int64_t(h) * C + c);
      cp_async16(&Wbs[h * L.ldc + c], p.wb + int64_t(h) * C + c);
    }
  } else {
    for (int idx = tid; idx < H * C; idx += kSmallThreads) {
      const int h = idx / C, c = idx - h * C;
      cp_async4(&Was[h * L.ldc + c], p.wa + idx, true);
      cp_async4(&Wbs[h * L.ldc + c], p.wb + idx, true);
    }
  }
  for (int c = tid; c < C; c += kSmallThreads) {
    cp_async4(&gam[c], p.ln_w + c, true);
    cp_async4(&bet[c], p.ln_b + c, true);
  }
  for (int h = tid; h < H; h += kSmallThreads) {
    cp_async4(&ba[h], p.ba ? p.ba + h : p.wa, p.ba != nullptr);
    cp_async4(&bb[h], p.bb ? p.bb + h : p.wb, p.bb != nullptr);
  }
  for (int dd = tid; dd < Dc; dd += kSmallThreads) {
    const bool valid = p.bias != nullptr && d0 + dd < p.D;
    cp_async4(&bias_o[dd], valid ? p.bias + d0 + dd : p.wa, valid);
  }
  cp_async_commit();
  if (has_rows) {
    // W[d0 + dd, :] -> Ws[dd, :], one contiguous slab; rows past D are zero.
    const int HH = H * H;
    const float* w_src = p.w_out + int64_t(d0) * HH;
    if ((HH % 4) == 0 && (reinterpret_cast<uintptr_t>(p.w_out) & 15) == 0) {
      const int valid4 = (min(Dc, p.D - d0) * HH) / 4;
      for (int f = tid; f < Dc * HH / 4; f += kSmallThreads)
        cp_async16z(&Ws[4 * f], f < valid4 ? w_src + 4 * f : p.w_out, f < valid4);
    } else {
      const int valid = min(Dc, p.D - d0) * HH;
      for (int f = tid; f < Dc * HH; f += kSmallThreads) cp_async4(&Ws[f], f < valid ? w_src + f : p.w_out, f < valid);
    }
  }
  cp_async_commit();

  // Masks (any dtype and strides): plain loads, all threads' in flight together.
  for (int r = tid; r < L.MP4; r += kSmallThreads) {
    const int il = r / S, s = r - il * S, n = i0 + il;
    mask_a[r] = (r < L.MP && n < N) ? mask_at(p.mask, b, s, n) : 0.f;
  }
  for (int r = tid; r < L.Rb; r += kSmallThreads) {
    const int g = g_base + r;
    const int s = g / N, n = g - s * N;
    mask_b[r] = g < S * N ? mask_at(p.mask, b, s, n) : 0.f;
  }
  cp_async_wait<1>();
  __syncthreads();

  // Denominators: den[i] = max(sum_s m[s, i], 1), summed in order of s.
  for (int il = tid; il < TI; il += kSmallThreads) {
    float sum = 0.f;
    for (int s = 0; s < S; ++s) sum += mask_a[il * S + s];
    den[il] = fmaxf(sum, 1.f);
  }
  // LayerNorm, eight lanes per row: reads Xs along the row, writes Xt across rows.  The leading
  // dimensions (ldxr = 8, ldx = 4 mod 32) make both conflict-free; R is a multiple of 4, so the
  // four rows of a warp are all present or all absent (full-mask shuffles).
  for (int r = tid >> 3; r < R; r += kSmallThreads / 8) {
    const int j = tid & 7;
    const float* xr = Xs + r * L.ldxr;
    float sum = 0.f;
    for (int c = j; c < C; c += 8) sum += xr[c];
#pragma unroll
    for (int off = 4; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    const float mean = sum / C;
    float sq = 0.f;
    for (int c = j; c < C; c += 8) {
      const float dv = xr[c] - mean;
      sq += dv * dv;
    }
#pragma unroll
    for (int off = 4; off > 0; off >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, off);
    const float rstd = rsqrtf(sq / C + p.ln_eps);
    for (int c = j; c < C; c += 8) Xt[c * L.ldx + r] = (xr[c] - mean) * rstd * gam[c] + bet[c];
  }
  __syncthreads();

  // ---- the four contractions, one loop so that one copy of the GEMM code serves them all ----
  //   0: a = Xn · Wa^T (this block's rows)     1: b = Xn · Wb^T (its share of the cluster's rows)
  //   (push of b to the cluster)              2: P = a · W over h1     3: out = b · P over (s, h2)
  const int dgroups = Dc / 4;
  const int HH = H * H;
  const bool vec_out = (p.D % 4) == 0;
#pragma unroll 1
  for (int job = 0; job < 4; ++job) {
    if (job == 0 && !has_rows) continue;
    if (job == 2) {
      // ---- push this block's rows of b into every block of the cluster ----
      cluster_wait();  // every peer has started (its shared memory exists)
      const int groups = L.Rb / 4;
      const int CL = int(cluster.num_blocks());
      for (int idx = tid; idx < H * groups; idx += kSmallThreads) {
        const int h = idx / groups, rg = idx - h * groups;
        const int g0 = g_base + 4 * rg;
        if (g0 >= S * N) continue;
        const float4 v = *reinterpret_cast<const float4*>(&bloc[h * L.Rb + 4 * rg]);
        if (kVecB) {
          const int s = g0 / N, n = g0 - s * N;
          const int off = (s * H + h) * L.N4 + n;
          for (int q = 0; q < CL; ++q) *reinterpret_cast<float4*>(cluster.map_shared_rank(bT + off, q)) = v;
        } else {
          const float vals[4] = {v.x, v.y, v.z, v.w};
          for (int e = 0; e < 4; ++e) {
            const int g = g0 + e;
            if (g >= S * N) break;
            const int s = g / N, n = g - s * N;
            const int off = (s * H + h) * L.N4 + n;
            for (int q = 0; q < CL; ++q) *cluster.map_shared_rank(bT + off, q) = vals[e];
          }
        }
      }
      cp_async_wait_all();
      cluster_barrier();
      if (!has_rows) return;
    }
    GemmShape g;
    switch (job) {
      case 0: g = {L.MP4 / 4, L.H4 / 4, C, L.ldx, 1, L.ldc, true, part_proj}; break;
      case 1: g = {L.Rb / 4, L.H4 / 4, C, L.ldx, 1, L.ldc, true, part_proj}; break;
      case 2: g = {L.MP4 / 4, H * dgroups, H, L.MP4, H, HH, false, part_po}; break;
      default: g = {L.N4 / 4, TI * dgroups, S * H, L.N4, Dc, 0, true, part_po}; break;
    }
    block_gemm_4x4(
        g,
        [&](int tm, int tn) -> TilePtrs {
          switch (job) {
            case 0: return {Xt + 4 * tm, Was + 4 * tn * L.ldc};
            case 1: return {Xt + L.MP4 + 4 * tm, Wbs + 4 * tn * L.ldc};
            case 2: {
              const int dg = tn / H, h2 = tn - dg * H;
              return {aT + 4 * tm, Ws + 4 * dg * HH + h2};
            }
            default: {
              const int il = tn / dgroups, dg = tn - il * dgroups;
              return {bT + 4 * tm, Pm + il * S * H * Dc + 4 * dg};
            }
          }
        },
        [&](int tm, int tn, const float(&acc)[4][4]) {
          if (job <= 1) {
            // a (job 0) to aT[h][m], b (job 1) to bloc[h][r]: bias, then mask
            const float* bias = job == 0 ? ba : bb;
            const float* msk = job == 0 ? mask_a : mask_b;
            float* dst = job == 0 ? aT : bloc;
            const int ld = job == 0 ? L.MP4 : L.Rb;
#pragma unroll
            for (int c = 0; c < 4; ++c) {
              const int h = 4 * tn + c;
              if (h >= H) continue;
              float4 v;
              v.x = (acc[0][c] + bias[h]) * msk[4 * tm + 0];
              v.y = (acc[1][c] + bias[h]) * msk[4 * tm + 1];
              v.z = (acc[2][c] + bias[h]) * msk[4 * tm + 2];
              v.w = (acc[3][c] + bias[h]) * msk[4 * tm + 3];
              *reinterpret_cast<float4*>(&dst[h * ld + 4 * tm]) = v;
            }
          } else if (job == 2) {
            // P[(m*H + h2)*Dc + d] for rows m = (i, s), d in this tile's group of 4
            const int dg = tn / H, h2 = tn - dg * H;
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              const int m = 4 * tm + r;
              if (m < L.MP)
                *reinterpret_cast<float4*>(&Pm[(m * H + h2) * Dc + 4 * dg]) =
                    make_float4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
            }
          } else {
            // out[b, i, j, d] = acc / den[i] + bias[d] (or a pair normalisation, see NormKind)
            const int il = tn / dgroups, dg = tn - il * dgroups;
            const int i = i0 + il;
            const int dl = 4 * dg, d = d0 + dl;
            if (i >= N || d >= p.D) return;
            const float inv_den = 1.f / den[il];
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              const int j = 4 * tm + r;
              if (j >= N) break;
              const int64_t dst = ((int64_t(b) * N + i) * N + j) * p.D + d;
              float v[4];
              if (p.norm.kind == kNormRow) {
#pragma unroll
                for (int c = 0; c < 4; ++c) v[c] = acc[r][c] * inv_den + bias_o[dl + c];
              } else {
                float pair = 0.f;  // sum_s m[s,i] m[s,j], in order of s
                for (int s = 0; s < S; ++s) pair += mask_a[il * S + s] * mask_at(p.mask, b, s, j);
#pragma unroll
                for (int c = 0; c < 4; ++c) v[c] = normalise(acc[r][c], bias_o[dl + c], 0.f, pair, p.norm);
              }
              if (vec_out && d + 3 < p.D) {
                store_out4(p.out, dst, v, p.out_kind);
              } else {
#pragma unroll
                for (int c = 0; c < 4; ++c)
                  if (d + c < p.D) store_out(p.out, dst + c, v[c], p.out_kind);
              }
            }
          }
        });
    __syncthreads();
  }
#else
  target_lacks_instructions();
#endif
}

}  // namespace flashopm
