// Autograd and autocast of flashopm::outer_product_mean on CUDA, registered from C++.
//
// ops.py registers the op's autograd in Python for every device (the CPU path, and CUDA before
// this extension is loaded).  A Python autograd kernel costs tens of microseconds on every call,
// with or without gradients, which is more than the whole GPU time of the op at small sizes; this
// AutogradCUDA kernel takes precedence over it.  Its backward calls the op
// flashopm::outer_product_mean_backward through the dispatcher, so whichever implementation is
// registered for it (and any tracing mode of torch.compile) sees the call.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "opm_op_handles.h"

#include <array>
#include <optional>
#include <vector>

namespace flashopm {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor forward_below_autograd(const at::Tensor& msa, const at::Tensor& mask, const at::Tensor& ln_w,
                                  const at::Tensor& ln_b, double ln_eps, const at::Tensor& w_a, const OptTensor& b_a,
                                  const at::Tensor& w_b, const OptTensor& b_b, const at::Tensor& w_out,
                                  const OptTensor& b_out, int64_t algorithm, int64_t normalization, double norm_eps,
                                  int64_t precision) {
  at::AutoDispatchBelowADInplaceOrView guard;
  return forward_op().call(msa, mask, ln_w, ln_b, ln_eps, w_a, b_a, w_b, b_b, w_out, b_out, algorithm, normalization,
                           norm_eps, precision);
}

// forward(grads, sources) -> grads: the gradients of a backward run with create_graph=True, as
// outputs of a node whose inputs are what they were computed from, so that a second derivative
// reaches the node, which raises with ops.py's SECOND_DERIVATIVE_MESSAGE (PyTorch's fallback for an
// op without a derivative would only warn and take the missing terms as zero).
struct SecondDerivativeError : public torch::autograd::Function<SecondDerivativeError> {
  static variable_list forward(AutogradContext* /*ctx*/, at::TensorList grads, at::TensorList /*sources*/) {
    return grads.vec();
  }
  static variable_list backward(AutogradContext* /*ctx*/, variable_list /*grad_outputs*/) {
    TORCH_CHECK(false,
                "flashopm: the gradients of the outer-product mean are not differentiable again: a second "
                "derivative through it (create_graph=True followed by a backward through those gradients, e.g. a "
                "gradient penalty) is not supported");
  }
};

std::vector<at::Tensor> mark_not_differentiable_again(const std::vector<at::Tensor>& grads,
                                                      const std::vector<at::Tensor>& sources) {
  std::vector<at::Tensor> needed;
  for (const at::Tensor& t : sources) {
    if (t.defined() && t.requires_grad()) needed.push_back(t);
  }
  if (needed.empty()) return grads;
  return SecondDerivativeError::apply(at::TensorList(grads), at::TensorList(needed));
}

// The differentiable inputs, in the order of the backward op's gradients (reference.GRAD_INPUTS).
constexpr int kGradInputs = 9;

struct OuterProductMeanFunction : public torch::autograd::Function<OuterProductMeanFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& msa, const at::Tensor& mask,
                            const at::Tensor& ln_w, const at::Tensor& ln_b, double ln_eps, const at::Tensor& w_a,
                            const OptTensor& b_a, const at::Tensor& w_b, const OptTensor& b_b,
                            const at::Tensor& w_out, const OptTensor& b_out, int64_t algorithm,
                            int64_t normalization, double norm_eps, int64_t precision) {
    const at::Tensor undefined;
    ctx->save_for_backward({msa, mask, ln_w, ln_b, w_a, b_a.value_or(undefined), w_b, b_b.value_or(undefined), w_out,
                            b_out.value_or(undefined)});
    ctx->saved_data["ln_eps"] = ln_eps;
    ctx->saved_data["normalization"] = normalization;
    ctx->saved_data["norm_eps"] = norm_eps;
    ctx->saved_data["precision"] = precision;
    return forward_below_autograd(msa, mask, ln_w, ln_b, ln_eps, w_a, b_a, w_b, b_b, w_out, b_out, algorithm,
                                  normalization, norm_eps, precision);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &msa = saved[0], &mask = saved[1], &ln_w = saved[2], &ln_b = saved[3], &w_a = saved[4];
    const at::Tensor &w_b = saved[6], &w_out = saved[8];
    const auto opt = [](const at::Tensor& t) { return t.defined() ? OptTensor(t) : OptTensor(); };
    const OptTensor b_a = opt(saved[5]), b_b = opt(saved[7]), b_out = opt(saved[9]);

    // Forward arguments that are tensors, in order; absent biases have no edge in the graph.
    // Argument positions: msa 0, mask 1, ln_w 2, ln_b 3, w_a 5, b_a 6, w_b 7, b_b 8, w_out 9, b_out 10.
    const std::array<int, kGradInputs> grad_arg = {0, 2, 3, 5, 6, 7, 8, 9, 10};
    const std::array<bool, 11> present = {true, true, true, true, false, true, b_a.has_value(), true,
                                          b_b.has_value(), true, b_out.has_value()};
    std::array<int, 11> edge{};
    for (int arg = 0, e = 0; arg < 11; ++arg) edge[arg] = present[arg] ? e++ : -1;

    std::array<bool, kGradInputs> needs{};
    bool any = false;
    for (int g = 0; g < kGradInputs; ++g) {
      const int e = edge[grad_arg[g]];
      needs[g] = e >= 0 && ctx->needs_input_grad(e);
      any = any || needs[g];
    }
    // One gradient per forward argument (15), undefined for non-tensors and what is not needed.
    variable_list grads(15);
    if (!any) return grads;
    const at::Tensor grad_out = grad_outputs[0].contiguous();
    c10::List<bool> output_mask;
    output_mask.reserve(kGradInputs);
    for (const bool need : needs) output_mask.push_back(need);
    // The call goes below autograd at once, past PyTorch's boxed fallback for ops without a
    // derivative (which would pack and unpack all sixteen arguments to find that nothing needs
    // one, and under create_graph=True would only warn when its missing derivative is asked for).
    std::vector<at::Tensor> computed;
    {
      const at::AutoDispatchBelowADInplaceOrView below_autograd;
      computed = backward_op().call(grad_out, msa, mask, ln_w, ln_b, ctx->saved_data["ln_eps"].toDouble(), w_a, b_a,
                                    w_b, b_b, w_out, b_out, ctx->saved_data["normalization"].toInt(),
                                    ctx->saved_data["norm_eps"].toDouble(), output_mask,
                                    ctx->saved_data["precision"].toInt());
    }
    if (at::GradMode::is_enabled()) {
      std::vector<at::Tensor> sources(saved.begin(), saved.end());
      sources.push_back(grad_outputs[0]);
      computed = mark_not_differentiable_again(computed, sources);
    }
    for (int g = 0; g < kGradInputs; ++g) {
      if (needs[g]) grads[grad_arg[g]] = computed[g];
    }
    return grads;
  }
};

