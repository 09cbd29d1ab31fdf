// Autograd of parallel_cross_entropy, in C++ so that LibTorch programs train
// with it too. Backward is the op shard::_parallel_cross_entropy_backward,
// which turns the forward's own logits buffer into the gradient in place: no
// new [rows, classes] memory.
#include <torch/autograd.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include <shardtorch/ops/parallel_cross_entropy.h>

namespace shardtorch {
namespace autograd {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::Function;
using torch::autograd::variable_list;

void save_options(AutogradContext* ctx, int64_t ignore_index, double label_smoothing, double z_loss,
                  int64_t reduction) {
  ctx->saved_data["ignore_index"] = ignore_index;
  ctx->saved_data["label_smoothing"] = label_smoothing;
  ctx->saved_data["z_loss"] = z_loss;
  ctx->saved_data["reduction"] = reduction;
}

class ParallelCrossEntropyFunction : public Function<ParallelCrossEntropyFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits,
                            const at::Tensor& target, const std::optional<at::Tensor>& weight,
                            int64_t ignore_index, double label_smoothing, double z_loss,
                            int64_t reduction, const std::string& group,
                            std::optional<int64_t> num_classes) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [loss, buffer, row_stats] =
        ops::parallel_cross_entropy_forward(logits, target, weight, ignore_index, label_smoothing,
                                            z_loss, reduction, group, num_classes);
    ctx->save_for_backward({buffer, row_stats, target, weight.value_or(at::Tensor())});
    ctx->saved_data["logits_sizes"] = logits.sizes().vec();
    save_options(ctx, ignore_index, label_smoothing, z_loss, reduction);
    return loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list result(9);
    if (!grads[0].defined() || !ctx->needs_input_grad(0)) return result;
    auto saved = ctx->get_saved_variables();
    // The buffer becomes the gradient in place, unless the graph is kept for
    // another backward (retain_graph=True, gradcheck): then a copy does, and
    // the saved logits stay intact for the next call.
    at::Tensor buffer = saved[0];
    if (torch::autograd::get_current_graph_task_keep_graph()) buffer = buffer.clone();
    const at::Tensor& weight = saved[3];
    ops::parallel_cross_entropy_backward(
        grads[0], buffer, saved[1], saved[2],
        weight.defined() ? std::optional<at::Tensor>(weight) : std::nullopt,
        ctx->saved_data["ignore_index"].toInt(), ctx->saved_data["label_smoothing"].toDouble(),
        ctx->saved_data["z_loss"].toDouble(), ctx->saved_data["reduction"].toInt());
    result[0] = buffer.view(ctx->saved_data["logits_sizes"].toIntVector());
    return result;
  }
};

at::Tensor parallel_cross_entropy_autograd(const at::Tensor& logits, const at::Tensor& target,
                                           const std::optional<at::Tensor>& weight,
                                           int64_t ignore_index, double label_smoothing,
                                           double z_loss, int64_t reduction,
                                           const std::string& group,
                                           std::optional<int64_t> num_classes) {
  // Decided before any collective, alike on every rank (the target's
  // requires_grad is the caller's, the same everywhere).
  TORCH_CHECK(!(at::GradMode::is_enabled() && target.requires_grad()),
              "shard::parallel_cross_entropy: the gradient with respect to a probability target "
              "is not supported; target requires grad (pass target.detach())");
  return ParallelCrossEntropyFunction::apply(logits, target, weight, ignore_index, label_smoothing,
                                             z_loss, reduction, group, num_classes);
}

}  // namespace

TORCH_LIBRARY_IMPL(shard, Autograd, m) {
  m.impl("parallel_cross_entropy", TORCH_FN(parallel_cross_entropy_autograd));
  // Internal ops: differentiate through the public ops, not these.
  m.impl("_parallel_cross_entropy_forward", torch::autograd::autogradNotImplementedFallback());
  m.impl("_parallel_cross_entropy_backward", torch::autograd::autogradNotImplementedFallback());
}

}  // namespace autograd
}  // namespace shardtorch
