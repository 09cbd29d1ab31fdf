#include "comm/watchdog.h"

#include <c10/util/Exception.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iomanip>
#include <sstream>

namespace shardtorch {
namespace comm {

FailurePolicy failure_policy_from_env() {
  const char* value = std::getenv("SHARDTORCH_ON_COMM_FAILURE");
  if (value == nullptr || std::strcmp(value, "") == 0 || std::strcmp(value, "terminate") == 0) {
    return FailurePolicy::kTerminate;
  }
  TORCH_CHECK(std::strcmp(value, "raise") == 0,
              "SHARDTORCH_ON_COMM_FAILURE must be 'terminate' (default) or 'raise', got '", value,
              "'");
  return FailurePolicy::kRaise;
}

CollectiveWatchdog::CollectiveWatchdog(std::string group, std::chrono::milliseconds timeout,
                                       WatchdogBackend backend, FailurePolicy policy,
                                       std::chrono::milliseconds poll_interval)
    : group_(std::move(group)),
      timeout_(timeout),
      backend_(std::move(backend)),
      policy_(policy),
      poll_interval_(poll_interval) {
  TORCH_CHECK(timeout_.count() > 0, "shardtorch watchdog for ", group_,
              ": timeout must be positive, got ", timeout_.count(), " ms");
  TORCH_CHECK(poll_interval_.count() > 0, "shardtorch watchdog: poll interval must be positive");
  thread_ = std::thread([this] { run(); });
}

CollectiveWatchdog::~CollectiveWatchdog() { stop(); }

void CollectiveWatchdog::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

int64_t CollectiveWatchdog::watch(std::string collective, std::function<bool()> started,
                                  std::function<bool()> done) {
  auto work = std::make_shared<Work>();
  work->collective = std::move(collective);
  work->started = std::move(started);
  work->done = std::move(done);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    work->sequence = next_sequence_++;
    work_.push_back(work);
  }
  wake_.notify_all();
  return work->sequence;
}

void CollectiveWatchdog::check() const {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(failure_.empty(), failure_);
}

bool CollectiveWatchdog::failed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return !failure_.empty();
}

std::string CollectiveWatchdog::failure() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return failure_;
}

int64_t CollectiveWatchdog::pending() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int64_t>(work_.size());
}

void CollectiveWatchdog::run() {
  if (backend_.on_thread_start) {
    try {
      backend_.on_thread_start();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "shardtorch watchdog for %s: thread setup failed: %s\n", group_.c_str(),
                   e.what());
    }
  }
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    // Idle until there is work; then poll at the interval.
    wake_.wait(lock, [this] { return stopping_ || (!work_.empty() && failure_.empty()); });
    if (stopping_) return;
    lock.unlock();
    // The callbacks may take locks of their own (the GIL, for tests driven
    // from Python): never call them, nor destroy them, under our mutex.
    std::vector<std::shared_ptr<Work>> finished;
    const std::string message = poll(finished);
    finished.clear();
    if (!message.empty()) fail(message);
    lock.lock();
    wake_.wait_for(lock, poll_interval_, [this] { return stopping_; });
    if (stopping_) return;
  }
}

std::string CollectiveWatchdog::poll(std::vector<std::shared_ptr<Work>>& finished) {
  std::vector<std::shared_ptr<Work>> snapshot;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    snapshot = work_;
  }
  const auto now = std::chrono::steady_clock::now();
  std::string message;
  std::shared_ptr<Work> oldest_running;
  for (auto& work : snapshot) {
    bool is_done = false;
    try {
      if (!work->running && work->started()) {
        work->running = true;
        work->started_at = now;
      }
      is_done = work->running && work->done();
    } catch (const std::exception&) {
      is_done = true;  // the caller sees this error on its own stream
    }
    if (is_done) {
      finished.push_back(work);
      continue;
    }
    if (work->running && !oldest_running) oldest_running = work;
  }
  if (oldest_running && now - oldest_running->started_at >= timeout_) {
    const double seconds = std::chrono::duration<double>(now - oldest_running->started_at).count();
    std::ostringstream out;
    out << std::fixed << std::setprecision(1) << "shardtorch: " << oldest_running->collective
        << " #" << oldest_running->sequence << " on " << group_ << " has not finished " << seconds
        << " s after it started (timeout " << timeout_.count() / 1000.0
        << " s): a peer has probably died or stalled.";
    message = out.str();
  } else if (finished.size() < snapshot.size() && backend_.async_error) {
    // Only while work is unfinished: a peer that exits cleanly after the last
    // collective may leave an error behind that concerns nobody.
    std::string error;
    try {
      error = backend_.async_error();
    } catch (const std::exception& e) {
      error = e.what();
    }
    if (!error.empty()) {
      auto& first = oldest_running ? oldest_running : snapshot.front();
      message = "shardtorch: " + group_ + " reported an asynchronous error during " +
                first->collective + " #" + std::to_string(first->sequence) + ": " + error + ".";
    }
  }
  if (!finished.empty()) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<std::shared_ptr<Work>> remaining;
    for (auto& work : work_) {
      bool gone = false;
      for (auto& f : finished) gone = gone || f == work;
      if (!gone) remaining.push_back(work);
    }
    work_.swap(remaining);
  }
  return message;
}

void CollectiveWatchdog::fail(const std::string& cause) {
  std::string message = cause;
  if (policy_ == FailurePolicy::kRaise) {
    try {
      if (backend_.abort) backend_.abort();
      message += " The communicator was aborted.";
    } catch (const std::exception& e) {
      // Aborting is the last resort; its own failure must not hide the cause.
      message += std::string(" Aborting the communicator failed too: ") + e.what();
    }
  }
  std::vector<std::shared_ptr<Work>> abandoned;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    failure_ = message;
    abandoned.swap(work_);  // destroyed outside the lock, see run()
  }
  if (policy_ == FailurePolicy::kTerminate) {
    std::fprintf(stderr,
                 "%s\nshardtorch: terminating this process so that no result of the failed "
                 "collective is used (SHARDTORCH_ON_COMM_FAILURE=raise aborts the communicator and "
                 "raises on the next collective instead).\n",
                 message.c_str());
    std::fflush(stderr);
    std::_Exit(1);
  }
}

}  // namespace comm
}  // namespace shardtorch
