// Under torch.autocast the margin loss runs its three GEMMs (logits, input
// gradient, weight gradient) in the autocast dtype, and everything else in
// float32 as the other losses do: the normalisations, the softmax statistics,
// the margin's trigonometry (float64 for the targets' cosines) and the
// gradients' accumulation. A float32 weight passes through uncast (the op
// casts each chunk of unit rows for its GEMMs, gemm_precision.h), so its
// gradient, dense or row-sparse, reaches the parameter as it is; a
// reduced-precision embedding or weight is cast up, the loss comes back
// float32, and the gradients flow back through the casts in the callers'
// dtypes.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <shardtorch/ops/parallel_linear_margin_cross_entropy.h>

#include "ops/autocast/float32_casts.h"
#include "ops/cross_entropy/gemm_precision.h"

namespace shardtorch {
namespace ops {
namespace {

// The float32 copy of a float16/bfloat16 class weight. aten's cast (_to_copy)
// converts its gradient back to the weight's layout as well as its dtype, and
// with sampled classes that gradient is row-sparse (COO): ToCopyBackward
// cannot turn it strided. This cast gives back the gradient's dtype only, so
// the row-sparse gradient reaches the parameter row-sparse.
class Float32CastKeepingGradientLayout
    : public torch::autograd::Function<Float32CastKeepingGradientLayout> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& weight) {
    ctx->saved_data["dtype"] = static_cast<int64_t>(weight.scalar_type());
    return weight.to(at::kFloat);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    return {grads[0].defined() ? grads[0].to(dtype) : at::Tensor()};
  }
};

at::Tensor weight_to_float32(const at::Tensor& weight) {
  if (weight.scalar_type() != at::kHalf && weight.scalar_type() != at::kBFloat16) return weight;
  return Float32CastKeepingGradientLayout::apply(weight);
}

template <c10::DeviceType Device, c10::DispatchKey AutocastKey>
at::Tensor margin_cross_entropy_autocast(
    const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target, double scale,
    double m1, double m2, double m3, bool easy_margin, int64_t ignore_index, double label_smoothing,
    int64_t reduction, const std::optional<at::Tensor>& sampled_classes, int64_t chunk_size,
    const std::string& group, std::optional<int64_t> num_classes) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(AutocastKey);
  const FusedHeadGemmDtypeGuard gemms(
      fused_head_autocast_gemm_dtype(Device, reduced_autocast_dtype(Device)));
  return parallel_linear_margin_cross_entropy(
      to_float32(input), weight_to_float32(weight), target, scale, m1, m2, m3, easy_margin,
      ignore_index, label_smoothing, reduction, sampled_classes, chunk_size, group, num_classes);
}

}  // namespace

TORCH_LIBRARY_IMPL(shard, AutocastCPU, m) {
  m.impl("parallel_linear_margin_cross_entropy",
         TORCH_FN(
             (margin_cross_entropy_autocast<c10::DeviceType::CPU, c10::DispatchKey::AutocastCPU>)));
}

TORCH_LIBRARY_IMPL(shard, AutocastCUDA, m) {
  m.impl(
      "parallel_linear_margin_cross_entropy",
      TORCH_FN(
          (margin_cross_entropy_autocast<c10::DeviceType::CUDA, c10::DispatchKey::AutocastCUDA>)));
}

}  // namespace ops
}  // namespace shardtorch
