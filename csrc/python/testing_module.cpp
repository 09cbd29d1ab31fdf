// shardtorch._C_testing: the test doubles of the C++ core, which the Python tests drive on
// machines without a GPU (fake CUDA communicators, ranks simulated in one process, the store
// exchange on threads, the watchdog with callables in place of CUDA events). Built only with
// SHARDTORCH_BUILD_TEST_DOUBLES=1 (scripts/test.sh sets it), so a user's shardtorch._C carries
// none of them. It links the same libshardtorch as _C and so reaches the same group registry.
#include <pybind11/pybind11.h>

#include "python/comm_testing_binding.h"
#include "python/watchdog_binding.h"

PYBIND11_MODULE(_C_testing, m) {
  m.doc() = "shardtorch's test doubles (built with SHARDTORCH_BUILD_TEST_DOUBLES=1)";
  shardtorch::python::bind_comm_testing(m);
  shardtorch::python::bind_watchdog(m);
}
