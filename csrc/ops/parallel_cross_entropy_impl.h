#pragma once
// The device-independent part of the parallel cross-entropy (plain and fused
// with the classifier): argument checks, which classes this rank holds, the one
// all-gather of per-row statistics, the loss formula and the gradient
// coefficients. The passes over [rows, classes] data come from a
// CrossEntropyKernels (ATen operations over row blocks on CPU, custom kernels on CUDA), so both devices
// share one algorithm.

#include <ATen/core/Tensor.h>

#include <array>
#include <optional>
#include <string>
#include <tuple>

namespace shardtorch {
namespace ops {

// Columns of the per-row statistics one rank computes over its own classes.
enum RowStat : int64_t {
  kRowMax = 0,         // max of the row's logits (-inf for no classes)
  kRowSumExp = 1,      // sum of exp(x - max)
  kRowTargetLogit = 2, // x[target] when this rank holds the target, else 0
  kRowWeightedSum = 3, // sum of w_c x_c (w = 1 without class weights)
  kRowTargetWeight = 4,// w[target] when this rank holds the target, else 0
  kNumRowStats = 5,
};

class CrossEntropyKernels {
 public:
  virtual ~CrossEntropyKernels() = default;

  // Folds `logits` [rows, c] (contiguous), which are columns
  // [col_begin, col_begin + c) of this rank's shard, into `stats`
  // [rows, kNumRowStats] (float32, float64 for float64 logits), merging max
  // and sum-exp online so that a shard may come in chunks.
  //   target_local [rows] int64: the local column of the row's target, or -1.
  //   weight_local [local_classes] in the stats dtype, or undefined (all 1).
  //   copy_to: undefined, or [rows, c] contiguous receiving the logits in the
  //   same pass (the backward buffer of the plain op).
  virtual void accumulate_row_stats(const at::Tensor& logits, int64_t col_begin,
                                    const at::Tensor& target_local,
                                    const at::Tensor& weight_local, const at::Tensor& stats,
                                    const at::Tensor& copy_to) const = 0;

  // In place over `values` [rows, c] contiguous (logits in, gradient out):
  //   v = grad_scale * exp(x - lse) - target_scale * [col == target]
  //       - smooth_scale * w_col
  // coefs [rows, kNumGradCoefs] in the stats dtype.
  virtual void softmax_grad_inplace(const at::Tensor& values, int64_t col_begin,
                                    const at::Tensor& target_local,
                                    const at::Tensor& weight_local,
                                    const at::Tensor& coefs) const = 0;
};

enum GradCoef : int64_t {
  kCoefLse = 0,
  kCoefGradScale = 1,
  kCoefTargetScale = 2,
  kCoefSmoothScale = 3,
  kNumGradCoefs = 4,
};

// Loss hyper-parameters, validated once.
struct CrossEntropyOptions {
  int64_t ignore_index = -100;
  double label_smoothing = 0.0;
  double z_loss = 0.0;
  int64_t reduction = 1;
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> parallel_cross_entropy_forward_impl(
    const at::Tensor& logits, const at::Tensor& target, const std::optional<at::Tensor>& weight,
    const CrossEntropyOptions& options, const std::string& group,
    std::optional<int64_t> num_classes, const CrossEntropyKernels& kernels);

void parallel_cross_entropy_backward_impl(const at::Tensor& grad_loss,
                                          const at::Tensor& logits_buffer,
                                          const at::Tensor& row_stats, const at::Tensor& target,
                                          const std::optional<at::Tensor>& weight,
                                          const CrossEntropyOptions& options,
                                          const CrossEntropyKernels& kernels);

std::tuple<at::Tensor, at::Tensor> parallel_linear_cross_entropy_forward_impl(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& target, const std::optional<at::Tensor>& class_weight,
    const CrossEntropyOptions& options, int64_t chunk_size, const std::string& group,
    std::optional<int64_t> num_classes, const CrossEntropyKernels& kernels);

std::tuple<at::Tensor, at::Tensor, at::Tensor> parallel_linear_cross_entropy_backward_impl(
    const at::Tensor& grad_loss, const at::Tensor& input, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& row_stats, const at::Tensor& target,
    const std::optional<at::Tensor>& class_weight, const CrossEntropyOptions& options,
    int64_t chunk_size, const std::string& group, std::array<bool, 3> output_mask,
    const CrossEntropyKernels& kernels);

// Shared with the Meta kernels so that shapes and checks cannot disagree.
void check_cross_entropy_options(const CrossEntropyOptions& options, const char* op);
void check_cross_entropy_inputs(const at::Tensor& logits_like, int64_t classes_dim_size,
                                const at::Tensor& target, const char* op);
// Shape of the loss: target's for reduction none, a scalar otherwise.
std::vector<c10::SymInt> cross_entropy_loss_shape(const at::Tensor& target, int64_t reduction);
// Stats dtype: float64 for float64 logits, float32 otherwise.
at::ScalarType cross_entropy_accumulate_type(at::ScalarType logits_type);

}  // namespace ops
}  // namespace shardtorch
