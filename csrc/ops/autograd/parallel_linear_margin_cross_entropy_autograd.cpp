// Autograd of parallel_linear_margin_cross_entropy, in C++ so that LibTorch
// programs train with it too, by the fused heads' protocol
// (fused_head_autograd.h): the gradients from
// shard::_parallel_linear_margin_cross_entropy_forward_with_gradients scaled,
// or shard::_parallel_linear_margin_cross_entropy_backward (chunks recomputed).
// With sampled classes the weight's gradient is a sparse COO tensor holding
// the kept rows only (as torch.nn.Embedding(sparse=True) gives its dense
// weight): rows that were not kept have no gradient at all, not a zero one, so
// that an optimizer that honours row-sparse gradients leaves them and their
// state alone (shardtorch.optim).
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <tuple>

#include "ops/autograd/fused_head_autograd.h"
#include <shardtorch/ops/parallel_linear_margin_cross_entropy.h>

namespace shardtorch {
namespace autograd {
namespace {

constexpr const char* kOp = "shard::parallel_linear_margin_cross_entropy";
// scale, m1, m2, m3, easy_margin, ignore_index, label_smoothing, reduction,
// chunk_size, group: what the backward op takes besides tensors.
using Arguments = std::tuple<double, double, double, double, bool, int64_t, double, int64_t,
                             int64_t, std::string>;

// The kept classes are strictly increasing (the forward checked): the
// sparse gradient is coalesced as built.
at::Tensor kept_rows_gradient(const at::Tensor& grad, const at::Tensor& kept,
                              at::IntArrayRef weight_sizes) {
  return at::_sparse_coo_tensor_unsafe(kept.unsqueeze(0), grad, weight_sizes)._coalesced_(true);
}

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
    ctx->saved_data["weight_sizes"] = weight.sizes().vec();
    save_arguments(ctx, Arguments(scale, m1, m2, m3, easy_margin, ignore_index, label_smoothing,
                                  reduction, chunk_size, group));
    const std::array<bool, 2> mask{grad_mode && input.requires_grad(),
                                   grad_mode && weight.requires_grad()};
    // The kept classes come last either way: the weight's gradient is
    // row-sparse over them.
    const at::Tensor kept = sampled_classes.value_or(at::Tensor());
    return fused_head_forward(
        ctx, weight, reduction, mask[0] || mask[1], /*gradient_count=*/2,
        [&]() -> LossAndSaved {
          auto [loss, unused_row_stats, grad_input, grad_weight] =
              ops::parallel_linear_margin_cross_entropy_forward_with_gradients(
                  input, weight, target, scale, m1, m2, m3, easy_margin, ignore_index,
                  label_smoothing, reduction, sampled_classes, chunk_size, group, num_classes,
                  mask);
          return {loss, {grad_input, grad_weight, kept}};
        },
        [&]() -> LossAndSaved {
          auto [loss, row_stats] = ops::parallel_linear_margin_cross_entropy_forward(
              input, weight, target, scale, m1, m2, m3, easy_margin, ignore_index, label_smoothing,
              reduction, sampled_classes, chunk_size, group, num_classes);
          return {loss, {input, weight, row_stats, target, kept}};
        });
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // Read before the protocol scales the saved gradients in place (a later
    // read of the saved tensors would find them modified).
    const at::Tensor kept = ctx->get_saved_variables().back();
    variable_list result = fused_head_backward(
        ctx, grads, 16, kOp,
        [ctx](const variable_list& saved, const at::Tensor& grad_loss, variable_list& result) {
          const std::array<bool, 2> mask{ctx->needs_input_grad(0), ctx->needs_input_grad(1)};
          if (!(mask[0] || mask[1])) return;
          const auto [scale, m1, m2, m3, easy_margin, ignore_index, label_smoothing, reduction,
                      chunk_size, group] = saved_arguments<Arguments>(ctx);
          const at::Tensor& kept = saved.back();
          std::tie(result[0], result[1]) = ops::parallel_linear_margin_cross_entropy_backward(
              grad_loss, saved[0], saved[1], saved[2], saved[3], scale, m1, m2, m3, easy_margin,
              ignore_index, label_smoothing, reduction,
              kept.defined() ? std::optional<at::Tensor>(kept) : std::nullopt, chunk_size, group,
              mask);
        });
    if (result[1].defined() && kept.defined()) {
      result[1] =
          kept_rows_gradient(result[1], kept, ctx->saved_data["weight_sizes"].toIntVector());
    }
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
  register_internal_ops_without_autograd(m, "parallel_linear_margin_cross_entropy");
}

}  // namespace autograd
}  // namespace shardtorch
