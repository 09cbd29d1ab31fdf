#include "python/comm_testing_binding.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <pybind11/stl.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/deferred_checks.h"
#include "comm/launch_lock.h"
#include "comm/nccl_teardown.h"
#include "comm/process_group_communicator.h"
#include "comm/registry.h"
#include "comm/store_exchange.h"
#include "comm/watchdog.h"
#include "python/deferred_check_counts.h"

namespace py = pybind11;

namespace shardtorch {
namespace python {
namespace {

double seconds_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// A communicator that moves nothing; its backend name says which device it was
// made for and in which order. It defers raise_if's verdicts as the NCCL one
// does (comm::DeferredChecks), with copies that are ready at once.
class FakeCommunicator final : public comm::Communicator {
 public:
  FakeCommunicator(const comm::GroupInfo& group, std::string backend)
      : name_(group.layout.name),
        rank_(group.layout.rank),
        size_(group.layout.size),
        backend_(std::move(backend)) {}
  int64_t rank() const override { return rank_; }
  int64_t size() const override { return size_; }
  const std::string& group_name() const override { return name_; }
  std::string backend_name() const override { return backend_; }
  std::shared_ptr<comm::CommHandle> all_reduce_async(at::Tensor&) override { return done(); }
  std::shared_ptr<comm::CommHandle> all_gather_async(const at::Tensor&, at::Tensor&) override {
    return done();
  }
  std::shared_ptr<comm::CommHandle> reduce_scatter_async(const at::Tensor&, at::Tensor&) override {
    return done();
  }
  std::shared_ptr<comm::CommHandle> broadcast_async(at::Tensor&, int64_t) override {
    return done();
  }
  std::shared_ptr<comm::CommHandle> send_async(const at::Tensor&, int64_t) override {
    return done();
  }
  std::shared_ptr<comm::CommHandle> recv_async(at::Tensor&, int64_t) override { return done(); }

  void raise_if(const at::Tensor& gathered, const Verdict& verdict) override {
    const at::Tensor host = gathered.to(at::kDouble).contiguous();
    const double* values = host.const_data_ptr<double>();
    comm::CheckCopy copy;
    copy.ready = [] { return true; };
    copy.wait = [] {};
    copy.values = [held = std::vector<double>(values, values + host.numel())] { return held; };
    deferred_.add(std::move(copy), verdict);
  }
  void check_deferred() override { comm::raise_failed_check(deferred_.settle_all(), backend_); }
  comm::DeferredCheckCounts deferred_check_counts() const override { return deferred_.counts(); }

 private:
  std::shared_ptr<comm::CommHandle> done() {
    comm::raise_failed_check(deferred_.before_launch(), backend_);
    return std::make_shared<comm::CompletedHandle>();
  }
  std::string name_;
  int64_t rank_, size_;
  std::string backend_;
  comm::DeferredChecks deferred_;
};

// Several ranks of one group in one process, each with a communicator of its
// own for CPU tensors, registered under its own group name; the tests drive
// each rank from a thread of its own. The collectives behave for the host as
// NCCL's do: a launch never blocks, a collective completes (its outputs
// written) once every rank has launched it, and wait() returns at once (it
// orders a stream, not the host). raise_if's verdicts are deferred by the
// NCCL communicator's rule (comm::DeferredChecks, RaisedAlone), each copy
// arriving when its collective completes: one behind a collective that a
// rank never joins never arrives. A host sync (synchronize(), a copy's wait)
// gives up after `hang_seconds` with an error that stands for the hang the
// GPU would have. A verdict that a rank left aborts the rank's communicator:
// its collectives not yet complete return (outputs as they are). Each rank
// has the NCCL communicator's watchdog (comm/watchdog.h), which polls the
// deferred checks whose copies arrived while collectives are in flight.
class SimulatedGroup {
 public:
  SimulatedGroup(std::vector<std::string> names, double hang_seconds)
      : state_(std::make_shared<State>()) {
    state_->names = std::move(names);
    state_->hang = std::chrono::duration<double>(hang_seconds);
    state_->ranks.resize(state_->names.size());
    auto state = state_;
    previous_ = comm::register_communicator_factory(
        c10::DeviceType::CPU,
        [state](const comm::GroupInfo& group,
                const c10::Device&) -> std::shared_ptr<comm::Communicator> {
          for (size_t r = 0; r < state->names.size(); ++r) {
            if (state->names[r] != group.layout.name) continue;
            auto rank = std::make_shared<Rank>(state, static_cast<int64_t>(r));
            std::lock_guard<std::mutex> lock(state->mutex);
            state->ranks[r] = rank;
            return rank;
          }
          return std::make_shared<comm::ProcessGroupCommunicator>(group.layout.name,
                                                                  group.process_group);
        });
    active_ = true;
  }
  ~SimulatedGroup() { close(); }
  void close() {
    if (!active_) return;
    comm::register_communicator_factory(c10::DeviceType::CPU, previous_);
    active_ = false;
    std::vector<std::shared_ptr<Rank>> ranks;
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      ranks = state_->ranks;
    }
    for (auto& rank : ranks) {
      if (rank) rank->stop_watchdog();
    }
  }

