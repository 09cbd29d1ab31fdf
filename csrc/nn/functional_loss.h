#pragma once
// Functional forms of the parallel losses (shardtorch::nn::functional), the
// C++ twins of shardtorch.nn.functional.parallel_cross_entropy and
// parallel_linear_cross_entropy, options in the style of
// torch::nn::functional::CrossEntropyFuncOptions.
//
// Unlike Python there are no tensor marks in C++: these always run the
// parallel loss, so `input` must be this rank's shard of the classes (the
// output of a column-parallel ParallelLinear). For whole logits, call
// torch::nn::functional::cross_entropy.

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/enum.h>

#include <cstdint>
#include <optional>
#include <string>
#include <variant>

#include <shardtorch/distributed/init_options.h>
#include <shardtorch/ops/parallel_cross_entropy.h>
#include <shardtorch/ops/parallel_linear_cross_entropy.h>

namespace shardtorch {
namespace nn {

// Options of ParallelCrossEntropyLoss and functional::parallel_cross_entropy.
struct ParallelCrossEntropyLossOptions {
  typedef std::variant<torch::enumtype::kNone, torch::enumtype::kMean, torch::enumtype::kSum>
      reduction_t;

  // Class weights: this rank's shard [local_classes] or all [num_classes].
  TORCH_ARG(at::Tensor, weight) = {};
  TORCH_ARG(int64_t, ignore_index) = -100;
  TORCH_ARG(reduction_t, reduction) = torch::kMean;
  // torch's formula over all classes, in [0, 1].
  TORCH_ARG(double, label_smoothing) = 0.0;
  // Adds z_loss * logsumexp^2 to every row that is not ignored (>= 0).
  TORCH_ARG(double, z_loss) = 0.0;
  // The shardtorch group the classes are split over.
  TORCH_ARG(std::string, group) = distributed::kTensorParallel;
  // Total classes when known: saves the op one tiny all-gather of shard sizes.
  TORCH_ARG(std::optional<int64_t>, num_classes) = std::nullopt;
};

// Options of functional::parallel_linear_cross_entropy: the loss options plus
// the number of classes whose logits exist at a time.
struct ParallelLinearCrossEntropyFuncOptions {
  typedef ParallelCrossEntropyLossOptions::reduction_t reduction_t;

  TORCH_ARG(at::Tensor, class_weight) = {};
  TORCH_ARG(int64_t, ignore_index) = -100;
  TORCH_ARG(reduction_t, reduction) = torch::kMean;
  TORCH_ARG(double, label_smoothing) = 0.0;
  TORCH_ARG(double, z_loss) = 0.0;
  // Classes per chunk: the extra memory is O(max(rows x chunk_size, 2^22)).
  TORCH_ARG(int64_t, chunk_size) = ops::kDefaultCrossEntropyChunk;
  TORCH_ARG(std::string, group) = distributed::kTensorParallel;
  TORCH_ARG(std::optional<int64_t>, num_classes) = std::nullopt;
};

namespace functional {

using ParallelCrossEntropyFuncOptions = ParallelCrossEntropyLossOptions;
using ParallelLinearCrossEntropyFuncOptions = nn::ParallelLinearCrossEntropyFuncOptions;

namespace detail {
inline std::optional<at::Tensor> optional_tensor(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}
}  // namespace detail

// torch::nn::functional::cross_entropy of logits sharded on their last dim:
// `input` [*, local_classes] this rank's shard, `target` [*] global class
// indices, the same on every rank, or class probabilities [*, local_classes]
// (sharded like the input) or [*, num_classes] (whole), floating. One all-gather of per-row
// statistics forward, nothing backward; `input` is never modified.
inline at::Tensor parallel_cross_entropy(const at::Tensor& input, const at::Tensor& target,
                                         const ParallelCrossEntropyFuncOptions& options = {}) {
  return ops::parallel_cross_entropy(input, target, detail::optional_tensor(options.weight()),
                                     options.ignore_index(), options.label_smoothing(),
                                     options.z_loss(),
                                     torch::enumtype::reduction_get_enum(options.reduction()),
                                     options.group(), options.num_classes());
}

// parallel_cross_entropy(input weight^T + bias, target) for a column-parallel
// classifier (`weight` [local_classes, in_features], `bias` [local_classes] or
// undefined, `input` whole on every rank), without materialising the logits.
// `target` as parallel_cross_entropy's: class indices, or class probabilities
// [*, local_classes] (sharded like the weight's classes) or [*, num_classes].
inline at::Tensor parallel_linear_cross_entropy(
    const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias,
    const at::Tensor& target, const ParallelLinearCrossEntropyFuncOptions& options = {}) {
  return ops::parallel_linear_cross_entropy(
      input, weight, detail::optional_tensor(bias), target,
      detail::optional_tensor(options.class_weight()), options.ignore_index(),
      options.label_smoothing(), options.z_loss(),
      torch::enumtype::reduction_get_enum(options.reduction()), options.chunk_size(),
      options.group(), options.num_classes());
}

}  // namespace functional
}  // namespace nn
}  // namespace shardtorch
