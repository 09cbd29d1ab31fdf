#pragma once
// Probability (soft) targets of the parallel cross-entropy, F.cross_entropy's
// class-probability target: a floating [*, classes] tensor p, sharded like the
// logits or whole. With label smoothing e, class weights w and C classes, torch
// defines the row loss as
//   loss_i = -sum_c w_c p'_ic log_softmax(z)_ic,   p' = (1 - e) p + e / C,
// that is, with lse_i the row's log-sum-exp,
//   loss_i = (1 - e) (A_i lse_i - B_i) + e / C (sum_c w_c lse_i - sum_c w_c z_ic)
//   A_i = sum_c w_c p_ic,   B_i = sum_c w_c p_ic z_ic,
// and its logit gradient (upstream g_i)
//   g_i ((1 - e) A_i + e / C sum_c w_c) softmax_ij - g_i w_j p'_ij.
// The smoothing terms are the class-index loss's own; A_i and B_i are sums over
// classes, so each rank adds its own classes' parts and they travel in the one
// gathered statistics (the RowStat target columns, which a probability target
// leaves free). The device kernels take both sums in their forward row pass and
// the probability term in their backward pass (CrossEntropyKernels'
// target_probs), B_i relative to the row's max so that it does not cancel
// against A_i lse_i; the plain op and the fused heads hand them this rank's
// columns of the target, on any block of columns.

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace shardtorch {
namespace ops {

// Whether `target` holds class probabilities (a floating tensor) rather than
// class indices.
bool is_probability_target(const at::Tensor& target);

// The rows of a probability target [*, T]: the product of its leading dims
// (T may be 0 on a rank that holds no class).
int64_t probability_target_rows(const at::Tensor& target);

// This rank's columns [rows, local] of a probability target [rows, T] in
// backward, where the class offset is a 0-d int64 tensor on the device (read
// from the saved statistics without a host read): the target itself when
// T == local, else the columns [offset, offset + local) of the whole target
// (a copy).
at::Tensor local_probability_columns(const at::Tensor& target_rows, const at::Tensor& offset,
                                     int64_t local);

}  // namespace ops
}  // namespace shardtorch
