// Backward of LayerNorm, both projections and the mask in one pass over x (math and layout in
// opm_params.h, LnBackwardArgs).  It replaces some forty PyTorch kernels over x-sized tensors
// (xhat, xn, grad_xn and their products) with one read of x, grad_a and grad_b and one write of
// grad_x; nothing x-sized is allocated besides grad_x.
#pragma once

#include "opm_kernels.cuh"

namespace flashopm {

// Sums of kN values per row over the threads of a row group (col_lanes threads, whole warps);
// every thread of the group gets the totals.  Within a warp a reduce-scatter (kN - 1 + 5 - log2 kN
// shuffles instead of 5 kN) leaves each lane the warp's sum of one value; across the group's warps
// the partial sums meet in shared memory, lane l adding those of value l % kN; kN shuffles then
// hand every lane all the totals.  Ends with the block synchronised when the group spans warps, so
// red can be reused at once.
template <int kN>
__device__ __forceinline__ void row_group_sum(float (&v)[kN], float* red, int col_lanes, int warp, int lane) {
  static_assert(kN >= 2 && kN <= 32 && (kN & (kN - 1)) == 0, "kN: a power of two up to 32");
  int index = 0;  // the value this lane's partial sum belongs to
#pragma unroll
  for (int half = kN / 2, mask = 16; half >= 1; half /= 2, mask >>= 1) {
    const bool upper = (lane & mask) != 0;
#pragma unroll
    for (int i = 0; i < half; ++i) {
      const float send = upper ? v[i] : v[i + half];
      const float keep = upper ? v[i + half] : v[i];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, mask);
    }
    if (upper) index += half;
  }
  float part = v[0];
  constexpr int kScatterBits = kN == 2 ? 1 : kN == 4 ? 2 : kN == 8 ? 3 : kN == 16 ? 4 : 5;
#pragma unroll
  for (int mask = 16 >> kScatterBits; mask >= 1; mask >>= 1) part += __shfl_xor_sync(0xffffffffu, part, mask);
  // lane holding value i's sum: its bits from 4 downwards spell i (the low bits are free)
  const auto holder = [](int i) {
    int l = 0;
#pragma unroll
    for (int b = 0, mask = 16, half = kN / 2; b < kScatterBits; ++b, mask >>= 1, half /= 2)
      if (i & half) l |= mask;
    return l;
  };
  if (col_lanes > 32) {  // block-uniform
    const int low = (1 << (5 - kScatterBits)) - 1;
    if ((lane & low) == 0) red[warp * kN + index] = part;
    __syncthreads();
    const int warps = col_lanes / 32, first = (warp / warps) * warps, mine = lane % kN;
    float t = 0.f;
    for (int w = 0; w < warps; ++w) t += red[(first + w) * kN + mine];
#pragma unroll
    for (int i = 0; i < kN; ++i) v[i] = __shfl_sync(0xffffffffu, t, i);
    __syncthreads();
  } else {
#pragma unroll
    for (int i = 0; i < kN; ++i) v[i] = __shfl_sync(0xffffffffu, part, holder(i));
  }
}

// The block's partial sums (layout of ln_backward_partial_floats) from its row groups' parts in
// shared memory, added in a fixed order: dW from dw_s [groups][h_stride][cstride], d ln_w and
// d ln_b from dln_s [groups][2][cstride], d b_a and d b_b from threads 0 .. 2H-1 (dbias).  Called
// by every thread after the barrier that follows the parts' stores.
__device__ __forceinline__ void store_ln_backward_partial(const LnBackwardArgs& p, const float* dw_s, int h_stride,
                                                          const float* dln_s, int cstride, int groups, float dbias) {
  const int C = p.C, H2 = 2 * p.H, tid = threadIdx.x;
  float* part = p.partial + int64_t(blockIdx.x) * ln_backward_partial_floats(C, p.H);
  for (int idx = tid; idx < H2 * C; idx += kLnBwdThreads) {
    const int h = idx / C, c = idx - h * C;
    float v = 0.f;
    for (int g = 0; g < groups; ++g) v += dw_s[(g * h_stride + h) * cstride + c];
    part[idx] = v;
  }
  for (int idx = tid; idx < 2 * C; idx += kLnBwdThreads) {
    const int which = idx / C, c = idx - which * C;
    float v = 0.f;
    for (int g = 0; g < groups; ++g) v += dln_s[(g * 2 + which) * cstride + c];
    part[H2 * C + idx] = v;
  }
  if (tid < H2) part[H2 * C + 2 * C + tid] = dbias;
}

template <int kCols, typename XT>  // XT: x's element type (p.x_kind)
__global__ void __launch_bounds__(kLnBwdThreads, kCols == 1 ? 2 : 1) opm_ln_backward_kernel(const LnBackwardArgs p) {
  extern __shared__ float4 smem_f4[];
  float* smem = reinterpret_cast<float*>(smem_f4);
  constexpr int R = kLnBwdRows;
  const int C = p.C, H = p.H, H2 = 2 * H, H2p = round_up4(H2);
  const int lanes = p.col_lanes, groups = kLnBwdThreads / lanes, cstride = lanes * kCols;
  const int tile_rows = groups * R;
  float* dw_s = smem;                                             // [groups][H2p][cstride]
  float* gm_s = dw_s + groups * H2p * cstride;                    // [tile_rows][H2p]
  float* red_s = gm_s + tile_rows * H2p;                          // [warps][2R]
  float* dln_s = red_s + kLnBwdWarps * 2 * R;                     // [groups][2][cstride]
  float* m_s = dln_s + groups * 2 * cstride;                      // [tile_rows]
  int64_t* xoff_s = reinterpret_cast<int64_t*>(m_s + round_up4(tile_rows));  // [tile_rows]

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int group = tid / lanes, cl = tid - group * lanes;
  for (int i = tid; i < groups * H2p * cstride; i += kLnBwdThreads) dw_s[i] = 0.f;

  int col[kCols];
  bool col_ok[kCols];
  float lw[kCols], lb[kCols], dlw[kCols], dlb[kCols];
#pragma unroll
  for (int k = 0; k < kCols; ++k) {
    col[k] = cl + k * lanes;
    col_ok[k] = col[k] < C;
    lw[k] = col_ok[k] ? p.ln_w[col[k]] : 0.f;
    lb[k] = col_ok[k] ? p.ln_b[col[k]] : 0.f;
    dlw[k] = dlb[k] = 0.f;
  }
  float dbias = 0.f;  // thread tid < 2H: d b_a[tid] or d b_b[tid - H]
  const float inv_c = 1.f / float(C);

  const int64_t ntiles = (p.rows + tile_rows - 1) / tile_rows;
  for (int64_t tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
    const int64_t row0 = tile * tile_rows;
    __syncthreads();  // the previous tile's reads of gm_s, m_s and xoff_s are done
    if (tid < tile_rows) {
      const int64_t row = row0 + tid;
      float mv = 0.f;
      int64_t off = 0;
      if (row < p.rows) {
        const int64_t bs = row / p.N;
        const int n = int(row - bs * p.N), s = int(bs % p.S), b = int(bs / p.S);
        mv = mask_at(p.mask, b, s, n);
        off = int64_t(b) * p.x_sb + int64_t(s) * p.x_ss + int64_t(n) * p.x_sn;
      }
      m_s[tid] = mv;
      xoff_s[tid] = off;
    }
    __syncthreads();
    // The masked gradients of the tile's rows, four elements per thread at a time: their loads are
    // issued together, before any of them is used (with a load and its use under one branch per
    // element, each load waited for the previous element's store).
    constexpr int kGmUnroll = 4;
    for (int idx0 = tid; idx0 < tile_rows * H2p; idx0 += kGmUnroll * kLnBwdThreads) {
      float g[kGmUnroll];
#pragma unroll
      for (int u = 0; u < kGmUnroll; ++u) {
        const int idx = idx0 + u * kLnBwdThreads;
        const int r = idx / H2p, h = idx - r * H2p;
        const int64_t row = row0 + r;
        const bool ok = idx < tile_rows * H2p && row < p.rows && h < H2;
        const float* src = h < H ? p.grad_a + row * H + h : p.grad_b + row * H + (h - H);
        g[u] = ok ? *src : 0.f;
      }
#pragma unroll
      for (int u = 0; u < kGmUnroll; ++u) {
        const int idx = idx0 + u * kLnBwdThreads;
        if (idx < tile_rows * H2p) gm_s[idx] = g[u] * m_s[idx / H2p];
      }
    }

    // This thread's rows: x, then LayerNorm's statistics in two passes over the registers.
    float xh[R][kCols];
    bool row_ok[R];
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int r = group * R + i;
      row_ok[i] = row0 + r < p.rows;
#pragma unroll
      for (int k = 0; k < kCols; ++k)
        xh[i][k] = row_ok[i] && col_ok[k] ? load_streaming_as_float<XT>(p.x, xoff_s[r] + col[k]) : 0.f;
    }
    float stat[R], rstd[R];
#pragma unroll
    for (int i = 0; i < R; ++i) {
      stat[i] = 0.f;
#pragma unroll
      for (int k = 0; k < kCols; ++k) stat[i] += xh[i][k];
    }
    row_group_sum(stat, red_s, lanes, warp, lane);
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const float mean = stat[i] * inv_c;
      stat[i] = 0.f;
#pragma unroll
      for (int k = 0; k < kCols; ++k) {
        xh[i][k] = col_ok[k] ? xh[i][k] - mean : 0.f;
        stat[i] = fmaf(xh[i][k], xh[i][k], stat[i]);
      }
    }
    row_group_sum(stat, red_s, lanes, warp, lane);
    float xn[R][kCols];
