// The device-free defaults of CrossEntropyKernels: ATen operations that run
// on any device, for the kernels that have nothing faster.
#include "ops/cross_entropy/cross_entropy_kernels.h"

#include <ATen/ATen.h>

#include <algorithm>

namespace shardtorch {
namespace ops {

void CrossEntropyKernels::softmax_grad_from_exp_inplace(const at::Tensor&, const at::Tensor&,
                                                        const at::Tensor&, const at::Tensor&,
                                                        const at::Tensor&,
                                                        const at::Tensor&) const {
  TORCH_INTERNAL_ASSERT(false,
                        "softmax_grad_from_exp_inplace without accumulate_row_stats_leaving_exp");
}

void CrossEntropyKernels::gather_scaled_unit_rows(at::Tensor& out, at::Tensor& norms,
                                                  const at::Tensor& weight, const at::Tensor& kept,
                                                  double scale, double eps) const {
  at::index_select_out(out, weight, 0, kept);
  at::linalg_vector_norm_out(norms, out, 2, {1});
  out.mul_((scale / norms.clamp_min(eps)).unsqueeze(1));
}

void CrossEntropyKernels::project_out_rows(at::Tensor& grad_rows, const at::Tensor& rows,
                                           const at::Tensor& a, const at::Tensor& b,
                                           at::ScalarType acc) const {
  // The dots a slice of rows at a time, so that their product stays small
  // (and in cache) instead of growing with the weight.
  constexpr int64_t kDotRows = 256;
  const int64_t n = rows.size(0);
  at::Tensor along = at::empty({n}, b.options());
  for (int64_t r0 = 0; r0 < n; r0 += kDotRows) {
    const int64_t r = std::min(kDotRows, n - r0);
    at::Tensor out = along.narrow(0, r0, r);
    at::sum_out(out, grad_rows.narrow(0, r0, r).mul(rows.narrow(0, r0, r)), {1},
                /*keepdim=*/false, acc);
  }
  along.mul_(b);
  if (a.defined()) grad_rows.mul_(a.unsqueeze(1).to(grad_rows.scalar_type()));
  grad_rows.addcmul_(rows, along.unsqueeze(1).to(grad_rows.scalar_type()), -1.0);
}

}  // namespace ops
}  // namespace shardtorch
