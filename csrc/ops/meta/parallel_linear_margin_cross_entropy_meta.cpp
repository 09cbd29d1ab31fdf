// Shapes of parallel_linear_margin_cross_entropy for FakeTensor /
// torch.compile. The argument checks are the real kernels' own
// (margin_cross_entropy_checks.h); checks of the targets' and the sampled
// classes' values happen in the real kernels only.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/cross_entropy/margin_cross_entropy_checks.h"

namespace shardtorch {
namespace ops {
namespace {

constexpr const char* kOp = "shard::parallel_linear_margin_cross_entropy";

std::tuple<at::Tensor, at::Tensor> forward_meta(
    const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target, double scale,
    double m1, double m2, double m3, bool easy_margin, int64_t ignore_index, double label_smoothing,
    int64_t reduction, const std::optional<at::Tensor>& sampled_classes, int64_t chunk_size,
    const std::string& group, std::optional<int64_t> num_classes) {
  check_parallel_linear_margin_cross_entropy_args(
      input, weight, target, MarginOptions{scale, m1, m2, m3, easy_margin},
      CrossEntropyOptions{ignore_index, label_smoothing, 0.0, reduction}, sampled_classes,
      chunk_size, kOp);
  at::Tensor loss = at::empty_symint(cross_entropy_loss_shape(target, reduction), input.options());
  at::Tensor row_stats = at::empty_symint(saved_row_stats_shape(leading_rows(input)),
                                          input.options().dtype(at::kDouble));
  return {loss, row_stats};
}

at::Tensor loss_meta(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target,
                     double scale, double m1, double m2, double m3, bool easy_margin,
                     int64_t ignore_index, double label_smoothing, int64_t reduction,
                     const std::optional<at::Tensor>& sampled_classes, int64_t chunk_size,
                     const std::string& group, std::optional<int64_t> num_classes) {
  return std::get<0>(forward_meta(input, weight, target, scale, m1, m2, m3, easy_margin,
                                  ignore_index, label_smoothing, reduction, sampled_classes,
                                  chunk_size, group, num_classes));
}

std::tuple<at::Tensor, at::Tensor> backward_meta(
    const at::Tensor& grad_loss, const at::Tensor& input, const at::Tensor& weight,
    const at::Tensor& row_stats, const at::Tensor& target, double scale, double m1, double m2,
    double m3, bool easy_margin, int64_t ignore_index, double label_smoothing, int64_t reduction,
    const std::optional<at::Tensor>& sampled_classes, int64_t chunk_size, const std::string& group,
    std::array<bool, 2> output_mask) {
  at::Tensor grad_input, grad_weight;
  if (output_mask[0]) grad_input = at::empty_symint(input.sym_sizes(), input.options());
  if (output_mask[1]) {
    const c10::SymInt rows_of_grad =
        is_sampled(sampled_classes) ? sampled_classes->sym_size(0) : weight.sym_size(0);
    grad_weight = at::empty_symint({rows_of_grad, weight.sym_size(1)}, weight.options());
  }
  return {grad_input, grad_weight};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward_with_gradients_meta(
    const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target, double scale,
    double m1, double m2, double m3, bool easy_margin, int64_t ignore_index, double label_smoothing,
    int64_t reduction, const std::optional<at::Tensor>& sampled_classes, int64_t chunk_size,
    const std::string& group, std::optional<int64_t> num_classes, std::array<bool, 2> output_mask) {
  TORCH_CHECK(reduction != 0, kOp, ": gradients in forward need reduction mean or sum");
  auto [loss, row_stats] =
      forward_meta(input, weight, target, scale, m1, m2, m3, easy_margin, ignore_index,
                   label_smoothing, reduction, sampled_classes, chunk_size, group, num_classes);
  auto [grad_input, grad_weight] = backward_meta(
      loss, input, weight, row_stats, target, scale, m1, m2, m3, easy_margin, ignore_index,
      label_smoothing, reduction, sampled_classes, chunk_size, group, output_mask);
  return {loss, row_stats, grad_input, grad_weight};
}

}  // namespace

TORCH_LIBRARY_IMPL(shard, Meta, m) {
  m.impl("parallel_linear_margin_cross_entropy", TORCH_FN(loss_meta));
  m.impl("_parallel_linear_margin_cross_entropy_forward", TORCH_FN(forward_meta));
  m.impl("_parallel_linear_margin_cross_entropy_backward", TORCH_FN(backward_meta));
  m.impl("_parallel_linear_margin_cross_entropy_forward_with_gradients",
         TORCH_FN(forward_with_gradients_meta));
}

}  // namespace ops
}  // namespace shardtorch
