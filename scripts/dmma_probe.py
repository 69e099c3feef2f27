"""Float64 tensor-core MMAs on an sm_90 GPU, before a kernel form is built on them
(NOTES.md, "Sketch: phases P and O of the spec shape on float64 tensor cores").

1. The fragment mapping of mma.sync.m16n8k16.row.col.f64 (g = lane / 4, t = lane % 4):
   A (16 x 16) a[v0 + 2 v1] = A[g + 8 v0][t + 4 v1];  B (16 x 8) b[v] = B[t + 4 v][g];
   C (16 x 8)  c[v0 + 2 v1] = C[g + 8 v1][2 t + v0].
   One warp multiplies random float32-valued matrices; the result must equal torch's float64
   product exactly up to float64 rounding.
2. Throughput: every SM runs warps that issue independent DMMA.16x8x16 from registers, and the
   same for float32 FFMA and for the float32 -> float64 conversion; the script prints the rates
   in multiply-adds (or conversions) per cycle per SM at the measured clock.

    python scripts/dmma_probe.py        (needs nvcc with sm_90a and an sm_90 GPU)
"""
import os

import torch
from torch.utils.cpp_extension import load_inline

# Float32 FFMA at 16 independent chains per thread, the pipe the tensor-core rates are set against
# (scripts/mma_sync_probe.py uses it too).
FFMA_RATE_CUDA = r"""
__global__ void ffma_rate_kernel(float* out, int iters, float seed) {
  float acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = seed + i;
  const float x = seed * 0.5f, y = 1.0001f;
  for (int it = 0; it < iters; ++it)
#pragma unroll
    for (int i = 0; i < 16; ++i) acc[i] = fmaf(acc[i], y, x);
  float s = 0;
  for (int i = 0; i < 16; ++i) s += acc[i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
"""

CUDA = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>

