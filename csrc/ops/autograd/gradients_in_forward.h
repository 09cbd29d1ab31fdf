#pragma once
// The backward of a fused loss whose forward computed its gradients (the
// fused linear cross-entropy and the margin loss): each saved gradient times
// the upstream gradient of the scalar loss.

#include <torch/autograd.h>
#include <torch/csrc/autograd/graph_task.h>

#include <shardtorch/ops/parallel_linear_cross_entropy.h>

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

}  // namespace autograd
}  // namespace shardtorch
