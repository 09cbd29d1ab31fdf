#include <shardtorch/nn/init_staging.h>

#include <ATen/ATen.h>

#include <algorithm>

namespace shardtorch {
namespace nn {

void check_shard_shape(const at::Tensor& shard, Range row_range, Range col_range,
                       const char* what) {
  TORCH_CHECK(shard.dim() == 2 && shard.size(0) == row_range.second - row_range.first &&
                  shard.size(1) == col_range.second - col_range.first,
              what, ": weight must be [", row_range.second - row_range.first, ", ",
              col_range.second - col_range.first, "] for rows [", row_range.first, ", ",
              row_range.second, ") and columns [", col_range.first, ", ", col_range.second,
              "), got ", shard.sizes());
}

void copy_chunk_block(at::Tensor& shard, const at::Tensor& chunk, int64_t first, Range row_range,
                      Range col_range) {
  const int64_t last = first + chunk.size(0);
  const int64_t lo = std::max(first, row_range.first);
  const int64_t hi = std::min(last, row_range.second);
  if (lo >= hi) return;
  shard.slice(0, lo - row_range.first, hi - row_range.first)
      .copy_(chunk.slice(0, lo - first, hi - first).slice(1, col_range.first, col_range.second));
}

void fill_on_cpu(at::Tensor& param, const std::function<void(at::Tensor&)>& fill) {
  if (param.device().is_cpu()) {
    fill(param);
    return;
  }
  at::Tensor staged = at::empty(param.sizes(), param.options().device(at::kCPU));
  fill(staged);
  param.copy_(staged);
}

}  // namespace nn
}  // namespace shardtorch
