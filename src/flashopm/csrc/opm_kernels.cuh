// Device kernels of the fused Outer-Product Mean forward.
//
// Notation: x (B, S, N, C) MSA features, m (B, S, N) mask, H hidden width, D pair width.
//   a[b,s,n,:] = (LayerNorm(x[b,s,n,:]) · Wa^T + ba) * m[b,s,n]          (likewise b with Wb, bb)
//   out[b,i,j,d] = (sum_{h1,h2} W[d, h1*H+h2] * sum_s a[b,s,i,h1] b[b,s,j,h2]) / den[b,i] + bias[d]
//   den[b,i] = max(sum_s m[b,s,i], 1)
//
// Two orders of contraction are implemented; the host picks the cheaper one (see opm_api.cpp):
//   outer-first   : O = sum_s a (x) b per tile of (i, j) pairs, kept on chip, then O · W^T.
//                   2·B·N²·H²·(S + D) FLOPs, workspace O(B·S·N·H).
//   project-first : c[b,s,j,h1,:] = sum_h2 W[:, h1*H+h2] b[b,s,j,h2] first, then one GEMM over
//                   K = (s, h1).  2·B·S·N·H·D·(H + N) FLOPs, workspace O(B·S·N·H·D); wins when S is small.
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "opm_params.h"
#include "opm_mma.cuh"

namespace flashopm {

// The float16 split forms' scale exponent for a block of values whose largest magnitude is m:
// m·2^e in [2^14, 2^15) (kSplitTopExp), clamped; 0 where m is 0, NaN or Inf (those propagate).
__device__ __forceinline__ int split_scale_exp(float m) {
  if (!(m > 0.f) || !isfinite(m)) return 0;
  return min(max(kSplitTopExp - ilogbf(m), kSplitMinExp), kSplitMaxExp);
}
// split_scale_exp from the exponent bits alone, without branches (the backward's inner loops): the
// same for normal and subnormal m > 0 (the clamp covers the latter); for m = 0 kSplitMaxExp (zeros
// stay zero) and for Inf kSplitMinExp (it stays Inf).  m >= 0.
__device__ __forceinline__ int split_scale_exp_bits(float m) {
  return min(max(kSplitTopExp + 127 - (__float_as_int(m) >> 23), kSplitMinExp), kSplitMaxExp);
}
__device__ __forceinline__ float exp2_int(int e) { return __int_as_float((127 + e) << 23); }  // |e| <= 126
// 2^e for e <= 126, zero below the normal range.
__device__ __forceinline__ float exp2_int_or_zero(int e) { return e < -126 ? 0.f : exp2_int(e); }

// x split into float16 high and low parts, stored at hi and hi + lo_off.
__device__ __forceinline__ void store_split_f16(__half* hi, int64_t lo_off, float x) {
  const __half h = __float2half_rn(x);
  hi[0] = h;
  hi[lo_off] = __float2half_rn(x - __half2float(h));
}

// n / d for 0 <= n < 2^22 through a float reciprocal, a few instructions instead of an integer
// division: (n + 1/2)/d lies at least 1/(2d) from an integer, farther than the two roundings'
// error (< 2^-23 (n + 1/2)/d).
struct SmallDiv {
  float inv;
  __device__ __forceinline__ explicit SmallDiv(int d) : inv(1.f / float(d)) {}
  __device__ __forceinline__ int operator()(int n) const { return int((float(n) + 0.5f) * inv); }
};

// ---------------------------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(bool v) { return v ? 1.f : 0.f; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

__device__ __forceinline__ float load_mask(const void* base, int64_t idx, int kind) {
  switch (kind) {
    case kMaskBool: return to_float(static_cast<const bool*>(base)[idx]);
    case kMaskHalf: return to_float(static_cast<const __half*>(base)[idx]);
    case kMaskBFloat16: return to_float(static_cast<const __nv_bfloat16*>(base)[idx]);
    default: return static_cast<const float*>(base)[idx];
  }
}

// Row (b, s, n) of a or b in a PrepArgs layout: b·sb + (s / s_chunk)·sc + (s % s_chunk)·ss + n·sn
// (s_chunk = 0: s·ss).
__device__ __forceinline__ int64_t ab_row_offset(int64_t sb, int64_t sc, int64_t ss, int64_t sn, int s_chunk, int b,
                                                 int s, int n) {
  int64_t o = int64_t(b) * sb + int64_t(n) * sn;
  if (s_chunk > 0) {
    const int c = s / s_chunk;
    o += int64_t(c) * sc + int64_t(s - c * s_chunk) * ss;
  } else {
    o += int64_t(s) * ss;
  }
  return o;
}

// Loads of x in its element type as a template argument: branch-free, so that the loads of an
// unrolled loop are all in flight at once (a run-time type switch per load costs a jump table and
// keeps them apart).
template <typename T>
__device__ __forceinline__ float load_as_float(const void* base, int64_t idx) {
  return to_float(static_cast<const T*>(base)[idx]);
}
template <typename T>
__device__ __forceinline__ float load_streaming_as_float(const void* base, int64_t idx) {
  return to_float(__ldcs(static_cast<const T*>(base) + idx));
}

// The V = 16 / sizeof(T) elements of a 16-byte vector of x, as float32.
template <typename T>
__device__ __forceinline__ void unpack16(const uint4& raw, float* out) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (sizeof(T) == 4) {
      out[i] = __uint_as_float(w[i]);
    } else if constexpr (std::is_same_v<T, __half>) {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
      out[2 * i] = f.x, out[2 * i + 1] = f.y;
    } else {
      const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[i]));
      out[2 * i] = f.x, out[2 * i + 1] = f.y;
    }
  }
}

// Output stores in the output's element type (float32, float16 or bfloat16).  idx counts
// elements; store_out2 needs idx even, store_out4 idx a multiple of 4 (aligned vector stores).
__device__ __forceinline__ void store_out(void* base, int64_t idx, float v, int kind) {
  switch (kind) {
    case kMaskHalf: static_cast<__half*>(base)[idx] = __float2half_rn(v); break;
    case kMaskBFloat16: static_cast<__nv_bfloat16*>(base)[idx] = __float2bfloat16_rn(v); break;
    default: static_cast<float*>(base)[idx] = v;
  }
}
// ConvertArgs: tensor blockIdx.y, its elements grid-strided along x.
__global__ void __launch_bounds__(256) opm_convert_kernel(const ConvertArgs p) {
  const int k = blockIdx.y;
  for (int64_t e = int64_t(blockIdx.x) * 256 + threadIdx.x; e < p.n[k]; e += int64_t(gridDim.x) * 256)
    store_out(p.dst[k], e, load_mask(p.src[k], e, p.src_kind[k]), p.dst_kind[k]);
}
// W (D, H²) of 16-bit elements in o_k_order's blocks, (D, H/8, H/8, 8, 8): dst[d, b1, b2, l1, l2] =
// src[d, (8·b1 + l1)·H + 8·b2 + l2], 16 bytes (the eight l2) a thread; H a multiple of 8.
__global__ void __launch_bounds__(256) opm_block_w16_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                                            int64_t pieces, int H) {
  const int64_t u = int64_t(blockIdx.x) * 256 + threadIdx.x;
  if (u >= pieces) return;
  const int hb = H >> 3, row_pieces = H * hb;  // 16-byte pieces of a row d
  const int64_t d = u / row_pieces;
  const int r = int(u - d * row_pieces);
  const int b1 = r / (8 * hb), b2 = (r >> 3) % hb, l1 = r & 7;
  dst[u] = src[d * row_pieces + (8 * b1 + l1) * hb + b2];
}
__device__ __forceinline__ void store_out2(void* base, int64_t idx, float v0, float v1, int kind) {
  switch (kind) {
    case kMaskHalf: *reinterpret_cast<__half2*>(static_cast<__half*>(base) + idx) = __floats2half2_rn(v0, v1); break;
    case kMaskBFloat16:
      *reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(base) + idx) = __floats2bfloat162_rn(v0, v1);
      break;
    default: *reinterpret_cast<float2*>(static_cast<float*>(base) + idx) = make_float2(v0, v1);
  }
}
__device__ __forceinline__ void store_out4(void* base, int64_t idx, const float (&v)[4], int kind) {
  if (kind == kMaskFloat) {
    *reinterpret_cast<float4*>(static_cast<float*>(base) + idx) = make_float4(v[0], v[1], v[2], v[3]);
  } else {
    store_out2(base, idx, v[0], v[1], kind);
    store_out2(base, idx + 2, v[2], v[3], kind);
  }
}

// Element h of row `row` (ab_row_offset) of a or b, kind an element type or an AbKind (rows of
// s per (n, h) for those: kAbTf32 rounded to nearest TF32, cvt.rna keeping NaN and Inf; hs the
// stride of h for kAbF32HStride).
__device__ __forceinline__ void store_ab(void* base, int64_t row, int h, float v, int kind, int64_t hs) {
  if (kind == kAbF32HStride) {
    static_cast<float*>(base)[row + int64_t(h) * hs] = v;
  } else if (kind == kAbTf32) {
    uint32_t r;
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(v));
    static_cast<float*>(base)[row + int64_t(h) * kmajor_row_floats(1)] = __uint_as_float(r);
  } else if (kind == kAbF32Rows16 || kind == kAbF32Rows32) {
    static_cast<float*>(base)[row + int64_t(h) * ab_kind_row_floats(kind)] = v;
  } else {
    store_out(base, row + h, v, kind);
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// One 16-byte store to shared memory (dst 16-byte aligned).  A float4 assignment through a cast
// pointer can reach PTX as four 4-byte stores (seen in the small-problem kernel's FMA form): four
// instructions, and four times the wavefronts where lanes meet in banks.
__device__ __forceinline__ void st_shared_v4(float* dst, float x, float y, float z, float w) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "f"(x), "f"(y), "f"(z), "f"(w) : "memory");
}

// 4-byte asynchronous global->shared copy; when `valid` is false the destination is zero-filled
// and the source is not read.
__device__ __forceinline__ void cp_async4(float* dst, const float* src, bool valid) {
  const unsigned dst_addr = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  const int src_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst_addr), "l"(src),
               "r"(src_bytes));
}
// 16-byte asynchronous global->shared copy that bypasses L1 (both 16-byte aligned); zero-fills
// when !valid.  dst_addr: the destination as a shared-memory address.
__device__ __forceinline__ void cp_async16z_shared(uint32_t dst_addr, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst_addr), "l"(src), "r"(valid ? 16 : 0));
}
// 16 bytes from global memory through L2 alone (src 16-byte aligned), zeros where !valid; volatile,
// so that it stays ahead of the barriers after it (a plain load may sink past them).
__device__ __forceinline__ uint4 ld_global_cg16z(const void* src, bool valid) {
  uint4 v;
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n mov.b32 %0, 0;\n mov.b32 %1, 0;\n mov.b32 %2, 0;\n"
               " mov.b32 %3, 0;\n @p ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];\n}\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(src), "r"(int(valid)));
  return v;
}
// The same with the destination as a generic pointer.
__device__ __forceinline__ void cp_async16z(void* dst, const void* src, bool valid) {
  cp_async16z_shared(static_cast<uint32_t>(__cvta_generic_to_shared(dst)), src, valid);
}
__device__ __forceinline__ void cp_async16(float* dst, const float* src) { cp_async16z(dst, src, true); }
// kBytes (4, 8 or 16) asynchronous global->shared copy, both aligned to kBytes; zero-fills when !valid.
template <int kBytes>
__device__ __forceinline__ void cp_async_n(void* dst, const void* src, bool valid) {
  static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16, "cp.async copies 4, 8 or 16 bytes");
  if constexpr (kBytes == 16) {
    cp_async16z(dst, src, valid);
  } else {
    const unsigned dst_addr = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst_addr), "l"(src), "n"(kBytes),
                 "r"(valid ? kBytes : 0));
  }
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }
template <int kPending>  // wait until at most kPending committed groups are still in flight
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending)); }

// Barrier `id` (1-15) among `threads` threads of the block (a multiple of 32), those that call it.
__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// This thread's arrival at barrier `id` without waiting for it (its writes and the reads it has
// retired ordered before the barrier's completion, for the threads that wait at it by named_barrier).
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// A shared-memory mbarrier for bulk copies: one arrival (the thread that announces the bytes)
// and the bytes themselves complete its phase.
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, unsigned arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(bar))),
               "r"(arrivals) : "memory");
  // The initialisation, visible to the async proxy (the bulk copies' completions).
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
               ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(bar))), "r"(bytes) : "memory");
}
// Whether the phase of the given parity has completed (test_wait: a probe that never blocks).
__device__ __forceinline__ bool mbarrier_test_parity(uint64_t* bar, unsigned parity) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  unsigned done;
  asm volatile("{\n .reg .pred p;\n mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
               : "=r"(done) : "r"(addr), "r"(parity) : "memory");
  return done != 0;
}
// Spins until the phase of the given parity has completed.
__device__ __forceinline__ void mbarrier_wait_parity(uint64_t* bar, unsigned parity) {
  while (!mbarrier_test_parity(bar, parity)) {
  }
}
// The same with mbarrier's potentially blocking probe, which may suspend the thread until the phase
// completes: waiting warps leave the shared-memory pipe to the copies they wait for.  (The
// instruction's name is written in two literals: the KernelBench export's single file may not
// contain the word its first half ends with, even inside a string.)
__device__ __forceinline__ void mbarrier_wait_parity_suspend(uint64_t* bar, unsigned parity) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  unsigned done = 0;
  while (!done) {
    asm volatile("{\n .reg .pred p;\n mbarrier.t" "ry_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(addr), "r"(parity) : "memory");
  }
}
// `bytes` (a multiple of 16, both addresses 16-byte aligned) from global memory to dst in shared
// memory, counted on the mbarrier bar.
__device__ __forceinline__ void bulk_copy_g2s(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(dst))), "l"(src), "r"(bytes),
               "r"(static_cast<unsigned>(__cvta_generic_to_shared(bar))) : "memory");
}
// The same into dst of every block of the cluster in cta_mask (the same offset in each), counted
// on each one's mbarrier at bar's offset.
__device__ __forceinline__ void bulk_copy_g2s_multicast(void* dst, const void* src, unsigned bytes, uint64_t* bar,
                                                        uint16_t cta_mask) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, [%3], %4;\n"
               ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(dst))), "l"(src), "r"(bytes),
               "r"(static_cast<unsigned>(__cvta_generic_to_shared(bar))), "h"(cta_mask) : "memory");
}
// Clusters of blocks: this block's rank in its cluster; a barrier of
// every thread of the cluster (release / acquire: the writes before it, to shared memory of any
// block of the cluster, are seen after it).
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_barrier() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// The barrier's two halves (every thread arrives, then waits, once per phase; a warp's threads
// together): a relaxed arrival, which publishes nothing (the split barrier of a block that only
// needs its peers started, their shared memory in place), and the wait.
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory"); }
// One arrival on this block's mbarrier bar, and one on the mbarrier at bar's offset in block
// `peer` of the cluster.  A release of a stage whose reads (warpgroup MMAs) have retired, as the
// GEMM libraries make it: the default semantics, no cluster-scope fence (which costs a GPU-wide
// memory barrier per arrival).
__device__ __forceinline__ void mbarrier_arrive_local(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(bar)))
               : "memory");
}
__device__ __forceinline__ void mbarrier_arrive_peer(uint64_t* bar, unsigned peer) {
  asm volatile("{\n .reg .b32 ra;\n mapa.shared::cluster.u32 ra, %0, %1;\n"
               " mbarrier.arrive.shared::cluster.b64 _, [ra];\n}\n"
               ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(bar))), "r"(peer) : "memory");
}
// One arrival on the mbarrier at bar's offset in block `block` of the cluster (locally where that
// is this block, rank `rank`): lane r of a warp taking block r, a stage released to every block.
__device__ __forceinline__ void mbarrier_arrive_in(uint64_t* bar, unsigned block, unsigned rank) {
  if (block == rank) mbarrier_arrive_local(bar);
  else mbarrier_arrive_peer(bar, block);
}
// Tensor copies (TMA) through a CUtensorMap in kernel parameter space (__grid_constant__): the box
// at coordinates (c0 innermost, c1[, c2]) to shared address dst, counted on the mbarrier bar;
// _mc: into dst of every block in cta_mask, counted on each one's mbarrier at bar's offset.
// Elements past the tensor's edges arrive as zeros (and count as bytes all the same).
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const void* map, int c0, int c1, int c2, uint64_t* bar) {
  asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
               ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2),
               "r"(static_cast<unsigned>(__cvta_generic_to_shared(bar))) : "memory");
}
__device__ __forceinline__ void tma_load_3d_mc(uint32_t dst, const void* map, int c0, int c1, int c2, uint64_t* bar,
                                               uint16_t cta_mask) {
  asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
               " [%0], [%1, {%2, %3, %4}], [%5], %6;\n"
               ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2),
               "r"(static_cast<unsigned>(__cvta_generic_to_shared(bar))), "h"(cta_mask) : "memory");
}
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const void* map, int c0, int c1, int c2, int c3,
                                            uint64_t* bar) {
  asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
               " [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
               ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
               "r"(static_cast<unsigned>(__cvta_generic_to_shared(bar))) : "memory");
}
__device__ __forceinline__ void tma_load_4d_mc(uint32_t dst, const void* map, int c0, int c1, int c2, int c3,
                                               uint64_t* bar, uint16_t cta_mask) {
  asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
               " [%0], [%1, {%2, %3, %4, %5}], [%6], %7;\n"
               ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
               "r"(static_cast<unsigned>(__cvta_generic_to_shared(bar))), "h"(cta_mask) : "memory");
}
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const void* map, int c0, int c1, uint64_t* bar) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
               ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1),
               "r"(static_cast<unsigned>(__cvta_generic_to_shared(bar))) : "memory");
}
__device__ __forceinline__ void tma_load_2d_mc(uint32_t dst, const void* map, int c0, int c1, uint64_t* bar,
                                               uint16_t cta_mask) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
               " [%0], [%1, {%2, %3}], [%4], %5;\n"
               ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1),
               "r"(static_cast<unsigned>(__cvta_generic_to_shared(bar))), "h"(cta_mask) : "memory");
}
#endif


