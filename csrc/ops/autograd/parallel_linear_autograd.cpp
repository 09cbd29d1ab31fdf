// Autograd of parallel_linear, in C++ so that LibTorch programs train with it
// too. The backward is the op shard::_parallel_linear_backward.
#include <torch/autograd.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include <shardtorch/ops/parallel_linear.h>

namespace shardtorch {
namespace autograd {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::Function;
using torch::autograd::variable_list;

class ParallelLinearFunction : public Function<ParallelLinearFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, std::optional<int64_t> dim,
                            const std::string& group) {
    ctx->save_for_backward({input, weight});
    ctx->saved_data["group"] = group;
    ctx->saved_data["dim"] = dim.has_value() ? c10::IValue(*dim) : c10::IValue();
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    at::AutoDispatchBelowADInplaceOrView guard;
    return ops::parallel_linear(input, weight, bias, dim, group);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto& dim_value = ctx->saved_data["dim"];
    std::optional<int64_t> dim;
    if (!dim_value.isNone()) dim = dim_value.toInt();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    std::array<bool, 3> mask{ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                             has_bias && ctx->needs_input_grad(2)};
    at::Tensor grad_input, grad_weight, grad_bias;
    if (grads[0].defined() && (mask[0] || mask[1] || mask[2])) {
      std::tie(grad_input, grad_weight, grad_bias) = ops::parallel_linear_backward(
          grads[0], saved[0], saved[1], dim, ctx->saved_data["group"].toStringRef(), mask);
    }
    return {grad_input, grad_weight, grad_bias, at::Tensor(), at::Tensor()};
  }
};

at::Tensor parallel_linear_autograd(const at::Tensor& input, const at::Tensor& weight,
                                    const std::optional<at::Tensor>& bias,
                                    std::optional<int64_t> dim, const std::string& group) {
  return ParallelLinearFunction::apply(input, weight, bias, dim, group);
}

}  // namespace

TORCH_LIBRARY_IMPL(shard, Autograd, m) {
  m.impl("parallel_linear", TORCH_FN(parallel_linear_autograd));
  // The backward has no backward of its own: a clear error, not a silent zero.
  m.impl("_parallel_linear_backward", torch::autograd::autogradNotImplementedFallback());
}

}  // namespace autograd
}  // namespace shardtorch
