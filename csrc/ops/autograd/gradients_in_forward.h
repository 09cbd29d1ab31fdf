#pragma once
// The backward of a fused loss whose forward computed its gradients (the
// fused linear cross-entropy and the margin loss): each saved gradient times
// the upstream gradient of the scalar loss.

#include <torch/autograd.h>
#include <torch/csrc/autograd/graph_task.h>

#include <shardtorch/ops/parallel_linear_cross_entropy.h>

#include "ops/cross_entropy/gemm_precision.h"

namespace shardtorch {
namespace autograd {

// result[i] = saved[i] * grad_loss for the first `count` saved gradients
// that are defined; nothing where grad_loss is undefined.
inline void scale_gradients_from_forward(torch::autograd::variable_list& result,
                                         const torch::autograd::variable_list& saved, int count,
                                         const at::Tensor& grad_loss, const char* op) {
  if (!grad_loss.defined()) return;
  // The gradients are constants of forward: their own derivatives are not
  // known here, and leaving them out would be a silent wrong answer.
  TORCH_CHECK(!at::GradMode::is_enabled(), op,
              ": differentiating its gradient (create_graph=True) is not supported");
  // Scaled in place unless the graph is kept for another backward.
  const bool in_place = !torch::autograd::get_current_graph_task_keep_graph();
  for (int i = 0; i < count; ++i) {
    if (saved[i].defined()) {
      result[i] = ops::parallel_linear_cross_entropy_apply_upstream(saved[i], grad_loss, in_place);
    }
  }
}

// A backward that recomputes the logits runs its GEMMs in the dtype the
// forward's ran in: under autocast the saved statistics come from the
// reduced-precision logits, and logits recomputed in float32 against them
// make softmax rows that do not sum to one. The dtype is a thread-local set
// for the forward's call only (gemm_precision.h): the forward records it,
// the backward sets it again for its own call.
inline void save_gemm_dtype(torch::autograd::AutogradContext* ctx) {
  const auto dtype = ops::fused_head_gemm_dtype_state;
  ctx->saved_data["gemm_dtype"] = dtype.has_value() ? static_cast<int64_t>(*dtype) : int64_t{-1};
}

inline std::optional<at::ScalarType> saved_gemm_dtype(torch::autograd::AutogradContext* ctx) {
  const int64_t dtype = ctx->saved_data["gemm_dtype"].toInt();
  if (dtype < 0) return std::nullopt;
  return static_cast<at::ScalarType>(dtype);
}

}  // namespace autograd
}  // namespace shardtorch
