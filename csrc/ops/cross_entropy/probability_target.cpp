#include "ops/cross_entropy/probability_target.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "ops/cross_entropy/cross_entropy_kernels.h"
#include "ops/cross_entropy/row_blocks.h"

namespace shardtorch {
namespace ops {
namespace {

at::Tensor as_stats_dtype(const at::Tensor& t, at::ScalarType acc) {
  return t.scalar_type() == acc ? t : t.to(acc);
}

// w_j p_ij of one block in the stats dtype: the caller's target itself (only
// ever read) when it is in that dtype and there are no class weights, so that
// the common case makes no copy.
at::Tensor weighted_probabilities(const at::Tensor& probs, const at::Tensor& w_cols,
                                  at::ScalarType acc) {
  const at::Tensor p = as_stats_dtype(probs, acc);
  return w_cols.defined() ? p * w_cols.unsqueeze(0) : p;
}

// Calls f(row0, n, wp) for each block of rows [row0, row0 + n) of a chunk of
// `cols` columns from col_begin, wp being w_j p_ij of that block. The blocks
// keep the temporaries (the target and the logits in the stats dtype, their
// products) about `block_elements` values whatever the batch
// (CrossEntropyKernels::probability_block_elements).
template <typename F>
void for_each_weighted_block(int64_t rows, int64_t cols, int64_t col_begin,
                             const at::Tensor& probs_local, const at::Tensor& weight_local,
                             at::ScalarType acc, int64_t block_elements, F f) {
  if (rows == 0 || cols == 0) return;
  const at::Tensor probs = probs_local.narrow(1, col_begin, cols);
  const at::Tensor w_cols =
      weight_local.defined() ? weight_local.narrow(0, col_begin, cols) : at::Tensor();
  const int64_t step = rows_per_block(cols, block_elements);
  for (int64_t row0 = 0; row0 < rows; row0 += step) {
    const int64_t n = std::min(step, rows - row0);
    f(row0, n, weighted_probabilities(probs.narrow(0, row0, n), w_cols, acc));
  }
}

}  // namespace

bool is_probability_target(const at::Tensor& target) {
  return at::isFloatingType(target.scalar_type());
}

int64_t probability_target_rows(const at::Tensor& target) {
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < target.dim(); ++d) rows *= target.size(d);
  return rows;
}

void accumulate_probability_stats(const at::Tensor& logits, int64_t col_begin,
                                  const at::Tensor& probs_local, const at::Tensor& weight_local,
                                  const at::Tensor& stats, int64_t block_elements) {
  const at::ScalarType acc = stats.scalar_type();
  for_each_weighted_block(logits.size(0), logits.size(1), col_begin, probs_local, weight_local, acc,
                          block_elements, [&](int64_t row0, int64_t n, const at::Tensor& wp) {
                            at::Tensor s = stats.narrow(0, row0, n);
                            s.select(1, kRowTargetWeight).add_(wp.sum(1));
                            // sum_c w_c p_c z_c: a row dot product, so a masked (-inf) logit under
                            // a zero probability is NaN here exactly as in torch's -(p *
                            // log_softmax).
                            s.select(1, kRowTargetLogit)
                                .add_((wp * as_stats_dtype(logits.narrow(0, row0, n), acc)).sum(1));
                          });
}

void subtract_probability_gradient(const at::Tensor& values, int64_t col_begin,
                                   const at::Tensor& probs_local, const at::Tensor& weight_local,
                                   const at::Tensor& scale, int64_t block_elements) {
  const at::ScalarType acc = scale.scalar_type();
  for_each_weighted_block(values.size(0), values.size(1), col_begin, probs_local, weight_local, acc,
                          block_elements, [&](int64_t row0, int64_t n, const at::Tensor& wp) {
                            const at::Tensor row_scale = scale.narrow(0, row0, n).unsqueeze(1);
                            at::Tensor v = values.narrow(0, row0, n);
                            if (v.scalar_type() == acc) {
                              v.addcmul_(wp, row_scale, -1);
                            } else {
                              // Reduced-precision logits: subtracted in the stats dtype, rounded
                              // once more.
                              v.copy_(v.to(acc).addcmul_(wp, row_scale, -1));
                            }
                          });
}

at::Tensor local_probability_columns(const at::Tensor& target_rows, const at::Tensor& offset,
                                     int64_t local) {
  if (target_rows.size(1) == local) return target_rows;
  // Forward accepted only this rank's or all classes; this guards a direct
  // call of the backward op with another target.
  TORCH_CHECK(target_rows.size(1) > local,
              "shard::_parallel_cross_entropy_backward: a probability target's last dim must be "
              "this rank's ",
              local, " classes or all of them, got ", target_rows.size(1));
  const at::Tensor columns = at::arange(local, offset.options()) + offset;
  return target_rows.index_select(1, columns);
}

}  // namespace ops
}  // namespace shardtorch
