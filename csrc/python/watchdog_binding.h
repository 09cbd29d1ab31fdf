#pragma once
// shardtorch._C_testing._CollectiveWatchdog: the communicators' watchdog driven from
// Python with callables in place of CUDA events and NCCL, so that its
// timeout, error and abort logic is tested on machines without a GPU.

#include <pybind11/pybind11.h>

namespace shardtorch {
namespace python {

void bind_watchdog(pybind11::module& m);

}  // namespace python
}  // namespace shardtorch
