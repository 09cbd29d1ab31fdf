#pragma once
// A comm::DeferredCheckCounts as the dict Python reads ({"launches", "pending", "settled",
// "waits", "dropped"}): shardtorch._C's _deferred_check_counts and the test doubles of
// shardtorch._C_testing give the same form.

#include <pybind11/pybind11.h>

#include "comm/deferred_checks.h"

namespace shardtorch {
namespace python {

inline pybind11::dict counts_dict(const comm::DeferredCheckCounts& counts) {
  pybind11::dict out;
  out["launches"] = counts.launches;
  out["pending"] = counts.pending;
  out["settled"] = counts.settled;
  out["waits"] = counts.waits;
  out["dropped"] = counts.dropped;
  return out;
}

}  // namespace python
}  // namespace shardtorch
