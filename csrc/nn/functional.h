#pragma once
// Functional forms of the parallel layers (shardtorch::nn::functional), the
// C++ twin of shardtorch.nn.functional: thin calls into the shard ops.

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

#include <shardtorch/distributed/init_options.h>
#include <shardtorch/ops/parallel_linear.h>

namespace shardtorch {
namespace nn {
namespace functional {

// y = input weight^T + bias with `weight` this rank's shard; see
// ParallelLinear for `dim`.
inline at::Tensor parallel_linear(const at::Tensor& input, const at::Tensor& weight,
                                  const at::Tensor& bias = {},
                                  std::optional<int64_t> dim = std::nullopt,
                                  const std::string& group = distributed::kTensorParallel) {
  std::optional<at::Tensor> maybe_bias;
  if (bias.defined()) maybe_bias = bias;
  return ops::parallel_linear(input, weight, maybe_bias, dim, group);
}

}  // namespace functional
}  // namespace nn
}  // namespace shardtorch
