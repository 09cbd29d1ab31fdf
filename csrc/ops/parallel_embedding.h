#pragma once
// shard::parallel_embedding: torch.nn.functional.embedding with the weight
// split over a tensor-parallel group.
//   dim = 0  vocabulary-parallel: weight holds rows [offset, offset + rows) of
//            the [num_embeddings, embedding_dim] table (split rule of
//            topology::shard_size). Indices outside the slice look up zeros;
//            the group's partial outputs are summed (shard::reduce), so every
//            rank returns the whole output.
//   dim = 1  embedding-dim-parallel: weight holds columns of every row; the
//            output is gathered on its last dim (shard::gather_replicated), so every
//            rank returns the whole output, as torch.nn.Embedding does.
// `full_size` is the size of the split dimension of the full table
// (num_embeddings for dim 0, embedding_dim for dim 1). `padding_idx` is a
// global row index (normalised, >= 0) or None.
//
// Both ops are CompositeImplicitAutograd: composed of at:: ops and the shard
// mapping ops, so autograd, meta/fake tensors and torch.compile follow from
// theirs.
//
// shard::parallel_embedding_renorm_: torch.embedding_renorm_ for a sharded
// weight: rescales, in place, every row referenced by `input` whose
// norm_type-norm exceeds max_norm. With dim = 1 a row's norm spans the shards
// of the whole group, so the per-shard partial norms are combined over it.

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

namespace shardtorch {
namespace ops {

at::Tensor parallel_embedding(const at::Tensor& input, const at::Tensor& weight,
                              std::optional<int64_t> padding_idx, int64_t dim, int64_t full_size,
                              bool scale_grad_by_freq, bool sparse, const std::string& group);

at::Tensor& parallel_embedding_renorm_(at::Tensor& weight, const at::Tensor& input, double max_norm,
                                       double norm_type, int64_t dim, int64_t full_size,
                                       const std::string& group);

}  // namespace ops
}  // namespace shardtorch
