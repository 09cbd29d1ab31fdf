#include "comm/registry.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <future>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include "comm/debug_communicator.h"
#include "comm/process_group_communicator.h"

namespace shardtorch {
namespace comm {
namespace {

using SharedCommunicator = std::shared_future<std::shared_ptr<Communicator>>;

struct Entry {
  GroupInfo info;
  // One per full device (cuda:0 and cuda:1 apart); a future while it is being
  // created, so that a second caller waits for the first one's instead of
  // creating its own.
  std::unordered_map<c10::Device, SharedCommunicator> communicators;
};

struct Registry {
  std::mutex mutex;
  std::map<std::string, Entry> groups;
  std::map<c10::DeviceType, CommunicatorFactory> factories;
};

Registry& registry() {
  static Registry* instance = new Registry();  // never destroyed: ops may run at exit
  return *instance;
}

std::string known_names(const Registry& r) {
  std::ostringstream out;
  out << "[";
  bool first = true;
  for (const auto& kv : r.groups) {
    out << (first ? "" : ", ") << "'" << kv.first << "'";
    first = false;
  }
  out << "]";
  return out.str();
}

// The timeout the CPU process group was created with; groups whose backend
// does not say keep GroupInfo's default (300 s, as init_process_group's).
std::chrono::milliseconds process_group_timeout(c10d::ProcessGroup& group,
                                                std::chrono::milliseconds fallback) {
  try {
    auto backend = group.getBackend(c10::DeviceType::CPU);
    if (backend) return backend->getBackendOptions()->timeout;
  } catch (const std::exception&) {
    // No CPU backend, or one that does not implement getBackendOptions.
  }
  return fallback;
}

// Whether the group has a backend for CPU tensors. torch 2.11 has no
// hasBackendForDeviceType; there, getBackend raises for a device type without one.
// (A template, so that the branch a torch version lacks is never instantiated.)
template <typename Group>
bool has_cpu_backend(Group& group) {
  if constexpr (requires { group.hasBackendForDeviceType(c10::kCPU); }) {
    return group.hasBackendForDeviceType(c10::kCPU);
  } else {
    try {
      return group.getBackend(c10::kCPU) != nullptr;
    } catch (const std::exception&) {
      return false;
    }
  }
}

// CPU tensors go through the process group's own CPU backend; a group that has
// none (torch.distributed started with backend="nccl") cannot move them.
std::shared_ptr<Communicator> make_cpu_communicator(const GroupInfo& info, const char* op) {
  TORCH_CHECK(
      has_cpu_backend(*info.process_group), op, ": group '", info.layout.name,
      "' has no backend for CPU tensors (its process group's ", "backend is '",
      info.process_group->getBackendName(),
      "'); CPU tensors need a CPU backend: start torch.distributed with backend "
      "\"cpu:gloo,cuda:nccl\" or \"gloo\", or let shardtorch.distributed.init_process_group "
      "create its groups");
  return std::make_shared<ProcessGroupCommunicator>(info.layout.name, info.process_group,
                                                    info.timeout);
}

}  // namespace

void register_group(const std::string& name, c10::intrusive_ptr<c10d::ProcessGroup> process_group,
                    std::vector<int64_t> global_ranks) {
  TORCH_CHECK(!name.empty(), "register_group: name must not be empty");
  TORCH_CHECK(process_group, "register_group: process group for '", name, "' is null");
  GroupInfo info;
  info.layout.name = name;
  info.layout.rank = process_group->getRank();
  info.layout.size = process_group->getSize();
  info.timeout = process_group_timeout(*process_group, info.timeout);
  info.process_group = std::move(process_group);
  if (global_ranks.empty()) {
    for (int64_t r = 0; r < info.layout.size; ++r) global_ranks.push_back(r);
  }
  TORCH_CHECK(static_cast<int64_t>(global_ranks.size()) == info.layout.size,
              "register_group: group '", name, "' has ", info.layout.size, " ranks but ",
              global_ranks.size(), " global ranks were given");
  info.layout.global_ranks = std::move(global_ranks);
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.groups[name] = Entry{std::move(info), {}};
}

void register_group_by_c10d_name(const std::string& name, const std::string& c10d_group_name,
                                 std::vector<int64_t> global_ranks) {
  auto group = c10d::resolve_process_group(c10d_group_name);
  register_group(name, std::move(group), std::move(global_ranks));
}

void unregister_group(const std::string& name) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.groups.erase(name);
}

void clear_groups() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.groups.clear();
}

bool has_group(const std::string& name) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.groups.count(name) != 0;
}

std::vector<std::string> group_names() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::vector<std::string> names;
  for (const auto& kv : r.groups) names.push_back(kv.first);
  return names;
}

