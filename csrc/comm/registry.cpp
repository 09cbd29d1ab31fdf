#include "comm/registry.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <map>
#include <mutex>
#include <sstream>

#include "comm/debug_communicator.h"
#include "comm/process_group_communicator.h"

namespace shardtorch {
namespace comm {
namespace {

struct Entry {
  GroupInfo info;
  std::map<c10::DeviceType, std::shared_ptr<Communicator>> communicators;
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

std::shared_ptr<Communicator> communicator_for(const std::string& name, const c10::Device& device,
                                               const char* op) {
  auto& r = registry();
  std::unique_lock<std::mutex> lock(r.mutex);
  Entry& entry = find_entry(r, name, op);
  const auto type = device.type();
  auto it = entry.communicators.find(type);
  if (it != entry.communicators.end()) return it->second;

  GroupInfo info = entry.info;
  auto factory = r.factories.find(type);
  std::shared_ptr<Communicator> created;
  if (factory != r.factories.end()) {
    // Creating an NCCL communicator is itself a collective over the CPU group;
    // release the lock so that other groups stay usable meanwhile.
    auto make = factory->second;
    lock.unlock();
    created = make(info);
    lock.lock();
  } else {
    created = std::make_shared<ProcessGroupCommunicator>(info.layout.name, info.process_group);
  }
  if (debug_mode_enabled()) created = make_debug_communicator(std::move(created), info);
  Entry& again = find_entry(r, name, op);
  auto inserted = again.communicators.emplace(type, created);
  return inserted.first->second;
}

void register_communicator_factory(c10::DeviceType device_type, CommunicatorFactory factory) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.factories[device_type] = std::move(factory);
}

}  // namespace comm
}  // namespace shardtorch