#pragma unroll
    for (int i = 0; i < R; ++i) {
      rstd[i] = rsqrtf(stat[i] * inv_c + p.ln_eps);
#pragma unroll
      for (int k = 0; k < kCols; ++k) {
        xh[i][k] *= rstd[i];
        xn[i][k] = fmaf(xh[i][k], lw[k], lb[k]);
      }
    }
    __syncthreads();  // gm_s complete (row_group_sum does not synchronise for 32 lanes)

    if (tid < H2) {
      for (int r = 0; r < tile_rows; ++r) dbias += gm_s[r * H2p + tid];
    }

    // grad_xn = g · [W_a; W_b] and the dW sums, four hidden units at a time: the masked gradients
    // come as float4 broadcasts (all threads of a warp share the row), W from L1/L2, the next
    // four rows of W requested before this step's products so that their latency overlaps them.
    float gxn[R][kCols];
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
      for (int k = 0; k < kCols; ++k) gxn[i][k] = 0.f;
    float* dw_group = dw_s + group * H2p * cstride;
    const auto load_w = [&](int h, float (&w)[4][kCols]) {
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int hh = h + u;
        const float* wrow = hh < H ? p.wa + int64_t(hh) * C : p.wb + int64_t(hh - H) * C;
#pragma unroll
        for (int k = 0; k < kCols; ++k) w[u][k] = hh < H2 && col_ok[k] ? __ldg(wrow + col[k]) : 0.f;
      }
    };
    float w[4][kCols];
    load_w(0, w);
#pragma unroll 1
    for (int h = 0; h < H2p; h += 4) {
      float w_next[4][kCols];
      load_w(h + 4 < H2p ? h + 4 : h, w_next);
      float dacc[4][kCols];
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int k = 0; k < kCols; ++k) dacc[u][k] = 0.f;
#pragma unroll
      for (int i = 0; i < R; ++i) {
        const float4 g4 = *reinterpret_cast<const float4*>(&gm_s[(group * R + i) * H2p + h]);
        const float g[4] = {g4.x, g4.y, g4.z, g4.w};
#pragma unroll
        for (int u = 0; u < 4; ++u)
#pragma unroll
          for (int k = 0; k < kCols; ++k) {
            gxn[i][k] = fmaf(g[u], w[u][k], gxn[i][k]);
            dacc[u][k] = fmaf(g[u], xn[i][k], dacc[u][k]);
          }
      }
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int k = 0; k < kCols; ++k) {
          dw_group[(h + u) * cstride + col[k]] += dacc[u][k];
          w[u][k] = w_next[u][k];
        }
    }

#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
      for (int k = 0; k < kCols; ++k) {
        dlw[k] = fmaf(gxn[i][k], xh[i][k], dlw[k]);
        dlb[k] += gxn[i][k];
      }

    if (p.grad_x != nullptr) {  // block-uniform
      float t[2 * R];
#pragma unroll
      for (int i = 0; i < R; ++i) {
        t[i] = t[R + i] = 0.f;
#pragma unroll
        for (int k = 0; k < kCols; ++k) {
          gxn[i][k] *= lw[k];  // now gxhat
          t[i] += gxn[i][k];
          t[R + i] = fmaf(gxn[i][k], xh[i][k], t[R + i]);
        }
      }
      row_group_sum(t, red_s, lanes, warp, lane);
#pragma unroll
      for (int i = 0; i < R; ++i) {
        if (!row_ok[i]) continue;
        const int64_t row = row0 + group * R + i;
        const float mg = t[i] * inv_c, mgx = t[R + i] * inv_c;
#pragma unroll
        for (int k = 0; k < kCols; ++k)
          if (col_ok[k])
            store_out(p.grad_x, row * C + col[k], rstd[i] * (gxn[i][k] - mg - xh[i][k] * mgx), p.gx_kind);
      }
    }
  }

  // This block's partial sums: the row groups' dW and LayerNorm sums added in a fixed order.
#pragma unroll
  for (int k = 0; k < kCols; ++k) {
    dln_s[(group * 2) * cstride + col[k]] = dlw[k];
    dln_s[(group * 2 + 1) * cstride + col[k]] = dlb[k];
  }
  __syncthreads();
  store_ln_backward_partial(p, dw_s, H2p, dln_s, cstride, groups, dbias);
}

