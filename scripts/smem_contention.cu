// How much the tensor cores' rate on shared-memory operands falls while bulk copies write into the
// same shared memory, as W's chunks do in the 16-bit contraction's phase 2 (16 KB a chunk of 384
// MMA cycles) and the stages do in phase 1.  One block an SM: kWgs warpgroups issue groups of
// kPerGroup m64nNk16 MMAs (one group in flight, as the kernel does), operands resident; one more
// warp's lane issues 16 KB copies from a global buffer that stays in L2 into two buffers of their
// own, one copy every `period` cycles (0: each as soon as its buffer's last copy has landed).
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I src/flashopm/csrc \
//        -o /tmp/smem_contention scripts/smem_contention.cu && /tmp/smem_contention
//
// Prints, per variant and period, the MMAs' MACs a clock an SM against 2048 (dense bfloat16 on
// sm_90) and the copies' bytes a clock an SM.
#include <vector>

#include "opm_kernels.cuh"
#include "wgmma_bench.cuh"

constexpr int kCopyBytes = 16384;

// kB: the B operands a group cycles over (each with accumulators of its own)
template <int N, int kWgs, int kPerGroup, int kB>
__global__ void __launch_bounds__(128 * kWgs + 32, 1)
    contention_kernel(long long* out, float* sink, const unsigned char* src, int iters, int period) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900  // (the mbarrier and copy helpers are device-only)
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const int a_bytes = kWgs * 8192, b_bytes = kB * N * 128;
  unsigned char* copy_buf = smem + a_bytes + b_bytes;                              // two of kCopyBytes
  uint64_t* bars = reinterpret_cast<uint64_t*>(copy_buf + 2 * kCopyBytes);         // one a buffer
  volatile int* done = reinterpret_cast<volatile int*>(bars + 2);                  // warpgroups finished
  fill_operands(smem, a_bytes + b_bytes);
  if (threadIdx.x == 0) {
    fo::mbarrier_init(bars, 1);
    fo::mbarrier_init(bars + 1, 1);
    *done = 0;
  }
  __syncthreads();
  const int wg = threadIdx.x / 128;
  if (wg == kWgs) {
    // the copier: lane 0 of the first warp past the MMAs' warpgroups
    if (threadIdx.x != 128 * kWgs) return;
    long long copies = 0;
    const long long t0 = clock64();
    long long t_last = t0;
    while (period >= 0 && *done < kWgs) {
      const int buf = int(copies & 1);
      if (copies >= 2) fo::mbarrier_wait_parity(bars + buf, unsigned((copies / 2 - 1) & 1));
      if (period > 0)
        while (clock64() < t0 + copies * period) {
        }
      fo::mbarrier_arrive_expect_tx(bars + buf, kCopyBytes);
      fo::bulk_copy_g2s(copy_buf + buf * kCopyBytes, src, kCopyBytes, bars + buf);
      ++copies;
      t_last = clock64();
    }
    for (long long c = copies > 2 ? copies - 2 : 0; c < copies; ++c)  // the copies still in flight
      fo::mbarrier_wait_parity(bars + int(c & 1), unsigned((c / 2) & 1));
    out[gridDim.x * 4 + blockIdx.x * 2] = copies;
    out[gridDim.x * 4 + blockIdx.x * 2 + 1] = t_last - t0;
    return;
  }
  const uint32_t a_regs[4] = {};
  const long long took = timed_groups<N, kPerGroup, false, kB>(smem, a_bytes, wg, iters, a_regs, sink);
  if ((threadIdx.x & 127) == 0) {
    out[blockIdx.x * 4 + wg] = took;
    atomicAdd(const_cast<int*>(done), 1);
  }
#endif
}

template <int N, int kWgs, int kPerGroup, int kB>
void run(const char* what, int sms, const unsigned char* src, int period) {
  auto k = contention_kernel<N, kWgs, kPerGroup, kB>;
  const int smem = kWgs * 8192 + kB * N * 128 + 2 * kCopyBytes + 64 + 1024;
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  RunBuffers buf(sms * 6);
  const int iters = kTimedIters;
  if (!warm_then_timed(what, [&](int n) { k<<<sms, 128 * kWgs + 32, smem>>>(buf.out, buf.sink, src, n, period); },
                       iters))
    return;
  const std::vector<long long> h = buf.read();
  double mean = 0, copy_rate = 0;
  for (int b = 0; b < sms; ++b) {
    for (int w = 0; w < kWgs; ++w) mean += double(h[b * 4 + w]) / (sms * kWgs);
    const long long copies = h[sms * 4 + b * 2], span = h[sms * 4 + b * 2 + 1];
    if (span > 0) copy_rate += double(copies) * kCopyBytes / double(span) / sms;
  }
  const double macs = double(iters) * kPerGroup * 64.0 * N * 16.0 * kWgs;  // per SM
  printf("%-40s period %5d  %6.1f%% of 2048 MACs/clk  copies %5.1f B/clk  (%.0f clk a group a warpgroup)\n", what,
         period, 100.0 * macs / mean / 2048.0, copy_rate, mean / iters);
}

int main() {
  const int sms = print_device();
  unsigned char* src;
  cudaMalloc(&src, kCopyBytes);
  cudaMemset(src, 0, kCopyBytes);
  // phase 2's chunk: two warpgroups' four m64n96k16 = 384 MMA cycles, 16 KB of W's copies in it;
  // phase 1's k steps of 2 x m64n128k16, on two warpgroups (three and the copier's warp would
  // leave 128 registers a thread: the registers go to warps in fours)
  const int periods[] = {-1, 1536, 768, 384, 256, 0};
  for (int p : periods) run<96, 2, 4, 1>("phase 2: m64n96, 2 WGs, 4 a group", sms, src, p);
  for (int p : periods) run<128, 2, 4, 2>("phase 1: 2 x m64n128, 2 WGs", sms, src, p);
  cudaFree(src);
  return 0;
}
