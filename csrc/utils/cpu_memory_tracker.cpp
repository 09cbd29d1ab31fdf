#include "utils/cpu_memory_tracker.h"

#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstring>
#include <mutex>

namespace shardtorch {
namespace utils {
namespace {

class TrackingCpuAllocator final : public c10::Allocator {
 public:
  explicit TrackingCpuAllocator(c10::Allocator* base) : base_(base) {}

  c10::DataPtr allocate(size_t bytes) override {
    c10::DataPtr inner = base_->allocate(bytes);
    void* data = inner.get();
    const c10::Device device = inner.device();
    auto* context = new Context{std::move(inner), static_cast<int64_t>(bytes), this};
    const int64_t now = current_.fetch_add(context->bytes) + context->bytes;
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
    return c10::DataPtr(data, context, &release, device);
  }

  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

  CpuMemoryStats stats() const { return {current_.load(), peak_.load()}; }
  void reset_peak() { peak_.store(current_.load()); }

 private:
  struct Context {
    c10::DataPtr inner;  // freeing it frees the memory through the base allocator
    int64_t bytes;
    TrackingCpuAllocator* owner;
  };

  static void release(void* raw) {
    auto* context = static_cast<Context*>(raw);
    context->owner->current_.fetch_sub(context->bytes);
    delete context;
  }

  c10::Allocator* base_;
  std::atomic<int64_t> current_{0};
  std::atomic<int64_t> peak_{0};
};

std::mutex install_mutex;
TrackingCpuAllocator* tracker = nullptr;  // never freed: live tensors point at it

}  // namespace

void install_cpu_memory_tracker() {
  std::lock_guard<std::mutex> lock(install_mutex);
  if (tracker) return;
  tracker = new TrackingCpuAllocator(c10::GetCPUAllocator());
  c10::SetCPUAllocator(tracker, /*priority=*/100);
}

bool cpu_memory_tracker_installed() { return tracker != nullptr; }

CpuMemoryStats cpu_memory_stats() { return tracker ? tracker->stats() : CpuMemoryStats{}; }

void reset_cpu_peak_memory() {
  if (tracker) tracker->reset_peak();
}

}  // namespace utils
}  // namespace shardtorch
