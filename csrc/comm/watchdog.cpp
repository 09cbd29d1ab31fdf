#include "comm/watchdog.h"

#include <c10/util/Exception.h>

#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <cstring>
#include <pthread.h>
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

struct WatchdogWork {
  int64_t sequence = 0;
  std::string collective;
  std::function<bool()> started;
  std::function<bool()> done;
  bool running = false;
  std::chrono::steady_clock::time_point started_at;
};

struct WatchdogState {
  std::string group;
  std::chrono::milliseconds timeout{0};
  WatchdogBackend backend;
  FailurePolicy policy = FailurePolicy::kTerminate;
  std::chrono::milliseconds poll_interval{0};

  mutable std::mutex mutex;
  std::condition_variable wake;
  std::vector<std::shared_ptr<WatchdogWork>> work;
  int64_t next_sequence = 0;
  std::string failure;
  bool stopping = false;
};

namespace {

using Work = WatchdogWork;
using State = WatchdogState;

void request_stop(State& state) {
  {
    std::lock_guard<std::mutex> lock(state.mutex);
    state.stopping = true;
  }
  state.wake.notify_all();
}

// Watchdogs belong to communicators that the group registry keeps to the end of the process
// (ops may run at exit), so their threads would still poll while exit() runs static
// destructors (the CUDA runtime's among them). At exit they stop first. Never destroyed.
struct LiveStates {
  std::mutex mutex;
  std::vector<std::weak_ptr<State>> states;
};

LiveStates& live_states();

void stop_all_at_exit() {
  auto& live = live_states();
  std::lock_guard<std::mutex> lock(live.mutex);
  for (auto& weak : live.states) {
    if (auto state = weak.lock()) request_stop(*state);
  }
}

LiveStates& live_states() {
  static auto* live = [] {
    auto* created = new LiveStates();
    std::atexit(&stop_all_at_exit);
    return created;
  }();
  return *live;
}

void add_live(const std::shared_ptr<State>& state) {
  auto& live = live_states();
  std::lock_guard<std::mutex> lock(live.mutex);
  auto& states = live.states;
  states.erase(std::remove_if(states.begin(), states.end(),
                              [](const std::weak_ptr<State>& s) { return s.expired(); }),
               states.end());
  states.push_back(state);
}

// Polls every collective once; returns the failure message, or "".
std::string poll_once(State& state, std::vector<std::shared_ptr<Work>>& finished);
void fail(State& state, const std::string& cause);

void run(const std::shared_ptr<State>& state) {
  // Named so that the exit path (shardtorch/distributed/clean_exit.py) can wait for it.
  pthread_setname_np(pthread_self(), "shardtorch_wdog");
  if (state->backend.on_thread_start) {
    try {
      state->backend.on_thread_start();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "shardtorch watchdog for %s: thread setup failed: %s\n",
                   state->group.c_str(), e.what());
    }
  }
  std::unique_lock<std::mutex> lock(state->mutex);
  while (true) {
    // Idle until there is work; then poll at the interval.
    state->wake.wait(
        lock, [&] { return state->stopping || (!state->work.empty() && state->failure.empty()); });
    if (state->stopping) return;
    lock.unlock();
    // The callbacks may take locks of their own (the GIL, for tests driven
    // from Python): never call them, nor destroy them, under our mutex.
    if (state->backend.poll_deferred_checks) {
      try {
        state->backend.poll_deferred_checks();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "shardtorch watchdog for %s: polling the deferred checks failed: %s\n",
                     state->group.c_str(), e.what());
      }
      lock.lock();
      if (state->stopping) return;
      lock.unlock();
    }
    std::vector<std::shared_ptr<Work>> finished;
    const std::string message = poll_once(*state, finished);
    finished.clear();
    if (!message.empty()) fail(*state, message);
    lock.lock();
    state->wake.wait_for(lock, state->poll_interval, [&] { return state->stopping; });
    if (state->stopping) return;
  }
}

