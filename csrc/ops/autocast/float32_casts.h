#pragma once
// The losses' autocast rule, shared by their autocast kernels: reduced-precision
// tensors (float16, bfloat16) are cast up to float32, the others pass as they are.

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>

#include <optional>

namespace shardtorch {
namespace ops {

inline at::Tensor to_float32(const at::Tensor& t) {
  return (t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16) ? t.to(at::kFloat) : t;
}

inline std::optional<at::Tensor> to_float32(const std::optional<at::Tensor>& t) {
  if (!t.has_value() || !t->defined()) return t;
  return to_float32(*t);
}

// The autocast dtype of `device` where it is a reduced one (float16,
// bfloat16): the fused heads' GEMM dtype (gemm_precision.h).
inline std::optional<at::ScalarType> reduced_autocast_dtype(c10::DeviceType device) {
  const at::ScalarType dtype = at::autocast::get_autocast_dtype(device);
  if (dtype == at::kHalf || dtype == at::kBFloat16) return dtype;
  return std::nullopt;
}

}  // namespace ops
}  // namespace shardtorch
