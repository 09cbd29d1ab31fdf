#pragma once
// Communicator for CUDA tensors, calling NCCL directly. One ncclComm_t per
// group and device (the tensors' device, not the current one), created
// lazily; its ncclUniqueId travels through the group's c10d Store. Collectives
// run on a communication stream of that device, ordered after the device's
// current stream by an event, one launch at a time per device
// (comm/launch_lock.h); wait() orders the device's current stream after them. No host
// synchronisation anywhere; a watchdog thread (comm/watchdog.h) turns a collective that outlives
// the group's timeout, or an NCCL asynchronous error, into an aborted communicator and a loud
// error.

#include "comm/registry.h"

namespace shardtorch {
namespace comm {

std::shared_ptr<Communicator> make_nccl_communicator(const GroupInfo& group,
                                                     const c10::Device& device);

}  // namespace comm
}  // namespace shardtorch