at::Tensor outer_product_mean_autograd(const at::Tensor& msa, const at::Tensor& mask, const at::Tensor& ln_w,
                                       const at::Tensor& ln_b, double ln_eps, const at::Tensor& w_a,
                                       const OptTensor& b_a, const at::Tensor& w_b, const OptTensor& b_b,
                                       const at::Tensor& w_out, const OptTensor& b_out, int64_t algorithm,
                                       int64_t normalization, double norm_eps, int64_t precision) {
  // Inference (no_grad, or nothing requires grad) skips building a graph node altogether.
  if (!at::GradMode::is_enabled() ||
      !(msa.requires_grad() || ln_w.requires_grad() || ln_b.requires_grad() || w_a.requires_grad() ||
        w_b.requires_grad() || w_out.requires_grad() || (b_a && b_a->requires_grad()) ||
        (b_b && b_b->requires_grad()) || (b_out && b_out->requires_grad()) || mask.requires_grad())) {
    return forward_below_autograd(msa, mask, ln_w, ln_b, ln_eps, w_a, b_a, w_b, b_b, w_out, b_out, algorithm,
                                  normalization, norm_eps, precision);
  }
  return OuterProductMeanFunction::apply(msa, mask, ln_w, ln_b, ln_eps, w_a, b_a, w_b, b_b, w_out, b_out, algorithm,
                                         normalization, norm_eps, precision);
}

// In a CUDA autocast region the op runs as the reference's linear layers and einsum run there:
// the parameters cast to the region's type (the mask as given; msa_repr too unless it is float32,
// which the LayerNorm reads as it is, as the reference's LayerNorm runs in float32 there), then the
// op below autocast, which returns that type.  The rule of ops.py's autocast kernel (the CPU's, and
// torch.compile's tracing), here in C++: a Python kernel and its casts cost ~170 us of host time
// per call (H200, the spec shape).  cached_cast is autocast's own cast: it skips tensors that are
// not floating, are float64 or already of that type, and reuses a leaf parameter's cast within
// one region, as nn.Linear's casts do.
at::Tensor outer_product_mean_autocast(const at::Tensor& msa, const at::Tensor& mask, const at::Tensor& ln_w,
                                       const at::Tensor& ln_b, double ln_eps, const at::Tensor& w_a,
                                       const OptTensor& b_a, const at::Tensor& w_b, const OptTensor& b_b,
                                       const at::Tensor& w_out, const OptTensor& b_out, int64_t algorithm,
                                       int64_t normalization, double norm_eps, int64_t precision) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCUDA);
  const at::ScalarType type = at::autocast::get_autocast_dtype(at::kCUDA);
  const auto cast = [type](const at::Tensor& t) { return at::autocast::cached_cast(type, t, c10::DeviceType::CUDA); };
  const auto cast_opt = [&cast](const OptTensor& t) { return t ? OptTensor(cast(*t)) : OptTensor(); };
  return forward_op().call(msa.scalar_type() == at::kFloat ? msa : cast(msa), mask, cast(ln_w), cast(ln_b), ln_eps,
                           cast(w_a), cast_opt(b_a), cast(w_b), cast_opt(b_b), cast(w_out), cast_opt(b_out), algorithm,
                           normalization, norm_eps, precision);
}

}  // namespace
}  // namespace flashopm

TORCH_LIBRARY_IMPL(flashopm, AutogradCUDA, m) {
  m.impl("outer_product_mean", &flashopm::outer_product_mean_autograd);
}

TORCH_LIBRARY_IMPL(flashopm, AutocastCUDA, m) {
  m.impl("outer_product_mean", &flashopm::outer_product_mean_autocast);
}
