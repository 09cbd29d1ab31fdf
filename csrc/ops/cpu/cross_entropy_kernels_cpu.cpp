// The cross-entropy kernels on CPU, for parallel_cross_entropy,
// parallel_linear_cross_entropy and parallel_linear_margin_cross_entropy: the row passes as ATen
// operations over blocks of rows (accumulated in float32, float64 for float64 logits), the fused
// heads' GEMMs through cpu/cpu_gemm.h (oneDNN where MKL's sgemm runs narrower than the CPU), the
// margin head's one-pass loops over weight rows (cpu/margin_rows_cpu.h).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <algorithm>

#include "ops/cpu/cpu_gemm.h"
#include "ops/cpu/margin_rows_cpu.h"
#include "ops/cpu/vector_isa.h"
#include "ops/cross_entropy/cross_entropy_kernel_adapter.h"
#include "ops/cross_entropy/cross_entropy_kernels.h"
#include "ops/cross_entropy/margin_cross_entropy_kernel_adapter.h"
#include "ops/cross_entropy/row_blocks.h"
#include "ops/recycled_buffers.h"
#include "ops/scratch_buffer.h"

namespace shardtorch {
namespace ops {
namespace {

// The passes run as ATen operations over blocks of rows: ATen picks its
// vectorised (AVX2/AVX-512) exp, max and cascade-summation kernels at run
// time, which hand-written loops in this library, compiled for baseline
// x86-64, cannot. A block holds about 2^18 elements (1 MiB in float32): the
// temporaries stay small next to the [rows, classes] data, and the blocks are
// still large enough for the per-operation overhead not to show (measured:
// 2^20 took 3 MiB more and was no faster at 100k classes).
constexpr int64_t kBlockElements = int64_t(1) << 18;

// `block` in the stats dtype: itself when it already is, else a converted copy.
at::Tensor in_stats_dtype(const at::Tensor& block, at::ScalarType acc) {
  return block.scalar_type() == acc ? block : block.to(acc);
}

template <typename scalar_t, typename acc_t>
void fold_targets(const at::Tensor& x, int64_t row0, int64_t col_begin, const int64_t* target_data,
                  const acc_t* w_data, acc_t* stats_data) {
  const int64_t rows = x.size(0), cols = x.size(1);
  const scalar_t* x_data = x.const_data_ptr<scalar_t>();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = target_data[row0 + r] - col_begin;
    if (t < 0 || t >= cols) continue;
    acc_t* s = stats_data + (row0 + r) * kNumRowStats;
    s[kRowTargetLogit] = static_cast<acc_t>(x_data[r * cols + t]);
    s[kRowTargetWeight] = w_data ? w_data[col_begin + t] : acc_t(1);
  }
}

// The shift of a row's exp(x - shift): its max, or 0 where that is -inf (a
// row whose logits are all -inf keeps max -inf and sum 0, and (-inf) - (-inf)
// stays out).
at::Tensor exp_shift(const at::Tensor& row_max) {
  return at::where(at::isneginf(row_max), at::zeros_like(row_max), row_max);
}

// A probability target's sums and gradient term as loops over its rows in
// its own dtype (vector_isa.h), next to the row pass's block in cache: ATen
// would cast the target (a copy), weight it (another) and reduce, each an op
// with its own overhead per block of rows. The sums go in float64 lanes: the
// lanes let the loop vectorise, and float64 keeps a row's one large
// probability from swallowing the many small ones after it (float32 lanes
// were 5e-7 off on a row of 0.997 and 2999 x 1e-6).
constexpr int64_t kProbabilityLanes = 8;

// a += sum_j w_j p_j, b += sum_j w_j p_j d_j over one row (w null: all 1).
template <bool kWeighted, typename acc_t, typename prob_t>
SHARDTORCH_INLINE_KERNEL void probability_row_sums(const acc_t* __restrict d,
                                                   const prob_t* __restrict p,
                                                   const acc_t* __restrict w, int64_t cols,
                                                   acc_t* a_out, acc_t* b_out) {
  double a[kProbabilityLanes] = {}, b[kProbabilityLanes] = {};
  int64_t k = 0;
  for (; k + kProbabilityLanes <= cols; k += kProbabilityLanes) {
    for (int64_t l = 0; l < kProbabilityLanes; ++l) {
      const acc_t pk = static_cast<acc_t>(p[k + l]);
      const double wp = static_cast<double>(pk) * (kWeighted ? static_cast<double>(w[k + l]) : 1.0);
      a[l] += wp;
      b[l] += wp * static_cast<double>(d[k + l]);
    }
  }
  double a_sum = 0, b_sum = 0;
  for (; k < cols; ++k) {
    const acc_t pk = static_cast<acc_t>(p[k]);
    const double wp = static_cast<double>(pk) * (kWeighted ? static_cast<double>(w[k]) : 1.0);
    a_sum += wp;
    b_sum += wp * static_cast<double>(d[k]);
  }
  for (int64_t l = 0; l < kProbabilityLanes; ++l) {
    a_sum += a[l];
    b_sum += b[l];
  }
  *a_out = static_cast<acc_t>(static_cast<double>(*a_out) + a_sum);
  *b_out = static_cast<acc_t>(static_cast<double>(*b_out) + b_sum);
}
template <typename acc_t, typename prob_t>
SHARDTORCH_INLINE_KERNEL void probability_sums(const acc_t* d, const prob_t* p, int64_t p_stride,
                                               const acc_t* w, int64_t rows, int64_t cols,
                                               acc_t* stats) {
  for (int64_t r = 0; r < rows; ++r) {
    acc_t* s = stats + r * kNumRowStats;
    if (w != nullptr) {
      probability_row_sums<true>(d + r * cols, p + r * p_stride, w, cols, &s[kRowTargetWeight],
                                 &s[kRowTargetLogit]);
    } else {
      probability_row_sums<false>(d + r * cols, p + r * p_stride, w, cols, &s[kRowTargetWeight],
                                  &s[kRowTargetLogit]);
    }
  }
}
SHARDTORCH_ISA_VARIANTS(run_probability_sums, probability_sums)

// g_ij -= scale_i w_j p_ij (w null: all 1), in the stats dtype.
template <typename acc_t, typename prob_t>
SHARDTORCH_INLINE_KERNEL void subtract_probability_term(acc_t* __restrict g,
                                                        const prob_t* __restrict p,
                                                        int64_t p_stride, const acc_t* __restrict w,
                                                        const acc_t* coefs, int64_t rows,
                                                        int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    const acc_t scale = coefs[r * kNumGradCoefs + kCoefTargetScale];
    acc_t* __restrict gr = g + r * cols;
    const prob_t* __restrict pr = p + r * p_stride;
    if (w != nullptr) {
      for (int64_t k = 0; k < cols; ++k) gr[k] -= scale * w[k] * static_cast<acc_t>(pr[k]);
    } else {
      for (int64_t k = 0; k < cols; ++k) gr[k] -= scale * static_cast<acc_t>(pr[k]);
    }
  }
}
SHARDTORCH_ISA_VARIANTS(run_subtract_probability_term, subtract_probability_term)

// Rows [row0, row0 + n) of a chunk of a probability target, with adjacent
// columns (a target that has none is copied a block at a time), and f(data,
// row stride) in its own dtype.
template <typename F>
void with_probability_block(const at::Tensor& probs, int64_t row0, int64_t n, int64_t col_begin,
                            int64_t cols, const F& f) {
  at::Tensor p = probs.narrow(0, row0, n).narrow(1, col_begin, cols);
  if (cols > 1 && p.stride(1) != 1) p = p.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, p.scalar_type(),
                                  "parallel_cross_entropy_probabilities_cpu",
                                  [&] { f(p.const_data_ptr<scalar_t>(), p.stride(0)); });
}

