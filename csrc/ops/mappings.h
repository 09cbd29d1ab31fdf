#pragma once
// The communication mappings of tensor parallelism as differentiable ops.
// Each op's name says its forward; its backward is the adjoint, except for
// gather_replicated, whose name says it is for replicated computation:
//   op                 forward         | backward
//   copy               identity        | all-reduce
//   reduce             all-reduce      | identity
//   scatter            keep my slice   | all-gather (gather_replicated)
//   all_gather         all-gather      | reduce-scatter (sum)
//   gather_replicated  all-gather      | keep my slice (for a gradient that is
//                                        the same on every rank)
//   reduce_scatter     reduce-scatter  | all-gather
// Shards along `dim` follow the split rule of topology::shard_size (uneven
// allowed). `full_size` tells gather ops the total length along `dim`; without
// it the ops exchange shard sizes first (one extra tiny collective). On CPU and
// under SHARDTORCH_DEBUG they exchange them with it too, so that a misfitting
// input fails on every rank at once (mappings_kernels.cpp, sizes_from_full_size).

#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>

#include <optional>
#include <string>

namespace shardtorch {
namespace ops {

at::Tensor copy(const at::Tensor& input, const std::string& group);
at::Tensor reduce(const at::Tensor& input, const std::string& group);
at::Tensor scatter(const at::Tensor& input, int64_t dim, const std::string& group);
at::Tensor gather_replicated(const at::Tensor& input, int64_t dim, const std::string& group,
                             std::optional<c10::SymInt> full_size = std::nullopt);
at::Tensor all_gather(const at::Tensor& input, int64_t dim, const std::string& group,
                      std::optional<c10::SymInt> full_size = std::nullopt);
at::Tensor reduce_scatter(const at::Tensor& input, int64_t dim, const std::string& group);

}  // namespace ops
}  // namespace shardtorch
