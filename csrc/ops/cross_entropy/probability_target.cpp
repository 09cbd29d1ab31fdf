#include "ops/cross_entropy/probability_target.h"

#include <ATen/ATen.h>

namespace shardtorch {
namespace ops {

bool is_probability_target(const at::Tensor& target) {
  return at::isFloatingType(target.scalar_type());
}

int64_t probability_target_rows(const at::Tensor& target) {
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < target.dim(); ++d) rows *= target.size(d);
  return rows;
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
