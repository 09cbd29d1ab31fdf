// Under torch.autocast parallel_linear_cross_entropy runs its three GEMMs
// (logits, input gradient, weight gradient) in the autocast dtype with float32
// accumulation, as torch's linear would (tensor cores on CUDA, AMX on CPU),
// and its statistics, loss and gradients' accumulation in float32, as torch's
// own cross_entropy does. The float32 weight passes through uncast: the op
// casts the input once and each chunk of the weight as it uses it
// (gemm_precision.h), so it still computes its gradients in forward and the
// weight's gradient is float32. Reduced-precision tensors are cast up to
// float32 (the gradients flow back through the casts in the callers' dtypes);
// float64 is left alone (cached_cast's rule) and runs in float64. A
// probability target follows the input to float32 (class indices pass).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <shardtorch/ops/parallel_linear_cross_entropy.h>

#include "ops/autocast/float32_casts.h"
#include "ops/cross_entropy/gemm_precision.h"

namespace shardtorch {
namespace ops {
namespace {

template <c10::DeviceType Device, c10::DispatchKey AutocastKey>
at::Tensor linear_cross_entropy_autocast(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& target, const std::optional<at::Tensor>& class_weight, int64_t ignore_index,
    double label_smoothing, double z_loss, int64_t reduction, int64_t chunk_size,
    const std::string& group, std::optional<int64_t> num_classes) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(AutocastKey);
  const FusedHeadGemmDtypeGuard gemms(
      fused_head_autocast_gemm_dtype(Device, reduced_autocast_dtype(Device)));
  return parallel_linear_cross_entropy(to_float32(input), to_float32(weight), to_float32(bias),
                                       to_float32(target), to_float32(class_weight), ignore_index,
                                       label_smoothing, z_loss, reduction, chunk_size, group,
                                       num_classes);
}

}  // namespace

TORCH_LIBRARY_IMPL(shard, AutocastCPU, m) {
  m.impl("parallel_linear_cross_entropy",
         TORCH_FN(
             (linear_cross_entropy_autocast<c10::DeviceType::CPU, c10::DispatchKey::AutocastCPU>)));
}

TORCH_LIBRARY_IMPL(shard, AutocastCUDA, m) {
  m.impl(
      "parallel_linear_cross_entropy",
      TORCH_FN(
          (linear_cross_entropy_autocast<c10::DeviceType::CUDA, c10::DispatchKey::AutocastCUDA>)));
}

}  // namespace ops
}  // namespace shardtorch
