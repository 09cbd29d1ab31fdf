#include <shardtorch/nn/parallel_cross_entropy.h>

#include <c10/util/Exception.h>

#include <utility>

namespace shardtorch {
namespace nn {

ParallelCrossEntropyLossImpl::ParallelCrossEntropyLossImpl(ParallelCrossEntropyLossOptions options_)
    : options(std::move(options_)) {
  reset();
}

void ParallelCrossEntropyLossImpl::reset() {
  // Checked here rather than only in the op, so a bad option fails where the
  // module is built, not at the first step.
  TORCH_CHECK(options.label_smoothing() >= 0.0 && options.label_smoothing() <= 1.0,
              "ParallelCrossEntropyLoss: label_smoothing must be in [0, 1], got ",
              options.label_smoothing());
  TORCH_CHECK(options.z_loss() >= 0.0, "ParallelCrossEntropyLoss: z_loss must be >= 0, got ",
              options.z_loss());
  TORCH_CHECK(!options.num_classes().has_value() || *options.num_classes() >= 0,
              "ParallelCrossEntropyLoss: num_classes must be >= 0, got ",
              options.num_classes().value_or(0));
  weight = register_buffer("weight", options.weight());
}

void ParallelCrossEntropyLossImpl::pretty_print(std::ostream& stream) const {
  stream << "shardtorch::nn::ParallelCrossEntropyLoss(ignore_index=" << options.ignore_index()
         << ", reduction=" << torch::enumtype::get_enum_name(options.reduction())
         << ", label_smoothing=" << options.label_smoothing() << ", z_loss=" << options.z_loss()
         << ", group=" << options.group() << ")";
}

torch::Tensor ParallelCrossEntropyLossImpl::forward(const torch::Tensor& input,
                                                    const torch::Tensor& target) {
  // The buffer, not options.weight(): it is what to(device) moved.
  auto call_options = options;
  call_options.weight(weight);
  return functional::parallel_cross_entropy(input, target, call_options);
}

}  // namespace nn
}  // namespace shardtorch
