// Autograd of parallel_linear_cross_entropy, in C++ so that LibTorch programs
// train with it too, by the fused heads' protocol (fused_head_autograd.h):
// the gradients from shard::_parallel_linear_cross_entropy_forward_with_gradients
// scaled, or shard::_parallel_linear_cross_entropy_backward (chunks recomputed).
#include <torch/autograd.h>
#include <torch/library.h>

#include <tuple>

#include "ops/autograd/fused_head_autograd.h"
#include <shardtorch/ops/parallel_linear_cross_entropy.h>

namespace shardtorch {
namespace autograd {
namespace {

constexpr const char* kOp = "shard::parallel_linear_cross_entropy";
// ignore_index, label_smoothing, z_loss, reduction, chunk_size, group: what
// the backward op takes besides tensors.
using Arguments = std::tuple<int64_t, double, double, int64_t, int64_t, std::string>;

std::optional<at::Tensor> optional(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

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
    save_arguments(ctx,
                   Arguments(ignore_index, label_smoothing, z_loss, reduction, chunk_size, group));
    return fused_head_forward(
        ctx, weight, reduction, mask[0] || mask[1] || mask[2], /*gradient_count=*/3,
        [&]() -> LossAndSaved {
          auto [loss, unused_row_stats, grad_input, grad_weight, grad_bias] =
              ops::parallel_linear_cross_entropy_forward_with_gradients(
                  input, weight, bias, target, class_weight, ignore_index, label_smoothing, z_loss,
                  reduction, chunk_size, group, num_classes, mask);
          return {loss, {grad_input, grad_weight, grad_bias}};
        },
        [&]() -> LossAndSaved {
          auto [loss, row_stats] = ops::parallel_linear_cross_entropy_forward(
              input, weight, bias, target, class_weight, ignore_index, label_smoothing, z_loss,
              reduction, chunk_size, group, num_classes);
          return {loss,
                  {input, weight, bias.value_or(at::Tensor()), row_stats, target,
                   class_weight.value_or(at::Tensor())}};
        });
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return fused_head_backward(
        ctx, grads, 13, kOp,
        [ctx](const variable_list& saved, const at::Tensor& grad_loss, variable_list& result) {
          const std::array<bool, 3> mask{ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                                         saved[2].defined() && ctx->needs_input_grad(2)};
          if (!(mask[0] || mask[1] || mask[2])) return;
          const auto [ignore_index, label_smoothing, z_loss, reduction, chunk_size, group] =
              saved_arguments<Arguments>(ctx);
          std::tie(result[0], result[1], result[2]) = ops::parallel_linear_cross_entropy_backward(
              grad_loss, saved[0], saved[1], optional(saved[2]), saved[3], saved[4],
              optional(saved[5]), ignore_index, label_smoothing, z_loss, reduction, chunk_size,
              group, mask);
        });
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
  TORCH_CHECK(!(at::GradMode::is_enabled() && target.requires_grad()), kOp,
              ": the gradient with respect to a probability target is not supported; target "
              "requires grad (pass target.detach())");
  // Grad mode as the caller has it (forward runs with it off).
  return ParallelLinearCrossEntropyFunction::apply(
      input, weight, bias, target, class_weight, ignore_index, label_smoothing, z_loss, reduction,
      chunk_size, group, num_classes, at::GradMode::is_enabled());
}

}  // namespace

TORCH_LIBRARY_IMPL(shard, Autograd, m) {
  m.impl("parallel_linear_cross_entropy", TORCH_FN(parallel_linear_cross_entropy_autograd));
  register_internal_ops_without_autograd(m, "parallel_linear_cross_entropy");
}

}  // namespace autograd
}  // namespace shardtorch
