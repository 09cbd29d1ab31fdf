#include "distributed/torchrun_environment.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <string>

namespace shardtorch {
namespace distributed {
namespace {

std::string require(const char* caller, const char* name) {
  const char* value = std::getenv(name);
  TORCH_CHECK(value != nullptr && *value != '\0', caller, ": environment variable ", name,
              " is not set; launch with torchrun (e.g. `torchrun --no-python --nproc-per-node 2 "
              "./program`) or set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT");
  return value;
}

int64_t parse_int(const char* caller, const char* name, const std::string& text, int64_t min) {
  size_t used = 0;
  int64_t value = -1;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  TORCH_CHECK(used == text.size() && value >= min, caller, ": environment variable ", name,
              " must be an integer >= ", min, ", got '", text, "'");
  return value;
}

}  // namespace

TorchrunEnvironment read_torchrun_environment(const char* caller) {
  TorchrunEnvironment env;
  env.rank = parse_int(caller, "RANK", require(caller, "RANK"), 0);
  env.world_size = parse_int(caller, "WORLD_SIZE", require(caller, "WORLD_SIZE"), 1);
  TORCH_CHECK(env.rank < env.world_size, caller, ": RANK must be < WORLD_SIZE (", env.world_size,
              "), got ", env.rank);
  const char* local_rank = std::getenv("LOCAL_RANK");
  env.local_rank = local_rank ? parse_int(caller, "LOCAL_RANK", local_rank, 0) : env.rank;
  env.master_addr = require(caller, "MASTER_ADDR");
  const auto port = parse_int(caller, "MASTER_PORT", require(caller, "MASTER_PORT"), 1);
  TORCH_CHECK(port <= 65535, caller, ": MASTER_PORT must be <= 65535, got ", port);
  env.master_port = static_cast<uint16_t>(port);
  const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  env.agent_store = agent != nullptr && std::string(agent) == "True";
  if (env.agent_store) {
    const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT");
    env.store_prefix = std::string("/worker/attempt_") + (attempt ? attempt : "0");
  }
  return env;
}

}  // namespace distributed
}  // namespace shardtorch
