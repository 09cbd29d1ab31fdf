#pragma once
// Hands a few bytes from one rank of a group to all the others through the
// group's c10d Store (what torch's own NCCL backend does with the
// ncclUniqueId). Unlike a broadcast over the process group it needs no
// collective backend at all, so NCCL communicators work whatever backend
// torch.distributed was started with ("nccl", "gloo" or "cpu:gloo,cuda:nccl").

#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>

#include "comm/registry.h"

namespace c10d {
class Store;
}

namespace shardtorch {
namespace comm {

// Counts one process's exchanges per scope: the n-th exchange of `scope` gets
// the key scope + "/" + n, n counting from 0. Ranks that create their
// communicators in the same order (they must: creation is collective) get the
// same keys, each from its own process's counter.
class ExchangeKeys {
 public:
  std::string next(const std::string& scope);

 private:
  std::mutex mutex_;
  std::map<std::string, int64_t> counts_;
};

// The process's counter (tests give each thread standing for a rank its own).
ExchangeKeys& process_exchange_keys();

// process_exchange_keys().next(scope).
std::string next_exchange_key(const std::string& scope);

// The scope of the store keys under which group rank 0 publishes the
// ncclUniqueId of each new NCCL communicator of `group_name` (the counter
// tells a process's successive ones apart). Every rank of the group must reach
// the same key, so it holds nothing of a rank's own: in particular not its
// device, since the ranks of one group sit on different GPUs (with the device
// in it, rank 1 on cuda:1 waited for a key that rank 0 on cuda:0 never wrote).
std::string nccl_unique_id_scope(const std::string& group_name);

// `payload` of `root` on every rank: root writes it under `key`, the others
// wait for it (the store's own timeout bounds the wait).
std::string share_through_store(c10d::Store& store, const std::string& key, int64_t rank,
                                int64_t root, const std::string& payload);

// `payload` of group rank 0 on every rank of `group`, through its process
// group's store under the next key of `scope`; nullopt (nothing exchanged)
// when the process group has no store.
std::optional<std::string> share_through_group_store(const GroupInfo& group,
                                                     const std::string& scope,
                                                     const std::string& payload);

}  // namespace comm
}  // namespace shardtorch
