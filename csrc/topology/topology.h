#pragma once
// Pure arithmetic of tensor-parallel layouts: which ranks form which group and
// which slice of a split dimension each rank owns. No communication here, so
// every rule can be unit-tested without starting processes.

#include <cstdint>
#include <utility>
#include <vector>

namespace shardtorch {
namespace topology {

// Splitting `total` items over `parts` ranks: the first `total % parts` ranks
// get one item more. 1,000,001 classes over 8 ranks is a normal case.
int64_t shard_size(int64_t total, int64_t parts, int64_t index);
int64_t shard_offset(int64_t total, int64_t parts, int64_t index);
std::vector<int64_t> shard_sizes(int64_t total, int64_t parts);
// [offset, offset + size) of shard `index`.
std::pair<int64_t, int64_t> shard_range(int64_t total, int64_t parts, int64_t index);

// Ranks [0, world) arranged as data_parallel_size x tensor_parallel_size with
// tensor-parallel ranks consecutive, so that a tensor-parallel group shares a
// node when ranks are numbered node by node.
class TensorParallelTopology {
 public:
  TensorParallelTopology(int64_t world_size, int64_t rank, int64_t tensor_parallel_size);

  int64_t world_size() const { return world_size_; }
  int64_t rank() const { return rank_; }
  int64_t tensor_parallel_size() const { return tensor_parallel_size_; }
  int64_t data_parallel_size() const { return world_size_ / tensor_parallel_size_; }
  int64_t tensor_parallel_rank() const { return rank_ % tensor_parallel_size_; }
  int64_t data_parallel_rank() const { return rank_ / tensor_parallel_size_; }

  // Every group of the world, in the order all ranks must create them.
  std::vector<std::vector<int64_t>> tensor_parallel_groups() const;
  std::vector<std::vector<int64_t>> data_parallel_groups() const;

  // The groups this rank belongs to.
  std::vector<int64_t> tensor_parallel_group_ranks() const;
  std::vector<int64_t> data_parallel_group_ranks() const;

 private:
  int64_t world_size_;
  int64_t rank_;
  int64_t tensor_parallel_size_;
};

}  // namespace topology
}  // namespace shardtorch
