"""mma.sync rates on an sm_90 GPU against float32 FMAs, before a small-path form is built on them
(NOTES.md, "Sketch: the spec shape's phases on float16 split mma.sync").

Every SM runs warps that issue independent MMAs from registers: float16 m16n8k16 and TF32 m16n8k8
with float32 accumulators, with 1, 2, 4 and 8 accumulators per warp (chains), and float32 FFMA.
Prints multiply-adds per cycle per SM at the H200's clock, and the time of one dependent MMA
(one chain, one warp per SM).  A float16 split product (lo·hi + hi·lo + hi·hi) costs three MMAs.

    python scripts/mma_sync_probe.py        (needs nvcc with sm_90a and an sm_90 GPU)
"""
import os

import torch
from torch.utils.cpp_extension import load_inline

from dmma_probe import FFMA_RATE_CUDA

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src", "flashopm", "csrc")  # opm_mma.cuh

CUDA = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>

#include "opm_mma.cuh"

namespace {

// kChains independent accumulators per warp, iters MMAs each; kF16: m16n8k16 float16, else
// m16n8k8 TF32.  The sums are written so that nothing is optimised away.
template <int kChains, bool kF16>
__global__ void mma_rate_kernel(float* out, int iters, uint32_t seed) {
  uint32_t a[4], b[2];
  float d[kChains][4];
  for (int i = 0; i < 4; ++i) a[i] = (seed + i + threadIdx.x) & 0x3bff3bffu;
  for (int i = 0; i < 2; ++i) b[i] = (seed * 3 + i) & 0x3bff3bffu;
  for (int c = 0; c < kChains; ++c)
    for (int i = 0; i < 4; ++i) d[c][i] = 0.f;
  for (int it = 0; it < iters; ++it)
#pragma unroll
    for (int c = 0; c < kChains; ++c) {
      if constexpr (kF16) flashopm::mma_16bit<__half>(d[c], a, b[0], b[1]);
      else flashopm::mma_tf32(d[c], a, b[0], b[1]);
    }
  float s = 0.f;
  for (int c = 0; c < kChains; ++c) s += d[c][0] + d[c][1] + d[c][2] + d[c][3];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

""" + FFMA_RATE_CUDA + r"""
template <bool kF16>
void launch_mma(int chains, int blocks, int threads, int iters, float* out, cudaStream_t stream) {
  switch (chains) {
    case 1: mma_rate_kernel<1, kF16><<<blocks, threads, 0, stream>>>(out, iters, 7u); break;
    case 2: mma_rate_kernel<2, kF16><<<blocks, threads, 0, stream>>>(out, iters, 7u); break;
    case 4: mma_rate_kernel<4, kF16><<<blocks, threads, 0, stream>>>(out, iters, 7u); break;
    default: mma_rate_kernel<8, kF16><<<blocks, threads, 0, stream>>>(out, iters, 7u); break;
  }
}

}  // namespace

// which: 0 float16 MMA, 1 TF32 MMA, 2 FFMA
void run_rate(int64_t which, int64_t chains, int64_t blocks, int64_t threads, int64_t iters, const at::Tensor& out) {
  auto stream = c10::cuda::getCurrentCUDAStream();
  float* o = out.data_ptr<float>();
  if (which == 0) launch_mma<true>(int(chains), int(blocks), int(threads), int(iters), o, stream);
  else if (which == 1) launch_mma<false>(int(chains), int(blocks), int(threads), int(iters), o, stream);
  else ffma_rate_kernel<<<blocks, threads, 0, stream>>>(o, int(iters), 1.0f);
}
"""

CPP = "void run_rate(int64_t which, int64_t chains, int64_t blocks, int64_t threads, int64_t iters, const at::Tensor& out);"


def main() -> None:
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")
    ext = load_inline("flashopm_mma_sync_probe", cpp_sources=CPP, cuda_sources=CUDA, functions=["run_rate"],
                      extra_include_paths=[CSRC], extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a"])
    if not torch.cuda.is_available():
        print("built; no GPU here")
        return
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.empty(sms * 8 * 1024, dtype=torch.float32, device="cuda")
    clock_ghz = 1.98  # H200 boost; the rates below are per cycle at this clock
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; multiply-adds per cycle per SM at {clock_ghz} GHz")

    def rate(which, chains, blocks, threads, iters, macs_per_thread_iter):
        ext.run_rate(which, chains, blocks, threads, 16, out)  # warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        ext.run_rate(which, chains, blocks, threads, iters, out)
        end.record()
        torch.cuda.synchronize()
        seconds = start.elapsed_time(end) / 1e3
        return seconds, blocks * threads * iters * macs_per_thread_iter / seconds / (clock_ghz * 1e9) / sms

    for which, name, macs in ((0, "float16 m16n8k16", 16 * 8 * 16), (1, "TF32 m16n8k8", 16 * 8 * 8)):
        for warps in (4, 8, 16):
            for chains in (1, 2, 4, 8):
                _, r = rate(which, chains, sms, 32 * warps, 4096, chains * macs / 32)
                print(f"{name}: {warps:2d} warps per SM, {chains} chains per warp: {r:7.0f} multiply-adds per cycle per SM")
        seconds, _ = rate(which, 1, sms, 32, 4096, macs / 32)
        print(f"{name}: one dependent MMA takes {seconds / 4096 * clock_ghz * 1e9:.1f} cycles")
    _, r = rate(2, 0, sms * 4, 256, 4096, 16)
    print(f"FFMA: {r:.0f} multiply-adds per cycle per SM")


if __name__ == "__main__":
    main()
