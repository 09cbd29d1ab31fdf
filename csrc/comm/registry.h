#pragma once
// Group names (the `str group` of every op schema) -> communicators.
//
// A group is registered once per process with its c10d process group (Gloo,
// created by Python's torch.distributed or by the C++ init; or any backend
// torch.distributed was started with). Communicators are created lazily, once
// per group and device (cuda:0 and cuda:1 get their own), the first time a
// tensor of that device meets the group: CPU tensors use the process group's
// CPU backend, CUDA tensors NCCL directly (its unique id travels through the
// process group's store, so an NCCL-only or Gloo-only group works alike).

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"

namespace c10d {
class ProcessGroup;
}

namespace shardtorch {
namespace comm {

// What ops need to know of a group: no communication state.
struct GroupLayout {
  std::string name;
  int64_t rank = 0;
  int64_t size = 1;
  // Global ranks of the members, in group-rank order.
  std::vector<int64_t> global_ranks;
};

// A group's layout and its CPU process group (complete type in
// <torch/csrc/distributed/c10d/ProcessGroup.hpp>, included only where used).
struct GroupInfo {
  GroupLayout layout;
  c10::intrusive_ptr<c10d::ProcessGroup> process_group;
  // How long a collective may run before it fails: the CPU process group's
  // timeout (init_process_group's `timeout`), which communicators that do not
  // go through it (NCCL) enforce with their watchdog.
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
};

void register_group(const std::string& name, c10::intrusive_ptr<c10d::ProcessGroup> process_group,
                    std::vector<int64_t> global_ranks = {});
// Registers a group that Python's torch.distributed created, found by its
// c10d group name.
void register_group_by_c10d_name(const std::string& name, const std::string& c10d_group_name,
                                 std::vector<int64_t> global_ranks = {});
void unregister_group(const std::string& name);
void clear_groups();
bool has_group(const std::string& name);
std::vector<std::string> group_names();

// Throw a clear error naming `op` when the group is unknown.
GroupLayout group_layout(const std::string& name, const char* op);
GroupInfo group_info(const std::string& name, const char* op);
std::chrono::milliseconds group_timeout(const std::string& name, const char* op);
// Whether the group's process group can move CPU tensors (torch.distributed
// started with backend="nccl" gives groups that cannot).
bool group_has_cpu_backend(const std::string& name, const char* op);
// The group's communicator for `device` (a CUDA device must carry its index:
// the tensor's). Created once, even when several threads ask at the same time
// (NCCL forbids two ncclCommInitRank of one communicator); a creation that
// fails is retried by the next call.
std::shared_ptr<Communicator> communicator_for(const std::string& name, const c10::Device& device,
                                               const char* op);

// Gives now every verdict that the group's communicators (every group's when
// `name` is empty) deferred (Communicator::check_deferred), waiting for the
// device if needed, and raises the first failed one, after settling them all.
// Every rank must call it at the same point of its program.
void check_deferred(const std::string& name = "");
// What those communicators' deferred checks did so far, summed (tests and
// benchmarks count the host's waits for them: nothing else sees them).
DeferredCheckCounts deferred_check_counts(const std::string& name = "");

// Backends for devices other than CPU plug in here (the CUDA part of the
// library registers NCCL at load time), so the registry stays device-free.
// The factory gets the device the communicator serves. Returns the factory
// it replaces (empty if none), so that tests can plug a fake in and restore.
using CommunicatorFactory =
    std::function<std::shared_ptr<Communicator>(const GroupInfo&, const c10::Device&)>;
CommunicatorFactory register_communicator_factory(c10::DeviceType device_type,
                                                  CommunicatorFactory factory);

}  // namespace comm
}  // namespace shardtorch
