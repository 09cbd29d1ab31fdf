#pragma once
// Byte-exact accounting of CPU tensor memory, for benchmarks and memory tests.
// torch keeps no allocator statistics for CPU tensors; installing this wraps
// the CPU allocator so that every tensor allocation (inside ops too) is counted
// until freed. Tensors allocated before install() are not counted.

#include <cstdint>

namespace shardtorch {
namespace utils {

struct CpuMemoryStats {
  int64_t current_bytes = 0;
  int64_t peak_bytes = 0;
};

// Installs the tracking allocator (idempotent). It stays installed for the
// life of the process; tracking costs one atomic add per allocation.
void install_cpu_memory_tracker();
bool cpu_memory_tracker_installed();
CpuMemoryStats cpu_memory_stats();
// Restarts peak tracking from the current usage.
void reset_cpu_peak_memory();

}  // namespace utils
}  // namespace shardtorch
