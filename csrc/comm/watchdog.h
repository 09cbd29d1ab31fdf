#pragma once
// Turns a collective that never finishes into an error instead of a hang.
//
// NCCL collectives run on a communication stream without the host waiting for
// them, so nothing on the calling thread notices when a peer dies or stalls:
// the kernel spins forever and so does every later synchronisation. The
// watchdog follows each collective on its own thread. When one has been
// running longer than the group's timeout, or the backend reports an
// asynchronous error, it aborts the communicator (which makes the stuck
// kernels return) and records a message naming the group, the collective and
// its sequence number. What happens next is the failure policy:
//
//   terminate (default): print the message and end the process, because the
//       collective's output is garbage and the host thread may already be past
//       the point where it could be told. It does not abort first:
//       ncclCommAbort can itself hang, and ending the process frees everything;
//   raise: abort the communicator (the stuck kernels return) and keep the
//       process; every later use of the communicator (a launch or a handle's
//       wait) throws the message. Results a wait() handed out before the
//       failure was seen may be garbage: terminate is the safe default.
//       SHARDTORCH_ON_COMM_FAILURE=raise.
//
// Device-free: the backend plugs in through callbacks, so CPU tests drive it
// with fakes (tests/unit/test_watchdog.py) and NCCL uses CUDA events.

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace shardtorch {
namespace comm {

enum class FailurePolicy { kTerminate, kRaise };

struct WatchdogState;

// SHARDTORCH_ON_COMM_FAILURE: "terminate" (default) or "raise"; anything else
// is an error naming the accepted values.
FailurePolicy failure_policy_from_env();

// What the watchdog needs of a backend.
struct WatchdogBackend {
  // An asynchronous error the backend has seen, or "" when there is none.
  std::function<std::string()> async_error;
  // Makes every collective in flight return; called once, from the watchdog
  // thread, under the raise policy only.
  std::function<void()> abort;
  // Called first on the watchdog thread (CUDA: select the communicator's
  // device, so that polling its events creates no context on device 0).
  std::function<void()> on_thread_start;
  // Called at each poll while collectives are in flight, before they are
  // looked at (may be empty): gives the deferred argument checks whose copies
  // are ready their look (DeferredChecks::poll), so that a verdict that a
  // rank left aborts the collectives that rank never joins at once, not at
  // the group's timeout. It may stop this watchdog (from its own thread).
  std::function<void()> poll_deferred_checks;
};

class CollectiveWatchdog {
 public:
  // `group` describes the communicator in messages, e.g. "group 'tp' (rank 0 of 2, nccl)".
  CollectiveWatchdog(std::string group, std::chrono::milliseconds timeout, WatchdogBackend backend,
                     FailurePolicy policy,
                     std::chrono::milliseconds poll_interval = std::chrono::milliseconds(100));
  ~CollectiveWatchdog();
  CollectiveWatchdog(const CollectiveWatchdog&) = delete;
  CollectiveWatchdog& operator=(const CollectiveWatchdog&) = delete;

  // Follows one collective. started(): its inputs are ready and it runs (the
  // timeout counts from the first poll that sees this, not from the launch, so
  // a collective queued behind long compute is not blamed for it). done(): it
  // finished. Both are polled from the watchdog thread; one that throws stops
  // the watching of that collective (its error belongs to the caller).
  // Returns the collective's sequence number on this communicator.
  int64_t watch(std::string collective, std::function<bool()> started, std::function<bool()> done);

  // Stops following collectives and joins the thread (idempotent). The owner
  // calls it before the backend the callbacks use goes away: handles may keep
  // the watchdog itself alive longer, for check().
  void stop();

  // Throws the recorded failure, if any. Call before each launch and in wait().
  void check() const;
  bool failed() const;
  std::string failure() const;
  // Collectives launched and not yet seen finished.
  int64_t pending() const;

 private:
  // Everything the thread reads (watchdog.cpp), shared by the thread and this object: the
  // last reference to the watchdog may be dropped on its own thread (by a callback), and
  // that thread must still be able to finish its poll and return.
  std::shared_ptr<WatchdogState> state_;
  std::thread thread_;
};

}  // namespace comm
}  // namespace shardtorch
