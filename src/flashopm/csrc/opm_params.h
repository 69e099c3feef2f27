// Kernel arguments, tile constants and launcher declarations shared by the host code
// (opm_api.cpp, compiled by the C++ compiler) and the kernels (opm_launch.cu, compiled by nvcc).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <cuda_runtime_api.h>
#include <unistd.h>  // environ

#include <string>

#ifdef __CUDACC__
#define FLASHOPM_HD __host__ __device__
#else
#define FLASHOPM_HD
#endif

namespace flashopm {

// The environment's FLASHOPM_ settings: switches that ask for a kernel form other than the
// default, to compare the forms.  A call asks about a dozen of them, and std::getenv walks the
// whole environment each time; so an op's host code opens an EnvScope, which walks it once and
// keeps the FLASHOPM_ entries, and env_get reads those for the rest of the call on that thread.
// Outside a scope env_get is std::getenv.
struct EnvSettings {
  static constexpr int kMax = 32;
  const char* entries[kMax];  // "FLASHOPM_NAME=value", pointers into the environment
  int count = 0;
  bool overflow = false;  // more than kMax: env_get falls back to std::getenv
};
inline thread_local const EnvSettings* t_env_settings = nullptr;

class EnvScope {
 public:
  EnvScope() : outer_(t_env_settings) {
    for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
      if (std::strncmp(*e, "FLASHOPM_", 9) != 0) continue;
      if (settings_.count < EnvSettings::kMax) settings_.entries[settings_.count++] = *e;
      else settings_.overflow = true;
    }
    t_env_settings = &settings_;
  }
  ~EnvScope() { t_env_settings = outer_; }
  EnvScope(const EnvScope&) = delete;
  EnvScope& operator=(const EnvScope&) = delete;

 private:
  EnvSettings settings_;
  const EnvSettings* outer_;
};

inline const char* env_get(const char* name) {
  const EnvSettings* s = t_env_settings;
  if (s == nullptr || s->overflow) return std::getenv(name);
  const size_t n = std::strlen(name);
  for (int i = 0; i < s->count; ++i)
    if (std::strncmp(s->entries[i], name, n) == 0 && s->entries[i][n] == '=') return s->entries[i] + n + 1;
  return nullptr;
}

// Whether environment variable `name` holds exactly `value`.
inline bool env_is(const char* name, const char* value) {
  const char* env = env_get(name);
  return env != nullptr && std::strcmp(env, value) == 0;
}

// FLASHOPM_SMEM_LIMIT: the shared memory (bytes) a block may take, below the GPU's own, so that
// the forms GPUs with less than this one's take run here (A100 166912; sm_86, sm_89 and sm_120
// 101376); 0 where unset, -1 where not a number of at least 49152 bytes (device_info refuses
// that).  The planners read it through device_info, and allow_smem sets each kernel's limit to it,
// so that a launch past it fails as it would on such a GPU.
inline long smem_limit_setting() {
  const char* e = std::getenv("FLASHOPM_SMEM_LIMIT");
  if (e == nullptr || *e == 0) return 0;
  char* end = nullptr;
  const long limit = std::strtol(e, &end, 10);
  return end != e && *end == '\0' && limit >= 49152 && limit <= (1L << 30) ? limit : -1;
}

// Element types of masks, x and the output (x and the output are never bool).
enum MaskKind : int { kMaskFloat = 0, kMaskBool = 1, kMaskHalf = 2, kMaskBFloat16 = 3 };

// How the contracted sum is normalised (the conventions of the models that use the op):
//   kNormRow       (the specification)  out = acc / max(sum_s m[s,i], 1) + bias
//   kNormOpenFold  (OpenFold, AF2)      out = (acc + bias) / (eps + sum_s m[s,i] m[s,j])
//   kNormBoltz     (Boltz-1/2)          out = acc / max(sum_s m[s,i] m[s,j], 1) + bias
// Operand layouts of the float32 tensor-core kernel's warpgroup-MMA form (TF32 operands must be
// K-major, i.e. contiguous along s): per batch, chunks of s; per chunk, one row of
// kmajor_row_floats(terms) floats for each (n, h), the s of the chunk in order:
//   kAbTf32:       32 s rounded to TF32 ("high"), 128 bytes: one row of a 128-byte swizzle atom
//   kAbF32Rows16:  16 s as they are (3xTF32, "highest"); the kernel splits each value into its
//                  high and low TF32 parts in shared memory, filling the other 64 bytes of the row
//   kAbF32Rows32:  32 s as they are, which opm_split_rows_f16_kernel then rewrites in place as
//                  32 float16 high parts followed by the 32 low parts of the same s, after scaling
//                  each residue's values by a power of two (the float16 split form, "highest")
// s past S in the last chunk is zero (the host clears that chunk before the projections run).
// One more kind, for the small-problem path's FMA form (opm_small_tc_kernel), which copies rows
// of a and b in 16-byte pieces:
//   kAbF32HStride: float32, element h of a row at h·a_hs (a) or h·b_hs (b): a as (B, H, NS4) with
//                  (n, s) at n·S + s and NS4 = round_up4(N·S), b as (B, S, H, N4) with
//                  N4 = round_up4(N)
// And one for its float16 split forms (opm_small_f16_kernel, opm_small_f16_chain_kernel), in
// their shared-memory layouts so that a block's rows arrive in a few bulk copies:
//   kAbF16Split:   each row (b, s, n) of a and of b scaled by its own power of two 2^e (e from the
//                  row's largest magnitude, split_scale_exp_bits) and split into float16 high and
//                  low parts; element h of a at a_out + b·a_sb + (n·S + s)·a_ss + h (a_ss = H + 8
//                  halves), of b at b_out + ab_row_offset(b, s, n) + h·b_hs: the staged form's
//                  b_ss = H + 8, b_sn = SmallF16Layout::ldk, b_hs = 1, no chunks of s; the chained
//                  form's chunks of 8 s (b_sc = 8·H, b_ss = 1, b_hs = 8, b_sn =
//                  SmallF16ChainLayout::ldk, zeros for s past S in the last chunk); the low parts
//                  a_lo_off (b_lo_off) halves further on; e at a_exp + b·a_exp_sb + n·a_exp_sn + s
//                  (b_exp: + n·S + s)
enum AbKind : int { kAbTf32 = 4, kAbF32Rows16 = 5, kAbF32Rows32 = 6, kAbF32HStride = 7, kAbF16Split = 8 };
FLASHOPM_HD constexpr int kmajor_row_floats(int terms) { return terms == 3 ? 16 : 32; }
FLASHOPM_HD constexpr int ab_kind_row_floats(int kind) { return kind == kAbF32Rows16 ? 16 : 32; }

// The float16 split form of "highest" (opm_outer_tc_kernel with kHalfSplit): every float32
// operand x, scaled by a power of two 2^e so that its block's largest magnitude lies in
// [2^14, 2^15), becomes hi = fp16(x·2^e) and lo = fp16(x·2^e - hi), 11 + 11 significant bits as
// 3xTF32 keeps, and each product takes three float16 MMAs (lo·hi + hi·lo + hi·hi) at twice the
// TF32 rate.  The scale exponents: per residue for a and b (over s and h), per output column d
// for W (over k), and one for O from the bound |sum_s a'b'| < S·2^30.
constexpr int kSplitTopExp = 14;   // largest magnitude after scaling in [2^14, 2^15)
constexpr int kSplitMinExp = -113; // scale exponents clamped: 2^-113 brings FLT_MAX below 2^15,
constexpr int kSplitMaxExp = 126;  // and 2^126 is the largest normal power of two (exp2_int): only
                                   // blocks whose largest magnitude is under 2^-112 lose precision

enum NormKind : int { kNormRow = 0, kNormOpenFold = 1, kNormBoltz = 2 };

struct Normalizer {
  int kind;
  float eps;  // kNormOpenFold only
};

// The mask as given: any strides, any supported dtype (MaskKind).
struct MaskView {
  const void* ptr;
  int64_t sb, ss, sn;
  int kind;
};

struct PrepArgs {
  const void* x;  // (B, S, N, C), unit stride along C, elements of kind x_kind
  int x_kind;     // kMaskFloat, kMaskHalf or kMaskBFloat16 (MaskKind names the element types)
  int64_t x_sb, x_ss, x_sn;
  MaskView mask;     // (B, S, N)
  int n_offset;      // rows n of this launch are positions n_offset + n of x and mask
  int a_rows;        // a is written for rows a_first <= n < a_first + a_rows only, as a's row n - a_first
  int a_first;
  const float* ln_w;
  const float* ln_b;
  float ln_eps;
  const float* wa;  // (H, C)
  const float* ba;  // (H) or null
  const float* wb;
  const float* bb;
  const float* w_out;  // (D, H*H), project-first only
  // a and b: element (b, s, n, h) at b·sb + (s / s_chunk)·sc + (s % s_chunk)·ss + n·sn + h·hs, where
  // s_chunk = 0 means no chunks (s·ss) and hs is 1, or s_chunk for the K-major kinds (AbKind).
  void* a_out;
  int64_t a_sb, a_ss, a_sn, a_sc;
  void* b_out;   // outer-first only, same strides convention
  int ab_kind;   // kMaskFloat, kMaskBFloat16/kMaskHalf (the 16-bit kernel), or an AbKind
  int64_t a_hs, b_hs;  // kAbF32HStride: the strides of h
  int64_t b_sb, b_ss, b_sn, b_sc;
  int64_t a_lo_off, b_lo_off;  // kAbF16Split: the low parts' offset (halves) from the high parts'
  int* a_exp;                  // kAbF16Split: the rows' scale exponents
  int* b_exp;
  int64_t a_exp_sb, b_exp_sb;
  int a_exp_sn;                // kAbF16Split: a's exponents of residue n, a_exp_sn apart (S rounded up to 4)
  int s_chunk;
  float* c_out;  // project-first only: (B, S, H, N, D)
  int B, S, N, C, H, D;  // N: rows of this launch
  int o_chunks;  // project-first: columns (h1, d) handled in chunks of kPrepThreads per block
  int mma_terms;  // opm_project_rows_kernel's products for float32 x: 0 float32 FMAs, 1 TF32, 3 3xTF32
  int weights_late;  // opm_prep_kernel: the weights' copies issued after the loads of x, not before
  // opm_project_rows_kernel's rows per block (tensor-core form): 128 (or 0), 64 or 32, as
  // project_rows_block_allowed permits
  int block_rows;
  // opm_prep_kernel (host side): launched as the previous kernel's programmatic dependent, so that
  // its blocks can be resident before that kernel ends (the kernel waits for it before any load)
  int after_previous;
  // opm_project_stream_kernel (host side): its grid (0: the row-tiled kernel instead) and the
  // stages of its ring of x tiles
  int stream_blocks;
  int stream_stages;
  // wa, wb (float32) hold values exact in x's 16-bit type: the caller's parameters are in that
  // type, so opm_project_regs_kernel may round them back to it (project_regs_applies)
  int w_in_x_type;
  // opm_project_regs_kernel (host side): its grid (0: another form)
  int regs_blocks;
};

// Whether x is float16 or bfloat16 (PrepArgs::x_kind).
FLASHOPM_HD inline bool x_is_16bit(const PrepArgs& p) { return p.x_kind == kMaskHalf || p.x_kind == kMaskBFloat16; }

// opm_project_rows_kernel's rows: (b, s, n), n fastest; for the K-major kinds (s_chunk > 1)
// (b, chunk of s, n, s within the chunk), s fastest, so that a warp's stores of one (n, h) are whole
// 32-byte pieces along s rather than one float each, the last chunk's rows past S counted and left
// out.
FLASHOPM_HD inline int64_t project_rows_count(const PrepArgs& p) {
  if (p.s_chunk > 1) return int64_t(p.B) * ((p.S + p.s_chunk - 1) / p.s_chunk) * p.s_chunk * p.N;
  return int64_t(p.B) * p.S * p.N;
}

constexpr int kPrepWarps = 8;
constexpr int kPrepThreads = kPrepWarps * 32;
constexpr int kPrepKC = 32;            // features of C staged per step
constexpr int kPrepLdW = kPrepKC + 4;  // a weight row of one chunk: 4 (mod 8) floats, for float4 reads
constexpr int kPrepCachedChunks = 2;  // chunks of x and LayerNorm's parameters kept in registers
// opm_prep_kernel's whole-weights form (kWholeW): msa_dim up to the features it keeps in registers,
// a multiple of 4 (W_a's and W_b's rows in 16-byte pieces).
constexpr int kPrepWholeMaxC = kPrepCachedChunks * kPrepKC;
constexpr int kPrepWStride = 257;      // odd stride: conflict-free transposed stores
constexpr int kMaxHidden = 64;

FLASHOPM_HD inline int round_up4(int v) { return (v + 3) & ~3; }
// The least multiple of 4 at least v that is 4 (mod 8).
FLASHOPM_HD inline int round_up4_odd_quad(int v) { return round_up4(v) % 8 == 0 ? round_up4(v) + 4 : round_up4(v); }

// Shared memory (floats) used by opm_prep_kernel.
FLASHOPM_HD inline int64_t prep_smem_floats(int H, int rows_per_warp, bool project_w) {
  // Q as the launcher instantiates the kernel (1, 2 or 4 outputs per lane)
  const int q = (2 * H + 31) / 32;
  const int Q = q <= 2 ? q : 4;
  int64_t proj = 2 * int64_t(32 * Q) * kPrepLdW                      // two weight chunks
                 + int64_t(kPrepWarps) * rows_per_warp * kPrepKC;   // normalised rows
  int64_t total = proj;
  if (project_w) {
    const int64_t wsm = int64_t(round_up4(H)) * kPrepWStride;
    total = (proj > wsm ? proj : wsm) + int64_t(kPrepWarps) * rows_per_warp * round_up4(H);
  }
  return total;
}

// Shared memory (floats) of opm_prep_kernel's whole-weights form (one row per warp, at most two
// outputs per lane): the 64 weight rows o whole, ldw = round_up4_odd_quad(C) floats apart
// (4 (mod 8): a quarter warp's float4 reads of eight rows fall in distinct banks), then the
// warps' normalised rows (C floats each; `warps` of them).
FLASHOPM_HD inline int64_t prep_whole_smem_floats(int C, int warps = kPrepWarps) {
  return int64_t(64) * round_up4_odd_quad(C) + int64_t(warps) * C;
}

// opm_project_rows_kernel: the same LayerNorm/projection/mask stage as opm_prep_kernel (outer-first
// layouts only) as a register-tiled GEMM over rows for large problems.  A block takes kProjRows
// consecutive rows r = (b, s, n) and all 2H outputs; 256 threads as 16 row groups x 16 column
// groups, each kProjRT rows x CT outputs (CT = 1, 2, 4 or 8, so that 16 CT >= 2H); C in chunks of
// kProjKC, the normalised rows and the weights staged in shared memory.  Its tensor-core form
// (16-bit x, whose linear layers PyTorch runs on 16-bit products, or float32 x as PrepArgs::mma_terms
// asks: TF32 or 3xTF32 products) gives each warp 16 rows and all 16·CT columns as mma.sync m16n8k8 tiles.
constexpr int kProjThreads = 256;
constexpr int kProjRT = 8;                       // rows per thread
constexpr int kProjRows = 16 * kProjRT;          // rows per block
constexpr int kProjKC = 32;                      // features of C per chunk
constexpr int kProjLdX = kProjRows + 4;          // xs[k][row]: stores of 8 k x 4 rows hit 32 banks
FLASHOPM_HD inline int proj_cols_per_thread(int H) { return 2 * H <= 16 ? 1 : 2 * H <= 32 ? 2 : 2 * H <= 64 ? 4 : 8; }
FLASHOPM_HD inline int proj_ld_w(int ct) { return 16 * ct + 8; }  // ws[k][o]: stores of 4 k x 8 o hit 32 banks
// The tensor-core form (mma): xs[row][k] and ws[o][k], rows of kProjKC + 4 floats (fragment reads
// of 8 rows x 4 k hit 32 banks).
constexpr int kProjLdK = kProjKC + 4;
// mma_terms: 0 (FMA form), 1 or 3 (tensor-core form: x's tile and one buffer of W's chunk, each
// with its low parts too for three terms)
FLASHOPM_HD inline int64_t project_rows_smem_floats(int H, int mma_terms, int block_rows = kProjRows) {
  const int nc = 16 * proj_cols_per_thread(H);
  const int64_t parts = mma_terms == 3 ? 2 : 1;
  const int64_t tiles = mma_terms > 0 ? parts * (int64_t(block_rows) + nc) * kProjLdK
                                      : int64_t(kProjKC) * kProjLdX + 2 * int64_t(kProjKC) * proj_ld_w(proj_cols_per_thread(H));
  return tiles + 3 * block_rows  // mean, rstd, mask per row
         + 2 * 3 * block_rows;   // offsets of x, a and b per row (int64)
}
// opm_project_rows_kernel's blocks per SM: its __launch_bounds__ minimum, which its register counts
// meet exactly (ptxas, sm_90: 3xTF32 at CT = 4 takes 128 registers with 128 rows, 80 with 64 or 32).
FLASHOPM_HD constexpr int project_rows_min_blocks(int CT, int mma_terms, int block_rows) {
  return mma_terms == 1 && CT <= 4 ? 3
         : CT >= 8                 ? (block_rows < kProjRows ? 2 : 1)
         : block_rows < kProjRows  ? 3
                                   : 2;
}
// The rows per block that opm_project_rows_kernel's tensor-core form can take: 64 for any H; 32
// where 2H > 16 (four column groups need at least four n tiles) and x is 32-bit (its 256 threads
// then stage one 16-byte vector each per chunk: 32 rows x 8 vectors).
FLASHOPM_HD inline bool project_rows_block_allowed(int block_rows, int H, bool x16) {
  if (block_rows == kProjRows) return true;
  const int n_tiles = 2 * proj_cols_per_thread(H);  // (16 CT) / 8
  const int col_groups = 8 / (block_rows / 16);
  if (block_rows == 64) return n_tiles % col_groups == 0;
  if (block_rows == 32) return n_tiles % col_groups == 0 && !x16;
  return false;
}

