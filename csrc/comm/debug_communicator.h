#pragma once
// SHARDTORCH_DEBUG=1: before every collective, the ranks of the group compare
// what they are about to do (collective, dtype, shape) over the CPU process
// group, and all of them fail with an error naming the rank that disagrees,
// instead of hanging or silently mixing mismatched data; the parallel losses
// also check that every rank holds the same targets (check_same_on_every_rank).
// Off by default: it costs one small extra collective per collective.

#include <c10/util/intrusive_ptr.h>

#include <memory>

#include "comm/communicator.h"
#include "comm/registry.h"

namespace shardtorch {
namespace comm {

bool debug_mode_enabled();

std::shared_ptr<Communicator> make_debug_communicator(std::shared_ptr<Communicator> inner,
                                                      const GroupInfo& group);

// SHARDTORCH_DEBUG: every rank of `communicator`'s group must hold the same
// `tensor` (an integer tensor: the targets of a parallel loss, which a rank
// with other labels would silently turn into a wrong loss). All-gathers it and
// raises on every rank, naming the first global rank whose copy differs from
// the group's first rank's and the first element that differs. Debug mode only:
// it moves the whole tensor and synchronises with the host.
void check_same_on_every_rank(Communicator& communicator, const at::Tensor& tensor,
                              const char* what, const char* op);

}  // namespace comm
}  // namespace shardtorch
