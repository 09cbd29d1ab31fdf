#pragma once
// Communicator over a c10d::ProcessGroup (Gloo for CPU tensors).

#include <c10/util/intrusive_ptr.h>

#include "comm/communicator.h"

namespace c10d {
class ProcessGroup;
}

namespace shardtorch {
namespace comm {

class ProcessGroupCommunicator final : public Communicator {
 public:
  ProcessGroupCommunicator(std::string group_name, c10::intrusive_ptr<c10d::ProcessGroup> group);

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
};

}  // namespace comm
}  // namespace shardtorch
