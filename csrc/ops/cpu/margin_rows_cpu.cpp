#include "ops/cpu/margin_rows_cpu.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <cmath>

#include "ops/cpu/vector_isa.h"

namespace shardtorch {
namespace ops {
namespace {

// Partial sums in lanes, so that the dot vectorises (one running sum would be
// a chain of dependent additions).
constexpr int64_t kMarginRowDotLanes = 16;

template <typename T>
SHARDTORCH_INLINE_KERNEL T margin_row_dot(const T* __restrict a, const T* __restrict b, int64_t n) {
  T lanes[kMarginRowDotLanes] = {};
  int64_t k = 0;
  for (; k + kMarginRowDotLanes <= n; k += kMarginRowDotLanes) {
    for (int64_t l = 0; l < kMarginRowDotLanes; ++l) lanes[l] += a[k + l] * b[k + l];
  }
  T sum = 0;
  for (; k < n; ++k) sum += a[k] * b[k];
  for (int64_t l = 0; l < kMarginRowDotLanes; ++l) sum += lanes[l];
  return sum;
}

// Rows [k0, k1) of the gather: out[k] = w[index[k]] * scale / max(|.|, eps).
// The next kept row is asked for while one is read: 50,000 of 500,000 rows of
// 512 floats took 22 to 43 ms without, 13 to 15 ms with (a Zen 5 core).
template <typename T>
SHARDTORCH_INLINE_KERNEL void gather_scaled_unit_rows(T* __restrict out, T* __restrict norms,
                                                      const T* __restrict w, int64_t w_stride,
                                                      const int64_t* index, int64_t features,
                                                      double scale, double eps, int64_t k0,
                                                      int64_t k1) {
  for (int64_t k = k0; k < k1; ++k) {
    if (k + 1 < k1) prefetch_row<kPrefetchToRead>(w + index[k + 1] * w_stride, features);
    const T* __restrict row = w + index[k] * w_stride;
    const T norm = std::sqrt(margin_row_dot(row, row, features));
    norms[k] = norm;
    // As F.normalize: divided by max(norm, eps); the scale rides along.
    const T factor = static_cast<T>(scale / std::max(static_cast<double>(norm), eps));
    T* __restrict o = out + k * features;
    for (int64_t f = 0; f < features; ++f) o[f] = row[f] * factor;
  }
}
SHARDTORCH_ISA_VARIANTS(run_gather_scaled_unit_rows, gather_scaled_unit_rows)

// Rows [r0, r1) of the projection: g = a g - (b (g . w)) w.
template <typename T>
SHARDTORCH_INLINE_KERNEL void project_margin_rows(T* __restrict g_base, int64_t g_stride,
                                                  const T* __restrict w_base, int64_t w_stride,
                                                  const T* a, const T* b, int64_t features,
                                                  int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* __restrict w = w_base + r * w_stride;
    T* __restrict g = g_base + r * g_stride;
    const T along = b[r] == T(0) ? T(0) : margin_row_dot(g, w, features) * b[r];
    if (a == nullptr) {
      if (along == T(0)) continue;
      for (int64_t k = 0; k < features; ++k) g[k] -= along * w[k];
    } else {
      const T keep = a[r];
      for (int64_t k = 0; k < features; ++k) g[k] = keep * g[k] - along * w[k];
    }
  }
}
SHARDTORCH_ISA_VARIANTS(run_project_margin_rows, project_margin_rows)

bool has_unit_stride_rows(const at::Tensor& t) { return t.dim() == 2 && t.stride(1) == 1; }

bool is_float_or_double(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kDouble;
}

}  // namespace

bool gather_scaled_unit_rows_cpu(at::Tensor& out, at::Tensor& norms, const at::Tensor& weight,
                                 const at::Tensor& kept, double scale, double eps) {
  const at::ScalarType dtype = weight.scalar_type();
  if (!weight.is_cpu() || !is_float_or_double(dtype) || out.scalar_type() != dtype ||
      norms.scalar_type() != dtype || !has_unit_stride_rows(weight) || !out.is_contiguous() ||
      !norms.is_contiguous() || !kept.is_cpu() || kept.dim() != 1 ||
      kept.scalar_type() != at::kLong) {
    return false;
  }
  // Seen by the profiler as a gather of the weight's rows, as index_select would be.
  RECORD_FUNCTION("shard::gather_scaled_unit_rows", std::vector<c10::IValue>({weight, kept}));
  const at::Tensor index = kept.contiguous();
  const int64_t n = index.size(0), rows = weight.size(0), features = weight.size(1);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == n && out.size(1) == features && norms.numel() == n,
              "gather_scaled_unit_rows_cpu: out must be [", n, ", ", features, "] and norms [", n,
              "], got ", out.sizes(), " and ", norms.sizes());
  const int64_t* index_of = index.const_data_ptr<int64_t>();
  for (int64_t k = 0; k < n; ++k) {
    TORCH_CHECK(index_of[k] >= 0 && index_of[k] < rows, "kept class ", index_of[k],
                " is not a row of the weight's ", rows);
  }
  AT_DISPATCH_FLOATING_TYPES(dtype, "gather_scaled_unit_rows_cpu", [&] {
    scalar_t* out_base = out.mutable_data_ptr<scalar_t>();
    scalar_t* norm_of = norms.mutable_data_ptr<scalar_t>();
    const scalar_t* w_base = weight.const_data_ptr<scalar_t>();
    const int64_t w_stride = weight.stride(0);
    at::parallel_for(0, n, 64, [&](int64_t k0, int64_t k1) {
      run_gather_scaled_unit_rows(out_base, norm_of, w_base, w_stride, index_of, features, scale,
                                  eps, k0, k1);
    });
  });
  return true;
}

bool margin_project_rows_cpu(at::Tensor& grad_rows, const at::Tensor& rows, const at::Tensor& a,
                             const at::Tensor& b) {
  const at::ScalarType dtype = grad_rows.scalar_type();
  if (!grad_rows.is_cpu() || !is_float_or_double(dtype) || rows.scalar_type() != dtype ||
      b.scalar_type() != dtype || (a.defined() && a.scalar_type() != dtype) ||
      !has_unit_stride_rows(grad_rows) || !has_unit_stride_rows(rows)) {
    return false;
  }
  const int64_t n = rows.size(0);
  TORCH_CHECK(
      grad_rows.sizes() == rows.sizes() && b.numel() == n && (!a.defined() || a.numel() == n),
      "margin_project_rows_cpu: grad_rows must be shaped like rows ", rows.sizes(),
      " and the factors hold one value per row");
  const at::Tensor b_c = b.contiguous();
  const at::Tensor a_c = a.defined() ? a.contiguous() : a;
  const int64_t features = rows.size(1);
  AT_DISPATCH_FLOATING_TYPES(dtype, "margin_project_rows_cpu", [&] {
    const scalar_t* b_of = b_c.const_data_ptr<scalar_t>();
    const scalar_t* a_of = a_c.defined() ? a_c.const_data_ptr<scalar_t>() : nullptr;
    const scalar_t* w_base = rows.const_data_ptr<scalar_t>();
    scalar_t* g_base = grad_rows.mutable_data_ptr<scalar_t>();
    const int64_t w_stride = rows.stride(0), g_stride = grad_rows.stride(0);
    at::parallel_for(0, n, 64, [&](int64_t r0, int64_t r1) {
      run_project_margin_rows(g_base, g_stride, w_base, w_stride, a_of, b_of, features, r0, r1);
    });
  });
  return true;
}

}  // namespace ops
}  // namespace shardtorch
