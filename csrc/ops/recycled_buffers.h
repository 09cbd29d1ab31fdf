#pragma once
// Large CPU buffers an op asks for on every call, kept by the op's call site
// for its next call. Why: glibc maps every buffer above 32 MiB anew and
// unmaps it when freed, so each call's fresh buffer costs a page fault and a
// zeroed page per 4 KiB before the op writes it (100 MB: 27 ms of a 42 ms
// write on one core, a fifth of the GEMM that writes a weight gradient of that
// size). CUDA's caching allocator does this for GPU memory already; a slot
// does it for the CPU buffers of one call site only.
//
// A kept buffer is handed out again only when nothing else holds its storage
// (no tensor or view of it, no weak reference): a gradient the caller still
// holds, a block saved for backward, is never written. Memory: a slot keeps
// at most two storages, the ones its call site made last; between steps that
// is the buffers the step makes anyway (its peak is unchanged), but they stay
// allocated until free_recycled_buffers() or the next call.
// SHARDTORCH_RECYCLE_BUFFERS=0 turns it off (every call allocates, as before).
#include <ATen/ATen.h>

#include <cstdint>
#include <mutex>
#include <vector>

namespace shardtorch {
namespace ops {

using BufferFactory = at::Tensor (*)(at::IntArrayRef, const at::TensorOptions&);

class BufferSlot {
 public:
  // Slots live as long as the process (function-local statics made with
  // new): their storages are never freed during static destruction, after
  // the allocator they came from may be gone.
  BufferSlot();
  BufferSlot(const BufferSlot&) = delete;
  BufferSlot& operator=(const BufferSlot&) = delete;

  // A contiguous tensor of `sizes`: on a storage this slot made before that
  // nobody holds now and that fits (at least the bytes needed, at most an
  // eighth more), else `fresh(sizes, options)`'s, which the slot then keeps.
  // Only large CPU buffers (kRecycledBytes or more) are kept; others, and
  // every buffer when recycling is off, are `fresh`'s as they are.
  at::Tensor take(at::IntArrayRef sizes, const at::TensorOptions& options, BufferFactory fresh);

  // Lets go of the storages nobody else holds; returns their bytes.
  int64_t free_idle();

 private:
  std::mutex mutex_;
  std::vector<c10::intrusive_ptr<c10::StorageImpl>> kept_;
};

constexpr int64_t kRecycledBytes = int64_t(4) << 20;

// Every slot's free_idle(); returns the bytes let go.
int64_t free_recycled_buffers();

}  // namespace ops
}  // namespace shardtorch
