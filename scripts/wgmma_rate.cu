// The tensor cores' rate for 16-bit warpgroup MMAs of each width N the 16-bit contraction uses, with
// operands resident in shared memory (no copies, no barriers): what a phase built on m64nNk16 can
// reach at best.  One block an SM, kWgs warpgroups each issuing groups of kPerGroup MMAs (one
// group in flight, as the kernel does), A (64 x 16, K-major) from shared memory or from registers.
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I src/flashopm/csrc \
//        -o /tmp/wgmma_rate scripts/wgmma_rate.cu && /tmp/wgmma_rate
//
// Prints, per variant, MACs a clock an SM against 2048 (dense bfloat16 on sm_90).
#include <vector>

#include "wgmma_bench.cuh"

// kB: the B operands each group cycles over (two: the wide forms' two column tiles, each its own
// MMA); N: each MMA's width
template <int N, int kWgs, int kPerGroup, bool kRS, int kB>
__global__ void __launch_bounds__(384, 1) rate_kernel(long long* cycles, float* sink, int iters) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const int a_bytes = kWgs * 8192, b_bytes = kB * N * 128;
  fill_operands(smem, a_bytes + b_bytes);
  __syncthreads();
  const int wg = threadIdx.x / 128;
  if (wg >= kWgs) return;
  const uint32_t a[4] = {0x3c003c00u, 0x3c003c00u, 0x3c003c00u, 0x3c003c00u};
  const long long took = timed_groups<N, kPerGroup, kRS, kB>(smem, a_bytes, wg, iters, a, sink);
  if ((threadIdx.x & 127) == 0) cycles[blockIdx.x * 3 + wg] = took;
}

template <int N, int kWgs, int kPerGroup, bool kRS, int kB>
void run(const char* what, int sms) {
  auto k = rate_kernel<N, kWgs, kPerGroup, kRS, kB>;
  const int smem = kWgs * 8192 + kB * N * 128 + 1024;
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  RunBuffers buf(sms * 3);
  const int iters = kTimedIters;
  if (!warm_then_timed(what, [&](int n) { k<<<sms, 128 * kWgs, smem>>>(buf.out, buf.sink, n); }, iters)) return;
  const std::vector<long long> h = buf.read();
  long long mx = 0;
  double mean = 0;
  for (int b = 0; b < sms; ++b)
    for (int w = 0; w < kWgs; ++w) {
      mx = h[b * 3 + w] > mx ? h[b * 3 + w] : mx;
      mean += double(h[b * 3 + w]) / (sms * kWgs);
    }
  const double macs = double(iters) * kPerGroup * 64.0 * N * 16.0 * kWgs;  // per SM
  printf("%-44s N %3d wgs %d mmas/group %2d %s  %7.0f MACs/clk/SM  %5.1f%% of 2048  (%.0f clk a group a warpgroup)\n", what, N,
         kWgs, kPerGroup, kRS ? "RS" : "SS", macs / mean, 100.0 * macs / mean / 2048.0, mean / iters);
}

int main() {
  const int sms = print_device();
  run<128, 3, 4, false, 2>("wide phase 1 (2 x m64n128 a k step, 3 WGs)", sms);
  run<128, 2, 4, false, 2>("the same on 2 WGs", sms);
  run<48, 2, 8, false, 2>("wide phase 2 (2 x m64n48, 2 WGs)", sms);
  run<48, 2, 8, true, 2>("wide phase 2, A from registers", sms);
  run<48, 3, 8, false, 2>("wide phase 2 shape on 3 WGs", sms);
  run<48, 2, 16, false, 2>("wide phase 2, 16 MMAs a group", sms);
  run<64, 2, 4, false, 1>("two-WG phase 2 (m64n64, 2 WGs)", sms);
  run<64, 2, 8, false, 1>("two-WG phase 2, 8 MMAs a group", sms);
  run<96, 2, 4, false, 1>("m64n96 (both column tiles), 2 WGs", sms);
  run<96, 2, 8, false, 1>("m64n96, 8 MMAs a group", sms);
  run<96, 3, 4, false, 1>("m64n96 on 3 WGs", sms);
  run<96, 2, 4, true, 1>("m64n96, A from registers", sms);
  run<128, 2, 4, false, 1>("m64n128, 2 WGs", sms);
  run<192, 2, 4, false, 1>("m64n192, 2 WGs", sms);
  run<48, 1, 8, false, 2>("m64n48 on 1 WG", sms);
  run<96, 1, 4, false, 1>("m64n96 on 1 WG", sms);
  return 0;
}
