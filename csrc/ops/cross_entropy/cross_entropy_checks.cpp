#include "ops/cross_entropy/cross_entropy_checks.h"

#include <c10/util/Exception.h>

#include "ops/cross_entropy/cross_entropy_saved_stats.h"
#include "ops/op_checks.h"
#include "ops/cross_entropy/probability_target.h"

namespace shardtorch {
namespace ops {
namespace {

// The target's leading shape is the input's without its last dim.
void check_leading_shape(const at::Tensor& input, const at::Tensor& target, const char* op) {
  const int64_t leading_dims = input.dim() - 1;
  for (int64_t d = 0; d < leading_dims; ++d) {
    TORCH_CHECK(target.sym_size(d) == input.sym_size(d), op, ": target shape ", target.sym_sizes(),
                " must match the input's leading shape ", input.sym_sizes());
  }
}

// target [*] int64 class indices on the input's device, shaped like the input
// without its last dim (or, checked elsewhere, floating probabilities).
void check_class_index_target(const at::Tensor& input, const at::Tensor& target, const char* op) {
  const int64_t leading_dims = input.dim() - 1;
  TORCH_CHECK(target.scalar_type() == at::kLong, op,
              ": target must be int64 class indices [*] or floating class probabilities "
              "[*, classes] (the logits' dtype or float32), got ",
              target.scalar_type());
  TORCH_CHECK(target.device() == input.device(), op, ": target must be on the input's device ",
              input.device(), ", got ", target.device());
  TORCH_CHECK(target.dim() == leading_dims, op, ": target must have the leading shape of the ",
              "input without its last dim (", leading_dims, "-D), got shape ", target.sym_sizes());
  check_leading_shape(input, target, op);
}

// A probability target [*, T]: the input's dtype or float32, on its device,
// the input's leading shape. T (this rank's classes or all of them) needs the
// class layout: checked with the statistics.
void check_probability_target(const at::Tensor& input, const at::Tensor& target, const char* op) {
  TORCH_CHECK(target.scalar_type() == input.scalar_type() || target.scalar_type() == at::kFloat, op,
              ": a probability target must have the logits' dtype (", input.scalar_type(),
              ") or float32, got ", target.scalar_type());
  TORCH_CHECK(target.device() == input.device(), op, ": target must be on the input's device ",
              input.device(), ", got ", target.device());
  TORCH_CHECK(target.dim() == input.dim(), op,
              ": a probability target must be shaped like the logits, [*, local_classes] or "
              "[*, num_classes] (",
              input.dim(), "-D), got shape ", target.sym_sizes());
  check_leading_shape(input, target, op);
}

// Class weights: 1-D floating, on the input's device (their size needs the
// class layout, checked with the statistics).
void check_class_weight(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                        const char* name, const char* op) {
  if (!weight.has_value() || !weight->defined()) return;
  check_floating(*weight, name, op);
  TORCH_CHECK(weight->device() == input.device(), op, ": ", name, " must be on the input's device ",
              input.device(), ", got ", weight->device());
  TORCH_CHECK(weight->dim() == 1, op, ": ", name, " must be 1-D, got shape ", weight->sym_sizes());
}

}  // namespace

void check_cross_entropy_options(const CrossEntropyOptions& options, const char* op) {
  TORCH_CHECK(options.reduction >= 0 && options.reduction <= 2, op,
              ": reduction must be 0 (none), 1 (mean) or 2 (sum), got ", options.reduction);
  TORCH_CHECK(options.label_smoothing >= 0.0 && options.label_smoothing <= 1.0, op,
              ": label_smoothing must be in [0, 1], got ", options.label_smoothing);
  TORCH_CHECK(options.z_loss >= 0.0, op, ": z_loss must be >= 0, got ", options.z_loss);
}

void check_parallel_cross_entropy_args(const at::Tensor& logits, const at::Tensor& target,
                                       const std::optional<at::Tensor>& weight,
                                       const CrossEntropyOptions& options, const char* op) {
  check_cross_entropy_options(options, op);
  TORCH_CHECK(logits.dim() >= 1, op,
              ": logits must be [*, local_classes] (at least 1-D), got a scalar");
  check_floating(logits, "logits", op);
  if (is_probability_target(target)) {
    check_probability_target(logits, target, op);
  } else {
    check_class_index_target(logits, target, op);
  }
  check_class_weight(logits, weight, "weight", op);
}

void check_parallel_linear_cross_entropy_args(const at::Tensor& input, const at::Tensor& weight,
                                              const std::optional<at::Tensor>& bias,
                                              const at::Tensor& target,
                                              const std::optional<at::Tensor>& class_weight,
                                              const CrossEntropyOptions& options,
                                              int64_t chunk_size, const char* op) {
  check_cross_entropy_options(options, op);
  TORCH_CHECK(chunk_size >= 1, op, ": chunk_size must be >= 1, got ", chunk_size);
  TORCH_CHECK(input.dim() >= 1, op, ": input must be [*, in_features], got a scalar");
  TORCH_CHECK(weight.dim() == 2, op, ": weight must be 2-D [local_classes, in_features], got ",
              weight.sym_sizes());
  check_floating(input, "input", op);
  // Mixed precision (what autocast on CUDA passes): a float32 input with a
  // float16/bfloat16 weight runs the chunk GEMMs in the weight's dtype and
  // keeps the statistics, the loss and the input gradient in float32.
  const bool mixed = input.scalar_type() == at::kFloat &&
                     (weight.scalar_type() == at::kHalf || weight.scalar_type() == at::kBFloat16);
  if (mixed) {
    TORCH_CHECK(input.device() == weight.device(), op,
                ": input and weight must be on the same device, got ", input.device(), " and ",
                weight.device());
  } else {
    check_same_dtype_device(input, "input", weight, "weight", op);
  }
  TORCH_CHECK(input.sym_size(-1) == weight.sym_size(1), op,
              ": input.size(-1) must equal in_features = ", weight.sym_size(1),
              " (weight.size(1)), got input of shape ", input.sym_sizes());
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->sym_size(0) == weight.sym_size(0), op,
                ": bias must be 1-D of size weight.size(0) = ", weight.sym_size(0), ", got ",
                bias->sym_sizes());
    check_same_dtype_device(weight, "weight", *bias, "bias", op);
  }
  if (is_probability_target(target)) {
    check_probability_target(input, target, op);
  } else {
    check_class_index_target(input, target, op);
  }
  check_class_weight(input, class_weight, "class_weight", op);
}

