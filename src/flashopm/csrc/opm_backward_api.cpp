// CUDA implementation of flashopm::outer_product_mean_backward, in C++ so that a training step's
// backward costs no Python per operation.  The same math as reference.outer_product_mean_backward_reference:
// LayerNorm, both projections and the mask are recomputed in one launch (opm_prep_kernel), the three
// contractions over the (pairs x H·H) intermediate go to flashopm::outer_contract_backward (the fused
// kernels) where the hidden size allows, else to ATen in blocks of rows; then the gradients flow
// back through the mask, the projections and LayerNorm in one pass over x (opm_ln_backward_kernel)
// and one reduction of its per-block parameter sums.  Problems those two kernels do not take
// (msa_dim > 512, or shared memory short) run the same math on ATen.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <c10/core/impl/LocalDispatchKeySet.h>

#include "opm_op_handles.h"

#include <algorithm>
#include <array>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace flashopm {
namespace {

// What output (i, j) is divided by (reference.output_divisor): (B, N, 1, 1) or (B, N, N, 1).
at::Tensor output_divisor(const at::Tensor& m, int64_t normalization, double norm_eps) {
  if (normalization == 0) return m.sum(1).clamp_min(1.0).unsqueeze(-1).unsqueeze(-1);
  const at::Tensor pair = at::matmul(m.transpose(1, 2), m).unsqueeze(-1);  // sum_s m[s,i] m[s,j]
  return normalization == 1 ? pair.add(norm_eps) : pair.clamp_min(1.0);
}

// x viewed as (P, V, U, L), contiguous -> (P, U, V, L), contiguous: the two middle axes swapped.
// opm_swap_middle_kernel moves each run of L elements whole in 16-byte pieces; ATen's permuted copy
// (the fallback, and FLASHOPM_SWAP_KERNEL=0) indexes every element.
at::Tensor swap_middle_axes(const at::Tensor& x, int64_t P, int64_t V, int64_t U, int64_t L) {
  const int64_t run_bytes = L * int64_t(x.element_size());
  const bool kernel = x.is_cuda() && x.is_contiguous() && run_bytes % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 && !env_is("FLASHOPM_SWAP_KERNEL", "0");
  if (!kernel) return x.view({P, V, U, L}).transpose(1, 2).contiguous();
  at::Tensor y = at::empty({P, U, V, L}, x.options());
  SwapMiddleArgs args{x.data_ptr(), y.data_ptr(), U, V, run_bytes / 16, P * U * V * (run_bytes / 16)};
  const int dev = x.get_device();
  launch_swap_middle(args, device_info(dev).sm_count, c10::cuda::getCurrentCUDAStream(dev).stream());
  return y;
}

// ATen's matmuls with 16-bit operands and a float32 result (the products summed in float32 and
// never rounded to 16 bits), where this torch has them (the `dtype` overloads); else the 16-bit
// result, converted.  out_mm_add: out += m1·m2 (3-D: batched) in out, a float32 tensor.
void out_mm_add(at::Tensor& out, const at::Tensor& m1, const at::Tensor& m2) {
  const bool batched = m1.dim() == 3;
  if (m1.scalar_type() == out.scalar_type()) {
    if (batched) out.baddbmm_(m1, m2);
    else out.addmm_(m1, m2);
    return;
  }
  static const std::optional<c10::OperatorHandle> baddbmm = c10::Dispatcher::singleton().findOp({"aten::baddbmm", "dtype_out"});
  static const std::optional<c10::OperatorHandle> addmm = c10::Dispatcher::singleton().findOp({"aten::addmm", "dtype_out"});
  const std::optional<c10::OperatorHandle>& op = batched ? baddbmm : addmm;
  if (op) {
    op->typed<at::Tensor&(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::ScalarType,
                          const c10::Scalar&, const c10::Scalar&, at::Tensor&)>()
        .call(out, m1, m2, out.scalar_type(), 1, 1, out);
  } else {
    out.add_(batched ? at::bmm(m1, m2) : at::mm(m1, m2));
  }
}

at::Tensor bmm_to(const at::Tensor& m1, const at::Tensor& m2, at::ScalarType type) {
  if (m1.scalar_type() == type) return at::bmm(m1, m2);
  static const std::optional<c10::OperatorHandle> op = c10::Dispatcher::singleton().findOp({"aten::bmm", "dtype"});
  if (!op) return at::bmm(m1, m2).to(type);
  return op->typed<at::Tensor(const at::Tensor&, const at::Tensor&, at::ScalarType)>().call(m1, m2, type);
}

// (grad_a, grad_b, grad_w_out) with the (B, n, N, H, H) intermediates formed for blocks of rows:
// reference.contract_outer_blocks_backward, for the hidden sizes the fused kernels do not take
// and past S = 256.  A GEMM writes dO as [(i, j), (p, q)], but grad_a and grad_b contract it over
// (j, q) and (i, p): it is permuted once, to [(i, p), (j, q)], which both read (einsum permuted
// it for each); the outer product comes as [(i, p), (j, q)] and is permuted once for grad_W.
// b and a's rows are read as (S, N·H) views.  `type`: the GEMMs' operand type, a's own or a 16-bit
// type (a 16-bit model, or "medium"), whose products are summed in float32 straight into the
// gradients in a's type (out_mm_add, bmm_to).
std::array<at::Tensor, 3> contract_blocks(const at::Tensor& g, const at::Tensor& a, const at::Tensor& b,
                                          const at::Tensor& w_out, bool need_ab, bool need_w, at::ScalarType type) {
  const int64_t B = a.size(0), S = a.size(1), Ni = a.size(2), H = a.size(3), Nj = b.size(2), D = w_out.size(0);
  const bool half = c10::elementSize(type) == 2;
  const at::Tensor W = w_out.reshape({D, H * H}).to(type);
  const at::Tensor a_c = a.to(type).contiguous(), b_rows = b.to(type).contiguous().view({B, S, Nj * H});  // [s, (j, q)]
  const at::TensorOptions opts = a.options();
  at::Tensor grad_a = need_ab ? at::zeros({B, S, Ni, H}, opts) : at::Tensor();
  at::Tensor grad_b = need_ab ? at::zeros({B, S, Nj * H}, opts) : at::Tensor();
  at::Tensor grad_w = need_w ? at::zeros({D, H * H}, opts) : at::Tensor();
  // Rows per block: 16M-64M elements of dO, twice as many in a 16-bit type (the same bytes as in
  // float32; fewer blocks, so fewer passes that add a block's grad_b into the float32 sum).
  const int64_t elems = std::min<int64_t>(int64_t(1) << 26, std::max<int64_t>(int64_t(1) << 24, g.numel() / 4)) *
                        (half ? 2 : 1);
  const int64_t step = std::max<int64_t>(1, elems / std::max<int64_t>(1, B * Nj * H * H));
  for (int64_t i0 = 0; i0 < Ni && (need_ab || need_w); i0 += step) {
    const int64_t i1 = std::min(Ni, i0 + step), ni = i1 - i0;
    const at::Tensor g_rows = g.slice(1, i0, i1).reshape({B * ni * Nj, D}).to(type);   // [(b, i, j), d]
    const at::Tensor a_rows = a_c.slice(2, i0, i1).reshape({B, S, ni * H});             // [s, (i, p)], a view
    if (need_ab) {
      const at::Tensor d_outer = swap_middle_axes(at::mm(g_rows, W), B * ni, Nj, H, H)  // [(b, i, j), (p, q)] ->
                                     .view({B, ni * H, Nj * H});                        // [(i, p), (j, q)]
      grad_a.slice(2, i0, i1).copy_(bmm_to(b_rows, d_outer.transpose(1, 2), a.scalar_type()).view({B, S, ni, H}));
      out_mm_add(grad_b, a_rows, d_outer);
    }
    if (need_w) {
      const at::Tensor outer = swap_middle_axes(at::bmm(a_rows.transpose(1, 2), b_rows),  // [(i, p), (j, q)] ->
                                                B * ni, H, Nj, H)
                                   .view({B * ni * Nj, H * H});                         // [(b, i, j), (p, q)]
      out_mm_add(grad_w, g_rows.t(), outer);
    }
  }
  return {grad_a, need_ab ? grad_b.view({B, S, Nj, H}) : grad_b, grad_w};
}

// What both LayerNorm/projection kernels read, converted once per backward call: x with unit stride
// along C (in its own type), the parameters as contiguous float32.
struct LnInputs {
  at::Tensor msa, mask, lw, lb, wa, wb;
  double ln_eps;
};

LnInputs ln_inputs(const at::Tensor& msa, const at::Tensor& mask, const at::Tensor& ln_w, const at::Tensor& ln_b,
                   double ln_eps, const at::Tensor& w_a, const at::Tensor& w_b) {
  const auto f32 = [](const at::Tensor& t) { return t.to(at::kFloat).contiguous(); };
  return {msa.stride(3) == 1 ? msa : msa.contiguous(), mask, f32(ln_w), f32(ln_b), f32(w_a), f32(w_b), ln_eps};
}

// The LayerNorm and projection inputs, as PrepArgs and LnBackwardArgs both name them.
template <typename Args>
void set_ln_inputs(Args& args, const LnInputs& in) {
  const at::Tensor &msa = in.msa, &mask = in.mask;
  args.x = msa.data_ptr();
  args.x_kind = elem_kind(msa);
  args.x_sb = msa.stride(0), args.x_ss = msa.stride(1), args.x_sn = msa.stride(2);
  args.mask = MaskView{mask.data_ptr(), mask.stride(0), mask.stride(1), mask.stride(2), mask_kind_of(mask)};
  args.ln_w = in.lw.data_ptr<float>(), args.ln_b = in.lb.data_ptr<float>(), args.ln_eps = float(in.ln_eps);
  args.wa = in.wa.data_ptr<float>(), args.wb = in.wb.data_ptr<float>();
}

// LayerNorm, the projections and the mask recomputed in one launch: a and b, each (B, S, N, H)
// float32 contiguous, as the forward computes them at precision `prec`, into a_out and b_out.
void project_masked(const LnInputs& in, const OptTensor& b_a, const OptTensor& b_b, Precision prec, float* a_out,
                    float* b_out, int dev) {
  RECORD_USER_SCOPE("flashopm::backward/project");
  const int64_t B = in.msa.size(0), S = in.msa.size(1), N = in.msa.size(2), C = in.msa.size(3), H = in.wa.size(0);
  const auto f32 = [](const at::Tensor& t) { return t.to(at::kFloat).contiguous(); };
  const OptTensor ba = b_a ? OptTensor(f32(*b_a)) : std::nullopt, bb = b_b ? OptTensor(f32(*b_b)) : std::nullopt;
  PrepArgs pa{};
  set_ln_inputs(pa, in);
  pa.ba = opt_ptr(ba), pa.bb = opt_ptr(bb);
  pa.a_out = a_out, pa.b_out = b_out, pa.ab_kind = kMaskFloat;
  pa.a_sb = pa.b_sb = S * N * H, pa.a_ss = pa.b_ss = N * H, pa.a_sn = pa.b_sn = H;
  pa.a_rows = int(N), pa.o_chunks = 1;
  pa.B = int(B), pa.S = int(S), pa.N = int(N), pa.C = int(C), pa.H = int(H), pa.D = 1;
  pa.mma_terms = projection_mma_terms(pa.x_kind != kMaskFloat, prec);
  run_prep(pa, false, dev, c10::cuda::getCurrentCUDAStream(dev).stream());
}

std::pair<at::Tensor, at::Tensor> project_masked(const LnInputs& in, const OptTensor& b_a, const OptTensor& b_b,
                                                 Precision prec, int dev) {
  const int64_t B = in.msa.size(0), S = in.msa.size(1), N = in.msa.size(2), H = in.wa.size(0);
  at::Tensor a = at::empty({B, S, N, H}, in.msa.options().dtype(at::kFloat));
  at::Tensor b = at::empty({B, S, N, H}, in.msa.options().dtype(at::kFloat));
  project_masked(in, b_a, b_b, prec, a.data_ptr<float>(), b.data_ptr<float>(), dev);
  return {a, b};
}

// Pairs (B·N²) from which a float32 backward under PyTorch's "high" contracts in ATen blocks.
constexpr int64_t kHighBlocksMinPairs = 3 * (int64_t(1) << 13);

// Whether the one-pass LayerNorm/projection kernels take this problem (else ATen does).
bool fused_ln_fits(const at::Tensor& msa, const at::Tensor& mask, int64_t rows, int64_t C, int64_t H, int64_t B,
                   int64_t S, bool ln_regs, int dev) {
  const at::ScalarType t = msa.scalar_type(), mt = mask.scalar_type();
  const bool types = (t == at::kFloat || t == at::kHalf || t == at::kBFloat16) &&
                     (mt == at::kFloat || mt == at::kHalf || mt == at::kBFloat16 || mt == at::kBool);
  return types && rows > 0 && C <= kLnBwdMaxCols && H <= kMaxHidden && B <= 65535 && S <= 65535 &&
         ln_backward_smem_bytes(int(C), int(H), ln_regs) <= device_info(dev).smem_optin;
}

// The tensor-core form of the LayerNorm backward that takes this problem, as LnBackwardArgs.mma
// counts it: 1 for a 16-bit model whose matmuls follow PyTorch's in its type, or a float32 one
// under "high" (TF32, as PyTorch's matmuls there); 3 for a float32 one under "highest" (3xTF32
// with float32 sums); 0 for none (msa_dim and hidden not as ln_backward_mma_form allows, x's rows
// not 16-byte aligned, or turned off by FLASHOPM_LN_BACKWARD_MMA=0, to compare the forms).
int ln_mma_terms(const at::Tensor& msa, bool follow16, Precision prec, int64_t C, int64_t H, int dev) {
  const int64_t per16 = 16 / msa.element_size();
  const bool aligned = reinterpret_cast<uintptr_t>(msa.data_ptr()) % 16 == 0 && msa.stride(0) % per16 == 0 &&
                       msa.stride(1) % per16 == 0 && msa.stride(2) % per16 == 0;
  const bool half = msa.scalar_type() == at::kHalf || msa.scalar_type() == at::kBFloat16;
  const bool f32 = msa.scalar_type() == at::kFloat;
  const int terms = follow16 && half ? 1 : f32 ? (prec == kHighest ? 3 : 1) : 0;
  const bool fits = terms > 0 && ln_backward_mma_form(int(C), int(H)) && aligned &&
                    ln_backward_mma_smem_bytes(int(C), f32) <= device_info(dev).smem_optin &&
                    !env_is("FLASHOPM_LN_BACKWARD_MMA", "0");
  return fits ? terms : 0;
}

// Whether opm_grad_scale_kernel takes g = grad_out / divisor (else ATen does).
bool scale_fits(at::ScalarType work, const at::Tensor& grad_out, const at::Tensor& mask, int64_t S) {
  const at::ScalarType mt = mask.scalar_type(), gt = grad_out.scalar_type();
  return work == at::kFloat && (gt == at::kFloat || gt == at::kHalf || gt == at::kBFloat16) &&
         grad_out.numel() > 0 && S > 0 && grad_out.size(0) <= 65535 &&
         (mt == at::kFloat || mt == at::kHalf || mt == at::kBFloat16 || mt == at::kBool);
}

// A second pass of the division that writes g split for the side kernels instead of float32
// (launch_grad_scale_side_split), to run after the W kernel has read g; fits: it applies (grad_out
// contiguous, the first pass by pair with vectors of four, pair_dim a multiple of 32).
struct GradScaleSideSplit {
  GradScaleArgs args{};
  int blocks = 0;
  at::Tensor go, pair;  // what args reads
  bool fits = false;
  void run(float* factors, cudaStream_t stream) {
    args.side_inv = factors;
    launch_grad_scale_side_split(args, blocks, stream);
  }
};

// g = grad_out / divisor, (B, N, N, D) in `type`, in one launch (and one more for the pair counts
// of the OpenFold and Boltz conventions) in place of ATen's reduction, clamp and division;
// grad_out is read in its own type.  With want_bias, the same pass sums out_proj's bias gradient
// where its columns fit the kernel's threads (one more small launch adds the blocks' sums) and
// puts it in bias_grad (float32, (D,)); elsewhere bias_grad stays undefined.
// FLASHOPM_BIAS_GRAD_KERNEL=0 leaves the bias gradient to the caller, to compare.
// g_out: where g goes (contiguous, aligned to 16 bytes; nothing is returned then), else a new tensor.
// side_split, if given, gets the second pass's arguments (the same divisors and grid rule).
at::Tensor scale_grad(const at::Tensor& go_in, const at::Tensor& mask, int64_t normalization, double norm_eps,
                      at::ScalarType type, bool want_bias, at::Tensor& bias_grad, int dev, void* g_out = nullptr,
                      GradScaleSideSplit* side_split = nullptr) {
  RECORD_USER_SCOPE("flashopm::backward/scale_grad");
  const at::Tensor go = go_in.contiguous();
  const int64_t B = go.size(0), N = go.size(1), D = go.size(3), S = mask.size(1);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dev).stream();
  const MaskView mask_view{mask.data_ptr(), mask.stride(0), mask.stride(1), mask.stride(2), mask_kind_of(mask)};
  const at::Tensor pair =
      pair_counts(mask_view, normalization, B, S, N, N, 0, go.options().dtype(at::kFloat), stream);
  at::Tensor g = g_out == nullptr ? at::empty(go.sizes(), go.options().dtype(type)) : at::Tensor();
  GradScaleArgs args{};
  args.go = go.data_ptr(), args.g = g_out == nullptr ? g.data_ptr() : g_out;
  args.go_kind = elem_kind(go), args.g_kind = elem_kind_of(type);
  const auto aligned4 = [](const void* p, int64_t elem_bytes) {
    return reinterpret_cast<uintptr_t>(p) % (4 * elem_bytes) == 0;
  };
  args.vec4 = D % 4 == 0 && aligned4(go.data_ptr(), go.element_size()) && aligned4(args.g, c10::elementSize(type));
  args.by_pair = D / (args.vec4 ? 4 : 1) <= kGradScaleThreads;
  args.mask = mask_view;
  args.pair = pair.defined() ? pair.data_ptr<float>() : nullptr;
  args.norm = Normalizer{int(normalization), float(norm_eps)};
  args.B = int(B), args.S = int(S), args.N = int(N), args.D = int(D);
  const bool bias_here = want_bias && args.by_pair && !env_is("FLASHOPM_BIAS_GRAD_KERNEL", "0");
  // Small problems in one block that writes the bias gradient itself: a launch and an allocation
  // less, where the step's time is the host's.
  const bool one_block = bias_here && go.numel() <= kGradScaleOneBlockElems;
  // Chunks of rows: enough of them for four blocks per SM where the rows allow (chunk_rows * N < 2^31).
  const int64_t rows = B * N, max_blocks = 4 * int64_t(device_info(dev).sm_count);
  const int spread_rows = N > (int64_t(1) << 24) ? 1 : int(std::clamp<int64_t>(rows / max_blocks, 1, kGradScaleMaxChunkRows));
  const int spread_blocks = int(std::min<int64_t>((rows + spread_rows - 1) / spread_rows, max_blocks));
  args.chunk_rows = one_block ? int(std::min<int64_t>(rows, kGradScaleMaxChunkRows)) : spread_rows;
  const int blocks = one_block ? 1 : spread_blocks;
  at::Tensor bias_part;
  if (bias_here) {
    bias_grad = at::empty({D}, go.options().dtype(at::kFloat));
    if (one_block) {
      args.bias_out = bias_grad.data_ptr<float>();
    } else {
      bias_part = at::empty({blocks, D}, go.options().dtype(at::kDouble));
      args.bias_part = bias_part.data_ptr<double>();
    }
  }
  if (side_split != nullptr) {
    GradScaleArgs& sa = side_split->args;
    sa = args;
    sa.bias_part = nullptr, sa.bias_out = nullptr;
    sa.chunk_rows = spread_rows;
    side_split->blocks = spread_blocks;
    side_split->go = go, side_split->pair = pair;
    // a copy of grad_out kept for it would add to the step's peak
    side_split->fits = go_in.is_contiguous() && grad_scale_side_split_fits(sa);
  }
  launch_grad_scale(args, blocks, stream);
  if (bias_part.defined()) launch_bias_grad_reduce(args.bias_part, blocks, int(D), bias_grad.data_ptr<float>(), stream);
  return g;
}

