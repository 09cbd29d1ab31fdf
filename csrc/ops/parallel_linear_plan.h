#pragma once
// What a parallel_linear call means, decided once from the arguments and the
// group and shared by the CPU, CUDA and Meta kernels so they cannot disagree.

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

namespace shardtorch {
namespace ops {

enum class LinearMode { kPlain, kColumn, kRow };

struct LinearPlan {
  LinearMode mode = LinearMode::kPlain;
  int64_t group_rank = 0;
  int64_t group_size = 1;
  // Row-parallel only: the input carries all in_features and this rank uses
  // [input_offset, input_offset + weight.size(1)) of them.
  bool input_is_whole = false;
  int64_t input_offset = 0;
  int64_t whole_in_features = 0;
};

// Validates the arguments (throwing errors that name argument, rule and value)
// and returns the plan. `op` names the caller in messages.
LinearPlan plan_parallel_linear(const at::Tensor& input, const at::Tensor& weight,
                                const std::optional<at::Tensor>& bias, std::optional<int64_t> dim,
                                const std::string& group, const char* op);

}  // namespace ops
}  // namespace shardtorch
