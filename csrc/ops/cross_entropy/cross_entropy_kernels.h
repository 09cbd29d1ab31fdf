#pragma once
// Everything the parallel cross-entropy ops (plain, fused with the
// classifier, margin) need from a device, and the one place device code is
// chosen for them: the passes over [rows, classes] data, the fused heads'
// GEMMs and the margin head's passes over weight rows. ATen operations over
// row blocks and oneDNN/MKL GEMMs on CPU (cpu/cross_entropy_kernels_cpu.cpp),
// custom kernels and cuBLASLt on CUDA (cuda/cross_entropy_kernels_cuda.cu).
// Everything else is shared and device-free (cross_entropy_statistics.h, the
// driver, the _impl files).

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace shardtorch {
namespace ops {

// Columns of the per-row statistics one rank computes over its own classes.
enum RowStat : int64_t {
  kRowMax = 0,           // max of the row's logits (-inf for no classes)
  kRowSumExp = 1,        // sum of exp(x - max)
  kRowTargetLogit = 2,   // x[target] when this rank holds the target, else 0
  kRowWeightedSum = 3,   // sum of w_c x_c (w = 1 without class weights)
  kRowTargetWeight = 4,  // w[target] when this rank holds the target, else 0
  kNumRowStats = 5,
};

// Columns of the per-row coefficients of the softmax gradient.
// The log-sum-exp is computed in float64 and passed as two parts, its value
// rounded to the stats dtype and the remainder, so that float32 kernels compute
// exp((x - lse) - remainder): x - lse is exact for the logits that matter (the
// two are close), and the gradient keeps F.cross_entropy's accuracy at any
// logit scale (a rounded lse alone costs half an ulp of |lse|: 3e-5 at 1000).
enum GradCoef : int64_t {
  kCoefLse = 0,  // log-sum-exp rounded to the stats dtype
  kCoefGradScale = 1,
  kCoefTargetScale = 2,
  kCoefSmoothScale = 3,
  kCoefLseRemainder = 4,  // log-sum-exp - kCoefLse (0 in float64)
  kNumGradCoefs = 5,
};

class CrossEntropyKernels {
 public:
  virtual ~CrossEntropyKernels() = default;

  // Folds `logits` [rows, c] (contiguous), which are columns
  // [col_begin, col_begin + c) of this rank's shard, into `stats`
  // [rows, kNumRowStats] (float32, float64 for float64 logits), merging max
  // and sum-exp online so that a shard may come in chunks.
  //   target_local [rows] int64: the local column of the row's target, or -1.
  //   target_probs: undefined, or a probability target's columns of this
  //   rank [rows, local_classes] (any floating dtype, unit column stride;
  //   probability_target.h), whose target_local is all -1. Its sums go into
  //   the target columns in the same pass:
  //     kRowTargetWeight += sum_c w_c p_c                          (A)
  //     kRowTargetLogit  += sum_c w_c p_c (z_c - shift)            (B)
  //   shift being the row's max as kRowMax holds it after the call (0 where
  //   that is -inf), B rebased whenever the max grows: summed relative to the
  //   max, B does not cancel against A lse for large confident logits, where
  //   sum w p z does in float32 (combine_over_group rebases it over ranks).
  //   weight_local [local_classes] in the stats dtype, or undefined (all 1).
  //   copy_to: undefined, or [rows, c] contiguous receiving the logits in the
  //   same pass (the backward buffer of the plain op).
  virtual void accumulate_row_stats(const at::Tensor& logits, int64_t col_begin,
                                    const at::Tensor& target_local, const at::Tensor& target_probs,
                                    const at::Tensor& weight_local, const at::Tensor& stats,
                                    const at::Tensor& copy_to) const = 0;

  // In place over `values` [rows, c] contiguous (logits in, gradient out):
  //   v = grad_scale * exp(x - lse) - target_scale * [col == target]
  //       - smooth_scale * w_col - target_scale * w_col * p_col
  // the last term only with target_probs (as above), rounded once into v.
  // coefs [rows, kNumGradCoefs] in the stats dtype.
  virtual void softmax_grad_inplace(const at::Tensor& values, int64_t col_begin,
                                    const at::Tensor& target_local, const at::Tensor& target_probs,
                                    const at::Tensor& weight_local,
                                    const at::Tensor& coefs) const = 0;

  // The gradients-in-forward pair, for a block of rows holding all of this
  // rank's columns. accumulate_row_stats_leaving_exp is accumulate_row_stats
  // into fresh stats from column 0 without copy_to, except that it leaves
  // exp(x - m) in place of each logit, m being the row's max as it wrote it
  // (0 where that is -inf, so the row holds 0); softmax_grad_from_exp_inplace
  // is then softmax_grad_inplace from those values and those stats, with one
  // multiply per logit where the other computes exp(x - lse) again:
  //   v = grad_scale * exp(max - lse) * v - target_scale * [col == target]
  //       - smooth_scale * w_col (- target_scale * w_col * p_col)
  // The first returns false, having done nothing, where the kernels do not
  // have this pair (the default) or the logits are not in the stats dtype;
  // the second may only follow a first that returned true.
  virtual bool accumulate_row_stats_leaving_exp(const at::Tensor& logits,
                                                const at::Tensor& target_local,
                                                const at::Tensor& target_probs,
                                                const at::Tensor& weight_local,
                                                const at::Tensor& stats) const {
    return false;
  }
  virtual void softmax_grad_from_exp_inplace(
      const at::Tensor& values, const at::Tensor& target_local, const at::Tensor& target_probs,
      const at::Tensor& weight_local, const at::Tensor& coefs, const at::Tensor& stats) const;

  // The fused classifier's GEMMs. x and w share a dtype (the GEMM dtype).
  // Logits [rows, width] in `out` (the stats dtype) of x [rows, f] times the
  // rows of w_chunk [width, f], plus bias_chunk [width] (or undefined): a
  // float16/bfloat16 GEMM accumulates and returns float32.
  virtual at::Tensor chunk_logits(const at::Tensor& x, const at::Tensor& w_chunk,
                                  const at::Tensor& bias_chunk, at::ScalarType out) const = 0;
  // The same product without bias into `out` [rows, width], columns of a
  // wider block (a strided view), in out's dtype.
  virtual void chunk_logits_into(at::Tensor& out, const at::Tensor& x,
                                 const at::Tensor& w_chunk) const = 0;
  // acc [m, n] += a [m, k] b [k, n]; acc in a's dtype or float32 (a
  // float16/bfloat16 product accumulated in float32). a or b may be the
  // transposed view of a contiguous tensor (the weight gradient's grad^T).
  virtual void add_product(at::Tensor& acc, const at::Tensor& a, const at::Tensor& b) const = 0;
  // out [m, n] = a [m, k] b [k, n], as add_product (no pass to zero `out`).
  virtual void write_product(at::Tensor& out, const at::Tensor& a, const at::Tensor& b) const = 0;

  // The margin head's passes over weight rows. The defaults are ATen's.
  // The kept rows normalised and scaled: out[k] = weight[kept[k]] * scale /
  // max(|weight[kept[k]]|, eps) and norms[k] = |weight[kept[k]]| (unclamped,
  // in the rows' dtype); out [kept, features] and norms [kept] written whole.
  virtual void gather_scaled_unit_rows(at::Tensor& out, at::Tensor& norms, const at::Tensor& weight,
                                       const at::Tensor& kept, double scale, double eps) const;
  // grad_rows [n, features] = a_j grad_rows_j - b_j (rows_j . grad_rows_j)
  // rows_j per row j, the dot taken (in `acc`) before the update; `a`
  // undefined is 1; a and b [n] in `acc`.
  virtual void project_out_rows(at::Tensor& grad_rows, const at::Tensor& rows, const at::Tensor& a,
                                const at::Tensor& b, at::ScalarType acc) const;
};

}  // namespace ops
}  // namespace shardtorch