struct LnGrads {
  at::Tensor x, ln_w, ln_b, w_a, b_a, w_b, b_b;  // float32 except x (msa's type); undefined if not asked
};

// The LayerNorm backward's grid: blocks resident at once over the rows' tiles.  regs: the kernel's
// register form (ln_backward_regs); mma: its tensor-core form (ln_mma_terms), which takes precedence.
int ln_backward_blocks(const at::Tensor& msa, int64_t H, bool regs, int mma, int dev) {
  const int64_t rows = msa.size(0) * msa.size(1) * msa.size(2), C = msa.size(3);
  const int lanes = ln_backward_col_lanes(int(C));
  const int tile_rows =
      mma ? ln_backward_mma_tile_rows(msa.scalar_type() == at::kFloat) : (kLnBwdThreads / lanes) * kLnBwdRows;
  const int smem = ln_backward_smem_bytes(int(C), int(H), regs);
  // resident blocks per SM: one in the register and tensor-core forms and with two columns per
  // thread, else two (the kernels' register bounds)
  const int per_sm = mma || regs || ln_backward_cols(int(C)) != 1
                         ? 1
                         : std::max(1, std::min(2, device_info(dev).smem_per_sm / (smem + 1024)));
  const int64_t tiles = (rows + tile_rows - 1) / tile_rows;
  return int(std::min<int64_t>(tiles, int64_t(per_sm) * device_info(dev).sm_count));
}

