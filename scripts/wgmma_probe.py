"""Checks, on an sm_90 GPU, which shared-memory layout and descriptor fields wgmma reads for
16-bit operands stored MN-major (a and b of the outer-first contraction are (s, h)-major, so
phase 1's A and B are both MN-major), before a kernel is built on it.

One warpgroup computes D (64 x 128, float32) = A (64 x 16) · B (16 x 128) with one
wgmma.m64n128k16.f32.bf16.bf16, A and B in the 128-byte-swizzled MN-major layout:
  element (k, x) of an operand at  group(x / 64) · LBO + (k / 8) · SBO + (k % 8) · 128
                                   + ((x % 64 / 8) ^ (k % 8)) · 16 + (x % 8) · 2   bytes,
i.e. rows of 64 consecutive x (128 bytes) per k, 8 rows to a 1 KB swizzle atom.  Both roles of
the two byte offsets are tried for MN-major (B has two 64-wide groups along n, so they differ),
and the K-major layout with rows of m or n; the script prints the error of each against
torch.matmul and which ones are exact (MN-major with both flags set, K-major with neither).

    python scripts/wgmma_probe.py        (needs nvcc with sm_90a and an sm_90 GPU)
"""
import os

import torch
from torch.utils.cpp_extension import load_inline

CUDA = r"""
#include <cuda_bf16.h>
#include <cstdint>
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>

namespace {

__device__ uint64_t smem_desc(const void* p, uint32_t lbo, uint32_t sbo) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  uint64_t d = 0;
  d |= uint64_t((addr >> 4) & 0x3fff);
  d |= uint64_t((lbo >> 4) & 0x3fff) << 16;
  d |= uint64_t((sbo >> 4) & 0x3fff) << 32;
  d |= uint64_t(1) << 62;  // 128-byte swizzle
  return d;
}

__device__ uint32_t swizzled(int k, int x, uint32_t lbo, uint32_t sbo) {
  return (x / 64) * lbo + (k / 8) * sbo + (k % 8) * 128 + (((x % 64) / 8) ^ (k % 8)) * 16 + (x % 8) * 2;
}

template <int kTransA, int kTransB>
__global__ void probe(const __nv_bfloat16* A, const __nv_bfloat16* B, float* D, uint32_t a_lbo, uint32_t a_sbo,
                      uint32_t b_lbo, uint32_t b_sbo, int a_mn_major, int b_mn_major) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __shared__ __align__(1024) unsigned char sa[8192];
  __shared__ __align__(1024) unsigned char sb[16384];
  const int tid = threadIdx.x;
  // A (64 m x 16 k) from global [k][m]; B (16 k x 128 n) from global [k][n].
  for (int e = tid; e < 64 * 16; e += 128) {
    const int k = e / 64, m = e % 64;
    const uint32_t off = a_mn_major ? swizzled(k, m, a_lbo, a_sbo) : swizzled(m, k, a_lbo, a_sbo);
    *reinterpret_cast<__nv_bfloat16*>(sa + off) = A[k * 64 + m];
  }
  for (int e = tid; e < 16 * 128; e += 128) {
    const int k = e / 128, n = e % 128;
    const uint32_t off = b_mn_major ? swizzled(k, n, b_lbo, b_sbo) : swizzled(n, k, b_lbo, b_sbo);
    *reinterpret_cast<__nv_bfloat16*>(sb + off) = B[k * 128 + n];
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  const uint64_t da = smem_desc(sa, a_lbo, a_sbo), db = smem_desc(sb, b_lbo, b_sbo);
  float d[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) d[i] = 0.f;
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, 0, 0;\n"  // scale-d false: D = A·B
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{@REGS@}, "
      "%64, %65, p, 1, 1, %66, %67;\n"
      "}\n"
      : @OUTS@
      : "l"(da), "l"(db), "n"(kTransA), "n"(kTransB));
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  // Accumulator layout: warp w holds rows 16w + lane/4 (+8); n tile j holds columns 8j + 2(lane%4) (+1).
  const int w = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int row = 16 * w + g, col = 8 * j + 2 * t;
    D[row * 128 + col] = d[4 * j];
    D[row * 128 + col + 1] = d[4 * j + 1];
    D[(row + 8) * 128 + col] = d[4 * j + 2];
    D[(row + 8) * 128 + col + 1] = d[4 * j + 3];
  }
#endif
}

}  // namespace

torch::Tensor run(torch::Tensor A, torch::Tensor B, int64_t trans_a, int64_t trans_b, int64_t a_lbo, int64_t a_sbo,
                  int64_t b_lbo, int64_t b_sbo, int64_t a_mn, int64_t b_mn) {
  auto D = torch::full({64, 128}, std::nan(""), A.options().dtype(torch::kFloat));
  auto s = c10::cuda::getCurrentCUDAStream().stream();
  auto a = reinterpret_cast<const __nv_bfloat16*>(A.data_ptr());
  auto b = reinterpret_cast<const __nv_bfloat16*>(B.data_ptr());
  const uint32_t al = a_lbo, as = a_sbo, bl = b_lbo, bs = b_sbo;
  const int am = a_mn, bm = b_mn;
  if (trans_a && trans_b) probe<1, 1><<<1, 128, 0, s>>>(a, b, D.data_ptr<float>(), al, as, bl, bs, am, bm);
  else if (trans_a) probe<1, 0><<<1, 128, 0, s>>>(a, b, D.data_ptr<float>(), al, as, bl, bs, am, bm);
  else if (trans_b) probe<0, 1><<<1, 128, 0, s>>>(a, b, D.data_ptr<float>(), al, as, bl, bs, am, bm);
  else probe<0, 0><<<1, 128, 0, s>>>(a, b, D.data_ptr<float>(), al, as, bl, bs, am, bm);
  return D;
}
"""

