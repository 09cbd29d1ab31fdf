#include "comm/nccl_communicator.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <type_traits>
#include <vector>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "comm/deferred_checks.h"
#include "comm/launch_lock.h"
#include "comm/nccl_teardown.h"
#include "comm/process_group_communicator.h"
#include "comm/store_exchange.h"
#include "comm/watchdog.h"
#include "utils/cuda_library_checks.h"

namespace shardtorch {
namespace comm {
namespace {

struct NcclCommDeleter {
  void operator()(ncclComm_t comm) const {
    if (comm) ncclCommDestroy(comm);
  }
};
using NcclCommPtr = std::unique_ptr<std::remove_pointer_t<ncclComm_t>, NcclCommDeleter>;

ncclDataType_t nccl_dtype(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return ncclFloat32;
    case at::kDouble: return ncclFloat64;
    case at::kHalf: return ncclFloat16;
    case at::kBFloat16: return ncclBfloat16;
    case at::kLong: return ncclInt64;
    case at::kInt: return ncclInt32;
    case at::kByte: return ncclUint8;
    case at::kChar: return ncclInt8;
    default: TORCH_CHECK(false, "shardtorch NCCL communicator: unsupported dtype ", type);
  }
}

// Makes the caller's current stream of the communicator's device (not of the
// current device, which may be another) wait for work enqueued on the
// communication stream; throws instead when the watchdog aborted the
// communicator (the work's output is garbage then).
class NcclHandle final : public CommHandle {
 public:
  NcclHandle(std::shared_ptr<at::cuda::CUDAEvent> done,
             std::shared_ptr<CollectiveWatchdog> watchdog, c10::DeviceIndex device)
      : done_(std::move(done)), watchdog_(std::move(watchdog)), device_(device) {}
  void wait() override {
    watchdog_->check();
    if (done_) done_->block(at::cuda::getCurrentCUDAStream(device_));
    done_.reset();
  }

 private:
  std::shared_ptr<at::cuda::CUDAEvent> done_;
  std::shared_ptr<CollectiveWatchdog> watchdog_;
  c10::DeviceIndex device_;
};

// Events are reused instead of created per collective: one that comes back
// (its collective seen finished and its handle dropped) serves the next.
class EventPool : public std::enable_shared_from_this<EventPool> {
 public:
  std::shared_ptr<at::cuda::CUDAEvent> get() {
    std::unique_ptr<at::cuda::CUDAEvent> event;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!free_.empty()) {
        event = std::move(free_.back());
        free_.pop_back();
      }
    }
    if (!event) event = std::make_unique<at::cuda::CUDAEvent>();
    std::weak_ptr<EventPool> pool = weak_from_this();
    return std::shared_ptr<at::cuda::CUDAEvent>(event.release(), [pool](at::cuda::CUDAEvent* e) {
      std::unique_ptr<at::cuda::CUDAEvent> owned(e);
      if (auto alive = pool.lock()) {
        std::lock_guard<std::mutex> lock(alive->mutex_);
        alive->free_.push_back(std::move(owned));
      }
    });
  }

 private:
  std::mutex mutex_;
  std::vector<std::unique_ptr<at::cuda::CUDAEvent>> free_;
};

// The ncclUniqueId of a new communicator, from group rank 0 to every rank:
// through the process group's store (works whatever its backend), or, for a
// group that has no store, a broadcast over its CPU backend.
ncclUniqueId share_unique_id(const GroupInfo& group) {
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  const std::string& name = group.layout.name;
  if (group.layout.rank == 0) SHARDTORCH_NCCL_CHECK(ncclGetUniqueId(&id), "ncclGetUniqueId");
  const auto shared =
      share_through_group_store(group, nccl_unique_id_scope(name),
                                std::string(reinterpret_cast<const char*>(&id), sizeof(id)));
  if (shared.has_value()) {
    TORCH_CHECK(shared->size() == sizeof(id), "shardtorch NCCL communicator for group '", name,
                "': the store held ", shared->size(), " bytes, expected an ", sizeof(id),
                "-byte ncclUniqueId");
    std::memcpy(&id, shared->data(), sizeof(id));
    return id;
  }
  at::Tensor id_bytes = at::empty({static_cast<int64_t>(sizeof(id))}, at::kByte);
  std::memcpy(id_bytes.data_ptr(), &id, sizeof(id));
  ProcessGroupCommunicator(name, group.process_group).broadcast(id_bytes, 0);
  std::memcpy(&id, id_bytes.data_ptr(), sizeof(id));
  return id;
}