// grad_a and grad_b (B, S, N, H) float32 contiguous, gradients of the masked projections, back
// through the mask, both projections and LayerNorm: one pass over x, then one reduction of the
// blocks' parameter sums, which go to `partial` (ln_backward_blocks x ln_backward_partial_floats
// floats) where given, else to a tensor of their own.
LnGrads ln_projection_backward(const LnInputs& in, const float* grad_a, const float* grad_b,
                               const std::array<bool, 9>& want, bool regs, int mma, int dev,
                               float* partial_ws = nullptr) {
  RECORD_USER_SCOPE("flashopm::backward/layernorm");
  const at::Tensor& msa = in.msa;
  const int64_t B = msa.size(0), S = msa.size(1), N = msa.size(2), C = msa.size(3), H = in.wa.size(0);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dev).stream();
  const at::TensorOptions opts = msa.options().dtype(at::kFloat);
  LnGrads r;
  if (want[0]) r.x = at::empty({B, S, N, C}, msa.options().memory_format(at::MemoryFormat::Contiguous));
  const int blocks = ln_backward_blocks(msa, H, regs, mma, dev);
  // kept until the reduction that reads it is queued
  const at::Tensor partial_t =
      partial_ws ? at::Tensor() : at::empty({blocks, ln_backward_partial_floats(int(C), int(H))}, opts);
  float* partial = partial_ws ? partial_ws : partial_t.data_ptr<float>();

  LnBackwardArgs la{};
  set_ln_inputs(la, in);
  la.grad_a = grad_a, la.grad_b = grad_b;
  la.grad_x = r.x.defined() ? r.x.data_ptr() : nullptr;
  la.gx_kind = elem_kind(msa);
  la.partial = partial;
  la.B = int(B), la.S = int(S), la.N = int(N), la.C = int(C), la.H = int(H);
  la.rows = B * S * N;
  la.col_lanes = ln_backward_col_lanes(int(C));
  la.regs = regs;
  la.mma = mma;
  launch_ln_backward(la, blocks, stream);

  const auto out = [&](bool need, at::IntArrayRef shape) { return need ? at::empty(shape, opts) : at::Tensor(); };
  r.ln_w = out(want[1], {C}), r.ln_b = out(want[2], {C});
  r.w_a = out(want[3], {H, C}), r.b_a = out(want[4], {H});
  r.w_b = out(want[5], {H, C}), r.b_b = out(want[6], {H});
  const auto ptr = [](const at::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; };
  LnBackwardReduceArgs ra{};
  ra.partial = partial;
  ra.blocks = blocks;
  ra.C = int(C), ra.H = int(H);
  ra.grad_wa = ptr(r.w_a), ra.grad_wb = ptr(r.w_b), ra.grad_lw = ptr(r.ln_w), ra.grad_lb = ptr(r.ln_b);
  ra.grad_ba = ptr(r.b_a), ra.grad_bb = ptr(r.b_b);
  if (want[1] || want[2] || want[3] || want[4] || want[5] || want[6]) launch_ln_backward_reduce(ra, stream);
  return r;
}

