#include "distributed/gloo_process_group.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

// Both are needed: Gloo's own headers (SHARDTORCH_WITH_GLOO_HEADERS, found by
// CMake) and a torch built with Gloo (USE_C10D_GLOO, from torch's CMake target).
#if defined(SHARDTORCH_WITH_GLOO_HEADERS) && defined(USE_C10D_GLOO)
#define SHARDTORCH_CAN_CREATE_GLOO_GROUPS 1
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif

#include <cstdlib>

namespace shardtorch {
namespace distributed {

bool gloo_process_groups_available() {
#ifdef SHARDTORCH_CAN_CREATE_GLOO_GROUPS
  return true;
#else
  return false;
#endif
}

c10::intrusive_ptr<c10d::ProcessGroup> make_gloo_process_group(
    const c10::intrusive_ptr<c10d::Store>& store, int64_t group_rank, int64_t group_size,
    std::chrono::milliseconds timeout) {
#ifdef SHARDTORCH_CAN_CREATE_GLOO_GROUPS
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  // Same device choice as torch.distributed: the interfaces named in
  // GLOO_SOCKET_IFNAME, else this host's address (loopback as a fallback).
  const char* interfaces = std::getenv("GLOO_SOCKET_IFNAME");
  if (interfaces != nullptr && *interfaces != '\0') {
    std::string list(interfaces);
    size_t start = 0;
    while (start <= list.size()) {
      size_t comma = list.find(',', start);
      if (comma == std::string::npos) comma = list.size();
      if (comma > start) {
        options->devices.push_back(
            c10d::ProcessGroupGloo::createDeviceForInterface(list.substr(start, comma - start)));
      }
      start = comma + 1;
    }
  } else {
    options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  }
  auto backend = c10::make_intrusive<c10d::ProcessGroupGloo>(store, static_cast<int>(group_rank),
                                                             static_cast<int>(group_size), options);
  // Ops and communicators take a ProcessGroup (as torch.distributed hands
  // them to Python): wrap the backend as the group's CPU (and default) backend.
  auto group = c10::make_intrusive<c10d::ProcessGroup>(store, static_cast<int>(group_rank),
                                                       static_cast<int>(group_size));
  group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
  group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, backend);
  return group;
#else
  TORCH_CHECK(false,
              "shardtorch::distributed::init_process_group: this libshardtorch was built without "
              "Gloo's C++ headers (gloo/algorithm.h, which the torch wheel does not ship; on "
              "Debian/Ubuntu: apt-get install libgloo-dev) or against a torch built without Gloo "
              "(USE_C10D_GLOO), so it cannot create Gloo process groups from C++. Install the "
              "headers and rebuild shardtorch, or create the groups from Python "
              "(shardtorch.distributed.init_process_group).");
  return {};
#endif
}

}  // namespace distributed
}  // namespace shardtorch
