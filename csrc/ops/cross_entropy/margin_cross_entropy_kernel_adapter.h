#pragma once
// Adapts one device's row kernels (cross_entropy_kernels.h) to the schemas of
// parallel_linear_margin_cross_entropy, as cross_entropy_kernel_adapter.h does
// for the plain losses. Each runs on its input's device, whichever device is
// current.

#include <ATen/DeviceGuard.h>
#include <torch/library.h>

#include "ops/cross_entropy/parallel_linear_margin_cross_entropy_impl.h"

namespace shardtorch {
namespace ops {

template <typename Kernels>
struct MarginCrossEntropyKernelAdapter {
  static const CrossEntropyKernels& kernels() {
    static const Kernels instance;
    return instance;
  }

  static MarginOptions margin_of(double scale, double m1, double m2, double m3, bool easy_margin) {
    return MarginOptions{scale, m1, m2, m3, easy_margin};
  }

  static CrossEntropyOptions options_of(int64_t ignore_index, double label_smoothing,
                                        int64_t reduction) {
    return CrossEntropyOptions{ignore_index, label_smoothing, /*z_loss=*/0.0, reduction};
  }

  static std::tuple<at::Tensor, at::Tensor> forward(
      const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target, double scale,
      double m1, double m2, double m3, bool easy_margin, int64_t ignore_index,
      double label_smoothing, int64_t reduction, const std::optional<at::Tensor>& sampled_classes,
      int64_t chunk_size, const std::string& group, std::optional<int64_t> num_classes) {
    const at::OptionalDeviceGuard device_guard(at::device_of(input));
    return parallel_linear_margin_cross_entropy_forward_impl(
        input, weight, target, margin_of(scale, m1, m2, m3, easy_margin),
        options_of(ignore_index, label_smoothing, reduction), sampled_classes, chunk_size, group,
        num_classes, kernels());
  }

  static at::Tensor loss(const at::Tensor& input, const at::Tensor& weight,
                         const at::Tensor& target, double scale, double m1, double m2, double m3,
                         bool easy_margin, int64_t ignore_index, double label_smoothing,
                         int64_t reduction, const std::optional<at::Tensor>& sampled_classes,
                         int64_t chunk_size, const std::string& group,
                         std::optional<int64_t> num_classes) {
    return std::get<0>(forward(input, weight, target, scale, m1, m2, m3, easy_margin, ignore_index,
                               label_smoothing, reduction, sampled_classes, chunk_size, group,
                               num_classes));
  }

  static std::tuple<at::Tensor, at::Tensor> backward(
      const at::Tensor& grad_loss, const at::Tensor& input, const at::Tensor& weight,
      const at::Tensor& row_stats, const at::Tensor& target, double scale, double m1, double m2,
      double m3, bool easy_margin, int64_t ignore_index, double label_smoothing, int64_t reduction,
      const std::optional<at::Tensor>& sampled_classes, int64_t chunk_size,
      const std::string& group, std::array<bool, 2> output_mask) {
    const at::OptionalDeviceGuard device_guard(at::device_of(input));
    return parallel_linear_margin_cross_entropy_backward_impl(
        grad_loss, input, weight, row_stats, target, margin_of(scale, m1, m2, m3, easy_margin),
        options_of(ignore_index, label_smoothing, reduction), sampled_classes, chunk_size, group,
        output_mask, kernels());
  }

  static std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward_with_gradients(
      const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target, double scale,
      double m1, double m2, double m3, bool easy_margin, int64_t ignore_index,
      double label_smoothing, int64_t reduction, const std::optional<at::Tensor>& sampled_classes,
      int64_t chunk_size, const std::string& group, std::optional<int64_t> num_classes,
      std::array<bool, 2> output_mask) {
    const at::OptionalDeviceGuard device_guard(at::device_of(input));
    return parallel_linear_margin_cross_entropy_forward_with_gradients_impl(
        input, weight, target, margin_of(scale, m1, m2, m3, easy_margin),
        options_of(ignore_index, label_smoothing, reduction), sampled_classes, chunk_size, group,
        num_classes, output_mask, kernels());
  }

  // shard::parallel_linear_margin_cross_entropy and its internal ops.
  static void register_parallel_linear_margin_cross_entropy(torch::Library& m) {
    m.impl("parallel_linear_margin_cross_entropy", TORCH_FN(loss));
    m.impl("_parallel_linear_margin_cross_entropy_forward", TORCH_FN(forward));
    m.impl("_parallel_linear_margin_cross_entropy_backward", TORCH_FN(backward));
    m.impl("_parallel_linear_margin_cross_entropy_forward_with_gradients",
           TORCH_FN(forward_with_gradients));
  }
};

}  // namespace ops
}  // namespace shardtorch
