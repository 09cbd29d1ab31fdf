#pragma once
// Communicator for CUDA tensors, calling NCCL directly. One ncclComm_t per
// group and device, created lazily; its ncclUniqueId travels over the group's
// CPU process group. Collectives run on a communication stream ordered after
// the caller's current stream by an event; wait() orders the current stream
// after them. No host synchronisation anywhere; a watchdog thread
// (comm/watchdog.h) turns a collective that outlives the group's timeout, or
// an NCCL asynchronous error, into an aborted communicator and a loud error.

#include "comm/registry.h"

namespace shardtorch {
namespace comm {

std::shared_ptr<Communicator> make_nccl_communicator(const GroupInfo& group);

}  // namespace comm
}  // namespace shardtorch
