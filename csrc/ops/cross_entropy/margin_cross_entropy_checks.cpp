#include "ops/cross_entropy/margin_cross_entropy_checks.h"

#include <c10/util/Exception.h>

#include <cmath>

namespace shardtorch {
namespace ops {

void check_margin_options(const MarginOptions& margin, const char* op) {
  TORCH_CHECK(std::isfinite(margin.scale) && margin.scale > 0.0, op,
              ": scale must be a finite number > 0, got ", margin.scale);
  TORCH_CHECK(std::isfinite(margin.m1) && margin.m1 >= 1.0, op,
              ": margins[0] (m1, multiplicative angular) must be finite and >= 1, got ", margin.m1);
  TORCH_CHECK(margin.m2 >= 0.0 && margin.m2 < kPi, op,
              ": margins[1] (m2, additive angular) must be in [0, pi), got ", margin.m2);
  TORCH_CHECK(margin.m3 >= 0.0 && margin.m3 <= 1.0, op,
              ": margins[2] (m3, additive cosine) must be in [0, 1], got ", margin.m3);
}

void check_parallel_linear_margin_cross_entropy_args(
    const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target,
    const MarginOptions& margin, const CrossEntropyOptions& options,
    const std::optional<at::Tensor>& sampled_classes, int64_t chunk_size, const char* op) {
  check_margin_options(margin, op);
  // The margin moves the one target class's logit: a distribution over
  // classes has no such class.
  TORCH_CHECK(!at::isFloatingType(target.scalar_type()), op,
              ": target must be int64 class indices: the margin loss is not defined for a "
              "probability (floating) target, got ",
              target.scalar_type());
  check_parallel_linear_cross_entropy_args(input, weight, std::nullopt, target, std::nullopt,
                                           options, chunk_size, op);
  // The fused cross-entropy's mixed rule (a float32 input with a float16 /
  // bfloat16 weight) does not carry over: the margin normalises the weight's
  // rows and multiplies them with the input's in one dtype, so a mix would
  // fail inside a GEMM. Under torch.autocast the op's autocast kernel casts
  // both to float32 first.
  TORCH_CHECK(input.scalar_type() == weight.scalar_type(), op,
              ": input and weight must have the same dtype (the margin loss has no mixed-precision "
              "path; under torch.autocast it runs in float32), got ",
              input.scalar_type(), " and ", weight.scalar_type());
  if (!is_sampled(sampled_classes)) return;
  const at::Tensor& kept = *sampled_classes;
  TORCH_CHECK(kept.dim() == 1 && kept.scalar_type() == at::kLong, op,
              ": sampled_classes must be a 1-D int64 tensor of local class indices, got ",
              kept.scalar_type(), " of shape ", kept.sym_sizes());
  TORCH_CHECK(kept.device() == input.device(), op,
              ": sampled_classes must be on the input's device ", input.device(), ", got ",
              kept.device());
}

}  // namespace ops
}  // namespace shardtorch
