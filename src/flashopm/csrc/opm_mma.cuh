// Warp-level tensor-core primitives shared by the kernels: mma.sync m16n8k8 with TF32 operands
// and float32 accumulation, the hi/lo split that gives float32 accuracy (3xTF32), and
// mma.sync m16n8k16 with bfloat16 or float16 operands fed by ldmatrix.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace flashopm {

// The #else of a kernel body (or a warpgroup MMA step) that its compilation target lacks the
// instructions for: clusters and programmatic launches before sm_90, warpgroup MMAs outside
// sm_90a, tensor-core MMAs before sm_80.  The host launches such a kernel only where the code the
// driver loaded has them (DeviceInfo::arch, wgmma_runs_on); launched anyway, it stops the grid
// rather than leave its outputs unwritten.
__device__ __forceinline__ void target_lacks_instructions() { __trap(); }

__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}

// x = hi + lo.  The MMA reads only the top 19 bits of a .tf32 operand (the low 13 are ignored,
// i.e. truncated), so: hi = x rounded to nearest TF32 by adding half an ulp to the bit pattern
// and clearing the low bits (two integer ops, where cvt.rna.tf32 costs four with its NaN/Inf
// checks); lo = x - hi is exact in float32 and goes in as is (its truncation to TF32 costs at
// most 2^-21 |x|, unbiased since lo takes either sign).  A NaN in x stays NaN in lo.
// With one term (TF32 proper) cvt.rna keeps NaN and Inf intact.
template <int kTerms>
__device__ __forceinline__ void split_tf32(float x, uint32_t& hi, uint32_t& lo) {
  if constexpr (kTerms == 3) {
    hi = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
    lo = __float_as_uint(x - __uint_as_float(hi));
  } else {
    hi = to_tf32(x);
  }
}