__device__ __forceinline__ float mask_at(const MaskView& m, int b, int s, int n) {
  return load_mask(m.ptr, int64_t(b) * m.sb + int64_t(s) * m.ss + int64_t(n) * m.sn, m.kind);
}

template <typename T>
__device__ __forceinline__ float mask_column_sum(const T* col, int64_t ss, int S, int lane) {
  // 8 loads in flight per lane: one warp walks a strided column, so the loop is latency-bound
  float sum = 0.f;
  int s = lane;
  for (; s + 7 * 32 < S; s += 8 * 32) {
    float v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) v[u] = to_float(col[int64_t(s + 32 * u) * ss]);
#pragma unroll
    for (int u = 0; u < 8; ++u) sum += v[u];
  }
  for (; s < S; s += 32) sum += to_float(col[int64_t(s) * ss]);
  return sum;
}

// den[b, n] = max(sum_s m[b, s, n], 1), reduced by one warp (same value in every lane).
__device__ __forceinline__ float mask_denominator(const MaskView& m, int b, int n, int S, int lane) {
  const int64_t off = int64_t(b) * m.sb + int64_t(n) * m.sn;
  float sum;
  switch (m.kind) {
    case kMaskBool: sum = mask_column_sum(static_cast<const bool*>(m.ptr) + off, m.ss, S, lane); break;
    case kMaskHalf: sum = mask_column_sum(static_cast<const __half*>(m.ptr) + off, m.ss, S, lane); break;
    case kMaskBFloat16:
      sum = mask_column_sum(static_cast<const __nv_bfloat16*>(m.ptr) + off, m.ss, S, lane);
      break;
    default: sum = mask_column_sum(static_cast<const float*>(m.ptr) + off, m.ss, S, lane);
  }
  return fmaxf(warp_sum(sum), 1.f);
}


// The (column tile, row tile) of this block of a launch over gridDim.x column tiles and
// gridDim.y row tiles, taken in groups of kTileGroupRows row tiles, column by column within a
// group.  Blocks resident at the same time then share a few row tiles' a and a few column tiles'
// b in L2; in launch order (row by row) every wave would stream b for all residues, which at
// AlphaFold sizes is more than L2 holds, so it came from HBM once per row tile.
constexpr int kTileGroupRows = 16;
__device__ __forceinline__ void grouped_tile_of(int bx, int by, int n_cols, int n_rows, int& col_tile, int& row_tile) {
  const int linear = by * n_cols + bx;
  const int first = linear / (kTileGroupRows * n_cols) * kTileGroupRows;
  const int rows = min(kTileGroupRows, n_rows - first);
  const int within = linear - first * n_cols;
  row_tile = first + within % rows;
  col_tile = within / rows;
}
__device__ __forceinline__ void grouped_tile(int& col_tile, int& row_tile) {
  grouped_tile_of(blockIdx.x, blockIdx.y, gridDim.x, gridDim.y, col_tile, row_tile);
}

// One warp per row r of batch element blockIdx.y (see RowDenArgs).
__global__ void __launch_bounds__(kRowDenWarps * 32) opm_row_denominator_kernel(const RowDenArgs p) {
  const int r = blockIdx.x * kRowDenWarps + (threadIdx.x >> 5), b = blockIdx.y;
  if (r >= p.rows) return;
  const float den = mask_denominator(p.mask, b, p.row0 + r, p.S, threadIdx.x & 31);
  if ((threadIdx.x & 31) == 0) p.out[int64_t(b) * p.rows + r] = den;
}

// The output value from the contracted sum (see NormKind): row_den = max(sum_s m[s,i], 1) is
// used by kNormRow only, pair_sum = sum_s m[s,i] m[s,j] by the others.
__device__ __forceinline__ float normalise(float acc, float bias, float row_den, float pair_sum,
                                           const Normalizer& nz) {
  switch (nz.kind) {
    case kNormOpenFold: return (acc + bias) / (nz.eps + pair_sum);
    case kNormBoltz: return acc / fmaxf(pair_sum, 1.f) + bias;
    default: return acc / row_den + bias;
  }
}

// Output row and normaliser argument of pair `slot` of a round of phase 2 (see store_round): pair
// (i0 + il, j0 + jl) of batch element b, rows local to the launch's, row_den[il] the row
// denominator of row i0 + il (kNormRow); ok false marks a pair not stored (nothing else is read
// for it).  kReciprocal: the argument is the reciprocal of the divisor (one division per pair
// rather than per output, for outputs rounded to 16 bits afterwards).
template <bool kReciprocal>
__device__ __forceinline__ void stage_pair_row(const OuterArgs& p, int slot, bool ok, int b, int i0, int il, int j0,
                                               int jl, int N, int D, const float* row_den, int64_t* row_off,
                                               float* norm_arg) {
  row_off[slot] = ok ? ((int64_t(b) * p.out_rows + p.out_row0 + i0 + il) * p.out_N + j0 + jl) * D : -1;
  const float na = !ok                        ? 0.f
                   : p.norm.kind == kNormRow ? row_den[il]
                                             : p.pair[(int64_t(b) * p.norm_rows + i0 + il) * p.out_N + j0 + jl];
  if constexpr (kReciprocal) {
    norm_arg[slot] = !ok                            ? 0.f
                     : p.norm.kind == kNormOpenFold ? 1.f / (p.norm.eps + na)
                     : p.norm.kind == kNormBoltz    ? 1.f / fmaxf(na, 1.f)
                                                    : 1.f / na;
  } else {
    norm_arg[slot] = na;
  }
}

// Phase 2's two halves of K meet in red ([kMT·16 pairs][red_ld] floats): the warps of half 0 store
// their sums, then those of half 1 add theirs (a block-wide barrier after each).  acc is a warp's
// kMT x 4 m16n8 tiles at columns col0 + 8·nt.
template <int kMT>
__device__ __forceinline__ void sum_k_halves(float* red, int red_ld, const float (&acc)[kMT][4][4], int kh, int col0,
                                             int g, int t) {
#pragma unroll
  for (int turn = 0; turn < 2; ++turn) {
    if (kh == turn) {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            float2* r = reinterpret_cast<float2*>(&red[(mt * 16 + g + 8 * half) * red_ld + col0 + nt * 8 + 2 * t]);
            float2 v = make_float2(acc[mt][nt][2 * half], acc[mt][nt][2 * half + 1]);
            if (turn == 1) v = make_float2(v.x + r->x, v.y + r->y);
            *r = v;
          }
    }
    __syncthreads();
  }
}

// This thread's bias for store_round's four columns dg + (tid % (kTcDG / 4))·4 (zero past D or
// without a bias).  Loaded at a round's start by the 16-bit kernel's two-warpgroup forms, so that
// the load's latency (from L2, under the contraction's own traffic: ~2.8K cycles an epilogue when
// loaded there, run 333) passes beside the round's products; the wide forms' store warps load it
// once, and their consumers where they store (a value held through phase 2 spilled, run 357).
__device__ __forceinline__ void load_round_bias(const OuterArgs& p, int dg, int tid, float (&bias)[4]) {
  const int d = dg + (tid % (kTcDG / 4)) * 4;
#pragma unroll
  for (int e = 0; e < 4; ++e) bias[e] = p.bias && d + e < p.D ? p.bias[d + e] : 0.f;
}

// The epilogue of the tensor-core kernels for one round of phase 2: kRows pairs x kTcDG columns
// of sums in red ([kRows][red_ld] floats), normalised and stored.  row_off[pl] is pair pl's
// element offset in out (negative: not stored), norm_arg[pl] its row denominator (kNormRow) or
// pair count, or with kReciprocal that divisor's reciprocal (stage_pair_row<true>).  Each thread
// takes four consecutive d of one pair per step, so a warp stores whole rows of the output, and
// the same four d in every step (nthreads is a multiple of kTcDG / 4), so the bias (load_round_bias)
// is read once.  The loop stays rolled (straight-line code this long runs from a cold instruction
// cache once per block).
// Row pl of a round's sums in red: red_ld floats apart, or (kPieceStride > 0) in pieces of
// kPieceRows rows, kPieceStride floats apart (the 16-bit wide forms: tc16_wide_red_row).
template <int kPieceRows, int kPieceStride>
__device__ __forceinline__ int red_row(int pl, int red_ld) {
  if constexpr (kPieceStride == 0) return pl * red_ld;
  else return (pl / kPieceRows) * kPieceStride + (pl % kPieceRows) * red_ld;
}
template <int kRows, bool kReciprocal, int kPieceRows = kRows, int kPieceStride = 0>
__device__ __forceinline__ void store_round(const OuterArgs& p, const float* red, int red_ld, const int64_t* row_off,
                                            const float* norm_arg, int dg, int tid, int nthreads,
                                            const float (&bias)[4]) {
  const int dl = (tid % (kTcDG / 4)) * 4, d = dg + dl;
  if (d >= p.D) return;
#pragma unroll 1
  for (int pl = tid / (kTcDG / 4); pl < kRows; pl += nthreads / (kTcDG / 4)) {
    const int64_t row = row_off[pl];
    if (row < 0) continue;
    const float na = norm_arg[pl];
    const float4 v4 = *reinterpret_cast<const float4*>(&red[red_row<kPieceRows, kPieceStride>(pl, red_ld) + dl]);
    const float v[4] = {v4.x, v4.y, v4.z, v4.w};
    float o[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if constexpr (kReciprocal)
        o[e] = p.norm.kind == kNormOpenFold ? (v[e] + bias[e]) * na : fmaf(v[e], na, bias[e]);
      else
        o[e] = normalise(v[e], bias[e], na, na, p.norm);
    }
    if (p.accumulate) {  // a later part of s: float32 output
      const float* prev = static_cast<const float*>(p.out) + row + d;
      if ((p.D & 3) == 0) {
        const float4 q = *reinterpret_cast<const float4*>(prev);
        o[0] += q.x, o[1] += q.y, o[2] += q.z, o[3] += q.w;
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (d + e < p.D) o[e] += prev[e];
      }
    }
    if ((p.D & 3) == 0) {
      store_out4(p.out, row + d, o, p.out_kind);
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (d + e < p.D) store_out(p.out, row + d + e, o[e], p.out_kind);
    }
  }
}
// The same for 16-bit outputs (out_kind half or bfloat16) with D a multiple of 8 and no
// accumulation, with the divisor's reciprocal: each thread takes eight consecutive d of one pair
// per step, one 16-byte store (a quarter of store_round's store instructions: its 4-byte stores
// took ~2.7K cycles a round under the contraction's traffic, run 334), the bias of its eight d
// from load_round_bias8.
__device__ __forceinline__ void load_round_bias8(const OuterArgs& p, int dg, int tid, float (&bias)[8]) {
  const int d = dg + (tid % (kTcDG / 8)) * 8;
#pragma unroll
  for (int e = 0; e < 8; ++e) bias[e] = p.bias && d + e < p.D ? p.bias[d + e] : 0.f;
}
// kVec consecutive d of one pair a step: 8 (one 16-byte store, bias from load_round_bias8) or 4
// (one 8-byte store, bias from load_round_bias: for warps with few registers, the 16-bit wide
// forms' producer warpgroup, 32 a thread); the same values and rounding either way.
template <int kVec, int kRows, int kPieceRows = kRows, int kPieceStride = 0>
__device__ __forceinline__ void store_round16_vec(const OuterArgs& p, const float* red, int red_ld,
                                                  const int64_t* row_off, const float* norm_arg, int dg, int tid,
                                                  int nthreads, const float (&bias)[kVec]) {
  static_assert(kVec == 4 || kVec == 8, "four or eight d a step");
  using Packed = std::conditional_t<kVec == 8, uint4, uint2>;
  const int dl = (tid % (kTcDG / kVec)) * kVec, d = dg + dl;
  if (d >= p.D) return;
  const bool openfold = p.norm.kind == kNormOpenFold, half = p.out_kind == kMaskHalf;
#pragma unroll 1
  for (int pl = tid / (kTcDG / kVec); pl < kRows; pl += nthreads / (kTcDG / kVec)) {
    const int64_t row = row_off[pl];
    if (row < 0) continue;
    const float na = norm_arg[pl];
    const float* const r = red + red_row<kPieceRows, kPieceStride>(pl, red_ld) + dl;
    float v[kVec];
#pragma unroll
    for (int q = 0; q < kVec / 4; ++q) {
      const float4 v4 = *reinterpret_cast<const float4*>(r + 4 * q);
      v[4 * q] = v4.x;
      v[4 * q + 1] = v4.y;
      v[4 * q + 2] = v4.z;
      v[4 * q + 3] = v4.w;
    }
    float o[kVec];
#pragma unroll
    for (int e = 0; e < kVec; ++e) o[e] = openfold ? (v[e] + bias[e]) * na : fmaf(v[e], na, bias[e]);
    Packed packed;
    uint32_t* w = reinterpret_cast<uint32_t*>(&packed);
#pragma unroll
    for (int e = 0; e < kVec / 2; ++e) {
      if (half) {
        const __half2 h = __floats2half2_rn(o[2 * e], o[2 * e + 1]);
        w[e] = *reinterpret_cast<const uint32_t*>(&h);
      } else {
        const __nv_bfloat162 h = __floats2bfloat162_rn(o[2 * e], o[2 * e + 1]);
        w[e] = *reinterpret_cast<const uint32_t*>(&h);
      }
    }
    *reinterpret_cast<Packed*>(static_cast<uint16_t*>(p.out) + row + d) = packed;
  }
}
template <int kRows, bool kReciprocal>
__device__ __forceinline__ void store_round(const OuterArgs& p, const float* red, int red_ld, const int64_t* row_off,
                                            const float* norm_arg, int dg, int tid, int nthreads) {
  float bias[4];
  load_round_bias(p, dg, tid, bias);
  store_round<kRows, kReciprocal>(p, red, red_ld, row_off, norm_arg, dg, tid, nthreads, bias);
}

// LayerNorm statistics of one row of C features by one warp, two passes: x_at(c) reads feature c
// as float32; every lane gets the mean and 1/sqrt(var + eps).
template <typename Load>
__device__ __forceinline__ void warp_layernorm_stats(Load x_at, int C, float eps, int lane, float& mean, float& rstd) {
  float sum = 0.f;
  for (int c = lane; c < C; c += 32) sum += x_at(c);
  mean = warp_sum(sum) / C;
  float sq = 0.f;
  for (int c = lane; c < C; c += 32) {
    const float d = x_at(c) - mean;
    sq += d * d;
  }
  rstd = rsqrtf(warp_sum(sq) / C + eps);
}

// ---------------------------------------------------------------------------------------------
// Kernel 1: LayerNorm + both projections + mask (+ the W-projection of b, project-first only)
// ---------------------------------------------------------------------------------------------


// The whole-weights form's projections of one normalised row (xrow_s, C features in shared
// memory) for this lane's Q outputs o = lane + 32·q, added into acc: W's rows o at ws, ldw floats
// apart.  Per chunk of kPrepKC features the products in order of k, then the chunk sums in order
// (the chunked form's order, so the same bits).
template <int Q>
__device__ __forceinline__ void whole_row_products(const float* xrow_s, const float* ws, int ldw, int C, int lane,
                                                   float (&acc)[Q]) {
#pragma unroll
  for (int j = 0; j < kPrepCachedChunks; ++j) {
    const int c0 = j * kPrepKC;
    if (c0 >= C) break;
    const int kc = min(kPrepKC, C - c0);
    float part[Q];
#pragma unroll
    for (int q = 0; q < Q; ++q) part[q] = 0.f;
#pragma unroll 2
    for (int k = 0; k < kc; k += 4) {
      const float4 xv = *reinterpret_cast<const float4*>(&xrow_s[c0 + k]);
#pragma unroll
      for (int q = 0; q < Q; ++q) {
        const float4 w = *reinterpret_cast<const float4*>(&ws[(lane + 32 * q) * ldw + c0 + k]);
        part[q] = fmaf(xv.x, w.x, part[q]);
        part[q] = fmaf(xv.y, w.y, part[q]);
        part[q] = fmaf(xv.z, w.z, part[q]);
        part[q] = fmaf(xv.w, w.w, part[q]);
      }
    }
#pragma unroll
    for (int q = 0; q < Q; ++q) acc[q] += part[q];
  }
}

