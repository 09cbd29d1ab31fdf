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
// leaves free). These passes are ATen, so every device runs them as they are;
// the plain op and the fused heads call them on any block of columns.

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

// The two passes take their arguments as CrossEntropyKernels' do, so that a
// head that goes over its classes in chunks (and its rows in blocks, with
// rows_of_setup) calls each right after the kernels' pass on the same chunk:
//   logits / values [rows, c]: columns [col_begin, col_begin + c) of this
//     rank's shard;
//   probs [rows, local_classes]: this rank's columns of the target, any
//     floating dtype (CrossEntropyForwardSetup / CrossEntropyBackwardSetup
//     ::target_probs); weight_local [local_classes] in the stats dtype or
//     undefined (all 1): both narrowed to the chunk here.

// Adds the chunk's parts of A_i and B_i (above) to stats [rows,
// kNumRowStats] (the stats dtype): A_i to kRowTargetWeight, B_i to
// kRowTargetLogit. combine_over_group then sums them over the ranks.
// `block_elements`: the kernels' probability_block_elements().
void accumulate_probability_stats(const at::Tensor& logits, int64_t col_begin,
                                  const at::Tensor& probs, const at::Tensor& weight_local,
                                  const at::Tensor& stats, int64_t block_elements);

// values [rows, c] -= scale_i w_j p_ij in place: the probability term of the
// logit gradient, after CrossEntropyKernels::softmax_grad_inplace has written
// the softmax and smoothing terms of the same chunk (given a probability
// target's coefficients and a target_local of -1, it writes nothing else).
// scale [rows] in the stats dtype: g_i (1 - e), the kCoefTargetScale column of
// a probability target's coefficients.
void subtract_probability_gradient(const at::Tensor& values, int64_t col_begin,
                                   const at::Tensor& probs, const at::Tensor& weight_local,
                                   const at::Tensor& scale, int64_t block_elements);

// This rank's columns [rows, local] of a probability target [rows, T] in
// backward, where the class offset is a 0-d int64 tensor on the device (read
// from the saved statistics without a host read): the target itself when
// T == local, else the columns [offset, offset + local) of the whole target
// (a copy).
at::Tensor local_probability_columns(const at::Tensor& target_rows, const at::Tensor& offset,
                                     int64_t local);

}  // namespace ops
}  // namespace shardtorch
