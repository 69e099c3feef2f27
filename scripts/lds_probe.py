"""Cycles per 16-byte shared-memory load (LDS.128) for the lane patterns of the small-problem
path's phase P, before a lane layout is chosen on a model of the hardware (NOTES.md, run 120:
P is bound by shared-memory wavefronts).

Every SM runs 16 warps that issue independent LDS.128 from one pattern of float offsets per lane
(the same pattern each step, moved by whole 128-byte rows so that the banks stay the same); the
script prints the SM cycles per warp-instruction, which is the number of wavefronts each takes
when the shared-memory pipe is the limit.  Patterns (q = lane / 8, r = lane % 8):

    a, 8 groups repeated per quarter     4 (lane % 8)                   (phase P's a today)
    W, one row per quarter               12 q                           (phase P's W today)
    a, 2 groups per quarter              4 (2q + r % 2)                 (branch p-lane-blocks)
    W, 4 rows per quarter, quads q       12 (4 q + r / 2)               (branch p-lane-blocks, j = 0)
    32 distinct, contiguous              4 lane
    16 distinct, halves repeated         4 (lane % 16)
    one address                          0

    python scripts/lds_probe.py        (needs nvcc with sm_90a and an sm_90 GPU)
"""
import os

import torch
from torch.utils.cpp_extension import load_inline

PATTERNS = [
    ("a, 8 groups repeated per quarter", "4 * (lane % 8)"),
    ("W, one row per quarter", "12 * q"),
    ("a, 2 groups per quarter", "4 * (2 * q + r % 2)"),
    ("W, 4 rows per quarter (quads q)", "12 * (4 * q + r / 2)"),
    ("32 distinct, contiguous", "4 * lane"),
    ("16 distinct, halves repeated", "4 * (lane % 16)"),
    ("one address", "0"),
]

CUDA = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>

namespace {

constexpr int kFloats = 8192;  // 32 KB of shared memory
constexpr int kUnroll = 8;     // independent loads in flight per warp

__device__ __forceinline__ int pattern_offset(int which, int lane) {
  const int q = lane / 8, r = lane % 8;
  (void)q, (void)r;
  switch (which) {
PATTERN_CASES
  }
  return 0;
}

// Thread 0 of each block records the SM clock around iters rounds of kUnroll loads per warp.
__global__ void __launch_bounds__(512) lds_kernel(int which, int iters, float* sink, long long* cycles) {
  __shared__ float4 buf4[kFloats / 4];
  float* buf = reinterpret_cast<float*>(buf4);
  for (int i = threadIdx.x; i < kFloats; i += blockDim.x) buf[i] = float(i);
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int base = pattern_offset(which, lane);
  // Addresses fixed outside the loop, loads with no arithmetic on their results inside it: the
  // loop issues nothing else that could limit it before the pipe does.  The loads are volatile in
  // the PTX itself: ptxas drops plain loads whose values are overwritten unread (an `asm
  // volatile` statement binds only the compiler before it; run 123 measured 0.02 cycles so).
  unsigned addr[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u)  // whole 128-byte rows apart: the same banks for every u
    addr[u] = unsigned(__cvta_generic_to_shared(buf + (base + 128 * ((u + warp) % 32)) % kFloats));
  float4 v[kUnroll];
  long long t0 = clock64();
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      asm volatile("ld.volatile.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                   : "=f"(v[u].x), "=f"(v[u].y), "=f"(v[u].z), "=f"(v[u].w)
                   : "r"(addr[u]));
  }
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) acc.x += v[u].x, acc.y += v[u].y, acc.z += v[u].z, acc.w += v[u].w;
  __syncthreads();
  long long t1 = clock64();
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
  sink[blockIdx.x * blockDim.x + threadIdx.x] = acc.x + acc.y + acc.z + acc.w;
}

}  // namespace

void run_lds(int64_t which, int64_t blocks, int64_t iters, const at::Tensor& sink, const at::Tensor& cycles) {
  lds_kernel<<<blocks, 512, 0, c10::cuda::getCurrentCUDAStream()>>>(int(which), int(iters), sink.data_ptr<float>(),
                                                                    reinterpret_cast<long long*>(cycles.data_ptr<int64_t>()));
}
"""

CPP = "void run_lds(int64_t which, int64_t blocks, int64_t iters, const at::Tensor& sink, const at::Tensor& cycles);"


def main() -> None:
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")
    cases = "\n".join(f"    case {i}: return {expr};" for i, (_, expr) in enumerate(PATTERNS))
    ext = load_inline("flashopm_lds_probe", cpp_sources=CPP, cuda_sources=CUDA.replace("PATTERN_CASES", cases),
                      functions=["run_lds"], extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a"])
    if not torch.cuda.is_available():
        print("built; no GPU here")
        return
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    blocks, iters, warps, unroll = sms, 2048, 16, 8
    sink = torch.empty(blocks * 512, device="cuda")
    cycles = torch.empty(blocks, dtype=torch.int64, device="cuda")
    print(f"{torch.cuda.get_device_name()}: SM cycles per LDS.128 per warp (16 warps per SM, {unroll} loads in flight)")
    for which, (name, expr) in enumerate(PATTERNS):
        ext.run_lds(which, blocks, 16, sink, cycles)  # warm-up
        ext.run_lds(which, blocks, iters, sink, cycles)
        torch.cuda.synchronize()
        per = cycles.double().median().item() / (iters * unroll * warps)
        print(f"  {name:36s} offset {expr:22s} {per:5.2f}")


if __name__ == "__main__":
    main()
