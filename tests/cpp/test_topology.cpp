// Single-process unit tests: shard arithmetic, tensor-parallel topology, the
// exact chunked initialisation (bitwise equal to torch::nn::Linear), and the
// errors of init_process_group outside a launcher.
#include <shardtorch/shardtorch.h>

#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/utils.h>

#include <cstdlib>

#include "check.h"

namespace topo = shardtorch::topology;
using Ranks = std::vector<std::vector<int64_t>>;

static void test_shard_arithmetic() {
  EXPECT(topo::shard_sizes(10, 4) == (std::vector<int64_t>{3, 3, 2, 2}));
  EXPECT(topo::shard_offset(10, 4, 2) == 6);
  EXPECT(topo::shard_size(1000001, 8, 0) == 125001);
  EXPECT(topo::shard_size(1000001, 8, 7) == 125000);
  EXPECT(topo::shard_offset(1000001, 8, 7) + topo::shard_size(1000001, 8, 7) == 1000001);
  EXPECT(topo::shard_sizes(1, 3) == (std::vector<int64_t>{1, 0, 0}));
  int64_t total = 0;
  for (int64_t r = 0; r < 7; ++r) {
    EXPECT(topo::shard_offset(100, 7, r) == total);
    total += topo::shard_size(100, 7, r);
  }
  EXPECT(total == 100);
}

