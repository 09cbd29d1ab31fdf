// Trains an MLP classifier whose layers are sharded over a tensor-parallel
// group, on synthetic data, and prints the loss of every step (rank 0).
//
//   torchrun --no-python --nproc-per-node 2 ./train_classifier [steps]
//
// Its Python twin, examples/python/train_classifier_twin.py, builds the same
// model from the same seed and prints the same losses (tests/cpp compares them).
//
// The loss, shardtorch::nn::ParallelCrossEntropyLoss, reads the sharded
// logits as they are: no rank ever holds the batch x all-classes matrix, and
// the loss costs one all-gather of per-row statistics forward, none backward.
#include <shardtorch/shardtorch.h>

#include <torch/nn/module.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>

#include <cstdio>
#include <cstdlib>
#include <string>

using shardtorch::nn::ParallelCrossEntropyLoss;
using shardtorch::nn::ParallelCrossEntropyLossOptions;
using shardtorch::nn::ParallelLinear;
using shardtorch::nn::ParallelLinearOptions;

namespace {

constexpr int64_t kSeed = 2024;
constexpr int64_t kSamples = 64;
constexpr int64_t kFeatures = 20;
constexpr int64_t kHidden = 48;
constexpr int64_t kClasses = 11;  // uneven over 2 ranks: shards of 6 and 5
constexpr double kLearningRate = 0.1;
constexpr double kMomentum = 0.9;

// features -> column-parallel -> row-parallel -> sharded classifier head.
struct ClassifierImpl : torch::nn::Module {
  ClassifierImpl()
      : hidden(register_module("hidden",
                               ParallelLinear(ParallelLinearOptions(kFeatures, kHidden).dim(1)))),
        project(register_module("project",
                                ParallelLinear(ParallelLinearOptions(kHidden, kHidden).dim(0)))),
        head(register_module("head",
                             ParallelLinear(ParallelLinearOptions(kHidden, kClasses).dim(1)))) {}

  // This rank's shard of the logits: [batch, classes of this rank].
  torch::Tensor forward(const torch::Tensor& features) {
    auto x = torch::relu(hidden(features));  // sharded on its last dim
    x = torch::relu(project(x));             // whole again (all-reduced)
    return head(x);
  }

  ParallelLinear hidden, project, head;
};
TORCH_MODULE(Classifier);

}  // namespace

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 20;
  // Every rank in one tensor-parallel group (torchrun sets WORLD_SIZE).
  const char* world_size = std::getenv("WORLD_SIZE");
  shardtorch::distributed::init_process_group(
      shardtorch::distributed::InitOptions().group_size(world_size ? std::atoi(world_size) : 1));
  const bool print = shardtorch::distributed::get_rank() == 0;

  torch::manual_seed(kSeed);
  Classifier model;
  // The same data on every rank: a random linear teacher labels Gaussian points.
  const auto features = torch::randn({kSamples, kFeatures});
  const auto teacher = torch::randn({kFeatures, kClasses});
  const auto targets = features.matmul(teacher).argmax(1);

  torch::optim::SGD optimizer(model->parameters(),
                              torch::optim::SGDOptions(kLearningRate).momentum(kMomentum));
  // num_classes spares the op the all-gather of shard sizes.
  ParallelCrossEntropyLoss loss_fn(ParallelCrossEntropyLossOptions().num_classes(kClasses));
  for (int step = 0; step < steps; ++step) {
    optimizer.zero_grad();
    const auto loss = loss_fn(model->forward(features), targets);
    loss.backward();
    optimizer.step();
    if (print) std::printf("step %d loss %.9g\n", step, loss.item<double>());
  }
  std::fflush(stdout);
  shardtorch::distributed::destroy_process_group();
  return 0;
}