std::string nccl_async_error(ncclComm_t comm) {
  ncclResult_t state = ncclSuccess;
  ncclResult_t queried = ncclCommGetAsyncError(comm, &state);
  if (queried != ncclSuccess)
    return std::string("ncclCommGetAsyncError failed: ") + ncclGetErrorString(queried);
  if (state == ncclSuccess || state == ncclInProgress) return "";
  // NCCL's last error is per process, not per communicator: a hint only.
  const char* detail = ncclGetLastError(comm);
  return std::string(ncclGetErrorString(state)) +
         (detail && *detail ? std::string(" (NCCL's last error: ") + detail + ")" : "");
}

// A collective as the watchdog sees it. It is watched from before its launch:
// a launch that blocks on the host (connecting to a dead peer) counts from the
// registration, by the host clock; once launched, from its start event.
struct LaunchState {
  std::shared_ptr<at::cuda::CUDAEvent> started;
  std::shared_ptr<at::cuda::CUDAEvent> done;  // set before `launched`
  std::atomic<bool> launched{false};
  std::atomic<bool> launch_failed{false};  // its error went to the caller
  bool is_started() const { return !launched.load(std::memory_order_acquire) || started->query(); }
  bool is_done() const {
    if (launch_failed.load(std::memory_order_acquire)) return true;
    return launched.load(std::memory_order_acquire) && done->query();
  }
};

class NcclCommunicator final : public Communicator {
 public:
  // `tensors_device`, not the current device (a rank that never
  // called set_device would otherwise put every communicator on cuda:0).
  NcclCommunicator(const GroupInfo& group, const c10::Device& tensors_device)
      : name_(group.layout.name),
        rank_(group.layout.rank),
        size_(group.layout.size),
        device_(tensors_device.has_index() ? tensors_device.index() : c10::cuda::current_device()),
        stream_(at::cuda::getStreamFromPool(/*isHighPriority=*/true, device_)),
        launch_mutex_(device_launch_mutex(c10::Device(c10::kCUDA, device_))),
        events_(std::make_shared<EventPool>()),
        // A verdict that a rank left aborts before anything else is waited
        // for: the collectives launched since wait for that rank in vain.
        deferred_checks_(DeferredChecks::kDefaultLag, [this] { abort_for_a_rank_that_left(); }),
        description_("NCCL communicator for group '" + name_ + "'") {
    const ncclUniqueId id = share_unique_id(group);
    c10::cuda::CUDAGuard guard(device_);
    ncclComm_t raw = nullptr;
    SHARDTORCH_NCCL_CHECK(
        ncclCommInitRank(&raw, static_cast<int>(size_), id, static_cast<int>(rank_)),
        "ncclCommInitRank for group '" + name_ + "'");
    comm_.reset(raw);

    const std::string description = "group '" + name_ + "' (rank " + std::to_string(rank_) +
                                    " of " + std::to_string(size_) +
                                    ", nccl on cuda:" + std::to_string(device_) + ")";
    WatchdogBackend backend;
    backend.async_error = [raw] { return nccl_async_error(raw); };
    backend.abort = [this] { abort(); };
    // A verdict that a rank left, read as soon as its copy is on the host:
    // the collectives launched since (a backward's all-reduce, say) and a
    // host sync behind them return at once instead of at the timeout.
    backend.poll_deferred_checks = [this] { deferred_checks_.poll(); };
    const c10::DeviceIndex device = device_;
    backend.on_thread_start = [device] {
      c10::cuda::set_device(device);
      // Polling events must not invalidate a CUDA graph that another thread
      // is capturing in the global mode.
      cudaStreamCaptureMode mode = cudaStreamCaptureModeThreadLocal;
      cudaThreadExchangeStreamCaptureMode(&mode);
    };
    watchdog_ = std::make_shared<CollectiveWatchdog>(description, group.timeout, std::move(backend),
                                                     failure_policy_from_env());
  }