__device__ __forceinline__ void mma_tf32(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// c += a·b with split operands; small terms first.
template <int kTerms>
__device__ __forceinline__ void mma_split(float (&c)[4], const uint32_t (&a_hi)[4], const uint32_t (&a_lo)[4],
                                          uint32_t b_hi0, uint32_t b_hi1, uint32_t b_lo0, uint32_t b_lo1) {
  if constexpr (kTerms == 3) {
    mma_tf32(c, a_lo, b_hi0, b_hi1);
    mma_tf32(c, a_hi, b_lo0, b_lo1);
  }
  mma_tf32(c, a_hi, b_hi0, b_hi1);
}

// acc += a·b for one k-step.  The tensor core's accumulation truncates (rounds toward zero)
// relative to the accumulator's magnitude, a bias that grows with every MMA added into a long
// sum; for float32 accuracy each k-step's products are formed in a zeroed fragment and added
// to the running sum in float32 (round to nearest).
template <int kTerms>
__device__ __forceinline__ void mma_split_add(float (&acc)[4], const uint32_t (&a_hi)[4], const uint32_t (&a_lo)[4],
                                              uint32_t b_hi0, uint32_t b_hi1, uint32_t b_lo0, uint32_t b_lo1) {
  if constexpr (kTerms == 3) {
    float c[4] = {0.f, 0.f, 0.f, 0.f};
    mma_split<3>(c, a_hi, a_lo, b_hi0, b_hi1, b_lo0, b_lo1);
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[e] += c[e];
  } else {
    mma_split<kTerms>(acc, a_hi, a_lo, b_hi0, b_hi1, b_lo0, b_lo1);
  }
}

// Fragments of mma.sync m16n8k8 (TF32) from float32 tiles in shared memory, split for kTerms.
// A (16 x 8) at p: K-major A(m, k) = p[m·ld + k] (conflict-free for ld = 4 mod 8), else
// A(m, k) = p[k·ld + m] (ld = 8 mod 32).  B (8 x 8) at p: K-major B(k, n) = p[n·ld + k], else
// B(k, n) = p[k·ld + n], with the same conditions on ld.
template <int kTerms, bool kKMajor>
__device__ __forceinline__ void tf32_a_frag(uint32_t (&hi)[4], uint32_t (&lo)[4], const float* p, int ld, int g,
                                            int t) {
  float v[4];
  if constexpr (kKMajor) {
    v[0] = p[g * ld + t], v[1] = p[(g + 8) * ld + t], v[2] = p[g * ld + t + 4], v[3] = p[(g + 8) * ld + t + 4];
  } else {
    v[0] = p[t * ld + g], v[1] = p[t * ld + g + 8], v[2] = p[(t + 4) * ld + g], v[3] = p[(t + 4) * ld + g + 8];
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    lo[e] = 0;
    split_tf32<kTerms>(v[e], hi[e], lo[e]);
  }
}
template <int kTerms, bool kKMajor>
__device__ __forceinline__ void tf32_b_frag(uint32_t (&hi)[2], uint32_t (&lo)[2], const float* p, int ld, int g,
                                            int t) {
  const float v0 = kKMajor ? p[g * ld + t] : p[t * ld + g];
  const float v1 = kKMajor ? p[g * ld + t + 4] : p[(t + 4) * ld + g];
  lo[0] = lo[1] = 0;
  split_tf32<kTerms>(v0, hi[0], lo[0]);
  split_tf32<kTerms>(v1, hi[1], lo[1]);
}

// c[mt][nt] += A·B over kSteps k-steps of 8, for a warp's kMT x kNT m16n8 tiles: A at the warp's
// first row and k, B at its first column and k (layouts as for tf32_a_frag / tf32_b_frag).  With
// three terms every k-step's products are added to c in float32 (mma_split_add).  k_steps and
// n_tiles (warp-uniform) cut the k-steps and n tiles to those that hold data, at the edges of small
// problems; callers pass them only there, so that whole tiles keep the unguarded loop.
template <int kTerms, int kMT, int kNT, bool kAKMajor, bool kBKMajor, int kSteps>
__device__ __forceinline__ void warp_mma_tf32(float (&c)[kMT][kNT][4], const float* A, int lda, const float* B,
                                              int ldb, int g, int t, int k_steps = kSteps, int n_tiles = kNT) {
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks) {
    if (ks >= k_steps) break;
    // all of the k-step's B fragments, then one A fragment at a time: fewer live registers than
    // the other way round when kMT >= kNT / 2
    uint32_t b_hi[kNT][2], b_lo[kNT][2];
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
      if (nt < n_tiles)
        tf32_b_frag<kTerms, kBKMajor>(b_hi[nt], b_lo[nt],
                                      B + (kBKMajor ? nt * 8 * ldb + ks * 8 : ks * 8 * ldb + nt * 8), ldb, g, t);
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      uint32_t a_hi[4], a_lo[4];
      tf32_a_frag<kTerms, kAKMajor>(a_hi, a_lo, A + (kAKMajor ? mt * 16 * lda + ks * 8 : ks * 8 * lda + mt * 16), lda,
                                    g, t);
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
        if (nt < n_tiles)
          mma_split_add<kTerms>(c[mt][nt], a_hi, a_lo, b_hi[nt][0], b_hi[nt][1], b_lo[nt][0], b_lo[nt][1]);
    }
  }
}

// One k-step of warp_mma_tf32<kTerms, 1, kNT, true, true, 1> from operands split beforehand
// (split_tf32<kTerms>, stored as float bit patterns): A's high and low parts K-major at A_hi /
// A_lo (16 rows), B's at B_hi / B_lo (kNT tiles of 8 columns, K-major).  The same fragments, so
// the same bits, as splitting each fragment as it is read; the low parts are not read for one term.
template <int kTerms, int kNT>
__device__ __forceinline__ void warp_mma_tf32_presplit(float (&c)[1][kNT][4], const float* A_hi, const float* A_lo,
                                                       int lda, const float* B_hi, const float* B_lo, int ldb, int g,
                                                       int t) {
  const auto u = [](float v) { return __float_as_uint(v); };
  uint32_t b_hi[kNT][2], b_lo[kNT][2];
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt) {
    const int o = (nt * 8 + g) * ldb + t;
    b_hi[nt][0] = u(B_hi[o]), b_hi[nt][1] = u(B_hi[o + 4]);
    b_lo[nt][0] = kTerms == 3 ? u(B_lo[o]) : 0u, b_lo[nt][1] = kTerms == 3 ? u(B_lo[o + 4]) : 0u;
  }
  const int r0 = g * lda + t, r1 = (g + 8) * lda + t;
  const uint32_t a_hi[4] = {u(A_hi[r0]), u(A_hi[r1]), u(A_hi[r0 + 4]), u(A_hi[r1 + 4])};
  uint32_t a_lo[4] = {0u, 0u, 0u, 0u};
  if constexpr (kTerms == 3) a_lo[0] = u(A_lo[r0]), a_lo[1] = u(A_lo[r1]), a_lo[2] = u(A_lo[r0 + 4]), a_lo[3] = u(A_lo[r1 + 4]);
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt)
    mma_split_add<kTerms>(c[0][nt], a_hi, a_lo, b_hi[nt][0], b_hi[nt][1], b_lo[nt][0], b_lo[nt][1]);
}

