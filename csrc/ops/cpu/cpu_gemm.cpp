// Which library multiplies float32 matrices on this CPU (cpu_gemm.h), and the
// op shard::_cpu_gemm_ that runs that choice from Python (tests, benchmarks).
#include "ops/cpu/cpu_gemm.h"

#include <ATen/ATen.h>
#include <ATen/Config.h>
#include <ATen/Context.h>
#include <ATen/MemoryOverlap.h>
#include <torch/library.h>

#include <cstdlib>
#include <cstring>
#include <exception>

#if AT_MKLDNN_ENABLED()
namespace at {
namespace native {
// result = beta * result + alpha * mat1 mat2 (aten/src/ATen/native/mkldnn/Matmul.h, which torch's
// wheel does not ship; exported from libtorch_cpu since torch 2.0, float32 taken since 2.1).
// Weak: a torch without it (or with another signature, another mangled name) still loads this
// library, and the GEMMs stay with ATen.
TORCH_API void mkldnn_matmul(const Tensor& mat1, const Tensor& mat2, const Tensor& result,
                             float beta, float alpha) __attribute__((weak));
}  // namespace native
}  // namespace at
#endif

namespace shardtorch {
namespace ops {
namespace {

constexpr const char* kVariable = "SHARDTORCH_CPU_FLOAT32_GEMMS";
// Below this many multiply-adds oneDNN's fixed cost per call (~15 us: its primitive looked up in
// its cache) exceeds what MKL's narrower kernels lose (measured on the Zen 5 above: [32 x 128] x
// [128 x 128] 14 us MKL, 19 us oneDNN; [64 x 256] x [256 x 256] 97 us, 57 us).
constexpr int64_t kOneDnnMinProduct = int64_t{1} << 21;

struct Float32GemmSupport {
  bool onednn_runs = false;    // torch's mkldnn_matmul takes float32 here
  bool blas_narrowed = false;  // MKL runs narrower kernels than the CPU has
  const char* missing = "";    // why not onednn_runs
};

#if AT_MKLDNN_ENABLED()
// Whether mkldnn_matmul takes a float32 product here. It checks the ISA oneDNN may use, which
// ONEDNN_MAX_CPU_ISA can cap below the CPU's: ask it once.
bool onednn_takes_float32() {
  try {
    const at::Tensor a = at::ones({2, 2}, at::kFloat);
    const at::Tensor out = at::zeros({2, 2}, at::kFloat);
    at::native::mkldnn_matmul(a, a, out, 0.0f, 1.0f);
    return out.eq(2.0f).all().item<bool>();
  } catch (const std::exception&) {
    return false;
  }
}
#endif

Float32GemmSupport detect() {
  Float32GemmSupport s;
#if !AT_MKLDNN_ENABLED()
  s.missing = "this torch is built without oneDNN (MKLDNN)";
#elif defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  // mkldnn_matmul refuses float32 without these (its bf16 device check).
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (&at::native::mkldnn_matmul == nullptr) {
    s.missing = "this torch does not export at::native::mkldnn_matmul";
  } else if (!avx512) {
    s.missing = "this CPU has no AVX-512 (F, BW, VL, DQ)";
  } else if (!onednn_takes_float32()) {
    s.missing = "torch's oneDNN refuses float32 GEMMs here (ONEDNN_MAX_CPU_ISA?)";
  } else {
    s.onednn_runs = true;
  }
  s.blas_narrowed = s.onednn_runs && at::hasMKL() && !__builtin_cpu_is("intel");
#else
  s.missing = "oneDNN's float32 GEMMs are taken on x86-64 only";
#endif
  return s;
}

const Float32GemmSupport& support() {
  static const Float32GemmSupport s = detect();
  return s;
}

// Float32 CPU operands with something to multiply (oneDNN is not asked for empty products).
bool operands_take_onednn(const at::Tensor& a, const at::Tensor& b) {
  if (!a.is_cpu() || !b.is_cpu() || a.scalar_type() != at::kFloat ||
      b.scalar_type() != at::kFloat || a.dim() != 2 || b.dim() != 2 || a.numel() == 0 ||
      b.numel() == 0) {
    return false;
  }
  return cpu_float32_gemm_takes_onednn(a.size(0), a.size(1), b.size(1));
}

bool takes_onednn(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  return out.is_cpu() && out.scalar_type() == at::kFloat && operands_take_onednn(a, b);
}

#if AT_MKLDNN_ENABLED()
void onednn_gemm(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b, bool accumulate) {
  at::native::mkldnn_matmul(a, b, out, accumulate ? 1.0f : 0.0f, 1.0f);
}
#else
void onednn_gemm(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool) {
  TORCH_INTERNAL_ASSERT(false, "oneDNN GEMM taken without oneDNN");
}
#endif

}  // namespace

bool cpu_float32_gemm_takes_onednn(int64_t m, int64_t k, int64_t n) {
  const char* asked = std::getenv(kVariable);
  const bool automatic = asked == nullptr || *asked == '\0' || std::strcmp(asked, "auto") == 0;
  if (automatic) {
    // In double: no overflow whatever the sizes. torch.backends.mkldnn.enabled = False keeps
    // ATen's GEMMs (torch's own choice of oneDNN follows it too).
    return support().blas_narrowed && at::globalContext().userEnabledMkldnn() &&
           static_cast<double>(m) * static_cast<double>(k) * static_cast<double>(n) >=
               static_cast<double>(kOneDnnMinProduct);
  }
  if (std::strcmp(asked, "blas") == 0) return false;
  TORCH_CHECK(std::strcmp(asked, "onednn") == 0, kVariable, " must be auto, onednn or blas, got '",
              asked, "'");
  TORCH_CHECK(support().onednn_runs, kVariable, "=onednn, but ", support().missing,
              ": unset it or set it to auto or blas");
  return true;
}

void cpu_mm_out(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  if (takes_onednn(out, a, b)) return onednn_gemm(out, a, b, /*accumulate=*/false);
  at::mm_out(const_cast<at::Tensor&>(out), a, b);
}

void cpu_addmm_(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  if (takes_onednn(out, a, b)) return onednn_gemm(out, a, b, /*accumulate=*/true);
  out.addmm_(a, b);
}

void cpu_addmm_out(const at::Tensor& out, const at::Tensor& bias, const at::Tensor& a,
                   const at::Tensor& b) {
  if (takes_onednn(out, a, b) && bias.is_cpu() && bias.scalar_type() == at::kFloat) {
    out.copy_(bias.expand_as(out));
    return onednn_gemm(out, a, b, /*accumulate=*/true);
  }
  at::addmm_out(const_cast<at::Tensor&>(out), bias, a, b);
}

at::Tensor cpu_mm(const at::Tensor& a, const at::Tensor& b) {
  if (!operands_take_onednn(a, b)) return at::mm(a, b);
  at::Tensor out = at::empty({a.size(0), b.size(1)}, a.options());
  onednn_gemm(out, a, b, /*accumulate=*/false);
  return out;
}

at::Tensor cpu_addmm(const at::Tensor& bias, const at::Tensor& a, const at::Tensor& b) {
  if (!bias.defined()) return cpu_mm(a, b);
  if (!bias.is_cpu() || bias.scalar_type() != at::kFloat || !operands_take_onednn(a, b)) {
    return at::addmm(bias, a, b);
  }
  at::Tensor out = at::empty({a.size(0), b.size(1)}, a.options());
  cpu_addmm_out(out, bias, a, b);
  return out;
}

namespace {

// out = a b (accumulate: out += a b) by the choice above: what the fused heads' and the
// linear layers' CPU GEMMs run, callable on its own.
void cpu_gemm_op(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b, bool accumulate) {
  constexpr const char* kOp = "shard::_cpu_gemm_";
  TORCH_CHECK(out.dim() == 2 && a.dim() == 2 && b.dim() == 2, kOp,
              ": out, a and b must be 2-D, got ", out.dim(), "-D, ", a.dim(), "-D and ", b.dim(),
              "-D");
  TORCH_CHECK(a.size(1) == b.size(0) && out.size(0) == a.size(0) && out.size(1) == b.size(1), kOp,
              ": shapes do not multiply: out ", out.sizes(), " = a ", a.sizes(), " b ", b.sizes());
  TORCH_CHECK(a.scalar_type() == out.scalar_type() && b.scalar_type() == out.scalar_type(), kOp,
              ": a and b must be in out's dtype ", out.scalar_type(), ", got ", a.scalar_type(),
              " and ", b.scalar_type());
  at::assert_no_internal_overlap(out);
  at::assert_no_overlap(out, a);
  at::assert_no_overlap(out, b);
  if (accumulate) {
    cpu_addmm_(out, a, b);
  } else {
    cpu_mm_out(out, a, b);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(shard, m) {
  m.def("_cpu_gemm_(Tensor(a!) out, Tensor a, Tensor b, bool accumulate=False) -> ()");
}

TORCH_LIBRARY_IMPL(shard, CPU, m) { m.impl("_cpu_gemm_", TORCH_FN(cpu_gemm_op)); }

}  // namespace ops
}  // namespace shardtorch
