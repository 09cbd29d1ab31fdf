// Shapes of the parallel_linear_cross_entropy ops for FakeTensor /
// torch.compile. The argument checks are the real kernels' own
// (cross_entropy_checks.h); checks that need the group or the targets' values
// happen in the real kernels only.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/cross_entropy/cross_entropy_checks.h"

namespace shardtorch {
namespace ops {
namespace {

std::tuple<at::Tensor, at::Tensor> fused_forward_meta(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& target, const std::optional<at::Tensor>& class_weight, int64_t ignore_index,
    double label_smoothing, double z_loss, int64_t reduction, int64_t chunk_size,
    const std::string& group, std::optional<int64_t> num_classes) {
  check_parallel_linear_cross_entropy_args(
      input, weight, bias, target, class_weight,
      CrossEntropyOptions{ignore_index, label_smoothing, z_loss, reduction}, chunk_size,
      "shard::parallel_linear_cross_entropy");
  at::Tensor loss = at::empty_symint(cross_entropy_loss_shape(target, reduction), input.options());
  at::Tensor row_stats = at::empty_symint(saved_row_stats_shape(leading_rows(input)),
                                          input.options().dtype(at::kDouble));
  return {loss, row_stats};
}

at::Tensor fused_loss_meta(const at::Tensor& input, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias, const at::Tensor& target,
                           const std::optional<at::Tensor>& class_weight, int64_t ignore_index,
                           double label_smoothing, double z_loss, int64_t reduction,
                           int64_t chunk_size, const std::string& group,
                           std::optional<int64_t> num_classes) {
  return std::get<0>(fused_forward_meta(input, weight, bias, target, class_weight, ignore_index,
                                        label_smoothing, z_loss, reduction, chunk_size, group,
                                        num_classes));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_backward_meta(
    const at::Tensor& grad_loss, const at::Tensor& input, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& row_stats, const at::Tensor& target,
    const std::optional<at::Tensor>& class_weight, int64_t ignore_index, double label_smoothing,
    double z_loss, int64_t reduction, int64_t chunk_size, const std::string& group,
    std::array<bool, 3> output_mask) {
  at::Tensor grad_input, grad_weight, grad_bias;
  if (output_mask[0]) grad_input = at::empty_symint(input.sym_sizes(), input.options());
  if (output_mask[1]) grad_weight = at::empty_symint(weight.sym_sizes(), weight.options());
  if (output_mask[2] && bias.has_value() && bias->defined()) {
    grad_bias = at::empty_symint(bias->sym_sizes(), bias->options());
  }
  return {grad_input, grad_weight, grad_bias};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
fused_forward_with_gradients_meta(const at::Tensor& input, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias, const at::Tensor& target,
                                  const std::optional<at::Tensor>& class_weight,
                                  int64_t ignore_index, double label_smoothing, double z_loss,
                                  int64_t reduction, int64_t chunk_size, const std::string& group,
                                  std::optional<int64_t> num_classes,
                                  std::array<bool, 3> output_mask) {
  TORCH_CHECK(reduction != 0, "shard::_parallel_linear_cross_entropy_forward_with_gradients",
              ": needs reduction mean or sum (a scalar loss), got reduction none");
  auto [loss, row_stats] =
      fused_forward_meta(input, weight, bias, target, class_weight, ignore_index, label_smoothing,
                         z_loss, reduction, chunk_size, group, num_classes);
  auto [grad_input, grad_weight, grad_bias] =
      fused_backward_meta(loss, input, weight, bias, row_stats, target, class_weight, ignore_index,
                          label_smoothing, z_loss, reduction, chunk_size, group, output_mask);
  return {loss, row_stats, grad_input, grad_weight, grad_bias};
}

}  // namespace

TORCH_LIBRARY_IMPL(shard, Meta, m) {
  m.impl("parallel_linear_cross_entropy", TORCH_FN(fused_loss_meta));
  m.impl("_parallel_linear_cross_entropy_forward", TORCH_FN(fused_forward_meta));
  m.impl("_parallel_linear_cross_entropy_backward", TORCH_FN(fused_backward_meta));
  m.impl("_parallel_linear_cross_entropy_forward_with_gradients",
         TORCH_FN(fused_forward_with_gradients_meta));
}

}  // namespace ops
}  // namespace shardtorch
