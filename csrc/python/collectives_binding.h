#pragma once
// shardtorch._C's collectives by group name (all_reduce, all_gather, broadcast, send, recv): what
// shardtorch/distributed/collectives.py calls, so that the Python package's own collectives go
// through the same communicators as the shard ops (comm/registry.h).

#include <pybind11/pybind11.h>

namespace shardtorch {
namespace python {

void bind_collectives(pybind11::module& m);

}  // namespace python
}  // namespace shardtorch
