#pragma once
// The checks the row-sparse update ops (shard::_row_sparse_sgd_,
// shard::_row_sparse_adam_) make alike; every message names the op, the
// argument, the rule and the value.
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>

#include <initializer_list>

namespace shardtorch {
namespace ops {

// param: a contiguous [rows, columns] tensor.
inline void check_row_sparse_param(const char* op, const at::Tensor& param) {
  TORCH_CHECK(param.dim() == 2 && param.is_contiguous(), op,
              ": param must be a contiguous [rows, columns] tensor, got shape ", param.sizes());
}

// rows: 1-D int64; grad: contiguous [len(rows), param.size(1)] in param's dtype.
inline void check_row_sparse_rows_and_grad(const char* op, const at::Tensor& param,
                                           const at::Tensor& rows, const at::Tensor& grad) {
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong, op,
              ": rows must be a 1-D int64 tensor, got ", rows.scalar_type(), " of shape ",
              rows.sizes());
  TORCH_CHECK(grad.dim() == 2 && grad.size(0) == rows.size(0) && grad.size(1) == param.size(1) &&
                  grad.is_contiguous() && grad.scalar_type() == param.scalar_type(),
              op, ": grad must be contiguous [len(rows), param.size(1)] = [", rows.size(0), ", ",
              param.size(1), "] in param's dtype ", param.scalar_type(), ", got ",
              grad.scalar_type(), " of shape ", grad.sizes());
}

// A state tensor `name` (momentum, moments): contiguous, shaped and typed like param.
inline void check_row_sparse_state(const char* op, const char* name, const at::Tensor& state,
                                   const at::Tensor& param) {
  TORCH_CHECK(state.sizes() == param.sizes() && state.is_contiguous() &&
                  state.scalar_type() == param.scalar_type(),
              op, ": ", name, " must be contiguous, shaped and typed like param ", param.sizes(),
              " ", param.scalar_type(), ", got ", state.sizes(), " ", state.scalar_type());
}

// The CPU kernels read and write their tensors through restrict pointers: no
// two of them may share memory.
inline void check_row_sparse_disjoint(std::initializer_list<const at::Tensor*> tensors) {
  for (auto a = tensors.begin(); a != tensors.end(); ++a) {
    for (auto b = a + 1; b != tensors.end(); ++b) at::assert_no_overlap(**a, **b);
  }
}

// The CPU kernels' row indices (`index`: contiguous int64): strictly
// increasing in [0, total), which is what lets the rows be updated in
// parallel in place. Returns their data.
inline const int64_t* strictly_increasing_rows(const char* op, const at::Tensor& index,
                                               int64_t total) {
  const int64_t* r = index.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < index.numel(); ++i) {
    TORCH_CHECK(r[i] >= 0 && r[i] < total && (i == 0 || r[i] > r[i - 1]), op,
                ": rows must be strictly increasing indices in [0, ", total, "), got ", r[i],
                " at position ", i, (i > 0 ? c10::str(" after ", r[i - 1]) : ""));
  }
  return r;
}

}  // namespace ops
}  // namespace shardtorch
