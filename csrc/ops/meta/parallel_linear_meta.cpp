// Shapes of parallel_linear and its backward for FakeTensor / torch.compile.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/parallel_linear_plan.h"

namespace shardtorch {
namespace ops {
namespace {

at::Tensor parallel_linear_meta(const at::Tensor& input, const at::Tensor& weight,
                                const std::optional<at::Tensor>& bias, std::optional<int64_t> dim,
                                const std::string& group) {
  plan_parallel_linear(input, weight, bias, dim, group, "shard::parallel_linear");
  auto sizes = input.sym_sizes().vec();
  sizes.back() = weight.sym_size(0);
  return at::empty_symint(sizes, input.options());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> parallel_linear_backward_meta(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    std::optional<int64_t> dim, const std::string& group, std::array<bool, 3> output_mask) {
  plan_parallel_linear(input, weight, std::nullopt, dim, group, "shard::_parallel_linear_backward");
  at::Tensor grad_input, grad_weight, grad_bias;
  if (output_mask[0]) grad_input = at::empty_symint(input.sym_sizes(), input.options());
  if (output_mask[1]) grad_weight = at::empty_symint(weight.sym_sizes(), weight.options());
  if (output_mask[2]) grad_bias = at::empty_symint({weight.sym_size(0)}, weight.options());
  return {grad_input, grad_weight, grad_bias};
}

}  // namespace

TORCH_LIBRARY_IMPL(shard, Meta, m) {
  m.impl("parallel_linear", TORCH_FN(parallel_linear_meta));
  m.impl("_parallel_linear_backward", TORCH_FN(parallel_linear_backward_meta));
}

}  // namespace ops
}  // namespace shardtorch
