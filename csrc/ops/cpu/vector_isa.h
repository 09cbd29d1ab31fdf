#pragma once
// Hand-written CPU row kernels compiled for the vector extension the machine
// has. The library is built for baseline x86-64 (it must load anywhere), where
// a loop vectorises to 4-lane SSE: ATen picks AVX2 / AVX-512 kernels at run
// time, and a kernel of ours does the same by being compiled three times
// (GCC / Clang target attributes) and called through the variant this CPU
// runs. Measured on an AVX-512 Xeon, one thread: gathering and normalising
// 50,000 rows of 512 floats took 30 ms as baseline code and 21 ms as
// AVX-512 code, as long as index_select's copy alone.
//
// A kernel is written once, as a SHARDTORCH_INLINE_KERNEL function template
// taking its arguments by value (pointers, sizes), and
//   SHARDTORCH_ISA_VARIANTS(run_kernel, kernel)
// defines run_kernel(args...): the kernel inlined into a baseline, an AVX2
// and an AVX-512 function, called through the one this CPU runs. Use it (and
// name the kernel's helpers) inside an anonymous namespace: the unity build
// compiles several files as one, and two files' templates of one name would
// otherwise be one definition.
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>

namespace shardtorch {
namespace ops {

enum class VectorIsa { kBaseline, kAvx2, kAvx512 };

// The widest variant SHARDTORCH_CPU_ISA allows (unset: every one).
inline VectorIsa vector_isa_asked() {
  const char* asked = std::getenv("SHARDTORCH_CPU_ISA");
  if (asked == nullptr || *asked == '\0') return VectorIsa::kAvx512;
  const std::string name(asked);
  TORCH_CHECK(name == "baseline" || name == "avx2" || name == "avx512",
              "SHARDTORCH_CPU_ISA must be baseline, avx2 or avx512, got '", name, "'");
  return name == "baseline" ? VectorIsa::kBaseline
         : name == "avx2"   ? VectorIsa::kAvx2
                            : VectorIsa::kAvx512;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define SHARDTORCH_INLINE_KERNEL __attribute__((always_inline)) inline
#define SHARDTORCH_TARGET_AVX2 __attribute__((target("avx2,fma")))
#define SHARDTORCH_TARGET_AVX512 \
  __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma")))

// The widest of the three this CPU (and its OS) runs, or a narrower one that
// SHARDTORCH_CPU_ISA (baseline, avx2 or avx512) asks for: a way to compare the
// variants (tests/ops/test_cpu_isa_variants.py) or to rule one out. Read once.
inline VectorIsa cpu_vector_isa() {
  static const VectorIsa isa = [] {
    __builtin_cpu_init();
    VectorIsa widest = VectorIsa::kBaseline;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq")) {
      widest = VectorIsa::kAvx512;
    } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
      widest = VectorIsa::kAvx2;
    }
    const VectorIsa cap = vector_isa_asked();
    return cap < widest ? cap : widest;
  }();
  return isa;
}
#else
#define SHARDTORCH_INLINE_KERNEL inline
#define SHARDTORCH_TARGET_AVX2
#define SHARDTORCH_TARGET_AVX512
// Only baseline code here; SHARDTORCH_CPU_ISA is still checked.
inline VectorIsa cpu_vector_isa() {
  static const VectorIsa isa = [] {
    (void)vector_isa_asked();
    return VectorIsa::kBaseline;
  }();
  return isa;
}
#endif

// Asks for the cache lines of a row of `count` values ahead of their use, to
// be written (kPrefetchToWrite) or only read: kernels over scattered rows (the
// row-sparse optimizers', the margin head's gather) call it for the next row
// while they work on one, since the hardware prefetchers start cold on each row.
enum PrefetchIntent { kPrefetchToRead = 0, kPrefetchToWrite = 1 };
template <int Intent, typename T>
SHARDTORCH_INLINE_KERNEL void prefetch_row(const T* row, int64_t count) {
  const char* bytes = reinterpret_cast<const char*>(row);
  const int64_t size = count * static_cast<int64_t>(sizeof(T));
  for (int64_t b = 0; b < size; b += 64) __builtin_prefetch(bytes + b, Intent, 3);
}

// fma and sqrt for the kernels, as the builtins rather than std::fma /
// std::sqrt: a library function compiled with other optimisation options (the
// kernels turn off fp-contract) may stay a call, and a call per element keeps
// the loop from vectorising (sqrt is one instruction under -fno-math-errno,
// which CMakeLists.txt sets as torch's build does).
template <typename T>
SHARDTORCH_INLINE_KERNEL T fused_multiply_add(T a, T b, T c) {
  if constexpr (std::is_same_v<T, float>) return __builtin_fmaf(a, b, c);
  return __builtin_fma(a, b, c);
}
template <typename T>
SHARDTORCH_INLINE_KERNEL T square_root(T x) {
  if constexpr (std::is_same_v<T, float>) return __builtin_sqrtf(x);
  return __builtin_sqrt(x);
}

#define SHARDTORCH_ISA_VARIANTS(name, kernel)                                    \
  template <typename... Args>                                                    \
  void name##_baseline(Args... args) {                                           \
    kernel(args...);                                                             \
  }                                                                              \
  template <typename... Args>                                                    \
  SHARDTORCH_TARGET_AVX2 void name##_avx2(Args... args) {                        \
    kernel(args...);                                                             \
  }                                                                              \
  template <typename... Args>                                                    \
  SHARDTORCH_TARGET_AVX512 void name##_avx512(Args... args) {                    \
    kernel(args...);                                                             \
  }                                                                              \
  template <typename... Args>                                                    \
  void name(Args... args) {                                                      \
    switch (::shardtorch::ops::cpu_vector_isa()) {                               \
      case ::shardtorch::ops::VectorIsa::kAvx512: return name##_avx512(args...); \
      case ::shardtorch::ops::VectorIsa::kAvx2: return name##_avx2(args...);     \
      default: return name##_baseline(args...);                                  \
    }                                                                            \
  }

}  // namespace ops
}  // namespace shardtorch
