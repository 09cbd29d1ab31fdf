// Autograd of parallel_linear_cross_entropy, in C++ so that LibTorch programs
// train with it too. Either the forward computes the gradients too
// (shard::_parallel_linear_cross_entropy_forward_with_gradients) and backward
// scales them, or backward is the op
// shard::_parallel_linear_cross_entropy_backward (chunks recomputed).
#include <torch/autograd.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include "ops/autograd/gradients_in_forward.h"
#include <shardtorch/ops/parallel_linear_cross_entropy.h>

namespace shardtorch {
namespace autograd {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::Function;
using torch::autograd::variable_list;

class ParallelLinearCrossEntropyFunction : public Function<ParallelLinearCrossEntropyFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, const at::Tensor& target,
                            const std::optional<at::Tensor>& class_weight, int64_t ignore_index,
                            double label_smoothing, double z_loss, int64_t reduction,
                            int64_t chunk_size, const std::string& group,
                            std::optional<int64_t> num_classes, bool grad_mode) {
    at::AutoDispatchBelowADInplaceOrView guard;
    // Which gradients autograd will ask for: what needs_input_grad says in
    // backward (during forward it has no edges to ask when none is needed).
    const std::array<bool, 3> mask{
        grad_mode && input.requires_grad(), grad_mode && weight.requires_grad(),
        grad_mode && bias.has_value() && bias->defined() && bias->requires_grad()};
    if (ops::parallel_linear_cross_entropy_gradients_in_forward(weight, reduction,
                                                                mask[0] || mask[1] || mask[2])) {
      auto [loss, unused_row_stats, grad_input, grad_weight, grad_bias] =
          ops::parallel_linear_cross_entropy_forward_with_gradients(
              input, weight, bias, target, class_weight, ignore_index, label_smoothing, z_loss,
              reduction, chunk_size, group, num_classes, mask);
      ctx->save_for_backward({grad_input, grad_weight, grad_bias});
      ctx->saved_data["gradients_in_forward"] = true;
      return loss;
    }
    ctx->saved_data["gradients_in_forward"] = false;
    save_gemm_dtype(ctx);
    auto [loss, row_stats] = ops::parallel_linear_cross_entropy_forward(
        input, weight, bias, target, class_weight, ignore_index, label_smoothing, z_loss, reduction,
        chunk_size, group, num_classes);
    ctx->save_for_backward({input, weight, bias.value_or(at::Tensor()), row_stats, target,
                            class_weight.value_or(at::Tensor())});
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["label_smoothing"] = label_smoothing;
    ctx->saved_data["z_loss"] = z_loss;
    ctx->saved_data["reduction"] = reduction;
    ctx->saved_data["chunk_size"] = chunk_size;
    ctx->saved_data["group"] = group;
    return loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list result(13);
    auto saved = ctx->get_saved_variables();
    if (ctx->saved_data["gradients_in_forward"].toBool()) {
      scale_gradients_from_forward(result, saved, 3, grads[0],
                                   "shard::parallel_linear_cross_entropy");
      return result;
    }
    const at::Tensor& bias = saved[2];
    const at::Tensor& class_weight = saved[5];
    std::array<bool, 3> mask{ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                             bias.defined() && ctx->needs_input_grad(2)};
    if (!grads[0].defined() || !(mask[0] || mask[1] || mask[2])) return result;
    const ops::FusedHeadGemmDtypeGuard forward_gemms(saved_gemm_dtype(ctx));
    auto [grad_input, grad_weight, grad_bias] = ops::parallel_linear_cross_entropy_backward(
        grads[0], saved[0], saved[1],
        bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt, saved[3], saved[4],
        class_weight.defined() ? std::optional<at::Tensor>(class_weight) : std::nullopt,
        ctx->saved_data["ignore_index"].toInt(), ctx->saved_data["label_smoothing"].toDouble(),
        ctx->saved_data["z_loss"].toDouble(), ctx->saved_data["reduction"].toInt(),
        ctx->saved_data["chunk_size"].toInt(), ctx->saved_data["group"].toStringRef(), mask);
    result[0] = grad_input;
    result[1] = grad_weight;
    result[2] = grad_bias;
    return result;
  }
};

at::Tensor parallel_linear_cross_entropy_autograd(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& target, const std::optional<at::Tensor>& class_weight, int64_t ignore_index,
    double label_smoothing, double z_loss, int64_t reduction, int64_t chunk_size,
    const std::string& group, std::optional<int64_t> num_classes) {
  // Decided before any collective, alike on every rank (the target's
  // requires_grad is the caller's, the same everywhere): a probability target
  // gets no gradient, and leaving it out silently would be wrong.
  TORCH_CHECK(!(at::GradMode::is_enabled() && target.requires_grad()),
              "shard::parallel_linear_cross_entropy: the gradient with respect to a probability "
              "target is not supported; target requires grad (pass target.detach())");
  // Grad mode as the caller has it (forward runs with it off).
  return ParallelLinearCrossEntropyFunction::apply(
      input, weight, bias, target, class_weight, ignore_index, label_smoothing, z_loss, reduction,
      chunk_size, group, num_classes, at::GradMode::is_enabled());
}

}  // namespace

TORCH_LIBRARY_IMPL(shard, Autograd, m) {
  m.impl("parallel_linear_cross_entropy", TORCH_FN(parallel_linear_cross_entropy_autograd));
  // Internal ops: differentiate through the public op, not these.
  m.impl("_parallel_linear_cross_entropy_forward",
         torch::autograd::autogradNotImplementedFallback());
  m.impl("_parallel_linear_cross_entropy_backward",
         torch::autograd::autogradNotImplementedFallback());
  m.impl("_parallel_linear_cross_entropy_forward_with_gradients",
         torch::autograd::autogradNotImplementedFallback());
}

}  // namespace autograd
}  // namespace shardtorch
