// Multi-process tests of the C++ init and the communicators, run by every rank
// under torchrun (ctest: torchrun --no-python --standalone --nproc-per-node N
// test_communicators GROUP_SIZE). Checks the groups match the topology, each
// collective of the CPU (Gloo) communicator, the mapping ops with their
// adjoint backwards, ParallelLinear, ParallelCrossEntropyLoss and
// ParallelEmbedding against their unsharded torch::nn twins.
#include <shardtorch/shardtorch.h>

#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/loss.h>
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
  for (int64_t r = 0; r < size; ++r)
    expected_blocks.push_back(torch::arange(2, torch::kFloat) + 10 * r);
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

// The sharded loss equals torch::nn::CrossEntropyLoss on the whole logits,
// value and logits gradient, with every option; the fused form equals a
// column-parallel Linear followed by the loss.
static void test_parallel_cross_entropy() {
  namespace snn = shardtorch::nn;
  const auto rank = dist::get_group_rank();
  const auto size = dist::get_group_size();
  constexpr int64_t kClasses = 11;  // uneven shards
  const auto o = topo::shard_offset(kClasses, size, rank);
  const auto n = topo::shard_size(kClasses, size, rank);
  torch::manual_seed(13);
  const auto logits = torch::randn({6, kClasses}, torch::kFloat64);
  const auto weight = torch::rand({kClasses}, torch::kFloat64) + 0.5;
  auto targets = torch::randint(0, kClasses, {6}, torch::kLong);
  targets[2] = -100;
  for (const bool weighted : {false, true}) {
    for (const double smoothing : {0.0, 0.2}) {
      auto whole = logits.clone().requires_grad_();
      auto shard = logits.slice(1, o, o + n).clone().requires_grad_();
      auto ref_options = torch::nn::CrossEntropyLossOptions().label_smoothing(smoothing);
      auto options = snn::ParallelCrossEntropyLossOptions().label_smoothing(smoothing);
      if (weighted) {
        ref_options.weight(weight);
        options.weight(weight.slice(0, o, o + n));  // this rank's shard of the weights
      }
      torch::nn::CrossEntropyLoss reference(ref_options);
      snn::ParallelCrossEntropyLoss loss_fn(options);
      const auto expected = reference(whole, targets);
      const auto loss = loss_fn(shard, targets);
      EXPECT_MSG(torch::allclose(loss, expected, 1e-10, 1e-12),
                 "weighted=" << weighted << " smoothing=" << smoothing << ": "
                             << loss.item<double>() << " vs " << expected.item<double>());
      expected.backward();
      loss.backward();
      EXPECT(torch::allclose(shard.grad(), whole.grad().slice(1, o, o + n), 1e-10, 1e-12));
    }
  }
  // reduction none and sum, through the functional form.
  namespace F = snn::functional;
  const auto none =
      F::parallel_cross_entropy(logits.slice(1, o, o + n), targets,
                                F::ParallelCrossEntropyFuncOptions().reduction(torch::kNone));
  const auto none_ref = torch::nn::functional::cross_entropy(
      logits, targets, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
  EXPECT(torch::allclose(none, none_ref, 1e-10, 1e-12));
  const auto sum = F::parallel_cross_entropy(
      logits.slice(1, o, o + n), targets,
      F::ParallelCrossEntropyFuncOptions().reduction(torch::kSum).num_classes(kClasses));
  EXPECT(torch::allclose(sum, none_ref.sum(), 1e-10, 1e-12));
  // z_loss adds z * logsumexp^2 over the rows that count, divided like the mean.
  const auto with_z = F::parallel_cross_entropy(logits.slice(1, o, o + n), targets,
                                                F::ParallelCrossEntropyFuncOptions().z_loss(0.1));
  const auto valid = targets.ne(-100);
  const auto lse = logits.logsumexp(1);
  const auto z_ref = torch::nn::functional::cross_entropy(logits, targets) +
                     0.1 * (lse * lse).masked_select(valid).sum() / valid.sum();
  EXPECT(torch::allclose(with_z, z_ref, 1e-10, 1e-12));
  // Class probabilities, whole [rows, classes] or this rank's columns, with
  // weights and smoothing: torch's soft-target loss and logit gradient.
  const auto probs = torch::randn({6, kClasses}, torch::kFloat64).softmax(1);
  for (const bool sharded : {false, true}) {
    auto whole = logits.clone().requires_grad_();
    auto shard = logits.slice(1, o, o + n).clone().requires_grad_();
    const auto expected = torch::nn::functional::cross_entropy(
        whole, probs,
        torch::nn::functional::CrossEntropyFuncOptions().weight(weight).label_smoothing(0.1));
    const auto loss = F::parallel_cross_entropy(
        shard, sharded ? probs.slice(1, o, o + n) : probs,
        F::ParallelCrossEntropyFuncOptions().weight(weight).label_smoothing(0.1));
    EXPECT_MSG(torch::allclose(loss, expected, 1e-10, 1e-12),
               "probabilities sharded=" << sharded << ": " << loss.item<double>() << " vs "
                                        << expected.item<double>());
    expected.backward();
    loss.backward();
    EXPECT(torch::allclose(shard.grad(), whole.grad().slice(1, o, o + n), 1e-10, 1e-12));
  }
  EXPECT_THROWS(snn::ParallelCrossEntropyLoss(snn::ParallelCrossEntropyLossOptions().z_loss(-1)),
                "ParallelCrossEntropyLoss: z_loss must be >= 0, got -1");
  EXPECT_THROWS(
      snn::ParallelCrossEntropyLoss(snn::ParallelCrossEntropyLossOptions().label_smoothing(1.5)),
      "ParallelCrossEntropyLoss: label_smoothing must be in [0, 1], got 1.5");

  // Fused: ParallelLinear(dim=1) + loss without the logits.
  torch::manual_seed(17);
  torch::nn::Linear ref_head(torch::nn::LinearOptions(5, kClasses));
  torch::manual_seed(17);
  snn::ParallelLinear head(snn::ParallelLinearOptions(5, kClasses).dim(1));
  const auto x = torch::randn({6, 5});
  auto x_ref = x.clone().requires_grad_();
  auto x_fused = x.clone().requires_grad_();
  const auto expected = torch::nn::functional::cross_entropy(ref_head(x_ref), targets);
  const auto fused = F::parallel_linear_cross_entropy(
      x_fused, head->weight, head->bias, targets,
      F::ParallelLinearCrossEntropyFuncOptions().chunk_size(2).num_classes(kClasses));
  EXPECT(torch::allclose(fused, expected, 1e-5, 1e-6));
  expected.backward();
  fused.backward();
  EXPECT(torch::allclose(x_fused.grad(), x_ref.grad(), 1e-5, 1e-6));
  EXPECT(
      torch::allclose(head->weight.grad(), ref_head->weight.grad().slice(0, o, o + n), 1e-5, 1e-6));
  EXPECT(torch::allclose(head->bias.grad(), ref_head->bias.grad().slice(0, o, o + n), 1e-5, 1e-6));
}

// Both splits of ParallelEmbedding equal torch::nn::Embedding: the table
// (exact init, padding row zero), the output, the gradient, and max_norm.
static void test_parallel_embedding() {
  namespace snn = shardtorch::nn;
  const auto rank = dist::get_group_rank();
  const auto size = dist::get_group_size();
  const auto ids = torch::tensor({{0, 3, 9}, {4, 4, 8}}, torch::kLong);
  for (const int64_t dim : {0, 1}) {
    for (const bool renorm : {false, true}) {
      auto ref_options = torch::nn::EmbeddingOptions(10, 7).padding_idx(-2);
      auto options = snn::ParallelEmbeddingOptions(10, 7).padding_idx(-2).dim(dim);
      if (renorm) {
        ref_options.max_norm(1.0);
        options.max_norm(1.0);
      }
      torch::manual_seed(19);
      torch::nn::Embedding reference(ref_options);
      torch::manual_seed(19);
      snn::ParallelEmbedding layer(options);
      const auto total = dim == 0 ? 10 : 7;
      const auto o = topo::shard_offset(total, size, rank);
      const auto n = topo::shard_size(total, size, rank);
      const auto slice = [&](const at::Tensor& t) { return t.slice(dim, o, o + n); };
      EXPECT_MSG(torch::equal(layer->weight, slice(reference->weight)), "dim=" << dim);
      EXPECT(layer->padding_idx == 8);
      const auto y_ref = reference(ids);
      const auto y = layer(ids);
      EXPECT_MSG(torch::allclose(y, y_ref, 1e-5, 1e-6), "dim=" << dim << " renorm=" << renorm);
      EXPECT_MSG(torch::allclose(layer->weight, slice(reference->weight), 1e-5, 1e-6),
                 "renormalised weight dim=" << dim);
      (y_ref * y_ref).sum().backward();
      (y * y).sum().backward();
      EXPECT_MSG(torch::allclose(layer->weight.grad(), slice(reference->weight.grad()), 1e-5, 1e-6),
                 "grad dim=" << dim << " renorm=" << renorm);
    }
  }
  EXPECT_THROWS(snn::ParallelEmbedding(snn::ParallelEmbeddingOptions(10, 7).dim(2)),
                "ParallelEmbedding: dim must be 0 (vocabulary-parallel) or 1");
  EXPECT_THROWS(snn::ParallelEmbedding(snn::ParallelEmbeddingOptions(10, 7).padding_idx(10)),
                "padding_idx must be within num_embeddings = 10");
  snn::ParallelEmbedding layer(10, 7);
  EXPECT_THROWS(layer(torch::tensor({10}, torch::kLong)),
                "indices must be in [0, num_embeddings = 10), got values in [10, 10]");
}

int main(int argc, char** argv) {
  const int64_t group_size = argc > 1 ? std::atoll(argv[1]) : 2;
  dist::init_process_group(
      dist::InitOptions().group_size(group_size).timeout(std::chrono::seconds(60)));
  test_groups(group_size);
  for (const char* group : {dist::kTensorParallel, dist::kDataParallel, dist::kWorld}) {
    test_communicator(group);
  }
  test_mappings();
  test_parallel_linear();
  test_parallel_cross_entropy();
  test_parallel_embedding();
  dist::destroy_process_group();
  EXPECT(!dist::is_initialized());
  EXPECT(shardtorch::comm::group_names().empty());
  const std::string name =
      "test_communicators rank " + std::to_string(std::atoi(std::getenv("RANK")));
  return shardtorch_test::finish(name.c_str());
}
