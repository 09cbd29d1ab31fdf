#pragma once
// One column-major GEMM, C = op(A) op(B) (+ bias per row of C) (+ C itself when
// `accumulate`), as in BLAS. Callers map row-major tensors onto it.
//
// A and B share a dtype; C has it too, or is float32 when A and B are
// float16/bfloat16 (their products accumulated and kept in float32, on tensor
// cores). float32 GEMMs use TF32 when torch allows it
// (torch.backends.cuda.matmul.allow_tf32 / set_float32_matmul_precision).
//
// cuBLASLt is told the operands' real alignment (an offset view such as
// x[1:] with an odd K in half precision is only 2-byte aligned). Like
// PyTorch, GEMMs with a dimension of 1, and those cuBLASLt has no algorithm
// for, go to plain cuBLAS instead; a bias the fused epilogue cannot take is
// added afterwards.

#include <ATen/core/Tensor.h>

namespace shardtorch {
namespace ops {
namespace cuda {

void cublaslt_gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k,
                   const at::Tensor& a, int64_t lda, const at::Tensor& b, int64_t ldb,
                   at::Tensor& c, int64_t ldc, const at::Tensor& bias, bool accumulate = false);

}  // namespace cuda
}  // namespace ops
}  // namespace shardtorch