// `leave_exp`: the logits (in the stats dtype) become exp(x - shift) in place
// (CrossEntropyKernels::accumulate_row_stats_leaving_exp). `probs`: a
// probability target's sums (accumulate_row_stats) in the same blocks, while
// the logits and x - shift are in cache.
template <typename scalar_t, typename acc_t>
void accumulate_rows(const at::Tensor& logits, int64_t col_begin, const at::Tensor& target_local,
                     const at::Tensor& probs, const at::Tensor& weight_local,
                     const at::Tensor& stats, const at::Tensor& copy_to, bool leave_exp) {
  const int64_t rows = logits.size(0), cols = logits.size(1);
  if (rows == 0 || cols == 0) return;
  const at::ScalarType acc = stats.scalar_type();
  const at::Tensor w_cols =
      weight_local.defined() ? weight_local.narrow(0, col_begin, cols) : at::Tensor();
  const int64_t step = rows_per_block(cols, kBlockElements);
  // exp(x - max) of a block, one buffer for all blocks: a fresh one per block
  // (2 MiB at 500k columns) cost more than the exp itself.
  at::Tensor shifted_storage;
  if (!leave_exp) {
    shifted_storage = at::empty({std::min(step, rows), cols}, logits.options().dtype(acc));
  }
  for (int64_t row0 = 0; row0 < rows; row0 += step) {
    const int64_t n = std::min(step, rows - row0);
    const at::Tensor x = logits.narrow(0, row0, n);
    if (copy_to.defined()) copy_to.narrow(0, row0, n).copy_(x);
    const at::Tensor xa = in_stats_dtype(x, acc);
    at::Tensor s = stats.narrow(0, row0, n);
    at::Tensor run_max = s.select(1, kRowMax), run_sum = s.select(1, kRowSumExp);
    // The passes that read the logits themselves come first: with
    // `leave_exp` the exp overwrites them.
    s.select(1, kRowWeightedSum).add_(w_cols.defined() ? at::mv(xa, w_cols) : xa.sum(1));
    fold_targets<scalar_t, acc_t>(
        x, row0, col_begin, target_local.const_data_ptr<int64_t>(),
        weight_local.defined() ? weight_local.const_data_ptr<acc_t>() : nullptr,
        stats.data_ptr<acc_t>());
    // Merge this block's max and sum-exp into the running ones (a shard may
    // come in column chunks).
    const at::Tensor new_max = at::maximum(run_max, xa.amax(1));
    const at::Tensor shift = exp_shift(new_max);
    at::Tensor shifted = leave_exp ? xa : shifted_storage.narrow(0, 0, n);
    at::sub_out(shifted, xa, shift.unsqueeze(1));
    if (probs.defined()) {
      // A += sum w p; B, relative to the shift, += sum w p (x - shift) after
      // moving the running B to the new shift: terms of one sign where p and
      // w are not negative, so neither sum cancels (cross_entropy_kernels.h).
      // A masked (-inf) logit under a zero probability makes B NaN, as torch's
      // -(p * log_softmax) is.
      at::Tensor run_a = s.select(1, kRowTargetWeight), run_b = s.select(1, kRowTargetLogit);
      run_b.sub_(run_a * (shift - exp_shift(run_max)));
      const acc_t* d = shifted.const_data_ptr<acc_t>();
      const acc_t* w = w_cols.defined() ? w_cols.const_data_ptr<acc_t>() : nullptr;
      acc_t* s_data = s.data_ptr<acc_t>();
      with_probability_block(probs, row0, n, col_begin, cols, [&](const auto* p, int64_t stride) {
        run_probability_sums(d, p, stride, w, n, cols, s_data);
      });
    }
    const at::Tensor block_sum = shifted.exp_().sum(1);
    run_sum.mul_(at::sub(run_max, shift).exp_()).add_(block_sum);
    run_max.copy_(new_max);
  }
}