std::string poll_once(State& state, std::vector<std::shared_ptr<Work>>& finished) {
  std::vector<std::shared_ptr<Work>> snapshot;
  {
    std::lock_guard<std::mutex> lock(state.mutex);
    snapshot = state.work;
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
  if (oldest_running && now - oldest_running->started_at >= state.timeout) {
    const double seconds = std::chrono::duration<double>(now - oldest_running->started_at).count();
    std::ostringstream out;
    out << std::fixed << std::setprecision(1) << "shardtorch: " << oldest_running->collective
        << " #" << oldest_running->sequence << " on " << state.group << " has not finished "
        << seconds << " s after it started (timeout " << state.timeout.count() / 1000.0
        << " s): a peer has probably died or stalled.";
    message = out.str();
  } else if (finished.size() < snapshot.size() && state.backend.async_error) {
    // Only while work is unfinished: a peer that exits cleanly after the last
    // collective may leave an error behind that concerns nobody.
    std::string error;
    try {
      error = state.backend.async_error();
    } catch (const std::exception& e) {
      error = e.what();
    }
    if (!error.empty()) {
      auto& first = oldest_running ? oldest_running : snapshot.front();
      message = "shardtorch: " + state.group + " reported an asynchronous error during " +
                first->collective + " #" + std::to_string(first->sequence) + ": " + error + ".";
    }
  }
  if (!finished.empty()) {
    std::lock_guard<std::mutex> lock(state.mutex);
    std::vector<std::shared_ptr<Work>> remaining;
    for (auto& work : state.work) {
      bool gone = false;
      for (auto& f : finished) gone = gone || f == work;
      if (!gone) remaining.push_back(work);
    }
    state.work.swap(remaining);
  }
  return message;
}

void fail(State& state, const std::string& cause) {
  std::string message = cause;
  if (state.policy == FailurePolicy::kRaise) {
    try {
      if (state.backend.abort) state.backend.abort();
      message += " The communicator was aborted.";
    } catch (const std::exception& e) {
      // Aborting is the last resort; its own failure must not hide the cause.
      message += std::string(" Aborting the communicator failed too: ") + e.what();
    }
  }
  std::vector<std::shared_ptr<Work>> abandoned;
  {
    std::lock_guard<std::mutex> lock(state.mutex);
    state.failure = message;
    abandoned.swap(state.work);  // destroyed outside the lock, see run()
  }
  if (state.policy == FailurePolicy::kTerminate) {
    std::fprintf(stderr,
                 "%s\nshardtorch: terminating this process so that no result of the failed "
                 "collective is used (SHARDTORCH_ON_COMM_FAILURE=raise aborts the communicator and "
                 "raises on the next collective instead).\n",
                 message.c_str());
    std::fflush(stderr);
    std::_Exit(1);
  }
}

}  // namespace

CollectiveWatchdog::CollectiveWatchdog(std::string group, std::chrono::milliseconds timeout,
                                       WatchdogBackend backend, FailurePolicy policy,
                                       std::chrono::milliseconds poll_interval)
    : state_(std::make_shared<State>()) {
  state_->group = std::move(group);
  state_->timeout = timeout;
  state_->backend = std::move(backend);
  state_->policy = policy;
  state_->poll_interval = poll_interval;
  TORCH_CHECK(timeout.count() > 0, "shardtorch watchdog for ", state_->group,
              ": timeout must be positive, got ", timeout.count(), " ms");
  TORCH_CHECK(poll_interval.count() > 0, "shardtorch watchdog: poll interval must be positive");
  add_live(state_);
  thread_ = std::thread([state = state_] { run(state); });
}

CollectiveWatchdog::~CollectiveWatchdog() { stop(); }

void CollectiveWatchdog::stop() {
  request_stop(*state_);
  if (!thread_.joinable()) return;
  if (thread_.get_id() == std::this_thread::get_id()) {
    // Called from the watchdog's own thread (a callback dropped the last reference): it
    // cannot join itself. It returns at its next look at `stopping`, holding the state
    // it reads; a std::thread destroyed joinable would end the process.
    thread_.detach();
  } else {
    thread_.join();
  }
}

int64_t CollectiveWatchdog::watch(std::string collective, std::function<bool()> started,
                                  std::function<bool()> done) {
  auto work = std::make_shared<Work>();
  work->collective = std::move(collective);
  work->started = std::move(started);
  work->done = std::move(done);
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    work->sequence = state_->next_sequence++;
    state_->work.push_back(work);
  }
  state_->wake.notify_all();
  return work->sequence;
}

void CollectiveWatchdog::check() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  TORCH_CHECK(state_->failure.empty(), state_->failure);
}

bool CollectiveWatchdog::failed() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return !state_->failure.empty();
}

std::string CollectiveWatchdog::failure() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->failure;
}

int64_t CollectiveWatchdog::pending() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return static_cast<int64_t>(state_->work.size());
}

}  // namespace comm
}  // namespace shardtorch
