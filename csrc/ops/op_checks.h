#pragma once
// Argument checks shared by the ops. Every message names the op, the argument,
// the rule and the value, so that a user on any rank can fix the call.

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>

namespace shardtorch {
namespace ops {

// `dim` of a tensor with `ndim` dimensions, negative allowed, as an index.
inline int64_t normalize_dim(int64_t dim, int64_t ndim, const char* op) {
  TORCH_CHECK(ndim >= 1, op, ": input must have at least 1 dimension, got a scalar");
  TORCH_CHECK(dim >= -ndim && dim < ndim, op, ": dim must be in [", -ndim, ", ", ndim, ") for a ",
              ndim, "-D input, got ", dim);
  return dim < 0 ? dim + ndim : dim;
}

inline void check_same_dtype_device(const at::Tensor& a, const char* a_name, const at::Tensor& b,
                                    const char* b_name, const char* op) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), op, ": ", a_name, " and ", b_name,
              " must have the same dtype, got ", a.scalar_type(), " and ", b.scalar_type());
  TORCH_CHECK(a.device() == b.device(), op, ": ", a_name, " and ", b_name,
              " must be on the same device, got ", a.device(), " and ", b.device());
}

inline void check_floating(const at::Tensor& t, const char* name, const char* op) {
  TORCH_CHECK(at::isFloatingType(t.scalar_type()), op, ": ", name,
              " must be a floating point tensor (float64, float32, float16 or bfloat16), got ",
              t.scalar_type());
}

}  // namespace ops
}  // namespace shardtorch
