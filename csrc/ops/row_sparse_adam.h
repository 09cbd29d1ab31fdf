#pragma once
// shard::_row_sparse_adam_: torch.optim.Adam's update applied in place to some
// rows of a parameter, each row with its own step count, for
// ts.optim.RowSparseAdam (a row-sparse gradient):
//
//   _row_sparse_adam_(Tensor(a!) param, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq,
//       Tensor(d!) row_step, Tensor rows, Tensor grad, float lr, float beta1,
//       float beta2, float eps, float weight_decay) -> ()
//
//   param, exp_avg and exp_avg_sq [R, C] contiguous, row_step [R] int64,
//   rows [n] int64 strictly increasing in [0, R), grad [n, C] contiguous (row
//   i is rows[i]'s). For each of those rows, with t = ++row_step[row] and
//   g = grad + weight_decay * param (L2, not AdamW):
//     exp_avg    = lerp(exp_avg, g, 1 - beta1)
//     exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g * g
//     param     += -(lr / (1 - beta1^t)) * exp_avg
//                  / (sqrt(exp_avg_sq) / sqrt(1 - beta2^t) + eps)
//   (torch.optim.Adam's single-tensor formulas; the bias corrections in
//   float64, as its Python floats), and no other row is read or written; the
//   gradient is not written. CPU: one pass over the rows in place; elsewhere:
//   the rows gathered, updated, written back (no host synchronisation).

#include <ATen/core/Tensor.h>

namespace shardtorch {
namespace ops {

// The checks every kernel makes, the Meta one included: shapes, dtypes and
// devices (names the op, the argument and the value). Not the row indices'
// values, which the CPU kernel checks as it reads them.
void check_row_sparse_adam_args(const at::Tensor& param, const at::Tensor& exp_avg,
                                const at::Tensor& exp_avg_sq, const at::Tensor& row_step,
                                const at::Tensor& rows, const at::Tensor& grad);

}  // namespace ops
}  // namespace shardtorch
