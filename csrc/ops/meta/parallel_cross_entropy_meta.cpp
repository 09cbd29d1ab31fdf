// Shapes of the parallel_cross_entropy ops for FakeTensor / torch.compile. The argument checks are
// the real kernels' own (cross_entropy_checks.h); checks that need the group or the targets' values
// happen in the real kernels only.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/cross_entropy/cross_entropy_checks.h"

namespace shardtorch {
namespace ops {
namespace {

CrossEntropyOptions options_of(int64_t ignore_index, double label_smoothing, double z_loss,
                               int64_t reduction) {
  return CrossEntropyOptions{ignore_index, label_smoothing, z_loss, reduction};
}

at::Tensor row_stats_like(const at::Tensor& input) {
  return at::empty_symint(saved_row_stats_shape(leading_rows(input)),
                          input.options().dtype(at::kDouble));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_meta(
    const at::Tensor& logits, const at::Tensor& target, const std::optional<at::Tensor>& weight,
    int64_t ignore_index, double label_smoothing, double z_loss, int64_t reduction,
    const std::string& group, std::optional<int64_t> num_classes) {
  check_parallel_cross_entropy_args(logits, target, weight,
                                    options_of(ignore_index, label_smoothing, z_loss, reduction),
                                    "shard::parallel_cross_entropy");
  at::Tensor loss = at::empty_symint(cross_entropy_loss_shape(target, reduction), logits.options());
  at::Tensor buffer =
      at::empty_symint({leading_rows(logits), logits.sym_size(-1)}, logits.options());
  return {loss, buffer, row_stats_like(logits)};
}

at::Tensor loss_meta(const at::Tensor& logits, const at::Tensor& target,
                     const std::optional<at::Tensor>& weight, int64_t ignore_index,
                     double label_smoothing, double z_loss, int64_t reduction,
                     const std::string& group, std::optional<int64_t> num_classes) {
  return std::get<0>(forward_meta(logits, target, weight, ignore_index, label_smoothing, z_loss,
                                  reduction, group, num_classes));
}

void backward_meta(const at::Tensor& grad_loss, const at::Tensor& logits_buffer,
                   const at::Tensor& row_stats, const at::Tensor& target,
                   const std::optional<at::Tensor>& weight, int64_t ignore_index,
                   double label_smoothing, double z_loss, int64_t reduction) {
  check_cross_entropy_options(options_of(ignore_index, label_smoothing, z_loss, reduction),
                              "shard::_parallel_cross_entropy_backward");
}

}  // namespace

TORCH_LIBRARY_IMPL(shard, Meta, m) {
  m.impl("parallel_cross_entropy", TORCH_FN(loss_meta));
  m.impl("_parallel_cross_entropy_forward", TORCH_FN(forward_meta));
  m.impl("_parallel_cross_entropy_backward", TORCH_FN(backward_meta));
}

}  // namespace ops
}  // namespace shardtorch