// The same pass where msa_dim <= 256 (one column per thread) and 2H <= kH2 <= 64: each thread
// keeps its column of [W_a; W_b] and its dW sums in registers for all its tiles, so that the loop
// over h reads nothing but the tile's gradients (shared-memory broadcasts); and the next tile's x,
// gradients, mask and row offsets are requested before the current tile is worked on, so that one
// block per SM hides their latency.  The mask multiplies the products (m g·W = m (g·W), and
// (m g) xn = g (m xn)) instead of the staged gradients, which come in by cp.async untouched.
template <int kH2, typename XT>
__global__ void __launch_bounds__(kLnBwdThreads, 1) opm_ln_backward_regs_kernel(const LnBackwardArgs p) {
  extern __shared__ float4 smem_f4[];
  float* smem = reinterpret_cast<float*>(smem_f4);
  constexpr int R = kLnBwdRows;
  const int C = p.C, H = p.H, H2 = 2 * H;
  const int lanes = p.col_lanes, groups = kLnBwdThreads / lanes;
  const int tile_rows = groups * R, tr4 = round_up4(tile_rows), gm_floats = tile_rows * kH2;
  float* dw_s = smem;                               // [groups][kH2][lanes]: the block's final sums
  float* gm_s = dw_s + kLnBwdThreads * kH2;         // [2][tile_rows][kH2]: a tile's gradients, unmasked
  float* red_s = gm_s + 2 * gm_floats;              // [warps][2R]
  float* dln_s = red_s + kLnBwdWarps * 2 * R;       // [groups][2][lanes]
  float* m_s = dln_s + groups * 2 * lanes;          // [2][tr4]
  int64_t* xoff_s = reinterpret_cast<int64_t*>(m_s + 2 * tr4);  // [2][tr4]

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int group = tid / lanes, cl = tid - group * lanes;
  const bool col_ok = cl < C;
  float wcol[kH2], dw[kH2];
#pragma unroll
  for (int h = 0; h < kH2; ++h) {
    const bool ok = h < H2 && col_ok;
    const float* wrow = h < H ? p.wa + int64_t(h) * C : p.wb + int64_t(h - H) * C;
    wcol[h] = ok ? __ldg(wrow + cl) : 0.f;
    dw[h] = 0.f;
  }
  const float lw = col_ok ? p.ln_w[cl] : 0.f, lb = col_ok ? p.ln_b[cl] : 0.f;
  float dlw = 0.f, dlb = 0.f, dbias = 0.f;  // dbias: thread tid < 2H, d b_a[tid] or d b_b[tid - H]
  const float inv_c = 1.f / float(C);
  const int64_t ntiles = (p.rows + tile_rows - 1) / tile_rows;

  // A tile's mask values and x offsets (threads below tile_rows, one row each): requested into
  // registers by fetch_rows, stored into buffer buf by stage_rows, so that the mask's load is
  // waited for only where its value is stored.
  float row_m = 0.f;
  int64_t row_off = 0;
  const auto fetch_rows = [&](int64_t tile) {
    row_m = 0.f;
    row_off = 0;
    const int64_t row = tile * tile_rows + tid;
    if (tid < tile_rows && row < p.rows) {
      const int64_t bs = row / p.N;
      const int n = int(row - bs * p.N), s = int(bs % p.S), b = int(bs / p.S);
      row_m = mask_at(p.mask, b, s, n);
      row_off = int64_t(b) * p.x_sb + int64_t(s) * p.x_ss + int64_t(n) * p.x_sn;
    }
  };
  const auto stage_rows = [&](int buf) {
    if (tid < tile_rows) {
      m_s[buf * tr4 + tid] = row_m;
      xoff_s[buf * tr4 + tid] = row_off;
    }
  };
  // A tile's loads: this thread's R values of x into registers, the gradients into gm_s[buf]
  // (rows of kH2: [grad_a | grad_b | zeros]).  Needs the tile's offsets staged and visible.
  const auto load_tile = [&](int64_t tile, int buf, float (&xr)[R]) {
    const int64_t row0 = tile * tile_rows;
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int r = group * R + i;
      xr[i] = row0 + r < p.rows && col_ok ? load_streaming_as_float<XT>(p.x, xoff_s[buf * tr4 + r] + cl) : 0.f;
    }
    float* gdst = gm_s + buf * gm_floats;
    for (int idx = tid; idx < gm_floats; idx += kLnBwdThreads) {
      const int r = idx / kH2, h = idx % kH2;
      const int64_t row = row0 + r;
      const bool ok = row < p.rows && h < H2;
      const float* src = !ok ? p.grad_a : h < H ? p.grad_a + row * H + h : p.grad_b + row * H + (h - H);
      cp_async4(gdst + idx, src, ok);
    }
    cp_async_commit();
  };

  int64_t tile = blockIdx.x;
  int buf = 0;
  float xv[R];
  if (tile < ntiles) {
    fetch_rows(tile);
    stage_rows(0);
  }
  __syncthreads();
  if (tile < ntiles) load_tile(tile, 0, xv);
  for (; tile < ntiles; tile += gridDim.x, buf ^= 1) {
    const int64_t row0 = tile * tile_rows, next = tile + gridDim.x;
    if (next < ntiles) fetch_rows(next);

    // LayerNorm's statistics, two passes over the registers.
    float xh[R], stat[R], rstd[R];
    bool row_ok[R];
#pragma unroll
    for (int i = 0; i < R; ++i) {
      row_ok[i] = row0 + group * R + i < p.rows;
      xh[i] = xv[i];
      stat[i] = xh[i];
    }
    row_group_sum(stat, red_s, lanes, warp, lane);
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const float mean = stat[i] * inv_c;
      xh[i] = col_ok ? xh[i] - mean : 0.f;
      stat[i] = xh[i] * xh[i];
    }
    row_group_sum(stat, red_s, lanes, warp, lane);
    const float* gm = gm_s + buf * gm_floats;
    const float* mrow = m_s + buf * tr4;
    float xnm[R];  // m * xn
#pragma unroll
    for (int i = 0; i < R; ++i) {
      rstd[i] = rsqrtf(stat[i] * inv_c + p.ln_eps);
      xh[i] *= rstd[i];
    }
    if (next < ntiles) stage_rows(buf ^ 1);
    cp_async_wait_all();
    __syncthreads();  // this tile's gradients in gm_s[buf]; the next tile's offsets in their buffer
#pragma unroll
    for (int i = 0; i < R; ++i) xnm[i] = mrow[group * R + i] * fmaf(xh[i], lw, lb);
    if (next < ntiles) load_tile(next, buf ^ 1, xv);

    if (tid < H2) {
      for (int r = 0; r < tile_rows; ++r) dbias = fmaf(gm[r * kH2 + tid], mrow[r], dbias);
    }

    float gxn[R];
#pragma unroll
    for (int i = 0; i < R; ++i) gxn[i] = 0.f;
#pragma unroll
    for (int h = 0; h < kH2; h += 4) {
#pragma unroll
      for (int i = 0; i < R; ++i) {
        const float4 g4 = *reinterpret_cast<const float4*>(&gm[(group * R + i) * kH2 + h]);
        const float g[4] = {g4.x, g4.y, g4.z, g4.w};
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          gxn[i] = fmaf(g[u], wcol[h + u], gxn[i]);
          dw[h + u] = fmaf(g[u], xnm[i], dw[h + u]);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < R; ++i) {
      gxn[i] *= mrow[group * R + i];  // grad_xn
      dlw = fmaf(gxn[i], xh[i], dlw);
      dlb += gxn[i];
    }

    if (p.grad_x != nullptr) {  // block-uniform
      float t[2 * R];
#pragma unroll
      for (int i = 0; i < R; ++i) {
        gxn[i] *= lw;  // now gxhat
        t[i] = gxn[i];
        t[R + i] = gxn[i] * xh[i];
      }
      row_group_sum(t, red_s, lanes, warp, lane);
#pragma unroll
      for (int i = 0; i < R; ++i) {
        if (!row_ok[i] || !col_ok) continue;
        const int64_t row = row0 + group * R + i;
        const float mg = t[i] * inv_c, mgx = t[R + i] * inv_c;
        store_out(p.grad_x, row * C + cl, rstd[i] * (gxn[i] - mg - xh[i] * mgx), p.gx_kind);
      }
    }
    __syncthreads();  // gm_s[buf] and m_s[buf] read: the next tile but one may overwrite them
  }

  // This block's partial sums: the row groups' added in a fixed order.
#pragma unroll
  for (int h = 0; h < kH2; ++h) dw_s[(group * kH2 + h) * lanes + cl] = dw[h];
  dln_s[(group * 2) * lanes + cl] = dlw;
  dln_s[(group * 2 + 1) * lanes + cl] = dlb;
  __syncthreads();
  store_ln_backward_partial(p, dw_s, kH2, dln_s, lanes, groups, dbias);
}

