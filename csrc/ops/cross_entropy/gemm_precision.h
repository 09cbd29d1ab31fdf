#pragma once
// The fused heads' GEMM dtype under torch.autocast. The autocast kernels of
// the fused heads pass the float32 master weight through unchanged (so that
// its gradient, dense or row-sparse, reaches the parameter without a cast in
// between) and set, for the op's call only, the dtype its GEMMs run in: each
// head then casts its input rows once and each weight chunk as it uses it,
// while the softmax statistics, the margin's trigonometry and every gradient
// accumulate in float32. A thread-local like autocast's own state: the op's
// schema stays as it is, and the op called outside autocast is unchanged.

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include <optional>

namespace shardtorch {
namespace ops {

inline thread_local std::optional<at::ScalarType> fused_head_gemm_dtype_state;

// The reduced GEMM dtype (float16/bfloat16) for a head whose operands are
// `operand` (the dtype it would compute in otherwise), or nullopt: only
// float32 operands are reduced (float64 stays out of autocast, as in ATen).
inline std::optional<at::ScalarType> fused_head_gemm_dtype(at::ScalarType operand) {
  if (operand != at::kFloat) return std::nullopt;
  return fused_head_gemm_dtype_state;
}

// The GEMM dtype the autocast kernels set for `device`, whose autocast dtype
// is `autocast_dtype` (nullopt: float32 GEMMs). On CUDA the reduced dtype
// when autocast's is one (tensor cores). On the CPU the reduced dtype only
// where the CPU multiplies it in hardware (ops/cpu/native_reduced_gemm.h):
// elsewhere a bfloat16 GEMM is a float32 one done slower and rounded, so
// float32 is both faster and closer. SHARDTORCH_CPU_AUTOCAST_GEMMS (read at
// each call) overrides that choice: `auto` (unset: the above), `reduced`
// (always the autocast dtype) or `float32`.
std::optional<at::ScalarType> fused_head_autocast_gemm_dtype(
    c10::DeviceType device, std::optional<at::ScalarType> autocast_dtype);

// Sets the GEMM dtype for the guard's scope (the autocast kernel's call).
class FusedHeadGemmDtypeGuard {
 public:
  explicit FusedHeadGemmDtypeGuard(std::optional<at::ScalarType> dtype)
      : previous_(fused_head_gemm_dtype_state) {
    fused_head_gemm_dtype_state = dtype;
  }
  ~FusedHeadGemmDtypeGuard() { fused_head_gemm_dtype_state = previous_; }
  FusedHeadGemmDtypeGuard(const FusedHeadGemmDtypeGuard&) = delete;
  FusedHeadGemmDtypeGuard& operator=(const FusedHeadGemmDtypeGuard&) = delete;

 private:
  std::optional<at::ScalarType> previous_;
};

}  // namespace ops
}  // namespace shardtorch
