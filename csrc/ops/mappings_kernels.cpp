// Kernels of the communication mappings. They are device-generic: the
// communicator for the tensor's device does the moving (Gloo on CPU, NCCL on
// CUDA), so the same kernel is registered for both. Each runs on its input's
// device (the current device may be another).
#include <ATen/ATen.h>
#include <ATen/DeviceGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <sstream>

#include "comm/debug_communicator.h"
#include "comm/registry.h"
#include "comm/sharded_collectives.h"
#include "ops/op_checks.h"
#include <shardtorch/topology/topology.h>

namespace shardtorch {
namespace ops {
namespace {

// With full_size the ranks know every shard's length without asking. A rank
// whose input does not fit must not fail alone, though: its peers would enter
// the all-gather and wait for the timeout. Where it costs no host sync (CPU:
// Gloo waits on the host anyway) or the user asked for checks
// (SHARDTORCH_DEBUG), the ranks first exchange what they hold and all fail
// together; on CUDA otherwise the check is local and the peers of a failing
// rank fail by the communicator's timeout (docs/bad_inputs.md, G5).
std::vector<int64_t> sizes_from_full_size(comm::Communicator& communicator, const at::Tensor& input,
                                          int64_t dim, int64_t total, const char* op) {
  const int64_t world = communicator.size();
  const int64_t rank = communicator.rank();
  const bool agree_first = world > 1 && (input.device().is_cpu() || comm::debug_mode_enabled());
  if (!agree_first) {
    TORCH_CHECK(total >= 0, op, ": full_size must be >= 0, got ", total);
    auto sizes = topology::shard_sizes(total, world);
    TORCH_CHECK(sizes[rank] == input.size(dim), op, ": input.size(", dim, ") must be rank ", rank,
                "'s shard of full_size=", total, " over ", world, " ranks (", sizes[rank],
                "), got ", input.size(dim));
    return sizes;
  }
  // Every rank's (shard length along dim, full_size), in one tiny all-gather:
  // every check after it sees the same values on every rank.
  const auto claims = comm::exchange_values(communicator, {input.size(dim), total}, input.device());
  std::vector<int64_t> held, totals;
  for (int64_t r = 0; r < world; ++r) {
    held.push_back(claims[2 * r]);
    totals.push_back(claims[2 * r + 1]);
  }
  TORCH_CHECK(std::all_of(totals.begin(), totals.end(), [&](int64_t t) { return t == total; }), op,
              ": the ranks of the group pass different full_size values ", c10::IntArrayRef(totals),
              " (in rank order)");
  TORCH_CHECK(total >= 0, op, ": full_size must be >= 0, got ", total);
  auto sizes = topology::shard_sizes(total, world);
  if (held != sizes) {
    std::ostringstream wrong;
    for (int64_t r = 0; r < world; ++r) {
      if (held[r] != sizes[r]) {
        wrong << (wrong.tellp() > 0 ? ", " : "") << "rank " << r << " holds " << held[r]
              << " instead of " << sizes[r];
      }
    }
    TORCH_CHECK(false, op, ": input.size(", dim, ") must be each rank's shard of full_size=", total,
                " over ", world, " ranks ", c10::IntArrayRef(sizes), ", but ", wrong.str(),
                " (this rank is ", rank, ")");
  }
  return sizes;
}

std::vector<int64_t> gathered_sizes(comm::Communicator& communicator, const at::Tensor& input,
                                    int64_t dim, const std::optional<c10::SymInt>& full_size,
                                    const char* op) {
  const int64_t world = communicator.size();
  if (full_size.has_value()) {
    return sizes_from_full_size(communicator, input, dim, full_size->guard_int(__FILE__, __LINE__),
                                op);
  }
  auto sizes = comm::exchange_sizes(communicator, input.size(dim), input.device());
  int64_t total = 0;
  for (auto s : sizes) total += s;
  TORCH_CHECK(sizes == topology::shard_sizes(total, world), op, ": shards along dim ", dim,
              " must follow the split rule (the first total % ranks "
              "ranks hold one more), got sizes ",
              c10::IntArrayRef(sizes));
  return sizes;
}

at::Tensor copy_kernel(const at::Tensor& input, const std::string& group) {
  const at::OptionalDeviceGuard device_guard(at::device_of(input));
  comm::group_layout(group, "shard::copy");
  return input.clone(at::MemoryFormat::Contiguous);
}

at::Tensor reduce_kernel(const at::Tensor& input, const std::string& group) {
  const at::OptionalDeviceGuard device_guard(at::device_of(input));
  auto communicator = comm::communicator_for(group, input.device(), "shard::reduce");
  at::Tensor output = input.clone(at::MemoryFormat::Contiguous);
  communicator->all_reduce(output);
  return output;
}

at::Tensor scatter_kernel(const at::Tensor& input, int64_t dim, const std::string& group) {
  const at::OptionalDeviceGuard device_guard(at::device_of(input));
  auto info = comm::group_layout(group, "shard::scatter");
  const int64_t d = normalize_dim(dim, input.dim(), "shard::scatter");
  const int64_t total = input.size(d);
  return input
      .narrow(d, topology::shard_offset(total, info.size, info.rank),
              topology::shard_size(total, info.size, info.rank))
      .clone(at::MemoryFormat::Contiguous);
}

at::Tensor all_gather_kernel(const at::Tensor& input, int64_t dim, const std::string& group,
                             std::optional<c10::SymInt> full_size) {
  const at::OptionalDeviceGuard device_guard(at::device_of(input));
  auto communicator = comm::communicator_for(group, input.device(), "shard::all_gather");
  const int64_t d = normalize_dim(dim, input.dim(), "shard::all_gather");
  auto sizes = gathered_sizes(*communicator, input, d, full_size, "shard::all_gather");
  return comm::all_gather_along_dim(*communicator, input, d, sizes);
}

at::Tensor reduce_scatter_kernel(const at::Tensor& input, int64_t dim, const std::string& group) {
  const at::OptionalDeviceGuard device_guard(at::device_of(input));
  auto communicator = comm::communicator_for(group, input.device(), "shard::reduce_scatter");
  const int64_t d = normalize_dim(dim, input.dim(), "shard::reduce_scatter");
  auto sizes = topology::shard_sizes(input.size(d), communicator->size());
  return comm::reduce_scatter_along_dim(*communicator, input, d, sizes);
}

// The same kernels serve CPU and CUDA: the communicator moves the data.
void register_mapping_kernels(torch::Library& m) {
  m.impl("copy", TORCH_FN(copy_kernel));
  m.impl("reduce", TORCH_FN(reduce_kernel));
  m.impl("scatter", TORCH_FN(scatter_kernel));
  m.impl("all_gather", TORCH_FN(all_gather_kernel));
  m.impl("gather_replicated", TORCH_FN(all_gather_kernel));
  m.impl("reduce_scatter", TORCH_FN(reduce_scatter_kernel));
}

}  // namespace

TORCH_LIBRARY_IMPL(shard, CPU, m) { register_mapping_kernels(m); }

TORCH_LIBRARY_IMPL(shard, CUDA, m) { register_mapping_kernels(m); }

}  // namespace ops
}  // namespace shardtorch
