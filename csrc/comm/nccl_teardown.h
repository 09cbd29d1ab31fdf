#pragma once
// How an NCCL communicator ends. ncclCommDestroy waits for the collectives in
// flight (which need every peer); ncclCommAbort cancels them. If ranks chose
// between the two from what their watchdog has seen finish so far (a count
// that lags the GPU differently on each rank), one could abort a collective
// that its peers then wait for forever. So the choice depends only on whether
// this communicator already failed, and a healthy one always drains first:
// it waits for its own collectives while the watchdog still watches them (a
// dead peer makes the watchdog fire, as during training, instead of a hang),
// then destroys. Device-free, so CPU tests check the rule.

namespace shardtorch {
namespace comm {

enum class NcclTeardown {
  kRelease,           // aborted after a failure: NCCL already freed it
  kDrainThenDestroy,  // wait for our collectives (watchdog on), then ncclCommDestroy
};

inline NcclTeardown nccl_teardown(bool aborted) {
  return aborted ? NcclTeardown::kRelease : NcclTeardown::kDrainThenDestroy;
}

}  // namespace comm
}  // namespace shardtorch
