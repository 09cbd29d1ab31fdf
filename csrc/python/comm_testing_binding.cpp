#include "python/comm_testing_binding.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <pybind11/stl.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/deferred_checks.h"
#include "comm/launch_lock.h"
#include "comm/nccl_teardown.h"
#include "comm/registry.h"
#include "comm/store_exchange.h"

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
  void check_deferred() override {
    const comm::CheckOutcome failed = deferred_.settle_all();
    TORCH_CHECK(failed.error.empty(), failed.error);
  }
  comm::DeferredCheckCounts deferred_check_counts() const override { return deferred_.counts(); }

 private:
  std::shared_ptr<comm::CommHandle> done() {
    const comm::CheckOutcome failed = deferred_.before_launch();
    TORCH_CHECK(failed.error.empty(), failed.error);
    return std::make_shared<comm::CompletedHandle>();
  }
  std::string name_;
  int64_t rank_, size_;
  std::string backend_;
  comm::DeferredChecks deferred_;
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
  explicit FakeDeferredChecks(int64_t lag) : checks_(lag) {}

  int64_t add(std::vector<double> values, bool ready, bool a_rank_left) {
    const int64_t id = static_cast<int64_t>(ready_.size());
    auto flag = std::make_shared<std::atomic<bool>>(ready);
    ready_.push_back(flag);
    comm::CheckCopy copy;
    copy.ready = [flag] { return flag->load(); };
    // The device finishing the copy while the host waits.
    copy.wait = [flag] { flag->store(true); };
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
  int64_t lag() const { return checks_.lag(); }
  comm::DeferredCheckCounts counts() const { return checks_.counts(); }

 private:
  static void raise(const comm::CheckOutcome& failed) {
    TORCH_CHECK(failed.error.empty(), failed.error, failed.a_rank_left ? " (a rank left)" : "");
  }
  comm::DeferredChecks checks_;
  std::vector<std::shared_ptr<std::atomic<bool>>> ready_;
};

py::dict counts_dict(const comm::DeferredCheckCounts& counts) {
  py::dict out;
  out["launches"] = counts.launches;
  out["pending"] = counts.pending;
  out["settled"] = counts.settled;
  out["waits"] = counts.waits;
  return out;
}

}  // namespace

void bind_comm_testing(py::module& m) {
  m.attr("_DEFERRED_CHECK_LAG") = comm::DeferredChecks::kDefaultLag;

  py::class_<FakeDeferredChecks>(m, "_FakeDeferredChecks")
      .def(py::init<int64_t>(), py::arg("lag") = comm::DeferredChecks::kDefaultLag)
      .def("add", &FakeDeferredChecks::add, py::arg("values"), py::arg("ready") = false,
           py::arg("a_rank_left") = false,
           "A check on the latest launch's values; returns its number. a_rank_left: its failure "
           "says a rank raised alone (the raised message then ends with ' (a rank left)').")
      .def("set_ready", &FakeDeferredChecks::set_ready, py::arg("id"))
      .def("before_launch", &FakeDeferredChecks::before_launch)
      .def("settle_all", &FakeDeferredChecks::settle_all)
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