// kN (even) consecutive XT values in shared memory, as float32, and back; 4-byte aligned.
template <typename XT, int kN>
__device__ __forceinline__ void load_pairs(const XT* src, float (&v)[kN]) {
#pragma unroll
  for (int k = 0; k < kN; k += 2) {
    float2 f;
    if constexpr (std::is_same_v<XT, __nv_bfloat16>) f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(src + k));
    else f = __half22float2(*reinterpret_cast<const __half2*>(src + k));
    v[k] = f.x, v[k + 1] = f.y;
  }
}
template <typename XT, int kN>
__device__ __forceinline__ void store_pairs(XT* dst, const float (&v)[kN]) {
#pragma unroll
  for (int k = 0; k < kN; k += 2) *reinterpret_cast<uint32_t*>(dst + k) = pack_16bit<XT>(v[k], v[k + 1]);
}

// ---- Pieces of the tensor-core forms (16-bit and TF32) ----

// A tile's row `row` (past p.rows: zeros) into shared memory by cp.async, kRowThreads threads a row
// (thread q of them): x as 16-byte pieces (every kRowThreads-th piece of the row's kC elements of
// XT) to xdst, G = [grad_a | grad_b | 0] (64 floats, 64 / kRowThreads of them per thread) to gdst,
// the mask value to *mdst (thread 0 of the row).
template <typename XT, int kC, int kRowThreads>
__device__ __forceinline__ void issue_ln_row(const LnBackwardArgs& p, int64_t row, int q, XT* xdst, float* gdst,
                                             float* mdst) {
  constexpr int kPiece = 16 / sizeof(XT), kChunks = kC / kPiece / kRowThreads, kG = 64 / kRowThreads;
  const int H = p.H, H2 = 2 * H;
  const bool ok = row < p.rows;
  int64_t off = 0;
  float mv = 0.f;
  if (ok) {
    const int64_t bs = row / p.N;
    const int n = int(row - bs * p.N), s = int(bs % p.S), b = int(bs / p.S);
    off = int64_t(b) * p.x_sb + int64_t(s) * p.x_ss + int64_t(n) * p.x_sn;
    mv = mask_at(p.mask, b, s, n);
  }
  const XT* xrow = static_cast<const XT*>(p.x) + off;
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    const int e = (q + kRowThreads * k) * kPiece;
    cp_async16z(xdst + e, xrow + e, ok);
  }
#pragma unroll
  for (int k = 0; k < kG; ++k) {
    const int h = q * kG + k;
    const bool hok = ok && h < H2;
    const float* src = !hok ? p.grad_a : h < H ? p.grad_a + row * H + h : p.grad_b + row * H + (h - H);
    cp_async4(gdst + h, src, hok);
  }
  if (q == 0) *mdst = mv;
}

// Row `row` of grad_x (if below p.rows) from its staged copy in shared memory, kRowThreads
// threads a row (thread q of them), in 16-byte pieces.
template <typename XT, int kC, int kRowThreads>
__device__ __forceinline__ void store_grad_x_row(const LnBackwardArgs& p, int64_t row, int q, const XT* src) {
  constexpr int kPiece = 16 / sizeof(XT), kChunks = kC / kPiece / kRowThreads;
  if (row >= p.rows) return;
  XT* dst = static_cast<XT*>(p.grad_x) + row * kC;
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    const int e = (q + kRowThreads * k) * kPiece;
    *reinterpret_cast<uint4*>(dst + e) = *reinterpret_cast<const uint4*>(src + e);
  }
}

// The per-thread LayerNorm parameters of the tensor-core forms: ln_w at the accumulators' columns
// (c0 + 8 nt + 2t + e) for the backward's row terms, ln_w and ln_b at lane·kVec .. for the
// statistics; and the d ln_w, d ln_b sums zeroed.
template <int kNT, int kVec>
__device__ __forceinline__ void ln_thread_params(const LnBackwardArgs& p, int c0, int lane, int t,
                                                 float (&lw_c)[kNT][2], float (&lw_v)[kVec], float (&lb_v)[kVec],
                                                 float (&dlw)[kNT][2], float (&dlb)[kNT][2]) {
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      lw_c[nt][e] = p.ln_w[c0 + nt * 8 + 2 * t + e];
      dlw[nt][e] = dlb[nt][e] = 0.f;
    }
#pragma unroll
  for (int k = 0; k < kVec; ++k) lw_v[k] = p.ln_w[lane * kVec + k], lb_v[k] = p.ln_b[lane * kVec + k];
}

// LayerNorm's statistics of a row whose kVec values per lane are v (a warp holds the row): v is
// centred in place; mean and rstd for every lane.
template <int kVec>
__device__ __forceinline__ void warp_center_rstd(float (&v)[kVec], float inv_c, float eps, float& mean, float& rstd) {
  float sum = 0.f;
#pragma unroll
  for (int k = 0; k < kVec; ++k) sum += v[k];
#pragma unroll
  for (int o = 16; o >= 1; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  mean = sum * inv_c;
  float sq = 0.f;
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    v[k] -= mean;
    sq = fmaf(v[k], v[k], sq);
  }
#pragma unroll
  for (int o = 16; o >= 1; o >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o);
  rstd = rsqrtf(sq * inv_c + eps);
}

// The LayerNorm backward's row terms from acc1 = G·W (a warp's kMTiles x kNT m16n8 tiles at rows
// r0 .., columns c0 ..): grad_xn = m acc1, d ln_w += grad_xn xhat, d ln_b += grad_xn; acc1 becomes
// gxhat = grad_xn ln_w, and each row's sums of gxhat and gxhat xhat over the warp's columns go to
// red_s[(wc · TR + r) · 2 ..] (the quad's lanes hold a row's columns).
template <typename XT, int kMTiles, int kNT>
__device__ __forceinline__ void ln_row_terms(float (&acc1)[kMTiles][kNT][4], const XT* xt, int xs, const float* stat_s,
                                             const float* m_tile, const float (&lw_c)[kNT][2], float (&dlw)[kNT][2],
                                             float (&dlb)[kNT][2], float* red_s, int tr, int r0, int c0, int wc,
                                             int g, int t) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int r = r0 + mt * 16 + g + 8 * hr;
      const float mean = stat_s[2 * r], rstd = stat_s[2 * r + 1], mv = m_tile[r];
      float a = 0.f, b = 0.f;
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int c = c0 + nt * 8 + 2 * t + e;
          const float xh = (to_float(xt[r * xs + c]) - mean) * rstd;
          const float gxn = acc1[mt][nt][2 * hr + e] * mv;
          dlw[nt][e] = fmaf(gxn, xh, dlw[nt][e]);
          dlb[nt][e] += gxn;
          const float gxh = gxn * lw_c[nt][e];
          acc1[mt][nt][2 * hr + e] = gxh;
          a += gxh;
          b = fmaf(gxh, xh, b);
        }
      a += __shfl_xor_sync(0xffffffffu, a, 1);
      a += __shfl_xor_sync(0xffffffffu, a, 2);
      b += __shfl_xor_sync(0xffffffffu, b, 1);
      b += __shfl_xor_sync(0xffffffffu, b, 2);
      if (t == 0) red_s[(wc * tr + r) * 2] = a, red_s[(wc * tr + r) * 2 + 1] = b;
    }
}

// grad_x = rstd (gxhat - mean(gxhat) - xhat mean(gxhat xhat)) for the warp's tiles, from the kWC
// column slices' row sums in red_s, into gx_s (XT, rows xs apart) at the accumulators' places.
template <typename XT, int kWC, int kMTiles, int kNT>
__device__ __forceinline__ void ln_grad_x_tile(const float (&acc1)[kMTiles][kNT][4], const XT* xt, XT* gx_s, int xs,
                                               const float* stat_s, const float* red_s, int tr, float inv_c, int r0,
                                               int c0, int g, int t) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int r = r0 + mt * 16 + g + 8 * hr;
      float a = 0.f, b = 0.f;
