// Multi-process tests of the C++ init and the communicators, run by every rank
// under torchrun (ctest: torchrun --no-python --standalone --nproc-per-node N
// test_communicators GROUP_SIZE). Checks the groups match the topology, each
// collective of the CPU (Gloo) communicator, the mapping ops with their
// adjoint backwards, and ParallelLinear against an unsharded torch::nn::Linear.
#include <shardtorch/shardtorch.h>

#include <torch/nn/modules/linear.h>
#include <torch/utils.h>

#include <cstdlib>

#include "check.h"
#include "comm/registry.h"

namespace dist = shardtorch::distributed;
namespace topo = shardtorch::topology;

static at::Tensor full_of(std::vector<int64_t> sizes, double value) {
  return torch::full(sizes, value, torch::kFloat);
}

static void test_groups(int64_t group_size) {
  const auto rank = dist::get_rank();
  const auto world = dist::get_world_size();
  topo::TensorParallelTopology layout(world, rank, group_size);
  EXPECT(dist::is_initialized());
  EXPECT(dist::get_group_size() == group_size);
  EXPECT(dist::get_group_rank() == layout.tensor_parallel_rank());
  EXPECT(dist::get_group_ranks(dist::kTensorParallel) == layout.tensor_parallel_group_ranks());
  EXPECT(dist::get_group_ranks(dist::kDataParallel) == layout.data_parallel_group_ranks());
  EXPECT(dist::get_group_size(dist::kDataParallel) == layout.data_parallel_size());
  EXPECT(dist::get_group_size(dist::kWorld) == world);
  EXPECT(dist::get_group_rank(dist::kWorld) == rank);
  EXPECT(dist::get_local_rank() == std::atoll(std::getenv("LOCAL_RANK")));
  EXPECT_THROWS(dist::get_group_size("nope"), "unknown group 'nope'");
  EXPECT_THROWS(dist::init_process_group(dist::InitOptions(group_size)), "already initialised");
}

static void test_communicator(const std::string& group) {
  auto comm = shardtorch::comm::communicator_for(group, c10::Device(c10::kCPU), "test");
  const auto rank = comm->rank();
  const auto size = comm->size();
  EXPECT(comm->backend_name() == "gloo");

  auto summed = full_of({3}, static_cast<double>(rank + 1));
  comm->all_reduce(summed);
  EXPECT(torch::equal(summed, full_of({3}, size * (size + 1) / 2.0)));

  auto input = torch::arange(2, torch::kFloat) + 10 * rank;
  auto gathered = torch::empty({size * 2});
  comm->all_gather(input, gathered);
  std::vector<at::Tensor> expected_blocks;
  for (int64_t r = 0; r < size; ++r) expected_blocks.push_back(torch::arange(2, torch::kFloat) + 10 * r);
  EXPECT(torch::equal(gathered, torch::cat(expected_blocks)));

  // Block r of every rank's input, summed, lands on rank r.
  auto blocks = torch::arange(size * 2, torch::kFloat) * (rank + 1);
  auto mine = torch::empty({2});
  comm->reduce_scatter(blocks, mine);
  EXPECT(torch::equal(mine, (torch::arange(size * 2, torch::kFloat) * (size * (size + 1) / 2.0))
                               .slice(0, 2 * rank, 2 * rank + 2)));

  auto root_value = full_of({4}, rank == size - 1 ? 42.0 : -1.0);
  comm->broadcast(root_value, size - 1);
  EXPECT(torch::equal(root_value, full_of({4}, 42.0)));

  if (size > 1) {
    // A ring: send to the next rank, receive from the previous.
    auto received = torch::empty({2});
    auto send = comm->send_async(full_of({2}, rank), (rank + 1) % size);
    comm->recv(received, (rank + size - 1) % size);
    send->wait();
    EXPECT(torch::equal(received, full_of({2}, (rank + size - 1) % size)));
  }
}

