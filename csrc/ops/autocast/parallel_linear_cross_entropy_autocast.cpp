// Under torch.autocast parallel_linear_cross_entropy's statistics and loss run
// in float32, as torch's own cross_entropy does, and the gradients flow back
// through the casts in the callers' dtypes.
//
// On CUDA its chunk GEMMs run in the autocast dtype, as torch's linear would
// (tensor cores), with float32 accumulation, statistics and loss: the weight
// and bias are cast to the autocast dtype (cached for the region, like
// linear's), the input to float32 (the op casts it once for its GEMMs). On CPU
// it runs wholly in float32. A probability target follows the input to float32
// (class indices pass).
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/library.h>

#include <shardtorch/ops/parallel_linear_cross_entropy.h>

#include "ops/autocast/float32_casts.h"

namespace shardtorch {
namespace ops {
namespace {

template <c10::DispatchKey AutocastKey>
at::Tensor linear_cross_entropy_autocast(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& target, const std::optional<at::Tensor>& class_weight, int64_t ignore_index,
    double label_smoothing, double z_loss, int64_t reduction, int64_t chunk_size,
    const std::string& group, std::optional<int64_t> num_classes) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(AutocastKey);
  return parallel_linear_cross_entropy(to_float32(input), to_float32(weight), to_float32(bias),
                                       to_float32(target), to_float32(class_weight), ignore_index,
                                       label_smoothing, z_loss, reduction, chunk_size, group,
                                       num_classes);
}

// CUDA: GEMMs in the autocast dtype (float64 is left alone, cached_cast's
// rule), everything else in float32.
at::Tensor linear_cross_entropy_autocast_cuda(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& target, const std::optional<at::Tensor>& class_weight, int64_t ignore_index,
    double label_smoothing, double z_loss, int64_t reduction, int64_t chunk_size,
    const std::string& group, std::optional<int64_t> num_classes) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCUDA);
  const auto dtype = at::autocast::get_autocast_dtype(c10::DeviceType::CUDA);
  const at::Tensor x = to_float32(input);
  if (x.scalar_type() != at::kFloat || weight.scalar_type() == at::kDouble ||
      (bias.has_value() && bias->defined() && bias->scalar_type() == at::kDouble)) {
    // float64 stays out of autocast (cached_cast's rule): as on CPU.
    return parallel_linear_cross_entropy(
        x, to_float32(weight), to_float32(bias), to_float32(target), to_float32(class_weight),
        ignore_index, label_smoothing, z_loss, reduction, chunk_size, group, num_classes);
  }
  std::optional<at::Tensor> cast_bias;
  if (bias.has_value() && bias->defined()) {
    cast_bias = at::autocast::cached_cast(dtype, *bias, c10::DeviceType::CUDA);
  }
  return parallel_linear_cross_entropy(
      x, at::autocast::cached_cast(dtype, weight, c10::DeviceType::CUDA), cast_bias,
      to_float32(target), to_float32(class_weight), ignore_index, label_smoothing, z_loss,
      reduction, chunk_size, group, num_classes);
}

}  // namespace

TORCH_LIBRARY_IMPL(shard, AutocastCPU, m) {
  m.impl("parallel_linear_cross_entropy",
         TORCH_FN(linear_cross_entropy_autocast<c10::DispatchKey::AutocastCPU>));
}

TORCH_LIBRARY_IMPL(shard, AutocastCUDA, m) {
  m.impl("parallel_linear_cross_entropy", TORCH_FN(linear_cross_entropy_autocast_cuda));
}

}  // namespace ops
}  // namespace shardtorch
