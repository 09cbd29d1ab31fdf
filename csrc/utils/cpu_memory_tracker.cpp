#include "utils/cpu_memory_tracker.h"

#include <c10/core/CPUAllocator.h>

#include <unordered_map>
#include <cstring>
#include <mutex>

namespace shardtorch {
namespace utils {
namespace {

// Data and context stay the same pointer (some callers, raw_allocate among
// them, require it), so the sizes live in a side table.
class TrackingCpuAllocator final : public c10::Allocator {
 public:
  explicit TrackingCpuAllocator(c10::Allocator* base) : base_(base) {}

  c10::DataPtr allocate(size_t bytes) override {
    void* data = base_->raw_allocate(bytes);
    if (data) {
      std::lock_guard<std::mutex> lock(mutex_);
      sizes_[data] = static_cast<int64_t>(bytes);
      current_ += static_cast<int64_t>(bytes);
      if (current_ > peak_) peak_ = current_;
    }
    return c10::DataPtr(data, data, &release, c10::Device(c10::DeviceType::CPU));
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

  CpuMemoryStats stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {current_, peak_};
  }
  void reset_peak() {
    std::lock_guard<std::mutex> lock(mutex_);
    peak_ = current_;
  }

  static void release(void* data);

 private:
  void forget(void* data) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = sizes_.find(data);
    if (it == sizes_.end()) return;
    current_ -= it->second;
    sizes_.erase(it);
  }

  c10::Allocator* base_;
  std::mutex mutex_;
  std::unordered_map<void*, int64_t> sizes_;
  int64_t current_ = 0;
  int64_t peak_ = 0;
};

std::mutex install_mutex;
TrackingCpuAllocator* tracker = nullptr;  // never freed: live tensors point at it

void TrackingCpuAllocator::release(void* data) {
  if (!data) return;
  tracker->forget(data);
  tracker->base_->raw_deallocate(data);
}

}  // namespace

void install_cpu_memory_tracker() {
  std::lock_guard<std::mutex> lock(install_mutex);
  if (tracker) return;
  c10::Allocator* base = c10::GetCPUAllocator();
  TORCH_CHECK(base->raw_deleter() != nullptr,
              "install_cpu_memory_tracker: the current CPU allocator does not support raw "
              "allocations, so its memory cannot be tracked");
  tracker = new TrackingCpuAllocator(base);
  c10::SetCPUAllocator(tracker, /*priority=*/100);
}

bool cpu_memory_tracker_installed() { return tracker != nullptr; }

CpuMemoryStats cpu_memory_stats() { return tracker ? tracker->stats() : CpuMemoryStats{}; }

void reset_cpu_peak_memory() {
  if (tracker) tracker->reset_peak();
}

}  // namespace utils
}  // namespace shardtorch
