#pragma once
// The environment torchrun (and any equivalent launcher) gives each rank.

#include <cstdint>
#include <string>

namespace shardtorch {
namespace distributed {

struct TorchrunEnvironment {
  int64_t rank = 0;
  int64_t world_size = 1;
  int64_t local_rank = 0;
  std::string master_addr;
  uint16_t master_port = 0;
  // torchrun's agent already serves a TCPStore at MASTER_ADDR:MASTER_PORT
  // (TORCHELASTIC_USE_AGENT_STORE=True): ranks then connect as clients and
  // use keys under the attempt's prefix, as torch.distributed does.
  bool agent_store = false;
  std::string store_prefix;
};

// Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (and the
// torchelastic variables); throws naming the variable that is missing or wrong.
TorchrunEnvironment read_torchrun_environment(const char* caller);

}  // namespace distributed
}  // namespace shardtorch