#pragma unroll
      for (int w = 0; w < kWC; ++w) a += red_s[(w * tr + r) * 2], b += red_s[(w * tr + r) * 2 + 1];
      const float mean = stat_s[2 * r], rstd = stat_s[2 * r + 1], mg = a * inv_c, mgx = b * inv_c;
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        const int c = c0 + nt * 8 + 2 * t;
        const float xh0 = (to_float(xt[r * xs + c]) - mean) * rstd;
        const float xh1 = (to_float(xt[r * xs + c + 1]) - mean) * rstd;
        const float v0 = rstd * (acc1[mt][nt][2 * hr] - mg - xh0 * mgx);
        const float v1 = rstd * (acc1[mt][nt][2 * hr + 1] - mg - xh1 * mgx);
        if constexpr (std::is_same_v<XT, float>) {
          *reinterpret_cast<float2*>(gx_s + r * xs + c) = make_float2(v0, v1);
        } else {
          *reinterpret_cast<uint32_t*>(gx_s + r * xs + c) = pack_16bit<XT>(v0, v1);
        }
      }
    }
}

// d ln_w and d ln_b of the warp's columns (c0 + 8 nt + 2t + e): summed over g within the warp,
// then over the kWR row slices in turn into dln_sum[c] and dln_sum[C + c]; every thread calls it
// (it holds kWR barriers).
template <int kWR, int kNT>
__device__ __forceinline__ void ln_sum_dln(float (&dlw)[kNT][2], float (&dlb)[kNT][2], float* dln_sum, int C, int wr,
                                           int c0, int g, int t) {
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e)
#pragma unroll
      for (int o = 4; o <= 16; o <<= 1) {
        dlw[nt][e] += __shfl_xor_sync(0xffffffffu, dlw[nt][e], o);
        dlb[nt][e] += __shfl_xor_sync(0xffffffffu, dlb[nt][e], o);
      }
  for (int w = 0; w < kWR; ++w) {
    if (wr == w && g == 0) {
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int c = c0 + nt * 8 + 2 * t + e;
          dln_sum[c] = w == 0 ? dlw[nt][e] : dln_sum[c] + dlw[nt][e];
          dln_sum[C + c] = w == 0 ? dlb[nt][e] : dln_sum[C + c] + dlb[nt][e];
        }
    }
    __syncthreads();
  }
}

// ---- The tensor-core form, for 16-bit models (LnBackwardArgs.mma) ----
// The two products of each tile are GEMMs: grad_xn = (G · [W_a; W_b]) * m over K = 2H, and
// [dW_a; dW_b] += Gᵀ · (m xn) over the tile's rows, G = [grad_a | grad_b] rounded to XT as PyTorch's
// matmuls in the model's type round it (float32 sums).  A block of 8 warps takes tiles of 64 rows
// in turn: x (XT) and G (float32) come in by cp.async a tile ahead; each warp takes LayerNorm's
// statistics of 8 rows and writes m·xn as XT; both GEMMs run on mma.sync m16n8k16 from ldmatrix
// fragments (the warps a grid of kLnMmaWR row slices by 8 / kLnMmaWR column slices of 32); the
// row sums of the LayerNorm backward meet in shared memory, and grad_x is staged there so that
// its stores are whole rows.  C = 64·kMT (64, 128 or 256), H <= 32.
template <int kMT>
struct LnMmaLayout {
  static constexpr int C = 64 * kMT, TR = 64, WR = 4 / kMT, WC = 8 / WR;
  static constexpr int XS = C + 8;   // row stride (elements) of the x, xn and W tiles: ldmatrix rows
  static constexpr int GS = 64 + 8;  // on distinct banks
  static constexpr int x_bytes = 2 * TR * XS * 2, xn_bytes = TR * XS * 2, w_bytes = 64 * XS * 2;
  static constexpr int gf_bytes = 2 * TR * 64 * 4, gs_bytes = TR * GS * 2;
  static constexpr int m_bytes = 2 * TR * 4, stat_bytes = TR * 2 * 4, red_bytes = WC * TR * 2 * 4;
  static constexpr int off_x = 0, off_xn = off_x + x_bytes, off_w = off_xn + xn_bytes, off_gf = off_w + w_bytes;
  static constexpr int off_gs = off_gf + gf_bytes, off_m = off_gs + gs_bytes, off_stat = off_m + m_bytes;
  static constexpr int off_red = off_stat + stat_bytes, bytes = off_red + red_bytes;
  static_assert(x_bytes >= 64 * C * 4, "the x buffers hold the block's dW sums at the end");
};

