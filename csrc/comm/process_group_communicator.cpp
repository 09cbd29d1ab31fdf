#include "comm/process_group_communicator.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <string>

namespace shardtorch {
namespace comm {
namespace {

// Wraps c10d work so that a failure (a peer that died, a timeout) names the
// group and the collective instead of surfacing as a bare backend message.
class ProcessGroupHandle final : public CommHandle {
 public:
  ProcessGroupHandle(c10::intrusive_ptr<c10d::Work> work, std::string group, const char* collective)
      : work_(std::move(work)), group_(std::move(group)), collective_(collective) {}

  void wait() override {
    if (!work_) return;
    // What the caller spends blocked here (the collective and the wait for
    // the slowest rank to reach it) shows in torch.profiler as
    // "shard::wait <collective>"; the backend's own events time its thread.
    RECORD_FUNCTION(std::string("shard::wait ") + collective_,
                    std::vector<c10::IValue>({c10::IValue(group_)}));
    try {
      work_->wait();
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "shardtorch: ", collective_, " on group '", group_,
                  "' failed: ", e.what());
    }
    work_.reset();
  }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::string group_;
  const char* collective_;
};

void check_contiguous(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.is_contiguous(), "shardtorch communicator: ", what, " must be contiguous");
}

}  // namespace

ProcessGroupCommunicator::ProcessGroupCommunicator(std::string group_name,
                                                   c10::intrusive_ptr<c10d::ProcessGroup> group,
                                                   std::chrono::milliseconds timeout)
    : group_name_(std::move(group_name)), group_(std::move(group)), timeout_(timeout) {
  TORCH_CHECK(group_, "ProcessGroupCommunicator: process group for '", group_name_, "' is null");
  rank_ = group_->getRank();
  size_ = group_->getSize();
}

std::string ProcessGroupCommunicator::backend_name() const { return group_->getBackendName(); }

SharedMemoryCollectives* ProcessGroupCommunicator::shared_memory(const at::Tensor& tensor) {
  // The same answer on every rank: the same sizes, dtypes and devices reach a collective.
  if (!tensor.is_cpu() || tensor.numel() * static_cast<int64_t>(tensor.element_size()) >
                              SharedMemoryCollectives::kSlotBytes) {
    return nullptr;
  }
  if (!shared_memory_tried_) {
    shared_memory_tried_ = true;
    shared_memory_ = SharedMemoryCollectives::create(*group_, group_name_, timeout_);
  }
  return shared_memory_.get();
}

std::shared_ptr<CommHandle> ProcessGroupCommunicator::all_reduce_async(at::Tensor& tensor) {
  check_contiguous(tensor, "all_reduce tensor");
  if (size_ == 1 || tensor.numel() == 0) return std::make_shared<CompletedHandle>();
  if (auto* shared = shared_memory(tensor)) {
    RECORD_FUNCTION("shard::wait all_reduce", std::vector<c10::IValue>({c10::IValue(group_name_)}));
    shared->all_reduce(tensor);
    return std::make_shared<CompletedHandle>();
  }
  std::vector<at::Tensor> tensors{tensor};
  return std::make_shared<ProcessGroupHandle>(group_->allreduce(tensors), group_name_,
                                              "all_reduce");
}

std::shared_ptr<CommHandle> ProcessGroupCommunicator::all_gather_async(const at::Tensor& input,
                                                                       at::Tensor& output) {
  check_contiguous(input, "all_gather input");
  check_contiguous(output, "all_gather output");
  TORCH_CHECK(output.numel() == input.numel() * size_, "all_gather: output must hold ", size_,
              " blocks of ", input.numel(), " elements, got ", output.numel());
  if (input.numel() == 0) return std::make_shared<CompletedHandle>();
  if (size_ == 1) {
    output.view(input.sizes()).copy_(input);
    return std::make_shared<CompletedHandle>();
  }
  if (auto* shared = shared_memory(input)) {
    RECORD_FUNCTION("shard::wait all_gather", std::vector<c10::IValue>({c10::IValue(group_name_)}));
    shared->all_gather(input, output);
    return std::make_shared<CompletedHandle>();
  }
  auto blocks = output.view({size_, input.numel()});
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int64_t r = 0; r < size_; ++r) outputs[0].push_back(blocks[r].view(input.sizes()));
  std::vector<at::Tensor> inputs{input};
  return std::make_shared<ProcessGroupHandle>(group_->allgather(outputs, inputs), group_name_,
                                              "all_gather");
}

std::shared_ptr<CommHandle> ProcessGroupCommunicator::reduce_scatter_async(const at::Tensor& input,
                                                                           at::Tensor& output) {
  check_contiguous(input, "reduce_scatter input");
  check_contiguous(output, "reduce_scatter output");
  TORCH_CHECK(input.numel() == output.numel() * size_, "reduce_scatter: input must hold ", size_,
              " blocks of ", output.numel(), " elements, got ", input.numel());
  if (output.numel() == 0) return std::make_shared<CompletedHandle>();
  if (size_ == 1) {
    output.copy_(input.view(output.sizes()));
    return std::make_shared<CompletedHandle>();
  }
  // Gloo has no reduce-scatter for every dtype and torch version; an
  // all-reduce of a copy followed by taking our block is always available and
  // exact. It moves size() times the bytes, which only matters off the CPU
  // path where NCCL is used instead.
  auto reduced = input.clone();
  if (auto* shared = shared_memory(reduced)) {
    shared->all_reduce(reduced);
  } else {
    std::vector<at::Tensor> tensors{reduced};
    ProcessGroupHandle(group_->allreduce(tensors), group_name_, "reduce_scatter").wait();
  }
  output.view({-1}).copy_(reduced.view({size_, output.numel()})[rank_]);
  return std::make_shared<CompletedHandle>();
}

std::shared_ptr<CommHandle> ProcessGroupCommunicator::broadcast_async(at::Tensor& tensor,
                                                                      int64_t root) {
  check_contiguous(tensor, "broadcast tensor");
  if (size_ == 1) return std::make_shared<CompletedHandle>();
  std::vector<at::Tensor> tensors{tensor};
  c10d::BroadcastOptions options;
  options.rootRank = root;
  return std::make_shared<ProcessGroupHandle>(group_->broadcast(tensors, options), group_name_,
                                              "broadcast");
}

std::shared_ptr<CommHandle> ProcessGroupCommunicator::send_async(const at::Tensor& tensor,
                                                                 int64_t dst) {
  check_contiguous(tensor, "send tensor");
  std::vector<at::Tensor> tensors{tensor};
  return std::make_shared<ProcessGroupHandle>(group_->send(tensors, static_cast<int>(dst), 0),
                                              group_name_, "send");
}

std::shared_ptr<CommHandle> ProcessGroupCommunicator::recv_async(at::Tensor& tensor, int64_t src) {
  check_contiguous(tensor, "recv tensor");
  std::vector<at::Tensor> tensors{tensor};
  return std::make_shared<ProcessGroupHandle>(group_->recv(tensors, static_cast<int>(src), 0),
                                              group_name_, "recv");
}

}  // namespace comm
}  // namespace shardtorch
