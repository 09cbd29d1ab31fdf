#pragma once
// shard::parallel_linear_cross_entropy: the loss of a column-parallel
// classifier, parallel_cross_entropy(parallel_linear(input, weight, bias,
// dim=1), target, ...), computed without materialising the logits.
//
//   parallel_linear_cross_entropy(Tensor input, Tensor weight, Tensor? bias,
//       Tensor target, Tensor? class_weight=None, int ignore_index=-100,
//       float label_smoothing=0.0, float z_loss=0.0, int reduction=1,
//       int chunk_size=4096, str group="tp", int? num_classes=None) -> Tensor
//
//   input [*, in_features] (whole on every rank), weight [local_classes,
//   in_features], bias [local_classes]; the other arguments as in
//   parallel_cross_entropy. The logits never exist whole: the extra memory is
//   O(max(rows x chunk_size, 2^22)) whatever the number of classes (chunk_size
//   default 4096; 2^22 is kGradientBlockMinElements of ops/cross_entropy/fused_head_driver.h),
//   or, where that would make blocks of rows thinner than 128, no more than
//   the weight gradient (local_classes x in_features).
//
// Two ways to the gradients, chosen by autograd:
// - Gradients in forward (a float32/float64 classifier, reduction mean or
//   sum, and autograd needs a gradient): the forward computes the input,
//   weight and bias gradients too, and backward only scales them by the
//   upstream gradient (not at all for loss.backward()'s 1 on CPU). Where a block of rows holding
//   all of the largest shard's classes fits the memory bound
//   (fused_head_gradient_block_rows > 0, ops/cross_entropy/fused_head_driver.h), each row's
//   logits are computed once: three GEMMs, against four when they are
//   recomputed; one all-gather of statistics per block of rows and one
//   all-reduce of the input gradient. Otherwise the forward computes the
//   logits twice, chunk_size classes at a time, as the separate backward
//   does. The gradients live from forward to backward.
// - Otherwise: forward as parallel_cross_entropy (one all-gather of per-row
//   statistics); backward recomputes the logits chunk by chunk, one
//   all-reduce of the input gradient.
//
// Internals:
//   _parallel_linear_cross_entropy_forward(...) -> (loss, row_stats)
//   _parallel_linear_cross_entropy_backward(grad_loss, input, weight, bias,
//     row_stats, target, class_weight, ignore_index, label_smoothing, z_loss,
//     reduction, chunk_size, group, bool[3] output_mask)
//     -> (grad_input, grad_weight, grad_bias)
//   _parallel_linear_cross_entropy_forward_with_gradients(input, weight, bias,
//     target, class_weight, ignore_index, label_smoothing, z_loss, reduction,
//     chunk_size, group, num_classes, bool[3] output_mask)
//     -> (loss, row_stats, grad_input, grad_weight, grad_bias), the gradients
//     of the loss for an upstream gradient of 1; reduction must be mean or
//     sum.

#include <ATen/core/Tensor.h>

#include <array>
#include <optional>
#include <string>
#include <tuple>

namespace shardtorch {
namespace ops {

constexpr int64_t kDefaultCrossEntropyChunk = 4096;
at::Tensor parallel_linear_cross_entropy(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& target, const std::optional<at::Tensor>& class_weight, int64_t ignore_index,
    double label_smoothing, double z_loss, int64_t reduction, int64_t chunk_size,
    const std::string& group, std::optional<int64_t> num_classes);

std::tuple<at::Tensor, at::Tensor> parallel_linear_cross_entropy_forward(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& target, const std::optional<at::Tensor>& class_weight, int64_t ignore_index,
    double label_smoothing, double z_loss, int64_t reduction, int64_t chunk_size,
    const std::string& group, std::optional<int64_t> num_classes);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
parallel_linear_cross_entropy_forward_with_gradients(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& target, const std::optional<at::Tensor>& class_weight, int64_t ignore_index,
    double label_smoothing, double z_loss, int64_t reduction, int64_t chunk_size,
    const std::string& group, std::optional<int64_t> num_classes, std::array<bool, 3> output_mask);

std::tuple<at::Tensor, at::Tensor, at::Tensor> parallel_linear_cross_entropy_backward(
    const at::Tensor& grad_loss, const at::Tensor& input, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& row_stats, const at::Tensor& target,
    const std::optional<at::Tensor>& class_weight, int64_t ignore_index, double label_smoothing,
    double z_loss, int64_t reduction, int64_t chunk_size, const std::string& group,
    std::array<bool, 3> output_mask);

}  // namespace ops
}  // namespace shardtorch
