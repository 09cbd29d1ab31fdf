#pragma once
// What the exact initialisers (init.h for Linear, embedding_init.h for
// Embedding) share: a shard is rows `row_range` and columns `col_range` of a
// full matrix that is drawn on the CPU generator chunk by chunk of whole rows,
// each rank keeping its block of each chunk.

#include <ATen/core/Tensor.h>

#include <functional>
#include <utility>

namespace shardtorch {
namespace nn {

// A half-open range [first, second) of rows or columns of the full matrix.
using Range = std::pair<int64_t, int64_t>;

// `shard` must be [row_range size, col_range size]; `what` names the caller.
void check_shard_shape(const at::Tensor& shard, Range row_range, Range col_range, const char* what);

// Copies the part of `chunk` (rows [first, first + chunk.size(0)) of the full
// matrix, all its columns) that falls in the shard's rows and columns into
// the shard (rows `row_range`, columns `col_range` of the full matrix).
void copy_chunk_block(at::Tensor& shard, const at::Tensor& chunk, int64_t first, Range row_range,
                      Range col_range);

// Runs `fill` on a CPU tensor holding `param`'s values (`param` itself when it
// is on the CPU) and copies the result to `param`: the CPU generator defines
// the values on every device, so a CUDA shard equals a CPU-built one, moved.
void fill_on_cpu(at::Tensor& param, const std::function<void(at::Tensor&)>& fill);

}  // namespace nn
}  // namespace shardtorch