template <typename XT, int kMT>
__global__ void __launch_bounds__(kLnBwdThreads, 1) opm_ln_backward_mma_kernel(const LnBackwardArgs p) {
  using L = LnMmaLayout<kMT>;
  constexpr int C = L::C, TR = L::TR, WC = L::WC, XS = L::XS, GS = L::GS;
  constexpr int VEC = C / 32;         // x elements per lane in the statistics
  extern __shared__ float4 smem_f4[];
  char* smem = reinterpret_cast<char*>(smem_f4);
  XT* x_s = reinterpret_cast<XT*>(smem + L::off_x);     // [2][TR][XS]
  XT* xn_s = reinterpret_cast<XT*>(smem + L::off_xn);   // [TR][XS]: m·xn, then grad_x
  XT* w_s = reinterpret_cast<XT*>(smem + L::off_w);     // [64][XS]: [W_a; W_b; 0]
  float* gf_s = reinterpret_cast<float*>(smem + L::off_gf);  // [2][TR][64]: [grad_a | grad_b | 0]
  XT* g_s = reinterpret_cast<XT*>(smem + L::off_gs);    // [TR][GS]
  float* m_s = reinterpret_cast<float*>(smem + L::off_m);     // [2][TR]
  float* stat_s = reinterpret_cast<float*>(smem + L::off_stat);  // [TR][2]: mean, rstd
  float* red_s = reinterpret_cast<float*>(smem + L::off_red);    // [WC][TR][2]

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int wr = warp / WC, wc = warp - wr * WC;
  const int H = p.H, H2 = 2 * H, K2 = (H2 + 15) & ~15;
  const float inv_c = 1.f / float(C);
  const int64_t ntiles = (p.rows + TR - 1) / TR;

  const auto w_at = [&](int h, int c) {
    return h < H ? p.wa[int64_t(h) * C + c] : h < H2 ? p.wb[int64_t(h - H) * C + c] : 0.f;
  };
  for (int idx = 2 * tid; idx < 64 * C; idx += 2 * kLnBwdThreads) {  // C is even: pairs stay in a row
    const int h = idx / C, c = idx - h * C;
    *reinterpret_cast<uint32_t*>(w_s + h * XS + c) = pack_16bit<XT>(w_at(h, c), w_at(h, c + 1));
  }

  // A tile's x rows and gradients into buffer buf: thread tid takes row tid / 4.
  const auto issue_tile = [&](int64_t tile, int buf) {
    const int r = tid >> 2;
    issue_ln_row<XT, C, 4>(p, tile * TR + r, tid & 3, x_s + (buf * TR + r) * XS, gf_s + (buf * TR + r) * 64,
                           m_s + buf * TR + r);
  };

  float acc2[4][4][4];  // [dW_a; dW_b] rows 16 mt + (g, g + 8), columns wc·32 + 8 nt + 2t (+1)
  zero_tiles(acc2);
  float dlw[4][2], dlb[4][2], dbias[4] = {0.f, 0.f, 0.f, 0.f};
  float lw_c[4][2], lw_v[VEC], lb_v[VEC];
  ln_thread_params(p, wc * 32, lane, t, lw_c, lw_v, lb_v, dlw, dlb);

  int64_t tile = blockIdx.x;
  int buf = 0;
  if (tile < ntiles) issue_tile(tile, 0);
  cp_async_commit();
  for (; tile < ntiles; tile += gridDim.x, buf ^= 1) {
    const int64_t next = tile + gridDim.x;
    if (next < ntiles) issue_tile(next, buf ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();  // this tile's x, gradients and mask in buffer buf

    // LayerNorm's statistics and m·xn, warp `warp` taking rows 8 warp .. 8 warp + 7.
    const XT* xt = x_s + buf * TR * XS;
    const float* m_tile = m_s + buf * TR;
#pragma unroll 2
    for (int i = 0; i < 8; ++i) {
      const int r = warp * 8 + i;
      float v[VEC], mean, rstd;
      load_pairs<XT, VEC>(xt + r * XS + lane * VEC, v);
      warp_center_rstd(v, inv_c, p.ln_eps, mean, rstd);
      const float mv = m_tile[r];
#pragma unroll
      for (int k = 0; k < VEC; ++k) v[k] = mv * fmaf(v[k] * rstd, lw_v[k], lb_v[k]);
      store_pairs<XT, VEC>(xn_s + r * XS + lane * VEC, v);
      if (lane == 0) stat_s[2 * r] = mean, stat_s[2 * r + 1] = rstd;
    }
    // G to XT (thread tid: columns 4 (tid % 16) .. + 3 of rows tid / 16 + 16 k), and d b_a, d b_b
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int r = tid / 16 + 16 * k, h = 4 * (tid & 15);
      const float4 v = *reinterpret_cast<const float4*>(gf_s + (buf * TR + r) * 64 + h);
      const float mv = m_tile[r];
      dbias[0] = fmaf(v.x, mv, dbias[0]), dbias[1] = fmaf(v.y, mv, dbias[1]);
      dbias[2] = fmaf(v.z, mv, dbias[2]), dbias[3] = fmaf(v.w, mv, dbias[3]);
      uint2 packed;
      packed.x = pack_16bit<XT>(v.x, v.y), packed.y = pack_16bit<XT>(v.z, v.w);
      *reinterpret_cast<uint2*>(g_s + r * GS + h) = packed;
    }
    __syncthreads();  // xn_s, g_s, stat_s complete

    // GEMM 1: acc1 = G · W for rows wr·16 kMT .., columns wc·32 ..
    float acc1[kMT][4][4];
    zero_tiles(acc1);
    const int r0 = wr * 16 * kMT, c0 = wc * 32;
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      if (ks * 16 >= K2) break;
      uint32_t af[kMT][4], bf[2][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
        ldmatrix_x4(af[mt], g_s + (r0 + mt * 16 + (lane & 7) + 8 * ((lane >> 3) & 1)) * GS + ks * 16 + 8 * (lane >> 4));
#pragma unroll
      for (int q = 0; q < 2; ++q)
        ldmatrix_x4_trans(bf[q], w_s + (ks * 16 + (lane & 7) + 8 * ((lane >> 3) & 1)) * XS + c0 + q * 16 + 8 * (lane >> 4));
      mma_16bit_tiles<XT, kMT, 4>(acc1, af, bf);
    }
    // GEMM 2: acc2 += Gᵀ · (m xn) over this warp's rows r0 .. r0 + 16 kMT - 1
#pragma unroll
    for (int kk = 0; kk < kMT; ++kk) {
      const int k0 = r0 + kk * 16;
      uint32_t bf[2][4];
#pragma unroll
      for (int q = 0; q < 2; ++q)
        ldmatrix_x4_trans(bf[q], xn_s + (k0 + (lane & 7) + 8 * ((lane >> 3) & 1)) * XS + c0 + q * 16 + 8 * (lane >> 4));
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
        if (mt * 16 >= K2) break;
        uint32_t af[4];
        ldmatrix_x4_trans(af, g_s + (k0 + (lane & 7) + 8 * (lane >> 4)) * GS + mt * 16 + 8 * ((lane >> 3) & 1));
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
          mma_16bit<XT>(acc2[mt][nt], af, bf[nt >> 1][(nt & 1) * 2], bf[nt >> 1][(nt & 1) * 2 + 1]);
      }
    }

    // grad_xn = m (G·W); d ln_w, d ln_b; gxhat and its row sums over this warp's columns.
    ln_row_terms(acc1, xt, XS, stat_s, m_tile, lw_c, dlw, dlb, red_s, TR, r0, c0, wc, g, t);
    __syncthreads();  // the row sums of every column slice; xn_s read by GEMM 2

    if (p.grad_x != nullptr) {  // block-uniform
      ln_grad_x_tile<XT, WC>(acc1, xt, xn_s, XS, stat_s, red_s, TR, inv_c, r0, c0, g, t);
      __syncthreads();  // grad_x's tile staged
      store_grad_x_row<XT, C, 4>(p, tile * TR + (tid >> 2), tid & 3, xn_s + (tid >> 2) * XS);
    }
    __syncthreads();  // buffers buf, xn_s, g_s and red_s free for the next tiles
  }
  cp_async_wait_all();

  // The block's partial sums, added in a fixed order: dW over the row slices (wr in turn) in the
  // x buffers, d ln_w and d ln_b over g within the warp, then over the row slices; d b over the
  // sixteen row groups of the conversion.
  float* dw_sum = reinterpret_cast<float*>(smem + L::off_x);  // [64][C]
  float* dln_sum = gf_s;                                       // [2][C]
  float* db_sum = gf_s + 2 * C;                                // [16][64]
  for (int w = 0; w < L::WR; ++w) {
    if (wr == w) {
#pragma unroll
      for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int h = mt * 16 + g + 8 * (e >> 1), c = wc * 32 + nt * 8 + 2 * t + (e & 1);
            float* d = dw_sum + h * C + c;
            *d = w == 0 ? acc2[mt][nt][e] : *d + acc2[mt][nt][e];
          }
    }
    __syncthreads();
  }
  ln_sum_dln<L::WR>(dlw, dlb, dln_sum, C, wr, wc * 32, g, t);
#pragma unroll
  for (int k = 0; k < 4; ++k) db_sum[(tid >> 4) * 64 + 4 * (tid & 15) + k] = dbias[k];
  __syncthreads();
  float db = 0.f;  // d b_a[tid] or d b_b[tid - H], for tid < 2H
  if (tid < H2)
    for (int k = 0; k < 16; ++k) db += db_sum[k * 64 + tid];
  store_ln_backward_partial(p, dw_sum, 64, dln_sum, C, 1, db);
}