// x's high part (and low part, for three terms) as split_tf32 forms them, as floats.
template <int kTerms>
__device__ __forceinline__ void split_tf32_f(float x, float& hi, float& lo) {
  uint32_t h, l = 0u;
  split_tf32<kTerms>(x, h, l);
  hi = __uint_as_float(h);
  lo = __uint_as_float(l);
}

// Four 8x8 matrices of 16-bit elements from shared memory; lane l gives the address of row l % 8
// of matrix l / 8 (16 contiguous bytes).  Without .trans lane l receives elements (l/4, 2(l%4))
// and (l/4, 2(l%4)+1) of each matrix; with .trans, elements (2(l%4), l/4) and (2(l%4)+1, l/4).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// c += a·b, m16n8k16, a and b of type T (__nv_bfloat16 or __half), c float32.
template <typename T>
__device__ __forceinline__ void mma_16bit(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// c[n] = a·b[n] for one k-step of m16n8k16 over the first n_valid of kNT n tiles (warp-uniform),
// float16 split operands (x = x_hi + x_lo): lo·hi + hi·lo + hi·hi, small terms first, formed in
// zeroed fragments, to be added to an accumulator in float32 (as mma_split_add, against the
// tensor core's truncating accumulation).  Each term goes to every tile before the next, so that
// consecutive MMAs are independent.  b_hi[n] / b_lo[n]: the tile's two B registers.
template <int kNT>
__device__ __forceinline__ void mma_f16_split_kstep(float (&c)[kNT][4], const uint32_t (&a_hi)[4],
                                                    const uint32_t (&a_lo)[4], const uint32_t (&b_hi)[kNT][2],
                                                    const uint32_t (&b_lo)[kNT][2], int n_valid) {
#pragma unroll
  for (int n = 0; n < kNT; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) c[n][e] = 0.f;
#pragma unroll
  for (int n = 0; n < kNT; ++n)
    if (n < n_valid) mma_16bit<__half>(c[n], a_lo, b_hi[n][0], b_hi[n][1]);
#pragma unroll
  for (int n = 0; n < kNT; ++n)
    if (n < n_valid) mma_16bit<__half>(c[n], a_hi, b_lo[n][0], b_lo[n][1]);
#pragma unroll
  for (int n = 0; n < kNT; ++n)
    if (n < n_valid) mma_16bit<__half>(c[n], a_hi, b_hi[n][0], b_hi[n][1]);
}

// acc[n] += a·b[n] (mma_f16_split_kstep's sums added in float32).
template <int kNT>
__device__ __forceinline__ void mma_f16_split_add(float (&acc)[kNT][4], const uint32_t (&a_hi)[4],
                                                  const uint32_t (&a_lo)[4], const uint32_t (&b_hi)[kNT][2],
                                                  const uint32_t (&b_lo)[kNT][2], int n_valid) {
  float c[kNT][4];
  mma_f16_split_kstep(c, a_hi, a_lo, b_hi, b_lo, n_valid);
#pragma unroll
  for (int n = 0; n < kNT; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[n][e] += c[n][e];
}

// The same with the k-step's sums scaled per row: rows g of acc[n] by f_g, rows g + 8 by f_g8
// (one fused multiply-add each instead of an add).
template <int kNT>
__device__ __forceinline__ void mma_f16_split_fma_rows(float (&acc)[kNT][4], const uint32_t (&a_hi)[4],
                                                       const uint32_t (&a_lo)[4], const uint32_t (&b_hi)[kNT][2],
                                                       const uint32_t (&b_lo)[kNT][2], int n_valid, float f_g,
                                                       float f_g8) {
  float c[kNT][4];
  mma_f16_split_kstep(c, a_hi, a_lo, b_hi, b_lo, n_valid);
#pragma unroll
  for (int n = 0; n < kNT; ++n) {
    acc[n][0] = fmaf(c[n][0], f_g, acc[n][0]);
    acc[n][1] = fmaf(c[n][1], f_g, acc[n][1]);
    acc[n][2] = fmaf(c[n][2], f_g8, acc[n][2]);
    acc[n][3] = fmaf(c[n][3], f_g8, acc[n][3]);
  }
}

// Zeroes a warp's kMT x kNT accumulator tiles.
template <int kMT, int kNT>
__device__ __forceinline__ void zero_tiles(float (&acc)[kMT][kNT][4]) {
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;
}

// acc[mt][nt] += A tile mt · B tile nt for a warp's kMT x kNT m16n8 tiles; bf holds two n tiles
// per ldmatrix.x4 (b0, b1 of tile 2q in bf[q][0..1], of tile 2q + 1 in bf[q][2..3]).
template <typename T, int kMT, int kNT>
__device__ __forceinline__ void mma_16bit_tiles(float (&acc)[kMT][kNT][4], const uint32_t (&af)[kMT][4],
                                                const uint32_t (&bf)[kNT / 2][4]) {
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
      mma_16bit<T>(acc[mt][nt], af[mt], bf[nt >> 1][(nt & 1) * 2], bf[nt >> 1][(nt & 1) * 2 + 1]);
}

// Two float32 values rounded to nearest in T, packed (the first in the low half).
template <typename T>
__device__ __forceinline__ uint32_t pack_16bit(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// Four 8 x 8 matrices of 16-bit values to shared memory (stmatrix .x4, sm_90): lane 8i + r gives
// the shared address of row r of matrix i (16 bytes, 16-byte aligned); register i holds this lane's
// (row lane / 4, columns 2(lane % 4), + 1) of matrix i, an MMA accumulator's layout in 16 bits.
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
#endif
}

// ---- sm_90a warpgroup MMA (wgmma) from shared memory ----
// Descriptor of a 128-byte-swizzled operand tile (PTX "matrix descriptor"): start address, LBO and
// SBO in 16-byte units, swizzle mode 1.  For the MN-major layout used here (rows of 64 consecutive
// m or n per k, 8 rows to a 1 KB atom, 16-byte pieces XORed with the row index): LBO is the byte
// stride between 64-wide groups along m/n, SBO between groups of 8 k (scripts/wgmma_probe.py).
__device__ __forceinline__ uint64_t wgmma_desc(const void* smem, uint32_t lbo, uint32_t sbo) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  return uint64_t((addr >> 4) & 0x3fff) | (uint64_t((lbo >> 4) & 0x3fff) << 16) |
         (uint64_t((sbo >> 4) & 0x3fff) << 32) | (uint64_t(1) << 62);
}

// A warpgroup's registers a thread, set to kRegs (a multiple of 8 in 24..256) by all its warps
// together: the producer warpgroup gives up what its one issuing lane does not need, the consumer
// warpgroups take it (ptxas allocates the code after each call within the new count).
template <int kRegs>
__device__ __forceinline__ void warpgroup_regs_dec() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
#endif
}
template <int kRegs>
__device__ __forceinline__ void warpgroup_regs_inc() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
#endif
}

