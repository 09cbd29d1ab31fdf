#pragma once
// Test-only hooks of shardtorch._C_testing (names start with an underscore) that drive
// the CUDA path's device-free rules on machines without a GPU: the device
// launch lock under threads, the store exchange of NCCL ids, the teardown
// choice, the registry's per-device, create-once communicators (with a fake
// CUDA factory), and groups whose process group has no CPU backend.

#include <pybind11/pybind11.h>

namespace shardtorch {
namespace python {

void bind_comm_testing(pybind11::module& m);

}  // namespace python
}  // namespace shardtorch
