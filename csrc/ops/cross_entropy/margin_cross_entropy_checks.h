#pragma once
// Argument checks of parallel_linear_margin_cross_entropy, shared by its real
// kernels and its Meta kernel (as cross_entropy_checks.h is for the plain
// losses). Checks of values on the device (targets, sampled classes) happen in
// the real kernels, with the statistics.

#include <ATen/core/Tensor.h>

#include <optional>

#include "ops/cross_entropy/cross_entropy_checks.h"

namespace shardtorch {
namespace ops {

inline constexpr double kPi = 3.14159265358979323846;

// The margin of the target logit, scale * (cos(m1 theta + m2) - m3).
struct MarginOptions {
  double scale = 64.0;
  double m1 = 1.0;  // multiplicative angular (SphereFace-style), >= 1
  double m2 = 0.5;  // additive angular (ArcFace), in [0, pi)
  double m3 = 0.0;  // additive cosine (CosFace), in [0, 1]
  bool easy_margin = false;
};

void check_margin_options(const MarginOptions& margin, const char* op);

// input [*, in_features], weight [local_classes, in_features], target [*],
// sampled_classes: undefined or 1-D int64 on the input's device.
void check_parallel_linear_margin_cross_entropy_args(
    const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target,
    const MarginOptions& margin, const CrossEntropyOptions& options,
    const std::optional<at::Tensor>& sampled_classes, int64_t chunk_size, const char* op);

inline bool is_sampled(const std::optional<at::Tensor>& sampled_classes) {
  return sampled_classes.has_value() && sampled_classes->defined();
}

}  // namespace ops
}  // namespace shardtorch
