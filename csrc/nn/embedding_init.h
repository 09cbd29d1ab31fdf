#pragma once
// Initialising an embedding shard exactly as torch::nn::Embedding (and
// torch.nn.Embedding) would, without ever holding the full table: the twin of
// shardtorch/nn/embedding_init.py.
//
// Embedding draws its weight with normal_ on the CPU generator. For a
// contiguous tensor of at least 16 elements, torch's CPU kernel fills every
// element with a uniform number in order, turns each aligned block of 16 into
// normals (Box-Muller) and, when the size is not a multiple of 16, draws 16
// fresh uniforms for the last 16 elements. Drawing the table in chunks gives
// the same numbers, bitwise, if and only if every chunk but the last holds a
// multiple of 16 elements (the blocks stay aligned) and the last holds at
// least 16 (its tail redraw is the table's). Tables of fewer than 16 elements
// take torch's element-by-element path: they are drawn whole.
//
// Each rank draws the whole table chunk by chunk (the generator cannot skip
// ahead) and keeps its slice: the generator ends where Embedding leaves it and
// the peak extra memory is one chunk of about `chunk_elements` elements.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <vector>

#include <shardtorch/nn/init.h>

namespace shardtorch {
namespace nn {

// Row ranges [first, last) of a [rows, cols] table whose element counts keep
// torch's 16-element blocks aligned (see above), about chunk_elements each.
std::vector<Range> embedding_chunk_bounds(int64_t rows, int64_t cols,
                                          int64_t chunk_elements = kInitChunkElements);

// Fills `weight` (rows `row_range`, columns `col_range` of the full
// [num_embeddings, embedding_dim] table) as torch::nn::Embedding does, the
// row `padding_idx` (a global, normalised index) zeroed. Draws on the CPU
// generator, so a CUDA shard equals a CPU-built Embedding, moved.
void init_embedding_shard_(at::Tensor& weight, int64_t num_embeddings, int64_t embedding_dim,
                           Range row_range, Range col_range,
                           std::optional<int64_t> padding_idx = std::nullopt,
                           int64_t chunk_elements = kInitChunkElements);

// Fills `weight` (rows `row_range`, columns `col_range`) as
// torch::empty({rows, cols}).normal_(mean, std) on the CPU generator would fill
// the whole table (the same chunked draw as an Embedding's): the
// initialisation of a margin loss's class weights (PartialFC's
// normal_(0, 0.01)), sliced.
void init_normal_shard_(at::Tensor& weight, int64_t rows, int64_t cols, Range row_range,
                        Range col_range, double mean, double std,
                        int64_t chunk_elements = kInitChunkElements);

}  // namespace nn
}  // namespace shardtorch