  // Rank r's host waits for every collective it launched (a loss.item()).
  void synchronize(int64_t r) { rank(r)->synchronize(); }
  // One all_reduce on rank r, not waited for (the next layer's collective).
  void launch(int64_t r) {
    at::Tensor nothing = at::zeros({1});
    rank(r)->all_reduce_async(nothing);
  }
  bool aborted(int64_t r) { return rank(r)->aborted(); }
  // Rank r's collectives launched and not complete (nor returned by an abort).
  int64_t stuck(int64_t r) { return rank(r)->stuck(); }
  comm::DeferredCheckCounts counts(int64_t r) { return rank(r)->deferred_check_counts(); }

 private:
  struct Collective {
    std::string kind;
    std::vector<at::Tensor> inputs, outputs;  // by rank
    int64_t launched = 0;
    bool complete = false;
  };
  class Rank;
  struct State {
    std::vector<std::string> names;
    std::chrono::duration<double> hang{5.0};
    std::mutex mutex;
    std::condition_variable changed;
    std::deque<Collective> collectives;  // by ordinal (each rank's n-th launch is the n-th)
    std::vector<std::shared_ptr<Rank>> ranks;

    // Rank r's launch number `ordinal` (0-based).
    void deposit(int64_t ordinal, int64_t r, const std::string& kind, const at::Tensor& input,
                 const at::Tensor& output) {
      const int64_t size = static_cast<int64_t>(names.size());
      std::lock_guard<std::mutex> lock(mutex);
      while (static_cast<int64_t>(collectives.size()) <= ordinal) {
        Collective c;
        c.inputs.resize(size);
        c.outputs.resize(size);
        collectives.push_back(std::move(c));
      }
      Collective& c = collectives[ordinal];
      TORCH_CHECK(c.kind.empty() || c.kind == kind, "simulated group: launch ", ordinal, " is a ",
                  c.kind, " on one rank and a ", kind, " on another");
      c.kind = kind;
      c.inputs[r] = input.clone();
      c.outputs[r] = output;
      if (++c.launched < size) return;
      // Every rank launched it: write every rank's output.
      if (kind == "all_reduce") {
        at::Tensor sum = at::zeros_like(c.inputs[0]);
        for (const auto& in : c.inputs) sum.add_(in);
        for (auto& out : c.outputs) out.copy_(sum);
      } else {
        const at::Tensor all = at::cat(c.inputs, 0).view({-1});
        for (auto& out : c.outputs) out.view({-1}).copy_(all);
      }
      c.complete = true;
      changed.notify_all();
    }
    bool complete(int64_t ordinal) {
      std::lock_guard<std::mutex> lock(mutex);
      return ordinal < static_cast<int64_t>(collectives.size()) && collectives[ordinal].complete;
    }
  };

