#include "comm/sharded_collectives.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "comm/registry.h"

namespace shardtorch {
namespace comm {
namespace {

int64_t max_of(const std::vector<int64_t>& sizes) {
  return sizes.empty() ? 0 : *std::max_element(sizes.begin(), sizes.end());
}

}  // namespace

PendingTensor all_gather_along_dim_async(Communicator& comm, const at::Tensor& input, int64_t dim,
                                         const std::vector<int64_t>& sizes) {
  const int64_t world = comm.size();
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(sizes.size()) == world);
  TORCH_INTERNAL_ASSERT(input.size(dim) == sizes[comm.rank()]);
  const int64_t block_rows = max_of(sizes);
  const bool even =
      std::all_of(sizes.begin(), sizes.end(), [&](int64_t s) { return s == block_rows; });

  // Blocks travel with the gathered dimension first so that each rank's block
  // is one contiguous run of memory.
  at::Tensor leading = input.movedim(dim, 0);
  std::vector<int64_t> block_shape(leading.sizes().begin(), leading.sizes().end());
  block_shape[0] = block_rows;
  at::Tensor block;
  if (even) {
    block = leading.contiguous();
  } else {
    block = at::zeros(block_shape, input.options());
    block.narrow(0, 0, leading.size(0)).copy_(leading);
  }
  std::vector<int64_t> gathered_shape{world};
  gathered_shape.insert(gathered_shape.end(), block_shape.begin(), block_shape.end());
  at::Tensor gathered = at::empty(gathered_shape, input.options());
  auto handle = comm.all_gather_async(block, gathered);

  auto assemble = [gathered, sizes, even, dim, world, block_shape]() {
    at::Tensor whole;
    if (even) {
      std::vector<int64_t> shape(block_shape);
      shape[0] = block_shape[0] * world;
      whole = gathered.view(shape);
    } else {
      std::vector<at::Tensor> pieces;
      for (int64_t r = 0; r < world; ++r) pieces.push_back(gathered[r].narrow(0, 0, sizes[r]));
      whole = at::cat(pieces, 0);
    }
    return whole.movedim(0, dim).contiguous();
  };
  return PendingTensor{std::move(handle), std::move(assemble)};
}

at::Tensor all_gather_along_dim(Communicator& comm, const at::Tensor& input, int64_t dim,
                                const std::vector<int64_t>& sizes) {
  return all_gather_along_dim_async(comm, input, dim, sizes).finish();
}

at::Tensor reduce_scatter_along_dim(Communicator& comm, const at::Tensor& input, int64_t dim,
                                    const std::vector<int64_t>& sizes) {
  const int64_t world = comm.size();
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(sizes.size()) == world);
  const int64_t block_rows = max_of(sizes);
  at::Tensor leading = input.movedim(dim, 0);
  std::vector<int64_t> block_shape(leading.sizes().begin(), leading.sizes().end());
  block_shape[0] = block_rows;
  std::vector<int64_t> blocks_shape{world};
  blocks_shape.insert(blocks_shape.end(), block_shape.begin(), block_shape.end());

  at::Tensor blocks = at::zeros(blocks_shape, input.options());
  int64_t offset = 0;
  for (int64_t r = 0; r < world; ++r) {
    blocks[r].narrow(0, 0, sizes[r]).copy_(leading.narrow(0, offset, sizes[r]));
    offset += sizes[r];
  }
  at::Tensor mine = at::empty(block_shape, input.options());
  comm.reduce_scatter(blocks, mine);
  return mine.narrow(0, 0, sizes[comm.rank()]).movedim(0, dim).contiguous();
}

std::vector<int64_t> exchange_values(Communicator& comm, const std::vector<int64_t>& local,
                                     const c10::Device& device) {
  const int64_t count = static_cast<int64_t>(local.size());
  if (!device.is_cpu() && group_has_cpu_backend(comm.group_name(), "exchange_values")) {
    // Host values over the host's backend: no device round trip to wait for.
    auto host = communicator_for(comm.group_name(), c10::Device(c10::kCPU), "exchange_values");
    return exchange_values(*host, local, c10::Device(c10::kCPU));
  }
  // The host waits for the device below: the checks still deferred are
  // settled first, so that one saying a rank left aborts the collectives that
  // wait for it instead of this wait hanging behind them.
  comm.check_deferred();
  at::Tensor mine = at::tensor(local, at::kLong).to(device);
  at::Tensor all = at::empty({comm.size() * count}, mine.options());
  comm.all_gather(mine, all);
  at::Tensor host = all.cpu();
  return std::vector<int64_t>(host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + host.numel());
}

std::vector<int64_t> exchange_sizes(Communicator& comm, int64_t local, const c10::Device& device) {
  return exchange_values(comm, {local}, device);
}

}  // namespace comm
}  // namespace shardtorch
