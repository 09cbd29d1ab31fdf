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
//   parallel_cross_entropy. Logits are computed chunk_size classes at a time
//   (default 4096) and recomputed in backward, so the extra memory is
//   O(rows x chunk_size) whatever the number of classes.
//
// Communication: forward as parallel_cross_entropy (one all-gather of per-row
// statistics); backward, one all-reduce of the input gradient.
//
// Internals:
//   _parallel_linear_cross_entropy_forward(...) -> (loss, row_stats)
//   _parallel_linear_cross_entropy_backward(grad_loss, input, weight, bias,
//     row_stats, target, class_weight, ignore_index, label_smoothing, z_loss,
//     reduction, chunk_size, group, bool[3] output_mask)
//     -> (grad_input, grad_weight, grad_bias)

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

std::tuple<at::Tensor, at::Tensor, at::Tensor> parallel_linear_cross_entropy_backward(
    const at::Tensor& grad_loss, const at::Tensor& input, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& row_stats, const at::Tensor& target,
    const std::optional<at::Tensor>& class_weight, int64_t ignore_index, double label_smoothing,
    double z_loss, int64_t reduction, int64_t chunk_size, const std::string& group,
    std::array<bool, 3> output_mask);

}  // namespace ops
}  // namespace shardtorch
