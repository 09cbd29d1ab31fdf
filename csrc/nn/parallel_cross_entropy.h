#pragma once
// shardtorch::nn::ParallelCrossEntropyLoss: torch::nn::CrossEntropyLoss for
// logits whose classes are split over a tensor-parallel group, the C++ twin of
// shardtorch.nn.ParallelCrossEntropyLoss, over the op
// shard::parallel_cross_entropy (one all-gather of per-row statistics forward,
// nothing backward, the logits never gathered).
//
//   shardtorch::nn::ParallelLinear head(
//       shardtorch::nn::ParallelLinearOptions(512, 1000000).dim(1));
//   shardtorch::nn::ParallelCrossEntropyLoss loss_fn(
//       shardtorch::nn::ParallelCrossEntropyLossOptions().label_smoothing(0.1));
//   auto loss = loss_fn(head(features), targets);   // targets: global class ids
//
// C++ tensors carry no marks, so unlike the Python module (which falls back to
// F.cross_entropy on unmarked logits) this one always runs the parallel loss:
// its input must be this rank's shard [*, local_classes]. For whole logits use
// torch::nn::CrossEntropyLoss.

#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <ostream>

#include <shardtorch/nn/functional_loss.h>

namespace shardtorch {
namespace nn {

class ParallelCrossEntropyLossImpl : public torch::nn::Cloneable<ParallelCrossEntropyLossImpl> {
 public:
  explicit ParallelCrossEntropyLossImpl(ParallelCrossEntropyLossOptions options_ = {});

  // Checks the options and registers the class weights as a buffer (so that
  // module->to(device) moves them), as torch::nn::CrossEntropyLoss does.
  void reset() override;

  void pretty_print(std::ostream& stream) const override;

  // input: [*, local_classes] this rank's logits; target: [*] int64 global
  // class indices, the same on every rank, or floating class probabilities
  // [*, local_classes] or [*, num_classes] (see ops/parallel_cross_entropy.h).
  torch::Tensor forward(const torch::Tensor& input, const torch::Tensor& target);

  ParallelCrossEntropyLossOptions options;
  torch::Tensor weight;
};

TORCH_MODULE(ParallelCrossEntropyLoss);

}  // namespace nn
}  // namespace shardtorch