__device__ __forceinline__ void wgmma_fence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#else
  target_lacks_instructions();
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#else
  target_lacks_instructions();
#endif
}
__device__ __forceinline__ void wgmma_wait_all() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#endif
}
template <int kPending>  // wait until at most kPending committed wgmma groups are in flight
__device__ __forceinline__ void wgmma_wait() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
#endif
}
// Orders this thread's earlier shared-memory writes (cp.async included) before reads by the
// async proxy (wgmma).
__device__ __forceinline__ void fence_proxy_async_smem() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// Accumulator operands of the warpgroup MMAs' inline assembly, d[k] .. d[k + 15] and longer runs.
#define FLASHOPM_ACC16(d, k)                                                                                  \
  "+f"(d[k]), "+f"(d[k + 1]), "+f"(d[k + 2]), "+f"(d[k + 3]), "+f"(d[k + 4]), "+f"(d[k + 5]), "+f"(d[k + 6]), \
      "+f"(d[k + 7]), "+f"(d[k + 8]), "+f"(d[k + 9]), "+f"(d[k + 10]), "+f"(d[k + 11]), "+f"(d[k + 12]),     \
      "+f"(d[k + 13]), "+f"(d[k + 14]), "+f"(d[k + 15])
#define FLASHOPM_ACC32(d) FLASHOPM_ACC16(d, 0), FLASHOPM_ACC16(d, 16)
#define FLASHOPM_ACC64(d) FLASHOPM_ACC32(d), FLASHOPM_ACC16(d, 32), FLASHOPM_ACC16(d, 48)
#define FLASHOPM_ACC128(d) \
  FLASHOPM_ACC64(d), FLASHOPM_ACC16(d, 64), FLASHOPM_ACC16(d, 80), FLASHOPM_ACC16(d, 96), FLASHOPM_ACC16(d, 112)

