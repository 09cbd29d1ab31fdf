#pragma once
// The communication interface every op uses. A Communicator belongs to one
// group and one device type; ops never talk to c10d or NCCL directly, so the
// same op code runs over Gloo on CPU and NCCL on CUDA.

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/deferred_checks.h"

namespace shardtorch {
namespace comm {

// A collective in flight. wait() orders the caller after its completion: on
// CPU it blocks; on CUDA it makes the current stream wait, without a host sync.
class CommHandle {
 public:
  virtual ~CommHandle() = default;
  virtual void wait() = 0;
};

// A handle for work that already finished (or was never needed).
class CompletedHandle final : public CommHandle {
 public:
  void wait() override {}
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int64_t rank() const = 0;
  virtual int64_t size() const = 0;
  virtual const std::string& group_name() const = 0;
  // "gloo", "nccl", ...: for error messages and tests.
  virtual std::string backend_name() const = 0;

  // In-place sum over the group. `tensor` must be contiguous.
  virtual std::shared_ptr<CommHandle> all_reduce_async(at::Tensor& tensor) = 0;
  // `output` holds size() equal blocks, each input.numel() long, in rank order.
  virtual std::shared_ptr<CommHandle> all_gather_async(const at::Tensor& input,
                                                       at::Tensor& output) = 0;
  // `input` holds size() equal blocks; block r, summed over the group, lands
  // in `output` on rank r.
  virtual std::shared_ptr<CommHandle> reduce_scatter_async(const at::Tensor& input,
                                                           at::Tensor& output) = 0;
  virtual std::shared_ptr<CommHandle> broadcast_async(at::Tensor& tensor, int64_t root) = 0;
  virtual std::shared_ptr<CommHandle> send_async(const at::Tensor& tensor, int64_t dst) = 0;
  virtual std::shared_ptr<CommHandle> recv_async(at::Tensor& tensor, int64_t src) = 0;

  // Raises, on every rank, what `verdict` makes of `gathered`: values that
  // every rank holds alike after a collective (each rank's argument checks,
  // gathered with the data), read on the host; "" means all is well.
  // Here (CPU, SHARDTORCH_DEBUG) they are read at once and the error raised
  // now. The NCCL communicator copies them without a host synchronisation and
  // gives the verdict later, at an ordinal every rank agrees on: before the
  // group's 8th launch after this one, or at check_deferred() (the rule:
  // comm/deferred_checks.h).
  using Verdict = CheckVerdict;
  virtual void raise_if(const at::Tensor& gathered, const Verdict& verdict) {
    const at::Tensor host = gathered.to(c10::Device(c10::kCPU), at::kDouble).contiguous();
    const double* values = host.const_data_ptr<double>();
    const CheckOutcome outcome = verdict(std::vector<double>(values, values + host.numel()));
    TORCH_CHECK(outcome.error.empty(), outcome.error);
  }
  // This rank is about to raise `error` alone, right after the collective it
  // just launched (an argument check only it could make failed; its peers get
  // it from raise_if's values). Where they get it later (NCCL), the collectives
  // they launch meanwhile would wait for this rank: it joins none again.
  virtual void raised_alone(const std::string& error) { static_cast<void>(error); }
  // Gives every verdict raise_if left pending, now, waiting for the device if
  // needed; raises the first failed one. Every rank must call it at the same
  // point (ts.distributed.check_deferred, destroy_process_group).
  virtual void check_deferred() {}
  // What the deferred checks did so far (all zero where raise_if is immediate).
  virtual DeferredCheckCounts deferred_check_counts() const { return {}; }
  // Blocks the host until the collectives launched so far are done, before
  // it reads their outputs (a rank about to raise reads what its peers'
  // checks found). Nothing to do where wait() blocks already (CPU).
  virtual void synchronize() {}

  void all_reduce(at::Tensor& tensor) { all_reduce_async(tensor)->wait(); }
  void all_gather(const at::Tensor& input, at::Tensor& output) {
    all_gather_async(input, output)->wait();
  }
  void reduce_scatter(const at::Tensor& input, at::Tensor& output) {
    reduce_scatter_async(input, output)->wait();
  }
  void broadcast(at::Tensor& tensor, int64_t root) { broadcast_async(tensor, root)->wait(); }
  void send(const at::Tensor& tensor, int64_t dst) { send_async(tensor, dst)->wait(); }
  void recv(at::Tensor& tensor, int64_t src) { recv_async(tensor, src)->wait(); }
};

}  // namespace comm
}  // namespace shardtorch
