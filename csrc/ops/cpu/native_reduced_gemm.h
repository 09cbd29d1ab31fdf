#pragma once
// Whether this CPU multiplies bfloat16 / float16 matrices in hardware. Without
// the instructions (AVX512-BF16 or AMX-BF16 for bfloat16, AVX512-FP16 or
// AMX-FP16 for float16) oneDNN emulates them by converting to float32, and a
// reduced-precision GEMM is slower than the float32 one it stands for: on an
// AVX-512 Xeon without them, [256 x 512] x [512 x 50,000] on one thread took
// 97 ms in float32, 463 ms in bfloat16 and 1,044 ms in float16.
#include <c10/core/ScalarType.h>

namespace shardtorch {
namespace ops {

// True for a dtype other than float16/bfloat16, and on CPUs other than
// x86-64 (whose reduced-precision GEMMs are taken as they come). Read once.
bool cpu_has_native_gemm(at::ScalarType dtype);

}  // namespace ops
}  // namespace shardtorch
