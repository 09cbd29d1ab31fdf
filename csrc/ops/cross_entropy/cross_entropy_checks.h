#pragma once
// Argument checks and result shapes of the two parallel cross-entropy ops
// (plain and fused with the classifier), shared by their real kernels (CPU,
// CUDA) and their Meta kernels so that the two cannot disagree. Checks that
// need the group or the targets' values live with the statistics
// (cross_entropy_statistics.h): only the real kernels can make them.

#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>

#include <optional>
#include <vector>

namespace shardtorch {
namespace ops {

// Loss hyper-parameters of both ops.
struct CrossEntropyOptions {
  int64_t ignore_index = -100;
  double label_smoothing = 0.0;
  double z_loss = 0.0;
  int64_t reduction = 1;  // at::Reduction: 0 none, 1 mean, 2 sum
};

void check_cross_entropy_options(const CrossEntropyOptions& options, const char* op);

// parallel_cross_entropy(logits [*, local_classes], target, weight?): target
// int64 class indices [*] or floating probabilities [*, local_classes] or
// [*, num_classes] (probability_target.h).
void check_parallel_cross_entropy_args(const at::Tensor& logits, const at::Tensor& target,
                                       const std::optional<at::Tensor>& weight,
                                       const CrossEntropyOptions& options, const char* op);

// parallel_linear_cross_entropy(input [*, in_features], weight
// [local_classes, in_features], bias?, target, class_weight?, chunk_size):
// target as parallel_cross_entropy's, the logits being [*, local_classes].
void check_parallel_linear_cross_entropy_args(const at::Tensor& input, const at::Tensor& weight,
                                              const std::optional<at::Tensor>& bias,
                                              const at::Tensor& target,
                                              const std::optional<at::Tensor>& class_weight,
                                              const CrossEntropyOptions& options,
                                              int64_t chunk_size, const char* op);

// The row_stats a backward receives must be its forward's: float64
// [rows + 1, kNumSavedStats].
void check_saved_row_stats(const at::Tensor& row_stats, int64_t rows, const char* op);

// Product of all dims but the last: the rows of [*, features] data.
c10::SymInt leading_rows(const at::Tensor& t);
// Shape of the loss: for reduction none, a class-index target's shape (a
// probability target's without its last dim); a scalar otherwise.
std::vector<c10::SymInt> cross_entropy_loss_shape(const at::Tensor& target, int64_t reduction);
// Shape of the saved row_stats for `rows` rows.
std::vector<c10::SymInt> saved_row_stats_shape(const c10::SymInt& rows);
// Stats dtype: float64 for float64 logits, float32 otherwise.
at::ScalarType cross_entropy_accumulate_type(at::ScalarType logits_type);

}  // namespace ops
}  // namespace shardtorch
