#include <shardtorch/nn/parallel_linear.h>

#include <torch/types.h>

#include <shardtorch/distributed/process_group.h>
#include <shardtorch/ops/mappings.h>
#include <shardtorch/ops/parallel_linear.h>
#include <shardtorch/topology/topology.h>

namespace shardtorch {
namespace nn {
ParallelLinearImpl::ParallelLinearImpl(const ParallelLinearOptions& options_) : options(options_) {
  reset();
}

void ParallelLinearImpl::reset() {
  const auto dim = options.dim();
  TORCH_CHECK(!dim.has_value() || *dim == 0 || *dim == 1 || *dim == -1,
              "ParallelLinear: dim must be nullopt, 0, 1 or -1, got ", *dim);
  TORCH_CHECK(options.in_features() >= 0, "ParallelLinear: in_features must be >= 0, got ",
              options.in_features());
  TORCH_CHECK(options.out_features() >= 0, "ParallelLinear: out_features must be >= 0, got ",
              options.out_features());
  group_rank = 0;
  group_size = 1;
  if (dim.has_value()) {
    group_rank = distributed::get_group_rank(options.group());
    group_size = distributed::get_group_size(options.group());
  }
  out_range = {0, options.out_features()};
  in_range = {0, options.in_features()};
  if (dim == 1 || dim == -1) {
    out_range = topology::shard_range(options.out_features(), group_size, group_rank);
  } else if (dim == 0) {
    in_range = topology::shard_range(options.in_features(), group_size, group_rank);
  }
  weight = register_parameter("weight", torch::empty({out_range.second - out_range.first,
                                                      in_range.second - in_range.first}));
  if (options.bias()) {
    bias = register_parameter("bias", torch::empty({out_range.second - out_range.first}));
  } else {
    bias = register_parameter("bias", {}, /*requires_grad=*/false);
  }
  reset_parameters();
}

void ParallelLinearImpl::reset_parameters() {
  std::optional<at::Tensor> maybe_bias;
  if (bias.defined()) maybe_bias = bias;
  init_linear_shard_(weight, maybe_bias, options.in_features(), options.out_features(), out_range,
                     in_range);
}

void ParallelLinearImpl::pretty_print(std::ostream& stream) const {
  stream << "shardtorch::nn::ParallelLinear(in_features=" << options.in_features()
         << ", out_features=" << options.out_features() << ", bias=" << std::boolalpha
         << options.bias() << ", dim=";
  if (options.dim().has_value()) {
    stream << *options.dim();
  } else {
    stream << "None";
  }
  stream << ", group=" << options.group() << ", shard=[" << weight.size(0) << ", " << weight.size(1)
         << "])";
}

torch::Tensor ParallelLinearImpl::forward(const torch::Tensor& input) {
  torch::Tensor x = input;
  const int64_t in_features = options.in_features();
  if (options.dim() == 0 && group_size > 1 && x.size(-1) == in_features &&
      topology::shard_size(in_features, group_size, 0) == in_features) {
    // A whole input the op would read as rank 0's shard (in_features <= 1
    // over several ranks): every rank slices it explicitly, so that all of
    // them run the same collectives, as the Python layer does.
    x = ops::scatter(x, -1, options.group());
  }
  std::optional<at::Tensor> maybe_bias;
  if (bias.defined()) maybe_bias = bias;
  return ops::parallel_linear(x, weight, maybe_bias, options.dim(), options.group());
}

}  // namespace nn
}  // namespace shardtorch
