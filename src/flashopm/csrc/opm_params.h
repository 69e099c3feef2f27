// Kernel arguments, tile constants and launcher declarations shared by the host code
// (opm_api.cpp, compiled by the C++ compiler) and the kernels (opm_launch.cu, compiled by nvcc).
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

#ifdef __CUDACC__
#define FLASHOPM_HD __host__ __device__
#else
#define FLASHOPM_HD
#endif

namespace flashopm {

enum MaskKind : int { kMaskFloat = 0, kMaskBool = 1, kMaskHalf = 2, kMaskBFloat16 = 3 };

// The mask as given: any strides, any supported dtype (MaskKind).
struct MaskView {
  const void* ptr;
  int64_t sb, ss, sn;
  int kind;
};

struct PrepArgs {
  const float* x;  // (B, S, N, C), unit stride along C
  int64_t x_sb, x_ss, x_sn;
  MaskView mask;     // (B, S, N)
  int n_offset;      // rows n of this launch are positions n_offset + n of x and mask
  int a_rows;        // a is written for rows n < a_rows only
  const float* ln_w;
  const float* ln_b;
  float ln_eps;
  const float* wa;  // (H, C)
  const float* ba;  // (H) or null
  const float* wb;
  const float* bb;
  const float* w_out;  // (D, H*H), project-first only
  float* a_out;        // strides below, unit stride along H
  int64_t a_sb, a_ss, a_sn;
  float* b_out;  // outer-first only, same strides convention
  int64_t b_sb, b_ss, b_sn;
  float* c_out;  // project-first only: (B, S, H, N, D)
  int B, S, N, C, H, D;  // N: rows of this launch
  int o_chunks;  // project-first: columns (h1, d) handled in chunks of kPrepThreads per block
};

constexpr int kPrepWarps = 8;
constexpr int kPrepThreads = kPrepWarps * 32;
constexpr int kPrepKC = 32;            // features of C staged per step
constexpr int kPrepWStride = 257;      // odd stride: conflict-free transposed stores
constexpr int kMaxHidden = 64;

FLASHOPM_HD inline int round_up4(int v) { return (v + 3) & ~3; }

// Shared memory (floats) used by opm_prep_kernel.
FLASHOPM_HD inline int64_t prep_smem_floats(int H, int rows_per_warp, bool project_w) {
  const int Q = (2 * H + 31) / 32;
  int64_t proj = int64_t(kPrepKC) * (2 * H + 1) + 32 * Q            // weight chunk (+ slack)
                 + int64_t(kPrepWarps) * rows_per_warp * kPrepKC;   // normalised rows
  int64_t total = proj;
  if (project_w) {
    const int64_t wsm = int64_t(round_up4(H)) * kPrepWStride;
    total = (proj > wsm ? proj : wsm) + int64_t(kPrepWarps) * rows_per_warp * round_up4(H);
  }
  return total;
}

constexpr int kOuterThreads = 256;
constexpr int kOuterMT = 128;          // phase-1 tile rows (i, h1)
constexpr int kOuterNT = 256;          // phase-1 tile cols (j, h2)
constexpr int kOuterBK = 8;            // S steps per stage
constexpr int kOuterOStride = kOuterNT + 4;
constexpr int kOuterKC = 32;           // k = (h1, h2) steps per W stage
constexpr int kOuterWStride = 128 + 1;
constexpr int kOuterStageFloats = 2 * kOuterBK * (kOuterMT + kOuterNT);
constexpr int kOuterWFloats = 2 * kOuterKC * kOuterWStride;
constexpr int kOuterSmemBytes =
    (kOuterMT * kOuterOStride +
     (kOuterStageFloats > kOuterWFloats ? kOuterStageFloats : kOuterWFloats)) *
    4;

struct OuterArgs {
  const float* a;  // (B, S, Na, H) contiguous: rows i_offset .. i_offset + Na of the output
  const float* b;  // (B, S, N, H) contiguous
  MaskView mask;
  const float* w_out;  // (D, H*H)
  const float* bias;   // (D) or null
  float* out;          // (B, N, N, D)
  int B, S, N, Na, i_offset, H, D;
  int Ti, Tj;  // pairs per tile along i and j
};

struct ProjectArgs {
  const float* A;
  const float* Cm;
  MaskView mask;
  const float* bias;
  float* out;
  int B, M, K, NC, D, S;
};

// Launchers (opm_launch.cu).  Each launches one kernel on `stream` and checks the launch.
void launch_prep(const PrepArgs& args, bool project_w, int rows_per_warp, cudaStream_t stream);
int prep_smem_bytes(int H, int rows_per_warp, bool project_w);
void launch_outer(const OuterArgs& args, cudaStream_t stream);
int outer_smem_bytes();
void launch_project_gemm(const ProjectArgs& args, bool big_tiles, cudaStream_t stream);
int project_gemm_smem_bytes(bool big_tiles);

}  // namespace flashopm
