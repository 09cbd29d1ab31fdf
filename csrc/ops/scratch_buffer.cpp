#include "ops/scratch_buffer.h"

#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace shardtorch {
namespace ops {
namespace {

#if defined(__linux__)
// madvise(advice) over the whole `page`-sized pages inside a large CPU
// buffer (none of a neighbour's). A hint: its failure (a kernel without THP
// or without MADV_POPULATE_WRITE) leaves the buffer as it was.
void advise_large_buffer(const at::Tensor& buffer, uintptr_t page, int advice) {
  if (!buffer.is_cpu() || static_cast<int64_t>(buffer.nbytes()) < kHugePageAdviceBytes) return;
  const auto begin = reinterpret_cast<uintptr_t>(buffer.data_ptr());
  const uintptr_t first = (begin + page - 1) & ~(page - 1);
  const uintptr_t last = (begin + buffer.nbytes()) & ~(page - 1);
  if (last > first) (void)madvise(reinterpret_cast<void*>(first), last - first, advice);
}
#endif

}  // namespace

at::Tensor empty_scratch_buffer(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor out = at::empty(sizes, options);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  advise_large_buffer(out, uintptr_t(2) << 20, MADV_HUGEPAGE);
#endif
  return out;
}

at::Tensor empty_prefaulted(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor out = at::empty(sizes, options);
#if defined(__linux__)
  // The Linux ABI's value, for C libraries whose headers predate it.
#if defined(MADV_POPULATE_WRITE)
  constexpr int kPopulateWrite = MADV_POPULATE_WRITE;
#else
  constexpr int kPopulateWrite = 23;
#endif
  advise_large_buffer(out, 4096, kPopulateWrite);
#endif
  return out;
}

}  // namespace ops
}  // namespace shardtorch
