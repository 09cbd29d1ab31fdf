// Autograd of parallel_linear_margin_cross_entropy, in C++ so that LibTorch
// programs train with it too. Either the forward computes the gradients too
// (shard::_parallel_linear_margin_cross_entropy_forward_with_gradients) and
// backward scales them, or backward is the op
// shard::_parallel_linear_margin_cross_entropy_backward (chunks recomputed).
// With sampled classes the weight's gradient is a sparse COO tensor holding
// the kept rows only (as torch.nn.Embedding(sparse=True) gives its dense
// weight): rows that were not kept have no gradient at all, not a zero one, so
// that an optimizer that honours row-sparse gradients leaves them and their
// state alone (shardtorch.optim).
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include "ops/autograd/gradients_in_forward.h"
#include <shardtorch/ops/parallel_linear_margin_cross_entropy.h>

namespace shardtorch {
namespace autograd {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::Function;
using torch::autograd::variable_list;

class ParallelLinearMarginCrossEntropyFunction
    : public Function<ParallelLinearMarginCrossEntropyFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const at::Tensor& target, double scale, double m1, double m2, double m3,
                            bool easy_margin, int64_t ignore_index, double label_smoothing,
                            int64_t reduction, const std::optional<at::Tensor>& sampled_classes,
                            int64_t chunk_size, const std::string& group,
                            std::optional<int64_t> num_classes, bool grad_mode) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->saved_data["reduction"] = reduction;
    ctx->saved_data["weight_sizes"] = weight.sizes().vec();
    const std::array<bool, 2> mask{grad_mode && input.requires_grad(),
                                   grad_mode && weight.requires_grad()};
    if (ops::parallel_linear_cross_entropy_gradients_in_forward(weight, reduction,
                                                                mask[0] || mask[1])) {
      auto [loss, unused_row_stats, grad_input, grad_weight] =
          ops::parallel_linear_margin_cross_entropy_forward_with_gradients(
              input, weight, target, scale, m1, m2, m3, easy_margin, ignore_index, label_smoothing,
              reduction, sampled_classes, chunk_size, group, num_classes, mask);
      ctx->save_for_backward({grad_input, grad_weight, sampled_classes.value_or(at::Tensor())});
      ctx->saved_data["gradients_in_forward"] = true;
      return loss;
    }
    ctx->saved_data["gradients_in_forward"] = false;
    save_gemm_dtype(ctx);
    auto [loss, row_stats] = ops::parallel_linear_margin_cross_entropy_forward(
        input, weight, target, scale, m1, m2, m3, easy_margin, ignore_index, label_smoothing,
        reduction, sampled_classes, chunk_size, group, num_classes);
    ctx->save_for_backward(
        {input, weight, row_stats, target, sampled_classes.value_or(at::Tensor())});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["m1"] = m1;
    ctx->saved_data["m2"] = m2;
    ctx->saved_data["m3"] = m3;
    ctx->saved_data["easy_margin"] = easy_margin;
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["label_smoothing"] = label_smoothing;
    ctx->saved_data["chunk_size"] = chunk_size;
    ctx->saved_data["group"] = group;
    return loss;
  }

  // The kept classes are strictly increasing (the forward checked): the
  // sparse gradient is coalesced as built.
  static at::Tensor kept_rows_gradient(const at::Tensor& grad, const at::Tensor& kept,
                                       at::IntArrayRef weight_sizes) {
    return at::_sparse_coo_tensor_unsafe(kept.unsqueeze(0), grad, weight_sizes)._coalesced_(true);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list result(16);
    if (ctx->saved_data["gradients_in_forward"].toBool()) {
      auto saved = ctx->get_saved_variables();
      scale_gradients_from_forward(result, saved, 2, grads[0],
                                   "shard::parallel_linear_margin_cross_entropy");
      if (result[1].defined() && saved[2].defined()) {
        result[1] =
            kept_rows_gradient(result[1], saved[2], ctx->saved_data["weight_sizes"].toIntVector());
      }
      return result;
    }
    std::array<bool, 2> mask{ctx->needs_input_grad(0), ctx->needs_input_grad(1)};
    if (!grads[0].defined() || !(mask[0] || mask[1])) return result;
    auto saved = ctx->get_saved_variables();
    const at::Tensor& weight = saved[1];
    const at::Tensor& kept = saved[4];
    const auto& d = ctx->saved_data;
    const ops::FusedHeadGemmDtypeGuard forward_gemms(saved_gemm_dtype(ctx));
    auto [grad_input, grad_weight] = ops::parallel_linear_margin_cross_entropy_backward(
        grads[0], saved[0], weight, saved[2], saved[3], d.at("scale").toDouble(),
        d.at("m1").toDouble(), d.at("m2").toDouble(), d.at("m3").toDouble(),
        d.at("easy_margin").toBool(), d.at("ignore_index").toInt(),
        d.at("label_smoothing").toDouble(), d.at("reduction").toInt(),
        kept.defined() ? std::optional<at::Tensor>(kept) : std::nullopt, d.at("chunk_size").toInt(),
        d.at("group").toStringRef(), mask);
    result[0] = grad_input;
    if (grad_weight.defined() && kept.defined()) {
      grad_weight = kept_rows_gradient(grad_weight, kept, weight.sizes());
    }
    result[1] = grad_weight;
    return result;
  }
};

at::Tensor parallel_linear_margin_cross_entropy_autograd(
    const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target, double scale,
    double m1, double m2, double m3, bool easy_margin, int64_t ignore_index, double label_smoothing,
    int64_t reduction, const std::optional<at::Tensor>& sampled_classes, int64_t chunk_size,
    const std::string& group, std::optional<int64_t> num_classes) {
  return ParallelLinearMarginCrossEntropyFunction::apply(
      input, weight, target, scale, m1, m2, m3, easy_margin, ignore_index, label_smoothing,
      reduction, sampled_classes, chunk_size, group, num_classes, at::GradMode::is_enabled());
}

}  // namespace

TORCH_LIBRARY_IMPL(shard, Autograd, m) {
  m.impl("parallel_linear_margin_cross_entropy",
         TORCH_FN(parallel_linear_margin_cross_entropy_autograd));
  // Internal ops: differentiate through the public op, not these.
  m.impl("_parallel_linear_margin_cross_entropy_forward",
         torch::autograd::autogradNotImplementedFallback());
  m.impl("_parallel_linear_margin_cross_entropy_backward",
         torch::autograd::autogradNotImplementedFallback());
  m.impl("_parallel_linear_margin_cross_entropy_forward_with_gradients",
         torch::autograd::autogradNotImplementedFallback());
}

}  // namespace autograd
}  // namespace shardtorch
