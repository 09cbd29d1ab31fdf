#pragma once
// One column-major GEMM through cuBLASLt, C = op(A) op(B) (+ bias per row of
// C), as in BLAS. Callers map row-major tensors onto it.

#include <ATen/core/Tensor.h>

namespace shardtorch {
namespace ops {
namespace cuda {

void cublaslt_gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k,
                   const at::Tensor& a, int64_t lda, const at::Tensor& b, int64_t ldb,
                   at::Tensor& c, int64_t ldc, const at::Tensor& bias);

}  // namespace cuda
}  // namespace ops
}  // namespace shardtorch
