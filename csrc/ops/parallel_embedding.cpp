// Schemas, entry points and the CompositeImplicitAutograd kernels of
// shard::parallel_embedding and shard::parallel_embedding_renorm_ (see
// parallel_embedding.h).
#include <shardtorch/ops/parallel_embedding.h>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

#include "comm/registry.h"
#include <shardtorch/ops/mappings.h>
#include <shardtorch/topology/topology.h>

namespace shardtorch {
namespace ops {

TORCH_LIBRARY_FRAGMENT(shard, m) {
  const std::vector<at::Tag> tags{at::Tag::pt2_compliant_tag};
  m.def(
      "parallel_embedding(Tensor input, Tensor weight, int? padding_idx, int dim, int full_size, "
      "bool scale_grad_by_freq, bool sparse, str group) -> Tensor",
      tags);
  m.def(
      "parallel_embedding_renorm_(Tensor(a!) weight, Tensor input, float max_norm, "
      "float norm_type, int dim, int full_size, str group) -> Tensor(a!)",
      tags);
}

namespace {

constexpr const char* kOp = "shard::parallel_embedding";

struct Slice {
  int64_t offset;
  int64_t size;
};

// The slice of the split dimension this rank holds, checked against weight.
Slice checked_slice(const at::Tensor& weight, int64_t dim, int64_t full_size,
                    const std::string& group, const char* op) {
  TORCH_CHECK(dim == 0 || dim == 1, op, ": dim must be 0 (vocabulary-parallel) or 1 ",
              "(embedding-dim-parallel), got ", dim);
  TORCH_CHECK(weight.dim() == 2, op, ": weight must be 2-D [rows, columns], got ", weight.sizes());
  TORCH_CHECK(full_size >= 0, op, ": full_size must be >= 0, got ", full_size);
  auto layout = comm::group_layout(group, op);
  const Slice slice{topology::shard_offset(full_size, layout.size, layout.rank),
                    topology::shard_size(full_size, layout.size, layout.rank)};
  TORCH_CHECK(weight.size(dim) == slice.size, op, ": weight.size(", dim, ") must be this rank's ",
              "shard of full_size = ", full_size, " over group '", group, "' (rank ", layout.rank,
              " of ", layout.size, "), i.e. ", slice.size, ", got ", weight.size(dim));
  return slice;
}

at::Tensor vocabulary_parallel(const at::Tensor& input, const at::Tensor& weight,
                               std::optional<int64_t> padding_idx, int64_t full_size,
                               bool scale_grad_by_freq, bool sparse, const std::string& group) {
  const Slice rows = checked_slice(weight, 0, full_size, group, kOp);
  const bool pad_here = padding_idx.has_value() && *padding_idx >= rows.offset &&
                        *padding_idx < rows.offset + rows.size;
  const int64_t local_padding = pad_here ? *padding_idx - rows.offset : -1;
  auto outside = at::logical_or(input < rows.offset, input >= rows.offset + rows.size);
  at::Tensor partial;
  if (scale_grad_by_freq || rows.size == 0) {
    // Indices of other ranks look up an extra zero row: they then never count
    // as occurrences of a real row (scale_grad_by_freq divides each row's
    // gradient by its number of occurrences), and an empty shard still has a
    // row to look up.
    auto extended = at::cat({weight, at::zeros({1, weight.size(1)}, weight.options())}, 0);
    auto local = at::where(outside, at::full({}, rows.size, input.options()), input - rows.offset);
    partial = at::embedding(extended, local, local_padding, scale_grad_by_freq, sparse);
  } else {
    // Indices of other ranks look up local row 0, then are zeroed: the
    // masked_fill also zeroes their gradient, so row 0 receives nothing from them.
    auto local = (input - rows.offset).masked_fill(outside, 0);
    partial = at::embedding(weight, local, local_padding, false, sparse)
                  .masked_fill(outside.unsqueeze(-1), 0);
  }
  return reduce(partial, group);
}

at::Tensor embedding_dim_parallel(const at::Tensor& input, const at::Tensor& weight,
                                  std::optional<int64_t> padding_idx, int64_t full_size,
                                  bool scale_grad_by_freq, bool sparse, const std::string& group) {
  checked_slice(weight, 1, full_size, group, kOp);
  auto local = at::embedding(weight, input, padding_idx.value_or(-1), scale_grad_by_freq, sparse);
  return gather_replicated(local, -1, group, c10::SymInt(full_size));
}

}  // namespace

at::Tensor parallel_embedding_composite(const at::Tensor& input, const at::Tensor& weight,
                                        std::optional<int64_t> padding_idx, int64_t dim,
                                        int64_t full_size, bool scale_grad_by_freq, bool sparse,
                                        const std::string& group) {
  TORCH_CHECK(input.scalar_type() == at::kLong || input.scalar_type() == at::kInt, kOp,
              ": input must hold indices (int64 or int32), got ", input.scalar_type());
  const int64_t rows_total = dim == 0 ? full_size : weight.size(0);
  if (padding_idx.has_value()) {
    TORCH_CHECK(*padding_idx >= 0 && *padding_idx < rows_total, kOp,
                ": padding_idx must be a row index in [0, ", rows_total, "), got ", *padding_idx);
  }
  if (dim == 0) {
    return vocabulary_parallel(input, weight, padding_idx, full_size, scale_grad_by_freq, sparse,
                               group);
  }
  TORCH_CHECK(dim == 1, kOp, ": dim must be 0 (vocabulary-parallel) or 1 (embedding-dim-parallel),",
              " got ", dim);
  return embedding_dim_parallel(input, weight, padding_idx, full_size, scale_grad_by_freq, sparse,
                                group);
}

at::Tensor& parallel_embedding_renorm_composite(at::Tensor& weight, const at::Tensor& input,
                                                double max_norm, double norm_type, int64_t dim,
                                                int64_t full_size, const std::string& group) {
  constexpr const char* op = "shard::parallel_embedding_renorm_";
  const Slice slice = checked_slice(weight, dim, full_size, group, op);
  TORCH_CHECK(max_norm >= 0, op, ": max_norm must be >= 0, got ", max_norm);
  at::NoGradGuard no_grad;
  auto indices = input.reshape(-1).to(at::kLong);
  if (dim == 0) {
    // A row lives whole on one rank: renormalise the referenced local rows.
    auto mine = at::logical_and(indices >= slice.offset, indices < slice.offset + slice.size);
    auto local = indices.masked_select(mine) - slice.offset;
    at::embedding_renorm_(weight, local, max_norm, norm_type);
    return weight;
  }
  // dim == 1: combine per-shard partial norms over the group (all-gather of
  // one number per row and rank), then scale as torch.embedding_renorm_ does.
  auto rows = std::get<0>(at::_unique(indices, /*sorted=*/true));
  auto values = weight.index_select(0, rows);
  const bool infinite = std::isinf(norm_type);
  auto partial = infinite ? values.abs().amax(1, /*keepdim=*/true)
                          : values.abs().pow(norm_type).sum(1, /*keepdim=*/true);
  const auto& layout = comm::group_layout(group, op);
  auto per_rank = gather_replicated(partial, -1, group, c10::SymInt(layout.size));
  auto norm = infinite ? per_rank.amax(1) : per_rank.sum(1).pow(1.0 / norm_type);
  auto too_long = norm > max_norm;
  auto scale = at::where(too_long, max_norm / (norm + 1e-7), at::ones_like(norm));
  weight.index_copy_(0, rows, values * scale.unsqueeze(1));
  return weight;
}

at::Tensor parallel_embedding(const at::Tensor& input, const at::Tensor& weight,
                              std::optional<int64_t> padding_idx, int64_t dim, int64_t full_size,
                              bool scale_grad_by_freq, bool sparse, const std::string& group) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("shard::parallel_embedding", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, std::optional<int64_t>, int64_t,
                            int64_t, bool, bool, const std::string&)>();
  return op.call(input, weight, padding_idx, dim, full_size, scale_grad_by_freq, sparse, group);
}

at::Tensor& parallel_embedding_renorm_(at::Tensor& weight, const at::Tensor& input, double max_norm,
                                       double norm_type, int64_t dim, int64_t full_size,
                                       const std::string& group) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("shard::parallel_embedding_renorm_", "")
                       .typed<at::Tensor&(at::Tensor&, const at::Tensor&, double, double, int64_t,
                                          int64_t, const std::string&)>();
  return op.call(weight, input, max_norm, norm_type, dim, full_size, group);
}

TORCH_LIBRARY_IMPL(shard, CompositeImplicitAutograd, m) {
  m.impl("parallel_embedding", &parallel_embedding_composite);
  m.impl("parallel_embedding_renorm_", &parallel_embedding_renorm_composite);
}

}  // namespace ops
}  // namespace shardtorch
