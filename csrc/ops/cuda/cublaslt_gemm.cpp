#include "ops/cuda/cublaslt_gemm.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>

#include <memory>
#include <mutex>
#include <unordered_map>

#include "utils/cuda_library_checks.h"

namespace shardtorch {
namespace ops {
namespace cuda {
namespace {

constexpr size_t kWorkspaceBytes = 32 << 20;  // what cuBLAS recommends for Hopper

cublasLtHandle_t lt_handle() {
  static std::mutex mutex;
  static std::unordered_map<int, cublasLtHandle_t> handles;  // one per device, never freed
  const int device = c10::cuda::current_device();
  std::lock_guard<std::mutex> lock(mutex);
  auto it = handles.find(device);
  if (it != handles.end()) return it->second;
  cublasLtHandle_t handle = nullptr;
  SHARDTORCH_CUBLAS_CHECK(cublasLtCreate(&handle), "cublasLtCreate");
  handles.emplace(device, handle);
  return handle;
}

struct TypeInfo {
  cudaDataType_t data;
  cublasComputeType_t compute;
  cudaDataType_t scale;
};

TypeInfo type_info(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return {CUDA_R_32F, CUBLAS_COMPUTE_32F, CUDA_R_32F};
    case at::kDouble: return {CUDA_R_64F, CUBLAS_COMPUTE_64F, CUDA_R_64F};
    case at::kHalf: return {CUDA_R_16F, CUBLAS_COMPUTE_32F, CUDA_R_32F};
    case at::kBFloat16: return {CUDA_R_16BF, CUBLAS_COMPUTE_32F, CUDA_R_32F};
    default: TORCH_CHECK(false, "shard::parallel_linear (CUDA): unsupported dtype ", type);
  }
}

template <typename T, void (*Destroy)(T)>
struct LtDeleter {
  void operator()(T p) const { Destroy(p); }
};
void destroy_desc(cublasLtMatmulDesc_t d) { cublasLtMatmulDescDestroy(d); }
void destroy_layout(cublasLtMatrixLayout_t l) { cublasLtMatrixLayoutDestroy(l); }
void destroy_pref(cublasLtMatmulPreference_t p) { cublasLtMatmulPreferenceDestroy(p); }
using DescPtr = std::unique_ptr<std::remove_pointer_t<cublasLtMatmulDesc_t>,
                                LtDeleter<cublasLtMatmulDesc_t, destroy_desc>>;
using LayoutPtr = std::unique_ptr<std::remove_pointer_t<cublasLtMatrixLayout_t>,
                                  LtDeleter<cublasLtMatrixLayout_t, destroy_layout>>;
using PrefPtr = std::unique_ptr<std::remove_pointer_t<cublasLtMatmulPreference_t>,
                                LtDeleter<cublasLtMatmulPreference_t, destroy_pref>>;

LayoutPtr layout(cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld) {
  cublasLtMatrixLayout_t raw = nullptr;
  SHARDTORCH_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&raw, type, rows, cols, ld), "layout");
  return LayoutPtr(raw);
}

// Returns false when no algorithm supports this problem (with the bias
// epilogue, say), so that the caller can fall back.
bool try_matmul(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k,
                const at::Tensor& a, int64_t lda, const at::Tensor& b, int64_t ldb, at::Tensor& c,
                int64_t ldc, const at::Tensor& bias) {
  const TypeInfo info = type_info(c.scalar_type());
  cublasLtMatmulDesc_t raw_desc = nullptr;
  SHARDTORCH_CUBLAS_CHECK(cublasLtMatmulDescCreate(&raw_desc, info.compute, info.scale), "desc");
  DescPtr desc(raw_desc);
  cublasOperation_t op_a = transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasOperation_t op_b = transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  SHARDTORCH_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(desc.get(), CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)),
      "TRANSA");
  SHARDTORCH_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(desc.get(), CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)),
      "TRANSB");
  if (bias.defined()) {
    cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    const void* bias_ptr = bias.data_ptr();
    SHARDTORCH_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(desc.get(), CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue,
                                       sizeof(epilogue)),
        "EPILOGUE");
    SHARDTORCH_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(desc.get(), CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias_ptr,
                                       sizeof(bias_ptr)),
        "BIAS_POINTER");
  }
  auto a_layout = layout(info.data, transpose_a ? k : m, transpose_a ? m : k, lda);
  auto b_layout = layout(info.data, transpose_b ? n : k, transpose_b ? k : n, ldb);
  auto c_layout = layout(info.data, m, n, ldc);

  cublasLtMatmulPreference_t raw_pref = nullptr;
  SHARDTORCH_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&raw_pref), "preference");
  PrefPtr pref(raw_pref);
  size_t workspace_bytes = kWorkspaceBytes;
  SHARDTORCH_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref.get(), CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                           &workspace_bytes, sizeof(workspace_bytes)),
      "workspace");
  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  cublasLtHandle_t handle = lt_handle();
  cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
      handle, desc.get(), a_layout.get(), b_layout.get(), c_layout.get(), c_layout.get(),
      pref.get(), 1, &heuristic, &found);
  if (status != CUBLAS_STATUS_SUCCESS || found == 0) return false;

  at::Tensor workspace =
      at::empty({static_cast<int64_t>(kWorkspaceBytes)}, c.options().dtype(at::kByte));
  const float alpha_f = 1.0f, beta_f = 0.0f;
  const double alpha_d = 1.0, beta_d = 0.0;
  const bool fp64 = info.scale == CUDA_R_64F;
  SHARDTORCH_CUBLAS_CHECK(
      cublasLtMatmul(handle, desc.get(), fp64 ? static_cast<const void*>(&alpha_d) : &alpha_f,
                     a.data_ptr(), a_layout.get(), b.data_ptr(), b_layout.get(),
                     fp64 ? static_cast<const void*>(&beta_d) : &beta_f, c.data_ptr(),
                     c_layout.get(), c.data_ptr(), c_layout.get(), &heuristic.algo,
                     workspace.data_ptr(), kWorkspaceBytes, at::cuda::getCurrentCUDAStream()),
      "cublasLtMatmul");
  return true;
}

}  // namespace

void cublaslt_gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k,
                   const at::Tensor& a, int64_t lda, const at::Tensor& b, int64_t ldb,
                   at::Tensor& c, int64_t ldc, const at::Tensor& bias) {
  c10::cuda::CUDAGuard guard(c.device());
  if (try_matmul(transpose_a, transpose_b, m, n, k, a, lda, b, ldb, c, ldc, bias)) return;
  TORCH_CHECK(bias.defined() && try_matmul(transpose_a, transpose_b, m, n, k, a, lda, b, ldb, c,
                                           ldc, at::Tensor()),
              "shardtorch: cuBLASLt found no algorithm for a ", c.scalar_type(), " GEMM m=", m,
              " n=", n, " k=", k);
  // No fused-bias algorithm for this case: add the bias (one per row of the
  // column-major C, i.e. per column of the row-major result) separately.
  c.view({n, m}).add_(bias);
}

}  // namespace cuda
}  // namespace ops
}  // namespace shardtorch
