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
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace shardtorch {
namespace comm {

// What a check's values mean: an empty error when all is well. a_rank_left:
// the check a rank failed was one only it could make, known on its host, so it
// raised at once (Communicator::raised_alone) and joins no later collective:
// the collectives launched since wait for it forever (the communicator aborts).
//
// When several due checks fail at once, the first one's error is raised; if a
// later one of them says a rank left, its error travels apart in
// later_rank_left (the communicator is aborted all the same), so that the
// departure is never pinned on an earlier, unrelated error.
struct CheckOutcome {
  CheckOutcome(std::string error_ = std::string(), bool a_rank_left_ = false)
      : error(std::move(error_)), a_rank_left(a_rank_left_) {}
  std::string error;
  bool a_rank_left;
  std::string later_rank_left;
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
  int64_t dropped = 0;   // checks left unread because a verdict said a rank left
};

class DeferredChecks {
 public:
  // 8 launches: docs/cuda.md ("Errors without host synchronisation").
  static constexpr int64_t kDefaultLag = 8;

  // `abort_on_rank_left` (may be empty) runs once, the moment a verdict says
  // a rank left, before anything else is waited for: it must make the
  // collectives launched since return (NCCL: ncclCommAbort). Every check
  // still pending then is dropped unread: its copy waits behind collectives
  // the rank that left never joins (it would never arrive without the
  // abort), and its values are garbage after it.
  explicit DeferredChecks(int64_t lag = kDefaultLag,
                          std::function<void()> abort_on_rank_left = nullptr)
      : lag_(lag), abort_on_rank_left_(std::move(abort_on_rank_left)) {
    TORCH_CHECK(lag >= 1, "DeferredChecks: lag must be at least 1, got ", lag);
  }

  int64_t lag() const { return lag_; }

  // A check on the values of a collective already launched (the latest one).
  // After a rank left it is dropped at once (its collective's output is garbage).
  void add(CheckCopy copy, CheckVerdict verdict) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (a_rank_left_) {
      ++dropped_;
      return;
    }
    pending_.push_back(Pending{launches_ + lag_, std::move(copy), std::move(verdict)});
  }

  // Counts a launch about to be made and settles the checks due at it; gives
  // the first failed verdict (the caller raises it; the launch must then not
  // be made), or an empty one.
  [[nodiscard]] CheckOutcome before_launch() {
    std::lock_guard<std::mutex> lock(mutex_);
    ++launches_;
    if (!held_.error.empty()) return std::exchange(held_, CheckOutcome());
    return settle_locked(launches_);
  }

  // Settles every pending check now (waiting for copies not ready): what
  // ts.distributed.check_deferred(), the group's destruction and an op before
  // its own host read of the group's collectives do (every rank at the same
  // point of its program).
  [[nodiscard]] CheckOutcome settle_all() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!held_.error.empty()) return std::exchange(held_, CheckOutcome());
    return settle_locked(INT64_MAX);
  }

  // From another thread (the watchdog's, at each of its polls), never
  // blocking: looks at the pending checks whose copies are ready, in order,
  // and when one of them says a rank left, aborts at once (the collectives
  // launched since, and a host sync behind them, return instead of waiting
  // for the group's timeout) and holds that verdict for the next launch or
  // settle, which raise it. Any other verdict is only computed early: it is
  // still given at its due launch, as on every rank. Skipped while a settle
  // holds the lock (it gives the same verdicts itself).
  void poll() {
    std::unique_lock<std::mutex> lock(mutex_, std::try_to_lock);
    if (!lock.owns_lock() || a_rank_left_) return;
    for (size_t i = 0; i < pending_.size(); ++i) {
      Pending& check = pending_[i];
      if (!check.outcome) {
        if (!check.copy.ready()) return;  // in launch order: the rest come later
        check.outcome = std::make_shared<CheckOutcome>(check.verdict(check.copy.values()));
      }
      if (!check.outcome->a_rank_left) continue;
      // Given now, with the checks before it (as settle_locked gives them).
      CheckOutcome first;
      for (size_t j = 0; j <= i; ++j) {
        CheckOutcome& outcome = *pending_[j].outcome;
        ++settled_;
        if (first.error.empty()) {
          first = std::move(outcome);
        } else if (j == i) {
          first.later_rank_left =
              outcome.error.empty() ? std::string("a rank left") : std::move(outcome.error);
        }
      }
      pending_.erase(pending_.begin(), pending_.begin() + static_cast<std::ptrdiff_t>(i) + 1);
      held_ = std::move(first);
      rank_left_locked();
      return;
    }
  }

  // Whether a verdict said a rank left (the abort ran).
  bool a_rank_left() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return a_rank_left_;
  }

  DeferredCheckCounts counts() const {
    std::lock_guard<std::mutex> lock(mutex_);
    DeferredCheckCounts c;
    c.launches = launches_;
    c.pending = static_cast<int64_t>(pending_.size());
    c.settled = settled_;
    c.waits = waits_;
    c.dropped = dropped_;
    return c;
  }

 private:
  struct Pending {
    int64_t due;  // the launch before which its verdict is given
    CheckCopy copy;
    CheckVerdict verdict;
    std::shared_ptr<CheckOutcome> outcome;  // computed early by poll(), not yet given
  };

  // Checks are added in launch order, so the due ones are at the front, and a
  // copy is waited for only while no verdict has said a rank left: up to the
  // check that says it, every collective was joined by every rank, so every
  // copy arrives. Every due check is settled (and dropped) even after one
  // fails, so that a later launch does not raise an older error again.
  CheckOutcome settle_locked(int64_t up_to) {
    CheckOutcome first;
    while (!pending_.empty() && pending_.front().due <= up_to) {
      Pending check = std::move(pending_.front());
      pending_.pop_front();
      if (!check.outcome && !check.copy.ready()) {
        ++waits_;
        check.copy.wait();
      }
      ++settled_;
      CheckOutcome outcome =
          check.outcome ? std::move(*check.outcome) : check.verdict(check.copy.values());
      const bool rank_left = outcome.a_rank_left;
      if (first.error.empty()) {
        first = std::move(outcome);
      } else if (rank_left) {
        first.later_rank_left =
            outcome.error.empty() ? std::string("a rank left") : std::move(outcome.error);
      }
      if (rank_left) {
        rank_left_locked();
        break;
      }
    }
    return first;
  }

  // Abort first (the collectives since return), then drop what is pending.
  void rank_left_locked() {
    if (!a_rank_left_) {
      a_rank_left_ = true;
      if (abort_on_rank_left_) abort_on_rank_left_();
    }
    dropped_ += static_cast<int64_t>(pending_.size());
    pending_.clear();
  }

  const int64_t lag_;
  const std::function<void()> abort_on_rank_left_;
  mutable std::mutex mutex_;
  std::deque<Pending> pending_;
  int64_t launches_ = 0;
  int64_t settled_ = 0;
  int64_t waits_ = 0;
  int64_t dropped_ = 0;
  bool a_rank_left_ = false;
  CheckOutcome held_;  // a verdict that a rank left, found by poll(), not yet raised
};

