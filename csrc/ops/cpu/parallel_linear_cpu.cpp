// parallel_linear on CPU: ATen's matrix products (float32 ones through
// cpu_gemm.h), Gloo for the collectives.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/cpu/cpu_gemm.h"
#include "ops/parallel_linear_impl.h"
#include "ops/parallel_linear_kernel_adapter.h"

namespace shardtorch {
namespace ops {
namespace {

class AtenLinearMath final : public LinearMath {
 public:
  at::Tensor forward(const at::Tensor& x, const at::Tensor& weight,
                     const at::Tensor& bias) const override {
    return cpu_addmm(bias, x, weight.t());
  }
  at::Tensor grad_input(const at::Tensor& grad, const at::Tensor& weight) const override {
    return cpu_mm(grad, weight);
  }
  at::Tensor grad_weight(const at::Tensor& grad, const at::Tensor& x) const override {
    return cpu_mm(grad.t(), x);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(shard, CPU, m) { LinearKernelAdapter<AtenLinearMath>::register_kernels(m); }

}  // namespace ops
}  // namespace shardtorch
