#pragma once
// shard::parallel_linear: y = x W^T + b with W split over a tensor-parallel group.
//   dim = None      plain linear, no communication.
//   dim = 1 or -1   column-parallel: weight [out_local, in], bias [out_local];
//                   output sharded on its last dim; backward all-reduces grad_input.
//   dim = 0         row-parallel: weight [out, in_local], bias [out] (whole,
//                   added once); input sharded on its last dim or whole (the op
//                   takes this rank's slice); output whole (all-reduce).
//                   An input whose last dim equals weight.size(1) is read as
//                   this rank's shard: with fewer input features than ranks a
//                   whole input is ambiguous there, and callers slice it first
//                   (shard::scatter), as ParallelLinear does.

#include <ATen/core/Tensor.h>

#include <array>
#include <optional>
#include <string>
#include <tuple>

namespace shardtorch {
namespace ops {

at::Tensor parallel_linear(const at::Tensor& input, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias, std::optional<int64_t> dim,
                           const std::string& group);

// Gradients of parallel_linear w.r.t. (input, weight, bias); entries whose
// output_mask is false come back undefined.
std::tuple<at::Tensor, at::Tensor, at::Tensor> parallel_linear_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    std::optional<int64_t> dim, const std::string& group, std::array<bool, 3> output_mask);

}  // namespace ops
}  // namespace shardtorch
