#pragma once
// Process groups of shardtorch from C++: the same groups as the Python
// package's shardtorch.distributed.init_process_group ("tp", "dp", "world",
// tensor-parallel ranks consecutive), registered in comm/registry so that
// every op finds them by name. CPU tensors communicate over Gloo; CUDA tensors
// over NCCL, created lazily per group by the communicator registry.
//
//   shardtorch::distributed::init_process_group(
//       shardtorch::distributed::InitOptions().group_size(2));

#include <cstdint>
#include <string>
#include <vector>

#include <shardtorch/distributed/init_options.h>

namespace shardtorch {
namespace distributed {

// Rendezvous through a c10d::TCPStore at MASTER_ADDR:MASTER_PORT (torchrun's
// environment), then creates and registers the groups. Every rank must call it.
void init_process_group(const InitOptions& options = InitOptions());

// Forgets the groups (and their NCCL communicators) and closes the store.
// Then raises, on every rank, an argument check on CUDA that no collective
// came to give (check_deferred) before.
void destroy_process_group();

// Gives now, on every rank that calls it at the same point, the argument
// checks the CUDA communicators deferred (a bad target of the step's loss):
// raises the first failed one. Without it they come at the group's 8th
// collective after theirs, or at destroy_process_group (docs/cuda.md).
// `group` empty: every group.
void check_deferred(const std::string& group = "");

bool is_initialized();

// This process's rank in the world and the world's size (0 and 1 when not
// distributed). Groups registered from Python count too.
int64_t get_rank();
int64_t get_world_size();
// LOCAL_RANK at init (the rank within this node: the CUDA device to use), 0
// when not initialised from C++.
int64_t get_local_rank();

// Rank within, size and global ranks of a registered group (default "tp").
int64_t get_group_rank(const std::string& group = kTensorParallel);
int64_t get_group_size(const std::string& group = kTensorParallel);
std::vector<int64_t> get_group_ranks(const std::string& group = kTensorParallel);

}  // namespace distributed
}  // namespace shardtorch
