#include "ops/cross_entropy/parallel_cross_entropy_impl.h"

#include <ATen/ATen.h>

#include "ops/cross_entropy/cross_entropy_statistics.h"

namespace shardtorch {
namespace ops {
namespace {
constexpr const char* kCrossEntropyForward = "shard::parallel_cross_entropy";
constexpr const char* kCrossEntropyBackward = "shard::_parallel_cross_entropy_backward";
}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> parallel_cross_entropy_forward_impl(
    const at::Tensor& logits, const at::Tensor& target, const std::optional<at::Tensor>& weight,
    const CrossEntropyOptions& options, const std::string& group,
    std::optional<int64_t> num_classes, const CrossEntropyKernels& kernels) {
  check_parallel_cross_entropy_args(logits, target, weight, options, kCrossEntropyForward);
  const int64_t rows = leading_rows(logits).guard_int(__FILE__, __LINE__);
  const int64_t local = logits.size(-1);
  const CrossEntropyForwardSetup setup =
      prepare_cross_entropy_forward(group, logits.device(), logits.scalar_type(), local,
                                    num_classes, target, weight, options, kCrossEntropyForward);

  // The caller's logits are only read: the buffer is the op's own copy,
  // written in the pass that computes the statistics.
  const at::Tensor x = logits.reshape({rows, local}).contiguous();
  at::Tensor buffer = at::empty({rows, local}, logits.options());
  at::Tensor stats = fresh_row_stats(rows, setup, logits.device());
  if (setup.check.code == LocalCheck::kOk) {
    kernels.accumulate_row_stats(x, 0, setup.target_local, setup.target_probs, setup.weight_local,
                                 stats, buffer);
  }
  at::Tensor saved = combine_over_group(setup, stats, options, kCrossEntropyForward);
  at::Tensor loss = reduce_loss(saved, target, options, logits.scalar_type());
  return {loss, buffer, saved};
}

void parallel_cross_entropy_backward_impl(const at::Tensor& grad_loss,
                                          const at::Tensor& logits_buffer,
                                          const at::Tensor& row_stats, const at::Tensor& target,
                                          const std::optional<at::Tensor>& weight,
                                          const CrossEntropyOptions& options,
                                          const CrossEntropyKernels& kernels) {
  TORCH_CHECK(logits_buffer.dim() == 2 && logits_buffer.is_contiguous(), kCrossEntropyBackward,
              ": logits_buffer must be the contiguous [rows, local_classes] buffer of the "
              "forward, got shape ",
              logits_buffer.sizes());
  const int64_t rows = logits_buffer.size(0), local = logits_buffer.size(1);
  check_saved_row_stats(row_stats, rows, kCrossEntropyBackward);
  const CrossEntropyBackwardSetup setup = prepare_cross_entropy_backward(
      grad_loss, row_stats, target, weight, options, local,
      cross_entropy_accumulate_type(logits_buffer.scalar_type()), kCrossEntropyBackward);
  kernels.softmax_grad_inplace(logits_buffer, 0, setup.target_local, setup.target_probs,
                               setup.weight_local, setup.coefs);
}

}  // namespace ops
}  // namespace shardtorch