// What backward_direct computes its gradients from.
struct DirectBackward {
  const LnInputs* ln_in;
  OptTensor b_a, b_b;        // the projections' biases, float32
  at::Tensor w_out;          // (D, H·H) float32
  int64_t normalization;
  double norm_eps;
  Precision prec;
  bool ln_regs;
  int ln_mma;  // LnBackwardArgs.mma
};

// The backward where every stage runs in our kernels (a float32 model; LayerNorm, the division and
// the contractions fused; pair_dim a multiple of 4), with its temporaries in two allocations: a, b,
// g and the contractions' partial sums, released once the contractions are queued, and grad_a,
// grad_b with the LayerNorm backward's block sums.  The contractions are launched from here rather
// than through their op.  At small sizes a step's time is the host's, and each allocation,
// dispatch and launch costs about as much host time as a kernel takes on the GPU; the two
// allocations keep what lives at once what it was with a tensor for each.
// want: the gradients asked for, those of absent biases not among them.
void backward_direct(const DirectBackward& d, const at::Tensor& grad_out, const at::Tensor& mask,
                     const std::array<bool, 9>& want, std::vector<at::Tensor>& grads, int dev) {
  const at::Tensor& msa = d.ln_in->msa;
  const int64_t B = msa.size(0), S = msa.size(1), N = msa.size(2), C = msa.size(3);
  const int64_t H = d.ln_in->wa.size(0), D = d.w_out.size(0);
  const bool need_proj = want[0] || want[1] || want[2] || want[3] || want[4] || want[5] || want[6];
  const bool need_wo = want[7], need_bo = want[8];
  const at::TensorOptions opts = msa.options().dtype(at::kFloat);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dev).stream();
  // g (in `first`, below) is read by nothing after the contractions, so the W kernel may split it in place
  const ContractBackwardPlan plan = plan_contract_backward(B, S, N, N, H, D, need_proj, need_wo, dev, true);
  const int64_t ab = round_up_line(B * S * N * H), gn = round_up_line(B * N * N * D);
  at::Tensor grad_w = need_wo ? at::empty({D, H * H}, opts) : at::Tensor();
  at::Tensor second;  // grad_a, grad_b, the LayerNorm backward's block sums
  int ln_blocks = 0;
  if (need_proj) {
    ln_blocks = ln_backward_blocks(msa, H, d.ln_regs, d.ln_mma, dev);
    second = at::empty({2 * ab + round_up_line(ln_blocks * ln_backward_partial_floats(int(C), int(H)))}, opts);
  }
  float* grad_a = need_proj ? second.data_ptr<float>() : nullptr;
  float* grad_b = need_proj ? grad_a + ab : nullptr;
  {
    const at::Tensor first = at::empty({2 * ab + gn + plan.scratch_floats()}, opts);  // a, b, g, scratch
    float* a = first.data_ptr<float>();
    float* b = a + ab;
    float* g = b + ab;
    project_masked(*d.ln_in, d.b_a, d.b_b, d.prec, a, b, dev);
    at::Tensor bias_grad;
    GradScaleSideSplit side_split;
    scale_grad(grad_out, mask, d.normalization, d.norm_eps, at::kFloat, need_bo, bias_grad, dev, g,
               plan.side_g_split ? &side_split : nullptr);
    // ATen's sum where the division's threads do not hold every column (pair_dim > 4 * kGradScaleThreads)
    if (need_bo)
      grads[8] = bias_grad.defined() ? bias_grad
                                     : at::sum(d.normalization == 1 ? at::from_blob(g, {B, N, N, D}, opts) : grad_out,
                                               {0, 1, 2}, false, at::kFloat);
    // The side kernels take g split once (g written again from grad_out once the W kernel has read it).
    const auto split_g_for_side = [&](float* factors) { side_split.run(factors, stream); };
    run_contract_backward(plan, g, a, b, d.w_out.data_ptr<float>(), grad_a, grad_b,
                          need_wo ? grad_w.data_ptr<float>() : nullptr, g + gn, d.prec == kHighest ? 3 : 1,
                          device_info(dev).sm_count, stream,
                          side_split.fits ? std::function<void(float*)>(split_g_for_side) : nullptr);
  }
  if (need_wo) grads[7] = grad_w;
  if (need_proj) {
    const LnGrads r = ln_projection_backward(*d.ln_in, grad_a, grad_b, want, d.ln_regs, d.ln_mma, dev, grad_b + ab);
    grads[0] = r.x, grads[1] = r.ln_w, grads[2] = r.ln_b, grads[3] = r.w_a, grads[4] = r.b_a;
    grads[5] = r.w_b, grads[6] = r.b_b;
  }
}

