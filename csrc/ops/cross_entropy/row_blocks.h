#pragma once
// The passes over [rows, classes] data go a block of rows at a time, so that
// their temporaries stay about `block_elements` values whatever the batch.

#include <algorithm>
#include <cstdint>

namespace shardtorch {
namespace ops {

// Rows per block of `columns` columns: at least one.
inline int64_t rows_per_block(int64_t columns, int64_t block_elements) {
  return std::max<int64_t>(1, block_elements / std::max<int64_t>(columns, 1));
}

}  // namespace ops
}  // namespace shardtorch