// ---- The TF32 form, for float32 models under "high" (LnBackwardArgs.mma with float32 x) ----
// The same two GEMMs as the 16-bit form, on mma.sync m16n8k8 with operands rounded to TF32 as
// PyTorch's matmuls under "high" round them (float32 sums): grad_xn = (G · [W_a; W_b]) * m and
// [dW_a; dW_b] += Gᵀ · (m xn).  Tiles of 32 rows (float32 tiles of x, m·xn and W fill the shared
// memory); the 8 warps are 2 row slices by 4 column slices of C / 4 for grad_xn, and 2 slices of
// 32 rows of [dW_a; dW_b] by the same column slices for dW, so each warp holds whole sums of its
// part of dW.  ldmatrix cannot transpose 32-bit elements: fragments come from 32-bit shared loads,
// from rows C + 8 floats apart (x, m·xn, W) and 72 apart (G), which puts each load's 32 lanes
// on distinct banks (G's K-major reads in GEMM 1 excepted: two ways).  C = 64·kMT, H <= 32.
// kTerms = 3 is the form for "highest": the tiles stay float32 and each fragment is split into a
// TF32 high part and the remainder as it is loaded (split_tf32), three MMAs per product, and each
// k-step's products are formed in a zeroed fragment and added to the sums in float32
// (mma_split_add), so that the sums keep float32's accuracy (the tensor core truncates as it
// accumulates).
template <int kMT>
struct LnTf32Layout {
  static constexpr int C = 64 * kMT, TR = 32, XS = C + 8, GS = 72, CW = C / 4;
  static constexpr int x_bytes = 2 * TR * XS * 4, xn_bytes = TR * XS * 4, w_bytes = 64 * XS * 4;
  static constexpr int gf_bytes = 2 * TR * 64 * 4, gs_bytes = TR * GS * 4;
  static constexpr int m_bytes = 2 * TR * 4, stat_bytes = TR * 2 * 4, red_bytes = 4 * TR * 2 * 4;
  static constexpr int off_x = 0, off_xn = off_x + x_bytes, off_w = off_xn + xn_bytes, off_gf = off_w + w_bytes;
  static constexpr int off_gs = off_gf + gf_bytes, off_m = off_gs + gs_bytes, off_stat = off_m + m_bytes;
  static constexpr int off_red = off_stat + stat_bytes, bytes = off_red + red_bytes;
  static_assert(x_bytes >= 64 * C * 4, "the x buffers hold the block's dW sums at the end");
  static_assert(gf_bytes >= (2 * C + 32 * 64) * 4, "the gradient buffers hold d ln_w, d ln_b and d b at the end");
};

template <int kMT, int kTerms>
__global__ void __launch_bounds__(kLnBwdThreads, 1) opm_ln_backward_tf32_kernel(const LnBackwardArgs p) {
  static_assert(kTerms == 1 || kTerms == 3, "one TF32 term or three");
  // operands as the tiles hold them: rounded to TF32 once (one term), or float32 split per fragment
  const auto tile_value = [](float v) { return kTerms == 1 ? __uint_as_float(to_tf32(v)) : v; };
  using L = LnTf32Layout<kMT>;
  constexpr int C = L::C, TR = L::TR, XS = L::XS, GS = L::GS, CW = L::CW;
  constexpr int NT = CW / 8;        // n-tiles of 8 columns per warp
  constexpr int VEC = C / 32;       // x elements per lane in the statistics
  extern __shared__ float4 smem_f4[];
  char* smem = reinterpret_cast<char*>(smem_f4);
  float* x_s = reinterpret_cast<float*>(smem + L::off_x);      // [2][TR][XS]
  float* xn_s = reinterpret_cast<float*>(smem + L::off_xn);    // [TR][XS]: m·xn (TF32), then grad_x
  float* w_s = reinterpret_cast<float*>(smem + L::off_w);      // [64][XS]: [W_a; W_b; 0] (TF32)
  float* gf_s = reinterpret_cast<float*>(smem + L::off_gf);    // [2][TR][64]: [grad_a | grad_b | 0]
  float* g_s = reinterpret_cast<float*>(smem + L::off_gs);     // [TR][GS]: G (TF32)
  float* m_s = reinterpret_cast<float*>(smem + L::off_m);      // [2][TR]
  float* stat_s = reinterpret_cast<float*>(smem + L::off_stat);  // [TR][2]: mean, rstd
  float* red_s = reinterpret_cast<float*>(smem + L::off_red);    // [4][TR][2]
  const uint32_t* xn_u = reinterpret_cast<const uint32_t*>(xn_s);
  const uint32_t* w_u = reinterpret_cast<const uint32_t*>(w_s);
  const uint32_t* g_u = reinterpret_cast<const uint32_t*>(g_s);

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int wr = warp >> 2, wc = warp & 3;
  const int H = p.H, H2 = 2 * H, K2 = (H2 + 7) & ~7;
  const float inv_c = 1.f / float(C);
  const int64_t ntiles = (p.rows + TR - 1) / TR;

  for (int idx = tid; idx < 64 * C; idx += kLnBwdThreads) {
    const int h = idx / C, c = idx - h * C;
    const float w = h < H ? p.wa[int64_t(h) * C + c] : h < H2 ? p.wb[int64_t(h - H) * C + c] : 0.f;
    w_s[h * XS + c] = tile_value(w);
  }

  // A tile's x rows and gradients into buffer buf: thread tid takes row tid / 8.
  const auto issue_tile = [&](int64_t tile, int buf) {
    const int r = tid >> 3;
    issue_ln_row<float, C, 8>(p, tile * TR + r, tid & 7, x_s + (buf * TR + r) * XS, gf_s + (buf * TR + r) * 64,
                              m_s + buf * TR + r);
  };

  float acc2[2][NT][4];  // [dW_a; dW_b] rows 32 wr + 16 mt + (g, g + 8), columns wc·CW + 8 nt + 2t (+1)
  zero_tiles(acc2);
  float dlw[NT][2], dlb[NT][2], dbias[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  float lw_c[NT][2], lw_v[VEC], lb_v[VEC];
  ln_thread_params(p, wc * CW, lane, t, lw_c, lw_v, lb_v, dlw, dlb);

  int64_t tile = blockIdx.x;
  int buf = 0;
  if (tile < ntiles) issue_tile(tile, 0);
  cp_async_commit();
  for (; tile < ntiles; tile += gridDim.x, buf ^= 1) {
    const int64_t next = tile + gridDim.x;
    if (next < ntiles) issue_tile(next, buf ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();  // this tile's x, gradients and mask in buffer buf

    // LayerNorm's statistics and m·xn, warp `warp` taking rows 4 warp .. 4 warp + 3.
    const float* xt = x_s + buf * TR * XS;
    const float* m_tile = m_s + buf * TR;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = warp * 4 + i;
      float v[VEC], mean, rstd;
#pragma unroll
      for (int k = 0; k < VEC; k += 2) {
        const float2 f = *reinterpret_cast<const float2*>(xt + r * XS + lane * VEC + k);
        v[k] = f.x, v[k + 1] = f.y;
      }
      warp_center_rstd(v, inv_c, p.ln_eps, mean, rstd);
      const float mv = m_tile[r];
#pragma unroll
      for (int k = 0; k < VEC; k += 2) {
        float2 f;
        f.x = tile_value(mv * fmaf(v[k] * rstd, lw_v[k], lb_v[k]));
        f.y = tile_value(mv * fmaf(v[k + 1] * rstd, lw_v[k + 1], lb_v[k + 1]));
        *reinterpret_cast<float2*>(xn_s + r * XS + lane * VEC + k) = f;
      }
      if (lane == 0) stat_s[2 * r] = mean, stat_s[2 * r + 1] = rstd;
    }
    // G to TF32 (thread tid: columns 8 (tid % 8) .. + 7 of row tid / 8), and d b_a, d b_b
    {
      const int r = tid >> 3, h = 8 * (tid & 7);
      const float mv = m_tile[r];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float4 v = *reinterpret_cast<const float4*>(gf_s + (buf * TR + r) * 64 + h + 4 * half);
        dbias[4 * half] = fmaf(v.x, mv, dbias[4 * half]);
        dbias[4 * half + 1] = fmaf(v.y, mv, dbias[4 * half + 1]);
        dbias[4 * half + 2] = fmaf(v.z, mv, dbias[4 * half + 2]);
        dbias[4 * half + 3] = fmaf(v.w, mv, dbias[4 * half + 3]);
        float4 r4;
        r4.x = tile_value(v.x), r4.y = tile_value(v.y), r4.z = tile_value(v.z), r4.w = tile_value(v.w);
        *reinterpret_cast<float4*>(g_s + r * GS + h + 4 * half) = r4;
      }
    }
    __syncthreads();  // xn_s, g_s, stat_s complete

    // GEMM 1: acc1 = G · W for rows r0 .. r0 + 15, columns c0 .. c0 + CW - 1
    const int r0 = wr * 16, c0 = wc * CW;
    float acc1[1][NT][4];
    zero_tiles(acc1);
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) {
      const int k0 = ks * 8;
      if (k0 >= K2) break;
      uint32_t af[4];
      af[0] = g_u[(r0 + g) * GS + k0 + t], af[1] = g_u[(r0 + g + 8) * GS + k0 + t];
      af[2] = g_u[(r0 + g) * GS + k0 + t + 4], af[3] = g_u[(r0 + g + 8) * GS + k0 + t + 4];
      if constexpr (kTerms == 1) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const int c = c0 + nt * 8 + g;
          mma_tf32(acc1[0][nt], af, w_u[(k0 + t) * XS + c], w_u[(k0 + t + 4) * XS + c]);
        }
      } else {
        uint32_t a_hi[4], a_lo[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) split_tf32<3>(__uint_as_float(af[e]), a_hi[e], a_lo[e]);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const int c = c0 + nt * 8 + g;
          uint32_t b_hi0, b_lo0, b_hi1, b_lo1;
          split_tf32<3>(w_s[(k0 + t) * XS + c], b_hi0, b_lo0);
          split_tf32<3>(w_s[(k0 + t + 4) * XS + c], b_hi1, b_lo1);
          mma_split_add<3>(acc1[0][nt], a_hi, a_lo, b_hi0, b_hi1, b_lo0, b_lo1);
        }
      }
    }
    // GEMM 2: acc2 += Gᵀ · (m xn) over the tile's 32 rows, for rows 32 wr .. of [dW_a; dW_b]
