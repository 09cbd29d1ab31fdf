#include "ops/scratch_buffer.h"

#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace shardtorch {
namespace ops {

at::Tensor empty_scratch_buffer(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor out = at::empty(sizes, options);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (out.is_cpu() && static_cast<int64_t>(out.nbytes()) >= kHugePageAdviceBytes) {
    constexpr uintptr_t kHugePage = uintptr_t(2) << 20;
    const auto begin = reinterpret_cast<uintptr_t>(out.data_ptr());
    const uintptr_t first = (begin + kHugePage - 1) & ~(kHugePage - 1);
    const uintptr_t last = (begin + out.nbytes()) & ~(kHugePage - 1);
    // A hint: its failure (no THP in this kernel) leaves the buffer as it was.
    if (last > first) (void)madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
  }
#endif
  return out;
}

at::Tensor empty_prefaulted(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor out = at::empty(sizes, options);
#if defined(__linux__)
  if (out.is_cpu() && static_cast<int64_t>(out.nbytes()) >= kHugePageAdviceBytes) {
    // The Linux ABI's value, for C libraries whose headers predate it.
    constexpr int kPopulateWrite =
#if defined(MADV_POPULATE_WRITE)
        MADV_POPULATE_WRITE;
#else
        23;
#endif
    constexpr uintptr_t kPage = 4096;
    const auto begin = reinterpret_cast<uintptr_t>(out.data_ptr());
    const uintptr_t first = (begin + kPage - 1) & ~(kPage - 1);
    const uintptr_t last = (begin + out.nbytes()) & ~(kPage - 1);
    // A hint: its failure (an older kernel) leaves the pages to fault as before.
    if (last > first) (void)madvise(reinterpret_cast<void*>(first), last - first, kPopulateWrite);
  }
#endif
  return out;
}

}  // namespace ops
}  // namespace shardtorch