  class Rank final : public comm::Communicator {
   public:
    Rank(std::shared_ptr<State> state, int64_t r)
        : state_(std::move(state)),
          rank_(r),
          name_(state_->names[r]),
          description_("simulated communicator for group '" + name_ + "'"),
          deferred_(comm::DeferredChecks::kDefaultLag, [this] { abort(); }) {
      // The NCCL communicator's watchdog, with its poll of the deferred
      // checks; its timeout never comes within a test (a hang is hang_seconds).
      comm::WatchdogBackend backend;
      backend.poll_deferred_checks = [this] { deferred_.poll(); };
      watchdog_ = std::make_shared<comm::CollectiveWatchdog>(
          description_, std::chrono::hours(1), std::move(backend), comm::FailurePolicy::kRaise,
          std::chrono::milliseconds(10));
    }
    ~Rank() override { stop_watchdog(); }
    void stop_watchdog() { watchdog_->stop(); }
    int64_t rank() const override { return rank_; }
    int64_t size() const override { return static_cast<int64_t>(state_->names.size()); }
    const std::string& group_name() const override { return name_; }
    std::string backend_name() const override { return "simulated"; }
    std::shared_ptr<comm::CommHandle> all_reduce_async(at::Tensor& tensor) override {
      return launch("all_reduce", tensor, tensor);
    }
    std::shared_ptr<comm::CommHandle> all_gather_async(const at::Tensor& input,
                                                       at::Tensor& output) override {
      return launch("all_gather", input, output);
    }
    std::shared_ptr<comm::CommHandle> reduce_scatter_async(const at::Tensor&,
                                                           at::Tensor&) override {
      TORCH_CHECK(false, "simulated group: reduce_scatter is not simulated");
    }
    std::shared_ptr<comm::CommHandle> broadcast_async(at::Tensor&, int64_t) override {
      TORCH_CHECK(false, "simulated group: broadcast is not simulated");
    }
    std::shared_ptr<comm::CommHandle> send_async(const at::Tensor&, int64_t) override {
      TORCH_CHECK(false, "simulated group: send is not simulated");
    }
    std::shared_ptr<comm::CommHandle> recv_async(at::Tensor&, int64_t) override {
      TORCH_CHECK(false, "simulated group: recv is not simulated");
    }
    void raise_if(const at::Tensor& gathered, const Verdict& verdict) override {
      const int64_t ordinal = launches_ - 1;  // the collective that wrote `gathered`
      auto state = state_;
      comm::CheckCopy copy;
      copy.ready = [this, state, ordinal] { return aborted_ || state->complete(ordinal); };
      copy.wait = [this, ordinal] { wait_on_host(ordinal, "a deferred check's copy"); };
      copy.values = [view = gathered] {
        const at::Tensor host = view.to(at::kDouble).contiguous();
        const double* values = host.const_data_ptr<double>();
        return std::vector<double>(values, values + host.numel());
      };
      deferred_.add(std::move(copy), verdict);
    }
    void raised_alone(const std::string& error) override { left_.record(error); }
    void check_deferred() override {
      comm::raise_failed_check(deferred_.settle_all(), description_);
    }
    comm::DeferredCheckCounts deferred_check_counts() const override { return deferred_.counts(); }
    void synchronize() override {
      for (int64_t k = 0; k < launches_; ++k) wait_on_host(k, "its collectives");
    }
    bool aborted() const { return aborted_; }
    // What ncclCommAbort does: the collectives not yet complete return.
    void abort() {
      std::lock_guard<std::mutex> lock(state_->mutex);
      aborted_ = true;
      state_->changed.notify_all();
    }
    int64_t stuck() const {
      int64_t n = 0;
      for (int64_t k = 0; k < launches_; ++k) n += !aborted_ && !state_->complete(k);
      return n;
    }

