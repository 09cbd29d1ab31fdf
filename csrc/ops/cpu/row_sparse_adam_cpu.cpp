// shard::_row_sparse_adam_ on CPU: each kept row updated in place in one pass
// (no gathered copies of the rows, their moments or the update).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <cmath>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "ops/row_sparse_checks.h"
#include "ops/row_sparse_adam.h"

namespace shardtorch {
namespace ops {
namespace {

struct AdamSettings {
  double lr, beta1, beta2, eps, weight_decay;
};

// sqrt per lane. Where this file is compiled for baseline x86-64, Vectorized is
// the generic one, whose sqrt calls std::sqrt per element (scalar, with errno
// handling): about half the kernel's time. SSE2's sqrtps gives the same
// correctly rounded values four at a time.
template <typename scalar_t>
at::vec::Vectorized<scalar_t> lane_sqrt(const at::vec::Vectorized<scalar_t>& x) {
#if defined(__SSE2__) && !defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)
  using Vec = at::vec::Vectorized<scalar_t>;
  if constexpr (std::is_same_v<scalar_t, float> && Vec::size() % 4 == 0) {
    alignas(64) float lanes[Vec::size()];
    x.store(lanes);
    for (int k = 0; k < Vec::size(); k += 4) {
      _mm_store_ps(lanes + k, _mm_sqrt_ps(_mm_load_ps(lanes + k)));
    }
    return Vec::loadu(lanes);
  } else if constexpr (std::is_same_v<scalar_t, double> && Vec::size() % 2 == 0) {
    alignas(64) double lanes[Vec::size()];
    x.store(lanes);
    for (int k = 0; k < Vec::size(); k += 2) {
      _mm_store_pd(lanes + k, _mm_sqrt_pd(_mm_load_pd(lanes + k)));
    }
    return Vec::loadu(lanes);
  }
#endif
  return x.sqrt();
}

// One row of `columns` values at step `step` (already advanced). The same
// roundings as torch.optim.Adam's single-tensor passes on their vectorised
// paths: add(alpha) and lerp as a fused multiply-add, mul_ then addcmul_,
// sqrt, div, add, addcdiv's (value * exp_avg) / denom. float16/bfloat16 in
// float, rounded once per stored value.
template <typename scalar_t>
void adam_update_row(scalar_t* p, scalar_t* m, scalar_t* v, const scalar_t* g, int64_t columns,
                     int64_t step, const AdamSettings& s) {
  using opmath_t = at::opmath_type<scalar_t>;
  // Bias corrections in float64, as torch's Python floats, then in opmath.
  const double t = static_cast<double>(step);
  const opmath_t neg_step_size = static_cast<opmath_t>((s.lr / (1 - std::pow(s.beta1, t))) * -1);
  const opmath_t bias_correction2_sqrt = static_cast<opmath_t>(std::sqrt(1 - std::pow(s.beta2, t)));
  const opmath_t wd = s.weight_decay, beta2 = s.beta2, one_minus_beta2 = 1 - s.beta2, eps = s.eps,
                 weight = 1 - s.beta1;
  // lerp(a, b, w): a + w * (b - a) for a small weight, else b - (1 - w) * (b - a).
  const bool small_weight = std::abs(weight) < opmath_t(0.5);
  const opmath_t coeff = small_weight ? weight : weight - opmath_t(1);
  int64_t j = 0;
  if constexpr (std::is_same_v<scalar_t, opmath_t>) {
    using Vec = at::vec::Vectorized<scalar_t>;
    const Vec wd_v(wd), beta2_v(beta2), one_minus_beta2_v(one_minus_beta2), eps_v(eps),
        coeff_v(coeff), neg_step_size_v(neg_step_size), bc2_v(bias_correction2_sqrt);
    for (; j + Vec::size() <= columns; j += Vec::size()) {
      const Vec pv = Vec::loadu(p + j);
      Vec gv = Vec::loadu(g + j);
      if (s.weight_decay != 0) gv = at::vec::fmadd(pv, wd_v, gv);
      const Vec mv = Vec::loadu(m + j);
      const Vec new_m = at::vec::fmadd(coeff_v, gv - mv, small_weight ? mv : gv);
      new_m.store(m + j);
      const Vec new_v = Vec::loadu(v + j) * beta2_v + one_minus_beta2_v * gv * gv;
      new_v.store(v + j);
      const Vec denom = lane_sqrt(new_v) / bc2_v + eps_v;
      (pv + neg_step_size_v * new_m / denom).store(p + j);
    }
  }
  for (; j < columns; ++j) {
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

void row_sparse_adam_cpu(const at::Tensor& param, const at::Tensor& exp_avg,
                         const at::Tensor& exp_avg_sq, const at::Tensor& row_step,
                         const at::Tensor& rows, const at::Tensor& grad, double lr, double beta1,
                         double beta2, double eps, double weight_decay) {
  check_row_sparse_adam_args(param, exp_avg, exp_avg_sq, row_step, rows, grad);
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
          for (int64_t i = begin; i < end; ++i) {
            const int64_t offset = r[i] * columns;
            adam_update_row(p + offset, m + offset, v + offset, g + i * columns, columns,
                            ++steps[r[i]], settings);
          }
        });
      });
}

}  // namespace

TORCH_LIBRARY_IMPL(shard, CPU, m) { m.impl("_row_sparse_adam_", TORCH_FN(row_sparse_adam_cpu)); }

}  // namespace ops
}  // namespace shardtorch
