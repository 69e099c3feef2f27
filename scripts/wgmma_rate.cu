// The tensor cores' rate for 16-bit warpgroup MMAs of each width N the 16-bit contraction uses, with
// operands resident in shared memory (no copies, no barriers): what a phase built on m64nNk16 can
// reach at best.  One block an SM, kWgs warpgroups each issuing groups of kPerGroup MMAs (one
// group in flight, as the kernel does), A (64 x 16, K-major) from shared memory or from registers.
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I src/flashopm/csrc \
//        -o /tmp/wgmma_rate scripts/wgmma_rate.cu && /tmp/wgmma_rate
//
// Prints, per variant, MACs a clock an SM against 2048 (dense bfloat16 on sm_90).
#include <cuda_bf16.h>
#include <cstdio>
#include <cstdint>
#include <vector>

#include "opm_mma.cuh"

namespace fo = flashopm;

// m64n48k16's 24 accumulators (the kernels no longer take that width); 48 from opm_mma.cuh
#define ACC_NAMES24 FLASHOPM_ACC_NAMES16 ", %16, %17, %18, %19, %20, %21, %22, %23"
#define ACC24(d) \
  FLASHOPM_ACC16(d, 0), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23])
#define ACC_NAMES96 \
  FLASHOPM_ACC_NAMES48 ", %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define ACC96(d) FLASHOPM_ACC64(d), FLASHOPM_ACC16(d, 64), FLASHOPM_ACC16(d, 80)

#define SS(SHAPE, NAMES, ACC, NA, NB) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned." SHAPE ".f32.bf16.bf16 {" NAMES "}, %" #NA ", %" #NB ", p, 1, 1, 0, 0;\n}\n" : ACC(d) : "l"(da), "l"(db))
#define RS(SHAPE, NAMES, ACC, N0, N1, N2, N3, NB) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned." SHAPE ".f32.bf16.bf16 {" NAMES "}, {%" #N0 ", %" #N1 ", %" #N2 ", %" #N3 "}, %" #NB ", p, 1, 1, 0;\n}\n" : ACC(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db))

template <int N>
__device__ __forceinline__ void mma_ss(float* d, uint64_t da, uint64_t db) {
  if constexpr (N == 48) SS("m64n48k16", ACC_NAMES24, ACC24, 24, 25);
  else if constexpr (N == 64) SS("m64n64k16", FLASHOPM_ACC_NAMES32, FLASHOPM_ACC32, 32, 33);
  else if constexpr (N == 96) SS("m64n96k16", FLASHOPM_ACC_NAMES48, FLASHOPM_ACC48, 48, 49);
  else if constexpr (N == 128) SS("m64n128k16", FLASHOPM_ACC_NAMES64, FLASHOPM_ACC64, 64, 65);
  else SS("m64n192k16", ACC_NAMES96, ACC96, 96, 97);
}
template <int N>
__device__ __forceinline__ void mma_rs(float* d, const uint32_t (&a)[4], uint64_t db) {
  if constexpr (N == 48) RS("m64n48k16", ACC_NAMES24, ACC24, 24, 25, 26, 27, 28);
  else if constexpr (N == 64) RS("m64n64k16", FLASHOPM_ACC_NAMES32, FLASHOPM_ACC32, 32, 33, 34, 35, 36);
  else if constexpr (N == 96) RS("m64n96k16", FLASHOPM_ACC_NAMES48, FLASHOPM_ACC48, 48, 49, 50, 51, 52);
  else if constexpr (N == 128) RS("m64n128k16", FLASHOPM_ACC_NAMES64, FLASHOPM_ACC64, 64, 65, 66, 67, 68);
  else RS("m64n192k16", ACC_NAMES96, ACC96, 96, 97, 98, 99, 100);
}

// kB: the B operands each group cycles over (two: the wide forms' two column tiles, each its own
// MMA); N: each MMA's width
template <int N, int kWgs, int kPerGroup, bool kRS, int kB>
__global__ void __launch_bounds__(384, 1) rate_kernel(long long* cycles, float* sink, int iters) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const int a_bytes = kWgs * 8192, b_bytes = kB * N * 128;
  for (int i = threadIdx.x; i < (a_bytes + b_bytes) / 2; i += blockDim.x)
    reinterpret_cast<__nv_bfloat16*>(smem)[i] = __float2bfloat16(0.001f * float((i * 7) % 13));
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  const int wg = threadIdx.x / 128;
  if (wg >= kWgs) return;
  float acc[kB * N / 2];  // each B operand its own accumulators, as each column tile's
#pragma unroll
  for (int e = 0; e < kB * N / 2; ++e) acc[e] = 0.f;
  const uint64_t da = fo::wgmma_desc(smem + wg * 8192, 16, 1024);
  const uint64_t db0 = fo::wgmma_desc(smem + a_bytes, 16, 1024);
  uint32_t a[4] = {0x3c003c00u, 0x3c003c00u, 0x3c003c00u, 0x3c003c00u};
  const long long t0 = clock64();
  for (int it = 0; it < iters; ++it) {
    fo::wgmma_fence();
#pragma unroll
    for (int g = 0; g < kPerGroup; ++g) {
      const uint64_t kk = uint64_t((g / kB) % 4) * 2;  // 32 bytes a k step, >> 4
      const uint64_t db = db0 + kk + uint64_t(g % kB) * (N * 128 >> 4);
      float* d = acc + (g % kB) * (N / 2);
      if constexpr (kRS) mma_rs<N>(d, a, db);
      else mma_ss<N>(d, da + kk, db);
    }
    fo::wgmma_commit();
    fo::wgmma_wait<1>();
  }
  fo::wgmma_wait<0>();
  const long long t1 = clock64();
  float s = 0.f;
#pragma unroll
  for (int e = 0; e < kB * N / 2; ++e) s += acc[e];
  if (s == 1234.5f) sink[threadIdx.x] = s;
  if ((threadIdx.x & 127) == 0) cycles[blockIdx.x * 3 + wg] = t1 - t0;
}

template <int N, int kWgs, int kPerGroup, bool kRS, int kB>
void run(const char* what, int sms) {
  auto k = rate_kernel<N, kWgs, kPerGroup, kRS, kB>;
  const int smem = kWgs * 8192 + kB * N * 128 + 1024;
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  long long* cyc;
  float* sink;
  cudaMalloc(&cyc, sms * 3 * sizeof(long long));
  cudaMalloc(&sink, 512 * sizeof(float));
  const int iters = 4000;
  k<<<sms, 128 * kWgs, smem>>>(cyc, sink, 100);  // warm
  k<<<sms, 128 * kWgs, smem>>>(cyc, sink, iters);
  cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    printf("%-44s error %s\n", what, cudaGetErrorString(e));
    return;
  }
  std::vector<long long> h(sms * 3);
  cudaMemcpy(h.data(), cyc, h.size() * sizeof(long long), cudaMemcpyDeviceToHost);
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
  cudaFree(cyc);
  cudaFree(sink);
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  printf("%s, %d SMs\n", prop.name, sms);
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
