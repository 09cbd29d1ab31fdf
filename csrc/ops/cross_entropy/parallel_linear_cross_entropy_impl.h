#pragma once
// shard::parallel_linear_cross_entropy's forward and backward on one device,
// given that device's row kernels (cross_entropy_kernels.h): the plain head
// of the fused-head driver (fused_head_driver.h), logits x w^T + b.

#include <ATen/core/Tensor.h>

#include <array>
#include <optional>
#include <string>
#include <tuple>

#include "ops/cross_entropy/cross_entropy_checks.h"
#include "ops/cross_entropy/cross_entropy_kernels.h"

namespace shardtorch {
namespace ops {

// -> (loss, row_stats); see parallel_linear_cross_entropy.h.
std::tuple<at::Tensor, at::Tensor> parallel_linear_cross_entropy_forward_impl(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& target, const std::optional<at::Tensor>& class_weight,
    const CrossEntropyOptions& options, int64_t chunk_size, const std::string& group,
    std::optional<int64_t> num_classes, const CrossEntropyKernels& kernels);

// -> (grad_input, grad_weight, grad_bias), each where output_mask asks.
std::tuple<at::Tensor, at::Tensor, at::Tensor> parallel_linear_cross_entropy_backward_impl(
    const at::Tensor& grad_loss, const at::Tensor& input, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& row_stats, const at::Tensor& target,
    const std::optional<at::Tensor>& class_weight, const CrossEntropyOptions& options,
    int64_t chunk_size, const std::string& group, std::array<bool, 3> output_mask,
    const CrossEntropyKernels& kernels);

// The input as the [rows, features] operand of the classifier's GEMMs: in the
// weight's dtype (a float32 input with a reduced-precision weight, as
// autocast passes them, is cast once, not per chunk).
at::Tensor gemm_input(const at::Tensor& input, const at::Tensor& weight, int64_t rows,
                      int64_t features);

// -> (loss, row_stats, grad_input, grad_weight, grad_bias): the gradients of
// the loss for an upstream gradient of 1 (see parallel_linear_cross_entropy.h),
// each where output_mask asks.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
parallel_linear_cross_entropy_forward_with_gradients_impl(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& target, const std::optional<at::Tensor>& class_weight,
    const CrossEntropyOptions& options, int64_t chunk_size, const std::string& group,
    std::optional<int64_t> num_classes, std::array<bool, 3> output_mask,
    const CrossEntropyKernels& kernels);

}  // namespace ops
}  // namespace shardtorch
