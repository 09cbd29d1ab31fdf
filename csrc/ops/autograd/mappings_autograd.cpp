// Autograd of the communication mappings: each backward calls the adjoint op
// through the dispatcher, so double backward and TorchScript see ops too.
#include <torch/autograd.h>
#include <torch/library.h>

#include <shardtorch/ops/mappings.h>
#include "ops/op_checks.h"

namespace shardtorch {
namespace autograd {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::Function;
using torch::autograd::variable_list;

std::string saved_group(AutogradContext* ctx) { return ctx->saved_data["group"].toStringRef(); }

class CopyFunction : public Function<CopyFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            const std::string& group) {
    ctx->saved_data["group"] = group;
    at::AutoDispatchBelowADInplaceOrView guard;
    return ops::copy(input, group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {ops::reduce(grads[0], saved_group(ctx)), at::Tensor()};
  }
};

class ReduceFunction : public Function<ReduceFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            const std::string& group) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return ops::reduce(input, group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {grads[0], at::Tensor()};
  }
};

// Both slicings of the group's data along `dim`: scatter keeps this rank's
// slice (backward: gather_replicated), reduce_scatter sums over the group first
// (backward: all_gather, the adjoint). Backward knows the full length.
class SliceFunction : public Function<SliceFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, int64_t dim,
                            const std::string& group, bool reduce) {
    const char* op = reduce ? "shard::reduce_scatter" : "shard::scatter";
    ctx->saved_data["group"] = group;
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["reduce"] = reduce;
    ctx->saved_data["full_size"] = input.sym_size(ops::normalize_dim(dim, input.dim(), op));
    at::AutoDispatchBelowADInplaceOrView guard;
    return reduce ? ops::reduce_scatter(input, dim, group) : ops::scatter(input, dim, group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const int64_t dim = ctx->saved_data["dim"].toInt();
    auto full = ctx->saved_data["full_size"].toSymInt();
    at::Tensor grad = ctx->saved_data["reduce"].toBool()
                          ? ops::all_gather(grads[0], dim, saved_group(ctx), full)
                          : ops::gather_replicated(grads[0], dim, saved_group(ctx), full);
    return {grad, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Both all-gathers: the adjoint (all_gather: reduce-scatter backward) and the
// one for replicated computation (gather_replicated: keep this rank's slice).
class AllGatherFunction : public Function<AllGatherFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, int64_t dim,
                            const std::string& group, std::optional<c10::SymInt> full_size,
                            bool replicated) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["replicated"] = replicated;
    at::AutoDispatchBelowADInplaceOrView guard;
    return replicated ? ops::gather_replicated(input, dim, group, std::move(full_size))
                      : ops::all_gather(input, dim, group, std::move(full_size));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const int64_t dim = ctx->saved_data["dim"].toInt();
    at::Tensor grad = ctx->saved_data["replicated"].toBool()
                          ? ops::scatter(grads[0], dim, saved_group(ctx))
                          : ops::reduce_scatter(grads[0], dim, saved_group(ctx));
    return {grad, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor copy_autograd(const at::Tensor& input, const std::string& group) {
  return CopyFunction::apply(input, group);
}
at::Tensor reduce_autograd(const at::Tensor& input, const std::string& group) {
  return ReduceFunction::apply(input, group);
}
at::Tensor scatter_autograd(const at::Tensor& input, int64_t dim, const std::string& group) {
  return SliceFunction::apply(input, dim, group, false);
}
at::Tensor all_gather_autograd(const at::Tensor& input, int64_t dim, const std::string& group,
                               std::optional<c10::SymInt> full_size) {
  return AllGatherFunction::apply(input, dim, group, std::move(full_size), false);
}
at::Tensor gather_replicated_autograd(const at::Tensor& input, int64_t dim,
                                      const std::string& group,
                                      std::optional<c10::SymInt> full_size) {
  return AllGatherFunction::apply(input, dim, group, std::move(full_size), true);
}
at::Tensor reduce_scatter_autograd(const at::Tensor& input, int64_t dim, const std::string& group) {
  return SliceFunction::apply(input, dim, group, true);
}

}  // namespace

TORCH_LIBRARY_IMPL(shard, Autograd, m) {
  m.impl("copy", TORCH_FN(copy_autograd));
  m.impl("reduce", TORCH_FN(reduce_autograd));
  m.impl("scatter", TORCH_FN(scatter_autograd));
  m.impl("all_gather", TORCH_FN(all_gather_autograd));
  m.impl("gather_replicated", TORCH_FN(gather_replicated_autograd));
  m.impl("reduce_scatter", TORCH_FN(reduce_scatter_autograd));
}

}  // namespace autograd
}  // namespace shardtorch