static Entry& find_entry(Registry& r, const std::string& name, const char* op) {
  auto it = r.groups.find(name);
  if (it == r.groups.end()) {
    TORCH_CHECK(!r.groups.empty(), op, ": no process group is initialised (group '", name,
                "' requested); call shardtorch.distributed.init_process_group(group_size=...) "
                "first (C++: shardtorch::distributed::init_process_group)");
    TORCH_CHECK(false, op, ": unknown group '", name, "'; known groups: ", known_names(r));
  }
  return it->second;
}

GroupLayout group_layout(const std::string& name, const char* op) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return find_entry(r, name, op).info.layout;
}

GroupInfo group_info(const std::string& name, const char* op) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return find_entry(r, name, op).info;
}

std::chrono::milliseconds group_timeout(const std::string& name, const char* op) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return find_entry(r, name, op).info.timeout;
}

bool group_has_cpu_backend(const std::string& name, const char* op) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return has_cpu_backend(*find_entry(r, name, op).info.process_group);
}

std::shared_ptr<Communicator> communicator_for(const std::string& name, const c10::Device& device,
                                               const char* op) {
  TORCH_CHECK(device.is_cpu() || device.has_index(), op,
              ": a communicator needs the tensor's full device (with its index), got ", device);
  const c10::Device key = device.is_cpu() ? c10::Device(c10::kCPU) : device;
  auto& r = registry();
  std::unique_lock<std::mutex> lock(r.mutex);
  Entry& entry = find_entry(r, name, op);
  auto it = entry.communicators.find(key);
  if (it != entry.communicators.end()) {
    SharedCommunicator existing = it->second;
    lock.unlock();
    return existing.get();  // waits while another thread creates it
  }

  GroupInfo info = entry.info;
  auto factory = r.factories.find(key.type());
  CommunicatorFactory make;
  if (factory != r.factories.end()) make = factory->second;
  std::promise<std::shared_ptr<Communicator>> promise;
  entry.communicators.emplace(key, promise.get_future().share());
  // Creating an NCCL communicator is itself a collective over the group;
  // release the lock so that other groups (and devices) stay usable meanwhile.
  lock.unlock();
  std::shared_ptr<Communicator> created;
  try {
    created = make ? make(info, key) : make_cpu_communicator(info, op);
    if (debug_mode_enabled()) created = make_debug_communicator(std::move(created), info);
  } catch (...) {
    promise.set_exception(std::current_exception());
    lock.lock();
    // A later call tries again (the group may have been dropped meanwhile).
    auto group = r.groups.find(name);
    if (group != r.groups.end()) group->second.communicators.erase(key);
    throw;
  }
  promise.set_value(created);
  return created;
}

// The communicators the group (every group when `name` is empty) has made so
// far, in group-name order (the same on every rank).
static std::vector<std::shared_ptr<Communicator>> created_communicators(const std::string& name,
                                                                        const char* op) {
  std::vector<std::shared_ptr<Communicator>> created;
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (!name.empty()) find_entry(r, name, op);
  for (const auto& group : r.groups) {
    if (!name.empty() && group.first != name) continue;
    for (const auto& device : group.second.communicators) {
      const SharedCommunicator& made = device.second;
      // One still being created has launched nothing that could be pending.
      if (made.wait_for(std::chrono::seconds(0)) != std::future_status::ready) continue;
      try {
        created.push_back(made.get());
      } catch (const std::exception&) {
        // Its creation failed (and will be retried): nothing pending either.
      }
    }
  }
  return created;
}

void check_deferred(const std::string& name) {
  // Outside the registry's lock: settling may wait for the device.
  std::string first_error;
  for (const auto& communicator : created_communicators(name, "check_deferred")) {
    try {
      communicator->check_deferred();
    } catch (const c10::Error& e) {
      if (first_error.empty()) first_error = e.what_without_backtrace();
    }
  }
  TORCH_CHECK(first_error.empty(), first_error);
}

DeferredCheckCounts deferred_check_counts(const std::string& name) {
  DeferredCheckCounts total;
  for (const auto& communicator : created_communicators(name, "deferred_check_counts")) {
    const DeferredCheckCounts counts = communicator->deferred_check_counts();
    total.launches += counts.launches;
    total.pending += counts.pending;
    total.settled += counts.settled;
    total.waits += counts.waits;
    total.dropped += counts.dropped;
  }
  return total;
}

CommunicatorFactory register_communicator_factory(c10::DeviceType device_type,
                                                  CommunicatorFactory factory) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  CommunicatorFactory previous;
  auto it = r.factories.find(device_type);
  if (it != r.factories.end()) previous = std::move(it->second);
  if (factory) {
    r.factories[device_type] = std::move(factory);
  } else {
    r.factories.erase(device_type);
  }
  return previous;
}

}  // namespace comm
}  // namespace shardtorch
