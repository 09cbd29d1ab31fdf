#pragma once
// The C++ API of shardtorch in one include: `#include <shardtorch/shardtorch.h>`
// and link shardtorch::shardtorch (find_package(shardtorch)).
//
//   shardtorch::distributed::init_process_group(shardtorch::distributed::InitOptions(2));
//   auto head = shardtorch::nn::ParallelLinear(
//       shardtorch::nn::ParallelLinearOptions(512, 1000).dim(1));
//   auto loss = shardtorch::nn::ParallelCrossEntropyLoss()(head(features), targets);
//
// Every op is also reachable through the dispatcher as shard::<name> (the
// same ops as torch.ops.shard.* in Python and TorchScript).

#include <shardtorch/build_info.h>

#include <shardtorch/distributed/collectives.h>
#include <shardtorch/distributed/init_options.h>
#include <shardtorch/distributed/process_group.h>
#include <shardtorch/nn/embedding_init.h>
#include <shardtorch/nn/functional.h>
#include <shardtorch/nn/functional_loss.h>
#include <shardtorch/nn/init.h>
#include <shardtorch/nn/parallel_cross_entropy.h>
#include <shardtorch/nn/parallel_embedding.h>
#include <shardtorch/nn/parallel_linear.h>
#include <shardtorch/ops/recycled_buffers.h>
#include <shardtorch/topology/topology.h>
