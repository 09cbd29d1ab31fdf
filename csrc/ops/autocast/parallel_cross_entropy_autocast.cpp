// Under torch.autocast the losses run in float32, as torch's own cross_entropy
// does: reduced-precision logits (or classifier inputs and weights) are cast
// up, the loss comes back float32, and the gradients flow back through the
// casts in the callers' dtypes.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/library.h>

#include <shardtorch/ops/parallel_cross_entropy.h>
#include <shardtorch/ops/parallel_linear_cross_entropy.h>

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
  return parallel_cross_entropy(to_float32(logits), target, to_float32(weight), ignore_index,
                                label_smoothing, z_loss, reduction, group, num_classes);
}

template <c10::DispatchKey AutocastKey>
at::Tensor linear_cross_entropy_autocast(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& target, const std::optional<at::Tensor>& class_weight, int64_t ignore_index,
    double label_smoothing, double z_loss, int64_t reduction, int64_t chunk_size,
    const std::string& group, std::optional<int64_t> num_classes) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(AutocastKey);
  return parallel_linear_cross_entropy(
      to_float32(input), to_float32(weight), to_float32(bias), target, to_float32(class_weight),
      ignore_index, label_smoothing, z_loss, reduction, chunk_size, group, num_classes);
}

}  // namespace

TORCH_LIBRARY_IMPL(shard, AutocastCPU, m) {
  m.impl("parallel_cross_entropy", TORCH_FN(cross_entropy_autocast<c10::DispatchKey::AutocastCPU>));
  m.impl("parallel_linear_cross_entropy",
         TORCH_FN(linear_cross_entropy_autocast<c10::DispatchKey::AutocastCPU>));
}

TORCH_LIBRARY_IMPL(shard, AutocastCUDA, m) {
  m.impl("parallel_cross_entropy",
         TORCH_FN(cross_entropy_autocast<c10::DispatchKey::AutocastCUDA>));
  m.impl("parallel_linear_cross_entropy",
         TORCH_FN(linear_cross_entropy_autocast<c10::DispatchKey::AutocastCUDA>));
}

}  // namespace ops
}  // namespace shardtorch
