// shard::_row_sparse_sgd_ on CPU: each kept row updated in place in one pass
// (no gathered copies of the rows, their momentum or the result).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "ops/row_sparse_checks.h"
#include "ops/row_sparse_sgd.h"

namespace shardtorch {
namespace ops {
namespace {

struct SgdSettings {
  double lr, momentum, weight_decay;
  bool nesterov;
};

// One row of `columns` values: the vectorised loop for float/double, the rest
// (and float16/bfloat16, in float) element by element.
template <typename scalar_t>
void update_row(scalar_t* p, scalar_t* buf, const scalar_t* g, int64_t columns,
                const SgdSettings& s) {
  using opmath_t = at::opmath_type<scalar_t>;
  const opmath_t lr = s.lr, momentum = s.momentum, wd = s.weight_decay;
  int64_t j = 0;
  if constexpr (std::is_same_v<scalar_t, opmath_t>) {
    using Vec = at::vec::Vectorized<scalar_t>;
    const Vec lr_v(lr), momentum_v(momentum), wd_v(wd);
    for (; j + Vec::size() <= columns; j += Vec::size()) {
      Vec d = Vec::loadu(g + j);
      const Vec pv = Vec::loadu(p + j);
      if (s.weight_decay != 0) d = d + pv * wd_v;
      if (buf != nullptr) {
        const Vec b = Vec::loadu(buf + j) * momentum_v + d;
        b.store(buf + j);
        d = s.nesterov ? d + b * momentum_v : b;
      }
      (pv - d * lr_v).store(p + j);
    }
  }
  for (; j < columns; ++j) {
    opmath_t d = static_cast<opmath_t>(g[j]);
    const opmath_t pv = static_cast<opmath_t>(p[j]);
    if (s.weight_decay != 0) d = d + pv * wd;
    if (buf != nullptr) {
      const opmath_t b = static_cast<opmath_t>(buf[j]) * momentum + d;
      buf[j] = static_cast<scalar_t>(b);
      d = s.nesterov ? d + b * momentum : b;
    }
    p[j] = static_cast<scalar_t>(pv - d * lr);
  }
}

void row_sparse_sgd_cpu(const at::Tensor& param, const std::optional<at::Tensor>& momentum_buffer,
                        const at::Tensor& rows, const at::Tensor& grad, double lr, double momentum,
                        double weight_decay, bool nesterov) {
  check_row_sparse_sgd_args(param, momentum_buffer, rows, grad, momentum);
  const int64_t n = rows.numel(), total = param.size(0), columns = param.size(1);
  const at::Tensor index = rows.contiguous();
  const int64_t* r = strictly_increasing_rows("shard::_row_sparse_sgd_", index, total);
  const SgdSettings settings{lr, momentum, weight_decay, nesterov};
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, param.scalar_type(), "shard::_row_sparse_sgd_", [&] {
        scalar_t* p = param.data_ptr<scalar_t>();
        scalar_t* buf = momentum != 0 ? momentum_buffer->data_ptr<scalar_t>() : nullptr;
        const scalar_t* g = grad.const_data_ptr<scalar_t>();
        const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(columns, 1));
        at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i) {
            update_row(p + r[i] * columns, buf == nullptr ? nullptr : buf + r[i] * columns,
                       g + i * columns, columns, settings);
          }
        });
      });
}

}  // namespace

TORCH_LIBRARY_IMPL(shard, CPU, m) { m.impl("_row_sparse_sgd_", TORCH_FN(row_sparse_sgd_cpu)); }

}  // namespace ops
}  // namespace shardtorch
