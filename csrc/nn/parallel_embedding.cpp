#include <shardtorch/nn/parallel_embedding.h>

#include <c10/core/GradMode.h>
#include <torch/types.h>

#include <shardtorch/distributed/process_group.h>
#include <shardtorch/nn/embedding_init.h>
#include <shardtorch/ops/parallel_embedding.h>
#include <shardtorch/topology/topology.h>

namespace shardtorch {
namespace nn {

ParallelEmbeddingImpl::ParallelEmbeddingImpl(const ParallelEmbeddingOptions& options_)
    : options(options_) {
  reset();
}

int64_t ParallelEmbeddingImpl::full_size() const {
  return options.dim() == 0 ? options.num_embeddings() : options.embedding_dim();
}

void ParallelEmbeddingImpl::reset() {
  TORCH_CHECK(options.dim() == 0 || options.dim() == 1,
              "ParallelEmbedding: dim must be 0 (vocabulary-parallel) or 1 "
              "(embedding-dim-parallel), got ",
              options.dim());
  TORCH_CHECK(options.num_embeddings() >= 0, "ParallelEmbedding: num_embeddings must be >= 0, got ",
              options.num_embeddings());
  TORCH_CHECK(options.embedding_dim() >= 0, "ParallelEmbedding: embedding_dim must be >= 0, got ",
              options.embedding_dim());
  padding_idx = options.padding_idx();
  if (padding_idx.has_value()) {
    const int64_t n = options.num_embeddings();
    TORCH_CHECK(-n <= *padding_idx && *padding_idx < n,
                "ParallelEmbedding: padding_idx must be within num_embeddings = ", n, " (in [", -n,
                ", ", n, ")), got ", *padding_idx);
    if (*padding_idx < 0) *padding_idx += n;
  }
  group_rank = distributed::get_group_rank(options.group());
  group_size = distributed::get_group_size(options.group());
  const Range split = topology::shard_range(full_size(), group_size, group_rank);
  row_range = options.dim() == 0 ? split : Range{0, options.num_embeddings()};
  col_range = options.dim() == 1 ? split : Range{0, options.embedding_dim()};
  weight = register_parameter("weight", torch::empty({row_range.second - row_range.first,
                                                      col_range.second - col_range.first}));
  reset_parameters();
}

void ParallelEmbeddingImpl::reset_parameters() {
  init_embedding_shard_(weight, options.num_embeddings(), options.embedding_dim(), row_range,
                        col_range, padding_idx);
}

void ParallelEmbeddingImpl::pretty_print(std::ostream& stream) const {
  stream << "shardtorch::nn::ParallelEmbedding(num_embeddings=" << options.num_embeddings()
         << ", embedding_dim=" << options.embedding_dim() << ", dim=" << options.dim()
         << ", group=" << options.group();
  if (padding_idx.has_value()) stream << ", padding_idx=" << *padding_idx;
  if (options.max_norm().has_value()) stream << ", max_norm=" << *options.max_norm();
  if (options.norm_type() != 2) stream << ", norm_type=" << options.norm_type();
  if (options.scale_grad_by_freq()) stream << ", scale_grad_by_freq=true";
  if (options.sparse()) stream << ", sparse=true";
  stream << ", shard=[" << weight.size(0) << ", " << weight.size(1) << "])";
}

torch::Tensor ParallelEmbeddingImpl::forward(const torch::Tensor& input) {
  // A vocabulary-parallel lookup would silently return zeros for an index past
  // the table: check it as torch::nn::Embedding does. Only for CPU inputs,
  // where the check costs no device synchronisation.
  if (input.device().is_cpu() && input.numel() > 0) {
    const int64_t low = input.min().item<int64_t>();
    const int64_t high = input.max().item<int64_t>();
    TORCH_CHECK_INDEX(low >= 0 && high < options.num_embeddings(),
                      "ParallelEmbedding: indices must be in [0, num_embeddings = ",
                      options.num_embeddings(), "), got values in [", low, ", ", high, "]");
  }
  if (options.max_norm().has_value()) {
    c10::NoGradGuard no_grad;
    ops::parallel_embedding_renorm_(weight, input, *options.max_norm(), options.norm_type(),
                                    options.dim(), full_size(), options.group());
  }
  return ops::parallel_embedding(input, weight, padding_idx, options.dim(), full_size(),
                                 options.scale_grad_by_freq(), options.sparse(), options.group());
}

}  // namespace nn
}  // namespace shardtorch
