#pragma once
// Creates a c10d::ProcessGroup backed by Gloo from C++ (what Python's
// torch.distributed.new_group does for "gloo"). Needs Gloo's headers at build
// time of libshardtorch; without them it throws, naming what is missing.

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <cstdint>
#include <string>

namespace c10d {
class ProcessGroup;
class Store;
}  // namespace c10d

namespace shardtorch {
namespace distributed {

// Whether this libshardtorch can create Gloo groups (built with Gloo headers).
bool gloo_process_groups_available();

// `store` must already be private to the group (a PrefixStore): every member
// calls this with the same store prefix, its rank within the group and the
// group's size.
c10::intrusive_ptr<c10d::ProcessGroup> make_gloo_process_group(
    const c10::intrusive_ptr<c10d::Store>& store, int64_t group_rank, int64_t group_size,
    std::chrono::milliseconds timeout);

}  // namespace distributed
}  // namespace shardtorch
