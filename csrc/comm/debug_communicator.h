#pragma once
// SHARDTORCH_DEBUG=1: before every collective, the ranks of the group compare
// what they are about to do (collective, dtype, shape) over the CPU process
// group, and all of them fail with an error naming the rank that disagrees,
// instead of hanging or silently mixing mismatched data. Off by default: it
// costs one small extra collective per collective.

#include <c10/util/intrusive_ptr.h>

#include <memory>

#include "comm/communicator.h"
#include "comm/registry.h"

namespace shardtorch {
namespace comm {

bool debug_mode_enabled();

std::shared_ptr<Communicator> make_debug_communicator(std::shared_ptr<Communicator> inner,
                                                      const GroupInfo& group);

}  // namespace comm
}  // namespace shardtorch