static void test_topology() {
  topo::TensorParallelTopology t(8, 5, 4);
  EXPECT(t.tensor_parallel_rank() == 1);
  EXPECT(t.data_parallel_rank() == 1);
  EXPECT(t.data_parallel_size() == 2);
  EXPECT(t.tensor_parallel_groups() == (Ranks{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  EXPECT(t.data_parallel_groups() == (Ranks{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT(t.tensor_parallel_group_ranks() == (std::vector<int64_t>{4, 5, 6, 7}));
  EXPECT(t.data_parallel_group_ranks() == (std::vector<int64_t>{1, 5}));
  topo::TensorParallelTopology single(1, 0, 1);
  EXPECT(single.tensor_parallel_groups() == (Ranks{{0}}));
  EXPECT_THROWS(topo::TensorParallelTopology(6, 0, 4), "group_size must divide the world size 6");
  EXPECT_THROWS(topo::TensorParallelTopology(4, 4, 2), "rank must be in [0, 4)");
}

// Each rank's shard, drawn alone under the same seed, is bitwise the slice of
// torch::nn::Linear's weight and bias, and leaves the generator where Linear does.
static void check_init_matches_linear(int64_t in, int64_t out, bool bias, int64_t parts) {
  torch::manual_seed(7);
  torch::nn::Linear reference(torch::nn::LinearOptions(in, out).bias(bias));
  const auto after_reference = torch::rand({3});
  for (int64_t rank = 0; rank < parts; ++rank) {
    for (int dim : {0, 1}) {
      const shardtorch::nn::Range out_range =
          dim == 1 ? shardtorch::nn::Range{topo::shard_offset(out, parts, rank),
                                           topo::shard_offset(out, parts, rank) +
                                               topo::shard_size(out, parts, rank)}
                   : shardtorch::nn::Range{0, out};
      const shardtorch::nn::Range in_range =
          dim == 0 ? shardtorch::nn::Range{topo::shard_offset(in, parts, rank),
                                           topo::shard_offset(in, parts, rank) +
                                               topo::shard_size(in, parts, rank)}
                   : shardtorch::nn::Range{0, in};
      auto weight =
          torch::empty({out_range.second - out_range.first, in_range.second - in_range.first});
      std::optional<at::Tensor> b;
      if (bias) b = torch::empty({dim == 1 ? out_range.second - out_range.first : out});
      torch::manual_seed(7);
      shardtorch::nn::init_linear_shard_(weight, b, in, out, out_range, in_range);
      const auto after_shard = torch::rand({3});
      const auto expected = reference->weight.slice(0, out_range.first, out_range.second)
                                .slice(1, in_range.first, in_range.second);
      EXPECT_MSG(torch::equal(weight, expected),
                 "weight in=" << in << " out=" << out << " rank=" << rank << " dim=" << dim);
      if (bias) {
        const auto expected_bias = dim == 1
                                       ? reference->bias.slice(0, out_range.first, out_range.second)
                                       : reference->bias;
        EXPECT_MSG(torch::equal(*b, expected_bias),
                   "bias in=" << in << " out=" << out << " rank=" << rank);
      }
      EXPECT_MSG(torch::equal(after_shard, after_reference), "generator state in=" << in);
    }
  }
}

static void test_init_matches_linear() {
  check_init_matches_linear(20, 11, true, 2);
  check_init_matches_linear(7, 5, false, 3);
  check_init_matches_linear(3, 1, true, 4);  // fewer features than ranks
  // Several chunks: 2^20 / 3000 = 349 rows per chunk.
  check_init_matches_linear(3000, 701, true, 3);
}

// Each rank's embedding shard, drawn alone under the same seed, is bitwise the
// slice of torch::nn::Embedding's table (padding row included), and leaves the
// generator where Embedding does. Small chunk sizes force many chunks, uneven
// 16-element blocks and the joined short tail.
static void check_init_matches_embedding(int64_t rows, int64_t cols, std::optional<int64_t> padding,
                                         int64_t parts, int64_t chunk_elements) {
  torch::manual_seed(9);
  torch::nn::Embedding reference(torch::nn::EmbeddingOptions(rows, cols).padding_idx(padding));
  const auto after_reference = torch::rand({3});
  for (int64_t rank = 0; rank < parts; ++rank) {
    for (int dim : {0, 1}) {
      const int64_t total = dim == 0 ? rows : cols;
      const shardtorch::nn::Range split{
          topo::shard_offset(total, parts, rank),
          topo::shard_offset(total, parts, rank) + topo::shard_size(total, parts, rank)};
      const auto row_range = dim == 0 ? split : shardtorch::nn::Range{0, rows};
      const auto col_range = dim == 1 ? split : shardtorch::nn::Range{0, cols};
      auto weight =
          torch::empty({row_range.second - row_range.first, col_range.second - col_range.first});
      std::optional<int64_t> normalised = padding;
      if (normalised && *normalised < 0) *normalised += rows;
      torch::manual_seed(9);
      shardtorch::nn::init_embedding_shard_(weight, rows, cols, row_range, col_range, normalised,
                                            chunk_elements);
      const auto after_shard = torch::rand({3});
      const auto expected = reference->weight.slice(0, row_range.first, row_range.second)
                                .slice(1, col_range.first, col_range.second);
      EXPECT_MSG(torch::equal(weight, expected),
                 "embedding rows=" << rows << " cols=" << cols << " rank=" << rank << " dim=" << dim
                                   << " chunk=" << chunk_elements);
      EXPECT_MSG(
          torch::equal(after_shard, after_reference),
          "generator state rows=" << rows << " cols=" << cols << " chunk=" << chunk_elements);
    }
  }
}

static void test_init_matches_embedding() {
  check_init_matches_embedding(11, 7, std::nullopt, 2, shardtorch::nn::kInitChunkElements);
  check_init_matches_embedding(3, 5, 1, 2, shardtorch::nn::kInitChunkElements);  // < 16 elements
  check_init_matches_embedding(2, 3, std::nullopt, 4, 1);  // tiny table, more ranks than rows
  check_init_matches_embedding(50, 7, -1, 3, 40);          // 7 columns: chunks of 32 rows
  check_init_matches_embedding(33, 16, 0, 2, 100);
  check_init_matches_embedding(35, 3, 0, 2, 48);  // a 9-element tail joins the chunk before
  check_init_matches_embedding(97, 6, 5, 4, 64);
  check_init_matches_embedding(5, 3, std::nullopt, 2, 16);  // 15 elements, one chunk
  // The default chunk: 2^20 / 701 -> 1488 rows per chunk.
  check_init_matches_embedding(3001, 701, 17, 3, shardtorch::nn::kInitChunkElements);
  EXPECT(shardtorch::nn::embedding_chunk_bounds(33, 16, 100) ==
         (std::vector<shardtorch::nn::Range>{
             {0, 6}, {6, 12}, {12, 18}, {18, 24}, {24, 30}, {30, 33}}));
  EXPECT(shardtorch::nn::embedding_chunk_bounds(35, 3, 48) ==
         (std::vector<shardtorch::nn::Range>{{0, 16}, {16, 35}}));
}

static void test_unsharded_layer_is_linear() {
  torch::manual_seed(3);
  torch::nn::Linear reference(torch::nn::LinearOptions(6, 4));
  torch::manual_seed(3);
  shardtorch::nn::ParallelLinear layer(6, 4);  // dim = nullopt: no group needed
  EXPECT(torch::equal(layer->weight, reference->weight));
  EXPECT(torch::equal(layer->bias, reference->bias));
  const auto x = torch::randn({5, 6});
  EXPECT(torch::allclose(layer(x), reference(x)));
  EXPECT(layer->parameters().size() == 2);
  EXPECT_THROWS(shardtorch::nn::ParallelLinear(shardtorch::nn::ParallelLinearOptions(6, 4).dim(2)),
                "ParallelLinear: dim must be nullopt, 0, 1 or -1, got 2");
}

static void test_errors_outside_a_launcher() {
  unsetenv("RANK");
  EXPECT_THROWS(shardtorch::distributed::init_process_group(),
                shardtorch::kBuiltWithGloo ? "environment variable RANK is not set"
                                           : "built without Gloo's C++ headers");
  EXPECT(!shardtorch::distributed::is_initialized());
  EXPECT(shardtorch::distributed::get_rank() == 0);
  EXPECT(shardtorch::distributed::get_world_size() == 1);
  EXPECT_THROWS(shardtorch::distributed::init_process_group(
                    shardtorch::distributed::InitOptions(2).backend("mpi")),
                "backend must be \"gloo\"");
  EXPECT_THROWS(shardtorch::nn::ParallelLinear(shardtorch::nn::ParallelLinearOptions(6, 4).dim(1)),
                "no process group is initialised");
}

int main() {
  test_shard_arithmetic();
  test_topology();
  test_init_matches_linear();
  test_init_matches_embedding();
  test_unsharded_layer_is_linear();
  test_errors_outside_a_launcher();
  return shardtorch_test::finish("test_topology");
}
