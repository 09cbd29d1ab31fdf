// parallel_linear under torch.autocast: casts like aten::linear does (input,
// weight and bias to the autocast dtype of the device), so that a sharded
// layer inside an autocast region takes the low-precision activations of the
// layers before it instead of refusing them for a dtype mismatch with its
// float32 weight. float64 and non-floating tensors are left alone
// (cached_cast's eligibility rule), as for ATen's own ops.
#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <shardtorch/ops/parallel_linear.h>

namespace shardtorch {
namespace ops {
namespace {

template <c10::DeviceType device_type, c10::DispatchKey autocast_key>
at::Tensor parallel_linear_autocast(const at::Tensor& input, const at::Tensor& weight,
                                    const std::optional<at::Tensor>& bias,
                                    std::optional<int64_t> dim, const std::string& group) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(autocast_key);
  const auto dtype = at::autocast::get_autocast_dtype(device_type);
  std::optional<at::Tensor> cast_bias;
  if (bias.has_value() && bias->defined()) {
    cast_bias = at::autocast::cached_cast(dtype, *bias, device_type);
  }
  return parallel_linear(at::autocast::cached_cast(dtype, input, device_type),
                         at::autocast::cached_cast(dtype, weight, device_type), cast_bias, dim,
                         group);
}

}  // namespace

TORCH_LIBRARY_IMPL(shard, AutocastCPU, m) {
  m.impl("parallel_linear",
         TORCH_FN((parallel_linear_autocast<c10::DeviceType::CPU, c10::DispatchKey::AutocastCPU>)));
}

TORCH_LIBRARY_IMPL(shard, AutocastCUDA, m) {
  m.impl(
      "parallel_linear",
      TORCH_FN((parallel_linear_autocast<c10::DeviceType::CUDA, c10::DispatchKey::AutocastCUDA>)));
}

}  // namespace ops
}  // namespace shardtorch
