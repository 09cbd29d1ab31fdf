#include "python/watchdog_binding.h"

#include <c10/util/Exception.h>
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <memory>

#include "comm/watchdog.h"

namespace py = pybind11;

namespace shardtorch {
namespace python {
namespace {

using comm::CollectiveWatchdog;

// Owns the watchdog; its thread calls back into Python, so it must be stopped
// with the GIL released or the two would wait on each other.
class WatchdogForTesting {
 public:
  WatchdogForTesting(const std::string& group, double timeout_s,
                     std::function<std::string()> async_error, std::function<void()> abort,
                     const std::string& policy, double poll_s,
                     std::function<void()> on_thread_start) {
    comm::WatchdogBackend backend{std::move(async_error), std::move(abort),
                                  std::move(on_thread_start)};
    // "env": what the NCCL communicators use (SHARDTORCH_ON_COMM_FAILURE).
    TORCH_CHECK(policy == "raise" || policy == "terminate" || policy == "env",
                "policy must be 'raise', 'terminate' or 'env', got '", policy, "'");
    const auto chosen = policy == "env"     ? comm::failure_policy_from_env()
                        : policy == "raise" ? comm::FailurePolicy::kRaise
                                            : comm::FailurePolicy::kTerminate;
    const auto ms = [](double seconds) {
      return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0));
    };
    watchdog_ = std::make_unique<CollectiveWatchdog>(group, ms(timeout_s), std::move(backend),
                                                     chosen, ms(poll_s));
  }
  ~WatchdogForTesting() { close(); }

  void close() {
    py::gil_scoped_release release;
    watchdog_.reset();
  }
  CollectiveWatchdog& get() {
    TORCH_CHECK(watchdog_, "watchdog is closed");
    return *watchdog_;
  }

 private:
  std::unique_ptr<CollectiveWatchdog> watchdog_;
};

}  // namespace

void bind_watchdog(py::module& m) {
  py::class_<WatchdogForTesting>(m, "_CollectiveWatchdog")
      .def(py::init<const std::string&, double, std::function<std::string()>, std::function<void()>,
                    const std::string&, double, std::function<void()>>(),
           py::arg("group"), py::arg("timeout"), py::arg("async_error"), py::arg("abort"),
           py::arg("policy") = "raise", py::arg("poll_interval") = 0.01,
           py::arg("on_thread_start") = std::function<void()>())
      .def(
          "watch",
          [](WatchdogForTesting& self, std::string collective, std::function<bool()> started,
             std::function<bool()> done) {
            return self.get().watch(std::move(collective), std::move(started), std::move(done));
          },
          py::arg("collective"), py::arg("started"), py::arg("done"))
      .def("check",
           [](WatchdogForTesting& self) {
             try {
               self.get().check();
             } catch (const c10::Error& e) {
               throw std::runtime_error(e.what_without_backtrace());
             }
           })
      .def_property_readonly("failed", [](WatchdogForTesting& self) { return self.get().failed(); })
      .def_property_readonly("failure",
                             [](WatchdogForTesting& self) { return self.get().failure(); })
      .def_property_readonly("pending",
                             [](WatchdogForTesting& self) { return self.get().pending(); })
      .def("stop",
           [](WatchdogForTesting& self) {
             py::gil_scoped_release release;
             self.get().stop();
           })
      .def("close", &WatchdogForTesting::close)
      .def(
          "__enter__", [](WatchdogForTesting& self) -> WatchdogForTesting& { return self; },
          py::return_value_policy::reference)
      .def("__exit__", [](WatchdogForTesting& self, py::args) { self.close(); });
}

}  // namespace python
}  // namespace shardtorch
