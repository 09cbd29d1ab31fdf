#pragma once
// The device-independent part of parallel_linear: which slices, which
// collectives, in which order. The GEMMs come from a LinearMath (ATen on CPU,
// cuBLAS/cuBLASLt on CUDA), so both devices share one algorithm.

#include <ATen/core/Tensor.h>

#include <array>
#include <optional>
#include <string>
#include <tuple>

namespace shardtorch {
namespace ops {

// 2-D matrix products on contiguous row-major operands; results are fresh.
class LinearMath {
 public:
  virtual ~LinearMath() = default;
  // x [M, K], weight [N, K], bias [N] or undefined -> x weight^T + bias [M, N]
  virtual at::Tensor forward(const at::Tensor& x, const at::Tensor& weight,
                             const at::Tensor& bias) const = 0;
  // grad [M, N], weight [N, K] -> grad weight [M, K]
  virtual at::Tensor grad_input(const at::Tensor& grad, const at::Tensor& weight) const = 0;
  // grad [M, N], x [M, K] -> grad^T x [N, K]
  virtual at::Tensor grad_weight(const at::Tensor& grad, const at::Tensor& x) const = 0;
};

at::Tensor parallel_linear_forward_impl(const at::Tensor& input, const at::Tensor& weight,
                                        const std::optional<at::Tensor>& bias,
                                        std::optional<int64_t> dim, const std::string& group,
                                        const LinearMath& math);

std::tuple<at::Tensor, at::Tensor, at::Tensor> parallel_linear_backward_impl(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    std::optional<int64_t> dim, const std::string& group, std::array<bool, 3> output_mask,
    const LinearMath& math);

}  // namespace ops
}  // namespace shardtorch