  // Every healthy rank takes the same path (comm/nccl_teardown.h).
  ~NcclCommunicator() override {
    // A check no later collective came to raise must not vanish unseen
    // (destroy_process_group raises it before this: check_deferred()). First:
    // a verdict that a rank left aborts, and the drain must then not wait for
    // the collectives that rank never joins.
    try {
      c10::cuda::CUDAGuard guard(device_);
      raise_failed_check(deferred_checks_.settle_all(), description_);
    } catch (const c10::Error& e) {
      std::fprintf(stderr, "%s\n", e.what_without_backtrace());
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());
    }
    if (nccl_teardown(aborted_.load()) == NcclTeardown::kDrainThenDestroy) {
      c10::cuda::CUDAGuard guard(device_);
      // With the watchdog still on: a peer that never finishes makes it fire.
      static_cast<void>(cudaStreamSynchronize(stream_.stream()));
    }
    // Stop watching before the communicator goes (handles may keep the
    // watchdog object alive, not its thread).
    watchdog_->stop();
    // The watchdog may have aborted it during the drain: then NCCL freed it.
    if (aborted_.load()) comm_.release();
    // Otherwise comm_'s deleter calls ncclCommDestroy, with nothing in flight.
  }

  int64_t rank() const override { return rank_; }
  int64_t size() const override { return size_; }
  const std::string& group_name() const override { return name_; }
  std::string backend_name() const override { return "nccl"; }

  std::shared_ptr<CommHandle> all_reduce_async(at::Tensor& tensor) override {
    return enqueue({tensor}, "all_reduce", [&](cudaStream_t s) {
      return ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(),
                           nccl_dtype(tensor.scalar_type()), ncclSum, comm_.get(), s);
    });
  }

  std::shared_ptr<CommHandle> all_gather_async(const at::Tensor& input,
                                               at::Tensor& output) override {
    TORCH_CHECK(output.numel() == input.numel() * size_, "all_gather: output must hold ", size_,
                " blocks of ", input.numel(), " elements, got ", output.numel());
    return enqueue({input, output}, "all_gather", [&](cudaStream_t s) {
      return ncclAllGather(input.data_ptr(), output.data_ptr(), input.numel(),
                           nccl_dtype(input.scalar_type()), comm_.get(), s);
    });
  }

  std::shared_ptr<CommHandle> reduce_scatter_async(const at::Tensor& input,
                                                   at::Tensor& output) override {
    TORCH_CHECK(input.numel() == output.numel() * size_, "reduce_scatter: input must hold ", size_,
                " blocks of ", output.numel(), " elements, got ", input.numel());
    return enqueue({input, output}, "reduce_scatter", [&](cudaStream_t s) {
      return ncclReduceScatter(input.data_ptr(), output.data_ptr(), output.numel(),
                               nccl_dtype(input.scalar_type()), ncclSum, comm_.get(), s);
    });
  }

  std::shared_ptr<CommHandle> broadcast_async(at::Tensor& tensor, int64_t root) override {
    return enqueue({tensor}, "broadcast", [&](cudaStream_t s) {
      return ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(),
                           nccl_dtype(tensor.scalar_type()), static_cast<int>(root), comm_.get(),
                           s);
    });
  }

  // The values go to pinned host memory on the device's current stream, and
  // the verdict waits in deferred_checks_ until the group's 8th launch after
  // this one (comm/deferred_checks.h): the host never waits for a copy it
  // could read later, and every rank raises at the same launch.
  void raise_if(const at::Tensor& gathered, const Verdict& verdict) override {
    c10::cuda::CUDAGuard guard(device_);
    at::Tensor host =
        at::empty(gathered.sizes(),
                  at::TensorOptions().dtype(at::kDouble).device(c10::kCPU).pinned_memory(true));
    host.copy_(gathered.to(at::kDouble), /*non_blocking=*/true);
    std::shared_ptr<at::cuda::CUDAEvent> copied = events_->get();
    copied->record(at::cuda::getCurrentCUDAStream(device_));
    CheckCopy copy;
    copy.ready = [copied] { return copied->query(); };
    copy.wait = [copied] { copied->synchronize(); };
    copy.values = [host] {
      const double* values = host.const_data_ptr<double>();
      return std::vector<double>(values, values + host.numel());
    };
    deferred_checks_.add(std::move(copy), verdict);
  }

  void check_deferred() override {
    c10::cuda::CUDAGuard guard(device_);
    raise_failed_check(deferred_checks_.settle_all(), description_);
  }

  // Its peers learn it at their 8th collective after this one, having launched
  // up to 7 that this rank would have to join: it joins none (no abort needed
  // here: its collectives so far were all joined by its peers, so they end),
  // and its peers abort theirs (raise_failed_check).
  void raised_alone(const std::string& error) override {
    if (size_ > 1) raised_alone_.record(error);
  }

  DeferredCheckCounts deferred_check_counts() const override { return deferred_checks_.counts(); }

  void synchronize() override {
    c10::cuda::CUDAGuard guard(device_);
    watchdog_->check();
    C10_CUDA_CHECK(cudaStreamSynchronize(stream_.stream()));
  }

  std::shared_ptr<CommHandle> send_async(const at::Tensor& tensor, int64_t dst) override {
    return enqueue({tensor}, "send", [&](cudaStream_t s) {
      return ncclSend(tensor.data_ptr(), tensor.numel(), nccl_dtype(tensor.scalar_type()),
                      static_cast<int>(dst), comm_.get(), s);
    });
  }

  std::shared_ptr<CommHandle> recv_async(at::Tensor& tensor, int64_t src) override {
    return enqueue({tensor}, "recv", [&](cudaStream_t s) {
      return ncclRecv(tensor.data_ptr(), tensor.numel(), nccl_dtype(tensor.scalar_type()),
                      static_cast<int>(src), comm_.get(), s);
    });
  }

 private:
  // From the watchdog thread (raise policy): makes the collectives in flight
  // return. NCCL frees the communicator; the flag, set under the launch lock
  // when a launch is not stuck, keeps later launches from touching it. A
  // launch stuck on the host past the wait is what the abort must unblock.
  void abort() {
    std::unique_lock<std::timed_mutex> lock(launch_mutex_, std::defer_lock);
    // Not getting it in time means a launch is stuck: abort regardless.
    static_cast<void>(lock.try_lock_for(std::chrono::seconds(2)));
    if (aborted_.exchange(true)) return;
    ncclCommAbort(comm_.get());
  }

  // A verdict said a rank raised a check alone long ago: the collectives
  // launched since wait for it in vain. Aborted (they return; this rank's
  // later launches raise), as every healthy rank of the group does at this
  // verdict. The watchdog stops first: it polls the communicator the abort
  // frees (called from the watchdog's own poll, it stops after this poll).
  void abort_for_a_rank_that_left() {
    if (size_ == 1) return;
    watchdog_->stop();
    abort();
  }

  template <typename Launch>
  std::shared_ptr<CommHandle> enqueue(std::initializer_list<at::Tensor> tensors, const char* what,
                                      Launch&& launch) {
    for (const auto& t : tensors) {
      TORCH_CHECK(t.is_cuda() && t.get_device() == device_, "shardtorch NCCL ", what, " on group '",
                  name_, "': tensors must be on cuda:", device_, ", got ", t.device());
      TORCH_CHECK(t.is_contiguous(), "shardtorch NCCL ", what, ": tensors must be contiguous");
    }
    // Before the launch lock: a wait for a check's copy (rare: only when the
    // GPU is `lag` collectives behind) must not hold up other groups' launches.
    // Counted before the launch is tried: one that then fails on this rank
    // alone still moves the ordinal as its peers' launches do.
    raised_alone_.check_before_launch(description_, what);
    {
      c10::cuda::CUDAGuard guard(device_);
      raise_failed_check(deferred_checks_.before_launch(), description_);
    }
    // One launch at a time on this device, whichever communicator (NCCL's rule).
    return with_device_launch_lock(launch_mutex_, [&] {
      watchdog_->check();
      TORCH_CHECK(!aborted_.load(), "shardtorch NCCL ", what, " on group '", name_,
                  "': the communicator was aborted after a failed collective or after a rank "
                  "raised a failed argument check alone");
      c10::cuda::CUDAGuard guard(device_);
      auto current = at::cuda::getCurrentCUDAStream(device_);
      // Reused: the wait is enqueued at once, before the next record.
      ready_.record(current);
      ready_.block(stream_);
      // The watchdog's clock starts when the inputs are ready, not at launch.
      auto state = std::make_shared<LaunchState>();
      state->started = events_->get();
      state->started->record(stream_);
      // The caching allocator must not hand these blocks out again before the
      // communication stream is done with them.
      for (const auto& t : tensors) {
        c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream_);
      }
      watchdog_->watch(
          what, [state] { return state->is_started(); }, [state] { return state->is_done(); });
      try {
        SHARDTORCH_NCCL_CHECK(launch(stream_.stream()),
                              std::string(what) + " on group '" + name_ + "'");
        state->done = events_->get();
        state->done->record(stream_);
      } catch (...) {
        state->launch_failed.store(true, std::memory_order_release);
        throw;
      }
      state->launched.store(true, std::memory_order_release);
      return std::make_shared<NcclHandle>(state->done, watchdog_, device_);
    });
  }

  std::string name_;
  int64_t rank_;
  int64_t size_;
  c10::DeviceIndex device_;
  c10::cuda::CUDAStream stream_;
  NcclCommPtr comm_;
  std::atomic<bool> aborted_{false};
  // The device's launch lock (comm/launch_lock.h), also taken (briefly, if it
  // can) by abort().
  std::timed_mutex& launch_mutex_;
  at::cuda::CUDAEvent ready_;
  std::shared_ptr<EventPool> events_;
  // raise_if's checks, settled at the ordinal every rank agrees on.
  DeferredChecks deferred_checks_;
  const std::string description_;  // for errors: "NCCL communicator for group '...'"
  RaisedAlone raised_alone_;
  // Declared last: destroyed first, so its thread never sees a half-gone communicator.
  std::shared_ptr<CollectiveWatchdog> watchdog_;
};

// Plug NCCL in as the communicator for CUDA tensors when the library loads.
const bool kRegistered = [] {
  register_communicator_factory(c10::DeviceType::CUDA,
                                [](const GroupInfo& group, const c10::Device& device) {
                                  return std::static_pointer_cast<Communicator>(
                                      std::make_shared<NcclCommunicator>(group, device));
                                });
  return true;
}();

}  // namespace

std::shared_ptr<Communicator> make_nccl_communicator(const GroupInfo& group,
                                                     const c10::Device& device) {
  return std::make_shared<NcclCommunicator>(group, device);
}

}  // namespace comm
}  // namespace shardtorch
