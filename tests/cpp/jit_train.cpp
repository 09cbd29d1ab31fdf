// Loads a TorchScript module that calls torch.ops.shard.* (saved from Python,
// one file per tensor-parallel rank: <prefix>_rank<R>.pt), and trains it a few
// SGD steps in C++ under torchrun, printing the loss of every step (rank 0).
// tests/cpp/test_cpp_api.py compares the losses with unsharded torch.
//
//   torchrun --no-python --nproc-per-node 2 jit_train PREFIX STEPS
#include <shardtorch/shardtorch.h>

#include <torch/optim/sgd.h>
#include <torch/script.h>
#include <torch/utils.h>

#include <cstdio>
#include <cstdlib>
#include <string>

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s PREFIX [STEPS]\n", argv[0]);
    return 2;
  }
  const std::string prefix = argv[1];
  const int steps = argc > 2 ? std::atoi(argv[2]) : 3;
  namespace dist = shardtorch::distributed;
  const char* world_size = std::getenv("WORLD_SIZE");
  dist::init_process_group(dist::InitOptions().group_size(world_size ? std::atoi(world_size) : 1));

  auto module = torch::jit::load(prefix + "_rank" + std::to_string(dist::get_group_rank()) + ".pt");
  module.train();
  std::vector<torch::Tensor> parameters;
  for (const auto& p : module.parameters()) parameters.push_back(p);

  torch::manual_seed(7);
  const auto features = torch::randn({8, 8});
  const auto targets = torch::randint(0, 4, {8});
  torch::optim::SGD optimizer(parameters, torch::optim::SGDOptions(0.2));
  for (int step = 0; step < steps; ++step) {
    optimizer.zero_grad();
    auto loss = module.forward({features, targets}).toTensor();
    loss.backward();
    optimizer.step();
    if (dist::get_rank() == 0) std::printf("step %d loss %.9g\n", step, loss.item<double>());
  }
  std::fflush(stdout);
  dist::destroy_process_group();
  return 0;
}
