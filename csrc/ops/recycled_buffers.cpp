#include "ops/recycled_buffers.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace shardtorch {
namespace ops {
namespace {

struct Slots {
  std::mutex mutex;
  std::vector<BufferSlot*> all;
};

Slots& slots() {
  static Slots* s = new Slots();  // never destroyed (see BufferSlot())
  return *s;
}

bool recycling_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("SHARDTORCH_RECYCLE_BUFFERS");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return enabled;
}

// Nothing but the slot holds it: no tensor, and no weak reference that could
// become one.
bool idle(const c10::intrusive_ptr<c10::StorageImpl>& storage) {
  return storage.use_count() == 1 && storage.weak_use_count() == 1;
}

constexpr size_t kMaxKept = 2;

}  // namespace

BufferSlot::BufferSlot() {
  std::lock_guard<std::mutex> lock(slots().mutex);
  slots().all.push_back(this);
}

at::Tensor BufferSlot::take(at::IntArrayRef sizes, const at::TensorOptions& options,
                            BufferFactory fresh) {
  const int64_t need =
      c10::multiply_integers(sizes) *
      static_cast<int64_t>(c10::elementSize(c10::typeMetaToScalarType(options.dtype())));
  if (!recycling_enabled() || options.device().type() != c10::DeviceType::CPU ||
      need < kRecycledBytes) {
    return fresh(sizes, options);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& storage : kept_) {
    const auto bytes = static_cast<int64_t>(storage->nbytes());
    if (idle(storage) && bytes >= need && bytes - need <= need / 8) {
      at::Tensor out = at::empty({0}, options);
      out.set_(c10::Storage(storage), 0, sizes);
      return out;
    }
  }
  at::Tensor out = fresh(sizes, options);
  if (kept_.size() >= kMaxKept) {
    // An idle one goes first (its memory is freed now), else the oldest.
    auto victim = std::find_if(kept_.begin(), kept_.end(), idle);
    kept_.erase(victim != kept_.end() ? victim : kept_.begin());
  }
  kept_.push_back(
      c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(out.storage().unsafeGetStorageImpl()));
  return out;
}

int64_t BufferSlot::free_idle() {
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t bytes = 0;
  for (const auto& storage : kept_) {
    if (idle(storage)) bytes += static_cast<int64_t>(storage->nbytes());
  }
  kept_.erase(std::remove_if(kept_.begin(), kept_.end(), idle), kept_.end());
  return bytes;
}

int64_t free_recycled_buffers() {
  std::lock_guard<std::mutex> lock(slots().mutex);
  int64_t bytes = 0;
  for (BufferSlot* slot : slots().all) bytes += slot->free_idle();
  return bytes;
}

}  // namespace ops
}  // namespace shardtorch