// ... and their names in the instruction: "%0, %1, ..." for 16, 32, 64 or 128 accumulators.
#define FLASHOPM_ACC_NAMES16 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define FLASHOPM_ACC_NAMES32 \
  FLASHOPM_ACC_NAMES16 ", %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define FLASHOPM_ACC_NAMES64                                                                           \
  FLASHOPM_ACC_NAMES32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
                       "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define FLASHOPM_ACC_NAMES128                                                                          \
  FLASHOPM_ACC_NAMES64 ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
                       "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "   \
                       "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, "    \
                       "%110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, "     \
                       "%123, %124, %125, %126, %127"

// d (64 x 256 per warpgroup, float32) += A (64 x 16) · B (16 x 256), both MN-major in shared
// memory (transpose flags set), T = __nv_bfloat16 or __half.  Accumulator layout: warp w of the
// warpgroup holds rows 16w + lane/4 (+8); d[4j .. 4j+3] are (row, 8j + 2(lane%4) + {0, 1}) and
// (row + 8, the same columns).
// The 16-bit warpgroup MMAs d += A·B with float32 sums, one function a shape for both types (T =
// __nv_bfloat16 or __half; no code off sm_90a): NAME(D_DECL, desc_a, desc_b), SHAPE the PTX shape,
// NAMES the accumulators' operand names, ACC the macro of their constraints (applied to d), DESC
// the descriptors' operand numbers, TRANS the transpose flags ("1, 1": both operands MN-major,
// "0, 0": both K-major).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FLASHOPM_WGMMA16_ASM(SHAPE, TYPE, NAMES, ACC, DESC, TRANS)                                   \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                                          \
               "wgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE "." TYPE " {" NAMES "}, " DESC   \
               ", p, 1, 1, " TRANS ";\n}\n"                                                      \
               : ACC(d)                                                                         \
               : "l"(desc_a), "l"(desc_b))
#else
#define FLASHOPM_WGMMA16_ASM(SHAPE, TYPE, NAMES, ACC, DESC, TRANS) ((void)d, (void)desc_a, (void)desc_b)
#endif
#define FLASHOPM_DEFINE_WGMMA16(NAME, D_DECL, SHAPE, NAMES, ACC, DESC, TRANS)                       \
  template <typename T>                                                                           \
  __device__ __forceinline__ void NAME(D_DECL, uint64_t desc_a, uint64_t desc_b) {                 \
    if constexpr (std::is_same_v<T, __nv_bfloat16>)                                                \
      FLASHOPM_WGMMA16_ASM(SHAPE, "bf16", NAMES, ACC, DESC, TRANS);                                 \
    else                                                                                          \
      FLASHOPM_WGMMA16_ASM(SHAPE, "f16", NAMES, ACC, DESC, TRANS);                                  \
  }

