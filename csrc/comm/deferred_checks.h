#pragma once
// The argument checks a communicator cannot read without waiting for the
// device (Communicator::raise_if on NCCL), and the rule that decides WHEN
// their verdict is given, the same on every rank:
//
//   a check made after the group's L-th launch is settled just before launch
//   L + lag (the lag-th launch after it), or at check_deferred() / when the
//   group is destroyed, whichever comes first.
//
// Every rank launches a communicator's collectives in the same order (NCCL's
// own rule), so every rank settles a check at the same ordinal and raises the
// same error there, whatever its GPU's progress. Whether a copy is ready is
// only asked to avoid blocking: a copy not ready when its check is due is
// waited for then (counted in `waits`), never raised sooner or later. So the
// host may run up to `lag` collectives ahead of the GPU, instead of one when
// every launch waited for the previous check (docs/cuda.md says why 8).
//
// Device-free: NcclCommunicator gives it CUDA events and pinned host copies,
// tests/unit/test_deferred_checks.py fakes (csrc/python/comm_testing_binding.cpp).

#include <c10/util/Exception.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace shardtorch {
namespace comm {

// What a check's values mean: an empty error when all is well. a_rank_left:
// the check a rank failed was one only it could make, known on its host, so it
// raised at once (Communicator::raised_alone) and joins no later collective:
// the collectives launched since wait for it forever (NcclCommunicator aborts).
struct CheckOutcome {
  CheckOutcome(std::string error_ = std::string(), bool a_rank_left_ = false)
      : error(std::move(error_)), a_rank_left(a_rank_left_) {}
  std::string error;
  bool a_rank_left;
};
using CheckVerdict = std::function<CheckOutcome(const std::vector<double>&)>;

// A check's values on their way to the host.
struct CheckCopy {
  std::function<bool()> ready;                  // without blocking (cudaEventQuery)
  std::function<void()> wait;                   // blocks until ready (cudaEventSynchronize)
  std::function<std::vector<double>()> values;  // once ready
};

struct DeferredCheckCounts {
  int64_t launches = 0;  // launches counted so far (the ordinal of the last)
  int64_t pending = 0;   // checks made, not yet settled
  int64_t settled = 0;   // checks whose verdict was given
  int64_t waits = 0;     // settled checks whose copy was not ready: the host blocked
};

class DeferredChecks {
 public:
  // 8 launches: docs/cuda.md ("Errors without host synchronisation").
  static constexpr int64_t kDefaultLag = 8;

  explicit DeferredChecks(int64_t lag = kDefaultLag) : lag_(lag) {
    TORCH_CHECK(lag >= 1, "DeferredChecks: lag must be at least 1, got ", lag);
  }

  int64_t lag() const { return lag_; }

  // A check on the values of a collective already launched (the latest one).
  void add(CheckCopy copy, CheckVerdict verdict) {
    std::lock_guard<std::mutex> lock(mutex_);
    pending_.push_back(Pending{launches_ + lag_, std::move(copy), std::move(verdict)});
  }

  // Counts a launch about to be made and settles the checks due at it; gives
  // the first failed verdict (the caller raises it; the launch must then not
  // be made), or an empty one.
  [[nodiscard]] CheckOutcome before_launch() {
    std::lock_guard<std::mutex> lock(mutex_);
    ++launches_;
    return settle_locked(launches_);
  }

  // Settles every pending check now (waiting for copies not ready): what
  // ts.distributed.check_deferred() and the group's destruction do.
  [[nodiscard]] CheckOutcome settle_all() {
    std::lock_guard<std::mutex> lock(mutex_);
    return settle_locked(INT64_MAX);
  }

  DeferredCheckCounts counts() const {
    std::lock_guard<std::mutex> lock(mutex_);
    DeferredCheckCounts c;
    c.launches = launches_;
    c.pending = static_cast<int64_t>(pending_.size());
    c.settled = settled_;
    c.waits = waits_;
    return c;
  }

 private:
  struct Pending {
    int64_t due;  // the launch before which its verdict is given
    CheckCopy copy;
    CheckVerdict verdict;
  };

  // Checks are added in launch order, so the due ones are at the front. Every
  // due check is settled (and dropped) even after one fails, so that a later
  // launch does not raise an older error again.
  CheckOutcome settle_locked(int64_t up_to) {
    CheckOutcome first;
    while (!pending_.empty() && pending_.front().due <= up_to) {
      Pending check = std::move(pending_.front());
      pending_.pop_front();
      if (!check.copy.ready()) {
        ++waits_;
        check.copy.wait();
      }
      ++settled_;
      CheckOutcome outcome = check.verdict(check.copy.values());
      const bool left = first.a_rank_left || outcome.a_rank_left;
      if (first.error.empty()) first = std::move(outcome);
      first.a_rank_left = left;
    }
    return first;
  }

  const int64_t lag_;
  mutable std::mutex mutex_;
  std::deque<Pending> pending_;
  int64_t launches_ = 0;
  int64_t settled_ = 0;
  int64_t waits_ = 0;
};

}  // namespace comm
}  // namespace shardtorch
