#include "ops/cpu/native_reduced_gemm.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#endif

#include <cstdint>

namespace shardtorch {
namespace ops {
namespace {

struct ReducedGemmIsa {
  bool bfloat16 = false;
  bool float16 = false;
};

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
uint64_t enabled_register_state() {  // XCR0: the register state the OS saves
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

ReducedGemmIsa detect() {
  ReducedGemmIsa isa;
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return isa;  // no OSXSAVE
  const uint64_t xcr0 = enabled_register_state();
  const bool avx512_state = (xcr0 & 0xe6) == 0xe6;     // SSE, AVX, opmask, ZMM halves
  const bool amx_state = (xcr0 & 0x60000) == 0x60000;  // XTILECFG, XTILEDATA
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return isa;
  const bool avx512f = b & (1u << 16);
  const bool avx512_fp16 = d & (1u << 23);
  const bool amx_bf16 = d & (1u << 22);
  const bool amx_tile = d & (1u << 24);
  const unsigned max_subleaf = a;
  bool avx512_bf16 = false, amx_fp16 = false;
  if (max_subleaf >= 1 && __get_cpuid_count(7, 1, &a, &b, &c, &d)) {
    avx512_bf16 = a & (1u << 5);
    amx_fp16 = a & (1u << 21);
  }
  const bool avx512 = avx512f && avx512_state;
  const bool amx = amx_tile && amx_state;
  isa.bfloat16 = (avx512 && avx512_bf16) || (amx && amx_bf16);
  isa.float16 = (avx512 && avx512_fp16) || (amx && amx_fp16);
  return isa;
}
#else
ReducedGemmIsa detect() { return {true, true}; }
#endif

}  // namespace

bool cpu_has_native_gemm(at::ScalarType dtype) {
  static const ReducedGemmIsa isa = detect();
  if (dtype == at::kBFloat16) return isa.bfloat16;
  if (dtype == at::kHalf) return isa.float16;
  return true;
}

}  // namespace ops
}  // namespace shardtorch