// The mappings through the dispatcher, with their adjoint backwards; 5 columns
// split unevenly when the group has 2 ranks.
static void test_mappings() {
  const auto rank = dist::get_group_rank();
  const auto size = dist::get_group_size();
  const auto whole = torch::arange(15, torch::kFloat).view({3, 5}).requires_grad_();
  const auto offset = topo::shard_offset(5, size, rank);
  const auto length = topo::shard_size(5, size, rank);

  auto shard = dist::scatter(whole, -1);
  EXPECT(torch::equal(shard, whole.slice(1, offset, offset + length)));
  auto back = dist::gather_replicated(shard, -1, dist::kTensorParallel, 5);
  EXPECT(torch::equal(back, whole));
  back.sum().backward();
  // gather_replicated keeps this rank's slice of the gradient; scatter all-gathers it back.
  EXPECT(torch::equal(whole.grad(), torch::ones({3, 5})));

  // gather is the adjoint: its backward sums the group's gradients.
  auto mine = shard.detach().requires_grad_();
  dist::gather(mine, -1, dist::kTensorParallel, 5).sum().backward();
  EXPECT(torch::equal(mine.grad(), torch::full_like(mine, static_cast<double>(size))));

  auto unsized = dist::all_gather(shard.detach(), -1);  // sizes exchanged first
  EXPECT(torch::equal(unsized, whole.detach()));

  auto x = full_of({2, 2}, 1.0).requires_grad_();
  auto reduced = dist::reduce(x * (rank + 1));
  EXPECT(torch::equal(reduced, full_of({2, 2}, size * (size + 1) / 2.0)));
  auto copied = dist::copy(x);
  copied.sum().backward();
  EXPECT(torch::equal(x.grad(), full_of({2, 2}, size)));  // copy's backward all-reduces

  auto summed_shard = dist::reduce_scatter(full_of({2, 5}, rank + 1.0), -1);
  EXPECT(summed_shard.size(1) == length);
  EXPECT(torch::equal(summed_shard, full_of({2, length}, size * (size + 1) / 2.0)));
}

// Column- then row-parallel layers equal their unsharded torch::nn::Linear
// twins: weights (exact init), output and every gradient.
static void test_parallel_linear() {
  namespace snn = shardtorch::nn;
  const auto rank = dist::get_group_rank();
  const auto size = dist::get_group_size();
  torch::manual_seed(11);
  torch::nn::Linear ref1(torch::nn::LinearOptions(6, 7));
  torch::nn::Linear ref2(torch::nn::LinearOptions(7, 3));
  torch::manual_seed(11);
  snn::ParallelLinear col(snn::ParallelLinearOptions(6, 7).dim(1));
  snn::ParallelLinear row(snn::ParallelLinearOptions(7, 3).dim(0));
  const auto o = topo::shard_offset(7, size, rank);
  const auto n = topo::shard_size(7, size, rank);
  EXPECT(torch::equal(col->weight, ref1->weight.slice(0, o, o + n)));
  EXPECT(torch::equal(col->bias, ref1->bias.slice(0, o, o + n)));
  EXPECT(torch::equal(row->weight, ref2->weight.slice(1, o, o + n)));
  EXPECT(torch::equal(row->bias, ref2->bias));

  const auto x = torch::randn({4, 6});
  auto x_ref = x.clone().requires_grad_();
  auto x_sharded = x.clone().requires_grad_();
  const auto y_ref = ref2(torch::relu(ref1(x_ref)));
  const auto y = row(torch::relu(col(x_sharded)));
  EXPECT(torch::allclose(y, y_ref, 1e-5, 1e-6));
  (y_ref * y_ref).sum().backward();
  (y * y).sum().backward();
  EXPECT(torch::allclose(x_sharded.grad(), x_ref.grad(), 1e-5, 1e-6));
  EXPECT(torch::allclose(col->weight.grad(), ref1->weight.grad().slice(0, o, o + n), 1e-5, 1e-6));
  EXPECT(torch::allclose(col->bias.grad(), ref1->bias.grad().slice(0, o, o + n), 1e-5, 1e-6));
  EXPECT(torch::allclose(row->weight.grad(), ref2->weight.grad().slice(1, o, o + n), 1e-5, 1e-6));
  EXPECT(torch::allclose(row->bias.grad(), ref2->bias.grad(), 1e-5, 1e-6));
  // The functional form is the same op.
  const auto yf = shardtorch::nn::functional::parallel_linear(x, col->weight, col->bias, 1);
  EXPECT(torch::allclose(yf, col(x)));
}

int main(int argc, char** argv) {
  const int64_t group_size = argc > 1 ? std::atoll(argv[1]) : 2;
  dist::init_process_group(dist::InitOptions().group_size(group_size).timeout(std::chrono::seconds(60)));
  test_groups(group_size);
  for (const char* group : {dist::kTensorParallel, dist::kDataParallel, dist::kWorld}) {
    test_communicator(group);
  }
  test_mappings();
  test_parallel_linear();
  dist::destroy_process_group();
  EXPECT(!dist::is_initialized());
  EXPECT(shardtorch::comm::group_names().empty());
  const std::string name = "test_communicators rank " + std::to_string(std::atoi(std::getenv("RANK")));
  return shardtorch_test::finish(name.c_str());
}
