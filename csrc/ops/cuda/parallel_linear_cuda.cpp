// parallel_linear on CUDA: GEMMs through cuBLASLt (bias fused as an epilogue),
// collectives through NCCL (the CUDA communicator).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/cuda/cublaslt_gemm.h"
#include "ops/parallel_linear_impl.h"
#include "ops/parallel_linear_kernel_adapter.h"

namespace shardtorch {
namespace ops {
namespace {

// Row-major [rows, cols] tensors are column-major [cols, rows]: every product
// below is written in that transposed view.
class CublasLinearMath final : public LinearMath {
 public:
  at::Tensor forward(const at::Tensor& x, const at::Tensor& weight,
                     const at::Tensor& bias) const override {
    const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
    at::Tensor y = at::empty({M, N}, x.options());
    if (M == 0 || N == 0) return y;
    if (K == 0) return bias.defined() ? y.copy_(bias.expand({M, N})) : y.zero_();
    // y^T [N, M] = W [N, K] x^T
    cuda::cublaslt_gemm(/*transpose_a=*/true, /*transpose_b=*/false, N, M, K, weight, K, x, K, y, N,
                        bias.defined() ? bias.contiguous() : bias);
    return y;
  }

  at::Tensor grad_input(const at::Tensor& grad, const at::Tensor& weight) const override {
    const int64_t M = grad.size(0), N = grad.size(1), K = weight.size(1);
    at::Tensor gx = at::empty({M, K}, grad.options());
    if (M == 0 || K == 0) return gx;
    if (N == 0) return gx.zero_();
    // gx^T [K, M] = W^T [K, N] grad^T
    cuda::cublaslt_gemm(false, false, K, M, N, weight, K, grad, N, gx, K, at::Tensor());
    return gx;
  }

  at::Tensor grad_weight(const at::Tensor& grad, const at::Tensor& x) const override {
    const int64_t M = grad.size(0), N = grad.size(1), K = x.size(1);
    at::Tensor gw = at::empty({N, K}, grad.options());
    if (N == 0 || K == 0) return gw;
    if (M == 0) return gw.zero_();
    // gw^T [K, N] = x^T [K, M] grad [M, N]
    cuda::cublaslt_gemm(false, true, K, N, M, x, K, grad, N, gw, K, at::Tensor());
    return gw;
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(shard, CUDA, m) { LinearKernelAdapter<CublasLinearMath>::register_kernels(m); }

}  // namespace ops
}  // namespace shardtorch
