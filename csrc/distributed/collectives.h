#pragma once
// The communication mappings of tensor parallelism, differentiable, with the
// defaults of the Python package (group "tp", last dim): the C++ twin of
// shardtorch.distributed.{copy, reduce, scatter, gather, all_gather,
// gather_replicated, reduce_scatter}. Each calls its op through the dispatcher
// (ops/mappings.h), so autograd, TorchScript and the CUDA/NCCL path are the
// same as Python's.
//
//   function           forward                  backward                  op
//   copy               identity                 all-reduce (sum)          shard::copy
//   reduce             all-reduce (sum)         identity                  shard::reduce
//   scatter            keep this rank's slice   all-gather                shard::scatter
//   gather             all-gather               reduce-scatter (sum)      shard::all_gather
//   all_gather         all-gather               reduce-scatter (sum)      shard::all_gather
//   gather_replicated  all-gather               keep this rank's slice    shard::gather_replicated
//   reduce_scatter     reduce-scatter (sum)     all-gather                shard::reduce_scatter
//
// gather is the adjoint (exact for a batch gathered before a sharded head under
// DDP over all ranks); gather_replicated is for computation replicated over the
// group whose result counts once per group (see shardtorch/distributed/mappings.py).

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

#include <shardtorch/distributed/init_options.h>
#include <shardtorch/ops/mappings.h>

namespace shardtorch {
namespace distributed {

inline at::Tensor copy(const at::Tensor& input, const std::string& group = kTensorParallel) {
  return ops::copy(input, group);
}

inline at::Tensor reduce(const at::Tensor& input, const std::string& group = kTensorParallel) {
  return ops::reduce(input, group);
}

inline at::Tensor scatter(const at::Tensor& input, int64_t dim = -1,
                          const std::string& group = kTensorParallel) {
  return ops::scatter(input, dim, group);
}

// `full_size`: the total length along `dim`; without it the ranks exchange
// their shard sizes first (one tiny collective).
inline at::Tensor all_gather(const at::Tensor& input, int64_t dim = -1,
                             const std::string& group = kTensorParallel,
                             std::optional<int64_t> full_size = std::nullopt) {
  std::optional<c10::SymInt> size;
  if (full_size.has_value()) size = c10::SymInt(*full_size);
  return ops::all_gather(input, dim, group, size);
}

// The same as all_gather (TorchShard's name for it).
inline at::Tensor gather(const at::Tensor& input, int64_t dim = -1,
                         const std::string& group = kTensorParallel,
                         std::optional<int64_t> full_size = std::nullopt) {
  return all_gather(input, dim, group, full_size);
}

inline at::Tensor gather_replicated(const at::Tensor& input, int64_t dim = -1,
                                    const std::string& group = kTensorParallel,
                                    std::optional<int64_t> full_size = std::nullopt) {
  std::optional<c10::SymInt> size;
  if (full_size.has_value()) size = c10::SymInt(*full_size);
  return ops::gather_replicated(input, dim, group, size);
}

inline at::Tensor reduce_scatter(const at::Tensor& input, int64_t dim = -1,
                                 const std::string& group = kTensorParallel) {
  return ops::reduce_scatter(input, dim, group);
}

}  // namespace distributed
}  // namespace shardtorch
