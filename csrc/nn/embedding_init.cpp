#include "nn/embedding_init.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <numeric>

namespace shardtorch {
namespace nn {
namespace {

// torch's CPU normal_ transforms uniforms 16 at a time.
constexpr int64_t kNormalBlock = 16;

}  // namespace

std::vector<Range> embedding_chunk_bounds(int64_t rows, int64_t cols, int64_t chunk_elements) {
  TORCH_CHECK(rows >= 0 && cols >= 0, "embedding_chunk_bounds: rows and cols must be >= 0, got ",
              rows, " and ", cols);
  TORCH_CHECK(chunk_elements >= 1, "embedding_chunk_bounds: chunk_elements must be >= 1, got ",
              chunk_elements);
  std::vector<Range> bounds;
  if (rows == 0) return bounds;
  if (rows * cols < kNormalBlock) {
    bounds.emplace_back(0, rows);
    return bounds;
  }
  // Rows per aligned unit: the fewest rows holding a multiple of 16 elements.
  const int64_t row_step = kNormalBlock / std::gcd(cols, kNormalBlock);
  const int64_t chunk_rows =
      std::max(row_step, (chunk_elements / std::max<int64_t>(cols, 1)) / row_step * row_step);
  for (int64_t first = 0; first < rows; first += chunk_rows) {
    bounds.emplace_back(first, std::min(rows, first + chunk_rows));
  }
  if (bounds.size() > 1 && (bounds.back().second - bounds.back().first) * cols < kNormalBlock) {
    // A tail shorter than one block would redraw elements of the chunk before
    // it: join them.
    const int64_t last = bounds.back().second;
    bounds.pop_back();
    bounds.back().second = last;
  }
  return bounds;
}

void init_embedding_shard_(at::Tensor& weight, int64_t num_embeddings, int64_t embedding_dim,
                           Range row_range, Range col_range, std::optional<int64_t> padding_idx,
                           int64_t chunk_elements) {
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == row_range.second - row_range.first &&
                  weight.size(1) == col_range.second - col_range.first,
              "init_embedding_shard_: weight must be [", row_range.second - row_range.first, ", ",
              col_range.second - col_range.first, "] for rows [", row_range.first, ", ",
              row_range.second, ") and columns [", col_range.first, ", ", col_range.second,
              "), got ", weight.sizes());
  c10::NoGradGuard no_grad;
  // The CPU generator defines the values, as in Python: draw into a CPU
  // buffer when the parameter lives elsewhere.
  const bool on_cpu = weight.device().is_cpu();
  at::Tensor target = on_cpu ? weight : at::empty(weight.sizes(), weight.options().device(at::kCPU));
  for (const auto& [first, last] : embedding_chunk_bounds(num_embeddings, embedding_dim, chunk_elements)) {
    auto chunk = at::empty({last - first, embedding_dim}, at::TensorOptions().dtype(weight.scalar_type()))
                     .normal_();
    const int64_t lo = std::max(first, row_range.first);
    const int64_t hi = std::min(last, row_range.second);
    if (lo < hi) {
      target.slice(0, lo - row_range.first, hi - row_range.first)
          .copy_(chunk.slice(0, lo - first, hi - first).slice(1, col_range.first, col_range.second));
    }
  }
  if (padding_idx.has_value() && row_range.first <= *padding_idx && *padding_idx < row_range.second) {
    target.select(0, *padding_idx - row_range.first).fill_(0);
  }
  if (!on_cpu) weight.copy_(target);
}

}  // namespace nn
}  // namespace shardtorch
