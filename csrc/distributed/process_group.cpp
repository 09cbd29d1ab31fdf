#include <shardtorch/distributed/process_group.h>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cstdlib>
#include <mutex>
#include <string>

#include "comm/registry.h"
#include "distributed/gloo_process_group.h"
#include "distributed/torchrun_environment.h"
#include <shardtorch/topology/topology.h>

namespace shardtorch {
namespace distributed {
namespace {

// What init_process_group created; the registry holds the groups themselves.
struct State {
  c10::intrusive_ptr<c10d::Store> store;
  int64_t rank = 0;
  int64_t world_size = 1;
  int64_t local_rank = 0;
};

std::mutex& state_mutex() {
  static std::mutex mutex;
  return mutex;
}

std::unique_ptr<State>& state() {
  static std::unique_ptr<State> instance;
  return instance;
}

void check_options(const InitOptions& options) {
  TORCH_CHECK(options.group_size() >= 1,
              "shardtorch::distributed::init_process_group: group_size must be >= 1, got ",
              options.group_size());
  TORCH_CHECK(options.timeout().count() > 0,
              "shardtorch::distributed::init_process_group: timeout must be positive, got ",
              options.timeout().count(), " ms");
  const auto& backend = options.backend();
  TORCH_CHECK(backend == "gloo" || backend == "cpu:gloo,cuda:nccl",
              "shardtorch::distributed::init_process_group: backend must be \"gloo\" (CUDA tensors "
              "use NCCL automatically) or \"cpu:gloo,cuda:nccl\", got \"",
              backend, "\"");
}

// Every member of `ranks` creates the group over a store prefix unique to it;
// other ranks create nothing (unlike torch.distributed.new_group, Gloo only
// needs the members to meet).
void create_and_register(const c10::intrusive_ptr<c10d::Store>& store, const std::string& name,
                         const std::string& key, const std::vector<int64_t>& ranks, int64_t rank,
                         std::chrono::milliseconds timeout) {
  int64_t group_rank = -1;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] == rank) group_rank = static_cast<int64_t>(i);
  }
  if (group_rank < 0) return;
  auto group_store = c10::make_intrusive<c10d::PrefixStore>("shardtorch/" + key, store);
  auto group =
      make_gloo_process_group(group_store, group_rank, static_cast<int64_t>(ranks.size()), timeout);
  comm::register_group(name, std::move(group), ranks);
}

}  // namespace

std::chrono::milliseconds default_timeout() {
  const char* seconds = std::getenv("SHARDTORCH_TIMEOUT");
  if (seconds != nullptr && *seconds != '\0') {
    try {
      return std::chrono::seconds(std::stoll(seconds));
    } catch (const std::exception&) {
      TORCH_CHECK(false,
                  "shardtorch::distributed: SHARDTORCH_TIMEOUT must be a number of seconds, "
                  "got '",
                  seconds, "'");
    }
  }
  return std::chrono::seconds(300);
}

void init_process_group(const InitOptions& options) {
  constexpr const char* kCaller = "shardtorch::distributed::init_process_group";
  check_options(options);
  // Fail before any rendezvous, so a missing build feature does not look like a hang.
  TORCH_CHECK(gloo_process_groups_available(), kCaller,
              ": this libshardtorch was built without Gloo's C++ headers (gloo/algorithm.h; on "
              "Debian/Ubuntu: apt-get install libgloo-dev, then rebuild shardtorch) or against a "
              "torch built without Gloo, so it cannot create process groups from C++");
  std::lock_guard<std::mutex> lock(state_mutex());
  TORCH_CHECK(!state(), kCaller, ": already initialised; call destroy_process_group() first");
  TORCH_CHECK(comm::group_names().empty(), kCaller,
              ": groups are already registered (by Python's shardtorch.distributed?): ",
              comm::group_names().size(), " groups");
  const auto env = read_torchrun_environment(kCaller);
  TORCH_CHECK(env.world_size % options.group_size() == 0, kCaller,
              ": group_size must divide the world size ", env.world_size, ", got ",
              options.group_size());

  c10d::TCPStoreOptions store_options;
  store_options.port = env.master_port;
  store_options.isServer = env.rank == 0 && !env.agent_store;
  store_options.numWorkers = static_cast<size_t>(env.world_size);
  store_options.waitWorkers = false;
  store_options.timeout = options.timeout();
  c10::intrusive_ptr<c10d::Store> store =
      c10::make_intrusive<c10d::TCPStore>(env.master_addr, store_options);
  if (!env.store_prefix.empty()) {
    store = c10::make_intrusive<c10d::PrefixStore>(env.store_prefix, store);
  }

  topology::TensorParallelTopology layout(env.world_size, env.rank, options.group_size());
  try {
    const auto tp_groups = layout.tensor_parallel_groups();
    for (size_t i = 0; i < tp_groups.size(); ++i) {
      create_and_register(store, kTensorParallel, "tp/" + std::to_string(i), tp_groups[i], env.rank,
                          options.timeout());
    }
    const auto dp_groups = layout.data_parallel_groups();
    for (size_t i = 0; i < dp_groups.size(); ++i) {
      create_and_register(store, kDataParallel, "dp/" + std::to_string(i), dp_groups[i], env.rank,
                          options.timeout());
    }
    std::vector<int64_t> everyone;
    for (int64_t r = 0; r < env.world_size; ++r) everyone.push_back(r);
    create_and_register(store, kWorld, "world", everyone, env.rank, options.timeout());
  } catch (...) {
    comm::clear_groups();
    throw;
  }
  auto created = std::make_unique<State>();
  created->store = std::move(store);
  created->rank = env.rank;
  created->world_size = env.world_size;
  created->local_rank = env.local_rank;
  state() = std::move(created);
}

void destroy_process_group() {
  std::lock_guard<std::mutex> lock(state_mutex());
  if (!state()) return;
  // A deferred check that no later collective came to give (the last step's
  // loss) raises here, on every rank, after the groups are gone.
  std::string deferred_error;
  try {
    comm::check_deferred();
  } catch (const c10::Error& e) {
    deferred_error = e.what_without_backtrace();
  }
  comm::clear_groups();
  state().reset();
  TORCH_CHECK(deferred_error.empty(), deferred_error);
}

void check_deferred(const std::string& group) { comm::check_deferred(group); }

bool is_initialized() {
  std::lock_guard<std::mutex> lock(state_mutex());
  return state() != nullptr;
}

int64_t get_rank() {
  {
    std::lock_guard<std::mutex> lock(state_mutex());
    if (state()) return state()->rank;
  }
  return comm::has_group(kWorld) ? comm::group_layout(kWorld, "get_rank").rank : 0;
}

int64_t get_world_size() {
  {
    std::lock_guard<std::mutex> lock(state_mutex());
    if (state()) return state()->world_size;
  }
  return comm::has_group(kWorld) ? comm::group_layout(kWorld, "get_world_size").size : 1;
}

int64_t get_local_rank() {
  std::lock_guard<std::mutex> lock(state_mutex());
  return state() ? state()->local_rank : 0;
}

int64_t get_group_rank(const std::string& group) {
  return comm::group_layout(group, "shardtorch::distributed::get_group_rank").rank;
}

int64_t get_group_size(const std::string& group) {
  return comm::group_layout(group, "shardtorch::distributed::get_group_size").size;
}

std::vector<int64_t> get_group_ranks(const std::string& group) {
  return comm::group_layout(group, "shardtorch::distributed::get_group_ranks").global_ranks;
}

}  // namespace distributed
}  // namespace shardtorch
