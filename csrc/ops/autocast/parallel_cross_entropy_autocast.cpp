// Under torch.autocast parallel_cross_entropy runs in float32, as torch's own
// cross_entropy does: reduced-precision logits are cast up, the loss comes
// back float32, and the gradients flow back through the casts in the callers'
// dtypes.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <shardtorch/ops/parallel_cross_entropy.h>

#include "ops/autocast/float32_casts.h"

namespace shardtorch {
namespace ops {
namespace {

template <c10::DispatchKey AutocastKey>
at::Tensor cross_entropy_autocast(const at::Tensor& logits, const at::Tensor& target,
                                  const std::optional<at::Tensor>& weight, int64_t ignore_index,
                                  double label_smoothing, double z_loss, int64_t reduction,
                                  const std::string& group, std::optional<int64_t> num_classes) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(AutocastKey);
  // A probability target follows the logits to float32 (class indices pass).
  return parallel_cross_entropy(to_float32(logits), to_float32(target), to_float32(weight),
                                ignore_index, label_smoothing, z_loss, reduction, group,
                                num_classes);
}

}  // namespace

TORCH_LIBRARY_IMPL(shard, AutocastCPU, m) {
  m.impl("parallel_cross_entropy", TORCH_FN(cross_entropy_autocast<c10::DispatchKey::AutocastCPU>));
}

TORCH_LIBRARY_IMPL(shard, AutocastCUDA, m) {
  m.impl("parallel_cross_entropy",
         TORCH_FN(cross_entropy_autocast<c10::DispatchKey::AutocastCUDA>));
}

}  // namespace ops
}  // namespace shardtorch
