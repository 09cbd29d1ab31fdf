#pragma once
// The CPU GEMMs of the parallel linear layers and the fused heads. ATen's mm
// runs float32 through MKL's sgemm, and MKL takes its AVX2 kernels on x86-64
// CPUs not made by Intel even where they have AVX-512: on an AMD EPYC (Zen 5,
// AVX-512), one thread, [256 x 512] x [512 x 50,000] ran at 87 GFLOPS in MKL
// and at 208 in oneDNN's matmul (torch's own at::native::mkldnn_matmul, whose
// kernels follow the CPU's instructions, not its maker). There a float32 GEMM
// big enough to pay oneDNN's ~15 us per call (m * n * k >= 2^21) goes through
// oneDNN; everywhere else, and in every other dtype or device, ATen's calls
// run as they would without this file. Both accumulate in float32: the result
// differs from MKL's in rounding only (tests/ops/test_cpu_gemm.py checks both
// against float64).
//
// SHARDTORCH_CPU_FLOAT32_GEMMS (read at each call) overrides the choice:
// `auto` (unset: the above), `onednn` (every float32 CPU GEMM, of any size; an
// error where torch's oneDNN cannot run them: no MKLDNN in torch, or no
// AVX-512 F/BW/VL/DQ) or `blas` (ATen's mm always).

#include <ATen/core/Tensor.h>

namespace shardtorch {
namespace ops {

// out = a b. `out` may be any strided view (columns of a wider block); a and b
// 2-D, in out's dtype, neither overlapping out.
void cpu_mm_out(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b);
// out += a b.
void cpu_addmm_(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b);
// out = bias + a b, bias broadcast over out as addmm's `self`.
void cpu_addmm_out(const at::Tensor& out, const at::Tensor& bias, const at::Tensor& a,
                   const at::Tensor& b);
// A new tensor: a b, or bias + a b (bias undefined: none).
at::Tensor cpu_mm(const at::Tensor& a, const at::Tensor& b);
at::Tensor cpu_addmm(const at::Tensor& bias, const at::Tensor& a, const at::Tensor& b);

// Whether a float32 GEMM of [m x k] x [k x n] on the CPU goes through oneDNN
// (the choice above; an error for `onednn` where oneDNN cannot run it).
bool cpu_float32_gemm_takes_onednn(int64_t m, int64_t k, int64_t n);

}  // namespace ops
}  // namespace shardtorch
