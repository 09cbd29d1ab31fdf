#include <shardtorch/nn/init.h>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>

namespace shardtorch {
namespace nn {
namespace {

// Draws a [rows, cols] uniform(-bound, bound) matrix chunk by chunk and copies
// its [row_range, col_range] block into `out`.
void draw_rows_into(at::Tensor out, int64_t rows, int64_t cols, double bound, Range row_range,
                    Range col_range, int64_t chunk_elements) {
  if (rows == 0 || cols == 0) return;
  const int64_t chunk_rows = std::max<int64_t>(1, chunk_elements / std::max<int64_t>(cols, 1));
  for (int64_t first = 0; first < rows; first += chunk_rows) {
    const int64_t last = std::min(rows, first + chunk_rows);
    auto chunk = at::empty({last - first, cols}, at::TensorOptions().dtype(out.scalar_type()))
                     .uniform_(-bound, bound);
    copy_chunk_block(out, chunk, first, row_range, col_range);
  }
}

}  // namespace

LinearBounds linear_bounds(int64_t in_features) {
  // The arithmetic of torch::nn::init::kaiming_uniform_(w, sqrt(5)) and of
  // torch.nn.init, step by step, so the doubles (and the draws) agree bitwise.
  const double gain = std::sqrt(2.0 / (1 + std::pow(std::sqrt(5.0), 2)));
  const double std_dev = in_features > 0 ? gain / std::sqrt(static_cast<double>(in_features)) : 0.0;
  LinearBounds bounds;
  bounds.weight = std::sqrt(3.0) * std_dev;
  bounds.bias = in_features > 0 ? 1 / std::sqrt(static_cast<double>(in_features)) : 0.0;
  return bounds;
}

void init_linear_shard_(at::Tensor& weight, const std::optional<at::Tensor>& bias,
                        int64_t in_features, int64_t out_features, Range out_range, Range in_range,
                        int64_t chunk_elements) {
  TORCH_CHECK(chunk_elements >= 1, "init_linear_shard_: chunk_elements must be >= 1, got ",
              chunk_elements);
  check_shard_shape(weight, out_range, in_range, "init_linear_shard_");
  c10::NoGradGuard no_grad;
  const auto bounds = linear_bounds(in_features);
  fill_on_cpu(weight, [&](at::Tensor& w) {
    draw_rows_into(w, out_features, in_features, bounds.weight, out_range, in_range,
                   chunk_elements);
  });
  if (bias.has_value() && bias->defined()) {
    at::Tensor b = *bias;
    const Range bias_range = b.numel() == out_features ? Range{0, out_features} : out_range;
    TORCH_CHECK(b.numel() == bias_range.second - bias_range.first,
                "init_linear_shard_: bias must have ", bias_range.second - bias_range.first,
                " elements, got ", b.numel());
    fill_on_cpu(b, [&](at::Tensor& staged) {
      draw_rows_into(staged.view({-1, 1}), out_features, 1, bounds.bias, bias_range, Range{0, 1},
                     chunk_elements);
    });
  }
}

}  // namespace nn
}  // namespace shardtorch