// Gradients for (msa_repr, ln_weight, ln_bias, w_a, b_a, w_b, b_b, w_out, b_out); an empty tensor
// where output_mask is false or the bias is absent.
std::vector<at::Tensor> outer_product_mean_backward_cuda(const at::Tensor& grad_out, const at::Tensor& msa,
                                                         const at::Tensor& mask, const at::Tensor& ln_w,
                                                         const at::Tensor& ln_b, double ln_eps, const at::Tensor& w_a,
                                                         const OptTensor& b_a, const at::Tensor& w_b,
                                                         const OptTensor& b_b, const at::Tensor& w_out,
                                                         const OptTensor& b_out, int64_t normalization,
                                                         double norm_eps, const c10::List<bool>& output_mask,
                                                         int64_t precision) {
  const EnvScope env_scope;
  // The math below picks its own types (float32 sums, the GEMMs' operand type): autocast, active
  // when the backward runs inside an autocast region, must not recast the ATen calls.
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  TORCH_CHECK(output_mask.size() == 9, "flashopm: output_mask must have 9 entries, got ",
              std::to_string(output_mask.size()));
  TORCH_CHECK(msa.dim() == 4, "flashopm: msa_repr must have shape (B, S, N, msa_dim), got ", std::to_string(msa.dim()),
              " dims");
  TORCH_CHECK(normalization >= 0 && normalization <= 2, "flashopm: normalization must be 0, 1 or 2, got ",
              std::to_string(normalization));
  TORCH_CHECK(precision >= kFollowPyTorch && precision <= kMedium, "flashopm: precision must be -1, 0, 1 or 2, got ",
              std::to_string(precision));
  const int64_t B = msa.size(0), S = msa.size(1), N = msa.size(2), C = msa.size(3);
  const int64_t H = w_a.size(0), D = w_out.size(0);
  TORCH_CHECK(grad_out.dim() == 4 && grad_out.size(0) == B && grad_out.size(1) == N && grad_out.size(2) == N &&
                  grad_out.size(3) == D,
              "flashopm: grad_out must have shape (B, N, N, pair_dim) = (", std::to_string(B), ", ", std::to_string(N),
              ", ", std::to_string(N), ", ", std::to_string(D), ")");
  // The kernels read these through raw pointers: a tensor on another device or of another shape
  // must fail here, not in a kernel.
  FLASHOPM_CHECK(mask.dim() == 3 && mask.size(0) == B && mask.size(1) == S && mask.size(2) == N,
                 "flashopm: msa_mask must have shape (B, S, N) = (", B, ", ", S, ", ", N, "), got ", mask.sizes());
  FLASHOPM_CHECK(w_a.dim() == 2 && w_b.sizes() == w_a.sizes() && w_a.size(1) == C,
                 "flashopm: proj_a and proj_b weights must have shape (hidden, msa_dim) = (", H, ", ", C, "), got ",
                 w_a.sizes(), " and ", w_b.sizes());
  FLASHOPM_CHECK(ln_w.numel() == C && ln_b.numel() == C, "flashopm: layer_norm weight and bias must have ", C,
                 " elements, got ", ln_w.numel(), " and ", ln_b.numel());
  const std::array<std::pair<const char*, const at::Tensor*>, 10> on_device = {{
      {"grad_out", &grad_out}, {"msa_mask", &mask}, {"layer_norm weight", &ln_w}, {"layer_norm bias", &ln_b},
      {"proj_a weight", &w_a}, {"proj_a bias", b_a ? &*b_a : nullptr}, {"proj_b weight", &w_b},
      {"proj_b bias", b_b ? &*b_b : nullptr}, {"out_proj weight", &w_out}, {"out_proj bias", b_out ? &*b_out : nullptr}}};
  for (const auto& [name, t] : on_device)
    FLASHOPM_CHECK(t == nullptr || t->device() == msa.device(), "flashopm: ", name, " is on ", t->device(),
                   " but msa_repr is on ", msa.device());
  const c10::cuda::CUDAGuard guard(msa.device());
  std::array<bool, 9> want{};
  for (int k = 0; k < 9; ++k) want[k] = output_mask.get(k);
  const bool need_x = want[0], need_lw = want[1], need_lb = want[2];
  const bool need_wa = want[3], need_ba = want[4] && b_a, need_wb = want[5];
  const bool need_bb = want[6] && b_b, need_wo = want[7], need_bo = want[8] && b_out;
  const bool need_proj = need_x || need_lw || need_lb || need_wa || need_ba || need_wb || need_bb;

  // A 16-bit model is one whose parameters are 16-bit; its x may be float32 (a mixed-precision
  // region casts the parameters only), which the LayerNorm stages read as it is.
  const at::ScalarType model = w_a.scalar_type();
  const bool half = model == at::kHalf || model == at::kBFloat16;
  FLASHOPM_CHECK(msa.scalar_type() == model || (half && msa.scalar_type() == at::kFloat),
                 "flashopm: msa_repr must have dtype ", model, " like proj_a weight (or float32 with 16-bit "
                 "parameters), got ", msa.scalar_type());
  const at::ScalarType work = half ? at::kFloat : msa.scalar_type();
  // The contractions' precision, by the forward's rule: a 16-bit model follows PyTorch's matmuls in
  // its type (16-bit products, float32 sums) unless a precision is asked for, and "medium" takes
  // bfloat16 operands; both contract in ATen blocks in that type.  Otherwise the fused kernels
  // take `prec` (3xTF32 for "highest", TF32 for "high").
  const bool follow16 = half && precision == kFollowPyTorch;
  const Precision prec = follow16 ? kHigh : resolve_precision(precision);
  const at::ScalarType blocks_type = work != at::kFloat ? work
                                     : follow16         ? model
                                     : prec == kMedium  ? at::kBFloat16
                                                        : at::kFloat;
  const bool scale_in_kernel = scale_fits(work, grad_out, mask, S);
  const int dev = msa.get_device();
  const bool ln_regs = ln_backward_regs(int(C), int(H));
  const bool fused_ln = fused_ln_fits(msa, mask, B * S * N, C, H, B, S, ln_regs, dev);
  // m: (B, S, N, 1) in the working type, for the ATen paths only (a view op less per call otherwise)
  const at::Tensor m = fused_ln && scale_in_kernel ? at::Tensor() : mask.to(work).unsqueeze(-1);
  // The parameters in the working type, contiguous: a 16-bit model's converted to float32 by one
  // launch (as the forward does), others as given.
  const ParamsF32 params = params_as_f32({&ln_w, &ln_b, &w_a, b_a ? &*b_a : nullptr, &w_b, b_b ? &*b_b : nullptr,
                                          &w_out, nullptr},
                                         half, msa.options().dtype(at::kFloat));
  const at::Tensor &lw = *params.t[0], &lb = *params.t[1], &wa = *params.t[2], &wb = *params.t[4], &wo = *params.t[6];
  const OptTensor &ba = params.t[3], &bb = params.t[5];
  const LnInputs ln_in = fused_ln ? ln_inputs(msa, mask, lw, lb, ln_eps, wa, wb) : LnInputs{};
  // The fused kernels recompute dO = g·W for every 128 values of s; past S = 256 that costs more
  // than PyTorch's blocks save in their mma.sync forms (H200: 79 against 54 ms at S = 512, N = 768),
  // so the blocks take those problems, at more memory (blocks of 16M-64M elements); the float16
  // split forms (backward_f16_form) stay faster at any S, since the recomputation at most doubles
  // the side kernels' work.  ops.contract_backward, the same rule where the forms are not known.
  // A 16-bit model's contractions run in ATen blocks on 16-bit tensor cores, which beat the
  // fused kernels' mma.sync TF32 form (H200, training crop: 1.74 against 2.38 ms a step) and
  // their float16 split form (below).
  // Under PyTorch's "high" the blocks' GEMMs take TF32 from cuBLAS and beat the fused kernels'
  // TF32 form too from ~2^15 pairs (H200, a training step: 1.31 against 1.79 ms at
  // (1,128,181,256,32,128), 1.81 against 2.40 ms at the crop (1,128,256,256,32,128)); at 2^14
  // pairs the blocks' launches still cost more than they save (1.07 against 0.94 ms at
  // (1,64,128,128,32,128)).  An explicit precision="high" under PyTorch's "highest" keeps the
  // fused kernels, whose TF32 it asks for.  Where the float16 split forms run (hidden_dim 32,
  // sm_90a, large problems) and S <= 256, "high" keeps the fused kernels too, with the high parts'
  // products alone (TF32's rounding, a third of the MMAs of "highest"): a training step at the
  // crop (1,128,256,256,32,128) took 0.81x the blocks' time; at S = 512 (N = 768), where the side
  // kernels form dO again for every 128 values of s, 1.19x.
  // A 16-bit model (follow16) keeps the blocks in its type even where the one-term kernels run:
  // cuBLAS's 16-bit GEMMs beat them (H200, a bfloat16 model's training step at the crop: 1034
  // against 1319 us; at (1,256,256,256,32,128) 1100 against 1767; the fused kernels' side and W
  // launches ran at 195 and 115 TFLOP/s).
  // FLASHOPM_BACKWARD_BLOCKS=1 takes the blocks everywhere, =0 the fused kernels wherever they
  // apply (a 16-bit model's too, in the one-term form), to compare the two.
  const bool f16_forms = H == 32 && backward_f16_form(B, S, N, N, H, dev);
  const bool blocks_off = env_is("FLASHOPM_BACKWARD_BLOCKS", "0");
  const bool tf32_blocks = prec == kHigh && B * N * N >= kHighBlocksMinPairs &&
                           at::globalContext().float32MatmulPrecision() != at::Float32MatmulPrecision::HIGHEST &&
                           !(S <= 256 && f16_forms) && !blocks_off;
  const bool f16_model_fused = follow16 && f16_forms && blocks_off;
  const bool fused_contract = work == at::kFloat && (blocks_type == at::kFloat || f16_model_fused) &&
                              (H == 16 || H == 32 || H == 64) && (S <= 256 || f16_forms) && !tf32_blocks &&
                              fused_backward_fits(dev) && !env_is("FLASHOPM_BACKWARD_BLOCKS", "1");
  // Every stage in our kernels, temporaries in two allocations (backward_direct); FLASHOPM_BACKWARD_DIRECT=0
  // takes the tensor-per-temporary form below, to compare.
  const bool direct = fused_ln && scale_in_kernel && fused_contract && D % 4 == 0 && (need_proj || need_wo) &&
                      B * S * N > 0 && !env_is("FLASHOPM_BACKWARD_DIRECT", "0");
  std::vector<at::Tensor> grads(9);
  if (direct) {
    check_fused_backward(dev);
    const DirectBackward d{&ln_in, ba, bb, contiguous_aligned16(wo), normalization, norm_eps, prec, ln_regs,
                           need_proj ? ln_mma_terms(ln_in.msa, follow16, prec, C, H, dev) : 0};
    std::array<bool, 9> need = want;
    need[4] = need_ba, need[6] = need_bb, need[8] = need_bo;
    backward_direct(d, grad_out, mask, need, grads, dev);
  } else {
    at::Tensor grad_a, grad_b, grad_w;
    // The unfused path's LayerNorm intermediates, kept for its backward.
    at::Tensor xhat, xn, rstd;
    {
      // a, b and g (B, N, N, D) live only for the contractions
      at::Tensor a, b;
      if (fused_ln) {
        std::tie(a, b) = project_masked(ln_in, ba, bb, prec, dev);
      } else {
        const at::Tensor x = msa.to(work);
        const auto [var, mu] = at::var_mean(x, {-1}, /*correction=*/0, /*keepdim=*/true);
        rstd = (var + ln_eps).rsqrt_();
        xhat = (x - mu).mul_(rstd);
        xn = at::addcmul(lb, xhat, lw);
        a = at::linear(xn, wa, ba).mul_(m);
        b = at::linear(xn, wb, bb).mul_(m);
      }
      // g in the 16-bit model's type when the contractions run in ATen blocks in that type (as
      // PyTorch divides in it), else in the working type.
      at::Tensor bias_grad;
      const at::ScalarType g_type = follow16 && !fused_contract ? blocks_type : work;
      const at::Tensor g = scale_in_kernel
                               ? scale_grad(grad_out, mask, normalization, norm_eps, g_type, need_bo, bias_grad, dev)
                               : grad_out.to(work).div(output_divisor(m.squeeze(-1), normalization, norm_eps));
      if (need_bo)
        grads[8] = bias_grad.defined() ? bias_grad : at::sum(normalization == 1 ? g : grad_out, {0, 1, 2}, false, work);
      if (need_proj || need_wo) {
        if (fused_contract) {
          const std::vector<at::Tensor> r = contract_backward_op().call(g, a, b, wo, need_proj, need_wo, int64_t(prec));
          grad_a = r[0], grad_b = r[1], grad_w = r[2];
        } else {
          const std::array<at::Tensor, 3> r = contract_blocks(g, a, b, wo, need_proj, need_wo, blocks_type);
          grad_a = r[0], grad_b = r[1], grad_w = r[2];
        }
      }
    }
    if (need_wo) grads[7] = grad_w;
    if (need_proj && fused_ln) {
      const at::Tensor ga = grad_a.to(at::kFloat).contiguous(), gb = grad_b.to(at::kFloat).contiguous();
      const LnGrads r = ln_projection_backward(ln_in, ga.data_ptr<float>(), gb.data_ptr<float>(), want, ln_regs,
                                               ln_mma_terms(ln_in.msa, follow16, prec, C, H, dev), dev);
      grads[0] = r.x, grads[1] = r.ln_w, grads[2] = r.ln_b, grads[3] = r.w_a, grads[5] = r.w_b;
      if (need_ba) grads[4] = r.b_a;
      if (need_bb) grads[6] = r.b_b;
    } else if (need_proj) {
      const at::Tensor ga = grad_a.mul_(m).reshape({-1, H});
      const at::Tensor gb = grad_b.mul_(m).reshape({-1, H});
      const at::Tensor xn2 = xn.reshape({-1, C});
      if (need_wa) grads[3] = at::mm(ga.t(), xn2);
      if (need_ba) grads[4] = ga.sum(0);
      if (need_wb) grads[5] = at::mm(gb.t(), xn2);
      if (need_bb) grads[6] = gb.sum(0);
      xn.reset();
      if (need_x || need_lw || need_lb) {
        at::Tensor grad_xn = at::addmm(at::mm(ga, wa), gb, wb).view({B, S, N, C});
        if (need_lw) grads[1] = (grad_xn * xhat).sum({0, 1, 2});
        if (need_lb) grads[2] = grad_xn.sum({0, 1, 2});
        if (need_x) {
          // rstd (gxhat - mean(gxhat) - xhat mean(gxhat xhat)), in grad_xn's storage
          at::Tensor gxhat = grad_xn.mul_(lw);
          const at::Tensor proj = (gxhat * xhat).sum(-1, /*keepdim=*/true).div_(double(C));
          const at::Tensor mean = gxhat.mean(-1, /*keepdim=*/true);
          grads[0] = gxhat.sub_(mean).sub_(xhat.mul_(proj)).mul_(rstd);
        }
      }
    }
  }
  const std::array<const at::Tensor*, 9> like = {&msa, &ln_w, &ln_b, &w_a, b_a ? &*b_a : nullptr, &w_b,
                                                 b_b ? &*b_b : nullptr, &w_out, b_out ? &*b_out : nullptr};
  for (int k = 0; k < 9; ++k) {
    if (!(grads[k].defined() && want[k] && like[k] != nullptr)) grads[k] = at::Tensor();
  }
  // The parameters' float32 gradients back to a 16-bit model's type in one launch.
  std::vector<at::Tensor> convert(9);
  bool one_type = true;
  for (int k = 1; k < 9; ++k) {
    if (!grads[k].defined() || grads[k].scalar_type() == like[k]->scalar_type()) continue;
    one_type = one_type && like[k]->scalar_type() == model && grads[k].scalar_type() == at::kFloat &&
               grads[k].is_contiguous();
    convert[k] = grads[k];
  }
  if (one_type) {
    const std::vector<at::Tensor> converted = float_tensors_to(convert, model);
    for (int k = 1; k < 9; ++k)
      if (converted[k].defined()) grads[k] = converted[k];
  }
  for (int k = 0; k < 9; ++k) {
    if (!grads[k].defined()) grads[k] = at::empty({0}, msa.options());
    else if (grads[k].scalar_type() != like[k]->scalar_type()) grads[k] = grads[k].to(like[k]->scalar_type());
  }
  return grads;
}

}  // namespace
}  // namespace flashopm

TORCH_LIBRARY_IMPL(flashopm, CUDA, m) {
  m.impl("outer_product_mean_backward", &flashopm::outer_product_mean_backward_cuda);
}
