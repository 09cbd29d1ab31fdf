#include "python/collectives_binding.h"

#include <pybind11/stl.h>
// torch's type casters for at::Tensor (needs libtorch_python).
#include <torch/csrc/utils/pybind.h>

#include <string>

#include "comm/registry.h"

namespace py = pybind11;

namespace shardtorch {
namespace python {
namespace {

// The group's communicator for the tensor's device: the one the shard ops use (NCCL on CUDA; the
// shared-memory segment or the CPU backend on CPU; wrapped by SHARDTORCH_DEBUG's checks).
std::shared_ptr<comm::Communicator> communicator(const std::string& group, const at::Tensor& t,
                                                 const char* op) {
  return comm::communicator_for(group, t.device(), op);
}

}  // namespace

void bind_collectives(py::module& m) {
  // Every call may wait for peers (and, on CUDA, for an NCCL communicator's creation): not under
  // the GIL. Ranks are group ranks; tensors must be contiguous (the communicators check it).
  m.def(
      "all_reduce",
      [](at::Tensor tensor, const std::string& group) {
        communicator(group, tensor, "shardtorch.distributed.collectives.all_reduce")
            ->all_reduce(tensor);
      },
      py::arg("tensor"), py::arg("group"), py::call_guard<py::gil_scoped_release>(),
      "In-place sum of `tensor` over the group.");
  m.def(
      "all_gather",
      [](const at::Tensor& input, at::Tensor output, const std::string& group) {
        communicator(group, input, "shardtorch.distributed.collectives.all_gather")
            ->all_gather(input, output);
      },
      py::arg("input"), py::arg("output"), py::arg("group"),
      py::call_guard<py::gil_scoped_release>(),
      "`output` becomes every group rank's `input` (equal sizes), in group rank order.");
  m.def(
      "broadcast",
      [](at::Tensor tensor, int64_t root, const std::string& group) {
        communicator(group, tensor, "shardtorch.distributed.collectives.broadcast")
            ->broadcast(tensor, root);
      },
      py::arg("tensor"), py::arg("root"), py::arg("group"),
      py::call_guard<py::gil_scoped_release>(), "`tensor` becomes group rank `root`'s.");
  m.def(
      "send",
      [](const at::Tensor& tensor, int64_t dst, const std::string& group) {
        communicator(group, tensor, "shardtorch.distributed.collectives.send")->send(tensor, dst);
      },
      py::arg("tensor"), py::arg("dst"), py::arg("group"),
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "recv",
      [](at::Tensor tensor, int64_t src, const std::string& group) {
        communicator(group, tensor, "shardtorch.distributed.collectives.recv")->recv(tensor, src);
      },
      py::arg("tensor"), py::arg("src"), py::arg("group"),
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "group_has_cpu_backend",
      [](const std::string& group) {
        return comm::group_has_cpu_backend(group, "group_has_cpu_backend");
      },
      py::arg("group"), "Whether the group's process group can move CPU tensors.");
}

}  // namespace python
}  // namespace shardtorch
