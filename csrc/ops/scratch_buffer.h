#pragma once
// Large buffers an op allocates on every call and writes whole at once:
// scratch it frees before it returns (a block of logits, the gathered kept
// rows), and outputs (a weight gradient).
#include <ATen/ATen.h>

namespace shardtorch {
namespace ops {

// at::empty, and on a Linux CPU a buffer of at least kHugePageAdviceBytes is
// advised to be backed by transparent huge pages before its first touch.
// Why: such a buffer is a fresh mapping on every call (glibc maps anything
// above 32 MiB anew and unmaps it when freed), so writing it first costs a
// page fault and a zeroed page per 4 KiB: 35 ms per 100 MB on one core, a
// third of a GEMM that writes it; huge pages take one fault per 2 MiB. The
// advice is a hint on the buffer's own whole 2 MiB pages only: where the
// kernel ignores it (THP "never") nothing changes. Memory use is the same
// (the buffer is written whole) and stays accounted by torch's allocator.
// Only scratch: advising the weight gradient too (which the caller keeps)
// was slower on this project's (virtual) machines, at 100 MB and 1 GB alike,
// while the scratch buffers' advice kept its gain (benchmarks/results/margin.md).
at::Tensor empty_scratch_buffer(at::IntArrayRef sizes, const at::TensorOptions& options);

constexpr int64_t kHugePageAdviceBytes = int64_t(4) << 20;

// at::empty for an output the op writes whole at once and hands to its caller
// (the weight gradient): on a Linux CPU a buffer of at least
// kHugePageAdviceBytes has its pages made present in a call per 16 MiB slice,
// the slices across the op's threads (MADV_POPULATE_WRITE, Linux 5.14; a
// hint, ignored where the kernel lacks it) instead of one fault per page in
// the GEMM that writes it. No huge
// pages (see above), no more memory than the write would take anyway. Measured
// on one core (a /tmp microbenchmark): 100 MB fresh written in 50 ms, 40 ms
// populated first; 1 GB in 410-490 ms, 353 ms.
at::Tensor empty_prefaulted(at::IntArrayRef sizes, const at::TensorOptions& options);

}  // namespace ops
}  // namespace shardtorch