// opm_project_stream_kernel: the tensor-core form of opm_project_rows_kernel for 16-bit x, with the
// same products in the same order, one persistent block per SM.  W (kPsCols outputs: a's H, then
// b's, zero past 2H) stays in shared memory rounded to TF32, [kPsCols][C + 4] floats; x streams
// through a ring of tiles of kPsRows rows, [kPsRows][project_stream_ldx(C)] bytes each, then
// LayerNorm's (w, b) per feature, each row's (mean, rstd), and per stage each row's offsets of x,
// a and b (int64) and mask value.
constexpr int kPsThreads = 256;
constexpr int kPsRows = 64;
constexpr int kPsCols = 64;
constexpr int kPsMaxStages = 4;
// A staged row's bytes: 2C padded so that the stride is 4 (mod 8) words, which keeps the A
// fragments' reads (8 rows at once) in distinct banks.
FLASHOPM_HD constexpr int project_stream_ldx(int C) { return 2 * C + (C % 16 == 0 ? 16 : 32); }
FLASHOPM_HD inline int64_t project_stream_smem_bytes(int C, int stages) {
  const int64_t w = int64_t(kPsCols) * (C + 4) * 4;
  const int64_t tiles = int64_t(stages) * kPsRows * project_stream_ldx(C);
  const int64_t meta = int64_t(stages) * kPsRows * (3 * 8 + 4);
  return tiles + w + int64_t(C) * 8 + kPsRows * 8 + meta;
}
// The stages opm_project_stream_kernel takes within `smem_limit` bytes of a block's opt-in (the
// most that fit, at most kPsMaxStages, with 1 KB to spare for static shared memory), or 0 where it
// does not apply: x 16-bit, 2H <= kPsCols, and two stages at least.
FLASHOPM_HD inline int project_stream_stages(int C, int H, bool x16, int64_t smem_limit) {
  if (!x16 || 2 * H > kPsCols || C < 1) return 0;
  for (int st = kPsMaxStages; st >= 2; --st)
    if (project_stream_smem_bytes(C, st) + 1024 <= smem_limit) return st;
  return 0;
}