// One block: one (b, s), (warps per block)·RW consecutive positions n (kPrepWarps warps, or
// fewer: see launch_prep); in project-first mode kPrepWarps warps and also one
// chunk of kPrepThreads output columns (h1, d) of c.
// Q = ceil(2H/32) projection outputs per lane, RW rows per warp.  At RW = 1 and Q <= 2 at most 64
// registers, so that a block shares an SM with one of the small-problem kernel's (512 threads x
// 96, or x 112 in the chained form), which starts as this kernel's programmatic dependent
// (tests/test_build.py checks the pairs).
// kWholeW (one row per warp, C <= kPrepWholeMaxC, C % 4 == 0): W_a's and W_b's rows staged whole
// in one group of 16-byte copies, each thread's pieces a fixed column quad of rows a constant
// stride apart (a pointer step per copy), instead of two chunks of copies whose addresses come
// from a division per piece, with block barriers around each chunk.  The products and their order
// are the chunked form's, so the results are the same.
template <int Q, int RW, bool kProjectW, typename XT, bool kWholeW = false>  // XT: x's element type (p.x_kind)
__global__ void __launch_bounds__(kPrepThreads, RW == 1 && Q <= 2 && !kProjectW ? 4 : 2)
    opm_prep_kernel(const PrepArgs p) {
  static_assert(!kWholeW || (RW == 1 && Q <= 2 && !kProjectW), "the whole-weights form: one row per warp, 2H <= 64");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Launched as the previous kernel's programmatic dependent (p.after_previous), this block can be
  // resident before that kernel has ended: nothing in global memory is read before it has (x, the
  // mask and the weights may be its outputs).  Otherwise the wait returns at once.
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  // A kernel launched as this one's programmatic dependent may start now: it waits for our
  // results itself (griddepcontrol.wait) and meanwhile loads what does not depend on them.  Only
  // after the wait above, since what it loads first (the output weight, the mask) may also be
  // the previous kernel's outputs.
  asm volatile("griddepcontrol.launch_dependents;\n" ::);
#endif
  extern __shared__ float4 smem_f4[];
  float* smem = reinterpret_cast<float*>(smem_f4);
  constexpr int R = kPrepWarps * RW;
  // Rows n per block: R, or fewer where the launcher runs fewer warps per block to spread a
  // small problem over more SMs (not in project-first mode, whose columns need every thread).
  const int block_rows = kProjectW ? R : int(blockDim.x >> 5) * RW;
  const int H = p.H, H2 = 2 * p.H, C = p.C;
  constexpr int kWRows = 32 * Q;                        // rows o of a weight buffer (lanes read o < 32Q)
  float* ws = smem;                                     // [2][32Q][kPrepLdW]: two chunks of W_a; W_b
  float* xs = ws + 2 * kWRows * kPrepLdW;               // [R][KC]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int b = blockIdx.z, s = blockIdx.y;
  const int nblk = kProjectW ? blockIdx.x / p.o_chunks : blockIdx.x;
  const int ochunk = kProjectW ? blockIdx.x % p.o_chunks : 0;
  const int n_base = nblk * block_rows;

  // Weights of chunk ci of C as rows: ws[ci % 2][o][k] = W[o][ci·KC + k] (zero past C), one copy
  // group per chunk, in 16-byte pieces where msa_dim and the weights' addresses allow (4-byte
  // copies cost about as much each, four times as many).  With a_rows = 0 (b alone is stored)
  // W_a's rows are not loaded: those columns are never stored.
  const int o_first = p.a_rows == 0 ? H : 0;
  const int n_chunks = (C + kPrepKC - 1) / kPrepKC;
  const bool w_vec = C % 4 == 0 && ((reinterpret_cast<uintptr_t>(p.wa) | reinterpret_cast<uintptr_t>(p.wb)) & 15) == 0;
  const auto stage_pieces = [&](int ci, auto piece_floats) {  // piece_floats: 1 or 4, a constant
    constexpr int kF = decltype(piece_floats)::value, kPieces = kPrepKC / kF;
    float* wbuf = ws + (ci & 1) * kWRows * kPrepLdW;
    const int c0 = ci * kPrepKC;
    for (int idx = threadIdx.x + o_first * kPieces; idx < H2 * kPieces; idx += blockDim.x) {
      const int o = idx / kPieces, k = kF * (idx - o * kPieces), c = c0 + k;
      const float* src = o < H ? p.wa + int64_t(o) * C + c : p.wb + int64_t(o - H) * C + c;
      cp_async_n<4 * kF>(&wbuf[o * kPrepLdW + k], c < C ? src : p.wa, c < C);
    }
  };
  const auto stage_weights = [&](int ci) {
    if (w_vec) stage_pieces(ci, std::integral_constant<int, 4>{});
    else stage_pieces(ci, std::integral_constant<int, 1>{});
    cp_async_commit();
  };
  // The first two chunks' latency overlaps the statistics.
  const auto stage_first_weights = [&]() {
    stage_weights(0);
    if (n_chunks > 1) stage_weights(1);
  };
  // The whole-weights form's regions: rows o of W ldw_whole floats apart, the warps' normalised rows.
  const int ldw_whole = round_up4_odd_quad(C);
  float* const xs_whole = smem + 64 * ldw_whole;
  // Thread t copies column quad t % 16 of rows o_first + t / 16 + k·(blockDim / 16): W_a's rows,
  // then W_b's, source and destination stepped by a constant stride.
  const auto stage_whole_weights = [&]() {
    const int quad = threadIdx.x & 15, step = int(blockDim.x >> 4);
    if (4 * quad < C) {
      int o = o_first + int(threadIdx.x >> 4);
      const int64_t src_step = int64_t(step) * C;
      float* dst = ws + o * ldw_whole + 4 * quad;
      const float* src = p.wa + int64_t(o) * C + 4 * quad;
#pragma unroll 4
      for (; o < H; o += step, src += src_step, dst += step * ldw_whole) cp_async_n<16>(dst, src, true);
      src = p.wb + int64_t(o - H) * C + 4 * quad;
#pragma unroll 4
      for (; o < H2; o += step, src += src_step, dst += step * ldw_whole) cp_async_n<16>(dst, src, true);
    }
    cp_async_commit();
  };
  if (!p.weights_late) {
    if constexpr (kWholeW) stage_whole_weights();
    else stage_first_weights();
  }
  // The epilogue's mask values and biases, loaded now so that their latency does too.
  float mask_v[RW], bias_v[Q];
#pragma unroll
  for (int r = 0; r < RW; ++r) {
    const int n = n_base + warp * RW + r;
    mask_v[r] = n < p.N ? mask_at(p.mask, b, s, n + p.n_offset) : 0.f;
  }
#pragma unroll
  for (int q = 0; q < Q; ++q) {
    const int o = lane + 32 * q;
    bias_v[q] = o < H ? (p.ba ? p.ba[o] : 0.f) : o < H2 && p.bb ? p.bb[o - H] : 0.f;
  }

  // LayerNorm statistics, two passes over the row.  x is float32, float16 or bfloat16
  // (p.x_kind), read as float32.  The first kPrepCachedChunks chunks' x values and LayerNorm
  // parameters stay in registers for the projection loop (the whole row for msa_dim <= 64): the
  // loop then issues no global loads of its own, which would each add a round trip to this
  // latency-bound kernel.  Later features are read again (from L1).  Same sums, same order.
  constexpr int kCached = kPrepCachedChunks;
  static_assert(kPrepKC == 32, "chunk ci's feature for a lane is ci·32 + lane, the statistics' ci-th");
  int64_t xrow[RW] = {};  // set below, before x_at is first called
  const auto x_at = [&](int r, int c) { return load_as_float<XT>(p.x, xrow[r] + c); };
  float x_c[RW][kCached], lnw_c[kCached], lnb_c[kCached];
#pragma unroll
  for (int j = 0; j < kCached; ++j) {
    const int c = j * kPrepKC + lane;
    lnw_c[j] = c < C ? p.ln_w[c] : 0.f;
    lnb_c[j] = c < C ? p.ln_b[c] : 0.f;
  }
  float mean[RW], rstd[RW];
#pragma unroll
  for (int r = 0; r < RW; ++r) {
    const int n = min(n_base + warp * RW + r, p.N - 1) + p.n_offset;
    xrow[r] = int64_t(b) * p.x_sb + int64_t(s) * p.x_ss + int64_t(n) * p.x_sn;
#pragma unroll
    for (int j = 0; j < kCached; ++j) {
      const int c = j * kPrepKC + lane;
      x_c[r][j] = c < C ? x_at(r, c) : 0.f;
    }
  }
  if (p.weights_late) {
    if constexpr (kWholeW) stage_whole_weights();
    else stage_first_weights();
  }
#pragma unroll
  for (int r = 0; r < RW; ++r) {
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < kCached; ++j)
      if (j * kPrepKC + lane < C) sum += x_c[r][j];
    for (int c = kCached * kPrepKC + lane; c < C; c += 32) sum += x_at(r, c);
    mean[r] = warp_sum(sum) / C;
    float sq = 0.f;
#pragma unroll
    for (int j = 0; j < kCached; ++j)
      if (j * kPrepKC + lane < C) {
        const float d = x_c[r][j] - mean[r];
        sq += d * d;
      }
    for (int c = kCached * kPrepKC + lane; c < C; c += 32) {
      const float d = x_at(r, c) - mean[r];
      sq += d * d;
    }
    rstd[r] = rsqrtf(warp_sum(sq) / C + p.ln_eps);
  }

  float acc[RW][Q];
#pragma unroll
  for (int r = 0; r < RW; ++r)
#pragma unroll
    for (int q = 0; q < Q; ++q) acc[r][q] = 0.f;

  if constexpr (kWholeW) {
    // The warp's normalised row, all C features (they are all in registers), then the products in
    // the chunked form's order: per chunk of kPrepKC features in order of k, chunk sums in order.
    float* const xrow_s = xs_whole + warp * C;
#pragma unroll
    for (int j = 0; j < kCached; ++j) {
      const int c = j * kPrepKC + lane;
      if (c < C) xrow_s[c] = (x_c[0][j] - mean[0]) * rstd[0] * lnw_c[j] + lnb_c[j];
    }
    cp_async_wait_all();
    __syncthreads();  // every thread's weight copies, and this warp's row
    whole_row_products<Q>(xrow_s, ws, ldw_whole, C, lane, acc[0]);
  }
  for (int ci = 0; ci < (kWholeW ? 0 : n_chunks); ++ci) {
    const int c0 = ci * kPrepKC;
    if (ci > 0) {
      __syncthreads();  // the rows and the other buffer's weights (chunk ci - 1) are consumed
      if (ci + 1 < n_chunks) stage_weights(ci + 1);
    }
#pragma unroll
    for (int r = 0; r < RW; ++r) {
      const int c = c0 + lane;
      float v = 0.f;
      if (c < C) {
        float xv = 0.f, w = 0.f, bias = 0.f;
        if (ci < kCached) {
#pragma unroll
          for (int j = 0; j < kCached; ++j)  // constant indices: the arrays stay in registers
            if (j == ci) xv = x_c[r][j], w = lnw_c[j], bias = lnb_c[j];
        } else {
          xv = x_at(r, c), w = p.ln_w[c], bias = p.ln_b[c];
        }
        v = (xv - mean[r]) * rstd[r] * w + bias;
      }
      xs[(warp * RW + r) * kPrepKC + lane] = v;
    }
    if (ci + 1 < n_chunks) cp_async_wait<1>();  // chunk ci (chunk ci + 1 may be in flight)
    else cp_async_wait_all();
    __syncthreads();
    const float* wbuf = ws + (ci & 1) * kWRows * kPrepLdW;
    // Two-level sum over C (per chunk, then across chunks), for accuracy at large msa_dim.
    float part[RW][Q];
#pragma unroll
    for (int r = 0; r < RW; ++r)
#pragma unroll
      for (int q = 0; q < Q; ++q) part[r][q] = 0.f;
    // Four k per step from float4 reads (rows of W at a stride of 4 (mod 8) floats: a quarter
    // warp's eight rows in distinct banks), the products added in order of k.
#pragma unroll 2
    for (int k = 0; k < kPrepKC; k += 4) {
      float4 xv[RW];
#pragma unroll
      for (int r = 0; r < RW; ++r) xv[r] = *reinterpret_cast<const float4*>(&xs[(warp * RW + r) * kPrepKC + k]);
#pragma unroll
      for (int q = 0; q < Q; ++q) {
        const float4 w = *reinterpret_cast<const float4*>(&wbuf[(lane + 32 * q) * kPrepLdW + k]);
#pragma unroll
        for (int r = 0; r < RW; ++r) {
          part[r][q] = fmaf(xv[r].x, w.x, part[r][q]);
          part[r][q] = fmaf(xv[r].y, w.y, part[r][q]);
          part[r][q] = fmaf(xv[r].z, w.z, part[r][q]);
          part[r][q] = fmaf(xv[r].w, w.w, part[r][q]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < RW; ++r)
#pragma unroll
      for (int q = 0; q < Q; ++q) acc[r][q] += part[r][q];
  }

  if constexpr (!kProjectW) {
    if (p.ab_kind == kAbF16Split) {
      // Each row of a and of b scaled by its own power of two and split into float16 parts
      // (kAbF16Split); the scale from the row's largest magnitude, over the whole warp.
#pragma unroll
      for (int r = 0; r < RW; ++r) {
        const int n = n_base + warp * RW + r;
        float v[Q];
        float max_a = 0.f, max_b = 0.f;
#pragma unroll
        for (int q = 0; q < Q; ++q) {
          const int o = lane + 32 * q;
          v[q] = (acc[r][q] + bias_v[q]) * mask_v[r];
          if (o < H) max_a = fmaxf(max_a, fabsf(v[q]));
          else if (o < H2) max_b = fmaxf(max_b, fabsf(v[q]));
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
          max_a = fmaxf(max_a, __shfl_xor_sync(0xffffffffu, max_a, off));
          max_b = fmaxf(max_b, __shfl_xor_sync(0xffffffffu, max_b, off));
        }
        if (n >= p.N) continue;
        const int e_a = split_scale_exp_bits(max_a), e_b = split_scale_exp_bits(max_b);
        const float f_a = exp2_int(e_a), f_b = exp2_int(e_b);
        const int64_t row = int64_t(n) * p.S + s;
        __half* const a_row = static_cast<__half*>(p.a_out) + b * p.a_sb + row * p.a_ss;
        // b's rows along k = (s, h) (s_chunk 0, h stride 1), or along (s / s_chunk, h, s % s_chunk)
        // (the chained form: h stride s_chunk, s past S zero to the end of its chunk)
        __half* const b_base = static_cast<__half*>(p.b_out);
        __half* const b_row = b_base + ab_row_offset(p.b_sb, p.b_sc, p.b_ss, p.b_sn, p.s_chunk, b, s, n);
        const bool store_a = n < p.a_rows;
#pragma unroll
        for (int q = 0; q < Q; ++q) {
          const int o = lane + 32 * q;
          if (o < H) {
            if (store_a) store_split_f16(a_row + o, p.a_lo_off, v[q] * f_a);
          } else if (o < H2) {
            store_split_f16(b_row + (o - H) * p.b_hs, p.b_lo_off, v[q] * f_b);
            if (p.s_chunk > 0 && s == p.S - 1) {
              for (int sp = p.S; sp % p.s_chunk != 0; ++sp) {
                __half* const pad = b_base + ab_row_offset(p.b_sb, p.b_sc, p.b_ss, p.b_sn, p.s_chunk, b, sp, n);
                store_split_f16(pad + (o - H) * p.b_hs, p.b_lo_off, 0.f);
              }
            }
          }
        }
        if (lane == 0) {
          if (store_a) p.a_exp[b * p.a_exp_sb + int64_t(n) * p.a_exp_sn + s] = e_a;
          p.b_exp[b * p.b_exp_sb + row] = e_b;
        }
      }
      return;
    }
  }

  // Bias, mask, store.  In project-first mode b stays in shared memory (zero rows past N).
  const int Hp = round_up4(H);
  float* bs = smem + (prep_smem_floats(H, RW, kProjectW) - int64_t(R) * Hp);  // [R][Hp]
#pragma unroll
  for (int r = 0; r < RW; ++r) {
    const int row = warp * RW + r;
    const int n = n_base + row;
    const bool valid = n < p.N;
    const float mv = mask_v[r];
#pragma unroll
    for (int q = 0; q < Q; ++q) {
      const int o = lane + 32 * q;
      if (o < H) {
        if (valid && ochunk == 0 && unsigned(n - p.a_first) < unsigned(p.a_rows)) {
          const float v = (acc[r][q] + bias_v[q]) * mv;
          store_ab(p.a_out, ab_row_offset(p.a_sb, p.a_sc, p.a_ss, p.a_sn, p.s_chunk, b, s, n - p.a_first), o, v,
                   p.ab_kind, p.a_hs);
        }
      } else if (o < H2) {
        const int h = o - H;
        const float v = valid ? (acc[r][q] + bias_v[q]) * mv : 0.f;
        if (kProjectW) {
          bs[row * Hp + h] = v;
        } else if (valid && p.b_out) {
          store_ab(p.b_out, ab_row_offset(p.b_sb, p.b_sc, p.b_ss, p.b_sn, p.s_chunk, b, s, n), h, v, p.ab_kind,
                   p.b_hs);
        }
      } else if (kProjectW && o < H + Hp) {
        bs[row * Hp + (o - H)] = 0.f;  // padding read by the float4 loop below
      }
    }
  }

  if constexpr (kProjectW) {
    // c[b, s, h1, n, d] = sum_h2 W[d, h1*H + h2] * b[n, h2], for the columns o = h1*D + d of
    // this block's chunk.  One thread per column; W^T staged in shared memory.
    float* wsm = smem;  // [Hp][kPrepWStride], aliases ws/xs (no longer needed)
    const int HD = H * p.D;
    const int o = ochunk * kPrepThreads + threadIdx.x;
    __syncthreads();
    for (int idx = threadIdx.x; idx < kPrepThreads * Hp; idx += kPrepThreads) {
      const int ol = idx / Hp, h2 = idx - ol * Hp;
      const int oo = ochunk * kPrepThreads + ol;
      const bool ok = oo < HD && h2 < H;
      const int h1 = ok ? oo / p.D : 0, d = ok ? oo - h1 * p.D : 0;
      cp_async4(&wsm[h2 * kPrepWStride + ol], p.w_out + (ok ? int64_t(d) * H * H + h1 * H + h2 : 0), ok);
    }
    cp_async_commit();
    cp_async_wait_all();
    __syncthreads();
    float cacc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) cacc[r] = 0.f;
    for (int h2 = 0; h2 < Hp; h2 += 4) {
      float w[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) w[u] = wsm[(h2 + u) * kPrepWStride + threadIdx.x];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float4 bv = *reinterpret_cast<const float4*>(&bs[r * Hp + h2]);
        cacc[r] = fmaf(bv.x, w[0], cacc[r]);
        cacc[r] = fmaf(bv.y, w[1], cacc[r]);
        cacc[r] = fmaf(bv.z, w[2], cacc[r]);
        cacc[r] = fmaf(bv.w, w[3], cacc[r]);
      }
    }
    if (o < HD) {
      const int h1 = o / p.D, d = o - h1 * p.D;
      float* dst = p.c_out + ((int64_t(b) * p.S + s) * H + h1) * int64_t(p.N) * p.D + d;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int n = n_base + r;
        if (n < p.N) dst[int64_t(n) * p.D] = cacc[r];
      }
    }
  }
}

