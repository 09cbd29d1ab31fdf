#pragma once
// shard::parallel_linear_margin_cross_entropy's forward and backward on one
// device, given that device's row kernels (cross_entropy_kernels.h): the
// cosine logits exist one chunk of classes at a time, and the statistics, the
// gather and the loss formula are the plain fused loss's
// (cross_entropy_statistics.h).

#include <ATen/core/Tensor.h>

#include <array>
#include <optional>
#include <string>
#include <tuple>

#include "ops/cross_entropy/cross_entropy_kernels.h"
#include "ops/cross_entropy/margin_cross_entropy_checks.h"

namespace shardtorch {
namespace ops {

// -> (loss, row_stats); see parallel_linear_margin_cross_entropy.h.
std::tuple<at::Tensor, at::Tensor> parallel_linear_margin_cross_entropy_forward_impl(
    const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target,
    const MarginOptions& margin, const CrossEntropyOptions& options,
    const std::optional<at::Tensor>& sampled_classes, int64_t chunk_size, const std::string& group,
    std::optional<int64_t> num_classes, const CrossEntropyKernels& kernels);

// -> (grad_input, grad_weight), each where output_mask asks; grad_weight is
// [sampled_classes.size(0), in_features] when sampled, weight's shape if not.
std::tuple<at::Tensor, at::Tensor> parallel_linear_margin_cross_entropy_backward_impl(
    const at::Tensor& grad_loss, const at::Tensor& input, const at::Tensor& weight,
    const at::Tensor& row_stats, const at::Tensor& target, const MarginOptions& margin,
    const CrossEntropyOptions& options, const std::optional<at::Tensor>& sampled_classes,
    int64_t chunk_size, const std::string& group, std::array<bool, 2> output_mask,
    const CrossEntropyKernels& kernels);

// -> (loss, row_stats, grad_input, grad_weight): the gradients of the loss for
// an upstream gradient of 1, each where output_mask asks.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>
parallel_linear_margin_cross_entropy_forward_with_gradients_impl(
    const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target,
    const MarginOptions& margin, const CrossEntropyOptions& options,
    const std::optional<at::Tensor>& sampled_classes, int64_t chunk_size, const std::string& group,
    std::optional<int64_t> num_classes, std::array<bool, 2> output_mask,
    const CrossEntropyKernels& kernels);

}  // namespace ops
}  // namespace shardtorch
