// What the MMA-rate programs (wgmma_rate.cu, smem_contention.cu) share: 16-bit warpgroup MMAs of
// each width with A from shared memory (mma_ss) or registers (mma_rs), a group of them with one
// group left in flight as the kernels do (mma_group), resident operands' fill, and the device line.
#pragma once
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

// kPerGroup MMAs of width N a group, cycling over kB B operands (each with kB·N / 2 accumulators
// of its own, as each column tile's) and four k steps of 16; then the commit and the wait for the
// group before.  kRS: A from registers (a) rather than from da.
template <int N, int kPerGroup, bool kRS, int kB>
__device__ __forceinline__ void mma_group(float* acc, uint64_t da, uint64_t db0, const uint32_t (&a)[4]) {
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

// Warpgroup wg's iters groups on resident operands (A: its 8 KB at wg·8 KB; B: kB operands of N
// rows from a_bytes), accumulators from zero; the clocks they took.  (The sums go to sink only
// on a value they never take, so that the MMAs are not dropped.)
template <int N, int kPerGroup, bool kRS, int kB>
__device__ __forceinline__ long long timed_groups(unsigned char* smem, int a_bytes, int wg, int iters,
                                                  const uint32_t (&a)[4], float* sink) {
  float acc[kB * N / 2];
#pragma unroll
  for (int e = 0; e < kB * N / 2; ++e) acc[e] = 0.f;
  const uint64_t da = fo::wgmma_desc(smem + wg * 8192, 16, 1024);
  const uint64_t db0 = fo::wgmma_desc(smem + a_bytes, 16, 1024);
  const long long t0 = clock64();
  for (int it = 0; it < iters; ++it) mma_group<N, kPerGroup, kRS, kB>(acc, da, db0, a);
  fo::wgmma_wait<0>();
  const long long t1 = clock64();
  float s = 0.f;
#pragma unroll
  for (int e = 0; e < kB * N / 2; ++e) s += acc[e];
  if (s == 1234.5f) sink[threadIdx.x] = s;
  return t1 - t0;
}

// The first `bytes` of shared memory as small 16-bit values, visible to the tensor cores.
__device__ __forceinline__ void fill_operands(unsigned char* smem, int bytes) {
  for (int i = threadIdx.x; i < bytes / 2; i += blockDim.x)
    reinterpret_cast<__nv_bfloat16*>(smem)[i] = __float2bfloat16(0.001f * float((i * 7) % 13));
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// The device's name and SM count, printed; the count returned.
inline int print_device() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  printf("%s, %d SMs\n", prop.name, sms);
  return sms;
}

// launch(n) runs the kernel for n iterations: once warm (100), once timed (iters); false, and a
// line saying why, where it failed.
template <typename Launch>
bool warm_then_timed(const char* what, Launch launch, int iters) {
  launch(100);
  launch(iters);
  const cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) printf("%-44s error %s\n", what, cudaGetErrorString(e));
  return e == cudaSuccess;
}

constexpr int kTimedIters = 4000;  // a timed launch's iterations

// A run's device buffers, freed with it: `n` counters its kernel writes, read back by read(), and
// the sink its MMAs' sums go to.
struct RunBuffers {
  long long* out = nullptr;
  float* sink = nullptr;
  int n = 0;
  explicit RunBuffers(int n_out) : n(n_out) {
    cudaMalloc(&out, n * sizeof(long long));
    cudaMalloc(&sink, 512 * sizeof(float));
  }
  RunBuffers(const RunBuffers&) = delete;
  RunBuffers& operator=(const RunBuffers&) = delete;
  ~RunBuffers() {
    cudaFree(out);
    cudaFree(sink);
  }
  std::vector<long long> read() const {
    std::vector<long long> h(n);
    cudaMemcpy(h.data(), out, h.size() * sizeof(long long), cudaMemcpyDeviceToHost);
    return h;
  }
};
