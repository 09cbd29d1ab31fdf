#include "comm/store_exchange.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <map>
#include <mutex>
#include <vector>

namespace shardtorch {
namespace comm {

std::string next_exchange_key(const std::string& scope) {
  static std::mutex mutex;
  static auto* counters = new std::map<std::string, int64_t>();
  std::lock_guard<std::mutex> lock(mutex);
  return scope + "/" + std::to_string((*counters)[scope]++);
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
