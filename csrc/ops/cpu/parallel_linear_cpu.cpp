// parallel_linear on CPU: ATen's matrix products, Gloo for the collectives.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/parallel_linear_impl.h"

namespace shardtorch {
namespace ops {
namespace {

class AtenLinearMath final : public LinearMath {
 public:
  at::Tensor forward(const at::Tensor& x, const at::Tensor& weight,
                     const at::Tensor& bias) const override {
    return bias.defined() ? at::addmm(bias, x, weight.t()) : at::mm(x, weight.t());
  }
  at::Tensor grad_input(const at::Tensor& grad, const at::Tensor& weight) const override {
    return at::mm(grad, weight);
  }
  at::Tensor grad_weight(const at::Tensor& grad, const at::Tensor& x) const override {
    return at::mm(grad.t(), x);
  }
};

at::Tensor parallel_linear_cpu(const at::Tensor& input, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias, std::optional<int64_t> dim,
                               const std::string& group) {
  return parallel_linear_forward_impl(input, weight, bias, dim, group, AtenLinearMath());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> parallel_linear_backward_cpu(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    std::optional<int64_t> dim, const std::string& group, std::array<bool, 3> output_mask) {
  return parallel_linear_backward_impl(grad_output, input, weight, dim, group, output_mask,
                                       AtenLinearMath());
}

}  // namespace

TORCH_LIBRARY_IMPL(shard, CPU, m) {
  m.impl("parallel_linear", TORCH_FN(parallel_linear_cpu));
  m.impl("_parallel_linear_backward", TORCH_FN(parallel_linear_backward_cpu));
}

}  // namespace ops
}  // namespace shardtorch
