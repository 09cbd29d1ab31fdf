#include "ops/cuda/cublaslt_gemm.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>
#include <cublas_v2.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <unordered_map>

#include "utils/cuda_library_checks.h"

namespace shardtorch {
namespace ops {
namespace cuda {
namespace {

constexpr size_t kWorkspaceBytes = 32 << 20;  // what cuBLAS recommends for Hopper

cublasLtHandle_t lt_handle(c10::DeviceIndex device) {
  static std::mutex mutex;
  static std::unordered_map<int, cublasLtHandle_t> handles;  // one per device, never freed
  std::lock_guard<std::mutex> lock(mutex);
  auto it = handles.find(device);
  if (it != handles.end()) return it->second;
  cublasLtHandle_t handle = nullptr;
  SHARDTORCH_CUBLAS_CHECK(cublasLtCreate(&handle), "cublasLtCreate");
  handles.emplace(device, handle);
  return handle;
}

// One workspace per device and stream, reused by every GEMM on that stream
// (work on one stream is ordered, so they never overlap; a workspace shared
// across streams could be).
void* workspace(c10::DeviceIndex device, cudaStream_t stream) {
  static std::mutex mutex;
  static auto* buffers = new std::map<std::pair<int, cudaStream_t>, at::Tensor>();
  std::lock_guard<std::mutex> lock(mutex);
  auto& buffer = (*buffers)[{device, stream}];
  if (!buffer.defined()) {
    buffer = at::empty({static_cast<int64_t>(kWorkspaceBytes)},
                       at::TensorOptions().dtype(at::kByte).device(at::kCUDA, device));
  }
  return buffer.data_ptr();
}

cudaDataType_t data_type(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return CUDA_R_32F;
    case at::kDouble: return CUDA_R_64F;
    case at::kHalf: return CUDA_R_16F;
    case at::kBFloat16: return CUDA_R_16BF;
    default: TORCH_CHECK(false, "shardtorch GEMM (CUDA): unsupported dtype ", type);
  }
}

struct GemmTypes {
  cudaDataType_t ab;
  cudaDataType_t c;
  cublasComputeType_t compute;
  cudaDataType_t scale;
};

GemmTypes gemm_types(at::ScalarType ab, at::ScalarType c) {
  const bool reduced = ab == at::kHalf || ab == at::kBFloat16;
  TORCH_CHECK(c == ab || (reduced && c == at::kFloat),
              "shardtorch GEMM (CUDA): the output must have the inputs' dtype ", ab,
              " (or float32 for float16/bfloat16 inputs), got ", c);
  if (ab == at::kDouble) return {CUDA_R_64F, CUDA_R_64F, CUBLAS_COMPUTE_64F, CUDA_R_64F};
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  if (ab == at::kFloat && at::globalContext().allowTF32CuBLAS()) {
    compute = CUBLAS_COMPUTE_32F_FAST_TF32;
  }
  return {data_type(ab), data_type(c), compute, CUDA_R_32F};
}

// The largest power of two (up to 256) that divides the address, as cuBLASLt
// wants it for its minimum-alignment preferences.
uint32_t alignment_bytes(const void* pointer) {
  const auto address = reinterpret_cast<uintptr_t>(pointer);
  uint32_t alignment = 256;
  while (alignment > 1 && address % alignment != 0) alignment /= 2;
  return alignment;
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

struct Gemm {
  bool transpose_a, transpose_b;
  int64_t m, n, k;
  const at::Tensor& a;
  int64_t lda;
  const at::Tensor& b;
  int64_t ldb;
  at::Tensor& c;
  int64_t ldc;
  bool accumulate;
};

// What cuBLASLt needs to run one kind of GEMM: the descriptor (operations,
// epilogue), the three layouts and the heuristic's algorithm, or that it found
// none. They depend only on the key below, so they are made once per key, not
// per GEMM: a training step repeats the same few shapes thousands of times.
struct GemmPlan {
  DescPtr desc;
  LayoutPtr a, b, c;
  bool found = false;
  cublasLtMatmulHeuristicResult_t heuristic{};
};

// Device, operations, sizes, leading dimensions, dtypes and compute type
// (TF32 or not, read per call), whether the bias is fused, and the alignment
// of each operand (the heuristic's answer depends on it).
using GemmPlanKey =
    std::tuple<int, bool, bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, int, int,
               bool, uint32_t, uint32_t, uint32_t, uint32_t>;

// Per thread: a plan's descriptor gets each call's bias pointer, so two
// threads must not share one. Bounded: a program that keeps changing shapes
// starts over rather than growing without end. Never freed (as the handles).
constexpr size_t kMaxGemmPlans = 1024;
std::map<GemmPlanKey, std::unique_ptr<GemmPlan>>& gemm_plans() {
  thread_local auto* plans = new std::map<GemmPlanKey, std::unique_ptr<GemmPlan>>();
  return *plans;
}

std::unique_ptr<GemmPlan> make_plan(const Gemm& g, const GemmTypes& types, const at::Tensor& bias,
                                    cublasLtHandle_t handle) {
  auto plan = std::make_unique<GemmPlan>();
  cublasLtMatmulDesc_t raw_desc = nullptr;
  SHARDTORCH_CUBLAS_CHECK(cublasLtMatmulDescCreate(&raw_desc, types.compute, types.scale), "desc");
  plan->desc.reset(raw_desc);
  cublasOperation_t op_a = g.transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasOperation_t op_b = g.transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  SHARDTORCH_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
                              plan->desc.get(), CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)),
                          "TRANSA");
  SHARDTORCH_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
                              plan->desc.get(), CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)),
                          "TRANSB");
  if (bias.defined()) {
    cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    const void* bias_ptr = bias.data_ptr();
    SHARDTORCH_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(plan->desc.get(), CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue,
                                       sizeof(epilogue)),
        "EPILOGUE");
    SHARDTORCH_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(plan->desc.get(), CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                       &bias_ptr, sizeof(bias_ptr)),
        "BIAS_POINTER");
  }
  const auto make_layout = [](cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld) {
    cublasLtMatrixLayout_t raw = nullptr;
    SHARDTORCH_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&raw, type, rows, cols, ld), "layout");
    return LayoutPtr(raw);
  };
  plan->a = make_layout(types.ab, g.transpose_a ? g.k : g.m, g.transpose_a ? g.m : g.k, g.lda);
  plan->b = make_layout(types.ab, g.transpose_b ? g.n : g.k, g.transpose_b ? g.k : g.n, g.ldb);
  plan->c = make_layout(types.c, g.m, g.n, g.ldc);

  cublasLtMatmulPreference_t raw_pref = nullptr;
  SHARDTORCH_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&raw_pref), "preference");
  PrefPtr pref(raw_pref);
  size_t workspace_bytes = kWorkspaceBytes;
  SHARDTORCH_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref.get(), CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                           &workspace_bytes, sizeof(workspace_bytes)),
      "workspace");
  // Without these the heuristic assumes 256-byte aligned operands and may pick
  // an algorithm that fails (or reads wrongly) on an offset view.
  const std::pair<cublasLtMatmulPreferenceAttributes_t, const void*> alignments[] = {
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, g.a.data_ptr()},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, g.b.data_ptr()},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, g.c.data_ptr()},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, g.c.data_ptr()},
  };
  for (const auto& [attribute, pointer] : alignments) {
    uint32_t bytes = alignment_bytes(pointer);
    SHARDTORCH_CUBLAS_CHECK(
        cublasLtMatmulPreferenceSetAttribute(pref.get(), attribute, &bytes, sizeof(bytes)),
        "alignment preference");
  }
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
      handle, plan->desc.get(), plan->a.get(), plan->b.get(), plan->c.get(), plan->c.get(),
      pref.get(), 1, &plan->heuristic, &found);
  plan->found = status == CUBLAS_STATUS_SUCCESS && found > 0;
  return plan;
}

