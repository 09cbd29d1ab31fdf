// Links shardtorch::shardtorch without calling any of its functions, with the
// linker told --as-needed (see CMakeLists.txt): the shard ops must still be
// registered, as for a program that only runs a TorchScript module through
// torch::jit::load. Includes no shardtorch header on purpose.
#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdio>

int main() {
  int missing = 0;
  for (const char* name :
       {"shard::parallel_linear", "shard::_parallel_linear_backward", "shard::copy",
        "shard::reduce", "shard::scatter", "shard::gather_replicated", "shard::all_gather",
        "shard::reduce_scatter"}) {
    if (!c10::Dispatcher::singleton().findSchema({name, ""}).has_value()) {
      std::fprintf(stderr, "FAILED: operator %s not registered\n", name);
      ++missing;
    }
  }
  std::printf("test_ops_registered: %d missing\n", missing);
  return missing == 0 ? 0 : 1;
}
