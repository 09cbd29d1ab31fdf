#pragma once
// shardtorch::nn::ParallelLinear: torch::nn::Linear with its weight split over
// a tensor-parallel group, the C++ twin of shardtorch.nn.ParallelLinear.
//
//   auto head = shardtorch::nn::ParallelLinear(
//       shardtorch::nn::ParallelLinearOptions(512, 1000000).dim(1));
//
// dim names a dimension of the [in, out] view of the weight, as in TorchShard:
//   nullopt  a plain linear layer (no communication);
//   1 or -1  column-parallel: out_features are split, the output is sharded on
//            its last dim;
//   0        row-parallel: in_features are split; the input may be sharded (from
//            a column-parallel layer) or whole (the layer takes its slice); the
//            output is whole; the bias is whole and added once.
// A new layer holds exactly this rank's slice of what torch::nn::Linear(in, out)
// draws under the same torch::manual_seed (see nn/init.h).

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>

#include <shardtorch/distributed/init_options.h>
#include <shardtorch/nn/init.h>

namespace shardtorch {
namespace nn {

struct ParallelLinearOptions {
  ParallelLinearOptions(int64_t in_features, int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}

  TORCH_ARG(int64_t, in_features);
  TORCH_ARG(int64_t, out_features);
  TORCH_ARG(bool, bias) = true;
  // nullopt, 0, 1 or -1 (see above).
  TORCH_ARG(std::optional<int64_t>, dim) = std::nullopt;
  // The shardtorch group to split over.
  TORCH_ARG(std::string, group) = distributed::kTensorParallel;
};

class ParallelLinearImpl : public torch::nn::Cloneable<ParallelLinearImpl> {
 public:
  ParallelLinearImpl(int64_t in_features, int64_t out_features)
      : ParallelLinearImpl(ParallelLinearOptions(in_features, out_features)) {}
  explicit ParallelLinearImpl(const ParallelLinearOptions& options_);

  // Creates the shard-shaped parameters and draws them (reset_parameters).
  void reset() override;
  // Draws this rank's slice of torch::nn::Linear's initialisation.
  void reset_parameters();

  void pretty_print(std::ostream& stream) const override;

  torch::Tensor forward(const torch::Tensor& input);

  ParallelLinearOptions options;
  // [out_local, in] (dim 1/-1), [out, in_local] (dim 0) or [out, in].
  torch::Tensor weight;
  // [out_local] (dim 1/-1) or [out]; undefined without bias.
  torch::Tensor bias;
  int64_t group_rank = 0;
  int64_t group_size = 1;
  // Rows and columns of the full [out, in] weight held here.
  Range out_range{0, 0};
  Range in_range{0, 0};
};

TORCH_MODULE(ParallelLinear);

}  // namespace nn
}  // namespace shardtorch
