// Built against the installed package: each public header by its own
// <shardtorch/...> path, the umbrella header not included, so that a header
// that needs another one it does not include, or that includes an internal
// header (not installed), fails to compile here.
#include <shardtorch/distributed/collectives.h>
#include <shardtorch/distributed/init_options.h>
#include <shardtorch/distributed/process_group.h>
#include <shardtorch/nn/embedding_init.h>
#include <shardtorch/nn/functional.h>
#include <shardtorch/nn/functional_loss.h>
#include <shardtorch/nn/init.h>
#include <shardtorch/nn/init_staging.h>
#include <shardtorch/nn/parallel_cross_entropy.h>
#include <shardtorch/nn/parallel_embedding.h>
#include <shardtorch/nn/parallel_linear.h>
#include <shardtorch/ops/mappings.h>
#include <shardtorch/ops/parallel_cross_entropy.h>
#include <shardtorch/ops/parallel_embedding.h>
#include <shardtorch/ops/parallel_linear.h>
#include <shardtorch/ops/parallel_linear_cross_entropy.h>
#include <shardtorch/ops/parallel_linear_margin_cross_entropy.h>
#include <shardtorch/ops/recycled_buffers.h>
#include <shardtorch/topology/topology.h>
#include <shardtorch/build_info.h>

#include <cstdio>

int main() {
  // 10 classes over 4 ranks: shards 3, 3, 2, 2; rank 2's starts at 6.
  const auto range = shardtorch::topology::shard_range(10, 4, 2);
  // Nothing made yet, so no kept buffer to free (and the symbol links).
  const bool ok =
      range.first == 6 && range.second == 8 && shardtorch::ops::free_recycled_buffers() == 0;
  std::printf("test_public_headers: shardtorch %s, %d failed\n", shardtorch::kVersion, ok ? 0 : 1);
  return ok ? 0 : 1;
}
