#pragma once
// shard::parallel_linear_margin_cross_entropy: the margin softmax (ArcFace,
// CosFace, SphereFace-style and their combination) of a class-sharded
// classifier, computed chunk by chunk without the logits.
//
//   parallel_linear_margin_cross_entropy(Tensor input, Tensor weight,
//       Tensor target, float scale=64.0, float m1=1.0, float m2=0.5,
//       float m3=0.0, bool easy_margin=False, int ignore_index=-100,
//       float label_smoothing=0.0, int reduction=1,
//       Tensor? sampled_classes=None, int chunk_size=4096, str group="tp",
//       int? num_classes=None) -> Tensor
//
//   input [*, in_features] (whole on every rank), weight [local_classes,
//   in_features], target [*] global class indices. With cos = the cosine of
//   an input row and a weight row (both L2-normalised, F.normalize's eps) and
//   theta = acos(cos), the target class's logit is scale * psi(cos) and every
//   other class's scale * cos, where
//     psi(cos) = cos(m1 theta + m2) - m3   while m1 theta + m2 <= pi, i.e.
//                                          cos > cos((pi - m2) / m1);
//              = cos - m3 - m2 sin(pi - m2) past it (insightface's fallback,
//                                          which keeps psi decreasing in theta);
//   with easy_margin: psi(cos) = cos(m1 theta + m2) - m3 where cos > 0, and
//   cos itself elsewhere (insightface's easy_margin). The loss is then
//   F.cross_entropy(logits, target, ignore_index=, reduction=,
//   label_smoothing=) on the gathered logits.
//   Ranges: scale > 0, m1 >= 1, 0 <= m2 < pi, 0 <= m3 <= 1.
//
//   sampled_classes: None, or this rank's kept local class indices (int64,
//   strictly increasing, in [0, local_classes), holding every local target of
//   the batch): the loss is then over the union of every rank's kept classes
//   (label smoothing spreads over those), and the weight gradient holds the
//   kept rows only ([kept, in_features], row i for class sampled_classes[i]).
//
// Communication and gradients: as parallel_linear_cross_entropy. When autograd
// needs a gradient of a mean or sum loss of a float32/float64 classifier, the
// gradients are computed in forward (backward only scales them): by blocks of
// rows holding all of the loss's columns where the largest count of columns
// any rank brings fits fused_head_gradient_block_rows (with
// sampling, the kept counts: one tiny all-gather of them), one all-gather of
// statistics per block; else the logits computed twice. Otherwise one
// all-gather of per-row statistics forward, the logits recomputed and one
// all-reduce of the input gradient backward.
//
// Internals:
//   _parallel_linear_margin_cross_entropy_forward(...) -> (loss, row_stats)
//   _parallel_linear_margin_cross_entropy_backward(grad_loss, input, weight,
//     row_stats, target, scale, m1, m2, m3, easy_margin, ignore_index,
//     label_smoothing, reduction, sampled_classes, chunk_size, group,
//     bool[2] output_mask) -> (grad_input, grad_weight)
//   _parallel_linear_margin_cross_entropy_forward_with_gradients(input,
//     weight, target, scale, m1, m2, m3, easy_margin, ignore_index,
//     label_smoothing, reduction, sampled_classes, chunk_size, group,
//     num_classes, bool[2] output_mask)
//     -> (loss, row_stats, grad_input, grad_weight), the gradients of the
//     loss for an upstream gradient of 1.

#include <ATen/core/Tensor.h>

#include <array>
#include <optional>
#include <string>
#include <tuple>

namespace shardtorch {
namespace ops {

at::Tensor parallel_linear_margin_cross_entropy(
    const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target, double scale,
    double m1, double m2, double m3, bool easy_margin, int64_t ignore_index, double label_smoothing,
    int64_t reduction, const std::optional<at::Tensor>& sampled_classes, int64_t chunk_size,
    const std::string& group, std::optional<int64_t> num_classes);

std::tuple<at::Tensor, at::Tensor> parallel_linear_margin_cross_entropy_forward(
    const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target, double scale,
    double m1, double m2, double m3, bool easy_margin, int64_t ignore_index, double label_smoothing,
    int64_t reduction, const std::optional<at::Tensor>& sampled_classes, int64_t chunk_size,
    const std::string& group, std::optional<int64_t> num_classes);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>
parallel_linear_margin_cross_entropy_forward_with_gradients(
    const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target, double scale,
    double m1, double m2, double m3, bool easy_margin, int64_t ignore_index, double label_smoothing,
    int64_t reduction, const std::optional<at::Tensor>& sampled_classes, int64_t chunk_size,
    const std::string& group, std::optional<int64_t> num_classes, std::array<bool, 2> output_mask);

std::tuple<at::Tensor, at::Tensor> parallel_linear_margin_cross_entropy_backward(
    const at::Tensor& grad_loss, const at::Tensor& input, const at::Tensor& weight,
    const at::Tensor& row_stats, const at::Tensor& target, double scale, double m1, double m2,
    double m3, bool easy_margin, int64_t ignore_index, double label_smoothing, int64_t reduction,
    const std::optional<at::Tensor>& sampled_classes, int64_t chunk_size, const std::string& group,
    std::array<bool, 2> output_mask);

}  // namespace ops
}  // namespace shardtorch