// Where row `row` of the row-tiled projections (project_rows_count's order) lives: x's offset (-1:
// past the last row, or s past S in the last chunk of s), a's and b's row offsets (-1: not
// written), and the mask's (b, s, n).
struct ProjectRow {
  int64_t x, a, b;
  int mb, ms, mn;
};
__device__ __forceinline__ ProjectRow project_row(const PrepArgs& p, int64_t rows, int64_t row) {
  ProjectRow r{-1, -1, -1, 0, 0, 0};
  int b = 0, s = p.S, n = 0;
  if (row < rows && p.s_chunk > 1) {
    const int sc = p.s_chunk, chunks = (p.S + sc - 1) / sc;
    const int64_t per_chunk = int64_t(p.N) * sc;
    const int64_t bc = row / per_chunk;  // b·chunks + chunk
    const int64_t rem = row - bc * per_chunk;
    b = int(bc / chunks);
    n = int(rem / sc);
    s = int(bc - int64_t(b) * chunks) * sc + int(rem - int64_t(n) * sc);  // S or more: past the end
  } else if (row < rows) {
    const int64_t bs = row / p.N;
    n = int(row - bs * p.N), s = int(bs % p.S), b = int(bs / p.S);
  }
  if (s < p.S) {
    r.x = int64_t(b) * p.x_sb + int64_t(s) * p.x_ss + int64_t(n + p.n_offset) * p.x_sn;
    r.mb = b, r.ms = s, r.mn = n + p.n_offset;
    if (unsigned(n - p.a_first) < unsigned(p.a_rows))
      r.a = ab_row_offset(p.a_sb, p.a_sc, p.a_ss, p.a_sn, p.s_chunk, b, s, n - p.a_first);
    if (p.b_out) r.b = ab_row_offset(p.b_sb, p.b_sc, p.b_ss, p.b_sn, p.s_chunk, b, s, n);
  }
  return r;
}

// Whether the tensor-core forms' epilogue may store a lane's two outputs of a row as one store: H
// even, 16-bit or float32 a and b, aligned for it.
__device__ __forceinline__ bool project_pair_stores(const PrepArgs& p) {
  return p.H % 2 == 0 && p.ab_kind < kAbTf32 &&
         reinterpret_cast<uintptr_t>(p.a_out) % (p.ab_kind == kMaskFloat ? 8 : 4) == 0 &&
         (p.b_out == nullptr || reinterpret_cast<uintptr_t>(p.b_out) % (p.ab_kind == kMaskFloat ? 8 : 4) == 0) &&
         ((p.a_sb | p.a_ss | p.a_sn | p.b_sb | p.b_ss | p.b_sn) & 1) == 0;
}

// Outputs o and o + 1 of one row (sums acc0, acc1): bias added, times the row's mask value mv,
// stored to a (o < H) at row offset ao or to b (H <= o < 2H) at bo, skipping offsets of -1.
__device__ __forceinline__ void project_store_two(const PrepArgs& p, bool pair_out, int o, float acc0, float acc1,
                                                  float mv, int64_t ao, int64_t bo) {
  const int H = p.H, H2 = 2 * H;
  const float acc[2] = {acc0, acc1};
  float v[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int oe = o + e;
    const float bias = oe < H ? (p.ba ? p.ba[oe] : 0.f) : oe < H2 && p.bb ? p.bb[oe - H] : 0.f;
    v[e] = (acc[e] + bias) * mv;
  }
  if (pair_out && o + 1 < H) {
    if (ao >= 0) store_out2(p.a_out, ao + o, v[0], v[1], p.ab_kind);
  } else if (pair_out && o >= H && o + 1 < H2) {
    if (bo >= 0) store_out2(p.b_out, bo + (o - H), v[0], v[1], p.ab_kind);
  } else {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int oe = o + e;
      if (oe < H) {
        if (ao >= 0) store_ab(p.a_out, ao, oe, v[e], p.ab_kind, p.a_hs);
      } else if (oe < H2) {
        if (bo >= 0) store_ab(p.b_out, bo, oe - H, v[e], p.ab_kind, p.b_hs);
      }
    }
  }
}

// One block: kProjRows consecutive rows r = (b, s, n) of all B·S·N (n < p.N), all 2H outputs.
// The layouts of opm_prep_kernel without kProjectW (a_out / b_out by strides, ab_kind), so the two
// kernels are interchangeable; this one runs the projections as a register-tiled GEMM (8 rows x
// CT outputs per thread: 3 shared-memory vector loads per 32 FMAs at CT = 4) for problems with
// enough rows to fill the GPU.  kVec: x read as 16-byte vectors (rows and msa_dim aligned to
// them), the normalised rows then stored with an XOR swizzle of 4-row pieces so that the
// transposing stores stay free of bank conflicts.  The tensor-core form (kMmaTerms = 1: TF32
// products) runs three blocks per SM (80 registers, a few spills): it is bound by the latency of its
// global loads, and at two blocks (124 registers) it took 19% longer at N = 1536 in bfloat16.  With
// kMmaTerms = 3 (float32 x under "highest") each k-step is three TF32 products of split operands
// into a zeroed fragment, added to the sums in float32 (warp_mma_tf32_presplit), at two blocks per
// SM.  The tensor-core forms split x and W (split_tf32) once, as they store them in shared memory,
// not per fragment in every warp: the same fragments, so the same bits.
// kRows (the tensor-core form only): rows per block, 128, 64 or 32.  The warps then split the
// columns too (kRows / 16 groups of rows x 128 / kRows groups of columns), so that a launch of a
// few thousand rows still spreads over the SMs; every output's sum runs through the same k-steps
// in the same order whatever kRows is, so the bits do not depend on it.
template <int CT, typename XT, bool kVec, int kMmaTerms, int kRows = kProjRows>  // XT: x's element type (p.x_kind); kMmaTerms: 0 FMA form
__global__ void __launch_bounds__(kProjThreads, project_rows_min_blocks(CT, kMmaTerms, kRows))
    opm_project_rows_kernel(const PrepArgs p) {
  constexpr bool kMma = kMmaTerms > 0;
  static_assert(kMmaTerms == 0 || kMmaTerms == 1 || kMmaTerms == 3, "no tensor cores, one TF32 term or three");
  static_assert(kRows == kProjRows || (kMma && kVec && (kRows == 64 || kRows == 32)),
                "blocks of fewer rows in the tensor-core form only");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::);  // as opm_prep_kernel
#endif
  extern __shared__ float4 smem_f4[];
  float* smem = reinterpret_cast<float*>(smem_f4);
  constexpr int TR = kRows, RT = kProjRT, KC = kProjKC, LDX = kProjLdX;
  constexpr int NC = 16 * CT, LDW = 16 * CT + 8, LDK = kProjLdK;
  // xs: normalised x, [KC][LDX] (k-major); ws: weights, double-buffered, [2][KC][LDW] (k-major).
  // kMma: both split for the MMAs as they are stored (each element once, where splitting every
  // fragment as it is read split W's chunk again in every warp): xs [TR][LDK] high parts, then as
  // many low parts for three terms; ws one buffer, [NC][LDK] high parts, then the low parts.
  constexpr int kParts = kMmaTerms == 3 ? 2 : 1;
  constexpr int kSplitTerms = kMma ? kMmaTerms : 1;  // split_tf32's terms (the FMA form splits nothing)
  constexpr int kXsFloats = kMma ? kParts * TR * LDK : KC * LDX, kWsFloats = kMma ? kParts * NC * LDK : 2 * KC * LDW;
  float* xs = smem;
  float* ws = xs + kXsFloats;
  float* mean_s = ws + kWsFloats;             // [TR]
  float* rstd_s = mean_s + TR;
  float* mask_s = rstd_s + TR;
  int64_t* xoff_s = reinterpret_cast<int64_t*>(mask_s + TR);  // [TR]; -1: past the last row
  int64_t* aoff_s = xoff_s + TR;              // -1: a not written for this row
  int64_t* boff_s = aoff_s + TR;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int H = p.H, H2 = 2 * H, C = p.C;
  const int64_t rows = project_rows_count(p);
  const int64_t row0 = int64_t(blockIdx.x) * TR;

  if (tid < TR) {
    const ProjectRow pr = project_row(p, rows, row0 + tid);
    xoff_s[tid] = pr.x;
    aoff_s[tid] = pr.a;
    boff_s[tid] = pr.b;
    mask_s[tid] = pr.x >= 0 ? mask_at(p.mask, pr.mb, pr.ms, pr.mn) : 0.f;
  }
  __syncthreads();

  // Staging maps, chosen for conflict-free shared stores and full 32-byte sectors in global loads.
  // Scalar: a warp takes 4 rows x 8 consecutive k per load; thread: 4 row slots x 4 groups of 8 k.
  // Vector: a lane takes V consecutive k of one row; a warp 32 / (KC / V) rows per load.
  constexpr int V = 16 / int(sizeof(XT));
  constexpr int VKG = KC / V;                                  // vectors per row and chunk
  constexpr int XRows = kVec ? TR * VKG / kProjThreads : TR / 32;  // row slots per thread
  static_assert(XRows >= 1, "every thread stages a row's vector");
  constexpr int XKG = kVec ? 1 : KC / 8;                       // scalar k groups per thread
  const auto slot_row = [&](int q) {
    return kVec ? (q * 8 + warp) * (32 / VKG) + lane / VKG : (q * 8 + warp) * 4 + (lane >> 3);
  };
  // xs: k-major; with kVec the 4-row pieces of row k are XOR-swizzled by k / 4.
  const auto xs_at = [](int k, int r) {
    if constexpr (kMma) return r * LDK + k;
    return kVec ? k * TR + ((((r >> 2) ^ ((k >> 2) & 7)) << 2) | (r & 3)) : k * LDX + r;
  };
  int64_t x_row[XRows];
  float x_mean[XRows], x_rstd[XRows];
  const int xk = kVec ? (lane % VKG) * V : lane & 7;
#pragma unroll
  for (int q = 0; q < XRows; ++q) x_row[q] = xoff_s[slot_row(q)];
  float xv[XRows][kVec ? 1 : XKG];
  uint4 xraw[kVec ? XRows : 1];
  const auto load_x = [&](int c0) {
#pragma unroll
    for (int q = 0; q < XRows; ++q) {
      if constexpr (kVec) {
        const int c = c0 + xk;  // C is a multiple of V: a vector is all in or all out
        xraw[q] = x_row[q] >= 0 && c < C
                      ? *reinterpret_cast<const uint4*>(static_cast<const XT*>(p.x) + x_row[q] + c)
                      : make_uint4(0u, 0u, 0u, 0u);
      } else {
#pragma unroll
        for (int g = 0; g < XKG; ++g) {
          const int c = c0 + g * 8 + xk;
          xv[q][g] = x_row[q] >= 0 && c < C ? load_as_float<XT>(p.x, x_row[q] + c) : 0.f;
        }
      }
    }
  };
  const auto store_x = [&](int c0) {
    if constexpr (kVec) {
      // LayerNorm's parameters for this lane's features, loaded once for all its rows and without
      // a branch, so that they are in flight together (C is a multiple of V: a vector is all in or
      // all out).
      const bool c_in = c0 + xk < C;
      float lw[V], lb[V];
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const int c = c_in ? c0 + xk + j : 0;
        lw[j] = p.ln_w[c];
        lb[j] = p.ln_b[c];
      }
#pragma unroll
      for (int q = 0; q < XRows; ++q) {
        float v[V];
        unpack16<XT>(xraw[q], v);
        const int r = slot_row(q);
        float y[V];
#pragma unroll
        for (int j = 0; j < V; ++j)
          y[j] = x_row[q] >= 0 && c_in ? fmaf((v[j] - x_mean[q]) * x_rstd[q], lw[j], lb[j]) : 0.f;
        if constexpr (kMma) {
          // the lane's V features of row r are consecutive in xs (16-byte aligned: LDK and xk are
          // multiples of 4): 16-byte stores, a quarter warp's covering one row's 128 bytes, where
          // single floats from four rows at once met 4-way bank conflicts
#pragma unroll
          for (int j = 0; j < V; j += 4) {
            float4 hi, lo;
            split_tf32_f<kSplitTerms>(y[j], hi.x, lo.x);
            split_tf32_f<kSplitTerms>(y[j + 1], hi.y, lo.y);
            split_tf32_f<kSplitTerms>(y[j + 2], hi.z, lo.z);
            split_tf32_f<kSplitTerms>(y[j + 3], hi.w, lo.w);
            *reinterpret_cast<float4*>(&xs[xs_at(xk + j, r)]) = hi;
            if constexpr (kMmaTerms == 3) *reinterpret_cast<float4*>(&xs[TR * LDK + xs_at(xk + j, r)]) = lo;
          }
        } else {
#pragma unroll
          for (int j = 0; j < V; ++j) xs[xs_at(xk + j, r)] = y[j];
        }
      }
    } else {
#pragma unroll
      for (int g = 0; g < XKG; ++g) {
        const int k = g * 8 + xk, c = c0 + k;
        const float w = c < C ? p.ln_w[c] : 0.f, b = c < C ? p.ln_b[c] : 0.f;
#pragma unroll
        for (int q = 0; q < XRows; ++q) {
          const float y = x_row[q] >= 0 ? fmaf((xv[q][g] - x_mean[q]) * x_rstd[q], w, b) : 0.f;
          xs[xs_at(k, slot_row(q))] = y;
        }
      }
    }
  };
  // W: a warp takes 4 k x 8 consecutive outputs per copy.  With 2H <= 32 a thread keeps one
  // output and takes 8 / (NC / 8) groups of 4 k; else NC / 64 outputs and all 8 groups.
  constexpr int WOuts = NC >= 64 ? NC / 64 : 1;
  constexpr int WKG = NC >= 64 ? KC / 4 : NC / 8;
  const float* w_src[WOuts];
  bool w_ok[WOuts];
  int w_o[WOuts];
  const int wk0 = NC >= 64 ? (lane >> 3) : (warp / (NC / 8)) * 4 + (lane >> 3);
#pragma unroll
  for (int oi = 0; oi < WOuts; ++oi) {
    const int o = NC >= 64 ? (oi * 8 + warp) * 8 + (lane & 7) : (warp % (NC / 8)) * 8 + (lane & 7);
    w_o[oi] = o;
    w_ok[oi] = o < H2;
    w_src[oi] = o < H ? p.wa + int64_t(o) * C : o < H2 ? p.wb + int64_t(o - H) * C : p.wa;
  }
  const auto w_k = [&](int g) { return wk0 + g * (NC >= 64 ? 4 : 4 * (64 / NC)); };
  const auto load_w = [&](int c0, float* dst) {  // k-major form: copies into a buffer
#pragma unroll
    for (int oi = 0; oi < WOuts; ++oi)
#pragma unroll
      for (int g = 0; g < WKG; ++g) {
        const int k = w_k(g), c = c0 + k;
        const bool ok = w_ok[oi] && c < C;
        cp_async4(&dst[k * LDW + w_o[oi]], ok ? w_src[oi] + c : p.wa, ok);
      }
    cp_async_commit();
  };
  // kMma: the chunk's weights through registers (loaded during the previous chunk's products),
  // split as they are stored
  float wv[kMma ? WOuts : 1][kMma ? WKG : 1];
  const auto load_w_regs = [&](int c0) {
    if constexpr (kMma) {
#pragma unroll
      for (int oi = 0; oi < WOuts; ++oi)
#pragma unroll
        for (int g = 0; g < WKG; ++g) {
          const int c = c0 + w_k(g);
          wv[oi][g] = w_ok[oi] && c < C ? w_src[oi][c] : 0.f;
        }
    }
  };
  const auto store_w = [&]() {
    if constexpr (kMma) {
#pragma unroll
      for (int oi = 0; oi < WOuts; ++oi)
#pragma unroll
        for (int g = 0; g < WKG; ++g) {
          float hi, lo;
          split_tf32_f<kSplitTerms>(wv[oi][g], hi, lo);
          ws[w_o[oi] * LDK + w_k(g)] = hi;
          if constexpr (kMmaTerms == 3) ws[NC * LDK + w_o[oi] * LDK + w_k(g)] = lo;
        }
    }
  };

  float acc[RT][CT];
