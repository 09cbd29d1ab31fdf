#include "ops/autograd/fused_head_autograd.h"

#include <ATen/FunctionalTensorWrapper.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/graph_task.h>

#include "ops/cross_entropy/gemm_precision.h"

namespace shardtorch {
namespace autograd {

bool gradients_in_forward(const at::Tensor& weight, int64_t reduction, bool any_gradient) {
  const auto type = weight.scalar_type();
  return reduction != 0 && (type == at::kFloat || type == at::kDouble) && any_gradient;
}

at::Tensor apply_upstream(const at::Tensor& gradient, const at::Tensor& grad_loss, bool in_place,
                          const char* op) {
  TORCH_CHECK(grad_loss.numel() == 1, op,
              ": the upstream gradient of a reduced loss must be one value, got shape ",
              grad_loss.sizes());
  // Not while torch.compile traces (the value is not known then).
  const bool traced = c10::impl::TorchDispatchModeTLS::any_modes_set() ||
                      grad_loss.unsafeGetTensorImpl()->is_python_dispatch() ||
                      at::functionalization::impl::isFunctionalTensor(grad_loss);
  if (!traced && grad_loss.is_cpu() && grad_loss.item<double>() == 1.0) return gradient;
  const at::Tensor factor = grad_loss.reshape({});
  return in_place ? gradient.mul_(factor) : gradient.mul(factor);
}

at::Tensor fused_head_forward(AutogradContext* ctx, const at::Tensor& weight, int64_t reduction,
                              bool any_gradient, int64_t gradient_count,
                              const std::function<LossAndSaved()>& with_gradients,
                              const std::function<LossAndSaved()>& loss_only) {
  const bool in_forward = gradients_in_forward(weight, reduction, any_gradient);
  ctx->saved_data["gradients_in_forward"] = in_forward;
  ctx->saved_data["gradient_count"] = gradient_count;
  // The GEMM dtype is a thread-local set for the forward's call only: the
  // backward sets it again for its own.
  const auto gemm = ops::fused_head_gemm_dtype_state;
  ctx->saved_data["gemm_dtype"] = gemm.has_value() ? static_cast<int64_t>(*gemm) : int64_t{-1};
  LossAndSaved out = in_forward ? with_gradients() : loss_only();
  ctx->save_for_backward(out.second);
  return out.first;
}

variable_list fused_head_backward(AutogradContext* ctx, const variable_list& grads, size_t inputs,
                                  const char* op, const Recompute& recompute) {
  variable_list result(inputs);
  const at::Tensor& grad_loss = grads[0];
  if (!grad_loss.defined()) return result;
  const variable_list saved = ctx->get_saved_variables();
  if (ctx->saved_data["gradients_in_forward"].toBool()) {
    // The gradients are constants of forward: their own derivatives are not
    // known here, and leaving them out would be a silent wrong answer.
    TORCH_CHECK(!at::GradMode::is_enabled(), op,
                ": differentiating its gradient (create_graph=True) is not supported");
    // Scaled in place unless the graph is kept for another backward.
    const bool in_place = !torch::autograd::get_current_graph_task_keep_graph();
    const int64_t count = ctx->saved_data["gradient_count"].toInt();
    for (int64_t i = 0; i < count; ++i) {
      if (saved[i].defined()) result[i] = apply_upstream(saved[i], grad_loss, in_place, op);
    }
    return result;
  }
  const int64_t gemm = ctx->saved_data["gemm_dtype"].toInt();
  const ops::FusedHeadGemmDtypeGuard forward_gemms(
      gemm < 0 ? std::nullopt : std::optional<at::ScalarType>(static_cast<at::ScalarType>(gemm)));
  recompute(saved, grad_loss, result);
  return result;
}

void register_internal_ops_without_autograd(torch::Library& m, const std::string& op) {
  for (const char* suffix : {"_forward", "_backward", "_forward_with_gradients"}) {
    m.impl(("_" + op + suffix).c_str(), torch::autograd::autogradNotImplementedFallback());
  }
}

}  // namespace autograd
}  // namespace shardtorch
