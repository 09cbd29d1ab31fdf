// Schema, checks, the Meta kernel and the any-device kernel of shard::_row_sparse_sgd_ (see
// row_sparse_sgd.h); the CPU kernel is in cpu/row_sparse_sgd_cpu.cpp.
#include "ops/row_sparse_sgd.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/row_sparse_checks.h"

namespace shardtorch {
namespace ops {

TORCH_LIBRARY_FRAGMENT(shard, m) {
  m.def(
      "_row_sparse_sgd_(Tensor(a!) param, Tensor(b!)? momentum_buffer, Tensor rows, Tensor grad, "
      "float lr, float momentum, float weight_decay, bool nesterov) -> ()");
}

namespace {
constexpr const char* kOp = "shard::_row_sparse_sgd_";
}  // namespace

void check_row_sparse_sgd_args(const at::Tensor& param,
                               const std::optional<at::Tensor>& momentum_buffer,
                               const at::Tensor& rows, const at::Tensor& grad, double momentum) {
  check_row_sparse_param(kOp, param);
  check_row_sparse_rows_and_grad(kOp, param, rows, grad);
  const bool has_buffer = momentum_buffer.has_value() && momentum_buffer->defined();
  TORCH_CHECK(has_buffer == (momentum != 0), kOp,
              ": momentum_buffer must be given exactly when momentum != 0, got momentum ", momentum,
              (has_buffer ? " with" : " without"), " a buffer");
  if (has_buffer) check_row_sparse_state(kOp, "momentum_buffer", *momentum_buffer, param);
  for (const at::Tensor* t : {&rows, &grad}) {
    TORCH_CHECK(t->device() == param.device(), kOp, ": rows and grad must be on param's device ",
                param.device(), ", got ", t->device());
  }
}

namespace {

// Any device: the rows gathered, updated by torch's fused SGD kernel (its
// arithmetic, one pass), written back.
void row_sparse_sgd_gathered(const at::Tensor& param,
                             const std::optional<at::Tensor>& momentum_buffer,
                             const at::Tensor& rows, const at::Tensor& grad, double lr,
                             double momentum, double weight_decay, bool nesterov) {
  check_row_sparse_sgd_args(param, momentum_buffer, rows, grad, momentum);
  if (rows.numel() == 0) return;
  at::Tensor taken = param.index_select(0, rows);
  std::vector<at::Tensor> buffers;
  if (momentum != 0) buffers.push_back(momentum_buffer->index_select(0, rows));
  at::_fused_sgd_({taken}, {grad}, buffers, weight_decay, momentum, lr, /*dampening=*/0.0, nesterov,
                  /*maximize=*/false, /*is_first_step=*/false);
  if (momentum != 0) momentum_buffer->index_copy_(0, rows, buffers[0]);
  param.index_copy_(0, rows, taken);
}

// Meta (FakeTensor, torch.compile tracing): the checks that need no data.
void row_sparse_sgd_meta(const at::Tensor& param, const std::optional<at::Tensor>& momentum_buffer,
                         const at::Tensor& rows, const at::Tensor& grad, double /*lr*/,
                         double momentum, double /*weight_decay*/, bool /*nesterov*/) {
  check_row_sparse_sgd_args(param, momentum_buffer, rows, grad, momentum);
}

}  // namespace

TORCH_LIBRARY_IMPL(shard, Meta, m) { m.impl("_row_sparse_sgd_", TORCH_FN(row_sparse_sgd_meta)); }

TORCH_LIBRARY_IMPL(shard, CompositeExplicitAutograd, m) {
  m.impl("_row_sparse_sgd_", TORCH_FN(row_sparse_sgd_gathered));
}

}  // namespace ops
}  // namespace shardtorch
