#pragma once
// shard::_row_sparse_sgd_: torch.optim.SGD's update applied in place to some
// rows of a parameter, for ts.optim.RowSparseSGD (a row-sparse gradient):
//
//   _row_sparse_sgd_(Tensor(a!) param, Tensor(b!)? momentum_buffer,
//       Tensor rows, Tensor grad, float lr, float momentum, float weight_decay,
//       bool nesterov) -> ()
//
//   param and momentum_buffer [R, C] contiguous, rows [n] int64 strictly
//   increasing in [0, R), grad [n, C] contiguous (row i is rows[i]'s). For
//   each of those rows, with d = grad + weight_decay * param:
//     momentum_buffer = momentum * momentum_buffer + d   (momentum != 0)
//     d = nesterov ? d + momentum * momentum_buffer : momentum_buffer
//     param -= lr * d
//   and no other row is read or written. No dampening: a dampened buffer's
//   first step differs per row (the optimizer keeps step counts for that).
//   CPU: one pass over the rows in place; elsewhere: the rows gathered,
//   torch's fused SGD kernel, written back.

#include <ATen/core/Tensor.h>

#include <optional>

namespace shardtorch {
namespace ops {

// The checks every kernel makes (names the op, the argument and the value).
void check_row_sparse_sgd_args(const at::Tensor& param,
                               const std::optional<at::Tensor>& momentum_buffer,
                               const at::Tensor& rows, const at::Tensor& grad, double momentum);

}  // namespace ops
}  // namespace shardtorch