#pragma unroll
  for (int i = 0; i < RT; ++i)
#pragma unroll
    for (int j = 0; j < CT; ++j) acc[i][j] = 0.f;
  const int rg = tid >> 4, cg = tid & 15;
  // kMma: warp (row group wr, column group wc) holds rows 16·wr + g (+8) and columns
  // 8·(wc·kNT + nt) + 2t (+1) of its m16n8 tile nt
  constexpr int kRowGroups = TR / 16, kColGroups = kProjThreads / 32 / kRowGroups;
  static_assert(!kMma || (NC / 8) % kColGroups == 0, "the column groups split the n tiles evenly");
  constexpr int kNT = NC / 8 / (kMma ? kColGroups : 1);
  const int wr = warp % kRowGroups, wc = warp / kRowGroups;
  float acc_t[1][kNT][4];
  const int g = lane >> 2, tq = lane & 3;
  const int chunks = (C + KC - 1) / KC;
  if constexpr (!kMma) load_w(0, ws);
  load_x(0);
  // LayerNorm statistics while the first chunk's loads are in flight: two passes (the second hits
  // L1), each warp four rows at a time so that many loads are in flight per lane.  The loads are
  // unconditional so that they can be: a row past the last (offset -1) reads row 0's features
  // instead, and its statistics are never used (store_x writes zeros for it).  Under a branch per
  // row, each load waited for the previous row's sums.
  for (int r0 = warp * 4; r0 < TR; r0 += kProjThreads / 32 * 4) {
    float sum[4] = {0.f, 0.f, 0.f, 0.f}, sq[4] = {0.f, 0.f, 0.f, 0.f}, mu[4];
    int64_t xo[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int64_t o = xoff_s[r0 + u];
      xo[u] = o >= 0 ? o : 0;
    }
    if constexpr (kVec) {
      const XT* x = static_cast<const XT*>(p.x);
#pragma unroll 2
      for (int cv = lane; cv < C / V; cv += 32) {
        uint4 raw[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) raw[u] = *reinterpret_cast<const uint4*>(x + xo[u] + cv * V);
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          float v[V];
          unpack16<XT>(raw[u], v);
#pragma unroll
          for (int j = 0; j < V; ++j) sum[u] += v[j];
        }
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) mu[u] = warp_sum(sum[u]) / C;
#pragma unroll 2
      for (int cv = lane; cv < C / V; cv += 32) {
        uint4 raw[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) raw[u] = *reinterpret_cast<const uint4*>(x + xo[u] + cv * V);
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          float v[V];
          unpack16<XT>(raw[u], v);
#pragma unroll
          for (int j = 0; j < V; ++j) sq[u] = fmaf(v[j] - mu[u], v[j] - mu[u], sq[u]);
        }
      }
    } else {
#pragma unroll 8
      for (int c = lane; c < C; c += 32)
#pragma unroll
        for (int u = 0; u < 4; ++u) sum[u] += load_as_float<XT>(p.x, xo[u] + c);
#pragma unroll
      for (int u = 0; u < 4; ++u) mu[u] = warp_sum(sum[u]) / C;
#pragma unroll 4
      for (int c = lane; c < C; c += 32)
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const float d = load_as_float<XT>(p.x, xo[u] + c) - mu[u];
          sq[u] = fmaf(d, d, sq[u]);
        }
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const float var = warp_sum(sq[u]) / C;
      if (lane == 0) {
        mean_s[r0 + u] = mu[u];
        rstd_s[r0 + u] = rsqrtf(var + p.ln_eps);
      }
    }
  }
  // (kMma: W's first chunk now, not before the statistics, and the next one after each chunk's
  // products, so that it holds no registers through either: W is a few KB that every block reads,
  // an L1 or L2 hit)
  load_w_regs(0);
  __syncthreads();  // mean_s, rstd_s
  zero_tiles(acc_t);  // here, not before the statistics: fewer registers live through them
#pragma unroll
  for (int q = 0; q < XRows; ++q) {
    x_mean[q] = mean_s[slot_row(q)];
    x_rstd[q] = rstd_s[slot_row(q)];
  }
  for (int t = 0; t < chunks; ++t) {
    store_x(t * KC);
    if constexpr (kMma) {
      store_w();
      if (t + 1 < chunks) load_x((t + 1) * KC);  // in flight during this chunk's products
    } else if (t + 1 < chunks) {
      load_w((t + 1) * KC, ws + ((t + 1) & 1) * (KC * LDW));
      load_x((t + 1) * KC);  // in flight during this chunk's products
      cp_async_wait<1>();
    } else {
      cp_async_wait_all();
    }
    __syncthreads();
    const float* wcur = ws + (kMma ? 0 : (t & 1) * (KC * LDW));
    if constexpr (kMma) {
      // one k-step at a time: all of a step's fragments are live at once (registers)
      const float* x_hi = xs + wr * 16 * LDK;
      const float* w_hi = wcur + wc * kNT * 8 * LDK;
#pragma unroll 1
      for (int ks = 0; ks < KC / 8; ++ks)
        warp_mma_tf32_presplit<kSplitTerms, kNT>(acc_t, x_hi + ks * 8, x_hi + TR * LDK + ks * 8, LDK, w_hi + ks * 8,
                                                 w_hi + NC * LDK + ks * 8, LDK, g, tq);
      if (t + 1 < chunks) load_w_regs((t + 1) * KC);
    } else {
#pragma unroll 4
      for (int k = 0; k < KC; ++k) {
        float xr[RT], wr[CT];
        const float4 x0 = *reinterpret_cast<const float4*>(&xs[xs_at(k, rg * RT)]);
        const float4 x1 = *reinterpret_cast<const float4*>(&xs[xs_at(k, rg * RT + 4)]);
        xr[0] = x0.x, xr[1] = x0.y, xr[2] = x0.z, xr[3] = x0.w, xr[4] = x1.x, xr[5] = x1.y, xr[6] = x1.z, xr[7] = x1.w;
        if constexpr (CT >= 4) {
#pragma unroll
          for (int j = 0; j < CT; j += 4) {
            const float4 w4 = *reinterpret_cast<const float4*>(&wcur[k * LDW + cg * CT + j]);
            wr[j] = w4.x, wr[j + 1] = w4.y, wr[j + 2] = w4.z, wr[j + 3] = w4.w;
          }
        } else if constexpr (CT == 2) {
          const float2 w2 = *reinterpret_cast<const float2*>(&wcur[k * LDW + cg * 2]);
          wr[0] = w2.x, wr[1] = w2.y;
        } else {
          wr[0] = wcur[k * LDW + cg];
        }
#pragma unroll
        for (int i = 0; i < RT; ++i)
#pragma unroll
          for (int j = 0; j < CT; ++j) acc[i][j] = fmaf(xr[i], wr[j], acc[i][j]);
      }
    }
    __syncthreads();  // xs and this buffer of ws are free
  }

  if constexpr (kMma) {
    // Bias, mask, store (a for outputs o < H, b for H <= o < 2H); each thread's two outputs of a
    // row as one store where they are on one side and the layouts keep them aligned.
    const bool pair_out = project_pair_stores(p);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = wr * 16 + g + 8 * half;
      const float mv = mask_s[r];
      const int64_t ao = aoff_s[r], bo = boff_s[r];
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
        project_store_two(p, pair_out, (wc * kNT + nt) * 8 + 2 * tq, acc_t[0][nt][2 * half], acc_t[0][nt][2 * half + 1],
                          mv, ao, bo);
    }
    return;
  }

  // Bias, mask, store (a for outputs o < H, b for H <= o < 2H): four consecutive outputs as one
  // vector where H and the layouts keep them aligned and on one side.
  const int align = p.ab_kind == kMaskFloat ? 16 : 8;
  const bool vec_out = CT >= 4 && H % 4 == 0 && p.ab_kind < kAbTf32 && reinterpret_cast<uintptr_t>(p.a_out) % align == 0 &&
                       (p.b_out == nullptr || reinterpret_cast<uintptr_t>(p.b_out) % align == 0) &&
                       ((p.a_sb | p.a_ss | p.a_sn | p.b_sb | p.b_ss | p.b_sn) & 3) == 0;
  // This thread's biases, loaded once before its rows' stores: read between the stores, they were
  // loaded again for every row (the compiler cannot know that the stores leave them unchanged).
  float bias[CT];
#pragma unroll
  for (int j = 0; j < CT; ++j) {
    const int o = cg * CT + j;
    bias[j] = o < H ? (p.ba ? p.ba[o] : 0.f) : o < H2 && p.bb ? p.bb[o - H] : 0.f;
  }
#pragma unroll
  for (int i = 0; i < RT; ++i) {
    const int r = rg * RT + i;
    const float mv = mask_s[r];
    const int64_t ao = aoff_s[r], bo = boff_s[r];
    if (CT >= 4 && vec_out) {
#pragma unroll
      for (int j = 0; j < CT; j += 4) {
        const int o = cg * CT + j;
        float v[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) v[e] = (acc[i][j + e] + bias[j + e]) * mv;
        if (o < H) {
          if (ao >= 0) store_out4(p.a_out, ao + o, v, p.ab_kind);
        } else if (o < H2) {
          if (bo >= 0) store_out4(p.b_out, bo + (o - H), v, p.ab_kind);
        }
      }
      continue;
    }
#pragma unroll
    for (int j = 0; j < CT; ++j) {
      const int o = cg * CT + j;
      if (o < H) {
        if (ao >= 0) store_ab(p.a_out, ao, o, (acc[i][j] + bias[j]) * mv, p.ab_kind, p.a_hs);
      } else if (o < H2) {
        if (bo >= 0) store_ab(p.b_out, bo, o - H, (acc[i][j] + bias[j]) * mv, p.ab_kind, p.b_hs);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The streamed projection (PrepArgs::stream_blocks > 0; layout in opm_params.h): the products of
// opm_project_rows_kernel's tensor-core form for 16-bit x (one TF32 term, k in steps of 8 in
// order, the same LayerNorm arithmetic), so the same bits, in a form bound by memory rather than
// by the latency of each block's loads.  A persistent block per SM stages W once; each tile of
// kPsRows rows is copied whole into a ring of kStages buffers, kStages - 1 tiles ahead of the one
// being multiplied; LayerNorm is applied as the A fragments are read, so that the tile is never
// written back normalised.  Warps: 4 row groups (16 rows) x 2 column groups (32 outputs, four
// m16n8k8 tiles, W's fragments by ldmatrix).  Two barriers per tile.
// ---------------------------------------------------------------------------------------------
template <typename XT, int kStages>
__global__ void __launch_bounds__(kPsThreads, 1) opm_project_stream_kernel(const PrepArgs p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::);  // as opm_prep_kernel
#endif
  static_assert(sizeof(XT) == 2 && kStages >= 2 && kStages <= kPsMaxStages, "16-bit x, 2 to kPsMaxStages stages");
  constexpr int R = kPsRows, V = 8;  // V: elements of a 16-byte piece
  extern __shared__ float4 smem_f4[];
  char* smem = reinterpret_cast<char*>(smem_f4);
  const int C = p.C, H = p.H, H2 = 2 * H;
  const int ldx = project_stream_ldx(C);  // bytes per staged row
  const int ldw = C + 4;       // floats per row of W
  char* tiles = smem;                                                          // [kStages][R][ldx]
  float* ws = reinterpret_cast<float*>(tiles + int64_t(kStages) * R * ldx);  // [kPsCols][ldw]
  float2* lnp = reinterpret_cast<float2*>(ws + kPsCols * ldw);                 // [C] (w, b)
  float2* stats = lnp + C;                                                     // [R] (mean, rstd)
  int64_t* offs = reinterpret_cast<int64_t*>(stats + R);                       // [kStages][x, a, b][R]
  float* mvs = reinterpret_cast<float*>(offs + kStages * 3 * R);               // [kStages][R]

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int64_t rows = project_rows_count(p);
  const int64_t n_tiles = (rows + R - 1) / R, G = gridDim.x;
  const int64_t n_it = n_tiles > blockIdx.x ? (n_tiles - blockIdx.x + G - 1) / G : 0;  // this block's tiles

  for (int o = warp; o < kPsCols; o += kPsThreads / 32) {
    const float* src = o < H ? p.wa + int64_t(o) * C : p.wb + int64_t(o - H) * C;
    for (int k = lane; k < C; k += 32) ws[o * ldw + k] = o < H2 ? __uint_as_float(to_tf32(src[k])) : 0.f;
  }
  for (int c = tid; c < C; c += kPsThreads) lnp[c] = make_float2(p.ln_w[c], p.ln_b[c]);

  // Threads tid < R: where row tid of iteration it's tile lives (its stage's offsets), and its mask
  // value into mv, which the caller stores later: the load stays in flight meanwhile.
  const auto place_row = [&](int64_t it, float& mv) {
    const int st = int(it % kStages);
    const ProjectRow pr = project_row(p, rows, (blockIdx.x + it * G) * R + tid);
    offs[(st * 3) * R + tid] = pr.x;
    offs[(st * 3 + 1) * R + tid] = pr.a;
    offs[(st * 3 + 2) * R + tid] = pr.b;
    mv = pr.x >= 0 ? mask_at(p.mask, pr.mb, pr.ms, pr.mn) : 0.f;
  };
  // Iteration it's tile into its stage (rows without x zero-filled); always one commit group.
  const int cpr = C / V;
  const auto issue_tile = [&](int64_t it) {
    if (it < n_it) {
      const int st = int(it % kStages);
      const int64_t* xo = offs + (st * 3) * R;
      char* dst = tiles + st * R * ldx;
      for (int idx = tid; idx < R * cpr; idx += kPsThreads) {
        const int r = idx / cpr, v = idx - r * cpr;
        const int64_t o = xo[r];
        cp_async16z(dst + r * ldx + v * 16, o >= 0 ? static_cast<const XT*>(p.x) + o + v * V : p.x, o >= 0);
      }
    }
    cp_async_commit();
  };

  float mv_next = 0.f;
  if (tid < R) {
    for (int64_t it = 0; it < kStages - 1 && it < n_it; ++it) {
      place_row(it, mv_next);
      mvs[int(it % kStages) * R + tid] = mv_next;
    }
  }
  __syncthreads();  // W, LayerNorm's parameters, the first tiles' places
  for (int it = 0; it < kStages - 1; ++it) issue_tile(it);

  const int wr = warp & 3, wc = warp >> 2;
  const int ra = wr * 16 + g, rb = ra + 8;  // this lane's rows of the A fragments
  // ldmatrix: lane l addresses row l % 8 of matrix l / 8 = (n tile 2np + l / 16, k half (l / 8) % 2)
  const float* w_lane = ws + (wc * 32 + (lane >> 4) * 8 + (lane & 7)) * ldw + ((lane >> 3) & 1) * 4;
  const bool pair_out = project_pair_stores(p);
  for (int64_t it = 0; it < n_it; ++it) {
    const int st = int(it % kStages);
    cp_async_wait<kStages - 2>();
    __syncthreads();  // tile it landed; every warp is done with iteration it - 1 (its stage, stats)
    if (tid < R) {
      // the mask value loaded one iteration ago (for iteration it + kStages - 2), then the next
      // places into the stage iteration it - 1 left
      if (it >= 1 && it + kStages - 2 < n_it) mvs[int((it + kStages - 2) % kStages) * R + tid] = mv_next;
      if (it + kStages - 1 < n_it) place_row(it + kStages - 1, mv_next);
    }
    const char* tile = tiles + st * R * ldx;
    // LayerNorm statistics as the row-tiled kernel forms them (lane order, two passes)
    for (int r0 = warp * (R / 8); r0 < (warp + 1) * (R / 8); r0 += 4) {
      float sum[4] = {0.f, 0.f, 0.f, 0.f}, sq[4] = {0.f, 0.f, 0.f, 0.f}, mu[4];
      // f(u, value) over this lane's values of rows r0 + u, in the row-tiled kernel's order
      const auto each_value = [&](auto&& f) {
        for (int cv = lane; cv < cpr; cv += 32) {
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            float v[V];
            unpack16<XT>(*reinterpret_cast<const uint4*>(tile + (r0 + u) * ldx + cv * 16), v);
#pragma unroll
            for (int j = 0; j < V; ++j) f(u, v[j]);
          }
        }
      };
      each_value([&](int u, float v) { sum[u] += v; });
#pragma unroll
      for (int u = 0; u < 4; ++u) mu[u] = warp_sum(sum[u]) / C;
      each_value([&](int u, float v) { sq[u] = fmaf(v - mu[u], v - mu[u], sq[u]); });
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const float var = warp_sum(sq[u]) / C;
        if (lane == 0) stats[r0 + u] = make_float2(mu[u], rsqrtf(var + p.ln_eps));
      }
    }
    __syncthreads();  // statistics and the next places
    issue_tile(it + kStages - 1);

    float acc[4][4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;
    const float2 sa = stats[ra], sb = stats[rb];
    const XT* xa = reinterpret_cast<const XT*>(tile + ra * ldx) + t;
    const XT* xb = reinterpret_cast<const XT*>(tile + rb * ldx) + t;
#pragma unroll 2
    for (int k0 = 0; k0 < C; k0 += 8) {
      const float2 p0 = lnp[k0 + t], p1 = lnp[k0 + t + 4];
      const uint32_t a[4] = {to_tf32(fmaf((to_float(xa[k0]) - sa.x) * sa.y, p0.x, p0.y)),
                             to_tf32(fmaf((to_float(xb[k0]) - sb.x) * sb.y, p0.x, p0.y)),
                             to_tf32(fmaf((to_float(xa[k0 + 4]) - sa.x) * sa.y, p1.x, p1.y)),
                             to_tf32(fmaf((to_float(xb[k0 + 4]) - sb.x) * sb.y, p1.x, p1.y))};
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        uint32_t bw[4];
        ldmatrix_x4(bw, w_lane + np * 16 * ldw + k0);
        mma_tf32(acc[2 * np], a, bw[0], bw[1]);
        mma_tf32(acc[2 * np + 1], a, bw[2], bw[3]);
      }
    }
    const int64_t* of = offs + (st * 3) * R;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = half ? rb : ra;
      const float mv = mvs[st * R + r];
      const int64_t ao = of[R + r], bo = of[2 * R + r];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
        project_store_two(p, pair_out, wc * 32 + nt * 8 + 2 * t, acc[nt][2 * half], acc[nt][2 * half + 1], mv, ao, bo);
    }
  }
  cp_async_wait_all();