# the asm's 64 accumulator operands
CUDA = CUDA.replace("@REGS@", ", ".join(f"%{i}" for i in range(64))).replace(
    "@OUTS@", ", ".join(f'"+f"(d[{i}])' for i in range(64)))

CPP = "torch::Tensor run(torch::Tensor A, torch::Tensor B, int64_t trans_a, int64_t trans_b, int64_t a_lbo, " \
      "int64_t a_sbo, int64_t b_lbo, int64_t b_sbo, int64_t a_mn, int64_t b_mn);"


def main() -> None:
    os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0a"  # wgmma exists only in the arch-specific target
    ext = load_inline("wgmma_probe", CPP, cuda_sources=CUDA, functions=["run"], extra_cuda_cflags=["-O2"])
    torch.manual_seed(0)
    # small integers: every product and sum exact in bfloat16 -> float32
    A = torch.randint(-4, 5, (16, 64), device="cuda").to(torch.bfloat16)    # [k][m]
    B = torch.randint(-4, 5, (16, 128), device="cuda").to(torch.bfloat16)   # [k][n]
    ref = (A.float().t() @ B.float())                                        # (64, 128)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("trans_a trans_b  A: layout LBO SBO | B: layout LBO SBO  max|err|")
    exact = []
    # A: one 64-wide group along m, two 8-row groups along k; B: two 64-wide groups along n.
    # MN-major: the 8-k groups 1 KB apart, B's n groups 2 KB apart; K-major (the transpose of the
    # same bytes' roles): rows are m or n, 16 k = 32 bytes of a 128-byte row.
    layouts = {
        "mn": [(1024, 1024, 2048, 1024), (1024, 1024, 1024, 2048)],
        "k": [(16, 1024, 16, 1024)],
    }
    # The transpose flags that match each layout (1: MN-major, 0: K-major); a wrong flag makes the
    # hardware walk K-major rows past these buffers (an illegal address), so it is not tried.
    for major, (ta, tb) in (("mn", (1, 1)), ("k", (0, 0))):
        for a_lbo, a_sbo, b_lbo, b_sbo in layouts[major]:
            mn = 1 if major == "mn" else 0
            D = ext.run(A, B, ta, tb, a_lbo, a_sbo, b_lbo, b_sbo, mn, mn)
            torch.cuda.synchronize()
            err = (D - ref).abs().max().item()
            tag = "  EXACT" if err == 0 else ""
            print(f"{ta:7d} {tb:7d}  {major:>9s} {a_lbo:4d} {a_sbo:4d} | {major:>9s} {b_lbo:4d} {b_sbo:4d}  {err:9.3g}{tag}")
            if err == 0:
                exact.append((ta, tb, major, a_lbo, a_sbo, b_lbo, b_sbo))
    print("exact:", exact if exact else "none")


if __name__ == "__main__":
    main()
