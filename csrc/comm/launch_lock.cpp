#include "comm/launch_lock.h"

#include <memory>
#include <unordered_map>

namespace shardtorch {
namespace comm {

std::timed_mutex& device_launch_mutex(const c10::Device& device) {
  static std::mutex mutex;
  // Never destroyed: communicators may launch (or abort) during exit.
  static auto* locks = new std::unordered_map<c10::Device, std::unique_ptr<std::timed_mutex>>();
  std::lock_guard<std::mutex> guard(mutex);
  auto& slot = (*locks)[device];
  if (!slot) slot = std::make_unique<std::timed_mutex>();
  return *slot;
}

}  // namespace comm
}  // namespace shardtorch
