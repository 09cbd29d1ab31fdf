#pragma once
// shardtorch::nn::ParallelEmbedding: torch::nn::Embedding with its table split
// over a tensor-parallel group, the C++ twin of shardtorch.nn.ParallelEmbedding,
// over the op shard::parallel_embedding.
//
//   shardtorch::nn::ParallelEmbedding tokens(
//       shardtorch::nn::ParallelEmbeddingOptions(250000, 1024).dim(0));
//   auto x = tokens(ids);   // [*, 1024] on every rank
//
// dim 0: vocabulary-parallel, each rank holds a slice of the rows; indices of
//        other ranks' rows look up zeros and the group sums its outputs.
// dim 1: embedding-dim-parallel, each rank holds a slice of the columns; the
//        output is gathered on its last dim.
// Either way every rank returns the whole [*, embedding_dim] output, as
// torch::nn::Embedding does. A new layer holds exactly this rank's slice of
// what torch::nn::Embedding draws under the same torch::manual_seed (see
// nn/embedding_init.h). With max_norm the referenced rows are renormalised in
// place before the lookup (shard::parallel_embedding_renorm_); for dim 1 a
// row's norm spans all shards and is combined over the group.

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>

#include <shardtorch/distributed/init_options.h>
#include <shardtorch/nn/init.h>

namespace shardtorch {
namespace nn {

struct ParallelEmbeddingOptions {
  ParallelEmbeddingOptions(int64_t num_embeddings, int64_t embedding_dim)
      : num_embeddings_(num_embeddings), embedding_dim_(embedding_dim) {}

  TORCH_ARG(int64_t, num_embeddings);
  TORCH_ARG(int64_t, embedding_dim);
  // As torch::nn::EmbeddingOptions: a row that is zero and gets no gradient;
  // negative values count from the end.
  TORCH_ARG(std::optional<int64_t>, padding_idx) = std::nullopt;
  TORCH_ARG(std::optional<double>, max_norm) = std::nullopt;
  TORCH_ARG(double, norm_type) = 2.;
  TORCH_ARG(bool, scale_grad_by_freq) = false;
  TORCH_ARG(bool, sparse) = false;
  // 0 (vocabulary-parallel) or 1 (embedding-dim-parallel).
  TORCH_ARG(int64_t, dim) = 0;
  // The shardtorch group to split over.
  TORCH_ARG(std::string, group) = distributed::kTensorParallel;
};

class ParallelEmbeddingImpl : public torch::nn::Cloneable<ParallelEmbeddingImpl> {
 public:
  ParallelEmbeddingImpl(int64_t num_embeddings, int64_t embedding_dim)
      : ParallelEmbeddingImpl(ParallelEmbeddingOptions(num_embeddings, embedding_dim)) {}
  explicit ParallelEmbeddingImpl(const ParallelEmbeddingOptions& options_);

  // Checks the options, creates the shard-shaped weight and draws it.
  void reset() override;
  // Draws this rank's slice of torch::nn::Embedding's initialisation.
  void reset_parameters();

  void pretty_print(std::ostream& stream) const override;

  // input: integer indices of any shape; returns [*input.sizes(), embedding_dim].
  torch::Tensor forward(const torch::Tensor& input);

  ParallelEmbeddingOptions options;
  // [rows of this rank, embedding_dim] (dim 0) or [num_embeddings, columns of
  // this rank] (dim 1).
  torch::Tensor weight;
  int64_t group_rank = 0;
  int64_t group_size = 1;
  // Rows and columns of the full [num_embeddings, embedding_dim] table held here.
  Range row_range{0, 0};
  Range col_range{0, 0};
  // padding_idx normalised to [0, num_embeddings), as torch::nn::Embedding does.
  std::optional<int64_t> padding_idx;

 private:
  // The size of the split dimension of the full table.
  int64_t full_size() const;
};

TORCH_MODULE(ParallelEmbedding);

}  // namespace nn
}  // namespace shardtorch