   private:
    std::shared_ptr<comm::CommHandle> launch(const char* kind, const at::Tensor& input,
                                             const at::Tensor& output) {
      left_.check_before_launch(description_, kind);
      comm::raise_failed_check(deferred_.before_launch(), description_);
      TORCH_CHECK(!aborted_, description_, ": ", kind, ": the communicator was aborted");
      const int64_t ordinal = launches_++;
      state_->deposit(ordinal, rank_, kind, input, output);
      auto state = state_;
      watchdog_->watch(
          kind, [] { return true; },
          [this, state, ordinal] { return aborted_ || state->complete(ordinal); });
      return std::make_shared<comm::CompletedHandle>();  // orders a stream: never blocks
    }
    // The host waiting for collective `ordinal`: returns once it completed
    // or an abort returned it; past the group's hang time it is a hang.
    void wait_on_host(int64_t ordinal, const char* what) {
      std::unique_lock<std::mutex> lock(state_->mutex);
      const bool done = state_->changed.wait_for(lock, state_->hang, [&] {
        return aborted_ || (ordinal < static_cast<int64_t>(state_->collectives.size()) &&
                            state_->collectives[ordinal].complete);
      });
      TORCH_CHECK(done, description_, ": the host waited ",
                  std::chrono::duration<double>(state_->hang).count(), " s for ", what,
                  " behind collective ", ordinal,
                  ", which a rank never joined: on a GPU it would wait until the watchdog's "
                  "timeout (a hang)");
    }

    std::shared_ptr<State> state_;
    int64_t rank_;
    std::string name_, description_;
    std::atomic<bool> aborted_{false};
    comm::DeferredChecks deferred_;
    comm::RaisedAlone left_;
    std::atomic<int64_t> launches_{0};
    std::shared_ptr<comm::CollectiveWatchdog> watchdog_;  // last: stopped first
  };

  std::shared_ptr<Rank> rank(int64_t r) {
    std::lock_guard<std::mutex> lock(state_->mutex);
    TORCH_CHECK(r >= 0 && r < static_cast<int64_t>(state_->ranks.size()) && state_->ranks[r],
                "simulated group: rank ", r, " has no communicator yet (no op ran on its group)");
    return state_->ranks[r];
  }

  std::shared_ptr<State> state_;
  comm::CommunicatorFactory previous_;
  bool active_ = false;
};

// Replaces the CUDA communicator factory while alive: each creation sleeps
// `delay` seconds (a real one is a collective) and is recorded.
class FakeCudaCommunicators {
 public:
  explicit FakeCudaCommunicators(double delay) : state_(std::make_shared<State>()) {
    state_->delay = delay;
    auto state = state_;
    previous_ = comm::register_communicator_factory(
        c10::DeviceType::CUDA, [state](const comm::GroupInfo& group, const c10::Device& device) {
          std::this_thread::sleep_for(std::chrono::duration<double>(state->delay));
          std::lock_guard<std::mutex> lock(state->mutex);
          const std::string made = group.layout.name + "@" + device.str();
          state->created.push_back(made);
          return std::static_pointer_cast<comm::Communicator>(std::make_shared<FakeCommunicator>(
              group, "fake " + made + " #" + std::to_string(state->created.size() - 1)));
        });
    active_ = true;
  }
  ~FakeCudaCommunicators() { close(); }
  void close() {
    if (!active_) return;
    comm::register_communicator_factory(c10::DeviceType::CUDA, previous_);
    active_ = false;
  }
  std::vector<std::string> created() const {
    std::lock_guard<std::mutex> lock(state_->mutex);
    return state_->created;
  }

 private:
  struct State {
    double delay = 0;
    mutable std::mutex mutex;
    std::vector<std::string> created;
  };
  std::shared_ptr<State> state_;
  comm::CommunicatorFactory previous_;
  bool active_ = false;
};

// comm::DeferredChecks with copies the test makes ready when it likes (a rank
// whose GPU is ahead or behind). A check fails when any of its values is not
// 0; its message names its number. Reading a copy before it is ready (a
// verdict given without waiting) is an error of its own.
class FakeDeferredChecks {
 public:
  explicit FakeDeferredChecks(int64_t lag) : checks_(lag, [this] { events_.push_back("abort"); }) {}

