// Warp-level tensor-core primitives shared by the kernels: mma.sync m16n8k8 with TF32 operands
// and float32 accumulation, the hi/lo split that gives float32 accuracy (3xTF32), and
// mma.sync m16n8k16 with bfloat16 or float16 operands fed by ldmatrix.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace flashopm {

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

}  // namespace flashopm