namespace {

__device__ __forceinline__ void dmma16816(double (&d)[4], const double (&a)[8], const double (&b)[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f64.f64.f64.f64 {%0,%1,%2,%3}, {%4,%5,%6,%7,%8,%9,%10,%11}, "
      "{%12,%13,%14,%15}, {%0,%1,%2,%3};\n"
      : "+d"(d[0]), "+d"(d[1]), "+d"(d[2]), "+d"(d[3])
      : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(a[4]), "d"(a[5]), "d"(a[6]), "d"(a[7]),
        "d"(b[0]), "d"(b[1]), "d"(b[2]), "d"(b[3]));
}

// A row-major (16 x 16), B row-major (16 x 8), C row-major (16 x 8).
__global__ void mapping_kernel(const double* A, const double* B, double* C) {
  const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
  double a[8], b[4], c[4] = {0, 0, 0, 0};
  for (int v0 = 0; v0 < 2; ++v0)
    for (int v1 = 0; v1 < 4; ++v1) a[v0 + 2 * v1] = A[(g + 8 * v0) * 16 + t + 4 * v1];
  for (int v = 0; v < 4; ++v) b[v] = B[(t + 4 * v) * 8 + g];
  dmma16816(c, a, b);
  for (int v0 = 0; v0 < 2; ++v0)
    for (int v1 = 0; v1 < 2; ++v1) C[(g + 8 * v1) * 8 + 2 * t + v0] = c[v0 + 2 * v1];
}

// kChains independent accumulators per warp, iters DMMAs each; the sum is written so that
// nothing is optimised away.
template <int kChains>
__global__ void dmma_rate_kernel(double* out, int iters, double seed) {
  double a[8], b[4], d[kChains][4];
  for (int i = 0; i < 8; ++i) a[i] = seed + i + threadIdx.x;
  for (int i = 0; i < 4; ++i) b[i] = seed - i;
  for (int c = 0; c < kChains; ++c)
    for (int i = 0; i < 4; ++i) d[c][i] = 0;
  for (int it = 0; it < iters; ++it)
#pragma unroll
    for (int c = 0; c < kChains; ++c) dmma16816(d[c], a, b);
  double s = 0;
  for (int c = 0; c < kChains; ++c) s += d[c][0] + d[c][1] + d[c][2] + d[c][3];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

""" + FFMA_RATE_CUDA + r"""
__global__ void cvt_rate_kernel(double* out, int iters, float seed) {
  float v[8];
  double s[8];
  for (int i = 0; i < 8; ++i) v[i] = seed + i + threadIdx.x, s[i] = 0;
  for (int it = 0; it < iters; ++it)
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      s[i] += double(v[i]);  // one conversion and one float64 add per element
      v[i] = __int_as_float(__float_as_int(v[i]) ^ 1);
    }
  double r = 0;
  for (int i = 0; i < 8; ++i) r += s[i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = r;
}

}  // namespace

at::Tensor dmma_mapping(const at::Tensor& A, const at::Tensor& B) {
  at::Tensor C = at::full({16, 8}, std::nan(""), A.options());
  mapping_kernel<<<1, 32, 0, c10::cuda::getCurrentCUDAStream()>>>(A.data_ptr<double>(), B.data_ptr<double>(),
                                                                  C.data_ptr<double>());
  return C;
}

void run_rate(int64_t which, int64_t blocks, int64_t threads, int64_t iters, const at::Tensor& out) {
  auto stream = c10::cuda::getCurrentCUDAStream();
  if (which == 0)
    dmma_rate_kernel<4><<<blocks, threads, 0, stream>>>(out.data_ptr<double>(), int(iters), 1.0);
  else if (which == 1)
    ffma_rate_kernel<<<blocks, threads, 0, stream>>>(reinterpret_cast<float*>(out.data_ptr<double>()), int(iters), 1.0f);
  else
    cvt_rate_kernel<<<blocks, threads, 0, stream>>>(out.data_ptr<double>(), int(iters), 1.0f);
}
"""

CPP = """
at::Tensor dmma_mapping(const at::Tensor& A, const at::Tensor& B);
void run_rate(int64_t which, int64_t blocks, int64_t threads, int64_t iters, const at::Tensor& out);
"""


def main() -> None:
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")
    ext = load_inline("flashopm_dmma_probe", cpp_sources=CPP, cuda_sources=CUDA, functions=["dmma_mapping", "run_rate"],
                      extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a"])
    if not torch.cuda.is_available():
        print("built; no GPU here")
        return
    torch.manual_seed(0)
    A = torch.randn(16, 16, dtype=torch.float32).double().cuda()
    B = torch.randn(16, 8, dtype=torch.float32).double().cuda()
    C = ext.dmma_mapping(A, B)
    ref = A @ B
    err = ((C - ref).abs().max() / ref.abs().max()).item()
    print(f"fragment mapping: max relative error {err:.2e} ({'exact to float64' if err < 1e-14 else 'WRONG'})")

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.empty(sms * 8 * 1024, dtype=torch.float64, device="cuda")
    clock_ghz = 1.98  # H200 boost; the rates below are per cycle at this clock
    for which, name, threads, per_thread_iter in ((0, "DMMA.16x8x16 multiply-adds", 256, 4 * 2048 / 32),
                                                  (1, "FFMA multiply-adds", 256, 16),
                                                  (2, "F2F.F64.F32 conversions", 256, 8)):
        blocks, iters = sms * 4, 4096
        ext.run_rate(which, blocks, threads, 16, out)  # warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        ext.run_rate(which, blocks, threads, iters, out)
        end.record()
        torch.cuda.synchronize()
        seconds = start.elapsed_time(end) / 1e3
        ops = blocks * threads * iters * per_thread_iter
        per_cycle_sm = ops / seconds / (clock_ghz * 1e9) / sms
        print(f"{name}: {ops / seconds / 1e12:.1f} T/s, {per_cycle_sm:.0f} per cycle per SM at {clock_ghz} GHz")


if __name__ == "__main__":
    main()
