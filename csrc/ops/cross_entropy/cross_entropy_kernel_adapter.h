#pragma once
// Adapts one device's row kernels (cross_entropy_kernels.h) to the schemas of
// parallel_cross_entropy and parallel_linear_cross_entropy: each function
// unpacks its schema's arguments and runs the op's shared implementation
// (parallel_cross_entropy_impl.h, parallel_linear_cross_entropy_impl.h) with
// those kernels, so that the CPU and CUDA files hold only their kernels and a
// line of registration per op. Each runs
// on its input's device (the current device may be another), so that kernels
// launch on that device's current stream and communicators serve that device.

#include <ATen/DeviceGuard.h>
#include <torch/library.h>

#include "ops/cross_entropy/parallel_cross_entropy_impl.h"
#include "ops/cross_entropy/parallel_linear_cross_entropy_impl.h"

namespace shardtorch {
namespace ops {

template <typename Kernels>
struct CrossEntropyKernelAdapter {
  static const CrossEntropyKernels& kernels() {
    static const Kernels instance;
    return instance;
  }

  static CrossEntropyOptions options_of(int64_t ignore_index, double label_smoothing, double z_loss,
                                        int64_t reduction) {
    return CrossEntropyOptions{ignore_index, label_smoothing, z_loss, reduction};
  }

  static std::tuple<at::Tensor, at::Tensor, at::Tensor> forward(
      const at::Tensor& logits, const at::Tensor& target, const std::optional<at::Tensor>& weight,
      int64_t ignore_index, double label_smoothing, double z_loss, int64_t reduction,
      const std::string& group, std::optional<int64_t> num_classes) {
    const at::OptionalDeviceGuard device_guard(at::device_of(logits));
    return parallel_cross_entropy_forward_impl(
        logits, target, weight, options_of(ignore_index, label_smoothing, z_loss, reduction), group,
        num_classes, kernels());
  }

  static at::Tensor loss(const at::Tensor& logits, const at::Tensor& target,
                         const std::optional<at::Tensor>& weight, int64_t ignore_index,
                         double label_smoothing, double z_loss, int64_t reduction,
                         const std::string& group, std::optional<int64_t> num_classes) {
    return std::get<0>(forward(logits, target, weight, ignore_index, label_smoothing, z_loss,
                               reduction, group, num_classes));
  }

  static void backward(const at::Tensor& grad_loss, const at::Tensor& logits_buffer,
                       const at::Tensor& row_stats, const at::Tensor& target,
                       const std::optional<at::Tensor>& weight, int64_t ignore_index,
                       double label_smoothing, double z_loss, int64_t reduction) {
    const at::OptionalDeviceGuard device_guard(at::device_of(logits_buffer));
    parallel_cross_entropy_backward_impl(
        grad_loss, logits_buffer, row_stats, target, weight,
        options_of(ignore_index, label_smoothing, z_loss, reduction), kernels());
  }

  static std::tuple<at::Tensor, at::Tensor> fused_forward(
      const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
      const at::Tensor& target, const std::optional<at::Tensor>& class_weight, int64_t ignore_index,
      double label_smoothing, double z_loss, int64_t reduction, int64_t chunk_size,
      const std::string& group, std::optional<int64_t> num_classes) {
    const at::OptionalDeviceGuard device_guard(at::device_of(input));
    return parallel_linear_cross_entropy_forward_impl(
        input, weight, bias, target, class_weight,
        options_of(ignore_index, label_smoothing, z_loss, reduction), chunk_size, group,
        num_classes, kernels());
  }

  static at::Tensor fused_loss(const at::Tensor& input, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias, const at::Tensor& target,
                               const std::optional<at::Tensor>& class_weight, int64_t ignore_index,
                               double label_smoothing, double z_loss, int64_t reduction,
                               int64_t chunk_size, const std::string& group,
                               std::optional<int64_t> num_classes) {
    return std::get<0>(fused_forward(input, weight, bias, target, class_weight, ignore_index,
                                     label_smoothing, z_loss, reduction, chunk_size, group,
                                     num_classes));
  }

  static std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_backward(
      const at::Tensor& grad_loss, const at::Tensor& input, const at::Tensor& weight,
      const std::optional<at::Tensor>& bias, const at::Tensor& row_stats, const at::Tensor& target,
      const std::optional<at::Tensor>& class_weight, int64_t ignore_index, double label_smoothing,
      double z_loss, int64_t reduction, int64_t chunk_size, const std::string& group,
      std::array<bool, 3> output_mask) {
    const at::OptionalDeviceGuard device_guard(at::device_of(input));
    return parallel_linear_cross_entropy_backward_impl(
        grad_loss, input, weight, bias, row_stats, target, class_weight,
        options_of(ignore_index, label_smoothing, z_loss, reduction), chunk_size, group,
        output_mask, kernels());
  }

  static std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
  fused_forward_with_gradients(const at::Tensor& input, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias, const at::Tensor& target,
                               const std::optional<at::Tensor>& class_weight, int64_t ignore_index,
                               double label_smoothing, double z_loss, int64_t reduction,
                               int64_t chunk_size, const std::string& group,
                               std::optional<int64_t> num_classes,
                               std::array<bool, 3> output_mask) {
    const at::OptionalDeviceGuard device_guard(at::device_of(input));
    return parallel_linear_cross_entropy_forward_with_gradients_impl(
        input, weight, bias, target, class_weight,
        options_of(ignore_index, label_smoothing, z_loss, reduction), chunk_size, group,
        num_classes, output_mask, kernels());
  }

  // Registers every cross-entropy op's kernel for the library's dispatch key.
  // shard::parallel_cross_entropy and its internal ops.
  static void register_parallel_cross_entropy(torch::Library& m) {
    m.impl("parallel_cross_entropy", TORCH_FN(loss));
    m.impl("_parallel_cross_entropy_forward", TORCH_FN(forward));
    m.impl("_parallel_cross_entropy_backward", TORCH_FN(backward));
  }
  // shard::parallel_linear_cross_entropy and its internal ops.
  static void register_parallel_linear_cross_entropy(torch::Library& m) {
    m.impl("parallel_linear_cross_entropy", TORCH_FN(fused_loss));
    m.impl("_parallel_linear_cross_entropy_forward", TORCH_FN(fused_forward));
    m.impl("_parallel_linear_cross_entropy_backward", TORCH_FN(fused_backward));
    m.impl("_parallel_linear_cross_entropy_forward_with_gradients",
           TORCH_FN(fused_forward_with_gradients));
  }
};

}  // namespace ops
}  // namespace shardtorch