// `stats` defined: the values are exp(x - exp_shift(max)) as accumulate_rows
// left them with `leave_exp`, and `stats` what it wrote.
template <typename scalar_t, typename acc_t>
void softmax_grad_rows(const at::Tensor& values, int64_t col_begin, const at::Tensor& target_local,
                       const at::Tensor& probs, const at::Tensor& weight_local,
                       const at::Tensor& coefs, const at::Tensor& stats) {
  const int64_t rows = values.size(0), cols = values.size(1);
  if (rows == 0 || cols == 0) return;
  const at::ScalarType acc = coefs.scalar_type();
  const at::Tensor w_cols =
      weight_local.defined() ? weight_local.narrow(0, col_begin, cols) : at::Tensor();
  const int64_t* target_data = target_local.const_data_ptr<int64_t>();
  const acc_t* c_data = coefs.const_data_ptr<acc_t>();
  const int64_t step = rows_per_block(cols, kBlockElements);
  for (int64_t row0 = 0; row0 < rows; row0 += step) {
    const int64_t n = std::min(step, rows - row0);
    at::Tensor v = values.narrow(0, row0, n);
    at::Tensor g = in_stats_dtype(v, acc);
    const at::Tensor c = coefs.narrow(0, row0, n);
    const at::Tensor grad_scale = c.select(1, kCoefGradScale);
    if (stats.defined()) {
      // exp(x - lse) = exp(x - m) exp(m - lse), the second a factor per row,
      // from the max itself: a row all -inf here holds exp(-inf - 0) = 0 and
      // gets factor exp(-inf - lse) = 0, not the exp(0 - lse) of its shift,
      // which overflows where lse < -88 (float32); a +inf max makes lse NaN
      // (its sum-exp is), and so the row, as exp(x - lse) does.
      const at::Tensor row_max = stats.select(1, kRowMax).narrow(0, row0, n);
      const at::Tensor factor =
          (row_max - c.select(1, kCoefLse) - c.select(1, kCoefLseRemainder)).exp_() * grad_scale;
      g.mul_(factor.unsqueeze(1));
    } else {
      g.sub_(c.select(1, kCoefLse).unsqueeze(1))
          .sub_(c.select(1, kCoefLseRemainder).unsqueeze(1))
          .exp_()
          .mul_(grad_scale.unsqueeze(1));
    }
    // The label smoothing's term, a pass over the block, only where a row
    // has one (without smoothing x - 0 == x: nothing to do).
    bool smoothing = false;
    for (int64_t r = 0; r < n && !smoothing; ++r) {
      smoothing = c_data[(row0 + r) * kNumGradCoefs + kCoefSmoothScale] != acc_t(0);
    }
    if (smoothing) {
      const at::Tensor smooth = c.select(1, kCoefSmoothScale).unsqueeze(1);
      if (w_cols.defined()) {
        g.addcmul_(smooth, w_cols.unsqueeze(0), -1);
      } else {
        g.sub_(smooth);
      }
    }
    if (probs.defined()) {
      // - g (1 - e) w_j p_j, in the stats dtype before the one rounding into v.
      acc_t* g_out = g.data_ptr<acc_t>();
      const acc_t* w = w_cols.defined() ? w_cols.const_data_ptr<acc_t>() : nullptr;
      const acc_t* c_rows = c_data + row0 * kNumGradCoefs;
      with_probability_block(probs, row0, n, col_begin, cols, [&](const auto* p, int64_t stride) {
        run_subtract_probability_term(g_out, p, stride, w, c_rows, n, cols);
      });
    }
    acc_t* g_data = g.data_ptr<acc_t>();
    for (int64_t r = 0; r < n; ++r) {
      const acc_t* cr = c_data + (row0 + r) * kNumGradCoefs;
      acc_t* gr = g_data + r * cols;
      // An ignored row (all three 0; a probability row whose w p sums to 0
      // has grad_scale 0 alone and keeps its probability term).
      if (cr[kCoefGradScale] == acc_t(0) && cr[kCoefSmoothScale] == acc_t(0) &&
          cr[kCoefTargetScale] == acc_t(0)) {
        std::fill(gr, gr + cols, acc_t(0));  // whatever its logits were (inf * 0 is nan)
        continue;
      }
      const int64_t t = target_data[row0 + r] - col_begin;  // outside [0, cols): not here
      if (t >= 0 && t < cols) gr[t] -= cr[kCoefTargetScale];
    }
    if (!g.is_same(v)) v.copy_(g);
  }
}

