// Which dtype the fused heads' GEMMs run in under autocast
// (cross_entropy/gemm_precision.h): a CPU decision, read from CPUID.
#include "ops/cross_entropy/gemm_precision.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>

#include "ops/cpu/native_reduced_gemm.h"

namespace shardtorch {
namespace ops {

std::optional<at::ScalarType> fused_head_autocast_gemm_dtype(
    c10::DeviceType device, std::optional<at::ScalarType> autocast_dtype) {
  if (!autocast_dtype.has_value() || device != c10::DeviceType::CPU) return autocast_dtype;
  const char* asked = std::getenv("SHARDTORCH_CPU_AUTOCAST_GEMMS");
  if (asked == nullptr || *asked == '\0' || std::strcmp(asked, "auto") == 0) {
    if (cpu_has_native_gemm(*autocast_dtype)) return autocast_dtype;
    return std::nullopt;
  }
  if (std::strcmp(asked, "reduced") == 0) return autocast_dtype;
  if (std::strcmp(asked, "float32") == 0) return std::nullopt;
  TORCH_CHECK(false, "SHARDTORCH_CPU_AUTOCAST_GEMMS must be auto, reduced or float32, got '", asked,
              "'");
}

}  // namespace ops
}  // namespace shardtorch