#else
  target_lacks_instructions();
#endif
}

// ---------------------------------------------------------------------------------------------
// The register-resident projection for 16-bit x (PrepArgs::regs_blocks > 0; layout in
// opm_params.h).  The row-tiled kernel stages x through shared memory behind its blocks' barriers
// and each block waits on its own loads (0.63 TB/s at (1,512,1536,256) in bfloat16); here a warp's
// 16 rows go from global memory straight into the registers that feed its MMAs, and the warps of
// an SM (two blocks of kPrWarps) keep their loads in flight each on its own: no barrier after W is
// staged.  LayerNorm's output is rounded to x's type and multiplied in it (16-bit products,
// float32 sums), as eager PyTorch runs a model in that type.
//
// Lane (g, t) = (lane / 4, lane % 4) loads features 32q + 8t .. 32q + 8t + 7 of rows g and g + 8,
// one 16-byte piece each.  Read as m16n8k16 A fragments, piece q of the two rows gives k-steps 2q
// (words .x, .y) and 2q + 1 (.z, .w): k-step 2q + h takes feature 32q + 8t + 4h + 2(k / 8) + k % 2
// as its k index k = 2t + k % 2 + 8(k / 8).  B's fragments of the same lane (column n = g) take
// the same features of W's row n, which one 16-byte read of the row as stored gives for both
// steps: k is permuted alike on both sides within each group of 32, so the sums are those of W·y.
// Per tile: the rows' sums on the tensor cores (x against ones: exact products, float32 sums), the
// squared deviations from the mean in float32, reduced over the lane quad (two passes, as eager's
// LayerNorm); y = (x - mean)·rstd·w + b rounded to x's type in place; then the MMAs, kPrPassTiles n
// tiles at a time (their accumulators live only through a pass), the bias and the mask, staged in
// the warp's rows of shared memory so that each row of a and b goes out whole, in 16-byte pieces.
// The register budget (128 at two blocks an SM) shaped the code: see the notes in it.
// ---------------------------------------------------------------------------------------------

// The 8 elements of a 16-byte piece of x as float32; bfloat16's by bit operations, one
// instruction an element (unpack16's conversions take two for the high halves).
template <typename T>
__device__ __forceinline__ void unpack16_bits(const uint4& raw, float* out) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[2 * i] = __uint_as_float(w[i] << 16);
      out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  } else {
    unpack16<T>(raw, out);
  }
}

// 16 bytes at base + kOffset bytes of global memory where ok, else zeros, past the caches (evict
// first: x is read once).  One address for all of a row's pieces: written as C++, each predicated
// load got its own address arithmetic (5 instructions).
template <int kOffset>
__device__ __forceinline__ uint4 ld_stream16_or_zero(const void* base, bool ok) {
  uint4 v;
  asm volatile(
      "{\n"
      "  .reg .pred p;\n"
      "  setp.ne.b32 p, %5, 0;\n"
      "  mov.b32 %0, 0;\n"
      "  mov.b32 %1, 0;\n"
      "  mov.b32 %2, 0;\n"
      "  mov.b32 %3, 0;\n"
      "  @p ld.global.cs.v4.u32 {%0, %1, %2, %3}, [%4+%6];\n"
      "}\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(__cvta_generic_to_global(base)), "r"(int(ok)), "n"(kOffset));
  return v;
}

// n / d for 0 <= n < 2^31 and d >= 1 by a multiply and a shift (Granlund and Montgomery: with
// l = ceil(log2 d), m = ceil(2^(31 + l) / d) < 2^32 and n / d = (n·m) >> (31 + l) for every such n).
struct RowDiv {
  uint32_t mul;
  int shift;
  __device__ explicit RowDiv(uint32_t d) {
    int l = 0;
    while ((1u << l) < d && l < 31) ++l;
    shift = 31 + l;
    mul = uint32_t(((uint64_t(1) << shift) + d - 1) / d);
  }
  __device__ __forceinline__ uint32_t operator()(uint32_t n) const { return uint32_t((uint64_t(n) * mul) >> shift); }
};

// project_row without chunks of s (s_chunk 0), rows below 2^31: b, s and n by div_n and div_s
// (RowDiv of N and S).
__device__ __forceinline__ ProjectRow project_row32(const PrepArgs& p, int rows, int row, const RowDiv& div_n,
                                                    const RowDiv& div_s) {
  ProjectRow r{-1, -1, -1, 0, 0, 0};
  if (row >= rows) return r;
  const unsigned bs = div_n(unsigned(row)), b = div_s(bs);
  const int n = row - int(bs) * p.N, s = int(bs - b * unsigned(p.S));
  r.x = int64_t(b) * p.x_sb + int64_t(s) * p.x_ss + int64_t(n + p.n_offset) * p.x_sn;
  r.mb = int(b), r.ms = s, r.mn = n + p.n_offset;
  if (unsigned(n - p.a_first) < unsigned(p.a_rows))
    r.a = ab_row_offset(p.a_sb, p.a_sc, p.a_ss, p.a_sn, 0, int(b), s, n - p.a_first);
  if (p.b_out) r.b = ab_row_offset(p.b_sb, p.b_sc, p.b_ss, p.b_sn, 0, int(b), s, n);
  return r;
}

template <typename XT, int kQ>  // XT: x's 16-bit type; kQ: groups of 32 features a row holds (msa_dim <= 32 kQ)
__global__ void __launch_bounds__(kPrThreads, kPrMaxBlocksPerSm) opm_project_regs_kernel(const PrepArgs p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::);  // as opm_prep_kernel
#endif
  static_assert(sizeof(XT) == 2 && kQ >= 1 && kQ <= kPrMaxGroups, "16-bit x, at most kPrMaxGroups groups");
  constexpr unsigned kAll = 0xffffffffu;
  extern __shared__ float4 smem_f4[];
  const int C = p.C, H = p.H;  // the host sized shared memory for project_regs_groups(C) = kQ
  const int hp = project_regs_side_rows(H), ldw = project_regs_row_bytes(C) / 16;  // 16-byte pieces a row
  uint4* ws = reinterpret_cast<uint4*>(smem_f4);              // [2][hp][ldw]
  float* ln_w = reinterpret_cast<float*>(ws + 2 * hp * ldw);  // [32 kQ]
  float* ln_b = ln_w + 32 * kQ;                               // [32 kQ]
  float* bias = ln_b + 32 * kQ;                               // [2][hp]
  const int ldo = project_regs_out_ld(H);                     // words a staged row
  uint32_t* staged = reinterpret_cast<uint32_t*>(bias + 2 * hp);  // [warps][kPrRows][ldo]
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  uint32_t* const own = staged + warp * kPrRows * ldo;  // this warp's rows

  // W's rows in x's type, exact (the host's float32 copy came from it): a's H then zero rows up to
  // hp, b's likewise
  for (int i = tid; i < 2 * hp * 4 * kQ; i += kPrThreads) {
    const int o = i / (4 * kQ), k0 = (i % (4 * kQ)) * 8;
    const int side = o >= hp, h = o - side * hp;
    const float* src = (side ? p.wb : p.wa) + int64_t(h) * C;
    uint32_t w[4] = {0u, 0u, 0u, 0u};
    if (h < H && k0 < C) {  // C % 8 == 0: a piece is all in or all out
#pragma unroll
      for (int j = 0; j < 4; ++j) w[j] = pack_16bit<XT>(src[k0 + 2 * j], src[k0 + 2 * j + 1]);
    }
    ws[o * ldw + k0 / 8] = make_uint4(w[0], w[1], w[2], w[3]);
  }
  for (int c = tid; c < 32 * kQ; c += kPrThreads) {
    ln_w[c] = c < C ? p.ln_w[c] : 0.f;  // zeros past C: y is 0 there whatever the mean
    ln_b[c] = c < C ? p.ln_b[c] : 0.f;
  }
  for (int o = tid; o < 2 * hp; o += kPrThreads) {
    const int side = o >= hp, h = o - side * hp;
    const float* b = side ? p.bb : p.ba;
    bias[o] = h < H && b != nullptr ? b[h] : 0.f;
  }
  __syncthreads();

  const int rows = int(project_rows_count(p));
  const int tiles = (rows + kPrRows - 1) / kPrRows;
  const uint32_t ones = pack_16bit<XT>(1.f, 1.f);
  // rows of a and b in 16-byte pieces: H a multiple of 8, every row 16-byte aligned
  const bool vec16 = H % 8 == 0 && ((reinterpret_cast<uintptr_t>(p.a_out) | reinterpret_cast<uintptr_t>(p.b_out)) & 15) == 0 &&
                     ((p.a_sb | p.a_ss | p.a_sn | p.b_sb | p.b_ss | p.b_sn) & 7) == 0;
  const float inv_c = 1.f / float(C);  // the mean and the variance as products, not quotients
  const XT* x = static_cast<const XT*>(p.x);
  const RowDiv div_n(unsigned(p.N)), div_s(unsigned(p.S));
  for (int tile = blockIdx.x * kPrWarps + warp; tile < tiles; tile += gridDim.x * kPrWarps) {
    // lane i places row i % 16 of the tile; lane (g, t) takes its rows' places from lanes g and g + 8
    const ProjectRow pr = project_row32(p, rows, tile * kPrRows + (lane & 15), div_n, div_s);
    const int64_t x0 = __shfl_sync(kAll, pr.x, g), x1 = __shfl_sync(kAll, pr.x, g + 8);
    // rows g and g + 8 (zeros past C and for rows past the last); x streams past the caches (read
    // once), each row's pieces at immediate offsets from one address
    uint4 xv[2][kQ];
    const uint4* xrow[2] = {reinterpret_cast<const uint4*>(x + (x0 >= 0 ? x0 : 0) + 8 * t),
                            reinterpret_cast<const uint4*>(x + (x1 >= 0 ? x1 : 0) + 8 * t)};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int c_end = (r == 0 ? x0 : x1) >= 0 ? C - 8 * t : 0;  // features of the row this lane reads
      [&]<int... kG>(std::integer_sequence<int, kG...>) {
        ((xv[r][kG] = ld_stream16_or_zero<64 * kG>(xrow[r], 32 * kG < c_end)), ...);
      }(std::make_integer_sequence<int, kQ>{});
    }
    const float mv = pr.x >= 0 ? mask_at(p.mask, pr.mb, pr.ms, pr.mn) : 0.f;

    // the rows' sums: x against ones.  A row's piece as a whole A fragment (its words taken as
    // rows g, g + 8, g, g + 8) puts the row's sum in D's rows g and g + 8 together, with no moves
    // to gather the two rows' words into one fragment.
    float sum[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int q = 0; q < kQ; ++q) {
      if (32 * q < C) {  // (the LayerNorm loops skip the groups past C: a branch a group keeps each
                         // group's values from being formed all at once, past 128 registers)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const uint32_t piece[4] = {xv[r][q].x, xv[r][q].y, xv[r][q].z, xv[r][q].w};
          mma_16bit<XT>(sum[r], piece, ones, ones);
        }
      }
    }
    const float mean[2] = {(sum[0][0] + sum[0][2]) * inv_c, (sum[1][0] + sum[1][2]) * inv_c};
    // squared deviations from the mean (pieces past C left out), summed over the quad
    float sq[2] = {0.f, 0.f};
#pragma unroll
    for (int q = 0; q < kQ; ++q) {
      if (32 * q < C) {
        const bool in = 32 * q + 8 * t < C;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float v[8];
          unpack16_bits<XT>(xv[r][q], v);
          float part = 0.f;
#pragma unroll
          for (int j = 0; j < 8; ++j) part = fmaf(v[j] - mean[r], v[j] - mean[r], part);
          sq[r] += in ? part : 0.f;
        }
      }
    }
    float rstd[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      sq[r] += __shfl_xor_sync(kAll, sq[r], 1);
      sq[r] += __shfl_xor_sync(kAll, sq[r], 2);
      rstd[r] = rsqrtf(sq[r] * inv_c + p.ln_eps);
    }
    // y = (x - mean)·rstd·w + b in float32, rounded to x's type and put back in the group's
    // registers as A fragments: xv[0][q] those of k-step 2q (words 0 and 1 of rows g, g + 8, in
    // fragment order), xv[1][q] those of k-step 2q + 1 (words 2 and 3).  In place: fragments in
    // registers of their own took the kernel past 128 registers into spills.
#pragma unroll
    for (int q = 0; q < kQ; ++q) {
      if (32 * q < C) {  // (past C x's registers are zeros, y's too, as the MMAs below need)
        const float4* wq = reinterpret_cast<const float4*>(ln_w + 32 * q + 8 * t);
        const float4* bq = reinterpret_cast<const float4*>(ln_b + 32 * q + 8 * t);
        const float4 w0 = wq[0], w1 = wq[1], b0 = bq[0], b1 = bq[1];
        const float lw[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
        const float lb[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
        uint32_t frag[2][4];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float v[8];
          unpack16_bits<XT>(xv[r][q], v);
#pragma unroll
          for (int j = 0; j < 4; ++j)
            frag[j >> 1][2 * (j & 1) + r] =
                pack_16bit<XT>(fmaf((v[2 * j] - mean[r]) * rstd[r], lw[2 * j], lb[2 * j]),
                               fmaf((v[2 * j + 1] - mean[r]) * rstd[r], lw[2 * j + 1], lb[2 * j + 1]));
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) xv[h][q] = make_uint4(frag[h][0], frag[h][1], frag[h][2], frag[h][3]);
      }
    }

    // a's outputs, then b's, kPrPassTiles n tiles a pass: + bias, × mask, rounded to x's type and
    // staged in the warp's rows of shared memory (row g + 8r: a's at word h / 2, b's at hp / 2 + h / 2)
    const float m[2] = {__shfl_sync(kAll, mv, g), __shfl_sync(kAll, mv, g + 8)};
    const uint4* w_lane = ws + g * ldw + t;
    for (int nt0 = 0; nt0 < 2 * hp / 8; nt0 += kPrPassTiles) {
      float acc[kPrPassTiles][4];
#pragma unroll
      for (int j = 0; j < kPrPassTiles; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
#pragma unroll
      for (int q = 0; q < kQ; ++q) {
        const uint32_t a_lo[4] = {xv[0][q].x, xv[0][q].y, xv[0][q].z, xv[0][q].w};
        const uint32_t a_hi[4] = {xv[1][q].x, xv[1][q].y, xv[1][q].z, xv[1][q].w};
#pragma unroll
        for (int j = 0; j < kPrPassTiles; ++j) {  // W's rows past H are zeros: no test per tile
          const uint4 w = w_lane[(nt0 + j) * 8 * ldw + 4 * q];
          mma_16bit<XT>(acc[j], a_lo, w.x, w.y);
          mma_16bit<XT>(acc[j], a_hi, w.z, w.w);
        }
      }
#pragma unroll
      for (int j = 0; j < kPrPassTiles; ++j) {
        const int o = (nt0 + j) * 8 + 2 * t;  // o and o + 1 on one side: hp is even
        const float2 bo = *reinterpret_cast<const float2*>(bias + o);
#pragma unroll
        for (int r = 0; r < 2; ++r)
          own[(g + 8 * r) * ldo + o / 2] =
              pack_16bit<XT>((acc[j][2 * r] + bo.x) * m[r], (acc[j][2 * r + 1] + bo.y) * m[r]);
      }
    }
    __syncwarp();
    // lane i writes row i % 16's a (i < 16) or b (i >= 16) where it has one: H / 4 pieces of 8 bytes
    // from the staged row (16-byte pieces where H % 8 == 0 and the layout keeps them aligned)
    {
      const int side = lane >> 4;
      const int64_t row_off = side ? pr.b : pr.a;
      if (row_off >= 0) {
        const uint32_t* src = own + (lane & 15) * ldo + side * (hp / 2);
        char* dst = reinterpret_cast<char*>(static_cast<XT*>(side ? p.b_out : p.a_out) + row_off);
        if (vec16) {
          for (int k = 0; k < H / 8; ++k)
            *reinterpret_cast<uint4*>(dst + 16 * k) = *reinterpret_cast<const uint4*>(src + 4 * k);
        } else {
          for (int k = 0; k < H / 4; ++k)
            *reinterpret_cast<uint2*>(dst + 8 * k) = *reinterpret_cast<const uint2*>(src + 2 * k);
        }
      }
    }
    __syncwarp();  // the staged rows read before the next tile's are staged
  }
#else
  target_lacks_instructions();
#endif
}