// opm_project_regs_kernel: LayerNorm and both projections for 16-bit x as eager PyTorch runs them in
// that type (LayerNorm's output rounded to it, 16-bit products summed in float32), each warp
// holding 16 rows r = (b, s, n) in registers, loaded straight from global memory as the A
// fragments of m16n8k16 MMAs, and taking tiles of 16 rows in turn (persistent blocks).  Shared
// memory: W's rows in x's type, a's H and zero rows up to project_regs_side_rows(H) (whole passes),
// then b's likewise, project_regs_row_bytes(C) apart (features in groups of 32, zeros past C); then
// LayerNorm's weight and bias (float32, 32 per group, zeros past C), the biases (float32, a's
// and b's, each zero-padded to project_regs_side_rows(H)), and each warp's 16 rows of outputs
// (a's then b's, in x's type), project_regs_out_ld(H) words apart, staged for whole-row stores.
constexpr int kPrWarps = 8;
constexpr int kPrThreads = kPrWarps * 32;
constexpr int kPrRows = 16;       // rows of a warp's tile
constexpr int kPrMaxGroups = 8;   // groups of 32 features a row holds in registers: msa_dim <= 256
constexpr int kPrPassTiles = 2;   // n tiles of 8 outputs a pass over a tile's rows (accumulators live only through one)
constexpr int kPrMaxBlocksPerSm = 2;
// The groups of 32 features a row holds (the kernel's kQ): 1, 2, 4 or kPrMaxGroups, the fewest that
// take msa_dim.  Groups past msa_dim hold zeros, and so do W's and LayerNorm's parameters there: the
// MMAs' loop over groups needs no tests.
FLASHOPM_HD inline int project_regs_groups(int C) {
  const int g = (C + 31) / 32;
  return g <= 1 ? 1 : g <= 2 ? 2 : g <= 4 ? 4 : kPrMaxGroups;
}
// A row of W: 64 bytes a group, and 64 more where that is a multiple of 128, so that rows g and
// g + 1 of a quarter warp's 16-byte reads fall in opposite halves of the banks.
FLASHOPM_HD inline int project_regs_row_bytes(int C) {
  const int g = project_regs_groups(C);
  return 64 * g + (g % 2 == 0 ? 64 : 0);
}
FLASHOPM_HD inline int project_regs_side_rows(int H) {
  constexpr int kPassRows = 8 * kPrPassTiles;
  return (H + kPassRows - 1) / kPassRows * kPassRows;
}
// A staged row of outputs: 2·side_rows 16-bit values, and 4 words more, so that the stride is 4
// (mod 8) words and the quads' 4-byte stores of eight rows fall in distinct banks.
FLASHOPM_HD inline int project_regs_out_ld(int H) { return project_regs_side_rows(H) + 4; }
FLASHOPM_HD inline int64_t project_regs_smem_bytes(int C, int H) {
  const int64_t side = project_regs_side_rows(H);
  return 2 * side * project_regs_row_bytes(C) + 2 * 4 * 32 * int64_t(project_regs_groups(C)) + 4 * 2 * side +
         4 * int64_t(kPrWarps) * kPrRows * project_regs_out_ld(H);
}
// Whether opm_project_regs_kernel may run (shared memory aside): x 16-bit in 16-byte aligned rows
// of msa_dim a multiple of 8 up to 32·kPrMaxGroups, W exact in x's type, a and b in x's type
// without chunks of s, their rows 8-byte aligned, H a multiple of 4, rows below 2^31.  (For the
// 16-bit contraction's workspace the alignment holds in every launch of a call: its rows are H
// elements from 256-byte aligned allocations.)
FLASHOPM_HD inline bool project_regs_applies(const PrepArgs& p) {
  const uintptr_t ab = reinterpret_cast<uintptr_t>(p.a_out) | reinterpret_cast<uintptr_t>(p.b_out);
  return x_is_16bit(p) && p.ab_kind == p.x_kind && p.w_in_x_type && p.s_chunk == 0 && p.C % 8 == 0 &&
         p.C >= 8 && p.C <= 32 * kPrMaxGroups && p.H % 4 == 0 && p.H >= 4 && p.H <= kMaxHidden &&
         reinterpret_cast<uintptr_t>(p.x) % 16 == 0 && p.x_sb % 8 == 0 && p.x_ss % 8 == 0 && p.x_sn % 8 == 0 &&
         ab % 8 == 0 && ((p.a_sb | p.a_ss | p.a_sn | p.b_sb | p.b_ss | p.b_sn) & 3) == 0 &&
         project_rows_count(p) < (int64_t(1) << 31) - kPrRows;
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

// a and b formed inside the float16 split form's contraction from x (the fused projection, for
// deep MSAs under a memory bound: no workspace for a and b): opm_fused_exponents_kernel forms each
// row's LayerNorm statistics and each residue's scale exponents, then per stage of 32 s each block
// copies its residues' rows of x, projects v = (x - mean)·rstd on tensor cores against W·diag(gamma)
// (beta folded into the bias) and splits the result into the stage's operand rows.  H = kFpH,
// C <= kFpMaxC, x float32 with rows 16-byte aligned.
struct FusedProjArgs {
  const float* x;  // (B, S, N, C), unit stride along C
  int64_t x_sb, x_ss, x_sn;
  const float* ln_w;
  const float* ln_b;
  float ln_eps;
  const float* wa;  // (H, C)
  const float* ba;  // (H) or null
  const float* wb;
  const float* bb;
  // (B, N, s_pad, 2): per row (b, s, n) of x its mean and rstd·2^kFpVExp, written by the first
  // kernel (zeros for s >= S), read by the contraction a stage at a time
  float* row_stats;
  int s_pad;  // S rounded up to whole stages
  int C;
  // FLASHOPM_FUSED_SKIP (timing aid only, results wrong): steps of each stage left out, bits
  // 1 x's copies, 4 the projection, 8 the stage's wgmma
  int skip;
};

// The waves form (deep MSAs under a memory bound, on request: FLASHOPM_WAVES=1): one cooperative
// launch of one block per SM takes the tiles a wave at a time, a wave being a rectangle of wave_r x
// wave_c tiles of the float16 split form (at most one per block).  Per wave the sum over s runs in
// parts, each part's accumulators kept in registers: every block projects its share of the wave's
// rows of x for the part (LayerNorm, both projections in float32 FMAs in the order the first kernel
// forms its exponents, the mask, the residue's scale, the float16 split) into a part buffer in the
// workspace's K-major layout; a grid barrier; then each block adds the part to its tile in phase 1.
// Phase 2 and the epilogue run once per wave, so a part costs its projection and a barrier, not a
// contraction with W.  Part buffers alternate between the two halves of a region: the output's rows
// after the wave's band (not written yet) where those are larger than the workspace, else the
// workspace.  x, LayerNorm's and the projections' parameters come in FusedProjArgs (row_stats null).
struct WaveArgs {
  char* ws;          // the workspace (null: not the waves form)
  int64_t ws_bytes;
  int wave_r, wave_c;  // tiles per wave along i and j
  int use_out;         // the output's unwritten rows may hold the part buffers (float32 output)
  // part buffers per region: 2, parts alternating between its halves; 1, a part filling it (twice
  // the s per part, a grid barrier before each part's stores); 0, per wave one buffer where that
  // takes at most three quarters of two buffers' parts (FLASHOPM_WAVES_BUFS)
  int bufs;
  // FLASHOPM_WAVES_SKIP (timing aid only, results wrong): steps left out, bits 1 the projection's
  // arithmetic and stores, 2 phase 1's chunks, 4 x's copies
  int skip;
  // FLASHOPM_WAVES_TRACE (timing aid): per block trace_cap records of 3 int64 (WaveMark | wave << 8
  // | part << 32, %globaltimer, clock64), record 0 holding the count; null: no trace
  long long* trace;
  int trace_cap;
  // 1: every wave projects its a (FLASHOPM_WAVES_KEEP=0); 0: a wave whose one part holds all of s
  // keeps the a that the wave before it in the band left in the same buffer
  int fresh_a;
  // 1: a wave may lay its part buffers over its own band's rows from its first column on (slots
  // of kWvSlotBytes a row, its output stores waiting until every block read its last part), where
  // those hold more than the rows after the band or the workspace (FLASHOPM_WAVES_OWN=0: never)
  int own_rows;
};
// The 16-bit kernel's trace points (FLASHOPM_TC16_TRACE, in WaveArgs::trace: per block and
// consumer warpgroup, record 0 the count, then Tc16Mark | payload << 8, %globaltimer, clock64), in
// the order a tile passes them.  kT16MarkTile's payload is the tile's index in the block | SM << 24.
enum Tc16Mark : int {
  kT16MarkTile = 0,      // the tile begins
  kT16MarkP1Done0 = 1,   // phase 1's products of column tile 0 retired
  kT16MarkO0 = 2,        // ... its O stored
  kT16MarkP1Done1 = 3,   // the same for column tile 1
  kT16MarkO1 = 4,
  kT16MarkRound = 5,     // phase 2's round begins (after the barrier on O)
  kT16MarkW0 = 6,        // its first W chunk in
  kT16MarkP2Done = 7,    // its products retired
  kT16MarkSums = 8,      // the sums in shared memory (after the barrier)
  kT16MarkStored = 9,    // the round's output rows stored
  kT16MarkWChunk = 10,   // phase 2's W chunk in; payload: the chunk | the cycles waited for it << 8
  kT16MarkO1Sync = 11,   // the last column tile's products retired in every warpgroup (its O next)
};
// The waves form's trace points (WaveArgs::trace), in the order a part passes them.
enum WaveMark : int {
  kMarkWave = 1,       // a wave begins (before its tile's row denominators)
  kMarkPart = 2,       // a part begins
  kMarkStoreWait = 3,  // one buffer: the barrier before the part's first stores begins
  kMarkStoreGo = 4,    // ... and ends
  kMarkProjected = 5,  // this block's share of the part projected and stored
  kMarkBarrier = 6,    // the part's grid barrier passed
  kMarkChunks = 7,     // the part's chunks added to the tile
  kMarkWaveEnd = 8,    // the wave's phase 2 and stores done
  kMarkBatchIn = 9,    // a batch's x rows in (after the block's barrier)
  kMarkBatchStats = 10,  // its statistics formed (after the barrier, and the one-buffer barrier if any)
  kMarkBatchDone = 11,   // its tasks projected and stored (this thread's warp)
  kMarkKeptA = 12,       // the wave keeps the a of the wave before it
  kMarkBatchIssued = 13,  // the next batch's copies issued (before this batch's statistics)
  kMarkOwnRows = 14,      // the wave's part buffers lie in its own band's unwritten rows
};
// a, b and w_out hold float32, or the 16-bit operand type of opm_outer_tc16_kernel.
// Division by a divisor fixed for a launch, as a multiply and a shift (Granlund and Montgomery):
// q = (umulhi(n, mul) + n) >> shift for 0 <= n < 2^31 and 1 <= d < 2^31.  The host makes it once;
// the kernel reads it from its parameters, where the division's own instruction chain (~40
// dependent instructions, a float reciprocal among them) would sit on the path between tiles.
struct FastDivisor {
  uint32_t d, mul, shift;
};
inline FastDivisor make_fast_divisor(uint32_t d) {
  uint32_t shift = 0;
  while (shift < 31 && (uint32_t(1) << shift) < d) ++shift;  // ceil(log2 d)
  const uint64_t mul = ((uint64_t(1) << 32) * ((uint64_t(1) << shift) - d)) / d + 1;
  return {d, uint32_t(mul), shift};
}
FLASHOPM_HD inline uint32_t fast_div(uint32_t n, const FastDivisor& f) {
#if defined(__CUDA_ARCH__)
  const uint32_t hi = __umulhi(n, f.mul);
#else
  const uint32_t hi = uint32_t((uint64_t(n) * f.mul) >> 32);
#endif
  return (hi + n) >> f.shift;
}

struct OuterArgs {
  const void* a;  // (B, S, Na, H) contiguous: residues i_offset .. i_offset + Na (rows i)
  const void* b;  // (B, S, N, H) contiguous: all residues (columns j)
  MaskView mask;       // (B, S, N): all residues
  const void* w_out;   // (D, H*H)
  const void* w_blocked;  // the wgmma forms of phase 2: w_out with k in o_k_order's order, or null
                          // (the float16 split form: per chunk of 32 k, 32 high then 32 low halves)
  // The float16 split form: scale exponents of a's rows (B, Na), b's (B, N) and W's (D), and O's
  // scale factor 2^o_exp (see kSplitTopExp); null / unused otherwise.
  const int* a_exp;
  const int* b_exp;
  const int* w_exp;
  float o_scale;
  int o_exp;
  const float* bias;   // (D) or null
  void* out;           // (B, out_rows, out_N, D) of out_kind; row i_offset + r of the problem is row out_row0 + r
  int out_kind;
  // pair (B, norm_rows, N): sum_s m[s, i_offset + r] m[s, j] at row r (OpenFold/Boltz conventions),
  // else null; row_den (B, norm_rows): max(sum_s m[s, i_offset + r], 1) (the 16-bit kernel,
  // kNormRow).  norm_rows is Na, or N (or a band's rows) where one tensor serves several blocks of
  // rows (its row 0 the block's first).
  const float* pair;
  const float* row_den;
  int norm_rows;
  Normalizer norm;
  int B, S, N, Na, i_offset, H, D;  // S: the s of a and b (one part of s where the sum is split)
  int S_mask;  // the s of the mask, over which the normalisers are formed (S where s is not split)
  // out += the normalised sum (no bias): a later part of s, the first having stored its own with
  // the bias (float32 outputs only; every convention's output is linear in the sum)
  int accumulate;
  int out_rows, out_row0;
  // Columns per row of out and pair: N, or more where the launch takes a block of N columns (b
  // holds those residues; out and pair then start at the block's first column)
  int out_N;
  int Ti, Tj;  // pairs per tile along i and j
  // the 16-bit tensor-copy forms: 1, each tile's last round stored beside the next tile's first MMAs
  // (FLASHOPM_TC16_DEFER=0: stored at once, as the form without tensor copies does)
  int tc16_defer;
  // the wide tensor-copy forms: 1, each tile's outputs stored by the producer warpgroup's other
  // three warps beside the next tile's phase 1, where the output takes 16-bit stores
  // (FLASHOPM_TC16_STORE_WARPS=0: by the consumers at once)
  int tc16_store_warps;
  // the wide tensor-copy forms: 1, a block's two b groups of a stage (8 KB together in one slice)
  // come by one copy of Tc16Maps::b2, where N·H is a multiple of 64 (FLASHOPM_TC16_B_PAIRS=0: one
  // copy a group)
  int tc16_b_pairs;
  // the wide tensor-copy forms: 1, W's chunks 2 and 3 of each tile loaded from L2 by the third
  // consumer warpgroup (idle in phase 2) into its registers as phase 2 begins, and stored into
  // their slots as soon as this block's phase 2 has retired chunks 0 and 1, rather than copied once
  // every block of the cluster has (FLASHOPM_TC16_W_THIRD=0: copied by the producer); 2
  // (FLASHOPM_TC16_W_THIRD=2), chunks 5 and 6 too, each loaded once the chunk two before it is
  // stored and stored once chunk 2 or 3 is retired (tc16_wide_w_by_third)
  int tc16_w_third;
  // the wide tensor-copy forms in clusters of two: 0, each block copies its half of W's chunks to
  // every block of the cluster once every block has released the chunk before in that slot; 1
  // (FLASHOPM_TC16_W_LOCAL=1), each block copies both halves into its own shared memory once its
  // own two phase-2 warpgroups have released it ("W's local empties"), so that neither block's
  // chunks wait for the other's phase 2
  int tc16_w_local;
  // the 16-bit kernel's wgmma forms: 1, 16-byte output stores where the output allows them
  // (FLASHOPM_TC16_WIDE_STORES=0: 4-byte stores)
  int tc16_wide;
  // the 16-bit kernel's wgmma forms: 1, O stored by stmatrix (FLASHOPM_TC16_STMATRIX=1; 0, the
  // default: 4-byte stores)
  int tc16_stmatrix;
  // the tensor-copy forms' groups of tiles (tc16_group_tile): the groups of a batch element
  // (column blocks x row groups) and of kTileGroupRows row groups (x column blocks), as divisors;
  // set where the cluster kernel is launched
  FastDivisor tc16_groups_per_b, tc16_group_span;
  FusedProjArgs fp;  // the fused projection's inputs (x null: a and b come in the workspace)
  WaveArgs wv;       // the waves form's (wv.ws null: not that form)
};

// Tensor-core outer-first kernel (opm_tc_kernel.cuh): the same tile as above, phase 1 staged
// kTcStages deep, phase 2 per group of kTcDG output columns with W in chunks of kTcKC.
constexpr int kTcThreads = 256;
constexpr int kTcMT = 128;
constexpr int kTcNT = 256;
constexpr int kTcBK = 32;
constexpr int kTcStages = 3;
constexpr int kTcLdA = kTcMT + 8;  // leading dimensions = 8 (mod 32): conflict-free fragments
FLASHOPM_HD constexpr int tc_ld_b(int nt) { return nt + 8; }  // B's, for phase 1 nt columns wide
constexpr int kTcDG = 128;
constexpr int kTcKC = 32;
FLASHOPM_HD constexpr int tc_ld_w(int kc) { return kc + 4; }  // = 4 (mod 32) for kc 32, 20 for 16
constexpr int kTcWStages = 3;
// On GPUs whose blocks take less shared memory than sm_90's (A100 163 KB; sm_86, sm_89, sm_120
// 99 KB) the mma.sync form may take half the s per phase-1 stage (kTcBKSmall: 76.8 KB of stages
// where kTcBK's take 153.6; the same k-steps in the same order, so the same sums) and half the k
// per W chunk of phase 2 (kTcKCSmall: 30.7 KB of W stages where kTcKC's take 55.3, which lets an
// A100 take the full column tile at hidden 32; each chunk's partial sums are then of 8 k, not 16,
// so the results round differently); their row stride of 20 keeps the fragment reads
// conflict-free.  Where a column tile holds at most kTcNTNarrow columns (j, h2), phase 1 may be
// that wide (each warp 64 x 32): no MMA unused, half the B stage, the same sums.
constexpr int kTcBKSmall = kTcBK / 2;
constexpr int kTcKCSmall = kTcKC / 2;
constexpr int kTcNTNarrow = kTcNT / 2;
FLASHOPM_HD constexpr int tc_stage_floats(int bk, int nt = kTcNT) { return bk * (kTcLdA + tc_ld_b(nt)); }
FLASHOPM_HD constexpr int tc_w_floats(int kc) { return kTcWStages * kTcDG * tc_ld_w(kc); }
struct TcMmaSyncStaging {
  bool half_stages = false;  // kTcBKSmall (the 16-bit kernel: kT16BKSmall)
  bool half_w = false;       // kTcKCSmall (the float32 kernel only)
  bool narrow = false;       // phase 1 kTcNTNarrow wide (the 16-bit kernel: kT16NTNarrow)
};

// Phase 1 of the tensor-core kernel on warpgroup MMAs (sm_90a; a and b in the K-major TF32
// layouts, see AbKind): one chunk of s per stage, A (kTcMT rows) then B (kTcNT rows) of 128 bytes
// each, 128-byte swizzled; kTcWgStages deep, issued kTcWgAhead ahead with one wgmma group in flight.
constexpr int kTcWgStages = 4;
constexpr int kTcWgAhead = kTcWgStages - 2;
constexpr int kTcWgABytes = kTcMT * 128;
constexpr int kTcWgStageBytes = (kTcMT + kTcNT) * 128;
// The fused projection's shared memory in phase 1 (bytes from the 1 KB-aligned start): one operand
// stage; x's rows of the stage's kFpS s for the tile's kFpResA + kFpResB residues, row (res, s) at
// res·kFpS + s, kFpLdX floats apart (8 mod 32: conflict-free fragment reads); W·diag(gamma)'s
// float16 split parts [side][high, low][h][c], kFpLdW halves apart; the rows' statistics and mask
// values; per side and h W's exponent and the bias; the residues' exponents; per side and h the
// factor that takes the projection's scales out.
constexpr int kFpH = 32;
constexpr int kFpS = 32;
constexpr int kFpResA = kTcMT / kFpH;  // 4
constexpr int kFpResB = kTcNT / kFpH;  // 8
constexpr int kFpRows = (kFpResA + kFpResB) * kFpS;
constexpr int kFpMaxC = 64;
// v = (x - mean)·rstd has sum_c v_c^2 = C·var/(var + eps) <= C, so |v_c| <= sqrt(C) <= 8 at C <= 64:
// v·2^12 < 2^15 lies within float16's range for the split, with no scale per row.
constexpr int kFpVExp = 12;
constexpr int kFpLdX = kFpMaxC + 8;
constexpr int kFpLdW = kFpMaxC + 8;
constexpr int kFpXOff = kTcWgStageBytes;
constexpr int kFpWOff = kFpXOff + kFpRows * kFpLdX * 4;
constexpr int kFpStatOff = kFpWOff + 2 * 2 * kFpH * kFpLdW * 2;
constexpr int kFpRowMOff = kFpStatOff + kFpRows * 8;
constexpr int kFpWEOff = kFpRowMOff + kFpRows * 4;
constexpr int kFpBiasOff = kFpWEOff + 2 * kFpH * 4;
constexpr int kFpResEOff = kFpBiasOff + 2 * kFpH * 4;
constexpr int kFpWFacOff = kFpResEOff + 16 * 4;
constexpr int kFpEnd = kFpWFacOff + 2 * kFpH * 4;
static_assert(kFpEnd <= kTcWgStages * kTcWgStageBytes, "the fused projection's phase 1 within the stages' space");
// The waves form's shared memory past the tile's (bytes): W·diag(gamma)'s float16 split parts as
// stage_w_split_f16 leaves them [side][high, low][h][kFpLdW], its exponents (scratch), factors and
// biases [side][h]; each batch row's statistics (mean, rstd·2^kFpVExp) and its mask times its
// residue's scale.  A batch of up to kWvSlots tasks (a residue's 32 s of one chunk each, one per
// warp) has its x rows in the stage area, kWvLdX floats apart; two batches lie there, so that the
// next one's copies run behind this one's projection.
// A part buffer is made of slots of four residues' rows for one chunk (a tile's a; a tile's b takes
// two neighbouring slots), kWvSlotBytes each; a region holds slots_row slots a row, rows
// row_stride bytes apart (one row where the region is contiguous).
constexpr int kWvTaskBytes = kFpH * 128;
constexpr int kWvSlotBytes = 4 * kWvTaskBytes;
constexpr int kWvSlots = kTcThreads / 32;
constexpr int kWvRows = kWvSlots * 32;
constexpr int kWvLdX = kFpLdX;  // 8 (mod 32) floats: conflict-free float2 fragment reads
constexpr int kWvWOff = 0;
constexpr int kWvWeOff = kWvWOff + 2 * 2 * kFpH * kFpLdW * 2;
constexpr int kWvFacOff = kWvWeOff + 2 * kFpH * 4;
constexpr int kWvBiasOff = kWvFacOff + 2 * kFpH * 4;
constexpr int kWvStatOff = kWvBiasOff + 2 * kFpH * 4;
constexpr int kWvMaskOff = kWvStatOff + kWvRows * 8;
constexpr int kWvBytes = kWvMaskOff + kWvRows * 4;
static_assert(2 * kWvRows * kWvLdX * 4 <= kTcWgStages * kTcWgStageBytes, "two batches' x rows within the stages");


// Shared memory of the tensor-core kernel, in floats: phase 1's stages, or phase 2's O tile
// ([Ti·Tj][H² + 4]) followed by the W stages; then the tile's row denominators and the output
// rows of a round of phase 2 (see store_round).  The warpgroup-MMA form (wgmma) starts everything
// at a 1 KB boundary (256 floats more).
constexpr int kTcRoundRows = 32;  // pairs per round of phase 2
struct TcLayout {
  int ldo, w, den, rows, total;
};
// Phase 2 on warpgroup MMAs (TF32, one term; the wgmma form of phase 1 with pairs in whole rounds
// of kTcRoundRows): out(i,j)ᵀ = W·Oᵀ per warpgroup (64 d x a round of pairs), W in chunks of 32 k
// (A, K-major, kTcDG rows of 128 bytes, swizzled) kTcWg2Stages deep, O (B, K-major) written by
// phase 1 with k in o_k_order's 8 x 8 blocks of (h1, h2) and W read in that order (w_blocked).
constexpr int kTcWg2Stages = 4;
constexpr int kTcWg2ChunkBytes = kTcDG * 128;
FLASHOPM_HD inline bool tc_phase2_wgmma(int terms, bool wgmma, int Ti, int Tj) {
  return wgmma && terms == 1 && (Ti * Tj) % kTcRoundRows == 0;
}
// bk, kc, nt: s per stage and columns of phase 1's mma.sync form (kTcBK or kTcBKSmall, kTcNT or
// kTcNTNarrow), k per W chunk of phase 2's (kTcKC or kTcKCSmall).
FLASHOPM_HD inline TcLayout tc_layout(int H, int Ti, int Tj, bool wgmma, bool wgmma2 = false, int bk = kTcBK,
                                      int kc = kTcKC, int nt = kTcNT) {
  TcLayout L{};
  L.ldo = H * H + 4;
  L.w = Ti * Tj * L.ldo;
  if (wgmma2) L.w = (Ti * Tj * H * H + 255) & ~255;  // unpadded O; W stages from a 1 KB boundary
  const int w_floats = wgmma2 && kTcWg2Stages * kTcWg2ChunkBytes / 4 > tc_w_floats(kTcKC)
                           ? kTcWg2Stages * kTcWg2ChunkBytes / 4
                           : tc_w_floats(kc);
  int o = L.w + w_floats;
  const int stages = wgmma ? kTcWgStages * kTcWgStageBytes / 4 : kTcStages * tc_stage_floats(bk, nt);
  if (o < stages) o = stages;
  L.den = o;
  o += round_up4(Ti);
  L.rows = (o + 1) & ~1;                 // 8-byte aligned
  L.total = L.rows + kTcRoundRows * 3 + (wgmma ? 256 : 0);   // int64 row offsets, then float normaliser arguments
  return L;
}

// 16-bit tensor-core outer-first kernel (opm_tc16_kernel.cuh): bfloat16 or float16 operands,
// float32 accumulation.  Phase 1 as above over kT16JSub column tiles of kTcNT in turn, so that
// phase 2 contracts twice the pairs per pass over W (half the W traffic from L2); sizes in
// elements of the 16-bit type.
constexpr int kT16JSub = 2;
// The tensor-copy forms' groups of tiles, which each cluster takes in turn: column blocks of
// Tj·kT16JSub columns, and row groups of `cluster` row tiles of Ti rows (one for the launch, the
// kernel and its divisors alike).
struct Tc16GroupCounts {
  int col_blocks, row_groups;
};
FLASHOPM_HD inline Tc16GroupCounts tc16_group_counts(int N, int Na, int Ti, int Tj, int cluster) {
  return {(N + Tj * kT16JSub - 1) / (Tj * kT16JSub), ((Na + Ti - 1) / Ti + cluster - 1) / cluster};
}
constexpr int kT16BK = 64;
constexpr int kT16Stages = 3;
constexpr int kT16LdA = kTcMT + 8;  // row strides of 16 bytes (mod 128): conflict-free ldmatrix
FLASHOPM_HD constexpr int tc16_ld_b(int nt) { return nt + 8; }  // B's, for phase 1 nt columns wide
// For GPUs with less shared memory than sm_90's the mma.sync form may take half the s per stage
// (kT16BKSmall: 76.8 KB of stages where kT16BK's take 153.6) and, where a column tile holds at
// most kT16NTNarrow columns (j, h2), a phase 1 of that width (each warp 64 x 32, half the stage
// of B): the narrower tiles those GPUs take then leave no MMA unused.  The same k-steps in the
// same order either way, so the same sums.
constexpr int kT16BKSmall = kT16BK / 2;
constexpr int kT16NTNarrow = kTcNT / 2;
FLASHOPM_HD constexpr int tc16_stage_elems(int bk, int nt = kTcNT) { return bk * (kT16LdA + tc16_ld_b(nt)); }
constexpr int kT16KC = 64;
constexpr int kT16LdW = kT16KC + 8;
constexpr int kT16WStages = 3;
constexpr int kT16WElems = kT16WStages * kTcDG * kT16LdW;

// Its sm_90a form runs phase 1 on warpgroup MMAs (wgmma) straight from the stages: per stage, A as
// two and B as four column groups of 64, each kT16WgBK rows of s of 128 bytes (swizzled, 1
// KB-aligned).  Stages are issued kT16WgAhead ahead and one wgmma group stays in flight, so a
// stage is refilled two stages after its multiply was issued.
constexpr int kT16WgBK = 32;
constexpr int kT16WgStages = 6;
constexpr int kT16WgAhead = kT16WgStages - 2;
constexpr int kT16WgGroupBytes = kT16WgBK * 128;
constexpr int kT16WgABytes = (kTcMT / 64) * kT16WgGroupBytes;
constexpr int kT16WgStageBytes = kT16WgABytes + (kTcNT / 64) * kT16WgGroupBytes;
// Uses of stage buffer sb in one tile of n_q stages (the tensor-copy forms start the ring at
// buffer 0 with each tile, so a buffer's phase follows from the tile's index and these uses).
FLASHOPM_HD constexpr int tc16_stage_uses(int n_q, int sb, int stages = kT16WgStages) {
  return sb < n_q ? (n_q - 1 - sb) / stages + 1 : 0;
}

// Forms of the 16-bit kernel: mma.sync throughout; phase 1 on wgmma; both phases on wgmma (needs
// the block's pairs in whole rounds of kT16RoundRows); then, for GPUs with less shared memory than
// sm_90's, mma.sync with stages of kT16BKSmall, with phase 1 kT16NTNarrow wide, or both.
enum Tc16Form : int {
  kT16MmaSync = 0,
  kT16WgmmaPhase1 = 1,
  kT16WgmmaBoth = 2,
  kT16MmaSyncHalfStages = 3,
  kT16MmaSyncNarrow = 4,
  kT16MmaSyncNarrowHalfStages = 5,
  // both phases on wgmma, the stages and W's chunks by tensor copies that a producer warp issues,
  // in clusters of two (four) blocks along rows, the same column tiles, each block's share of b
  // and of W multicast to all; or (kT16WgmmaTma) each block on its own
  kT16WgmmaPair = 6,
  kT16WgmmaQuad = 7,
  kT16WgmmaTma = 8,
  // the same with three consumer warpgroups (Tc16Shape<true>): tiles of 192 rows (i, h1), 96 pairs
  kT16WgmmaPairWide = 9,
  kT16WgmmaTmaWide = 10,
};
// Whether a form is one of the tensor-copy forms; the blocks of its clusters (1: not clustered);
// the tensor-copy form of clusters of `cluster` blocks.
FLASHOPM_HD constexpr bool tc16_form_tma(int form) {
  return form == kT16WgmmaPair || form == kT16WgmmaQuad || form == kT16WgmmaTma || form == kT16WgmmaPairWide ||
         form == kT16WgmmaTmaWide;
}
FLASHOPM_HD constexpr bool tc16_form_wide(int form) { return form == kT16WgmmaPairWide || form == kT16WgmmaTmaWide; }
FLASHOPM_HD constexpr int tc16_form_cluster(int form) {
  return form == kT16WgmmaPair || form == kT16WgmmaPairWide ? 2 : form == kT16WgmmaQuad ? 4 : 1;
}
FLASHOPM_HD constexpr int tc16_tma_form(int cluster, bool wide = false) {
  return wide ? (cluster == 2 ? kT16WgmmaPairWide : kT16WgmmaTmaWide)
              : cluster == 4 ? kT16WgmmaQuad : cluster == 2 ? kT16WgmmaPair : kT16WgmmaTma;
}
FLASHOPM_HD constexpr int tc16_form_bk(int form) {
  return form == kT16MmaSyncHalfStages || form == kT16MmaSyncNarrowHalfStages ? kT16BKSmall : kT16BK;
}
FLASHOPM_HD constexpr int tc16_form_nt(int form) {
  return form == kT16MmaSyncNarrow || form == kT16MmaSyncNarrowHalfStages ? kT16NTNarrow : kTcNT;
}
// The mma.sync form of stage depth bk and phase-1 width nt.
FLASHOPM_HD constexpr int tc16_mma_sync_form(int bk, int nt) {
  return nt == kTcNT ? (bk == kT16BK ? kT16MmaSync : kT16MmaSyncHalfStages)
                     : (bk == kT16BK ? kT16MmaSyncNarrow : kT16MmaSyncNarrowHalfStages);
}
// Phase 2 of the last form: W chunks of 64 k for kTcDG rows of d (128-byte rows, swizzled),
// kT16Wg2Stages deep.
constexpr int kT16Wg2ChunkBytes = kTcDG * 128;
constexpr int kT16Wg2Stages = 4;
// The two-warpgroup tensor-copy forms' registers a thread after setmaxnreg (Tc16Shape): 128 x 40
// + 256 x 232 = 384 x 168, the launch's whole share.  A producer warpgroup (one lane of it issues)
// rather than a warp, so that setmaxnreg can hand its registers to the consumers, whose 128
// accumulators a thread would otherwise spill at the 168 registers a third of the file gives each
// of 384 threads.
constexpr int kT16ProducerRegs = 40, kT16ConsumerRegs = 232;

// Shared memory of the 16-bit kernel, in bytes: O ([Ti·Tj·kT16JSub][H² + 8] 16-bit) with the
// phase-1 stages placed after the first column tile's O (the later tiles' O is written only once
// their stages are consumed), the W stages after all of O (also the float32 partial sums of
// phase 2's two k halves), then the output rows of a round of phase 2 (see store_round).  In the
// form with both phases on wgmma, O is phase 2's K-major B operand instead (pairs in groups of 8
// rows, each group H² · 16 bytes: see kmajor_sw128_offset; k in o_k_order) and every offset is from the shared
// memory's start rounded up to 1 KB.  The row denominators come from launch_row_denominators.
constexpr int kT16RoundRows = 64;  // pairs per round of phase 2

// The tensor-copy forms' shape: two consumer warpgroups (phase 1 in tiles of 128 rows (i, h1) x
// 256 columns (j, h2), 64 pairs over its two column tiles), or three (kWide, the default at hidden
// 32 with D <= kTcDG: 192 rows, 96 pairs).  Each SM takes in a, b and W at ~35 B a clock in either phase (runs
// 335-338), so what sets the tile's time may be the bytes it takes in per pair: 16 KB with two
// warpgroups (a 4, b 8, W 4 at hidden 32), 12 KB with three (a 4, b 5.3, W 2.7).
// Three consumer warpgroups and the producer's are 512 threads, 128 registers a thread at entry;
// by setmaxnreg the producer keeps 32 and the consumers take 160 (the whole file), room for their
// 128 accumulators.
// ptxas compiles no single instruction that needs more registers than the entry count, so their
// phase 1 takes two m64n128k16 a k step where two warpgroups take one m64n256k16 (A read twice).
// Their O (192 KB) leaves room for four stages and two W chunks, and for one round of phase 2 (all
// 96 pairs, D <= kTcDG), whose sums go over O once phase 2 is done and are stored at once (clear
// of the stages, which the next tile's first copies fill meanwhile).  Phase 2 runs on the first two
// warpgroups (64 d each, one m64n96k16 a k step); the third waits at its barriers.
// Two W buffers alone (32 KB in flight) left phase 2 at 37% of the tensor rate (run 342: 16.4K
// cycles a tile against 6.1K), so W's chunks also go where O's chunks already used lie.  O is
// laid out in slices of two chunks (tc16_wide_o), so that phase 2 takes both column tiles' 96
// pairs in one m64n96k16 (its B's groups 2 KB apart; with its operands resident m64n48k16 runs
// at 86% of the tensor rate, m64n96k16 at 100%: run 347, scripts/wgmma_rate.cu) and a used slice
// frees 24 KB at once, room for a chunk and a half of W in whole halves of 64 rows (run 348's
// eight copies of 8 rows a half into 1 KB holes could not keep pace); phase 1's stages lie in
// the slices' halves that column tile 1's O fills last (tc16_wide_stage_a, _b).
template <bool kWide>
struct Tc16Shape {
  static constexpr int kWgs = kWide ? 3 : 2;     // consumer warpgroups
  static constexpr int kMT = 64 * kWgs;          // phase 1's rows (i, h1) a tile
  static constexpr int kThreads = 128 * kWgs;    // consumer threads
  static constexpr int kStages = kWide ? 4 : kT16WgStages;
  // W's chunks: kW2Stages mbarrier pairs, kWBuffers buffers of their own at Tc16Layout::w (kWide:
  // a pair per chunk of a tile, H² / 64 = 16, and beside the two buffers the slices of O that the
  // tile's chunks before have freed: tc16_wide_w_slot)
  static constexpr int kW2Stages = kWide ? 16 : kT16Wg2Stages;
  static constexpr int kWBuffers = kWide ? 2 : kT16Wg2Stages;
  static constexpr int kRound = kWide ? 96 : kT16RoundRows;  // pairs a round of phase 2
  static constexpr int kABytes = (kMT / 64) * kT16WgGroupBytes;
  static constexpr int kStageBytes = kABytes + (kTcNT / 64) * kT16WgGroupBytes;
  // mbarriers: phase 1's full and empty a stage, W's a chunk stage, one for phase 2's rounds
  // stored, and (kWide) one for a tile's sums in shared memory, for the warps that store them, and
  // W's local empties a chunk (OuterArgs::tc16_w_local)
  static constexpr int kBarriers = 2 * kStages + 2 * kW2Stages + 1 + (kWide ? 1 + kW2Stages : 0);
  static constexpr int kTmaThreads = kThreads + 128;  // and the producer warpgroup
  static constexpr int kProducerRegs = kWide ? 32 : kT16ProducerRegs;
  static constexpr int kConsumerRegs = kWide ? 160 : kT16ConsumerRegs;
  static_assert(kProducerRegs * 128 + kConsumerRegs * kThreads <= (65536 / kTmaThreads / 8 * 8) * kTmaThreads,
                "the warpgroups' registers after setmaxnreg fit the launch's share of the file");
};
// A form's Tc16Shape as values, for the host's layout.
struct Tc16ShapeSizes {
  int stages, stage_bytes, w_buffers, round, barriers;
};
template <bool kWide>
FLASHOPM_HD constexpr Tc16ShapeSizes tc16_shape_sizes_of() {
  using S = Tc16Shape<kWide>;
  return {S::kStages, S::kStageBytes, S::kWBuffers, S::kRound, S::kBarriers};
}
FLASHOPM_HD constexpr Tc16ShapeSizes tc16_shape_sizes(bool wide) {
  return wide ? tc16_shape_sizes_of<true>() : tc16_shape_sizes_of<false>();
}
struct Tc16Layout {
  int ldo, stages, w, rows, total;  // bytes, except ldo (elements)
};
// The wide forms' shared memory (hidden 32; 12 pair groups of 8 pairs, 16 chunks of 64 k): O in 8
// slices of 24 KB, slice s holding chunks 2s and 2s + 1 of every pair group (group G at 2 KB·G,
// the chunk's parity at 1 KB), column tile 0's groups in each slice's first 12 KB and column tile
// 1's in its last 12.  Phase 2's B for chunk kc then has its 12 groups 2 KB apart (one
// m64n96k16), and a slice whose two chunks are done frees 24 KB at once for W.  Phase 1's stage
// buffers lie in the slices' last 12 KB (free until column tile 1's O) and from Tc16Layout::w:
// buffer sb takes the last 12 KB of slices 2p and 2p + 1 (p = 3 - sb) for b's four 64-column
// groups (two a slice, 4 KB apart, as the MMAs' B expects) and the first two warpgroups' a, and 4
// KB from w for the third warpgroup's a.  A tile's sums (96 pairs of kTcDG + 4 floats) lie in the
// first 12 KB of slices 0-5, 16 pairs a slice (tc16_wide_red_row; a multiple of 8, so that the
// offsets of a thread's pairs 8j + 2t differ by constants): clear of every stage buffer, so that
// the next tile's stages never wait for them to be stored, and free until that tile's O of column
// tile 0.
constexpr int kT16WideSlice = 24 * 1024;
constexpr int kT16WideRedRows = 16;  // pairs' sums a slice
// pair pr's sums in the wide forms: their offset in floats from the shared memory's start
FLASHOPM_HD constexpr int tc16_wide_red_row(int pr) {
  return (pr / kT16WideRedRows) * (kT16WideSlice / 4) + (pr % kT16WideRedRows) * (kTcDG + 4);
}
static_assert(kT16WideRedRows * (kTcDG + 4) * 4 <= kT16WideSlice / 2 && (96 + kT16WideRedRows - 1) / kT16WideRedRows <= 8,
              "the wide forms' sums fit column tile 0's halves of the slices");
FLASHOPM_HD constexpr int tc16_wide_piece(int sb, int j) {
  return ((3 - sb) * 2 + j) * kT16WideSlice + kT16WideSlice / 2;
}
// stage buffer sb's a for warpgroup wg (64 rows (i, h1)), and its b group g (64 columns (j, h2))
FLASHOPM_HD constexpr int tc16_wide_stage_a(int sb, int wg, int w) {
  return wg < 2 ? tc16_wide_piece(sb, wg) + 2 * kT16WgGroupBytes : w + sb * kT16WgGroupBytes;
}
FLASHOPM_HD constexpr int tc16_wide_stage_b(int sb, int g) {
  return tc16_wide_piece(sb, g >> 1) + (g & 1) * kT16WgGroupBytes;
}
// whether stage buffer sb lies over any of the bytes [lo, hi)
FLASHOPM_HD constexpr bool tc16_wide_stage_over(int sb, int w, int lo, int hi) {
  auto over = [&](int a, int bytes) { return a < hi && a + bytes > lo; };
  return over(tc16_wide_piece(sb, 0), kT16WideSlice / 2) || over(tc16_wide_piece(sb, 1), kT16WideSlice / 2) ||
         over(tc16_wide_stage_a(sb, 2, w), kT16WgGroupBytes);
}
// O's chunk kc (64 k) of pair group `group`: its byte offset
FLASHOPM_HD constexpr int tc16_wide_o(int group, int kc) { return (kc >> 1) * kT16WideSlice + group * 2048 + (kc & 1) * 1024; }
// The wide forms' W chunk n of a tile (n < 16): where each half h (rows of d 64h .. 64h + 63, one
// warpgroup's A: 8 KB, its groups of 8 rows 1 KB apart) goes, and the chunk of the same tile whose
// release it waits for (-1: none beyond the stages beneath it, and the tile before's chunks, all
// released before this tile's stages were issued).  Slots: A and B (their own 16 KB at w, A over
// the third warpgroup's stage a), S0-S3 (the first 16 KB of slice s, once its chunks 2s and 2s + 1
// are done), and the last 8 KB of two such slices (H01: slices 0 and 1, half h in slice h; H23:
// slices 2 and 3).  Every slot's chunk before is released before the chunk it waits for, since
// the warpgroups release their chunks in order; up to eight chunks ahead.
// (The tables as nibbles of one constant each: an array indexed at run time went to local memory.)
FLASHOPM_HD constexpr int tc16_wide_w_slot(int n) {
  // slots of chunks 0-15 (0 A, 1 B, 2 + s Ss, 6 H01, 7 H23), n-th nibble:
  // B A B A S0 B A S1 H01 S0 B S2 A S1 S3 H23
  return int((0x7530412630120101ull >> (4 * (n & 15))) & 15u);
}
FLASHOPM_HD constexpr int tc16_wide_w_after(int n) {
  // 1 + the chunk waited for, n-th nibble: -1 -1 0 1 1 2 3 3 3 4 5 5 6 7 7 7
  return int((0x8887665444322100ull >> (4 * (n & 15))) & 15u) - 1;
}
// half h of a chunk in slot `slot`: its byte offset (w: Tc16Layout::w)
FLASHOPM_HD constexpr int tc16_wide_w_half(int slot, int h, int w) {
  if (slot < 2) return w + slot * kT16Wg2ChunkBytes + h * (kT16Wg2ChunkBytes / 2);
  if (slot < 6) return (slot - 2) * kT16WideSlice + h * (kT16Wg2ChunkBytes / 2);
  return (2 * (slot - 6) + h) * kT16WideSlice + kT16Wg2ChunkBytes;
}
// The wide forms' W chunks that the third consumer warpgroup stores from its registers
// (OuterArgs::tc16_w_third): chunks 2 and 3, the first that wait for a release (of chunks 0 and 1)
// and then for L2, while phase 2 has nothing else in flight (run 353: 860 and 743 cycles a tile
// against ~120 for the others); in mode 2 also chunks 5 and 6, which wait for chunks 2 and 3 (run
// 359, phase 2 unrolled: chunk 5 still waited ~240 cycles beyond the others, its copy issued once
// both blocks had released chunk 2, and then from L2).  Chunk kc's slot held chunk
// tc16_wide_w_after(kc) before; the third warpgroup stores into it once this block's first two
// warpgroups have retired that chunk (named barrier tc16_wide_third_barrier(kc)).
FLASHOPM_HD constexpr bool tc16_wide_w_by_third(int n, int mode) {
  return mode > 0 && (n == 2 || n == 3 || (mode > 1 && (n == 5 || n == 6)));
}
FLASHOPM_HD constexpr int tc16_wide_third_barrier(int n) { return n == 2 ? 3 : n == 3 ? 4 : n == 5 ? 6 : 7; }
static_assert(tc16_wide_w_after(2) == 0 && tc16_wide_w_after(3) == 1 && tc16_wide_w_after(5) == 2 &&
                  tc16_wide_w_after(6) == 3,
              "the third warpgroup's chunks wait for chunks 0, 1, 2 and 3 (its barriers 3, 4, 6 and 7)");
FLASHOPM_HD constexpr bool tc16_wide_w_after_below_8() {
  for (int n = 0; n < 16; ++n)
    if (tc16_wide_w_after(n) >= 8) return false;
  return true;
}
static_assert(tc16_wide_w_after_below_8(), "the consumers release W's local empties of chunks 0-7 alone");
// The tables' rules, checked as the code compiles (hidden 32, W's buffers from 192 KB): each
// chunk waits for one at least two back (a warpgroup releases a chunk once its next chunk's MMAs
// are issued, with one group in flight); its halves lie clear of every chunk issued since that
// one, and of O's slices not yet used (those holding chunks after it); the chunks without one use
// A or B alone; the stage buffers lie clear of one another and of column tile 0's O, all of them
// below W's B (the sums lie in column tile 0's halves, clear of them all).
FLASHOPM_HD constexpr bool tc16_wide_tables_ok() {
  constexpr int w = 192 * 1024, half = kT16Wg2ChunkBytes / 2;
  auto overlap = [](int a, int la, int b, int lb) { return a < b + lb && b < a + la; };
  for (int n = 0; n < 16; ++n) {
    const int after = tc16_wide_w_after(n), slot = tc16_wide_w_slot(n);
    if ((after >= 0 && after > n - 2) || (after < 0 && slot > 1)) return false;
    for (int h = 0; h < 2; ++h) {
      const int at = tc16_wide_w_half(slot, h, w);
      if (at < w && 2 * (at / kT16WideSlice) + 1 > after) return false;  // over O still to be read
      for (int m = after + 1; m < n; ++m)
        for (int g = 0; g < 2; ++g)
          if (overlap(at, half, tc16_wide_w_half(tc16_wide_w_slot(m), g, w), half)) return false;
    }
  }
  for (int sb = 0; sb < 4; ++sb) {
    int box[7] = {};
    for (int k = 0; k < 3; ++k) box[k] = tc16_wide_stage_a(sb, k, w);
    for (int g = 0; g < 4; ++g) box[3 + g] = tc16_wide_stage_b(sb, g);
    for (int k = 0; k < 7; ++k) {
      if (box[k] + kT16WgGroupBytes > w + kT16Wg2ChunkBytes) return false;  // below B
      for (int s = 0; s < 8; ++s)  // column tile 0's O: each slice's first half
        if (overlap(box[k], kT16WgGroupBytes, s * kT16WideSlice, kT16WideSlice / 2)) return false;
      for (int sb2 = sb; sb2 < 4; ++sb2)
        for (int k2 = 0; k2 < 7; ++k2) {
          const int other = k2 < 3 ? tc16_wide_stage_a(sb2, k2, w) : tc16_wide_stage_b(sb2, k2 - 3);
          if ((sb2 != sb || k2 != k) && overlap(box[k], kT16WgGroupBytes, other, kT16WgGroupBytes)) return false;
        }
    }
  }
  return true;
}
static_assert(tc16_wide_tables_ok(), "the wide forms' W slots and stage buffers break their rules");
FLASHOPM_HD inline int round_up1k(int x) { return (x + 1023) & ~1023; }
FLASHOPM_HD inline Tc16Layout tc16_layout(int H, int Ti, int Tj, int form) {
  const int bk = tc16_form_bk(form), nt = tc16_form_nt(form);  // the mma.sync forms' stage
  Tc16Layout L{};
  L.ldo = H * H + 8;
  int end;
  const bool tma = tc16_form_tma(form);
  const bool wide = tc16_form_wide(form);
  const Tc16ShapeSizes sh = tc16_shape_sizes(wide);
  const int round_rows = sh.round;
  if (form == kT16WgmmaBoth || tma) {
    const int o_tile = Ti * Tj * H * H * 2;
    L.stages = round_up1k(o_tile);
    L.w = round_up1k(kT16JSub * o_tile);
    end = L.stages + sh.stages * sh.stage_bytes;
    const int w_end = L.w + sh.w_buffers * kT16Wg2ChunkBytes;
    // (the wide forms' sums lie over O: tc16_wide_red_row)
    const int red_end = wide ? tc16_wide_red_row(round_rows - 1) * 4 + (kTcDG + 4) * 4
                             : L.w + round_rows * (kTcDG + 4) * 4;
    if (end < w_end) end = w_end;
    if (end < red_end) end = red_end;
  } else {
    const int o_tile = Ti * Tj * L.ldo * 2;
    L.stages = o_tile;  // the wgmma form rounds its start up to 1 KB in the shared address space
    L.w = kT16JSub * o_tile;
    end = L.w + kT16WElems * 2;
    const int red = L.w + kT16RoundRows * (kTcDG + 4) * 4;
    if (end < red) end = red;
    const int stages_end = form == kT16WgmmaPhase1 ? L.stages + 1024 + kT16WgStages * kT16WgStageBytes
                                                   : L.stages + kT16Stages * tc16_stage_elems(bk, nt) * 2;
    if (end < stages_end) end = stages_end;
  }
  L.rows = end;  // 16-byte aligned
  L.total = L.rows + round_rows * 12 + (form == kT16WgmmaBoth || tma ? 1024 : 0) +
            (tma ? sh.barriers * 8 : 0);
  return L;
}
// The tensor-copy forms' tensor maps (CUtensorMap's 128 bytes each): a as (B, S, Na·H), b as (B, S,
// N·H) (boxes of 32 s x 64 columns), W in o_k_order as (D, H²) (boxes of kTcDG / cluster rows of d x
// 64 k: a block's share), all swizzled by 128 bytes as the stages are.
struct Tc16Maps {
  alignas(64) unsigned char a[128];
  alignas(64) unsigned char b[128];
  alignas(64) unsigned char w[128];
  // b as (B, N·H / 64, S, 64): a box is two consecutive 64-column groups of kT16WgBK s, group by
  // group (OuterArgs::tc16_b_pairs; zeros otherwise)
  alignas(64) unsigned char b2[128];
};
// The form of the 16-bit kernel for a tile when `requested` is asked for.
FLASHOPM_HD inline int tc16_form(int Ti, int Tj, int requested) {
  if (requested == kT16WgmmaBoth && (Ti * Tj * kT16JSub) % kT16RoundRows != 0) return kT16WgmmaPhase1;
  return requested;
}

struct ProjectArgs {
  const float* A;
  const float* Cm;
  MaskView mask;
  const float* bias;
  void* out;  // of out_kind
  int out_kind;
  const float* pair;  // (B, M, NC / D): pair mask counts (OpenFold/Boltz conventions), else null
  Normalizer norm;
  int B, M, K, NC, D, S;
};

// Pair mask counts of the OpenFold and Boltz conventions, for rows row0 .. row0 + rows:
//   out[b, r, j] = sum_s m[b, s, row0 + r] m[b, s, j]         out (B, rows, N)
// One small GEMM (2·B·rows·N·S FLOPs), computed once per launch of the contraction instead of in
// every tile's epilogue, where its loads stalled the tile (~10% of the OpenFold path's time).
struct PairCountArgs {
  MaskView mask;  // (B, S, N)
  float* out;
  int B, S, N, rows, row0;
  bool mma;  // the tensor-core form (opm_pair_count_mma_kernel), else float32 FMAs
};
constexpr int kPairThreads = 256;
constexpr int kPairTR = 64;  // rows r per block (4 per thread)
constexpr int kPairTJ = 64;  // columns j per block (4 per thread)
constexpr int kPairSK = 32;  // steps of s per stage
// The tensor-core form: kPairMmaTR rows x pair_mma_cols columns per block, kPairMmaSK s per stage,
// two stages; float32 masks as three bfloat16 pieces each (pair_mma_pieces), in blocks half as wide
// (their six products a k-step take the registers of the other half).
constexpr int kPairMmaThreads = 256;
constexpr int kPairMmaTR = 128;
constexpr int kPairMmaSK = 32;
FLASHOPM_HD constexpr int pair_mma_pieces(int mask_kind) { return mask_kind == kMaskFloat ? 3 : 1; }
FLASHOPM_HD constexpr int pair_mma_cols(int mask_kind) { return mask_kind == kMaskFloat ? 64 : 128; }
// Shared memory of a block: per stage and piece, the s x rows and s x columns tiles of 16-bit
// elements, each row 8 elements longer than the tile (ldmatrix's rows then fall in distinct banks).
FLASHOPM_HD constexpr int pair_mma_smem_bytes(int mask_kind) {
  return 2 * pair_mma_pieces(mask_kind) * kPairMmaSK * (kPairMmaTR + 8 + pair_mma_cols(mask_kind) + 8) * 2;
}

// Row denominators of the specification's convention, for rows row0 .. row0 + rows:
//   out[b, r] = max(sum_s m[b, s, row0 + r], 1)          out (B, rows)
// once per launch of the 16-bit contraction rather than in each of its tiles (whose prologue
// waited ~7% of the kernel's time on these strided loads).  The float32 kernels keep forming them
// per tile: their workspace already takes the whole memory bound at some shapes.
struct RowDenArgs {
  MaskView mask;  // (B, S, N)
  float* out;
  int B, S, rows, row0;
};
constexpr int kRowDenWarps = 8;

// Launchers (opm_launch.cu).  Each launches one kernel on `stream` and checks the launch.
// warps: per block, kPrepWarps or fewer (ignored in project-first mode, which takes kPrepWarps).
// whole_w: the whole-weights form, where prep_whole_weights_apply says it may run.
void launch_prep(const PrepArgs& args, bool project_w, int rows_per_warp, int warps, cudaStream_t stream,
                 bool whole_w = false);
// Whether opm_prep_kernel's whole-weights form may run: float32 x, one row per warp, 2·H <= 64,
// C % 4 == 0, C <= kPrepWholeMaxC, W_a and W_b 16-byte aligned, not project-first.
bool prep_whole_weights_apply(const PrepArgs& args, bool project_w, int rows_per_warp);
// opm_project_rows_kernel over all B * S * N rows (project_w = false layouts); the streamed form
// where args.stream_blocks > 0, the register-resident one where args.regs_blocks > 0
void launch_project_rows(const PrepArgs& args, cudaStream_t stream);
// How many clusters of `cluster` blocks (1, 2 or 4) of the 16-bit kernel's tensor-copy form can be
// resident at once on device `dev` for operands of operand_kind with `smem` bytes of shared memory
// a block: 0 where the driver's tensor-map encoder is missing or no such cluster fits.
int outer_tc16_max_clusters(int dev, int operand_kind, int cluster, int smem, bool wide = false);
// Blocks of the 16-bit kernel's form with both phases on wgmma (without tensor copies) resident at once.
int outer_tc16_resident_blocks(int dev, int operand_kind, int smem);
int project_rows_smem_bytes(const PrepArgs& args);
// opm_project_rows_kernel's TF32 terms per product: 0 for its FMA form (x not in 16-byte vectors,
// or FLASHOPM_PROJECTION_MMA=0), 1 for 16-bit x, else PrepArgs::mma_terms.
int project_rows_mma_terms(const PrepArgs& args);
int prep_smem_bytes(int H, int rows_per_warp, bool project_w, bool whole_w = false, int C = 0);
void launch_outer(const OuterArgs& args, cudaStream_t stream);
void launch_row_denominators(const RowDenArgs& args, cudaStream_t stream);
int outer_smem_bytes();
// terms: 3 (3xTF32, float32 accuracy) or 1 (TF32)
// wgmma: phase 1 on warpgroup MMAs, a and b in the K-major layout of `terms` (kAbF32Rows16
// for 3, kAbTf32 for 1; needs outer_tc16_wgmma_built() and an sm_90 GPU); else a and b as
// (B, S, Na, H) and (B, S, N, H) float32.
// wgmma2: phase 2 on warpgroup MMAs too (tc_phase2_wgmma; needs args.w_blocked: w_out with k in
// o_k_order's order, rounded to TF32: launch_round_tf32).
// half_split: the float16 split form of "highest" (terms 3, wgmma and wgmma2; a and b in the
// kAbF32Rows32 layout rewritten by launch_split_rows_f16, args.w_blocked from launch_split_w_f16,
// args.a_exp / b_exp / w_exp / o_scale / o_exp set).
// staging: the mma.sync form's (not wgmma's) stage and W chunk sizes.
void launch_outer_tc(const OuterArgs& args, int terms, bool wgmma, bool wgmma2, bool half_split,
                     TcMmaSyncStaging staging, cudaStream_t stream);
// a or b (rows_n residues, kAbF32Rows32 layout with n_chunks chunks per batch) split in place into
// float16 high and low parts, each residue's scale exponent to exp_out (B, rows_n).
void launch_split_rows_f16(float* buf, int* exp_out, int64_t B, int64_t rows_n, int H, int64_t n_chunks,
                           cudaStream_t stream);
// W (D, H²) float32 contiguous into w_split (D·H² 32-bit slots) for the float16 split form's phase
// 2, each row's scale exponent to w_exp (D).
void launch_split_w_f16(const float* w, uint32_t* w_split, int* w_exp, int64_t D, int H, cudaStream_t stream);
// The fused projection's first kernel: each row's LayerNorm statistics (FusedProjArgs::row_stats)
// and the scale exponents of a's and b's residues (split_scale_exp of the largest
// |mask·(LN(x)·W + bias)| over s and h), as opm_split_rows_f16_kernel forms them from a and b.
struct FusedExponentArgs {
  FusedProjArgs in;  // x, LayerNorm's and the projections' parameters (skip unused)
  MaskView mask;
  int* a_exp;  // (B, N)
  int* b_exp;  // (B, N)
  int B, S, N;
};
void launch_fused_exponents(const FusedExponentArgs& args, cudaStream_t stream);
// The waves form's exponents from a bound on a and b (opm_bound_exponents_kernel; row_stats unused).
void launch_bound_exponents(const FusedExponentArgs& args, cudaStream_t stream);
// The waves form (WaveArgs) in one cooperative launch of `blocks` blocks (at most one per SM), after
// launch_bound_exponents has formed the residues' exponents.
void launch_outer_waves(const OuterArgs& args, int blocks, cudaStream_t stream);
int outer_waves_smem_bytes();
// w (n floats, in place) rounded to TF32: w_blocked for wgmma2, which reads W as it arrives
void launch_round_tf32(float* w, int64_t n, cudaStream_t stream);
// staging: the mma.sync form's stage and W chunk sizes (GPUs with less shared memory than sm_90's)
int outer_tc_smem_bytes(int H, int Ti, int Tj, bool wgmma, bool wgmma2, TcMmaSyncStaging staging = {});
// operand_kind: kMaskBFloat16 or kMaskHalf, the element type of a, b and w_out
// form: a Tc16Form, as tc16_form gives it (the wgmma forms need outer_tc16_wgmma_built() and a
// compute capability 9.0 GPU)
// max_clusters: the tensor-copy forms' clusters resident at once (each then takes several groups
// of tiles in turn), 0 for one cluster per group of tiles; for the form with both phases on wgmma
// without tensor copies, its blocks resident at once (each taking tiles in turn), 0 for one a tile
void launch_outer_tc16(const OuterArgs& args, int operand_kind, int form, int max_clusters, cudaStream_t stream);
int outer_tc16_smem_bytes(int H, int Ti, int Tj, int form);
bool outer_tc16_wgmma_built();  // the extension holds sm_90a code
// The architecture the current device's kernel code was compiled for, as __CUDA_ARCH__ / 10 (80,
// 90, ...): below the device's own where the build holds no machine code for it and the driver
// compiled PTX of an older target, whose kernels leave out what that target lacks (clusters,
// programmatic launches, warpgroup MMAs); -1 where the build holds no code the device runs.
int loaded_code_arch();
void launch_project_gemm(const ProjectArgs& args, bool big_tiles, cudaStream_t stream);
// args.mma: compute capability 8.0 or newer, pair_mma_smem_bytes(args.mask.kind) of shared memory
void launch_pair_count(const PairCountArgs& args, cudaStream_t stream);
int project_gemm_smem_bytes(bool big_tiles);

// ---- single-launch path for small problems (opm_small_kernel.cuh) ----

constexpr int kSmallWarps = 16;
constexpr int kSmallThreads = kSmallWarps * 32;

struct SmallArgs {
  const float* x;  // (B, S, N, C), unit stride along C
  int64_t x_sb, x_ss, x_sn;
  MaskView mask;
  const float* ln_w;
  const float* ln_b;
  float ln_eps;
  const float* wa;  // (H, C) contiguous
  const float* ba;  // (H) or null
  const float* wb;
  const float* bb;
  const float* w_out;  // (D, H*H) contiguous
  const float* bias;   // (D) or null
  void* out;           // (B, N, N, D) of out_kind
  int out_kind;
  Normalizer norm;
  int B, S, N, C, H, D;
  int TI, Dc, CL;  // rows i and columns d per block; blocks per cluster (along the i tiles)
  int n_itiles;    // ceil(N / TI); the grid's x is this rounded up to a multiple of CL
};

// Split of K over otherwise idle threads in the block GEMM: a power of two, at most 8, keeping
// at least 16 terms per part.
FLASHOPM_HD inline int small_gemm_ksplit(int tiles, int K) {
  int ks = 1;
  while (ks < 8 && tiles * ks * 2 <= kSmallThreads && K / (ks * 2) >= 16) ks *= 2;
  return ks;
}
FLASHOPM_HD inline int small_gemm_part_floats(int tiles, int K) {
  const int ks = small_gemm_ksplit(tiles, K);
  return ks > 1 ? (ks - 1) * tiles * 16 : 0;
}

// Shared-memory layout of opm_small_kernel, in floats; every region starts 16-byte aligned.
struct SmallLayout {
  int H4, N4, MP, MP4, Rb, ldx, ldxr, ldc;
  int bT, aT, w, den, bias, mask_a;     // live for the whole kernel
  int xt, wa, wb, gam, bet, ba, bb, mask_b, bloc, part_proj, xs;  // projection phase
  int p, part_po;                       // contraction phase (aliases the projection phase)
  int total;
};

FLASHOPM_HD inline SmallLayout small_layout(int S, int N, int C, int H, int TI, int Dc, int CL) {
  SmallLayout L{};
  L.H4 = round_up4(H);
  L.N4 = round_up4(N);
  L.MP = TI * S;
  L.MP4 = round_up4(L.MP);
  L.Rb = round_up4((S * N + CL - 1) / CL);
  const int R = L.MP4 + L.Rb;
  // Leading dimensions 4 and 8 (mod 32) make LayerNorm's row reads and transposed writes
  // conflict-free (see the kernel).
  L.ldx = R <= 4 ? 4 : (R - 4 + 31) / 32 * 32 + 4;
  L.ldxr = C <= 8 ? 8 : (C - 8 + 31) / 32 * 32 + 8;
  const int C4 = round_up4(C);
  L.ldc = C4 % 8 == 0 ? C4 + 4 : C4;  // halves the bank conflicts of the gathered weight reads
  int o = 0;
  L.bT = o;     o += S * H * L.N4;
  L.aT = o;     o += H * L.MP4;
  L.w = o;      o += round_up4(H * H * Dc);
  L.den = o;    o += round_up4(TI);
  L.bias = o;   o += Dc;
  L.mask_a = o; o += L.MP4;
  const int phase = o;
  L.xt = o;     o += C * L.ldx;
  L.wa = o;     o += H * L.ldc;
  L.wb = o;     o += H * L.ldc;
  L.gam = o;    o += C4;
  L.bet = o;    o += C4;
  L.ba = o;     o += L.H4;
  L.bb = o;     o += L.H4;
  L.mask_b = o; o += L.Rb;
  L.bloc = o;   o += H * L.Rb;
  L.part_proj = o;
  {
    const int pa = small_gemm_part_floats((L.MP4 / 4) * (L.H4 / 4), C);
    const int pb = small_gemm_part_floats((L.Rb / 4) * (L.H4 / 4), C);
    o += pa > pb ? pa : pb;
  }
  L.xs = L.bloc;  // raw x rows: dead before bloc and part_proj are first written
  if (L.xs + R * L.ldxr > o) o = L.xs + R * L.ldxr;
  const int end_proj = o;
  o = phase;
  L.p = o;      o += TI * S * H * Dc;
  L.part_po = o;
  {
    const int pp = small_gemm_part_floats((L.MP4 / 4) * (H * Dc / 4), H);
    const int po = small_gemm_part_floats((L.N4 / 4) * (TI * Dc / 4), S * H);
    o += pp > po ? pp : po;
  }
  L.total = o > end_proj ? o : end_proj;
  return L;
}

void launch_small(const SmallArgs& args, int smem_bytes, cudaStream_t stream);
// Clusters of `cluster_size` blocks with `smem_bytes` each that the device runs at once (0: none).
int small_max_active_clusters(int cluster_size, int smem_bytes);

// ---- two-launch path for small problems on tensor cores (opm_small_tc_kernel.cuh) ----
// The LayerNorm/projection kernel writes a and b as (B, N, S, H); this kernel, launched as its
// programmatic dependent, then computes per block (batch b, TI rows i, chunk of Dc columns d):
//   P[i, d, s, h2] = sum_h1 W[d, h1·H + h2] · a[i, s, h1]       (M = Dc·H, N = TI·S, K = H)
//   out[i, j, d]   = normalise(sum_{s, h2} b[j, s, h2] · P[i, d, s, h2])   (M = N, N = TI·Dc, K = S·H)
// Both are mma.sync loops (3xTF32 or TF32).  W goes from global memory straight into MMA
// fragments (each element is used once per n tile of phase P), the first loads issued before the
// wait for the projections so that they overlap the first kernel.  TI rows share each W fragment:
// W's traffic, B·N·D·H² floats over all blocks when TI = 1, is what the tiling trades against
// parallelism.
constexpr int kSmallTcWarps = 16;
constexpr int kSmallTcThreads = kSmallTcWarps * 32;
constexpr int kSmallTcMaxDc = 64;
constexpr int kSmallTcMaxTI = 8;
constexpr int kSmallTcKBatch = 4;  // k-steps of W fragments loaded at once

struct SmallTcArgs {
  // Masked projections.  The two-launch FMA form: a as (B, H, NS4), b as (B, S, H, N4) (the
  // kAbF32HStride layouts; a unused when local_a).  Otherwise both (B, N, S, H) contiguous, written
  // by the kernel itself when fused.
  float* a;
  float* b;
  // The float16 split forms: a and b as kernel 1 writes them in kAbF16Split (a16 with the strides
  // (N·S·lda, lda) for batch and row (n, s), b16 with (N·ldk, ldk) for batch and n, ldk of the
  // form's layout; the low parts a16_lo (b16_lo) halves on; exponents at a_exp + (b·N + n)·S4 + s
  // (S4 = S rounded up to 4) and b_exp + b·NS4 + n·S + s).
  const void* a16;
  const void* b16;
  int64_t a16_lo, b16_lo;
  const int* a_exp;
  const int* b_exp;
  MaskView mask;
  const float* w_out;  // (D, H*H) contiguous, 8-byte aligned
  const float* bias;   // (D) or null
  void* out;           // (B, N, N, D) of out_kind
  int out_kind;
  Normalizer norm;
  int B, S, N, H, D;
  int TI;  // rows i per block: 1, 2, 4 or 8
  int Dc;  // columns d per block: 8, 16, 32 or 64
  int f16_opts;   // the float16 split form's factors: 1 b's per thread in phase O, 2 a's per thread in P
  int fma;        // the float32 FMA form (small_tc_fma_layout) rather than mma.sync
  int f16;        // the float16 split form (opm_small_f16_kernel, small_f16_layout)
  int f16_chain;  // ... chained (opm_small_f16_chain_kernel<f16_chain>, small_f16_chain_layout):
                  // its m tiles of j, 1-3; 0 for the staged form
  int fused;      // the kernel projects the rows itself (cooperative launch, float32 x)
  int local_a;    // the FMA form projects its own rows of a and runs phase P before the wait
                  // (float32 x; the first kernel writes b alone)
  int local_a_vec;  // ... with its weights, LayerNorm's parameters and x's rows copied in 16-byte pieces
  // Where the kernel lets the next kernel on the stream start (griddepcontrol.launch_dependents),
  // if that one was launched as its programmatic dependent: 0 at the end (no early signal), 1 at
  // the start, 2 before the epilogue (the chained form; the others at the start)
  int trigger_next;
  // The chained form in two launches, in clusters of two blocks along d (gridDim.x even): the
  // pair's rows of a and b are the same, so each block copies half of them into both blocks
  // (bulk copies multicast to the cluster), half the L2 traffic after the wait
  int pair_copies;
  PrepArgs prep;  // the projections' inputs, when fused or local_a
};

// Shared-memory layout (floats; every region 16-byte aligned).  Leading dimensions of 4 (mod 32)
// make the fragment reads (lanes: rows g, columns t) conflict-free.
struct SmallTcLayout {
  int R8, N16, lda, ldb, ldps, ldp, ldr, kparts;
  int a, b, p, red, pair, bias, den;
  int w, ldw;  // the float32 FMA form only: W's chunk in shared memory
  int total;
};

// Phase O's columns (i, d) in groups of kSmallTcMaxDc, one group per warp item.
FLASHOPM_HD inline int small_tc_col_groups(int TI, int Dc) { return (TI * Dc + kSmallTcMaxDc - 1) / kSmallTcMaxDc; }

// K split of phase O: enough (tile of rows j, group of columns, part of K) items for every warp,
// at most one part per k-step.
FLASHOPM_HD inline int small_tc_kparts(int TI, int Dc, int N16, int K8) {
  int kp = kSmallTcWarps / (small_tc_col_groups(TI, Dc) * (N16 / 16));
  if (kp < 1) kp = 1;
  return kp < K8 ? kp : K8;
}

// The regions both forms end with, from offset o: pair counts, bias, row denominators.
FLASHOPM_HD inline void small_tc_layout_tail(SmallTcLayout& L, int o, int TI, int Dc) {
  L.pair = o; o += TI * L.N16;
  L.bias = o; o += round_up4(Dc);
  L.den = o;  o += kSmallTcMaxTI;
  L.total = o;
}

FLASHOPM_HD inline SmallTcLayout small_tc_layout(int S, int N, int H, int TI, int Dc) {
  SmallTcLayout L{};
  L.R8 = (TI * S + 7) / 8 * 8;  // rows (i, s) of a, padded to a tile of 8
  L.N16 = (N + 15) / 16 * 16;
  const int SH = S * H;
  L.lda = H + 4;
  L.ldb = (SH + 31) / 32 * 32 + 4;
  // P as [i][d][s][h2]: rows of s padded to H + 4, so that phase P's 8-byte stores (lanes along
  // h2 and s) and phase O's reads (lanes along d and h2) are both conflict-free.
  L.ldps = H + 4;
  L.ldp = (S * L.ldps + 31) / 32 * 32 + 4;
  L.ldr = (TI * Dc) % 16 == 0 ? TI * Dc + 8 : TI * Dc;  // rows j of phase O's columns (i, d)
  L.kparts = small_tc_kparts(TI, Dc, L.N16, SH / 8);
  int o = 0;
  L.a = o;    o += L.R8 * L.lda;
  L.b = o;    o += L.N16 * L.ldb;
  L.p = o;    o += TI * Dc * L.ldp;
  L.red = o;  o += L.kparts * L.N16 * L.ldr;
  small_tc_layout_tail(L, o, TI, Dc);
  return L;
}

// Rows j of phase O's register tiles in the FMA form (each tile kSmallFmaRowsO x 4 columns (i, d);
// phase P's tiles are 4 x 4).  With 8 rows the loop reads 3 float4 from shared memory per 32 FMAs
// (4 x 4: 2 per 16) and O's K parts give work to half the threads.  At the specification's shape
// 8 and 4 rows measured the same (13.8 us); 8 x 4 tiles in phase P were slower (15.0 against 14.7).
constexpr int kSmallFmaRowsO = 8;

// The float32 FMA form of the same kernel (kTerms = 0: exact float32 sums, register tiles from
// float4 operands, where W's chunk fits in shared memory):
//   w   [H·H][ldw = Dc + 4]        W[d0 + d, k] at k·ldw + d
//   a   [H][lda ≥ round4(TI·S)]    a transposed, columns (i, s)
//   b   [S·H][ldb ≥ round4(N)]     b transposed, columns j
// Leading dimensions of 4 (mod 8): the transposing 4-byte copies (lanes along the rows) meet at
// most 4-way bank conflicts, and the float4 reads of P's and O's loops none.
//   p   [S·H][ldp = TI·Dc + 4]     P transposed: P[i, d, s, h2] at (s·H + h2)·ldp + i·Dc + d
//   red [kparts][N16][ldr]         as in the mma.sync form
FLASHOPM_HD inline SmallTcLayout small_tc_fma_layout(int S, int N, int H, int TI, int Dc) {
  SmallTcLayout L{};
  const int SH = S * H, cols = TI * Dc;
  L.N16 = (N + 15) / 16 * 16;
  L.ldw = Dc + 4;
  L.lda = round_up4_odd_quad(TI * S);
  L.ldb = round_up4_odd_quad(N);
  L.ldp = cols + 4;
  L.ldr = cols % 16 == 0 ? cols + 8 : cols;
  const int tiles_o = ((N + kSmallFmaRowsO - 1) / kSmallFmaRowsO) * (cols / 4);
  int kp = kSmallTcThreads * 4 / kSmallFmaRowsO / tiles_o;
  L.kparts = kp < 1 ? 1 : kp < SH ? kp : SH;
  int o = 0;
  L.w = o;    o += H * H * L.ldw;
  L.a = o;    o += H * L.lda;
  L.b = o;    o += SH * L.ldb;
  L.p = o;    o += SH * L.ldp;
  L.red = o;  o += L.kparts * L.N16 * L.ldr;
  small_tc_layout_tail(L, o, TI, Dc);
  return L;
}

// The float16 split form (opm_small_f16_kernel; hidden 16, 32 or 64): phases P and O on mma.sync
// m16n8k16 with every operand split into float16 high and low parts after scaling by a power of
// two (see kSplitTopExp), three MMAs per product.  Regions (byte offsets; 16-bit rows padded so
// that the eight 16-byte rows an ldmatrix reads fall in distinct banks):
//   w    [2][Dc·H][ldw = H + 8]      W[d0 + d, h1·H + h2] at (d·H + h1)·ldw + h2, high then low parts
//   a    [2][R16][lda = H + 8]       a[i0 + r / S, r % S, h1] at r·lda + h1
//   b    [2][N16][ldk]               b[j, s, h2] at j·ldk + s·(H + 8) + h2
//   p    [2][NP][ldk]                P[i, d, s, h2] at (i·Dc + d)·ldk + s·(H + 8) + h2 (NP: columns
//                                    (i, d) rounded up to a group of phase O's n tiles)
//   red  [kparts][N16][ldr] floats   phase O's K parts, over W's region (W is dead after phase P)
//   a_st [TI·S·H], b_st [N·S·H]      the float32 rows of a and b as copied
//   then the floats of small_tc_layout_tail and the scale exponents of a's rows i and b's rows j.
// k = (s, h2) runs in blocks of H padded by 8, so that phase P's stores (lanes along s) meet no
// bank conflicts; ldk is an odd number of 16-byte pieces.
constexpr int kSmallF16GroupN = 4;  // phase O's n tiles (8 columns (i, d) each) per warp item
struct SmallF16Layout {
  int R16, N16, NP, lda, ldw, ldk, ldr, kparts, NS4;
  int S4;  // S rounded up to 4: a's exponents per residue n, in the workspace and in e_a_st
  int w, a, b, p, red, e_b_st, e_a_st, p_f, b_f, pair, bias, den, e_a, e_b, bars, total;  // bytes
};
FLASHOPM_HD inline SmallF16Layout small_f16_layout(int S, int N, int H, int TI, int Dc) {
  SmallF16Layout L{};
  const int cols = TI * Dc, group = 8 * kSmallF16GroupN;
  L.R16 = (TI * S + 15) / 16 * 16;
  L.N16 = (N + 15) / 16 * 16;
  L.NP = (cols + group - 1) / group * group;
  L.lda = L.ldw = H + 8;
  L.ldk = S * (H + 8) + (S % 2 == 0 ? 8 : 0);  // S·(H + 8) / 8 has the parity of S (H % 16 == 0)
  L.ldr = cols + (8 - cols % 32 + 32) % 32;    // 8 (mod 32): phase O's 8-byte stores meet no conflicts
  const int tiles = (L.N16 / 16) * ((cols / 8 + kSmallF16GroupN - 1) / kSmallF16GroupN);
  const int ksteps = S * H / 16;
  const int kp = kSmallTcWarps / tiles;
  L.kparts = kp < 1 ? 1 : kp < ksteps ? kp : ksteps;
  const int w_bytes = 2 * Dc * H * L.ldw * 2, red_bytes = L.kparts * L.N16 * L.ldr * 4;
  int o = 0;
  L.w = L.red = o;  o += w_bytes > red_bytes ? w_bytes : red_bytes;
  L.a = o;          o += 2 * L.R16 * L.lda * 2;
  L.b = o;          o += 2 * L.N16 * L.ldk * 2;
  L.p = o;          o += 2 * L.NP * L.ldk * 2;
  L.NS4 = round_up4(N * S);
  L.e_b_st = o;     o += L.NS4 * 4;         // b's rows' exponents as kernel 1 wrote them
  L.S4 = round_up4(S);
  L.e_a_st = o;     o += TI * L.S4 * 4;      // the block's rows of a's exponents, likewise
  L.p_f = o;        o += L.R16 * 4;          // phase P's factor per row (i, s)
  L.b_f = o;        o += S * L.N16 * 4;      // phase O's factor per (s, row j)
  L.pair = o;       o += TI * L.N16 * 4;
  L.bias = o;       o += round_up4(Dc) * 4;
  L.den = o;        o += kSmallTcMaxTI * 4;
  L.e_a = o;        o += kSmallTcMaxTI * 4;
  L.e_b = o;        o += L.N16 * 4;
  L.bars = (o + 7) / 8 * 8;  o = L.bars + 16;  // two mbarriers: a's copies, b's
  L.total = o;
  return L;
}

// The chained float16 split form (opm_small_f16_chain_kernel; hidden 32, N <= 48): phase P's tile
// goes from its accumulators straight into phase O's operands, so P is never stored.  Phase P per
// warp item is P[(h2, d), s] = sum_h1 W[d, h1·H + h2] a[(i, s), h1] for a pair of h2 and eight d
// (M = 16) and eight s (N = 8); its accumulator fragment is, element for element, the B fragment of
// out[j, d] += sum_k b[j, k] P[k, d] over k = (h2 pair, eight s).  So b's rows run along
// k = (s / 8, h2, s % 8) (ldk halves, S padded to S8 with zeros by kernel 1), W's chunk is staged
// as rows (h2, d) of h1 (each quad of h2 kSmallF16ChainSkew halves further on, so that the
// prologue's stores of four h2 quads meet no bank conflicts), and a's rows (i, s) are as in the
// staged form.  Regions (bytes, each a multiple of 16): W's high and low parts, the K parts, a's
// parts (TI·S rows), a zero row (a's rows past S), b's parts, b's and a's exponents, then the
// tail of small_f16_layout.
constexpr int kSmallF16ChainIG = 2;     // rows i per warp item (their P fragments share W's)
// Rows j per warp item: all of them, in m tiles of 16.  Up to three tiles, since at four (128
// registers, which leave no room for the first kernel's blocks beside this kernel's) the staged
// form was faster: 12.9 against 14.6 us at (1,8,64,64,32,64), within 0.2 us of it at B = 2.
constexpr int kSmallF16ChainMaxN = 48;
constexpr int kSmallF16ChainSkew = 16;  // halves between W's rows of consecutive h2 quads, past ldw
// The chained form in one cooperative launch (SmallTcArgs::fused): the block's first warps project
// its share of the rows (b, s, n) while the others split W's chunk.
constexpr int kSmallF16FusedProjWarps = 4;
// Shared memory that projection takes (bytes, in the items' sums region): opm_prep_kernel's
// whole-weights layout for the projecting warps.
FLASHOPM_HD inline int64_t small_f16_fused_proj_bytes(int C) {
  return prep_whole_smem_floats(C, kSmallF16FusedProjWarps) * 4;
}
struct SmallF16ChainLayout {
  int N16, S8, RA, lda, ldw, ldk, ldr, kparts, NS4, S4;
  int wq;  // halves per part (high, low) of W's chunk: H·Dc rows and the quads' skews
  int w, red, a, zero, b, e_b_st, e_a_st, pair, bias, den, e_a, e_b, bars, total;  // bytes
};
FLASHOPM_HD inline SmallF16ChainLayout small_f16_chain_layout(int S, int N, int H, int TI, int Dc) {
  SmallF16ChainLayout L{};
  L.N16 = (N + 15) / 16 * 16;
  L.S8 = (S + 7) / 8 * 8;
  L.RA = TI * S;
  L.lda = L.ldw = H + 8;  // an odd number of 16-byte pieces: the fragments' rows meet no conflicts
  L.ldk = L.S8 * H + 8;   // S8·H / 8 is even
  const int cols = TI * Dc;
  L.ldr = cols + (8 - cols % 32 + 32) % 32;
  const int groups = (TI + kSmallF16ChainIG - 1) / kSmallF16ChainIG * (Dc / 8);
  const int ksteps = H / 2 * (L.S8 / 8);
  // groups and kSmallTcWarps are powers of two, and ksteps a multiple of 16: kparts is a power of
  // two that divides ksteps
  const int kp = kSmallTcWarps / groups;
  L.kparts = kp < 1 ? 1 : kp < ksteps ? kp : ksteps;
  int o = 0;
  L.wq = H * Dc * L.ldw + H / 4 * kSmallF16ChainSkew;
  L.w = o;       o += 2 * L.wq * 2;
  L.red = o;     o += L.kparts * L.N16 * L.ldr * 4;
  L.a = o;       o += 2 * L.RA * L.lda * 2;
  L.zero = o;    o += L.lda * 2;
  L.b = o;       o += 2 * L.N16 * L.ldk * 2;
  L.NS4 = round_up4(N * S);
  L.e_b_st = o;  o += L.NS4 * 4;
  L.S4 = round_up4(S);
  L.e_a_st = o;  o += TI * L.S4 * 4;
  L.pair = o;    o += TI * L.N16 * 4;
  L.bias = o;    o += round_up4(Dc) * 4;
  L.den = o;     o += kSmallTcMaxTI * 4;
  L.e_a = o;     o += kSmallTcMaxTI * 4;
  L.e_b = o;     o += L.N16 * 4;
  L.bars = (o + 7) / 8 * 8;  o = L.bars + 16;
  L.total = o;
  return L;
}

// Rows of the fused form's projections per block, and whether its staged weights and normalised
// rows fit in the regions it borrows (P and the K parts).
constexpr int kSmallTcFusedMaxRows = kSmallTcWarps;  // one pass (each pass waits for its rows of x)
FLASHOPM_HD inline int64_t small_tc_proj_wt_floats(int C, int H) { return int64_t(C) * (2 * H + 1); }
FLASHOPM_HD inline bool small_tc_fused_fits(const SmallTcLayout& L, int C, int H) {
  return small_tc_proj_wt_floats(C, H) + int64_t(kSmallTcWarps) * C <= int64_t(L.pair - L.p);
}

// The local-a form's scratch before phase P, in the regions of b, P and the K parts (offsets in
// floats): W_a as [H][ldwa] (ldwa = 4 mod 8: the projection's float4 reads along lanes h are
// conflict-free), the block's rows of x as [rows][ldx] (rows = TI·S), LayerNorm's weight and bias
// (ldx each), b_a (H) and the rows' mask values (rows).  vec: the copies in 16-byte pieces
// (small_tc_local_a_vec).  end: one past the last.
struct SmallTcLocalA {
  int64_t wa, xs, lnw, lnb, ba, mask, end;
  int ldwa, ldx, vec;
};
FLASHOPM_HD inline SmallTcLocalA small_tc_local_a_layout(const SmallTcLayout& L, int C, int H, int rows, int vec) {
  SmallTcLocalA A{};
  A.ldwa = round_up4_odd_quad(C);
  A.ldx = round_up4(C);
  A.vec = vec;
  A.wa = L.b;
  A.xs = A.wa + int64_t(H) * A.ldwa;
  A.lnw = A.xs + int64_t(rows) * A.ldx;
  A.lnb = A.lnw + A.ldx;
  A.ba = A.lnb + A.ldx;
  A.mask = A.ba + round_up4(H);
  A.end = A.mask + rows;
  return A;
}
FLASHOPM_HD inline bool small_tc_local_a_fits(const SmallTcLayout& L, int C, int H, int rows) {
  return small_tc_local_a_layout(L, C, H, rows, 0).end <= int64_t(L.pair);
}

// Launches the second kernel of the pair (after launch_prep on the same stream) as a
// programmatic dependent of the first, or (args.fused) alone as a cooperative launch whose grid
// the device holds at once; terms as for launch_outer_tc.
void launch_small_tc(const SmallTcArgs& args, int terms, cudaStream_t stream);
int small_tc_smem_bytes(int S, int N, int H, int TI, int Dc, bool fma);

// ---- Backward of the outer-first contraction (opm_backward_kernel.cuh) ----
// With g = dL/d(out) already divided by the normaliser, (B, Nr, Nc, Dp) with Dp = D rounded up to 4
// (the pad is zero), a (B, S, Nr, H), b (B, S, Nc, H) and W (D, H, H):
//   grad_a[s,i,h1] = sum_j sum_h2 (sum_d g[i,j,d] W[d,h1,h2]) b[s,j,h2]       (opm_bwd_side_kernel)
//   grad_b: the same with i <-> j, a <-> b and W's h1 <-> h2 swapped
//   grad_W[d,h1,h2] = sum_{i,j} g[i,j,d] sum_s a[s,i,h1] b[s,j,h2]           (opm_bwd_w_kernel)
// Both kernels chain two tensor-core GEMMs per tile and keep the (pairs x H·H) intermediate on chip.
// hidden_dim must be 16, 32 or 64 (a chunk of h1 values times H fills the tile's columns).
// Both run blocks of 4 warps (wide warp tiles: fewer fragment loads and splits per MMA), two per SM.
constexpr int kBwThreads = 128;
constexpr int kBwK = 32;         // k per pipeline stage
constexpr int kBwStages = 3;
constexpr int kBwLdK = kBwK + 4;      // K-major rows of 32: = 4 (mod 32), conflict-free fragments
// Side kernel: 64 rows (i, h1) x kBwSB s per block; tiles of 64 pairs (i, j) x 128 (h1, h2).
constexpr int kBwSideCols = 128;      // (h1 in the block's chunk, h2): GEMM 1's N, GEMM 2's K per tile
constexpr int kBwSideRows = 64;       // (i, h1): GEMM 2's M; also the pairs of a tile
constexpr int kBwSB = 128;            // s per block
constexpr int kBwLdN = kBwSideCols + 8;   // N-major rows of 128: = 8 (mod 32)
constexpr int kBwLdDs = kBwSideCols + 4;  // the dO tile, K-major
constexpr int kBwSideXFloats = kBwSideRows * kBwLdK;                     // g: 64 pairs x 32 d
constexpr int kBwSideStageFloats = kBwSideXFloats + kBwK * kBwLdN;       // + W: 32 d x 128
static_assert(kBwSB * kBwLdK <= kBwSideStageFloats, "side kernel: the y stage does not fit");
constexpr int kBwSideSmemFloats = kBwStages * kBwSideStageFloats + kBwSideRows * kBwLdDs;
// W kernel: 64 columns (h1, h2) of grad_W x 128 d per block; tiles of 64 (i, h1) x 64 (j, h2),
// 64 pairs.
constexpr int kBwWCols = 64;
constexpr int kBwWPairs = 64;
constexpr int kBwWDG = 128;                     // d per block
constexpr int kBwLd64 = 64 + 8;                 // M/N-major rows of 64: = 8 (mod 32)
constexpr int kBwWGLd = kBwWDG + 8;             // g: 32 pairs x 128 d, N-major
constexpr int kBwWStageFloats = 2 * kBwK * kBwLd64;  // a and b: 32 s x 64 each
static_assert(kBwK * kBwWGLd <= kBwWStageFloats, "w kernel: the g stage does not fit");
constexpr int kBwWSmemFloats = kBwStages * kBwWStageFloats + kBwWPairs * kBwLd64;

struct BwdSideArgs {
  const float* g;    // rows r, columns c: g + b·gs_b + r·gs_r + c·gs_c, Dp floats each
  const float* w;    // (D, H, H) as this side sees it (h1 = its own hidden index)
  const float* y;    // (B, S, Nc, H): the other side's projection
  float* grad;       // (jsplits, B, S, Nr, H): one partial sum per split of the columns
  int64_t gs_b, gs_r, gs_c;
  int B, S, Nr, Nc, H, D, Dp;
  int n_sblocks;     // blocks of kBwSB along s
  int jsplits;       // blocks sharing the columns of one row block (column tiles jt = split mod jsplits)
  // The float16 split form (opm_bwd_side_f16_kernel) reads W and y split instead of w and y:
  const uint32_t* w_split;  // (ceil(D / 32), H·H, 32) from opm_split_side_w_kernel
  const float* w_inv;       // (H·H,)
  const uint32_t* y_split;  // (B, Nc·H / 32, S, 32) from opm_split_side_y_kernel
  const float* y_inv;       // (B, S)
};

// The side kernel's float16 split form on warpgroup MMAs (sm_90a, hidden_dim 32, "highest"): the
// sums of opm_bwd_side_kernel with float32 accuracy from three float16 MMAs per product, as the
// forward's split form.  Scales (powers of two, see kSplitTopExp), each constant along the K of
// the MMAs that use it between two float32 retirements:
//   GEMM 1 (dO = g·W over d): g per (pair, chunk of 32 d), formed in the kernel from float32 g
//     (or once for both sides before them: launch_bwd_side_f16's g_inv);
//     W per column (h1, h2) over all d (opm_split_side_w_kernel), taken out as dO is formed.
//   GEMM 2 (grad = dO·y over (j, h2)): dO per (row (i, h1), chunk of 32 (j, h2)) as the kernel
//     stores it; y per s over all (j, h2) (opm_split_side_y_kernel), taken out in the epilogue.
// Shared memory (bytes from a 1 KB boundary): kBwStages stages, each a 16 KB slot of split rows
// (W: 128 columns x 32 d; y: 128 s x 32 k) and g's float32 chunk (64 pairs x 32 d, rows of
// kBsfGLd floats); dO split (4 chunks of 64 rows x 128 bytes); dO's inverse scales (64 x 4
// floats); W's inverse scales for the block's 128 columns.
constexpr int kBsfSlotBytes = kBwSideCols * 128;
constexpr int kBsfGLd = kBwK + 8;  // = 8 (mod 32): 8-byte fragment loads without bank conflicts
constexpr int kBsfGBytes = kBwSideRows * kBsfGLd * 4;
constexpr int kBsfStageBytes = kBsfSlotBytes + kBsfGBytes;
static_assert(kBsfStageBytes % 1024 == 0, "side kernel f16: every stage's slot on a 1 KB boundary");
constexpr int kBsfDoChunks = kBwSideCols / 32;
constexpr int kBsfDoBytes = kBsfDoChunks * kBwSideRows * 128;
constexpr int kBsfSmemBytes =
    1024 + kBwStages * kBsfStageBytes + kBsfDoBytes + (kBwSideRows * kBsfDoChunks + kBwSideCols) * 4;
static_assert(kBsfSmemBytes <= 113 * 1024, "side kernel f16: two blocks per SM");

struct BwdWArgs {
  const float* g;    // (B, Nr, Nc, Dp)
  const float* a;    // (B, S, Nr, H)
  const float* b;    // (B, S, Nc, H)
  float* ws;         // (splits, D, H·H): one partial sum per split of the tiles
  int B, S, Nr, Nc, H, D, Dp;
  // The float16 split form (opm_bwd_w_f16_kernel) reads a and b split instead
  // (opm_split_ab_f16_kernel): (B, ceil(S / 32), N, H, 32) and their inverse scales (B, N).
  const uint32_t* a_split;
  const uint32_t* b_split;
  const float* a_inv;
  const float* b_inv;
  // Non-null: g is the caller's to overwrite, and launch_bwd_w_f16 splits it in place once
  // (opm_split_w_g_kernel) into the pieces the W kernel's GEMM 2 reads, with each piece's row
  // factors here ([chunk][Dp], w_g_split_chunks chunks), where every block along h1 converted
  // each chunk of g itself.  Only where w_g_split_fits.
  float* g_inv_split;
};

// The W kernel's float16 split form on warpgroup MMAs (sm_90a, hidden_dim 32): the tile and sums
// of opm_bwd_w_kernel, one warpgroup per block.  Scales (powers of two, see kSplitTopExp):
//   GEMM 1 (O = a·b over s): a and b per residue over (s, h) (opm_split_ab_f16_kernel), so a
//     chunk's products add to O' = O·2^(e_i + e_j) without a factor; O' by its bound
//     |O'| < S·2^30 (one power of two) as GEMM 2's B.
//   GEMM 2 (grad_W[d, k] = sum over pairs of g[pair, d]·O[pair, k]): g·2^-(e_i + e_j) per
//     (d, chunk of 32 pairs), split in the kernel from float32 g (or once before it, in place:
//     opm_split_w_g_kernel, BwdWArgs::g_inv_split), as A (rows d).
// Shared memory (bytes from a 1 KB boundary): kBwStages stages of 16 KB (a's and b's split rows
// for 32 s, or g's float32 chunk of 32 pairs x 128 d); g's split chunk (two halves of 64 d, hi
// then lo, 16 KB); O' split (64 pairs x 64 k, hi then lo, 16 KB); the tile's pair factors (64
// floats) and the chunk's row factors (128 floats).
constexpr int kBwfStageBytes = 16384;
constexpr int kBwfGsBytes = 16384;
constexpr int kBwfOsBytes = 16384;
constexpr int kBwfSmemBytes = 1024 + kBwStages * kBwfStageBytes + kBwfGsBytes + kBwfOsBytes + (64 + kBwWDG) * 4;
static_assert(kBwfSmemBytes <= 113 * 1024, "w kernel f16: two blocks per SM");
// With GEMM 1's chunks in overlapping pairs (the kernel's kOverlap): one stage more.
constexpr int kBwfOverlapStages = kBwStages + 1;
constexpr int kBwfOverlapSmemBytes = kBwfSmemBytes + kBwfStageBytes;
static_assert(kBwfOverlapSmemBytes <= 113 * 1024, "w kernel f16, overlapped: two blocks per SM");
// g split once for the W kernel's float16 split form (hidden_dim 32): a unit is one tile's chunk
// of 32 pairs (16 i x 2 j) for one block of kBwWDG d; the split needs every unit whole (rows
// in whole tiles of 32, columns in pairs, d in whole blocks).  Its row factors: Dp floats per
// chunk of pairs.
inline bool w_g_split_fits(int64_t Nr, int64_t Nc, int64_t Dp) {
  return Nr % 32 == 0 && Nc % 2 == 0 && Dp % kBwWDG == 0;
}
inline int64_t w_g_split_chunks(int64_t B, int64_t Nr, int64_t Nc) { return B * (Nr / 32) * (Nc / 2) * (kBwWPairs / 32); }

void launch_bwd_side(const BwdSideArgs& args, int terms, cudaStream_t stream);
// The float16 split form of the side kernel and the splits it reads (hidden_dim 32, sm_90a):
//   args.w (D, H·H) as given, in its side's view (swap_hh: h1 and h2 exchanged, as for grad_b), into
//   args.w_split / args.w_inv,
//   y (B, S, Nc, H) into args.y_split / args.y_inv, then the kernel.
// terms: 3 (float32 accuracy) or 1 (the high parts alone: TF32's rounding, for "high").
// g_inv, if not null: g arrives split for both sides (launch_grad_scale_side_split), each pair's
// chunk of 32 d as its 128 bytes of float16 high then low parts, the chunk's factor 2^-e at
// g_inv[(offset of the chunk in g) / 32] (Dp a multiple of 32).
void launch_bwd_side_f16(const BwdSideArgs& args, const float* g_inv, bool swap_hh, int terms, cudaStream_t stream);
// The float16 split form of the W kernel (hidden_dim 32, sm_90a): a and b split into
// args.a_split / a_inv and b_split / b_inv, then (args.g_inv_split set) g split in place, then
// the kernel over `splits` splits of the tiles; terms as for the side kernel.
// overlap: GEMM 1's chunks in overlapping pairs (opm_bwd_w_f16_kernel's kOverlap;
// kBwfOverlapSmemBytes of shared memory).
void launch_bwd_w_f16(const BwdWArgs& args, int splits, int terms, bool overlap, cudaStream_t stream);
void launch_bwd_w(const BwdWArgs& args, int splits, int terms, cudaStream_t stream);

// g = grad_out / divisor in one pass over grad_out (opm_grad_scale_kernel); the divisor of pair
// (b, i, j) as `normalise` applies it:
//   kNormRow      max(sum_s m[b,s,i], 1)   (from the mask, per row)
//   kNormOpenFold eps + pair[b,i,j]         kNormBoltz  max(pair[b,i,j], 1)
// grad_out and g in any element kind (MaskKind: float32, float16, bfloat16); vec4: D % 4 == 0 and
// both pointers aligned to four elements, so that each thread moves four elements at a time.
// by_pair: each thread keeps the same columns in every row (D, or D / 4 with vec4, at most
// kGradScaleThreads); then bias_part, if not null, gets each block's column sums of the bias
// gradient's terms (grad_out, or g for kNormOpenFold, which divides the bias too) in float64, or,
// in a grid of one block, bias_out the sums themselves (float32).
struct GradScaleArgs {
  const void* go;     // (B, N, N, D), contiguous, go_kind
  void* g;            // (B, N, N, D), contiguous, g_kind
  MaskView mask;      // (B, S, N): kNormRow's divisors
  const float* pair;  // (B, N, N): sum_s m[b,s,i] m[b,s,j] (the other conventions), else null
  Normalizer norm;
  int B, S, N, D;
  double* bias_part;  // (blocks, D) or null
  float* bias_out;    // (D,) or null: one block only
  int go_kind, g_kind;
  int chunk_rows;     // rows (b, i) per block at a time, <= kGradScaleMaxChunkRows, chunk_rows * N < 2^31
  bool vec4, by_pair;
  // Non-null: the side form (launch_grad_scale_side_split): g's bytes get the split for the side
  // kernels (launch_bwd_side_f16's g_inv) instead of float32 g, the factors here.
  float* side_inv;
};
constexpr int kGradScaleThreads = 256;
constexpr int kGradScaleMaxChunkRows = 64;
constexpr int kGradScaleBatch = 4;  // loads in flight per thread (8 spills at 128 registers)
// At most this many elements of grad_out go to one block when the bias gradient is summed too
// (about eight rounds of kGradScaleBatch loads per thread: a few microseconds; 2^17 took 124 us in
// one block with one load in flight per thread).
constexpr int64_t kGradScaleOneBlockElems = int64_t(1) << 15;
void launch_grad_scale(const GradScaleArgs& args, int blocks, cudaStream_t stream);
// g = grad_out / divisor as launch_grad_scale forms it (the same bits), each pair's chunk of 32
// columns then scaled by the power of two of its largest magnitude and split as
// opm_bwd_side_f16_kernel splits it (launch_bwd_side_f16's g_inv): 128 bytes, the 32 float16 high parts then
// the 32 low parts, in the chunk's own bytes of g; 2^-e to args.side_inv[pair·D / 32 + chunk].
// Needs by_pair, vec4, float32 g, D a multiple of 32 and no bias sums.
inline bool grad_scale_side_split_fits(const GradScaleArgs& args) {
  return args.by_pair && args.vec4 && args.g_kind == kMaskFloat && args.D % 32 == 0 && args.bias_part == nullptr &&
         args.bias_out == nullptr;
}
void launch_grad_scale_side_split(const GradScaleArgs& args, int blocks, cudaStream_t stream);
// bias[d] = sum over blocks of part[block][d] (float64 sums in block order, rounded once).
void launch_bias_grad_reduce(const double* part, int blocks, int D, float* bias, cudaStream_t stream);

// Up to eight small tensors converted in one launch (a 16-bit model's parameters to float32, its
// gradients back): dst[k][e] = src[k][e] for e < n[k], both contiguous, with element kinds
// src_kind[k] and dst_kind[k] (MaskKind; stores round to nearest even, as ATen's conversions).
struct ConvertArgs {
  const void* src[8];
  void* dst[8];
  int64_t n[8];
  int src_kind[8];
  int dst_kind[8];
  int count;
};
void launch_convert(const ConvertArgs& args, cudaStream_t stream);
// W (D, H²) of 16-bit elements copied into o_k_order's blocks (the 16-bit kernel's wgmma phase 2):
// one launch where a 5-D transposed clone costs ~50 us of host time a call (run 342's profile).
void launch_block_w16(const void* w, void* w_blocked, int64_t D, int H, cudaStream_t stream);

// Whether launches go through the driver's cuLaunchKernelEx (the default) or the runtime's
// cudaLaunchKernelEx: set_driver_launch returns the previous setting.  Both give the same bits; the
// switch lets the tests and the host-time measurements compare the two routes in one process.
bool driver_launch();
bool set_driver_launch(bool enabled);

// Launch batches: between begin_launch_batch and end_launch_batch the launchers above record their
// launches on the calling thread, and end_launch_batch sends them as one launch of a CUDA graph
// holding the same launches (instantiated once per sequence of kernels, grids and attributes;
// each call sets its own parameters).  begin_launch_batch returns false, and the launches go out
// one by one as they come, where the stream is being captured (they join the caller's graph),
// under FLASHOPM_GRAPH_LAUNCH=0, or after set_graph_launch(false).  Only launches on `stream`
// with nothing else enqueued between them may be batched: they run when the batch is sent.
bool begin_launch_batch(cudaStream_t stream);
void end_launch_batch(cudaStream_t stream);
void abandon_launch_batch();
bool graph_launch();
bool set_graph_launch(bool enabled);
// In this process, over all devices: graphs built, graph launches, sequences of launches no graph
// could be built for (they go out one by one), and the last such failure's step and error.
struct GraphLaunchCounts {
  uint64_t built, launched, failed;
  std::string last_failure;
};
GraphLaunchCounts graph_launch_counts();

// The launches made in its lifetime, up to send(), batched as above; a scope left by an
// exception drops what it recorded.
class LaunchBatchScope {
 public:
  explicit LaunchBatchScope(cudaStream_t stream) : stream_(stream), active_(begin_launch_batch(stream)) {}
  ~LaunchBatchScope() {
    if (active_) abandon_launch_batch();
  }
  LaunchBatchScope(const LaunchBatchScope&) = delete;
  LaunchBatchScope& operator=(const LaunchBatchScope&) = delete;
  void send() {
    if (!active_) return;
    active_ = false;
    end_launch_batch(stream_);
  }

 private:
  cudaStream_t stream_;
  bool active_;
};

// Partial sums of split grids added up, up to four tensors in one launch:
//   out[k][e] = sum_{q < parts[k]} in[k][q · n[k] + e]   for e < n[k], q in order (deterministic).
struct SumPartsArgs {
  const float* in[4];
  float* out[4];
  int64_t n[4];
  int parts[4];
  int count;
};
constexpr int kSumPartsThreads = 256;
void launch_sum_parts(const SumPartsArgs& args, cudaStream_t stream);
// y (D, H, H) = x (D, H, H) with the last two axes swapped, both contiguous float32.
void launch_transpose_hh(const float* x, float* y, int H, int64_t D, int sm_count, cudaStream_t stream);
// The two middle axes of a contiguous (P, V, U, L) tensor swapped: y (P, U, V, L), contiguous,
// with each run of L elements a whole number of 16-byte pieces (`run` of them), both pointers
// 16-byte aligned (opm_swap_middle_kernel).  total = P * U * V * run pieces.
struct SwapMiddleArgs {
  const void* x;
  void* y;
  int64_t U, V, run, total;
};
constexpr int kSwapThreads = 256;
constexpr int kSwapPieces = 4;
void launch_swap_middle(const SwapMiddleArgs& args, int sm_count, cudaStream_t stream);
int bwd_side_smem_bytes();
int bwd_w_smem_bytes();

// ---- Backward of LayerNorm, both projections and the mask (opm_ln_backward_kernel.cuh) ----
// Per row r = (b, s, n), with xhat = (x - mean) * rstd, xn = xhat * ln_w + ln_b and the masked
// gradients ga = grad_a * m, gb = grad_b * m (H each):
//   grad_xn = ga · W_a + gb · W_b,  gxhat = grad_xn * ln_w
//   grad_x  = rstd * (gxhat - mean_c(gxhat) - xhat * mean_c(gxhat * xhat))
// and, summed over rows, dW_a = ga^T xn, dW_b = gb^T xn, d ln_w = sum grad_xn * xhat,
// d ln_b = sum grad_xn, d b_a = sum ga, d b_b = sum gb.  LayerNorm's statistics are recomputed.
// A block takes tiles of rows in turn; its threads form row groups of col_lanes threads, each
// thread kLnBwdRows rows x kCols columns (c = lane + k * col_lanes).  The parameter sums are
// written per block (partial) and added by opm_ln_backward_reduce_kernel: no atomics, the same
// result on every run.
constexpr int kLnBwdWarps = 8;
constexpr int kLnBwdThreads = kLnBwdWarps * 32;
constexpr int kLnBwdRows = 8;        // rows per thread per tile
constexpr int kLnBwdMaxCols = 512;   // msa_dim this kernel takes (2 columns per thread)
constexpr int kLnBwdReduceThreads = 256;

struct LnBackwardArgs {
  const void* x;  // (B, S, N, C), unit stride along C, elements of kind x_kind
  int x_kind;
  int64_t x_sb, x_ss, x_sn;
  MaskView mask;
  const float* ln_w;
  const float* ln_b;
  float ln_eps;
  const float* wa;      // (H, C) contiguous
  const float* wb;
  const float* grad_a;  // (B, S, N, H) contiguous, gradient of the masked projection
  const float* grad_b;
  void* grad_x;         // (B, S, N, C) contiguous of kind gx_kind, or null when not needed
  int gx_kind;
  float* partial;       // (gridDim.x, ln_backward_partial_floats(C, H))
  int B, S, N, C, H;
  int64_t rows;         // B * S * N
  int col_lanes;        // 32, 64, 128 or 256: threads sharing one row's columns
  int regs;             // the register form runs (ln_backward_regs), else the shared-memory one
  int mma;              // a tensor-core form runs over the others (ln_mma_terms): 1 one term (16-bit x, or float32
                        // x in TF32), 3 float32 x in 3xTF32; 0 none
};

// Layout of one block's partial sums: [dW_a (H, C) | dW_b (H, C) | d ln_w (C) | d ln_b (C) |
// d b_a (H) | d b_b (H)].
FLASHOPM_HD inline int64_t ln_backward_partial_floats(int C, int H) { return int64_t(2) * H * C + 2 * C + 2 * H; }

// Columns per thread and threads per row for msa_dim C.
FLASHOPM_HD inline int ln_backward_cols(int C) { return C <= 256 ? 1 : 2; }
FLASHOPM_HD inline int ln_backward_col_lanes(int C) {
  const int per_thread = (C + ln_backward_cols(C) - 1) / ln_backward_cols(C);
  int lanes = 32;
  while (lanes < per_thread) lanes *= 2;
  return lanes;
}

// Shared memory (floats) of opm_ln_backward_kernel.
FLASHOPM_HD inline int64_t ln_backward_smem_floats(int C, int H) {
  const int lanes = ln_backward_col_lanes(C), groups = kLnBwdThreads / lanes;
  const int cstride = lanes * ln_backward_cols(C), h2p = round_up4(2 * H), tile_rows = groups * kLnBwdRows;
  return int64_t(groups) * h2p * cstride      // dW accumulators, one set per row group
         + int64_t(tile_rows) * h2p           // the tile's masked gradients
         + kLnBwdWarps * 2 * kLnBwdRows       // row reductions
         + int64_t(groups) * 2 * cstride      // d ln_w, d ln_b per row group (final sum)
         + round_up4(tile_rows)               // mask per row
         + 2 * round_up4(tile_rows);          // x offset per row (int64)
}

// The form with W's columns and the dW sums in registers (opm_ln_backward_regs_kernel): msa_dim
// up to 256 and 2H up to 64, rounded up to kH2 = 16, 32 or 64; one block per SM.
FLASHOPM_HD inline bool ln_backward_regs_form(int C, int H) { return C <= 256 && 2 * H <= 64; }
FLASHOPM_HD inline int ln_backward_regs_h2(int H) { return 2 * H <= 16 ? 16 : 2 * H <= 32 ? 32 : 64; }
FLASHOPM_HD inline int64_t ln_backward_regs_smem_floats(int C, int H) {
  const int lanes = ln_backward_col_lanes(C), groups = kLnBwdThreads / lanes, h2 = ln_backward_regs_h2(H);
  const int tile_rows = groups * kLnBwdRows;
  return int64_t(kLnBwdThreads) * h2         // the row groups' dW sums at the end
         + 2 * int64_t(tile_rows) * h2       // two tiles' gradients
         + kLnBwdWarps * 2 * kLnBwdRows      // row reductions
         + int64_t(groups) * 2 * lanes       // d ln_w, d ln_b per row group
         + 2 * round_up4(tile_rows)          // two tiles' mask values
         + 4 * round_up4(tile_rows);         // two tiles' x offsets (int64)
}

struct LnBackwardReduceArgs {
  const float* partial;  // (blocks, P)
  int blocks;
  int C, H;
  float* grad_wa;        // each (H, C), (C) or (H) float32, or null when not needed
  float* grad_wb;
  float* grad_lw;
  float* grad_lb;
  float* grad_ba;
  float* grad_bb;
};

void launch_ln_backward(const LnBackwardArgs& args, int blocks, cudaStream_t stream);
void launch_ln_backward_reduce(const LnBackwardReduceArgs& args, cudaStream_t stream);
int ln_backward_smem_bytes(int C, int H, bool regs);
// Whether the register form runs: where ln_backward_regs_form allows it, unless
// FLASHOPM_LN_BACKWARD_REGS=0 (to compare the forms).  Asked once per backward call.
bool ln_backward_regs(int C, int H);
// The tensor-core forms (opm_ln_backward_mma_kernel for 16-bit x, opm_ln_backward_tf32_kernel for
// float32 x, in TF32 under "high" and 3xTF32 under "highest"): msa_dim 64, 128 or 256 and H <= 32; shared memory per block and rows
// per tile of each.
FLASHOPM_HD inline bool ln_backward_mma_form(int C, int H) { return (C == 64 || C == 128 || C == 256) && H >= 1 && H <= 32; }
int ln_backward_mma_smem_bytes(int C, bool tf32);
FLASHOPM_HD inline int ln_backward_mma_tile_rows(bool tf32) { return tf32 ? 32 : 64; }

}  // namespace flashopm