FLASHOPM_DEFINE_WGMMA16(wgmma_m64n256k16, float (&d)[128], "m64n256k16", FLASHOPM_ACC_NAMES128,
                        FLASHOPM_ACC128, "%128, %129", "1, 1")

// The same for B 16 x 128: the columns 128h .. 128h + 127 of wgmma_m64n256k16 as d[64] (its
// accumulators 64h .. 64h + 63).  Two of these do what one m64n256k16 does where a kernel's
// threads have at most 128 registers at entry (ptxas compiles no instruction that needs more than
// the entry count, setmaxnreg or not, and m64n256k16 needs ~154).
FLASHOPM_DEFINE_WGMMA16(wgmma_m64n128k16, float* d, "m64n128k16", FLASHOPM_ACC_NAMES64, FLASHOPM_ACC64,
                        "%64, %65", "1, 1")

// d (64 x 256 per warpgroup, float32) += A (64 x 8) · B (8 x 256), TF32 operands, both K-major in
// shared memory (TF32 has no transposed form): rows of m or n, 128 bytes of k each, 8 rows to a 1 KB
// swizzle atom.  The MMA reads the top 19 bits of each operand.  Accumulator layout as in
// wgmma_m64n256k16.
__device__ __forceinline__ void wgmma_m64n256k8_tf32(float (&d)[128], uint64_t desc_a, uint64_t desc_b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k8.f32.tf32.tf32 {"
      FLASHOPM_ACC_NAMES128 "}, "
      "%128, %129, p, 1, 1;\n}\n"
      : FLASHOPM_ACC128(d)
      : "l"(desc_a), "l"(desc_b));
#endif
}

