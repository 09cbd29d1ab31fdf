#pragma once
// One-pass CPU kernels over the margin head's weight rows (float and double
// rows with unit stride), where ATen would read a weight-sized operand twice.
// Each returns false where it does not apply (another device or dtype, rows
// not contiguous): the caller then takes ATen's way.
#include <ATen/ATen.h>

namespace shardtorch {
namespace ops {

// The kept rows, normalised and scaled, in one pass over each:
// out[k] = weight[kept[k]] * scale / max(|weight[kept[k]]|, eps), and
// norms[k] = |weight[kept[k]]| (unclamped, in the rows' dtype).
// out [kept, features] and norms [kept] are written whole.
bool gather_scaled_unit_rows_cpu(at::Tensor& out, at::Tensor& norms, const at::Tensor& weight,
                                 const at::Tensor& kept, double scale, double eps);

// grad_rows [n, features] = a_j grad_rows_j - b_j (rows_j . grad_rows_j) rows_j
// per row j, the dot taken before the update; `a` undefined is 1. One pass
// over each row: it stays in cache between its dot and its update.
bool margin_project_rows_cpu(at::Tensor& grad_rows, const at::Tensor& rows, const at::Tensor& a,
                             const at::Tensor& b);

}  // namespace ops
}  // namespace shardtorch
