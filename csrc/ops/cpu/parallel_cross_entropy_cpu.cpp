// Parallel cross-entropy on CPU: the row passes as plain loops (one read of
// each logit per pass, accumulated in float32 or float64), Gloo for the
// collectives, ATen's matrix products for the fused classifier.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

#include "ops/parallel_cross_entropy_entry_points.h"
#include "ops/parallel_cross_entropy_impl.h"

namespace shardtorch {
namespace ops {
namespace {

// Rows per parallel task: enough work to amortise a task.
int64_t rows_per_task(int64_t cols) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(cols, 1)); }

template <typename scalar_t, typename acc_t>
void accumulate_rows(const at::Tensor& logits, int64_t col_begin, const at::Tensor& target_local,
                     const at::Tensor& weight_local, const at::Tensor& stats,
                     const at::Tensor& copy_to) {
  const int64_t rows = logits.size(0), cols = logits.size(1);
  const scalar_t* x_data = logits.const_data_ptr<scalar_t>();
  const int64_t* target_data = target_local.const_data_ptr<int64_t>();
  const acc_t* w_data = weight_local.defined() ? weight_local.const_data_ptr<acc_t>() : nullptr;
  acc_t* stats_data = stats.data_ptr<acc_t>();
  scalar_t* copy_data = copy_to.defined() ? copy_to.data_ptr<scalar_t>() : nullptr;
  constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();

  at::parallel_for(0, rows, rows_per_task(cols), [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const scalar_t* x = x_data + r * cols;
      acc_t* s = stats_data + r * kNumRowStats;
      // Online max / sum-exp: each logit is read once.
      acc_t run_max = s[kRowMax], run_sum = s[kRowSumExp], weighted = 0;
      for (int64_t j = 0; j < cols; ++j) {
        const acc_t v = static_cast<acc_t>(x[j]);
        if (copy_data) copy_data[r * cols + j] = x[j];
        weighted += (w_data ? w_data[col_begin + j] : acc_t(1)) * v;
        if (v > run_max) {
          run_sum = (run_max == kNegInf ? acc_t(0) : run_sum * std::exp(run_max - v)) + acc_t(1);
          run_max = v;
        } else if (v != kNegInf) {
          run_sum += std::exp(v - run_max);
        }
      }
      s[kRowMax] = run_max;
      s[kRowSumExp] = run_sum;
      s[kRowWeightedSum] += weighted;
      const int64_t t = target_data[r] - col_begin;
      if (t >= 0 && t < cols) {
        s[kRowTargetLogit] = static_cast<acc_t>(x[t]);
        s[kRowTargetWeight] = w_data ? w_data[col_begin + t] : acc_t(1);
      }
    }
  });
}

template <typename scalar_t, typename acc_t>
void softmax_grad_rows(const at::Tensor& values, int64_t col_begin, const at::Tensor& target_local,
                       const at::Tensor& weight_local, const at::Tensor& coefs) {
  const int64_t rows = values.size(0), cols = values.size(1);
  scalar_t* v_data = values.data_ptr<scalar_t>();
  const int64_t* target_data = target_local.const_data_ptr<int64_t>();
  const acc_t* w_data = weight_local.defined() ? weight_local.const_data_ptr<acc_t>() : nullptr;
  const acc_t* c_data = coefs.const_data_ptr<acc_t>();

  at::parallel_for(0, rows, rows_per_task(cols), [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      scalar_t* v = v_data + r * cols;
      const acc_t* c = c_data + r * kNumGradCoefs;
      const acc_t lse = c[kCoefLse], grad_scale = c[kCoefGradScale];
      const acc_t smooth = c[kCoefSmoothScale];
      if (grad_scale == acc_t(0) && smooth == acc_t(0)) {  // ignored row
        std::fill(v, v + cols, scalar_t(0));
        continue;
      }
      const int64_t t = target_data[r] - col_begin;  // outside [0, cols): not here
      const acc_t target_scale = c[kCoefTargetScale];
      for (int64_t j = 0; j < cols; ++j) {
        const acc_t p = std::exp(static_cast<acc_t>(v[j]) - lse);
        acc_t g = grad_scale * p - smooth * (w_data ? w_data[col_begin + j] : acc_t(1));
        if (j == t) g -= target_scale;
        v[j] = static_cast<scalar_t>(g);
      }
    }
  });
}

class CpuCrossEntropyKernels final : public CrossEntropyKernels {
 public:
  void accumulate_row_stats(const at::Tensor& logits, int64_t col_begin,
                            const at::Tensor& target_local, const at::Tensor& weight_local,
                            const at::Tensor& stats, const at::Tensor& copy_to) const override {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(),
                                    "parallel_cross_entropy_forward_cpu", [&] {
      using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
      accumulate_rows<scalar_t, acc_t>(logits, col_begin, target_local, weight_local, stats,
                                       copy_to);
    });
  }

  void softmax_grad_inplace(const at::Tensor& values, int64_t col_begin,
                            const at::Tensor& target_local, const at::Tensor& weight_local,
                            const at::Tensor& coefs) const override {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, values.scalar_type(),
                                    "parallel_cross_entropy_backward_cpu", [&] {
      using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
      softmax_grad_rows<scalar_t, acc_t>(values, col_begin, target_local, weight_local, coefs);
    });
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(shard, CPU, m) {
  CrossEntropyEntryPoints<CpuCrossEntropyKernels>::register_kernels(m);
}

}  // namespace ops
}  // namespace shardtorch