// This rank's own departure: a check only it could make failed on its host, it
// raised at once (Communicator::raised_alone), and it joins no later launch of
// the group (its peers abort theirs at their verdict).
class RaisedAlone {
 public:
  void record(const std::string& error) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (error_.empty()) error_ = error.empty() ? std::string("an argument check") : error;
  }
  // Throws before a launch once this rank left.
  void check_before_launch(const std::string& communicator, const char* what) const {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(error_.empty(), communicator, ": ", what, ": this rank raised \"", error_,
                "\" alone and left the group's collectives (its peers abort theirs at their "
                "verdict on it)");
  }

 private:
  mutable std::mutex mutex_;
  std::string error_;
};

// Raises a failed verdict (nothing when it passed). Where the failing rank
// raised alone, `communicator` (described for the message) is aborted already.
inline void raise_failed_check(const CheckOutcome& failed, const std::string& communicator) {
  if (failed.error.empty()) return;
  TORCH_CHECK(!failed.a_rank_left, failed.error,
              " (that rank raised at once and left the group's collectives: this rank's ",
              communicator, " is aborted)");
  TORCH_CHECK(failed.later_rank_left.empty(), failed.error, " (then a later check: \"",
              failed.later_rank_left,
              "\": that rank raised at once and left the group's collectives: this rank's ",
              communicator, " is aborted)");
  TORCH_CHECK(false, failed.error);
}

}  // namespace comm
}  // namespace shardtorch
