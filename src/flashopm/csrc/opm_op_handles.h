// Typed dispatcher handles of the ops that C++ calls back into (the autograd kernel, the Python
// entry): one signature per schema of ops.py, looked up once.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <vector>

namespace flashopm {

using OptTensor = std::optional<at::Tensor>;

// flashopm::outer_product_mean
using ForwardSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                              const at::Tensor&, const OptTensor&, const at::Tensor&, const OptTensor&,
                              const at::Tensor&, const OptTensor&, int64_t, int64_t, double, int64_t);
// flashopm::outer_product_mean_backward
using BackwardSig = std::vector<at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                            const at::Tensor&, const at::Tensor&, double, const at::Tensor&,
                                            const OptTensor&, const at::Tensor&, const OptTensor&,
                                            const at::Tensor&, const OptTensor&, int64_t, double,
                                            const c10::List<bool>&, int64_t);
// flashopm::outer_contract_backward
using ContractBackwardSig = std::vector<at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                    const at::Tensor&, bool, bool, int64_t);

// The op's CUDA kernel (opm_api.cpp), for the Python entry's calls that the dispatcher would take
// straight to it.
at::Tensor outer_product_mean_cuda(const at::Tensor& msa, const at::Tensor& mask, const at::Tensor& ln_weight,
                                   const at::Tensor& ln_bias, double ln_eps, const at::Tensor& w_a,
                                   const OptTensor& b_a, const at::Tensor& w_b, const OptTensor& b_b,
                                   const at::Tensor& w_out, const OptTensor& b_out, int64_t algorithm,
                                   int64_t normalization, double norm_eps, int64_t precision);

inline const c10::TypedOperatorHandle<ForwardSig>& forward_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("flashopm::outer_product_mean", "").typed<ForwardSig>();
  return op;
}

inline const c10::TypedOperatorHandle<BackwardSig>& backward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("flashopm::outer_product_mean_backward", "")
                             .typed<BackwardSig>();
  return op;
}

inline const c10::TypedOperatorHandle<ContractBackwardSig>& contract_backward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("flashopm::outer_contract_backward", "")
                             .typed<ContractBackwardSig>();
  return op;
}

}  // namespace flashopm