// cuBLASLt, with the bias as an epilogue when `bias` is defined. Returns false
// (having launched nothing) when cuBLASLt has no algorithm for the problem as
// aligned, so that the caller can fall back; other failures throw.
bool try_cublaslt(const Gemm& g, const at::Tensor& bias, cudaStream_t stream) {
  const GemmTypes types = gemm_types(g.a.scalar_type(), g.c.scalar_type());
  const c10::DeviceIndex device = g.c.get_device();
  cublasLtHandle_t handle = lt_handle(device);
  const GemmPlanKey key{static_cast<int>(device),
                        g.transpose_a,
                        g.transpose_b,
                        g.m,
                        g.n,
                        g.k,
                        g.lda,
                        g.ldb,
                        g.ldc,
                        static_cast<int>(types.ab),
                        static_cast<int>(types.c),
                        static_cast<int>(types.compute),
                        bias.defined(),
                        alignment_bytes(g.a.data_ptr()),
                        alignment_bytes(g.b.data_ptr()),
                        alignment_bytes(g.c.data_ptr()),
                        bias.defined() ? alignment_bytes(bias.data_ptr()) : 0u};
  auto& plans = gemm_plans();
  auto it = plans.find(key);
  if (it == plans.end()) {
    if (plans.size() >= kMaxGemmPlans) plans.clear();
    it = plans.emplace(key, make_plan(g, types, bias, handle)).first;
  }
  GemmPlan& plan = *it->second;
  if (!plan.found) return false;
  if (bias.defined()) {
    const void* bias_ptr = bias.data_ptr();  // this call's: the plan's descriptor is reused
    SHARDTORCH_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(plan.desc.get(), CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                       &bias_ptr, sizeof(bias_ptr)),
        "BIAS_POINTER");
  }

  const float alpha_f = 1.0f, beta_f = g.accumulate ? 1.0f : 0.0f;
  const double alpha_d = 1.0, beta_d = g.accumulate ? 1.0 : 0.0;
  const bool fp64 = types.scale == CUDA_R_64F;
  SHARDTORCH_CUBLAS_CHECK(
      cublasLtMatmul(handle, plan.desc.get(), fp64 ? static_cast<const void*>(&alpha_d) : &alpha_f,
                     g.a.data_ptr(), plan.a.get(), g.b.data_ptr(), plan.b.get(),
                     fp64 ? static_cast<const void*>(&beta_d) : &beta_f, g.c.data_ptr(),
                     plan.c.get(), g.c.data_ptr(), plan.c.get(), &plan.heuristic.algo,
                     workspace(device, stream), kWorkspaceBytes, stream),
      "cublasLtMatmul");
  return true;
}

