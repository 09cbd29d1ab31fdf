#pragma once
// NCCL forbids two threads from enqueueing at the same time on one
// communicator, or on two communicators of one device (their kernels can
// deadlock each other). Every NCCL launch holds its device's launch mutex; the
// watchdog's abort takes it too, with a time limit (a launch stuck on the host
// is what the abort must unblock). Device-free, so tests drive it on CPU
// (tests/unit/test_cuda_rules.py).

#include <c10/core/Device.h>

#include <mutex>

namespace shardtorch {
namespace comm {

// One mutex per full device (cuda:0 and cuda:1 apart), alive for the process.
std::timed_mutex& device_launch_mutex(const c10::Device& device);

// Runs `launch` holding `device_lock` (a device_launch_mutex): how every NCCL
// launch is made (NcclCommunicator::enqueue), so that the CPU test driving
// this function tests the rule the launches follow.
template <typename Launch>
auto with_device_launch_lock(std::timed_mutex& device_lock, Launch&& launch) -> decltype(launch()) {
  std::lock_guard<std::timed_mutex> launching(device_lock);
  return launch();
}

}  // namespace comm
}  // namespace shardtorch