void check_saved_row_stats(const at::Tensor& row_stats, int64_t rows, const char* op) {
  TORCH_CHECK(row_stats.dim() == 2 && row_stats.size(0) == rows + 1 &&
                  row_stats.size(1) == kNumSavedStats && row_stats.scalar_type() == at::kDouble,
              op, ": row_stats must be the float64 [rows + 1, ", kNumSavedStats,
              "] statistics of the forward (rows = ", rows, "), got ", row_stats.scalar_type(), " ",
              row_stats.sizes());
}

c10::SymInt leading_rows(const at::Tensor& t) {
  c10::SymInt rows = 1;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) rows = rows * t.sym_size(d);
  return rows;
}

std::vector<c10::SymInt> cross_entropy_loss_shape(const at::Tensor& target, int64_t reduction) {
  if (reduction != 0) return {};
  std::vector<c10::SymInt> shape = target.sym_sizes().vec();
  if (is_probability_target(target)) shape.pop_back();  // one loss per row of probabilities
  return shape;
}

std::vector<c10::SymInt> saved_row_stats_shape(const c10::SymInt& rows) {
  return {rows + 1, c10::SymInt(kNumSavedStats)};
}

at::ScalarType cross_entropy_accumulate_type(at::ScalarType logits_type) {
  return logits_type == at::kDouble ? at::kDouble : at::kFloat;
}

}  // namespace ops
}  // namespace shardtorch
