// The ATen versions of the fused classifier's GEMMs (CPU; CUDA has its own,
// cuBLASLt with float32 output for reduced-precision inputs).
#include "ops/cross_entropy_kernels.h"

#include <ATen/ATen.h>

namespace shardtorch {
namespace ops {

at::Tensor CrossEntropyKernels::chunk_logits(const at::Tensor& x, const at::Tensor& w_chunk,
                                             const at::Tensor& bias_chunk,
                                             at::ScalarType out) const {
  at::Tensor logits =
      bias_chunk.defined() ? at::addmm(bias_chunk, x, w_chunk.t()) : at::mm(x, w_chunk.t());
  return logits.scalar_type() == out ? logits : logits.to(out);
}

void CrossEntropyKernels::add_product(at::Tensor& acc, const at::Tensor& a,
                                      const at::Tensor& b) const {
  if (acc.scalar_type() == a.scalar_type()) {
    acc.addmm_(a, b);
  } else {
    acc.add_(at::mm(a, b));
  }
}

}  // namespace ops
}  // namespace shardtorch
