#include "ops/scratch_buffer.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <utility>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

namespace shardtorch {
namespace ops {
namespace {

#if defined(__linux__)
// The whole `page`-aligned range inside a large CPU buffer (none of a
// neighbour's), as [first, last); empty where the buffer is small.
std::pair<uintptr_t, uintptr_t> whole_pages(const at::Tensor& buffer, uintptr_t page) {
  if (!buffer.is_cpu() || static_cast<int64_t>(buffer.nbytes()) < kHugePageAdviceBytes)
    return {0, 0};
  const auto begin = reinterpret_cast<uintptr_t>(buffer.data_ptr());
  const uintptr_t first = (begin + page - 1) & ~(page - 1);
  const uintptr_t last = (begin + buffer.nbytes()) & ~(page - 1);
  return last > first ? std::make_pair(first, last) : std::make_pair(uintptr_t(0), uintptr_t(0));
}

// madvise is a hint: its failure (a kernel without THP, or before
// MADV_POPULATE_WRITE) leaves the buffer as it was.
void advise(uintptr_t first, uintptr_t last, int advice) {
  if (last > first) (void)madvise(reinterpret_cast<void*>(first), last - first, advice);
}
#endif

}  // namespace

at::Tensor empty_scratch_buffer(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor out = at::empty(sizes, options);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const auto [first, last] = whole_pages(out, uintptr_t(2) << 20);
  advise(first, last, MADV_HUGEPAGE);
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
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const std::pair<uintptr_t, uintptr_t> range = whole_pages(out, page);
  const uintptr_t first = range.first, last = range.second;
  // In slices across the op's threads, as the threads of a GEMM writing it
  // would fault its pages (each near its own thread's memory).
  const int64_t pages = static_cast<int64_t>((last - first) / page);
  const int64_t slice_pages =
      std::max<int64_t>(1, (int64_t(16) << 20) / static_cast<int64_t>(page));
  at::parallel_for(0, pages, slice_pages, [&](int64_t p0, int64_t p1) {
    advise(first + p0 * page, first + p1 * page, kPopulateWrite);
  });
#endif
  return out;
}

}  // namespace ops
}  // namespace shardtorch