// Plain cuBLAS (no epilogue): what PyTorch uses where cuBLASLt's heuristic
// fails, GEMMs with a dimension of 1 among them. Any alignment works.
void plain_cublas(const Gemm& g) {
  const GemmTypes types = gemm_types(g.a.scalar_type(), g.c.scalar_type());
  cublasHandle_t handle = at::cuda::getCurrentCUDABlasHandle();
  const float alpha_f = 1.0f, beta_f = g.accumulate ? 1.0f : 0.0f;
  const double alpha_d = 1.0, beta_d = g.accumulate ? 1.0 : 0.0;
  const bool fp64 = types.scale == CUDA_R_64F;
  SHARDTORCH_CUBLAS_CHECK(
      cublasGemmEx(handle, g.transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                   g.transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(g.m),
                   static_cast<int>(g.n), static_cast<int>(g.k),
                   fp64 ? static_cast<const void*>(&alpha_d) : &alpha_f, g.a.data_ptr(), types.ab,
                   static_cast<int>(g.lda), g.b.data_ptr(), types.ab, static_cast<int>(g.ldb),
                   fp64 ? static_cast<const void*>(&beta_d) : &beta_f, g.c.data_ptr(), types.c,
                   static_cast<int>(g.ldc), types.compute, CUBLAS_GEMM_DEFAULT),
      "cublasGemmEx");
}

}  // namespace

void cublaslt_gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k,
                   const at::Tensor& a, int64_t lda, const at::Tensor& b, int64_t ldb,
                   at::Tensor& c, int64_t ldc, const at::Tensor& bias, bool accumulate) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "shardtorch GEMM (CUDA): A and B must share a ",
              "dtype, got ", a.scalar_type(), " and ", b.scalar_type());
  c10::cuda::CUDAGuard guard(c.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(c.get_device()).stream();
  const Gemm g{transpose_a, transpose_b, m, n, k, a, lda, b, ldb, c, ldc, accumulate};
  // The fused bias epilogue wants the bias in C's dtype, 16-byte aligned, and
  // nothing already in C to add to.
  const bool fuse_bias = bias.defined() && !accumulate && bias.scalar_type() == c.scalar_type() &&
                         alignment_bytes(bias.data_ptr()) >= 16;
  const bool use_lt = m > 1 && n > 1 && k > 1;
  bool done = use_lt && fuse_bias && try_cublaslt(g, bias, stream);
  const bool bias_added = done;
  if (!done && use_lt) done = try_cublaslt(g, at::Tensor(), stream);
  if (!done) plain_cublas(g);
  if (bias.defined() && !bias_added) {
    // One bias value per row of the column-major C: per column of the
    // row-major [n, m] result that C is for the callers.
    TORCH_INTERNAL_ASSERT(ldc == m, "shardtorch GEMM: a separate bias needs a packed C");
    c.view({n, m}).add_(bias);
  }
}

}  // namespace cuda
}  // namespace ops
}  // namespace shardtorch