  int64_t add(std::vector<double> values, bool ready, bool a_rank_left, bool arrives) {
    const int64_t id = static_cast<int64_t>(ready_.size());
    auto flag = std::make_shared<std::atomic<bool>>(ready);
    ready_.push_back(flag);
    comm::CheckCopy copy;
    copy.ready = [flag] { return flag->load(); };
    // The device finishing the copy while the host waits; a copy behind a
    // collective that a rank never joins never arrives: the host would wait
    // for it forever (an error here, so that a test sees it).
    copy.wait = [this, flag, id, arrives] {
      events_.push_back("wait " + std::to_string(id));
      TORCH_CHECK(arrives, "fake check ", id,
                  "'s copy never arrives: the host would wait for it forever");
      flag->store(true);
    };
    copy.values = [flag, values, id] {
      TORCH_CHECK(flag->load(), "fake check ", id, " was read before its copy was ready");
      return values;
    };
    checks_.add(std::move(copy),
                [id, a_rank_left](const std::vector<double>& got) -> comm::CheckOutcome {
                  for (double value : got) {
                    if (value != 0)
                      return {"fake check " + std::to_string(id) + " failed", a_rank_left};
                  }
                  return {};
                });
    return id;
  }
  void set_ready(int64_t id) {
    TORCH_CHECK(id >= 0 && id < static_cast<int64_t>(ready_.size()), "no fake check ", id);
    ready_[id]->store(true);
  }
  void before_launch() { raise(checks_.before_launch()); }
  void settle_all() { raise(checks_.settle_all()); }
  void poll() { checks_.poll(); }
  int64_t lag() const { return checks_.lag(); }
  comm::DeferredCheckCounts counts() const { return checks_.counts(); }
  // What the host did, in order: "wait N" (for check N's copy), "abort".
  std::vector<std::string> events() const { return events_; }

