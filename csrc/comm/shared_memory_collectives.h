#pragma once
// Small all-reduces and all-gathers among the ranks of one group on one host, through a
// shared memory segment instead of Gloo's sockets.
//
// Why: a Gloo collective between two processes of one host costs a round trip through its
// I/O threads and their wake-ups (1.7 ms for 4 KiB on the 2-core VMs of benchmarks/results),
// and a transformer block makes two per layer each way: generation with a parallelized model
// spent more time waiting in them than multiplying. Here each rank copies its tensor into its
// slot of a segment all ranks map, marks it arrived, waits (spinning, then sleeping on a futex)
// until every rank has, and reads every slot: a few microseconds.
//
// Every rank sums the slots in rank order, so every rank gets the same bits. A rank that
// exits while the others wait for it (its pid is gone, or left as a zombie that its parent has not
// reaped) makes them raise at once, naming it;
// one that stalls makes them raise after the group's timeout, as a Gloo collective would.

#include <ATen/core/Tensor.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>

namespace c10d {
class ProcessGroup;
}

namespace shardtorch {
namespace comm {

class SharedMemoryCollectives {
 public:
  // Bytes one rank's tensor may have; larger tensors go through the process group.
  static constexpr int64_t kSlotBytes = int64_t{1} << 20;

  // Collective over `group` (every rank calls it at the same point): the segment, or nullptr on
  // every rank when the ranks are not all on this host, SHARDTORCH_SHARED_MEMORY=0, or a
  // segment cannot be made on some rank.
  static std::unique_ptr<SharedMemoryCollectives> create(c10d::ProcessGroup& group,
                                                         const std::string& group_name,
                                                         std::chrono::milliseconds timeout);
  ~SharedMemoryCollectives();
  SharedMemoryCollectives(const SharedMemoryCollectives&) = delete;
  SharedMemoryCollectives& operator=(const SharedMemoryCollectives&) = delete;

  // `tensor` (contiguous, CPU, at most kSlotBytes) becomes the sum over the group.
  void all_reduce(at::Tensor& tensor);
  // `output` (contiguous, CPU) becomes every rank's `input` (at most kSlotBytes) in rank order.
  void all_gather(const at::Tensor& input, at::Tensor& output);

 private:
  struct RankControl;
  SharedMemoryCollectives(std::string group_name, int64_t rank, int64_t size, void* base,
                          size_t bytes, std::chrono::milliseconds timeout);
  char* slot(int64_t sequence, int64_t rank) const;
  RankControl& control(int64_t rank) const;
  // Waits until every rank's `arrived` (or `departed`) counter reaches `target`.
  void wait_for_all(bool arrived, int64_t target, const char* collective) const;
  int64_t begin(const at::Tensor& input, const char* collective);
  void end(int64_t sequence);
  // Wakes the peers sleeping on this rank's counters.
  void announce();

  std::string group_name_;
  int64_t rank_;
  int64_t size_;
  void* base_;
  size_t bytes_;
  std::chrono::milliseconds timeout_;
  int64_t sequence_ = 0;
};

}  // namespace comm
}  // namespace shardtorch
