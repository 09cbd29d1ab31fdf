#include <shardtorch/nn/embedding_init.h>

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

namespace {

// The whole [rows, cols] table drawn chunk by chunk with normal_(mean, std),
// this shard's block kept.
void draw_normal_chunks(at::Tensor& target, int64_t rows, int64_t cols, Range row_range,
                        Range col_range, double mean, double std, int64_t chunk_elements) {
  for (const auto& [first, last] : embedding_chunk_bounds(rows, cols, chunk_elements)) {
    auto chunk = at::empty({last - first, cols}, at::TensorOptions().dtype(target.scalar_type()))
                     .normal_(mean, std);
    copy_chunk_block(target, chunk, first, row_range, col_range);
  }
}

}  // namespace

void init_normal_shard_(at::Tensor& weight, int64_t rows, int64_t cols, Range row_range,
                        Range col_range, double mean, double std, int64_t chunk_elements) {
  check_shard_shape(weight, row_range, col_range, "init_normal_shard_");
  c10::NoGradGuard no_grad;
  fill_on_cpu(weight, [&](at::Tensor& target) {
    draw_normal_chunks(target, rows, cols, row_range, col_range, mean, std, chunk_elements);
  });
}

void init_embedding_shard_(at::Tensor& weight, int64_t num_embeddings, int64_t embedding_dim,
                           Range row_range, Range col_range, std::optional<int64_t> padding_idx,
                           int64_t chunk_elements) {
  check_shard_shape(weight, row_range, col_range, "init_embedding_shard_");
  c10::NoGradGuard no_grad;
  fill_on_cpu(weight, [&](at::Tensor& target) {
    draw_normal_chunks(target, num_embeddings, embedding_dim, row_range, col_range, 0.0, 1.0,
                       chunk_elements);
    if (padding_idx.has_value() && row_range.first <= *padding_idx &&
        *padding_idx < row_range.second) {
      target.select(0, *padding_idx - row_range.first).fill_(0);
    }
  });
}

}  // namespace nn
}  // namespace shardtorch
