#pragma once
// Options of shardtorch::distributed::init_process_group, in the builder style
// of torch::nn options: InitOptions().group_size(2).timeout(std::chrono::seconds(60)).

#include <torch/arg.h>

#include <chrono>
#include <cstdint>
#include <string>

namespace shardtorch {
namespace distributed {

// Names of the groups every op schema refers to (`str group`); the same names
// as the Python package, so scripted modules saved from Python run unchanged.
inline constexpr const char* kTensorParallel = "tp";
inline constexpr const char* kDataParallel = "dp";
inline constexpr const char* kWorld = "world";

// SHARDTORCH_TIMEOUT (seconds), as in Python, else 300 s.
std::chrono::milliseconds default_timeout();

struct InitOptions {
  InitOptions() = default;
  /* implicit */ InitOptions(int64_t group_size) : group_size_(group_size) {}

  // Ranks per tensor-parallel group; must divide the world size.
  TORCH_ARG(int64_t, group_size) = 1;
  // How long a collective (and the rendezvous) may wait for a peer.
  TORCH_ARG(std::chrono::milliseconds, timeout) = default_timeout();
  // The CPU backend: "gloo" (the only one; "cpu:gloo,cuda:nccl" is accepted
  // too, since CUDA tensors always use NCCL through the communicator registry).
  TORCH_ARG(std::string, backend) = "gloo";
};

}  // namespace distributed
}  // namespace shardtorch
