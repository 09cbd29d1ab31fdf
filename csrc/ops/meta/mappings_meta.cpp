// Shapes of the communication mappings without data or communication, so that
// torch.compile and FakeTensor can trace them. Group sizes come from the
// registry, which holds no communication state.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "comm/registry.h"
#include "ops/op_checks.h"

namespace shardtorch {
namespace ops {
namespace {

c10::SymInt symbolic_shard_size(const c10::SymInt& total, int64_t parts, int64_t index) {
  c10::SymInt base = total / parts;
  c10::SymInt remainder = total % parts;
  const bool one_more = remainder > index;  // guards on a symbolic total
  return one_more ? base + 1 : base;
}

at::Tensor with_size(const at::Tensor& input, int64_t dim, c10::SymInt size) {
  auto sizes = input.sym_sizes().vec();
  sizes[dim] = std::move(size);
  return at::empty_symint(sizes, input.options());
}

at::Tensor same_meta(const at::Tensor& input, const std::string& group) {
  comm::group_layout(group, "shard::copy/reduce");
  return at::empty_symint(input.sym_sizes(), input.options());
}

at::Tensor scatter_meta(const at::Tensor& input, int64_t dim, const std::string& group) {
  auto info = comm::group_layout(group, "shard::scatter");
  const int64_t d = normalize_dim(dim, input.dim(), "shard::scatter");
  return with_size(input, d, symbolic_shard_size(input.sym_size(d), info.size, info.rank));
}

at::Tensor gather_meta(const at::Tensor& input, int64_t dim, const std::string& group,
                       std::optional<c10::SymInt> full_size) {
  auto info = comm::group_layout(group, "shard::all_gather");
  const int64_t d = normalize_dim(dim, input.dim(), "shard::all_gather");
  // Without full_size the shards are taken to be equal; pass full_size for
  // uneven shards under torch.compile (eager checks the sizes either way).
  c10::SymInt total = full_size.has_value() ? *full_size : input.sym_size(d) * info.size;
  return with_size(input, d, std::move(total));
}

at::Tensor reduce_scatter_meta(const at::Tensor& input, int64_t dim, const std::string& group) {
  auto info = comm::group_layout(group, "shard::reduce_scatter");
  const int64_t d = normalize_dim(dim, input.dim(), "shard::reduce_scatter");
  return with_size(input, d, symbolic_shard_size(input.sym_size(d), info.size, info.rank));
}

}  // namespace

TORCH_LIBRARY_IMPL(shard, Meta, m) {
  m.impl("copy", TORCH_FN(same_meta));
  m.impl("reduce", TORCH_FN(same_meta));
  m.impl("scatter", TORCH_FN(scatter_meta));
  m.impl("gather_replicated", TORCH_FN(gather_meta));
  m.impl("all_gather", TORCH_FN(gather_meta));
  m.impl("reduce_scatter", TORCH_FN(reduce_scatter_meta));
}

}  // namespace ops
}  // namespace shardtorch
