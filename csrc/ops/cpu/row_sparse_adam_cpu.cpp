// shard::_row_sparse_adam_ on CPU: each kept row updated in place in one pass
// (no gathered copies of the rows, their moments or the update), vectorised
// for the CPU's widest extension.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <type_traits>

#include "ops/cpu/vector_isa.h"
#include "ops/row_sparse_checks.h"
#include "ops/row_sparse_adam.h"

namespace shardtorch {
namespace ops {
namespace {

struct AdamSettings {
  double lr, beta1, beta2, eps, weight_decay;
};

// Bias corrections in float64, as torch's Python floats: -lr / (1 - beta1^t)
// and sqrt(1 - beta2^t).
inline double neg_step_size_at(const AdamSettings& s, int64_t step) {
  return (s.lr / (1 - std::pow(s.beta1, static_cast<double>(step)))) * -1;
}
inline double bias_correction2_sqrt_at(const AdamSettings& s, int64_t step) {
  return std::sqrt(1 - std::pow(s.beta2, static_cast<double>(step)));
}

// lerp(a, b, w): a + w * (b - a) for a small weight, else b - (1 - w) * (b - a).
template <typename T>
bool small_lerp_weight(T weight) {
  return std::abs(weight) < T(0.5);
}

// One float16/bfloat16 row at step `step` (already advanced), element by
// element in float, rounded once per stored value; the roundings of
// adam_rows below.
template <typename scalar_t>
void adam_update_reduced_row(scalar_t* p, scalar_t* m, scalar_t* v, const scalar_t* g,
                             int64_t columns, int64_t step, const AdamSettings& s) {
  using opmath_t = at::opmath_type<scalar_t>;
  const opmath_t neg_step_size = neg_step_size_at(s, step);
  const opmath_t bias_correction2_sqrt = bias_correction2_sqrt_at(s, step);
  const opmath_t wd = s.weight_decay, beta2 = s.beta2, one_minus_beta2 = 1 - s.beta2, eps = s.eps,
                 weight = 1 - s.beta1;
  const bool small_weight = small_lerp_weight(weight);
  const opmath_t coeff = small_weight ? weight : weight - opmath_t(1);
  for (int64_t j = 0; j < columns; ++j) {
    const opmath_t pv = static_cast<opmath_t>(p[j]);
    opmath_t gv = static_cast<opmath_t>(g[j]);
    if (s.weight_decay != 0) gv = std::fma(pv, wd, gv);
    const opmath_t mv = static_cast<opmath_t>(m[j]);
    const opmath_t new_m = std::fma(coeff, gv - mv, small_weight ? mv : gv);
    m[j] = static_cast<scalar_t>(new_m);
    const opmath_t scaled_v = static_cast<opmath_t>(v[j]) * beta2;
    const opmath_t new_v = scaled_v + one_minus_beta2 * gv * gv;
    v[j] = static_cast<scalar_t>(new_v);
    const opmath_t denom = std::sqrt(new_v) / bias_correction2_sqrt + eps;
    p[j] = static_cast<scalar_t>(pv + neg_step_size * new_m / denom);
  }
}

// float/double kept rows [begin, end) of r, each advanced one step and
// updated in place in one loop the compiler vectorises (vector_isa.h: AVX-512
// where the CPU has it), the next row's value and moments asked for while one
// is updated (the rows are scattered: the hardware prefetchers would start
// cold on each). The roundings of torch.optim.Adam's single-tensor passes on
// their vectorised paths: add(alpha) and lerp as a fused multiply-add (written
// out; the compiler may fuse nothing else), mul_ then addcmul_, sqrt, div,
// add, addcdiv's (value * exp_avg) / denom. Decay: std::bool_constant.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif
template <typename T, typename Decay>
SHARDTORCH_INLINE_KERNEL void adam_rows(T* p, T* m, T* v, const T* g, const int64_t* r,
                                        int64_t* steps, int64_t begin, int64_t end, int64_t columns,
                                        const AdamSettings* s, Decay) {
  const T wd = s->weight_decay, beta2 = s->beta2, one_minus_beta2 = 1 - s->beta2, eps = s->eps,
          weight = 1 - s->beta1;
  const bool small_weight = small_lerp_weight(weight);
  const T coeff = small_weight ? weight : weight - T(1);
  for (int64_t i = begin; i < end; ++i) {
    if (i + 1 < end) {
      prefetch_row<kPrefetchToWrite>(p + r[i + 1] * columns, columns);
      prefetch_row<kPrefetchToWrite>(m + r[i + 1] * columns, columns);
      prefetch_row<kPrefetchToWrite>(v + r[i + 1] * columns, columns);
    }
    const int64_t step = ++steps[r[i]];
    const T neg_step_size = neg_step_size_at(*s, step);
    const T bias_correction2_sqrt = bias_correction2_sqrt_at(*s, step);
    T* __restrict pr = p + r[i] * columns;
    T* __restrict mr = m + r[i] * columns;
    T* __restrict vr = v + r[i] * columns;
    const T* __restrict gr = g + i * columns;
    for (int64_t j = 0; j < columns; ++j) {
      const T pv = pr[j];
      T gv = gr[j];
      if constexpr (Decay::value) gv = fused_multiply_add(pv, wd, gv);
      const T mv = mr[j];
      const T new_m = fused_multiply_add(coeff, gv - mv, small_weight ? mv : gv);
      mr[j] = new_m;
      const T scaled_v = vr[j] * beta2;
      const T scaled_g = one_minus_beta2 * gv;
      const T square = scaled_g * gv;
      const T new_v = scaled_v + square;
      vr[j] = new_v;
      const T root = square_root(new_v);
      const T denom = root / bias_correction2_sqrt + eps;
      const T scaled_m = neg_step_size * new_m;
      pr[j] = pv + scaled_m / denom;
    }
  }
}
SHARDTORCH_ISA_VARIANTS(run_adam_rows, adam_rows)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

void row_sparse_adam_cpu(const at::Tensor& param, const at::Tensor& exp_avg,
                         const at::Tensor& exp_avg_sq, const at::Tensor& row_step,
                         const at::Tensor& rows, const at::Tensor& grad, double lr, double beta1,
                         double beta2, double eps, double weight_decay) {
  check_row_sparse_adam_args(param, exp_avg, exp_avg_sq, row_step, rows, grad);
  check_row_sparse_disjoint({&param, &exp_avg, &exp_avg_sq, &grad});
  const int64_t n = rows.numel(), total = param.size(0), columns = param.size(1);
  const at::Tensor index = rows.contiguous();
  const int64_t* r = strictly_increasing_rows("shard::_row_sparse_adam_", index, total);
  const AdamSettings settings{lr, beta1, beta2, eps, weight_decay};
  int64_t* steps = row_step.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, param.scalar_type(), "shard::_row_sparse_adam_", [&] {
        scalar_t* p = param.data_ptr<scalar_t>();
        scalar_t* m = exp_avg.data_ptr<scalar_t>();
        scalar_t* v = exp_avg_sq.data_ptr<scalar_t>();
        const scalar_t* g = grad.const_data_ptr<scalar_t>();
        const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(columns, 1));
        at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
          if constexpr (std::is_floating_point_v<scalar_t>) {
            if (weight_decay != 0) {
              run_adam_rows(p, m, v, g, r, steps, begin, end, columns, &settings, std::true_type{});
            } else {
              run_adam_rows(p, m, v, g, r, steps, begin, end, columns, &settings,
                            std::false_type{});
            }
          } else {
            for (int64_t i = begin; i < end; ++i) {
              const int64_t offset = r[i] * columns;
              adam_update_reduced_row(p + offset, m + offset, v + offset, g + i * columns, columns,
                                      ++steps[r[i]], settings);
            }
          }
        });
      });
}

}  // namespace

TORCH_LIBRARY_IMPL(shard, CPU, m) { m.impl("_row_sparse_adam_", TORCH_FN(row_sparse_adam_cpu)); }

}  // namespace ops
}  // namespace shardtorch
