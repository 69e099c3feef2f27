// CUDA implementation of flashopm::outer_product_mean_backward, in C++ so that a training step's
// backward costs no Python per operation.  The same math as reference.outer_product_mean_backward_reference:
// LayerNorm and both projections are recomputed, the three contractions over the (pairs x H·H)
// intermediate go to flashopm::outer_contract_backward (the fused kernels) where the hidden size
// allows, else to ATen in blocks of rows; then the gradients flow back through the mask, the
// projections and LayerNorm.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <optional>
#include <string>
#include <vector>

namespace flashopm {
namespace {

using OptTensor = std::optional<at::Tensor>;

const c10::TypedOperatorHandle<std::vector<at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                        const at::Tensor&, bool, bool, int64_t)>&
contract_backward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("flashopm::outer_contract_backward", "")
                             .typed<std::vector<at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                            const at::Tensor&, bool, bool, int64_t)>();
  return op;
}

// What output (i, j) is divided by (reference.output_divisor): (B, N, 1, 1) or (B, N, N, 1).
at::Tensor output_divisor(const at::Tensor& m, int64_t normalization, double norm_eps) {
  if (normalization == 0) return m.sum(1).clamp_min(1.0).unsqueeze(-1).unsqueeze(-1);
  const at::Tensor pair = at::matmul(m.transpose(1, 2), m).unsqueeze(-1);  // sum_s m[s,i] m[s,j]
  return normalization == 1 ? pair.add(norm_eps) : pair.clamp_min(1.0);
}

// (grad_a, grad_b, grad_w_out) with the (B, n, N, H, H) intermediates formed for blocks of rows:
// reference.contract_outer_blocks_backward, for the hidden sizes the fused kernels do not take.
std::array<at::Tensor, 3> contract_blocks(const at::Tensor& g, const at::Tensor& a, const at::Tensor& b,
                                          const at::Tensor& w_out, bool need_ab, bool need_w) {
  const int64_t B = a.size(0), Ni = a.size(2), H = a.size(3), Nj = b.size(2), D = w_out.size(0);
  const at::Tensor W = w_out.view({D, H, H});
  at::Tensor grad_a = need_ab ? at::zeros_like(a) : at::Tensor();
  at::Tensor grad_b = need_ab ? at::zeros_like(b) : at::Tensor();
  at::Tensor grad_w = need_w ? at::zeros({D, H, H}, a.options()) : at::Tensor();
  const int64_t elems = std::min<int64_t>(int64_t(1) << 26, std::max<int64_t>(int64_t(1) << 24, g.numel() / 4));
  const int64_t step = std::max<int64_t>(1, elems / std::max<int64_t>(1, B * Nj * H * H));
  for (int64_t i0 = 0; i0 < Ni && (need_ab || need_w); i0 += step) {
    const int64_t i1 = std::min(Ni, i0 + step);
    const at::Tensor gi = g.slice(1, i0, i1), ai = a.slice(2, i0, i1);
    if (need_ab) {
      const at::Tensor d_outer = at::einsum("bijd,dpq->bijpq", {gi, W});
      grad_a.slice(2, i0, i1).copy_(at::einsum("bijpq,bsjq->bsip", {d_outer, b}));
      grad_b.add_(at::einsum("bijpq,bsip->bsjq", {d_outer, ai}));
    }
    if (need_w) {
      const at::Tensor outer = at::einsum("bsip,bsjq->bijpq", {ai, b});
      grad_w.add_(at::einsum("bijd,bijpq->dpq", {gi, outer}));
    }
  }
  return {grad_a, grad_b, need_w ? grad_w.view({D, H * H}) : grad_w};
}

