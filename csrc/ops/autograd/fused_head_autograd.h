#pragma once
// The autograd protocol both fused heads follow (the linear cross-entropy and
// the margin loss): gradients in forward, or recomputed in backward.
//
// Where the loss is a scalar (reduction mean or sum), the classifier float32
// or float64 and a gradient is needed, the forward computes the gradients for
// an upstream gradient of 1 and the backward multiplies them by the one it
// gets (gradients_in_forward). Otherwise the forward computes the loss only
// and the backward op recomputes the logits chunk by chunk, its GEMMs in the
// dtype the forward's ran in (gemm_precision.h: under autocast the saved
// statistics came from the reduced-precision logits).

#include <ATen/core/List.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <functional>
#include <string>
#include <tuple>
#include <utility>

namespace shardtorch {
namespace autograd {

// The names a fused head's Function is written in.
using torch::autograd::AutogradContext;
using torch::autograd::Function;
using torch::autograd::variable_list;

// A Function's non-tensor arguments (a std::tuple) kept for its backward.
template <typename Arguments>
void save_arguments(torch::autograd::AutogradContext* ctx, const Arguments& arguments) {
  c10::impl::GenericList list(c10::AnyType::get());
  std::apply([&](const auto&... a) { (list.push_back(c10::IValue(a)), ...); }, arguments);
  ctx->saved_data["arguments"] = list;
}

template <typename Arguments, size_t... I>
Arguments unpack_arguments(const c10::List<c10::IValue>& list, std::index_sequence<I...>) {
  return Arguments(list.get(I).template to<std::tuple_element_t<I, Arguments>>()...);
}

template <typename Arguments>
Arguments saved_arguments(torch::autograd::AutogradContext* ctx) {
  return unpack_arguments<Arguments>(ctx->saved_data["arguments"].toList(),
                                     std::make_index_sequence<std::tuple_size_v<Arguments>>{});
}

// Whether autograd takes the gradients-in-forward way: a scalar loss (its
// upstream gradient one number), a float32/float64 classifier (a
// reduced-precision gradient scaled after its GEMM would be rounded twice),
// and a gradient to compute.
bool gradients_in_forward(const at::Tensor& weight, int64_t reduction, bool any_gradient);

// A gradient computed in forward times the upstream gradient `grad_loss` (one
// value), in place or not; returned as is where grad_loss is a CPU 1
// (loss.backward()), which costs no pass over a weight-sized gradient. On a
// device the multiply stays, one pass over each gradient, no host wait: the
// engine's seed of loss.backward() is an ordinary tensor that ones_like
// filled on the device (nothing in it or in the graph says it holds 1), and
// reading it is a copy to the host that waits for the whole forward.
at::Tensor apply_upstream(const at::Tensor& gradient, const at::Tensor& grad_loss, bool in_place,
                          const char* op);

// What a head's forward op gives its Function: the loss and the tensors the
// backward needs (the gradients, first, on the gradients-in-forward way).
using LossAndSaved = std::pair<at::Tensor, torch::autograd::variable_list>;

// The forward: `with_gradients()` where gradients_in_forward holds, its first
// `gradient_count` tensors the gradients of the Function's first inputs (in
// order; undefined where not asked); else `loss_only()`. Every saved tensor
// goes through save_for_backward.
at::Tensor fused_head_forward(torch::autograd::AutogradContext* ctx, const at::Tensor& weight,
                              int64_t reduction, bool any_gradient, int64_t gradient_count,
                              const std::function<LossAndSaved()>& with_gradients,
                              const std::function<LossAndSaved()>& loss_only);

// The backward: `inputs` gradients (one per argument of the Function's
// forward), the saved gradients scaled, or those `recompute(saved, grad_loss,
// result)` writes into result with the forward's GEMM dtype set. Nothing
// where the upstream gradient is undefined.
using Recompute =
    std::function<void(const torch::autograd::variable_list& saved, const at::Tensor& grad_loss,
                       torch::autograd::variable_list& result)>;
torch::autograd::variable_list fused_head_backward(torch::autograd::AutogradContext* ctx,
                                                   const torch::autograd::variable_list& grads,
                                                   size_t inputs, const char* op,
                                                   const Recompute& recompute);

// Registers `op`'s internal ops (_<op>_forward, _<op>_backward,
// _<op>_forward_with_gradients) at the Autograd key as not differentiable:
// gradients go through the public op, whose Function follows this protocol.
void register_internal_ops_without_autograd(torch::Library& m, const std::string& op);

}  // namespace autograd
}  // namespace shardtorch
