#include "comm/store_exchange.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <vector>

namespace shardtorch {
namespace comm {

std::string ExchangeKeys::next(const std::string& scope) {
  std::lock_guard<std::mutex> lock(mutex_);
  return scope + "/" + std::to_string(counts_[scope]++);
}

ExchangeKeys& process_exchange_keys() {
  // Never destroyed: communicators may be created during exit.
  static auto* keys = new ExchangeKeys();
  return *keys;
}

std::string next_exchange_key(const std::string& scope) {
  return process_exchange_keys().next(scope);
}

std::string nccl_unique_id_scope(const std::string& group_name) {
  return "shardtorch/nccl_unique_id/" + group_name;
}

std::string share_through_store(c10d::Store& store, const std::string& key, int64_t rank,
                                int64_t root, const std::string& payload) {
  if (rank == root) {
    store.set(key, std::vector<uint8_t>(payload.begin(), payload.end()));
    return payload;
  }
  const std::vector<uint8_t> bytes = store.get(key);
  return std::string(bytes.begin(), bytes.end());
}

std::optional<std::string> share_through_group_store(const GroupInfo& group,
                                                     const std::string& scope,
                                                     const std::string& payload) {
  auto store = group.process_group->getStore();
  if (!store) return std::nullopt;
  return share_through_store(*store, next_exchange_key(scope), group.layout.rank, 0, payload);
}

}  // namespace comm
}  // namespace shardtorch