// Gradients for (msa_repr, ln_weight, ln_bias, w_a, b_a, w_b, b_b, w_out, b_out); an empty tensor
// where output_mask is false or the bias is absent.
std::vector<at::Tensor> outer_product_mean_backward_cuda(const at::Tensor& grad_out, const at::Tensor& msa,
                                                         const at::Tensor& mask, const at::Tensor& ln_w,
                                                         const at::Tensor& ln_b, double ln_eps, const at::Tensor& w_a,
                                                         const OptTensor& b_a, const at::Tensor& w_b,
                                                         const OptTensor& b_b, const at::Tensor& w_out,
                                                         const OptTensor& b_out, int64_t normalization,
                                                         double norm_eps, const c10::List<bool>& output_mask) {
  TORCH_CHECK(output_mask.size() == 9, "flashopm: output_mask must have 9 entries, got ",
              std::to_string(output_mask.size()));
  TORCH_CHECK(msa.dim() == 4, "flashopm: msa_repr must have shape (B, S, N, msa_dim), got ", std::to_string(msa.dim()),
              " dims");
  TORCH_CHECK(normalization >= 0 && normalization <= 2, "flashopm: normalization must be 0, 1 or 2, got ",
              std::to_string(normalization));
  const int64_t B = msa.size(0), S = msa.size(1), N = msa.size(2), C = msa.size(3);
  const int64_t H = w_a.size(0), D = w_out.size(0);
  TORCH_CHECK(grad_out.dim() == 4 && grad_out.size(0) == B && grad_out.size(1) == N && grad_out.size(2) == N &&
                  grad_out.size(3) == D,
              "flashopm: grad_out must have shape (B, N, N, pair_dim) = (", std::to_string(B), ", ", std::to_string(N),
              ", ", std::to_string(N), ", ", std::to_string(D), ")");
  const c10::cuda::CUDAGuard guard(msa.device());
  std::array<bool, 9> want{};
  for (int k = 0; k < 9; ++k) want[k] = output_mask.get(k);
  const bool need_x = want[0], need_lw = want[1], need_lb = want[2];
  const bool need_wa = want[3], need_ba = want[4] && b_a, need_wb = want[5];
  const bool need_bb = want[6] && b_b, need_wo = want[7], need_bo = want[8] && b_out;
  const bool need_proj = need_x || need_lw || need_lb || need_wa || need_ba || need_wb || need_bb;

  const bool half = msa.scalar_type() == at::kHalf || msa.scalar_type() == at::kBFloat16;
  const at::ScalarType work = half ? at::kFloat : msa.scalar_type();
  const at::Tensor x = msa.to(work), m = mask.to(work).unsqueeze(-1);  // m: (B, S, N, 1)
  const at::Tensor lw = ln_w.to(work), lb = ln_b.to(work), wa = w_a.to(work), wb = w_b.to(work);
  const at::Tensor wo = w_out.to(work);
  const auto [var, mu] = at::var_mean(x, {-1}, /*correction=*/0, /*keepdim=*/true);
  const at::Tensor rstd = (var + ln_eps).rsqrt_();
  at::Tensor xhat = (x - mu).mul_(rstd);
  at::Tensor xn = at::addcmul(lb, xhat, lw);
  std::vector<at::Tensor> grads(9);
  at::Tensor grad_a, grad_b, grad_w;
  {
    // a, b and g (B, N, N, D) live only for the contractions
    const at::Tensor a = at::linear(xn, wa, b_a ? OptTensor(b_a->to(work)) : std::nullopt).mul_(m);
    const at::Tensor b = at::linear(xn, wb, b_b ? OptTensor(b_b->to(work)) : std::nullopt).mul_(m);
    const at::Tensor den = output_divisor(m.squeeze(-1), normalization, norm_eps);
    const at::Tensor go = grad_out.to(work);
    const at::Tensor g = go.div(den);
    if (need_bo) grads[8] = (normalization == 1 ? g : go).sum({0, 1, 2});
    if (need_proj || need_wo) {
      // The fused kernels recompute dO = g·W for every 128 values of s; past S = 256 that costs more
      // than PyTorch's blocks save (H200: 79 against 54 ms at S = 512, N = 768), which then win on
      // speed, at more memory (blocks of 16M-64M elements).  ops.contract_backward, the same rule.
      if (work == at::kFloat && (H == 16 || H == 32 || H == 64) && S <= 256) {
        const std::vector<at::Tensor> r = contract_backward_op().call(g, a, b, wo, need_proj, need_wo, -1);
        grad_a = r[0], grad_b = r[1], grad_w = r[2];
      } else {
        const std::array<at::Tensor, 3> r = contract_blocks(g, a, b, wo, need_proj, need_wo);
        grad_a = r[0], grad_b = r[1], grad_w = r[2];
      }
    }
  }
  {
    if (need_wo) grads[7] = grad_w;
    if (need_proj) {
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
    if (grads[k].defined() && want[k] && like[k] != nullptr) {
      grads[k] = grads[k].to(like[k]->scalar_type());
    } else {
      grads[k] = at::empty({0}, msa.options());
    }
  }
  return grads;
}

}  // namespace
}  // namespace flashopm

TORCH_LIBRARY_IMPL(flashopm, CUDA, m) {
  m.impl("outer_product_mean_backward", &flashopm::outer_product_mean_backward_cuda);
}
