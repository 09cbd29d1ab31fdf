#pragma once
// Hands a few bytes from one rank of a group to all the others through the
// group's c10d Store (what torch's own NCCL backend does with the
// ncclUniqueId). Unlike a broadcast over the process group it needs no
// collective backend at all, so NCCL communicators work whatever backend
// torch.distributed was started with ("nccl", "gloo" or "cpu:gloo,cuda:nccl").

#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <optional>
#include <string>

#include "comm/registry.h"

namespace c10d {
class Store;
}

namespace shardtorch {
namespace comm {

// A key no earlier exchange of `scope` in this process used: scope + "/" + n,
// n counting from 0. Ranks that create their communicators in the same order
// (they must: creation is collective) get the same keys.
std::string next_exchange_key(const std::string& scope);

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
