#include "comm/nccl_communicator.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <shared_mutex>
#include <cstring>
#include <memory>
#include <type_traits>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "comm/process_group_communicator.h"
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

// Makes the caller's current stream wait for work enqueued on the
// communication stream; throws instead when the watchdog aborted the
// communicator (the work's output is garbage then).
class NcclHandle final : public CommHandle {
 public:
  NcclHandle(std::shared_ptr<at::cuda::CUDAEvent> done,
             std::shared_ptr<CollectiveWatchdog> watchdog)
      : done_(std::move(done)), watchdog_(std::move(watchdog)) {}
  void wait() override {
    watchdog_->check();
    if (done_) done_->block(at::cuda::getCurrentCUDAStream());
    done_.reset();
  }

 private:
  std::shared_ptr<at::cuda::CUDAEvent> done_;
  std::shared_ptr<CollectiveWatchdog> watchdog_;
};

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
  explicit NcclCommunicator(const GroupInfo& group)
      : name_(group.layout.name),
        rank_(group.layout.rank),
        size_(group.layout.size),
        device_(c10::cuda::current_device()),
        stream_(at::cuda::getStreamFromPool(/*isHighPriority=*/true, device_)) {
    ncclUniqueId id;
    if (rank_ == 0) SHARDTORCH_NCCL_CHECK(ncclGetUniqueId(&id), "ncclGetUniqueId");
    at::Tensor id_bytes = at::empty({static_cast<int64_t>(sizeof(id))}, at::kByte);
    std::memcpy(id_bytes.data_ptr(), &id, sizeof(id));
    ProcessGroupCommunicator(name_, group.process_group).broadcast(id_bytes, 0);
    std::memcpy(&id, id_bytes.data_ptr(), sizeof(id));
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

  ~NcclCommunicator() override {
    // Stop watching before the communicator goes (handles may keep the
    // watchdog object alive, not its thread); an aborted one is already freed.
    const bool work_pending = watchdog_->pending() > 0;
    watchdog_->stop();
    if (aborted_.load()) {
      comm_.release();
    } else if (work_pending) {
      // ncclCommDestroy waits for collectives in flight, which a peer that
      // never joined would make forever: abort instead.
      ncclCommAbort(comm_.release());
    }
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
    std::unique_lock<std::shared_timed_mutex> lock(launch_mutex_, std::defer_lock);
    // Not getting it in time means a launch is stuck: abort regardless.
    static_cast<void>(lock.try_lock_for(std::chrono::seconds(2)));
    if (aborted_.exchange(true)) return;
    ncclCommAbort(comm_.get());
  }

  template <typename Launch>
  std::shared_ptr<CommHandle> enqueue(std::initializer_list<at::Tensor> tensors, const char* what,
                                      Launch&& launch) {
    for (const auto& t : tensors) {
      TORCH_CHECK(t.is_cuda() && t.get_device() == device_, "shardtorch NCCL ", what, " on group '",
                  name_, "': tensors must be on cuda:", device_, ", got ", t.device());
      TORCH_CHECK(t.is_contiguous(), "shardtorch NCCL ", what, ": tensors must be contiguous");
    }
    std::shared_lock<std::shared_timed_mutex> launching(launch_mutex_);
    watchdog_->check();
    TORCH_CHECK(!aborted_.load(), "shardtorch NCCL ", what, " on group '", name_,
                "': the communicator was aborted after a failed collective");
    c10::cuda::CUDAGuard guard(device_);
    auto current = at::cuda::getCurrentCUDAStream(device_);
    at::cuda::CUDAEvent ready;
    ready.record(current);
    ready.block(stream_);
    // The watchdog's clock starts when the inputs are ready, not at launch.
    auto state = std::make_shared<LaunchState>();
    state->started = std::make_shared<at::cuda::CUDAEvent>();
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
      state->done = std::make_shared<at::cuda::CUDAEvent>();
      state->done->record(stream_);
    } catch (...) {
      state->launch_failed.store(true, std::memory_order_release);
      throw;
    }
    state->launched.store(true, std::memory_order_release);
    return std::make_shared<NcclHandle>(state->done, watchdog_);
  }

  std::string name_;
  int64_t rank_;
  int64_t size_;
  c10::DeviceIndex device_;
  c10::cuda::CUDAStream stream_;
  NcclCommPtr comm_;
  std::atomic<bool> aborted_{false};
  // Shared by launches, taken (briefly, if it can) by abort().
  std::shared_timed_mutex launch_mutex_;
  // Declared last: destroyed first, so its thread never sees a half-gone communicator.
  std::shared_ptr<CollectiveWatchdog> watchdog_;
};

// Plug NCCL in as the communicator for CUDA tensors when the library loads.
const bool kRegistered = [] {
  register_communicator_factory(c10::DeviceType::CUDA, [](const GroupInfo& group) {
    return std::static_pointer_cast<Communicator>(std::make_shared<NcclCommunicator>(group));
  });
  return true;
}();

}  // namespace

std::shared_ptr<Communicator> make_nccl_communicator(const GroupInfo& group) {
  return std::make_shared<NcclCommunicator>(group);
}

}  // namespace comm
}  // namespace shardtorch