// d (64 x 128 per warpgroup, float32) = A (64 x 8) · B (8 x 128) + (accumulate ? d : 0), TF32
// operands as in wgmma_m64n256k8_tf32; the accumulator layout of that MMA's first 16 column tiles.
__device__ __forceinline__ void wgmma_m64n128k8_tf32(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 {"
      FLASHOPM_ACC_NAMES64 "}, "
      "%64, %65, p, 1, 1;\n}\n"
      : FLASHOPM_ACC64(d)
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
#endif
}

// As wgmma_m64n128k8_tf32 with A from registers: warp w of the warpgroup holds rows 16w .. 16w + 15,
// a[0..3] = (row 16w + g, k t), (row + 8, k t), (row, k t + 4), (row + 8, k t + 4) with g = lane / 4,
// t = lane % 4 (the layout of mma.sync m16n8k8's A).  No shared-memory reads for A.
__device__ __forceinline__ void wgmma_m64n128k8_tf32_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b,
                                                        int accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 {"
      FLASHOPM_ACC_NAMES64 "}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
      : FLASHOPM_ACC64(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
#endif
}

// d (64 x 32 per warpgroup, float32) += A (64 x 8) · B (8 x 32), TF32, both K-major (as
// wgmma_m64n256k8_tf32; the accumulator layout of its first 4 column tiles).
__device__ __forceinline__ void wgmma_m64n32k8_tf32(float (&d)[16], uint64_t desc_a, uint64_t desc_b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k8.f32.tf32.tf32 {"
      FLASHOPM_ACC_NAMES16 "}, "
      "%16, %17, p, 1, 1;\n}\n"
      : FLASHOPM_ACC16(d, 0)
      : "l"(desc_a), "l"(desc_b));
#endif
}

// Byte offset of float element (row, k) in a 128-byte-swizzled K-major TF32 tile: rows of 32 k
// (128 bytes), 8 rows to a 1 KB atom, the k groups of 32 of a row group 1 KB apart, row groups
// sbo bytes apart.
__device__ __forceinline__ uint32_t kmajor_tf32_offset(int row, int k, uint32_t sbo) {
  return uint32_t(row >> 3) * sbo + uint32_t(k >> 5) * 1024u + uint32_t(row & 7) * 128u +
         uint32_t((((k & 31) >> 2) ^ (row & 7)) << 4) + uint32_t(k & 3) * 4u;
}

// d (64 x 64 per warpgroup, float32) += A (64 x 16) · B (16 x 64), both K-major in shared memory
// (rows of m or n, 128 bytes of k each, 8 rows to a 1 KB swizzle atom; transpose flags clear).
// The accumulator layout is that of wgmma_m64n256k16 with 8 column tiles.
FLASHOPM_DEFINE_WGMMA16(wgmma_m64n64k16_kmajor, float (&d)[32], "m64n64k16", FLASHOPM_ACC_NAMES32,
                        FLASHOPM_ACC32, "%32, %33", "0, 0")

// The same with B 16 x 96 (the wide forms' phase 2: both column tiles' 96 pairs), into d[0..47]:
// the layout of wgmma_m64n256k16's first 12 column tiles.
#define FLASHOPM_ACC48(d) FLASHOPM_ACC32(d), FLASHOPM_ACC16(d, 32)
#define FLASHOPM_ACC_NAMES48 \
  FLASHOPM_ACC_NAMES32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"
FLASHOPM_DEFINE_WGMMA16(wgmma_m64n96k16_kmajor, float* d, "m64n96k16", FLASHOPM_ACC_NAMES48, FLASHOPM_ACC48,
                        "%48, %49", "0, 0")

// The float16 split form's MMAs: d = A·B + (accumulate ? d : 0) with float16 operands, both
// K-major in shared memory (rows of m or n, 128 bytes of k each, 8 rows to a 1 KB swizzle atom;
// transpose flags clear).  m64n128k16: the accumulator layout of wgmma_m64n256k16's first 16
// column tiles; m64n32k16: its first 4.
__device__ __forceinline__ void wgmma_m64n128k16_f16(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                                     int accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {"
      FLASHOPM_ACC_NAMES64 "}, "
      "%64, %65, p, 1, 1, 0, 0;\n}\n"
      : FLASHOPM_ACC64(d)
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
#endif
}
__device__ __forceinline__ void wgmma_m64n32k16_f16(float (&d)[16], uint64_t desc_a, uint64_t desc_b,
                                                    int accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {"
      FLASHOPM_ACC_NAMES16 "}, "
      "%16, %17, p, 1, 1, 0, 0;\n}\n"
      : FLASHOPM_ACC16(d, 0)
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
#endif
}

// As wgmma_m64n128k16_f16 with A from registers: warp w of the warpgroup holds rows 16w .. 16w + 15,
// a[0..3] = (row 16w + g, k 2t, 2t + 1), (row + 8, the same k), (row, k 2t + 8, 2t + 9), (row + 8,
// those k), two float16 values per register, the lower k in the low half (the layout of mma.sync
// m16n8k16's A).
__device__ __forceinline__ void wgmma_m64n128k16_f16_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b,
                                                        int accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {"
      FLASHOPM_ACC_NAMES64 "}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
      : FLASHOPM_ACC64(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
#endif
}

// d (64 x 64 per warpgroup, float32) = A (64 x 16) · B (16 x 64) + (accumulate ? d : 0), float16
// operands in shared memory, K-major (kTransA / kTransB = 0: rows of m or n, 128 bytes of k) or
// MN-major (1: rows of 64 m or n per k, 8 rows of k to a 1 KB atom; see wgmma_desc).  The
// accumulator layout of wgmma_m64n256k16's first 8 column tiles.
template <int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n64k16_f16(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {"
      FLASHOPM_ACC_NAMES32 "}, "
      "%32, %33, p, 1, 1, %35, %36;\n}\n"
      : FLASHOPM_ACC32(d)
      : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(kTransA), "n"(kTransB));
#endif
}

// Byte offset of element (row, k) of a float16 split operand in shared memory: the 128-byte
// swizzled K-major layout of kmajor_tf32_offset, each row's 128 bytes holding the high parts of
// its 32 k (bytes 0-63) and then their low parts (bytes 64-127); `part` 0 or 1.
__device__ __forceinline__ uint32_t kmajor_split16_offset(int row, int k, uint32_t sbo, int part) {
  return uint32_t(row >> 3) * sbo + uint32_t(k >> 5) * 1024u + uint32_t(row & 7) * 128u +
         uint32_t(((((k & 31) >> 3) + 4 * part) ^ (row & 7)) << 4) + uint32_t(k & 7) * 2u;
}

// One k16 step of a float16 split product, both operands in shared memory: part += a_lo·b_hi +
// a_hi·b_lo + a_hi·b_hi with three terms, a_hi·b_hi alone with one (the low parts unread); the
// step's first MMA starts from zero where kk == 0 (each chunk's products in a fresh accumulator).
template <int kTerms>
__device__ __forceinline__ void wgmma_split_m64n128k16(float (&part)[64], uint64_t a_hi, uint64_t a_lo, uint64_t b_hi,
                                                       uint64_t b_lo, int kk) {
  if constexpr (kTerms == 3) {
    wgmma_m64n128k16_f16(part, a_lo, b_hi, kk);
    wgmma_m64n128k16_f16(part, a_hi, b_lo, 1);
  }
  wgmma_m64n128k16_f16(part, a_hi, b_hi, kTerms == 3 ? 1 : kk);
}
template <int kTerms, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_split_m64n64k16(float (&part)[32], uint64_t a_hi, uint64_t a_lo, uint64_t b_hi,
                                                      uint64_t b_lo, int kk) {
  if constexpr (kTerms == 3) {
    wgmma_m64n64k16_f16<kTransA, kTransB>(part, a_lo, b_hi, kk);
    wgmma_m64n64k16_f16<kTransA, kTransB>(part, a_hi, b_lo, 1);
  }
  wgmma_m64n64k16_f16<kTransA, kTransB>(part, a_hi, b_hi, kTerms == 3 ? 1 : kk);
}

// x = hi + lo in float16 (x already scaled into float16's range): hi rounded to nearest, lo the
// rest rounded to nearest, two pairs packed as half2 (first value in the low half).
__device__ __forceinline__ void split_f16x2(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  const __half2 h = __floats2half2_rn(x0, x1);
  const float2 hf = __half22float2(h);
  const __half2 l = __floats2half2_rn(x0 - hf.x, x1 - hf.y);
  hi = *reinterpret_cast<const uint32_t*>(&h);
  lo = *reinterpret_cast<const uint32_t*>(&l);
}

// Position of element (h1, h2) of an H x H outer product (H = 8·hb) along k in the 16-bit
// kernel's O and W operands of phase 2: 8 x 8 blocks of (h1, h2) in the order (h1 / 8, h2 / 8),
// each one 64-wide swizzle group, h1 % 8 selecting its 16-byte piece and h2 % 8 the element.
__device__ __forceinline__ int o_k_order(int h1, int h2, int hb) {
  return (((h1 >> 3) * hb + (h2 >> 3)) << 6) + ((h1 & 7) << 3) + (h2 & 7);
}

// p rounded up to the next 1 KB boundary of the shared address space: the 128-byte swizzle
// follows address bits 4-9, so swizzled tiles start at such a boundary.
__device__ __forceinline__ char* align_smem_1k(char* p) {
  return p + ((1024 - (static_cast<uint32_t>(__cvta_generic_to_shared(p)) & 1023)) & 1023);
}

// Byte offset of 16-bit element (row, k) in a 128-byte-swizzled K-major tile whose 8-row groups
// lie sbo bytes apart and whose 64-wide k groups lie 1 KB apart (the atom of rows 8r .. 8r+7).
__device__ __forceinline__ uint32_t kmajor_sw128_offset(int row, int k, uint32_t sbo) {
  return uint32_t(row >> 3) * sbo + uint32_t(k >> 6) * 1024u + uint32_t(row & 7) * 128u +
         uint32_t((((k & 63) >> 3) ^ (row & 7)) << 4) + uint32_t(k & 7) * 2u;
}

}  // namespace flashopm