// ---------------------------------------------------------------------------------------------
// Kernel 2a (outer-first): per block a tile of Ti x Tj pairs (i, j).
//   phase 1: O[(i,h1), (j,h2)] = sum_s a[s,i,h1] b[s,j,h2], a (Ti·H <= 128) x (Tj·H <= 256) GEMM
//            with K = S, accumulators in registers, then parked in shared memory;
//   phase 2: out[(i,j), d] = sum_k O[(i,j), k] W[d, k] over k = (h1, h2), W streamed through
//            shared memory; epilogue divides by den[i] and adds the bias.
// Nothing of O leaves the chip.
// ---------------------------------------------------------------------------------------------


template <bool kVec4>  // kVec4: H % 4 == 0, so 4 consecutive k share h1
__global__ void __launch_bounds__(kOuterThreads, 1) opm_outer_fused_kernel(const OuterArgs p) {
  extern __shared__ float4 smem_f4[];
  float* Os = reinterpret_cast<float*>(smem_f4);      // [MT][OStride]
  float* stage = Os + kOuterMT * kOuterOStride;        // phase 1: A/B stages; phase 2: W stages
  __shared__ float den_s[kOuterMT];
  const int H = p.H, N = p.N, S = p.S, D = p.D;
  const int b = blockIdx.z;
  const int i0 = blockIdx.y * p.Ti, j0 = blockIdx.x * p.Tj;  // i0 local to this row block
  const int tid = threadIdx.x;
  const int64_t NH = int64_t(N) * H, NaH = int64_t(p.Na) * H;

  for (int il = tid >> 5; il < p.Ti; il += kOuterThreads / 32) {
    const int i = min(i0 + il, p.Na - 1) + p.i_offset;
    const float den = mask_denominator(p.mask, b, i, p.S_mask, tid & 31);
    if ((tid & 31) == 0) den_s[il] = den;
  }

  // ---------------- phase 1 ----------------
  const int tx = tid & 15, ty = tid >> 4;
  float acc[8][16];
#pragma unroll
  for (int r = 0; r < 8; ++r)
#pragma unroll
    for (int c = 0; c < 16; ++c) acc[r][c] = 0.f;

  const int a_lim = min(p.Ti * H, int((p.Na - i0) * H));  // valid rows of this tile
  const int b_lim = min(p.Tj * H, int((N - j0) * H));
  const float* a_base = static_cast<const float*>(p.a) + int64_t(b) * S * NaH + int64_t(i0) * H;
  const float* b_base = static_cast<const float*>(p.b) + int64_t(b) * S * NH + int64_t(j0) * H;

  auto load_stage = [&](int buf, int s0) {
    float* As = stage + buf * kOuterBK * (kOuterMT + kOuterNT);
    float* Bs = As + kOuterBK * kOuterMT;
#pragma unroll
    for (int u = 0; u < kOuterBK * kOuterMT / kOuterThreads; ++u) {
      const int idx = tid + u * kOuterThreads;
      const int k = idx / kOuterMT, m = idx % kOuterMT;
      const bool ok = (s0 + k < S) && (m < a_lim);
      cp_async4(&As[idx], a_base + (ok ? int64_t(s0 + k) * NaH + m : 0), ok);
    }
#pragma unroll
    for (int u = 0; u < kOuterBK * kOuterNT / kOuterThreads; ++u) {
      const int idx = tid + u * kOuterThreads;
      const int k = idx / kOuterNT, n = idx % kOuterNT;
      const bool ok = (s0 + k < S) && (n < b_lim);
      cp_async4(&Bs[idx], b_base + (ok ? int64_t(s0 + k) * NH + n : 0), ok);
    }
    cp_async_commit();
  };

  const int n_stages = (S + kOuterBK - 1) / kOuterBK;
  if (n_stages > 0) load_stage(0, 0);
  for (int st = 0; st < n_stages; ++st) {
    cp_async_wait_all();
    __syncthreads();
    if (st + 1 < n_stages) load_stage((st + 1) & 1, (st + 1) * kOuterBK);
    const float* As = stage + (st & 1) * kOuterBK * (kOuterMT + kOuterNT);
    const float* Bs = As + kOuterBK * kOuterMT;
#pragma unroll
    for (int k = 0; k < kOuterBK; ++k) {
      float av[8], bv[16];
      *reinterpret_cast<float4*>(&av[0]) = *reinterpret_cast<const float4*>(&As[k * kOuterMT + ty * 4]);
      *reinterpret_cast<float4*>(&av[4]) =
          *reinterpret_cast<const float4*>(&As[k * kOuterMT + 64 + ty * 4]);
#pragma unroll
      for (int q = 0; q < 4; ++q)
        *reinterpret_cast<float4*>(&bv[4 * q]) =
            *reinterpret_cast<const float4*>(&Bs[k * kOuterNT + 64 * q + tx * 4]);
#pragma unroll
      for (int r = 0; r < 8; ++r)
#pragma unroll
        for (int c = 0; c < 16; ++c) acc[r][c] = fmaf(av[r], bv[c], acc[r][c]);
    }
  }
  __syncthreads();  // all reads of the last stage done before W stages reuse the space
#pragma unroll
  for (int r = 0; r < 8; ++r) {
    const int m = (r < 4) ? ty * 4 + r : 64 + ty * 4 + (r - 4);
#pragma unroll
    for (int q = 0; q < 4; ++q)
      *reinterpret_cast<float4*>(&Os[m * kOuterOStride + 64 * q + tx * 4]) =
          *reinterpret_cast<const float4*>(&acc[r][4 * q]);
  }

  // ---------------- phase 2 ----------------
  const int K2 = H * H;
  const int warp = tid >> 5, lane = tid & 31;
  const bool two_halves = D > 64;
  const int dgw = two_halves ? (warp & 1) : 0;        // which 64-wide half of the d group
  const int pw = two_halves ? (warp >> 1) : warp;     // pair slot of this warp
  const int pairs_per_round = (two_halves ? 4 : 8) * 8;
  const int DG = two_halves ? 128 : 64;
  const int P = p.Ti * p.Tj;
  const int n_kc = (K2 + kOuterKC - 1) / kOuterKC;

  auto load_w = [&](int buf, int dg, int kc0) {
    float* Ws = stage + buf * kOuterKC * kOuterWStride;
    for (int idx = tid; idx < kOuterKC * DG; idx += kOuterThreads) {
      const int dl = idx / kOuterKC, k = idx - dl * kOuterKC;
      const bool ok = (dg + dl < D) && (kc0 + k < K2);
      cp_async4(&Ws[k * kOuterWStride + dl], static_cast<const float*>(p.w_out) + (ok ? int64_t(dg + dl) * K2 + kc0 + k : 0),
                ok);
    }
    cp_async_commit();
  };

  for (int dg = 0; dg < D; dg += DG) {
    for (int p0 = 0; p0 < P; p0 += pairs_per_round) {
      int obase[8];
      bool pvalid[8];
#pragma unroll
      for (int pp = 0; pp < 8; ++pp) {
        const int pr = p0 + pw * 8 + pp;
        pvalid[pp] = pr < P;
        const int il = pvalid[pp] ? pr / p.Tj : 0, jl = pvalid[pp] ? pr % p.Tj : 0;
        obase[pp] = il * H * kOuterOStride + jl * H;
      }
      float acc2[8][2];
#pragma unroll
      for (int pp = 0; pp < 8; ++pp) acc2[pp][0] = acc2[pp][1] = 0.f;

      __syncthreads();  // Os written / previous W stages consumed
      load_w(0, dg, 0);
      int h1 = 0, h2 = 0;  // (h1, h2) of the first k of the current chunk
      for (int kc = 0; kc < n_kc; ++kc) {
        cp_async_wait_all();
        __syncthreads();
        if (kc + 1 < n_kc) load_w((kc + 1) & 1, dg, (kc + 1) * kOuterKC);
        const float* Ws = stage + (kc & 1) * kOuterKC * kOuterWStride + dgw * 64 + lane;
        const int kmax = min(kOuterKC, K2 - kc * kOuterKC);
        // Two-level sum (per chunk, then across chunks) keeps the rounding error of K2 = H*H
        // terms near that of a blocked GEMM rather than a long serial chain.
        float part[8][2];
#pragma unroll
        for (int pp = 0; pp < 8; ++pp) part[pp][0] = part[pp][1] = 0.f;
        if (kVec4) {
          // kmax is a multiple of 4 here (K2 = H*H with 4 | H)
          for (int k = 0; k < kmax; k += 4) {
            const int off = h1 * kOuterOStride + h2;
            float w[4][2];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
              w[u][0] = Ws[(k + u) * kOuterWStride];
              w[u][1] = Ws[(k + u) * kOuterWStride + 32];
            }
#pragma unroll
            for (int pp = 0; pp < 8; ++pp) {
              const float4 o = *reinterpret_cast<const float4*>(&Os[obase[pp] + off]);
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                part[pp][e] = fmaf(o.x, w[0][e], part[pp][e]);
                part[pp][e] = fmaf(o.y, w[1][e], part[pp][e]);
                part[pp][e] = fmaf(o.z, w[2][e], part[pp][e]);
                part[pp][e] = fmaf(o.w, w[3][e], part[pp][e]);
              }
            }
            h2 += 4;
            if (h2 >= H) { h2 = 0; ++h1; }
          }
        } else {
          for (int k = 0; k < kmax; ++k) {
            const int off = h1 * kOuterOStride + h2;
            const float w0 = Ws[k * kOuterWStride], w1 = Ws[k * kOuterWStride + 32];
#pragma unroll
            for (int pp = 0; pp < 8; ++pp) {
              const float o = Os[obase[pp] + off];
              part[pp][0] = fmaf(o, w0, part[pp][0]);
              part[pp][1] = fmaf(o, w1, part[pp][1]);
            }
            if (++h2 == H) { h2 = 0; ++h1; }
          }
        }
#pragma unroll
        for (int pp = 0; pp < 8; ++pp) {
          acc2[pp][0] += part[pp][0];
          acc2[pp][1] += part[pp][1];
        }
      }

#pragma unroll
      for (int pp = 0; pp < 8; ++pp) {
        if (!pvalid[pp]) continue;
        const int pr = p0 + pw * 8 + pp;
        const int il = pr / p.Tj, j = j0 + pr % p.Tj;
        if (i0 + il >= p.Na || j >= N) continue;
        const float den = den_s[il];
        const float pair = p.norm.kind == kNormRow ? 0.f : p.pair[(int64_t(b) * p.norm_rows + i0 + il) * p.out_N + j];
        const int64_t dst = ((int64_t(b) * p.out_rows + p.out_row0 + i0 + il) * p.out_N + j) * D;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int d = dg + dgw * 64 + lane + 32 * e;
          if (d >= D) continue;
          float o = normalise(acc2[pp][e], p.bias ? p.bias[d] : 0.f, den, pair, p.norm);
          if (p.accumulate) o += static_cast<const float*>(p.out)[dst + d];  // a later part of s
          store_out(p.out, dst + d, o, p.out_kind);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Kernel 2b (project-first): out[b] = (A[b] · Cm[b]) / den[b, row] + bias[col % D]
//   A  (B, N, K)     row-major, K = S·H, A[b, i, (s, h1)] = a[b, s, i, h1]
//   Cm (B, K, N·D)   row-major, Cm[b, (s, h1), (j, d)] = c[b, s, h1, j, d]
// A plain tiled SGEMM with a fused epilogue; TMxTN outputs per thread.
// ---------------------------------------------------------------------------------------------


template <int BM, int BN, int BK, int TM, int TN, int STAGES>
struct ProjectGemmConfig {
  static constexpr int kThreads = (BM / TM) * (BN / TN);
  static constexpr int kAStride = BM + 4;
  static constexpr int kStageFloats = BK * (kAStride + BN);
  static constexpr int kSmemBytes = STAGES * kStageFloats * 4;
};

template <int BM, int BN, int BK, int TM, int TN, int STAGES>
__global__ void __launch_bounds__((BM / TM) * (BN / TN))
    opm_project_gemm_kernel(const ProjectArgs p) {
  using Cfg = ProjectGemmConfig<BM, BN, BK, TM, TN, STAGES>;
  constexpr int kThreads = Cfg::kThreads, kAStride = Cfg::kAStride;
  extern __shared__ float4 smem_f4[];
  float* smem = reinterpret_cast<float*>(smem_f4);
  __shared__ float den_s[BM];
  const int b = blockIdx.z;
  const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
  const int tid = threadIdx.x;
  const int tx = tid % (BN / TN), ty = tid / (BN / TN);
  const float* A = p.A + int64_t(b) * p.M * p.K;
  const float* Cm = p.Cm + int64_t(b) * p.K * p.NC;

  for (int r = tid >> 5; r < BM; r += kThreads / 32) {
    const float den = mask_denominator(p.mask, b, min(m0 + r, p.M - 1), p.S, tid & 31);
    if ((tid & 31) == 0) den_s[r] = den;
  }

  auto load_stage = [&](int buf, int k0) {
    float* As = smem + buf * Cfg::kStageFloats;  // [BK][kAStride], A transposed
    float* Bs = As + BK * kAStride;               // [BK][BN]
#pragma unroll
    for (int u = 0; u < (BM * BK + kThreads - 1) / kThreads; ++u) {
      const int idx = tid + u * kThreads;
      if (idx < BM * BK) {
        const int m = idx / BK, k = idx % BK;  // consecutive threads walk K: coalesced
        const bool ok = (m0 + m < p.M) && (k0 + k < p.K);
        cp_async4(&As[k * kAStride + m], A + (ok ? int64_t(m0 + m) * p.K + k0 + k : 0), ok);
      }
    }
#pragma unroll
    for (int u = 0; u < (BN * BK + kThreads - 1) / kThreads; ++u) {
      const int idx = tid + u * kThreads;
      if (idx < BN * BK) {
        const int k = idx / BN, n = idx % BN;
        const bool ok = (n0 + n < p.NC) && (k0 + k < p.K);
        cp_async4(&Bs[k * BN + n], Cm + (ok ? int64_t(k0 + k) * p.NC + n0 + n : 0), ok);
      }
    }
  };

  float acc[TM][TN];
#pragma unroll
  for (int r = 0; r < TM; ++r)
#pragma unroll
    for (int c = 0; c < TN; ++c) acc[r][c] = 0.f;

  // STAGES-1 tiles in flight ahead of the one being multiplied.
  const int n_k = (p.K + BK - 1) / BK;
#pragma unroll
  for (int st = 0; st < STAGES - 1; ++st) {
    if (st < n_k) load_stage(st, st * BK);
    cp_async_commit();
  }
  for (int kt = 0; kt < n_k; ++kt) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    const int next = kt + STAGES - 1;
    if (next < n_k) load_stage(next % STAGES, next * BK);
    cp_async_commit();
    const float* As = smem + (kt % STAGES) * Cfg::kStageFloats;
    const float* Bs = As + BK * kAStride;
    // Two-level sum: one tile's BK terms, then across tiles (K = S*H can be long).
    float part[TM][TN];
#pragma unroll
    for (int r = 0; r < TM; ++r)
#pragma unroll
      for (int c = 0; c < TN; ++c) part[r][c] = 0.f;
#pragma unroll
    for (int k = 0; k < BK; ++k) {
      float av[TM], bv[TN];
#pragma unroll
      for (int r = 0; r < TM; ++r) av[r] = As[k * kAStride + ty * TM + r];
#pragma unroll
      for (int c = 0; c < TN; ++c) bv[c] = Bs[k * BN + tx * TN + c];
#pragma unroll
      for (int r = 0; r < TM; ++r)
#pragma unroll
        for (int c = 0; c < TN; ++c) part[r][c] = fmaf(av[r], bv[c], part[r][c]);
    }
#pragma unroll
    for (int r = 0; r < TM; ++r)
#pragma unroll
      for (int c = 0; c < TN; ++c) acc[r][c] += part[r][c];
  }
  cp_async_wait_all();
  __syncthreads();

#pragma unroll
  for (int r = 0; r < TM; ++r) {
    const int m = m0 + ty * TM + r;
    if (m >= p.M) continue;
    const float den = den_s[ty * TM + r];
    const int64_t dst = (int64_t(b) * p.M + m) * p.NC;
    const float* pair_row = p.pair ? p.pair + (int64_t(b) * p.M + m) * (p.NC / p.D) : nullptr;
#pragma unroll
    for (int c = 0; c < TN; ++c) {
      const int n = n0 + tx * TN + c;
      if (n >= p.NC) continue;
      const float pair = p.norm.kind == kNormRow ? 0.f : pair_row[n / p.D];
      store_out(p.out, dst + n, normalise(acc[r][c], p.bias ? p.bias[n % p.D] : 0.f, den, pair, p.norm), p.out_kind);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Pair mask counts (PairCountArgs): a kPairTR x kPairTJ tile of (r, j) per block, 4 x 4 per thread,
// the mask columns of the tile staged through shared memory kPairSK steps of s at a time, the next
// step's values loaded into registers while this step's are summed (a step's loads are one
// latency, not the kernel's serial chain: at N = 256 the grid is 16 blocks); sums in order of s.
// ---------------------------------------------------------------------------------------------

__global__ void __launch_bounds__(kPairThreads) opm_pair_count_kernel(const PairCountArgs p) {
  __shared__ __align__(16) float mi[kPairSK][kPairTR];
  __shared__ __align__(16) float mj[kPairSK][kPairTJ];
  constexpr int kLoadsI = kPairSK * kPairTR / kPairThreads, kLoadsJ = kPairSK * kPairTJ / kPairThreads;
  static_assert(kLoadsI * kPairThreads == kPairSK * kPairTR && kLoadsJ * kPairThreads == kPairSK * kPairTJ,
                "whole loads per thread");
  static_assert((kPairTR / 4) * (kPairTJ / 4) == kPairThreads, "4 x 4 sums per thread");
  const int b = blockIdx.z, r0 = blockIdx.y * kPairTR, j0 = blockIdx.x * kPairTJ;
  const int tid = threadIdx.x, tx = tid % (kPairTJ / 4), ty = tid / (kPairTJ / 4);
  float acc[4][4] = {};
  float vi[kLoadsI], vj[kLoadsJ];
  auto load_step = [&](int s0) {
#pragma unroll
    for (int k = 0; k < kLoadsI; ++k) {
      const int idx = tid + k * kPairThreads, sl = idx / kPairTR, r = idx % kPairTR;
      const bool ok = s0 + sl < p.S && r0 + r < p.rows;
      vi[k] = ok ? mask_at(p.mask, b, s0 + sl, p.row0 + r0 + r) : 0.f;
    }
#pragma unroll
    for (int k = 0; k < kLoadsJ; ++k) {
      const int idx = tid + k * kPairThreads, sl = idx / kPairTJ, c = idx % kPairTJ;
      const bool ok = s0 + sl < p.S && j0 + c < p.N;
      vj[k] = ok ? mask_at(p.mask, b, s0 + sl, j0 + c) : 0.f;
    }
  };
  load_step(0);
  for (int s0 = 0; s0 < p.S; s0 += kPairSK) {
#pragma unroll
    for (int k = 0; k < kLoadsI; ++k) {
      const int idx = tid + k * kPairThreads;
      mi[idx / kPairTR][idx % kPairTR] = vi[k];
    }
#pragma unroll
    for (int k = 0; k < kLoadsJ; ++k) {
      const int idx = tid + k * kPairThreads;
      mj[idx / kPairTJ][idx % kPairTJ] = vj[k];
    }
    __syncthreads();
    if (s0 + kPairSK < p.S) load_step(s0 + kPairSK);
#pragma unroll 8
    for (int sl = 0; sl < kPairSK; ++sl) {
      const float4 x = *reinterpret_cast<const float4*>(&mi[sl][4 * ty]);
      const float4 y = *reinterpret_cast<const float4*>(&mj[sl][4 * tx]);
      const float xs[4] = {x.x, x.y, x.z, x.w}, ys[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
      for (int rr = 0; rr < 4; ++rr)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[rr][c] = fmaf(xs[rr], ys[c], acc[rr][c]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int rr = 0; rr < 4; ++rr) {
    const int r = r0 + 4 * ty + rr;
    if (r >= p.rows) continue;
    float* dst = p.out + (int64_t(b) * p.rows + r) * p.N;
#pragma unroll
    for (int c = 0; c < 4; ++c)
      if (j0 + 4 * tx + c < p.N) dst[j0 + 4 * tx + c] = acc[rr][c];
  }
}

// ---------------------------------------------------------------------------------------------
// Pair mask counts on tensor cores (PairCountArgs::mma): count = Mᵀ·M per batch element, M the
// (S x N) mask, by mma.sync m16n8k16 with float32 sums.  Every bool, float16 or bfloat16 mask value
// is exact in the 16-bit operand type (bool as bfloat16 0 or 1), so every product is exact.  A
// float32 value m goes in as three bfloat16 pieces, m0 = bf16(m), m1 = bf16(m - m0), m2 =
// bf16(m - m0 - m1) (each rest exact in float32), whose sum is m exactly short of values whose last
// piece falls below bfloat16's normal range; of the nine products the six above float32's last
// place are summed, small ones first (m0·m2, m1·m1, m2·m0, m0·m1, m1·m0, m0·m0).  A stage whose
// low pieces are all zero (0/1 masks, and any other mask exact in bfloat16) takes m0·m0 alone: the
// others would add zeros.  Each k-step's products go to a zeroed fragment that is then added to
// the sums in float32 (as mma_split_add), since the tensor core's own accumulation truncates.
// A block: kPairMmaTR rows r x pair_mma_cols columns j of one batch element, 8 warps of 64 x 32
// (32 x 32 for float32 masks).  The mask's s x r and s x j tiles are read in pieces of 8
// consecutive n (a vector load where the mask has unit stride along n and the piece is aligned,
// else element by element), the next stage's kept in registers while this one's are multiplied,
// and stored as 16-bit operands into two stages of shared memory, s-major (MN-major for both
// operands: fragments by transposing ldmatrix); one barrier per stage.
// ---------------------------------------------------------------------------------------------

// Eight consecutive mask elements along n, as their bits.
template <int kKind>
struct alignas(16) PairMaskPiece {
  using Bits = std::conditional_t<kKind == kMaskFloat, uint32_t,
                                  std::conditional_t<kKind == kMaskBool, uint8_t, uint16_t>>;
  Bits v[8];
};

// Elements (b, s, n .. n + 7) of the mask into x, zeros past n_end (and for all of them where
// !in_s); vec: unit stride along n and a 16-byte aligned mask, so that a whole piece whose first
// element's offset is a multiple of 8 is one vector load.
template <int kKind>
__device__ __forceinline__ void load_pair_piece(PairMaskPiece<kKind>& x, const MaskView& m, int b, int s, int n,
                                                int n_end, bool in_s, bool vec) {
  using Bits = typename PairMaskPiece<kKind>::Bits;
  const int64_t row = int64_t(b) * m.sb + int64_t(s) * m.ss;
  const Bits* base = static_cast<const Bits*>(m.ptr) + row;
  if (in_s && vec && n + 8 <= n_end && ((uint32_t(row) + uint32_t(n)) & 7) == 0) {
    const Bits* src = base + n;
    if constexpr (kKind == kMaskFloat) {
      reinterpret_cast<uint4*>(x.v)[0] = __ldg(reinterpret_cast<const uint4*>(src));
      reinterpret_cast<uint4*>(x.v)[1] = __ldg(reinterpret_cast<const uint4*>(src) + 1);
    } else if constexpr (kKind == kMaskBool) {
      *reinterpret_cast<uint2*>(x.v) = __ldg(reinterpret_cast<const uint2*>(src));
    } else {
      *reinterpret_cast<uint4*>(x.v) = __ldg(reinterpret_cast<const uint4*>(src));
    }
    return;
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) x.v[e] = in_s && n + e < n_end ? base[int64_t(n + e) * m.sn] : Bits(0);
}

// Piece x as 16-bit operands at dst, for float32 masks its lower pieces at dst + plane and
// dst + 2·plane; returns whether those lower pieces hold anything but zeros.
template <int kKind>
__device__ __forceinline__ bool store_pair_piece(uint16_t* dst, int plane, const PairMaskPiece<kKind>& x) {
  if constexpr (kKind == kMaskHalf || kKind == kMaskBFloat16) {
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(x.v);
    return false;
  } else if constexpr (kKind == kMaskBool) {
    uint32_t w[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) w[q] = (x.v[2 * q] ? 0x3f80u : 0u) | (x.v[2 * q + 1] ? 0x3f800000u : 0u);
    *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
    return false;
  } else {
    uint32_t w0[4], w1[4], w2[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float a = __uint_as_float(x.v[2 * q]), b = __uint_as_float(x.v[2 * q + 1]);
      const __nv_bfloat162 p0 = __floats2bfloat162_rn(a, b);
      const float2 f0 = __bfloat1622float2(p0);
      const float ra = a - f0.x, rb = b - f0.y;
      const __nv_bfloat162 p1 = __floats2bfloat162_rn(ra, rb);
      const float2 f1 = __bfloat1622float2(p1);
      const __nv_bfloat162 p2 = __floats2bfloat162_rn(ra - f1.x, rb - f1.y);
      w0[q] = *reinterpret_cast<const uint32_t*>(&p0);
      w1[q] = *reinterpret_cast<const uint32_t*>(&p1);
      w2[q] = *reinterpret_cast<const uint32_t*>(&p2);
    }
    *reinterpret_cast<uint4*>(dst) = make_uint4(w0[0], w0[1], w0[2], w0[3]);
    *reinterpret_cast<uint4*>(dst + plane) = make_uint4(w1[0], w1[1], w1[2], w1[3]);
    *reinterpret_cast<uint4*>(dst + 2 * plane) = make_uint4(w2[0], w2[1], w2[2], w2[3]);
    const uint32_t low = (w1[0] | w1[1] | w1[2] | w1[3] | w2[0] | w2[1] | w2[2] | w2[3]) & 0x7fff7fffu;
    return low != 0;
  }
}

template <int kKind>
__global__ void __launch_bounds__(kPairMmaThreads, 2) opm_pair_count_mma_kernel(const PairCountArgs p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using T = std::conditional_t<kKind == kMaskHalf, __half, __nv_bfloat16>;
  constexpr int kPieces = pair_mma_pieces(kKind), TR = kPairMmaTR, TJ = pair_mma_cols(kKind), SK = kPairMmaSK;
  constexpr int LA = TR + 8, LB = TJ + 8;  // elements per row of the r and j tiles
  constexpr int kPlane = SK * (LA + LB);   // one piece of a stage: the r tile, then the j tile
  constexpr int kStage = kPieces * kPlane;
  constexpr int kWarpsJ = TJ / 32, kWarpsR = kPairMmaThreads / 32 / kWarpsJ, WR = TR / kWarpsR;
  constexpr int kMT = WR / 16, kNT = 4;
  constexpr int kPiecesR = SK * TR / 8 / kPairMmaThreads, kPiecesJ = SK * TJ / 8 / kPairMmaThreads;
  static_assert(kPiecesR * kPairMmaThreads * 8 == SK * TR && kPiecesJ * kPairMmaThreads * 8 == SK * TJ,
                "whole pieces per thread");
  static_assert(kWarpsR * WR == TR && kMT * 16 == WR && SK % 16 == 0, "the warps cover the tile");
  static_assert(2 * kStage * 2 == pair_mma_smem_bytes(kKind), "the host's shared memory");
  extern __shared__ float4 smem_f4[];
  uint16_t* const smem = reinterpret_cast<uint16_t*>(smem_f4);

  const int b = blockIdx.z, r0 = blockIdx.y * TR, j0 = blockIdx.x * TJ;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int wr0 = (warp / kWarpsJ) * WR, wj0 = (warp % kWarpsJ) * 32;
  const bool vec = p.mask.sn == 1 && reinterpret_cast<uintptr_t>(p.mask.ptr) % 16 == 0;

  // The r tile holds mask columns row0 + r, read up to N (columns past the band's rows feed only
  // sums that are not stored), so that a band's last piece is one load where it can be.
  PairMaskPiece<kKind> xr[kPiecesR], xj[kPiecesJ];
  const auto load_stage = [&](int s0) {
#pragma unroll
    for (int k = 0; k < kPiecesR; ++k) {
      const int idx = tid + k * kPairMmaThreads, sl = idx / (TR / 8), c = idx % (TR / 8);
      load_pair_piece<kKind>(xr[k], p.mask, b, s0 + sl, p.row0 + r0 + 8 * c, p.N, s0 + sl < p.S, vec);
    }
#pragma unroll
    for (int k = 0; k < kPiecesJ; ++k) {
      const int idx = tid + k * kPairMmaThreads, sl = idx / (TJ / 8), c = idx % (TJ / 8);
      load_pair_piece<kKind>(xj[k], p.mask, b, s0 + sl, j0 + 8 * c, p.N, s0 + sl < p.S, vec);
    }
  };
  // whether this thread's pieces of the stage have low pieces other than zero
  const auto store_stage = [&](uint16_t* st) {
    bool low = false;
#pragma unroll
    for (int k = 0; k < kPiecesR; ++k) {
      const int idx = tid + k * kPairMmaThreads, sl = idx / (TR / 8), c = idx % (TR / 8);
      low |= store_pair_piece<kKind>(st + sl * LA + 8 * c, kPlane, xr[k]);
    }
#pragma unroll
    for (int k = 0; k < kPiecesJ; ++k) {
      const int idx = tid + k * kPairMmaThreads, sl = idx / (TJ / 8), c = idx % (TJ / 8);
      low |= store_pair_piece<kKind>(st + SK * LA + sl * LB + 8 * c, kPlane, xj[k]);
    }
    return low;
  };

  // ldmatrix: lane l addresses row l % 8 of matrix l / 8, which is (r half (l / 8) % 2, k half
  // l / 16) of an A fragment and (k half (l / 8) % 2, n tile 2q + l / 16) of a pair of B fragments
  const int a_lane = ((lane & 7) + 8 * (lane >> 4)) * LA + wr0 + 8 * ((lane >> 3) & 1);
  const int b_lane = SK * LA + ((lane & 7) + 8 * ((lane >> 3) & 1)) * LB + wj0 + 8 * (lane >> 4);
  float acc[kMT][kNT][4];
  zero_tiles(acc);

  const int n_stages = (p.S + SK - 1) / SK;
  load_stage(0);
  for (int st = 0; st < n_stages; ++st) {
    uint16_t* const stage = smem + (st & 1) * kStage;
    [[maybe_unused]] const bool low_here = store_stage(stage);
    // the stage stored, and every warp done with the one before in this buffer (two stages ago)
    bool low = false;
    if constexpr (kPieces == 3) low = __syncthreads_or(low_here) != 0;
    else __syncthreads();
    if (st + 1 < n_stages) load_stage((st + 1) * SK);
#pragma unroll
    for (int ks = 0; ks < SK / 16; ++ks) {
      uint32_t bf[kPieces][kNT / 2][4];
#pragma unroll
      for (int pc = 0; pc < kPieces; ++pc)
        if (pc == 0 || low)
#pragma unroll
          for (int q = 0; q < kNT / 2; ++q)
            ldmatrix_x4_trans(bf[pc][q], stage + pc * kPlane + b_lane + ks * 16 * LB + q * 16);
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        uint32_t af[kPieces][4];
#pragma unroll
        for (int pc = 0; pc < kPieces; ++pc)
          if (pc == 0 || low) ldmatrix_x4_trans(af[pc], stage + pc * kPlane + a_lane + ks * 16 * LA + mt * 16);
        float c[kNT][4];
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) c[nt][e] = 0.f;
        const auto term = [&](int pa, int pb) {
#pragma unroll
          for (int nt = 0; nt < kNT; ++nt)
            mma_16bit<T>(c[nt], af[pa], bf[pb][nt >> 1][(nt & 1) * 2], bf[pb][nt >> 1][(nt & 1) * 2 + 1]);
        };
        if constexpr (kPieces == 3) {
          if (low) {
            term(0, 2);
            term(1, 1);
            term(2, 0);
            term(0, 1);
            term(1, 0);
          }
        }
        term(0, 0);
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[mt][nt][e] += c[nt][e];
      }
    }
  }

  // lane (g, t) holds rows g and g + 8 of each m16 tile, columns 2t and 2t + 1 of each n8 tile
  const bool pairs = p.N % 2 == 0;  // (b, r, j) and (b, r, j + 1) in one aligned float2
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = r0 + wr0 + 16 * mt + 8 * h + g;
      if (r >= p.rows) continue;
      float* const dst = p.out + (int64_t(b) * p.rows + r) * p.N;
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        const int j = j0 + wj0 + 8 * nt + 2 * t;
        const float v0 = acc[mt][nt][2 * h], v1 = acc[mt][nt][2 * h + 1];
        if (pairs) {
          if (j < p.N) *reinterpret_cast<float2*>(dst + j) = make_float2(v0, v1);
        } else {
          if (j < p.N) dst[j] = v0;
          if (j + 1 < p.N) dst[j + 1] = v1;
        }
      }
    }
#else
  target_lacks_instructions();
#endif
}

}  // namespace flashopm
