// The ATen versions of the fused classifier's GEMMs (CPU; CUDA has its own,
// cuBLASLt with float32 output for reduced-precision inputs). Float32 ones go
// through cpu/cpu_gemm.h (oneDNN where MKL's sgemm runs narrower than the CPU).
#include "ops/cross_entropy/cross_entropy_kernels.h"

#include <ATen/ATen.h>

#include "ops/cpu/cpu_gemm.h"
#include "ops/recycled_buffers.h"
#include "ops/scratch_buffer.h"

namespace shardtorch {
namespace ops {

at::Tensor CrossEntropyKernels::chunk_logits(const at::Tensor& x, const at::Tensor& w_chunk,
                                             const at::Tensor& bias_chunk,
                                             at::ScalarType out) const {
  if (x.scalar_type() == out && w_chunk.scalar_type() == out &&
      (!bias_chunk.defined() || bias_chunk.scalar_type() == out)) {
    // Written straight into a scratch buffer advised for huge pages
    // (scratch_buffer.h), the last calls' when free (recycled_buffers.h).
    static BufferSlot* const slot = new BufferSlot();
    at::Tensor logits = slot->take({x.size(0), w_chunk.size(0)}, x.options(), empty_scratch_buffer);
    if (bias_chunk.defined()) {
      cpu_addmm_out(logits, bias_chunk, x, w_chunk.t());
    } else {
      cpu_mm_out(logits, x, w_chunk.t());
    }
    return logits;
  }
  at::Tensor logits =
      bias_chunk.defined() ? at::addmm(bias_chunk, x, w_chunk.t()) : at::mm(x, w_chunk.t());
  return logits.scalar_type() == out ? logits : logits.to(out);
}

void CrossEntropyKernels::softmax_grad_from_exp_inplace(const at::Tensor&, const at::Tensor&,
                                                        const at::Tensor&, const at::Tensor&,
                                                        const at::Tensor&) const {
  TORCH_INTERNAL_ASSERT(false,
                        "softmax_grad_from_exp_inplace without accumulate_row_stats_leaving_exp");
}

void CrossEntropyKernels::add_product(at::Tensor& acc, const at::Tensor& a,
                                      const at::Tensor& b) const {
  if (acc.scalar_type() == a.scalar_type()) {
    cpu_addmm_(acc, a, b);
  } else {
    acc.add_(at::mm(a, b));
  }
}

void CrossEntropyKernels::write_product(at::Tensor& out, const at::Tensor& a,
                                        const at::Tensor& b) const {
  if (out.scalar_type() == a.scalar_type()) {
    cpu_mm_out(out, a, b);
  } else {
    // No CPU GEMM returns float32 from float16/bfloat16 operands (it
    // accumulates in float32 inside and rounds its output): one rounding.
    out.copy_(at::mm(a, b));
  }
}

}  // namespace ops
}  // namespace shardtorch
