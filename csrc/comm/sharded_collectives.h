#pragma once
// Collectives over shards of one logical tensor split along any dimension,
// uneven splits included (shard r has sizes[r] elements along `dim`). Both
// backends only move equal blocks, so shards are padded to the largest one;
// the padding is at most one row per rank under the split rule.

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <vector>

#include "comm/communicator.h"

namespace shardtorch {
namespace comm {

// A gather in flight; finish() waits and assembles the result.
struct PendingTensor {
  std::shared_ptr<CommHandle> handle;
  std::function<at::Tensor()> assemble;
  at::Tensor finish() {
    handle->wait();
    return assemble();
  }
};

// Concatenation along `dim` of every rank's `input`.
PendingTensor all_gather_along_dim_async(Communicator& comm, const at::Tensor& input, int64_t dim,
                                         const std::vector<int64_t>& sizes);
at::Tensor all_gather_along_dim(Communicator& comm, const at::Tensor& input, int64_t dim,
                                const std::vector<int64_t>& sizes);

// Sum over the group of `input` (whole along `dim`), keeping this rank's shard.
at::Tensor reduce_scatter_along_dim(Communicator& comm, const at::Tensor& input, int64_t dim,
                                    const std::vector<int64_t>& sizes);

// Every rank's `local` values, in rank order (one small all-gather): rank r's
// are entries [r * local.size(), (r + 1) * local.size()). For CUDA tensors
// they travel over the group's CPU backend when it has one, so that the host
// never waits for the GPU; only an NCCL-only group moves them on the device.
std::vector<int64_t> exchange_values(Communicator& comm, const std::vector<int64_t>& local,
                                     const c10::Device& device);

// Every rank's value of `local`, for shards whose sizes nobody told us.
std::vector<int64_t> exchange_sizes(Communicator& comm, int64_t local, const c10::Device& device);

}  // namespace comm
}  // namespace shardtorch
