#pragma once
// Adapts one device's matrix products (a LinearMath, parallel_linear_impl.h) to
// the schemas of shard::parallel_linear and its backward, so that the CPU and
// CUDA files hold only their GEMMs and one line of registration. Each kernel
// runs on its input's device (the current device may be another): streams,
// handles and communicators follow it.

#include <ATen/DeviceGuard.h>
#include <torch/library.h>

#include "ops/parallel_linear_impl.h"

namespace shardtorch {
namespace ops {

template <typename Math>
struct LinearKernelAdapter {
  static at::Tensor forward(const at::Tensor& input, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, std::optional<int64_t> dim,
                            const std::string& group) {
    const at::OptionalDeviceGuard device_guard(at::device_of(input));
    return parallel_linear_forward_impl(input, weight, bias, dim, group, Math());
  }

  static std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(
      const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
      std::optional<int64_t> dim, const std::string& group, std::array<bool, 3> output_mask) {
    const at::OptionalDeviceGuard device_guard(at::device_of(input));
    return parallel_linear_backward_impl(grad_output, input, weight, dim, group, output_mask,
                                         Math());
  }

  // Registers both ops' kernels for the library's dispatch key.
  static void register_kernels(torch::Library& m) {
    m.impl("parallel_linear", TORCH_FN(forward));
    m.impl("_parallel_linear_backward", TORCH_FN(backward));
  }
};

}  // namespace ops
}  // namespace shardtorch
