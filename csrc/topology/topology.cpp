#include <shardtorch/topology/topology.h>

#include <c10/util/Exception.h>

namespace shardtorch {
namespace topology {

static void check_split(int64_t total, int64_t parts, int64_t index) {
  TORCH_CHECK(total >= 0, "shard_size: total must be >= 0, got ", total);
  TORCH_CHECK(parts >= 1, "shard_size: parts must be >= 1, got ", parts);
  TORCH_CHECK(index >= 0 && index < parts, "shard_size: index must be in [0, ", parts, "), got ",
              index);
}

int64_t shard_size(int64_t total, int64_t parts, int64_t index) {
  check_split(total, parts, index);
  return total / parts + (index < total % parts ? 1 : 0);
}

int64_t shard_offset(int64_t total, int64_t parts, int64_t index) {
  check_split(total, parts, index);
  const int64_t remainder = total % parts;
  return index * (total / parts) + (index < remainder ? index : remainder);
}

std::pair<int64_t, int64_t> shard_range(int64_t total, int64_t parts, int64_t index) {
  const int64_t offset = shard_offset(total, parts, index);
  return {offset, offset + shard_size(total, parts, index)};
}

std::vector<int64_t> shard_sizes(int64_t total, int64_t parts) {
  std::vector<int64_t> sizes;
  sizes.reserve(parts);
  for (int64_t i = 0; i < parts; ++i) sizes.push_back(shard_size(total, parts, i));
  return sizes;
}

TensorParallelTopology::TensorParallelTopology(int64_t world_size, int64_t rank,
                                               int64_t tensor_parallel_size)
    : world_size_(world_size), rank_(rank), tensor_parallel_size_(tensor_parallel_size) {
  TORCH_CHECK(world_size >= 1, "TensorParallelTopology: world_size must be >= 1, got ", world_size);
  TORCH_CHECK(rank >= 0 && rank < world_size, "TensorParallelTopology: rank must be in [0, ",
              world_size, "), got ", rank);
  TORCH_CHECK(tensor_parallel_size >= 1 && world_size % tensor_parallel_size == 0,
              "TensorParallelTopology: group_size must divide the world size ", world_size,
              ", got ", tensor_parallel_size);
}

std::vector<std::vector<int64_t>> TensorParallelTopology::tensor_parallel_groups() const {
  std::vector<std::vector<int64_t>> groups;
  for (int64_t g = 0; g < data_parallel_size(); ++g) {
    std::vector<int64_t> ranks;
    for (int64_t i = 0; i < tensor_parallel_size_; ++i)
      ranks.push_back(g * tensor_parallel_size_ + i);
    groups.push_back(std::move(ranks));
  }
  return groups;
}

std::vector<std::vector<int64_t>> TensorParallelTopology::data_parallel_groups() const {
  std::vector<std::vector<int64_t>> groups;
  for (int64_t t = 0; t < tensor_parallel_size_; ++t) {
    std::vector<int64_t> ranks;
    for (int64_t g = 0; g < data_parallel_size(); ++g)
      ranks.push_back(g * tensor_parallel_size_ + t);
    groups.push_back(std::move(ranks));
  }
  return groups;
}

std::vector<int64_t> TensorParallelTopology::tensor_parallel_group_ranks() const {
  return tensor_parallel_groups()[data_parallel_rank()];
}

std::vector<int64_t> TensorParallelTopology::data_parallel_group_ranks() const {
  return data_parallel_groups()[tensor_parallel_rank()];
}

}  // namespace topology
}  // namespace shardtorch
