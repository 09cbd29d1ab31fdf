#pragma once
// Communicator over a c10d::ProcessGroup (Gloo for CPU tensors); all-reduces and all-gathers of
// small CPU tensors among ranks of one host go through shared memory instead
// (shared_memory_collectives.h).

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <memory>

#include "comm/communicator.h"
#include "comm/shared_memory_collectives.h"

namespace c10d {
class ProcessGroup;
}

namespace shardtorch {
namespace comm {

class ProcessGroupCommunicator final : public Communicator {
 public:
  ProcessGroupCommunicator(std::string group_name, c10::intrusive_ptr<c10d::ProcessGroup> group,
                           std::chrono::milliseconds timeout = std::chrono::seconds(300));

  int64_t rank() const override { return rank_; }
  int64_t size() const override { return size_; }
  const std::string& group_name() const override { return group_name_; }
  std::string backend_name() const override;

  std::shared_ptr<CommHandle> all_reduce_async(at::Tensor& tensor) override;
  std::shared_ptr<CommHandle> all_gather_async(const at::Tensor& input,
                                               at::Tensor& output) override;
  std::shared_ptr<CommHandle> reduce_scatter_async(const at::Tensor& input,
                                                   at::Tensor& output) override;
  std::shared_ptr<CommHandle> broadcast_async(at::Tensor& tensor, int64_t root) override;
  std::shared_ptr<CommHandle> send_async(const at::Tensor& tensor, int64_t dst) override;
  std::shared_ptr<CommHandle> recv_async(at::Tensor& tensor, int64_t src) override;

 private:
  std::string group_name_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  int64_t rank_;
  int64_t size_;
  std::chrono::milliseconds timeout_;
  // Made at the first collective that could use it (collective: every rank reaches that one).
  SharedMemoryCollectives* shared_memory(const at::Tensor& tensor);
  std::unique_ptr<SharedMemoryCollectives> shared_memory_;
  bool shared_memory_tried_ = false;
};

}  // namespace comm
}  // namespace shardtorch
