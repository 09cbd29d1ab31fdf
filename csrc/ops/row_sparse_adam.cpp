// Schema, checks, the Meta kernel and the any-device kernel of
// shard::_row_sparse_adam_ (see row_sparse_adam.h); the CPU kernel is in
// cpu/row_sparse_adam_cpu.cpp.
#include "ops/row_sparse_adam.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/row_sparse_checks.h"

namespace shardtorch {
namespace ops {

TORCH_LIBRARY_FRAGMENT(shard, m) {
  m.def(
      "_row_sparse_adam_(Tensor(a!) param, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
      "Tensor(d!) row_step, Tensor rows, Tensor grad, float lr, float beta1, float beta2, "
      "float eps, float weight_decay) -> ()");
}

namespace {
constexpr const char* kAdamOp = "shard::_row_sparse_adam_";
}  // namespace

void check_row_sparse_adam_args(const at::Tensor& param, const at::Tensor& exp_avg,
                                const at::Tensor& exp_avg_sq, const at::Tensor& row_step,
                                const at::Tensor& rows, const at::Tensor& grad) {
  check_row_sparse_param(kAdamOp, param);
  TORCH_CHECK(at::isFloatingType(param.scalar_type()), kAdamOp,
              ": param must be floating point, got ", param.scalar_type());
  const std::pair<const char*, const at::Tensor*> moments[] = {{"exp_avg", &exp_avg},
                                                               {"exp_avg_sq", &exp_avg_sq}};
  for (const auto& [name, t] : moments) check_row_sparse_state(kAdamOp, name, *t, param);
  TORCH_CHECK(row_step.dim() == 1 && row_step.size(0) == param.size(0) &&
                  row_step.scalar_type() == at::kLong && row_step.is_contiguous(),
              kAdamOp, ": row_step must be a contiguous int64 [param.size(0)] = [", param.size(0),
              "] tensor, got ", row_step.scalar_type(), " of shape ", row_step.sizes());
  check_row_sparse_rows_and_grad(kAdamOp, param, rows, grad);
  const std::pair<const char*, const at::Tensor*> others[] = {{"exp_avg", &exp_avg},
                                                              {"exp_avg_sq", &exp_avg_sq},
                                                              {"row_step", &row_step},
                                                              {"rows", &rows},
                                                              {"grad", &grad}};
  for (const auto& [name, t] : others) {
    TORCH_CHECK(t->device() == param.device(), kAdamOp, ": ", name, " must be on param's device ",
                param.device(), ", got ", t->device());
  }
}

namespace {

// Meta (FakeTensor, torch.compile tracing): the checks that need no data.
void row_sparse_adam_meta(const at::Tensor& param, const at::Tensor& exp_avg,
                          const at::Tensor& exp_avg_sq, const at::Tensor& row_step,
                          const at::Tensor& rows, const at::Tensor& grad, double /*lr*/,
                          double /*beta1*/, double /*beta2*/, double /*eps*/,
                          double /*weight_decay*/) {
  check_row_sparse_adam_args(param, exp_avg, exp_avg_sq, row_step, rows, grad);
}

// Any device: the rows gathered, updated by torch.optim.Adam's single-tensor
// passes with a step per row (device tensors, no host synchronisation),
// written back.
void row_sparse_adam_gathered(const at::Tensor& param, const at::Tensor& exp_avg,
                              const at::Tensor& exp_avg_sq, const at::Tensor& row_step,
                              const at::Tensor& rows, const at::Tensor& grad, double lr,
                              double beta1, double beta2, double eps, double weight_decay) {
  check_row_sparse_adam_args(param, exp_avg, exp_avg_sq, row_step, rows, grad);
  if (rows.numel() == 0) return;
  const at::Tensor steps = row_step.index_select(0, rows).add_(1);
  row_step.index_copy_(0, rows, steps);
  at::Tensor g = grad;
  if (weight_decay != 0) g = grad.add(param.index_select(0, rows), weight_decay);
  const at::Tensor avg = exp_avg.index_select(0, rows).lerp_(g, 1 - beta1);
  exp_avg.index_copy_(0, rows, avg);
  const at::Tensor sq = exp_avg_sq.index_select(0, rows).mul_(beta2).addcmul_(g, g, 1 - beta2);
  exp_avg_sq.index_copy_(0, rows, sq);
  // The bias corrections per row in float64 (torch's Python floats), then in param's dtype.
  const at::Tensor t = steps.to(at::kDouble).unsqueeze(1);
  const at::Tensor bias_correction1 = at::pow(beta1, t).neg_().add_(1);
  const at::Tensor neg_step_size =
      at::full_like(bias_correction1, -lr).div_(bias_correction1).to(param.scalar_type());
  const at::Tensor bias_correction2_sqrt =
      at::pow(beta2, t).neg_().add_(1).sqrt_().to(param.scalar_type());
  const at::Tensor denom = sq.sqrt().div_(bias_correction2_sqrt).add_(eps);
  // p + (value * exp_avg) / denom: addcdiv's arithmetic with a value per row.
  param.index_add_(0, rows, avg.mul(neg_step_size).div_(denom));
}

}  // namespace

TORCH_LIBRARY_IMPL(shard, Meta, m) { m.impl("_row_sparse_adam_", TORCH_FN(row_sparse_adam_meta)); }

TORCH_LIBRARY_IMPL(shard, CompositeExplicitAutograd, m) {
  m.impl("_row_sparse_adam_", TORCH_FN(row_sparse_adam_gathered));
}

}  // namespace ops
}  // namespace shardtorch