class CpuCrossEntropyKernels final : public CrossEntropyKernels {
 public:
  void accumulate_row_stats(const at::Tensor& logits, int64_t col_begin,
                            const at::Tensor& target_local, const at::Tensor& target_probs,
                            const at::Tensor& weight_local, const at::Tensor& stats,
                            const at::Tensor& copy_to) const override {
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, logits.scalar_type(), "parallel_cross_entropy_forward_cpu", [&] {
          using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
          accumulate_rows<scalar_t, acc_t>(logits, col_begin, target_local, target_probs,
                                           weight_local, stats, copy_to, /*leave_exp=*/false);
        });
  }

  bool accumulate_row_stats_leaving_exp(const at::Tensor& logits, const at::Tensor& target_local,
                                        const at::Tensor& target_probs,
                                        const at::Tensor& weight_local,
                                        const at::Tensor& stats) const override {
    if (logits.scalar_type() != stats.scalar_type()) return false;
    AT_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "parallel_cross_entropy_forward_cpu", [&] {
      accumulate_rows<scalar_t, scalar_t>(logits, 0, target_local, target_probs, weight_local,
                                          stats, at::Tensor(), /*leave_exp=*/true);
    });
    return true;
  }

  void softmax_grad_inplace(const at::Tensor& values, int64_t col_begin,
                            const at::Tensor& target_local, const at::Tensor& target_probs,
                            const at::Tensor& weight_local,
                            const at::Tensor& coefs) const override {
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, values.scalar_type(), "parallel_cross_entropy_backward_cpu", [&] {
          using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
          softmax_grad_rows<scalar_t, acc_t>(values, col_begin, target_local, target_probs,
                                             weight_local, coefs, at::Tensor());
        });
  }

  void softmax_grad_from_exp_inplace(const at::Tensor& values, const at::Tensor& target_local,
                                     const at::Tensor& target_probs, const at::Tensor& weight_local,
                                     const at::Tensor& coefs,
                                     const at::Tensor& stats) const override {
    AT_DISPATCH_FLOATING_TYPES(values.scalar_type(), "parallel_cross_entropy_backward_cpu", [&] {
      softmax_grad_rows<scalar_t, scalar_t>(values, 0, target_local, target_probs, weight_local,
                                            coefs, stats);
    });
  }

  at::Tensor chunk_logits(const at::Tensor& x, const at::Tensor& w_chunk,
                          const at::Tensor& bias_chunk, at::ScalarType out) const override {
    if (x.scalar_type() == out && w_chunk.scalar_type() == out &&
        (!bias_chunk.defined() || bias_chunk.scalar_type() == out)) {
      // Written straight into a scratch buffer advised for huge pages
      // (scratch_buffer.h), the last calls' when free (recycled_buffers.h).
      static BufferSlot* const slot = new BufferSlot();
      at::Tensor logits =
          slot->take({x.size(0), w_chunk.size(0)}, x.options(), empty_scratch_buffer);
      if (bias_chunk.defined()) {
        cpu_addmm_out(logits, bias_chunk, x, w_chunk.t());
      } else {
        cpu_mm_out(logits, x, w_chunk.t());
      }
      return logits;
    }
    // No CPU GEMM returns float32 from float16/bfloat16 operands (it
    // accumulates in float32 inside and rounds its output): one rounding.
    at::Tensor logits =
        bias_chunk.defined() ? at::addmm(bias_chunk, x, w_chunk.t()) : at::mm(x, w_chunk.t());
    return logits.scalar_type() == out ? logits : logits.to(out);
  }

  // The GEMM writes into the block's columns where the dtypes allow; a
  // reduced-precision product is cast by the one copy into them.
  void chunk_logits_into(at::Tensor& out, const at::Tensor& x,
                         const at::Tensor& w_chunk) const override {
    if (w_chunk.scalar_type() == out.scalar_type()) {
      cpu_mm_out(out, x, w_chunk.t());
    } else {
      out.copy_(at::mm(x, w_chunk.t()));
    }
  }

  void add_product(at::Tensor& acc, const at::Tensor& a, const at::Tensor& b) const override {
    if (acc.scalar_type() == a.scalar_type()) {
      cpu_addmm_(acc, a, b);
    } else {
      acc.add_(at::mm(a, b));
    }
  }

  void write_product(at::Tensor& out, const at::Tensor& a, const at::Tensor& b) const override {
    if (out.scalar_type() == a.scalar_type()) {
      cpu_mm_out(out, a, b);
    } else {
      out.copy_(at::mm(a, b));  // one rounding, as chunk_logits
    }
  }

  void gather_scaled_unit_rows(at::Tensor& out, at::Tensor& norms, const at::Tensor& weight,
                               const at::Tensor& kept, double scale, double eps) const override {
    if (gather_scaled_unit_rows_cpu(out, norms, weight, kept, scale, eps)) return;
    CrossEntropyKernels::gather_scaled_unit_rows(out, norms, weight, kept, scale, eps);
  }

  void project_out_rows(at::Tensor& grad_rows, const at::Tensor& rows, const at::Tensor& a,
                        const at::Tensor& b, at::ScalarType acc) const override {
    if (margin_project_rows_cpu(grad_rows, rows, a, b)) return;
    CrossEntropyKernels::project_out_rows(grad_rows, rows, a, b, acc);
  }
};

}  // namespace

// The three losses that run on these kernels, each with its internal ops.
TORCH_LIBRARY_IMPL(shard, CPU, m) {
  CrossEntropyKernelAdapter<CpuCrossEntropyKernels>::register_parallel_cross_entropy(m);
  CrossEntropyKernelAdapter<CpuCrossEntropyKernels>::register_parallel_linear_cross_entropy(m);
  MarginCrossEntropyKernelAdapter<
      CpuCrossEntropyKernels>::register_parallel_linear_margin_cross_entropy(m);
}

}  // namespace ops
}  // namespace shardtorch