#pragma unroll
    for (int kk = 0; kk < TR / 8; ++kk) {
      const int k0 = kk * 8;
      if constexpr (kTerms == 3) {
        // both m tiles' A fragments split once, then one column tile's B at a time (registers)
        uint32_t a_hi[2][4], a_lo[2][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          const int m0 = wr * 32 + mt * 16;
          split_tf32<3>(g_s[(k0 + t) * GS + m0 + g], a_hi[mt][0], a_lo[mt][0]);
          split_tf32<3>(g_s[(k0 + t) * GS + m0 + g + 8], a_hi[mt][1], a_lo[mt][1]);
          split_tf32<3>(g_s[(k0 + t + 4) * GS + m0 + g], a_hi[mt][2], a_lo[mt][2]);
          split_tf32<3>(g_s[(k0 + t + 4) * GS + m0 + g + 8], a_hi[mt][3], a_lo[mt][3]);
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const int c = c0 + nt * 8 + g;
          uint32_t b_hi0, b_lo0, b_hi1, b_lo1;
          split_tf32<3>(xn_s[(k0 + t) * XS + c], b_hi0, b_lo0);
          split_tf32<3>(xn_s[(k0 + t + 4) * XS + c], b_hi1, b_lo1);
#pragma unroll
          for (int mt = 0; mt < 2; ++mt)
            if (wr * 32 + mt * 16 < K2)
              mma_split_add<3>(acc2[mt][nt], a_hi[mt], a_lo[mt], b_hi0, b_hi1, b_lo0, b_lo1);
        }
      } else {
        uint32_t bf[NT][2];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const int c = c0 + nt * 8 + g;
          bf[nt][0] = xn_u[(k0 + t) * XS + c], bf[nt][1] = xn_u[(k0 + t + 4) * XS + c];
        }
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          const int m0 = wr * 32 + mt * 16;
          if (m0 >= K2) break;
          uint32_t af[4];
          af[0] = g_u[(k0 + t) * GS + m0 + g], af[1] = g_u[(k0 + t) * GS + m0 + g + 8];
          af[2] = g_u[(k0 + t + 4) * GS + m0 + g], af[3] = g_u[(k0 + t + 4) * GS + m0 + g + 8];
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) mma_tf32(acc2[mt][nt], af, bf[nt][0], bf[nt][1]);
        }
      }
    }

    // grad_xn = m (G·W); d ln_w, d ln_b; gxhat and its row sums over this warp's columns.
    ln_row_terms(acc1, xt, XS, stat_s, m_tile, lw_c, dlw, dlb, red_s, TR, r0, c0, wc, g, t);
    __syncthreads();  // the row sums of every column slice; xn_s read by GEMM 2

    if (p.grad_x != nullptr) {  // block-uniform
      ln_grad_x_tile<float, 4>(acc1, xt, xn_s, XS, stat_s, red_s, TR, inv_c, r0, c0, g, t);
      __syncthreads();  // grad_x's tile staged
      store_grad_x_row<float, C, 8>(p, tile * TR + (tid >> 3), tid & 7, xn_s + (tid >> 3) * XS);
    }
    __syncthreads();  // buffers buf, xn_s, g_s and red_s free for the next tiles
  }
  cp_async_wait_all();

  // The block's partial sums, added in a fixed order: each warp's dW entries are whole sums;
  // d ln_w and d ln_b over g within the warp, then over the two row slices; d b over the 32 rows'
  // thread groups of the conversion.
  float* dw_sum = reinterpret_cast<float*>(smem + L::off_x);  // [64][C]
  float* dln_sum = gf_s;                                       // [2][C]
  float* db_sum = gf_s + 2 * C;                                // [32][64]
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = wr * 32 + mt * 16 + g + 8 * (e >> 1), c = wc * CW + nt * 8 + 2 * t + (e & 1);
        dw_sum[h * C + c] = acc2[mt][nt][e];
      }
  ln_sum_dln<2>(dlw, dlb, dln_sum, C, wr, wc * CW, g, t);
#pragma unroll
  for (int k = 0; k < 8; ++k) db_sum[(tid >> 3) * 64 + 8 * (tid & 7) + k] = dbias[k];
  __syncthreads();
  float db = 0.f;  // d b_a[tid] or d b_b[tid - H], for tid < 2H
  if (tid < H2)
    for (int k = 0; k < 32; ++k) db += db_sum[k * 64 + tid];
  store_ln_backward_partial(p, dw_sum, 64, dln_sum, C, 1, db);
}

// grad[e] = sum over blocks of partial[block][e], each segment of the layout written to its own
// tensor (null: not needed).  Four running sums over the blocks, added at the end.
__global__ void __launch_bounds__(kLnBwdReduceThreads) opm_ln_backward_reduce_kernel(const LnBackwardReduceArgs p) {
  const int C = p.C, H = p.H;
  const int64_t P = ln_backward_partial_floats(C, H);
  const int64_t e = int64_t(blockIdx.x) * kLnBwdReduceThreads + threadIdx.x;
  if (e >= P) return;
  const int64_t HC = int64_t(H) * C;
  float* dst;
  int64_t off;
  if (e < HC) dst = p.grad_wa, off = e;
  else if (e < 2 * HC) dst = p.grad_wb, off = e - HC;
  else if (e < 2 * HC + C) dst = p.grad_lw, off = e - 2 * HC;
  else if (e < 2 * HC + 2 * C) dst = p.grad_lb, off = e - 2 * HC - C;
  else if (e < 2 * HC + 2 * C + H) dst = p.grad_ba, off = e - 2 * HC - 2 * C;
  else dst = p.grad_bb, off = e - 2 * HC - 2 * C - H;
  if (dst == nullptr) return;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  int blk = 0;
  for (; blk + 4 <= p.blocks; blk += 4) {
#pragma unroll
    for (int u = 0; u < 4; ++u) acc[u] += p.partial[int64_t(blk + u) * P + e];
  }
  for (; blk < p.blocks; ++blk) acc[0] += p.partial[int64_t(blk) * P + e];
  dst[off] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

}  // namespace flashopm