 private:
  static void raise(const comm::CheckOutcome& failed) {
    TORCH_CHECK(failed.error.empty(), failed.error, failed.a_rank_left ? " (a rank left)" : "",
                failed.later_rank_left.empty() ? "" : " (then a rank left: ",
                failed.later_rank_left, failed.later_rank_left.empty() ? "" : ")");
  }
  std::vector<std::string> events_;
  comm::DeferredChecks checks_;
  std::vector<std::shared_ptr<std::atomic<bool>>> ready_;
};

}  // namespace

void bind_comm_testing(py::module& m) {
  py::class_<FakeDeferredChecks>(m, "_FakeDeferredChecks")
      .def(py::init<int64_t>(), py::arg("lag") = comm::DeferredChecks::kDefaultLag)
      .def("add", &FakeDeferredChecks::add, py::arg("values"), py::arg("ready") = false,
           py::arg("a_rank_left") = false, py::arg("arrives") = true,
           "A check on the latest launch's values; returns its number. a_rank_left: its failure "
           "says a rank raised alone (the raised message then ends with ' (a rank left)'). "
           "arrives=False: its copy never arrives (waiting for it raises).")
      .def_property_readonly("events", &FakeDeferredChecks::events)
      .def("set_ready", &FakeDeferredChecks::set_ready, py::arg("id"))
      .def("before_launch", &FakeDeferredChecks::before_launch)
      .def("settle_all", &FakeDeferredChecks::settle_all)
      .def("poll", &FakeDeferredChecks::poll,
           "What the watchdog does at each poll: reads the ready checks, in order, without "
           "waiting; aborts at once on a verdict that a rank left")
      .def_property_readonly("lag", &FakeDeferredChecks::lag)
      .def_property_readonly(
          "counts", [](const FakeDeferredChecks& self) { return counts_dict(self.counts()); });

  m.def(
      "_raise_if",
      [](const std::string& group, const std::string& device, std::vector<double> values) {
        auto communicator = comm::communicator_for(group, c10::Device(device), "test");
        const at::Tensor gathered = at::tensor(values, at::kDouble);
        communicator->raise_if(gathered, [](const std::vector<double>& got) -> comm::CheckOutcome {
          for (double value : got) {
            if (value != 0) return "test check failed: a value is " + std::to_string(value);
          }
          return {};
        });
      },
      py::arg("group"), py::arg("device"), py::arg("values"),
      "Communicator::raise_if on the group's communicator for `device` (a fake CUDA one under "
      "_FakeCudaCommunicators): fails when a value is not 0.");
  m.def(
      "_launch",
      [](const std::string& group, const std::string& device) {
        auto communicator = comm::communicator_for(group, c10::Device(device), "test");
        at::Tensor nothing = at::zeros({1});
        communicator->all_reduce_async(nothing)->wait();
      },
      py::arg("group"), py::arg("device"),
      "One all_reduce on the group's communicator for `device` (a fake one moves nothing).");

  m.def(
      "_hold_launch_lock",
      [](const std::string& device, double seconds) {
        py::gil_scoped_release release;
        return comm::with_device_launch_lock(comm::device_launch_mutex(c10::Device(device)), [&] {
          const double start = seconds_now();
          std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
          return std::make_pair(start, seconds_now());
        });
      },
      py::arg("device"), py::arg("seconds"),
      "A launch on `device` that takes `seconds`, made the way NCCL launches are made "
      "(comm::with_device_launch_lock); returns (start, end) on time.monotonic's clock.");

  m.def("_nccl_teardown", [](bool aborted) {
    return comm::nccl_teardown(aborted) == comm::NcclTeardown::kRelease ? "release"
                                                                        : "drain_then_destroy";
  });

  m.def("_next_exchange_key", &comm::next_exchange_key, py::arg("scope"));
  m.def("_nccl_unique_id_scope", &comm::nccl_unique_id_scope, py::arg("group"));

  m.def(
      "_share_nccl_unique_id_threads",
      [](const std::string& group, const std::string& payload, int64_t world, double timeout) {
        std::vector<std::string> received(world);
        std::vector<std::string> errors(world);
        double seconds = 0;
        {
          py::gil_scoped_release release;
          auto store = c10::make_intrusive<c10d::HashStore>();
          store->setTimeout(std::chrono::milliseconds(static_cast<int64_t>(timeout * 1000)));
          const double start = seconds_now();
          std::vector<std::thread> ranks;
          for (int64_t r = world - 1; r >= 0; --r) {
            ranks.emplace_back([&, r] {
              // Each thread is a rank in a process of its own (its own
              // counter), on its own device, creating the group's first
              // communicator: the key NcclCommunicator uses.
              comm::ExchangeKeys process_keys;
              const std::string key = process_keys.next(comm::nccl_unique_id_scope(group));
              try {
                received[r] = comm::share_through_store(*store, key, r, 0, r == 0 ? payload : "");
              } catch (const std::exception& e) {
                errors[r] = "rank " + std::to_string(r) + " (key " + key + "): " + e.what();
              }
            });
          }
          for (auto& t : ranks) t.join();
          seconds = seconds_now() - start;
        }
        py::list out;
        for (const auto& bytes : received) out.append(py::bytes(bytes));
        py::list failures;
        for (const auto& e : errors) {
          if (!e.empty()) failures.append(e);
        }
        return py::make_tuple(out, failures, seconds);
      },
      py::arg("group"), py::arg("payload"), py::arg("world") = 2, py::arg("timeout") = 1.0,
      "Ranks 0..world-1 (threads, each with its own exchange counter, as if on cuda:0, "
      "cuda:1, ...) exchange group rank 0's ncclUniqueId bytes under the key NcclCommunicator "
      "builds, over one HashStore whose waits time out after `timeout` s; returns (bytes per "
      "rank, errors, seconds).");

  m.def(
      "_share_through_store_threads",
      [](int64_t world, const std::string& payload, int64_t root) {
        std::vector<std::string> received(world);
        {
          py::gil_scoped_release release;
          auto store = c10::make_intrusive<c10d::HashStore>();
          const std::string key = comm::next_exchange_key("test/share_through_store");
          std::vector<std::thread> ranks;
          // Non-root ranks start first: they must wait for the root's write.
          for (int64_t r = world - 1; r >= 0; --r) {
            ranks.emplace_back([&, r] {
              received[r] =
                  comm::share_through_store(*store, key, r, root, r == root ? payload : "");
            });
          }
          for (auto& t : ranks) t.join();
        }
        py::list out;
        for (const auto& bytes : received) out.append(py::bytes(bytes));
        return out;
      },
      py::arg("world"), py::arg("payload"), py::arg("root") = 0,
      "Runs share_through_store on `world` threads (one per rank) over one HashStore.");

  m.def(
      "_register_group_without_cpu_backend",
      [](const std::string& name) {
        // What torch.distributed hands out for backend="nccl" on a machine
        // without GPUs, as far as shardtorch can tell: a store, no CPU backend.
        auto group = c10::make_intrusive<c10d::ProcessGroup>(c10::make_intrusive<c10d::HashStore>(),
                                                             /*rank=*/0, /*size=*/1);
        comm::register_group(name, group, {0});
      },
      py::arg("name"));

  m.def(
      "_share_through_group_store",
      [](const std::string& name, const std::string& payload) {
        auto shared = comm::share_through_group_store(comm::group_info(name, "test"),
                                                      "test/group_store/" + name, payload);
        return shared.has_value() ? py::object(py::bytes(*shared)) : py::object(py::none());
      },
      py::arg("name"), py::arg("payload"));

  m.def(
      "_communicator_backend",
      [](const std::string& group, const std::string& device) {
        py::gil_scoped_release release;
        return comm::communicator_for(group, c10::Device(device), "test")->backend_name();
      },
      py::arg("group"), py::arg("device"),
      "The backend name of the group's communicator for `device` (created if needed).");

  py::class_<SimulatedGroup>(m, "_SimulatedGroup",
                             "Ranks of one group simulated in this process for CPU tensors, "
                             "each under its own group name, with NCCL's deferred checks")
      .def(py::init<std::vector<std::string>, double>(), py::arg("names"),
           py::arg("hang_seconds") = 5.0)
      .def("synchronize", &SimulatedGroup::synchronize, py::arg("rank"),
           py::call_guard<py::gil_scoped_release>())
      .def("launch", &SimulatedGroup::launch, py::arg("rank"),
           py::call_guard<py::gil_scoped_release>())
      .def("aborted", &SimulatedGroup::aborted, py::arg("rank"))
      .def("stuck", &SimulatedGroup::stuck, py::arg("rank"))
      .def(
          "counts", [](SimulatedGroup& self, int64_t r) { return counts_dict(self.counts(r)); },
          py::arg("rank"))
      .def("close", &SimulatedGroup::close)
      .def(
          "__enter__", [](SimulatedGroup& self) -> SimulatedGroup& { return self; },
          py::return_value_policy::reference)
      .def("__exit__", [](SimulatedGroup& self, py::args) { self.close(); });

  py::class_<FakeCudaCommunicators>(m, "_FakeCudaCommunicators")
      .def(py::init<double>(), py::arg("delay") = 0.0)
      .def_property_readonly("created", &FakeCudaCommunicators::created)
      .def("close", &FakeCudaCommunicators::close)
      .def(
          "__enter__", [](FakeCudaCommunicators& self) -> FakeCudaCommunicators& { return self; },
          py::return_value_policy::reference)
      .def("__exit__", [](FakeCudaCommunicators& self, py::args) { self.close(); });
}

}  // namespace python
}  // namespace shardtorch
