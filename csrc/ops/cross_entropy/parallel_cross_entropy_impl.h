#pragma once
// shard::parallel_cross_entropy's forward and backward on one device, given
// that device's row kernels (cross_entropy_kernels.h). The CPU and CUDA
// registrations (cross_entropy_kernel_adapter.h) call these.

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <tuple>

#include "ops/cross_entropy/cross_entropy_checks.h"
#include "ops/cross_entropy/cross_entropy_kernels.h"

namespace shardtorch {
namespace ops {

// -> (loss, logits_buffer, row_stats); see parallel_cross_entropy.h.
std::tuple<at::Tensor, at::Tensor, at::Tensor> parallel_cross_entropy_forward_impl(
    const at::Tensor& logits, const at::Tensor& target, const std::optional<at::Tensor>& weight,
    const CrossEntropyOptions& options, const std::string& group,
    std::optional<int64_t> num_classes, const CrossEntropyKernels& kernels);

// Turns logits_buffer into d loss / d logits in place.
void parallel_cross_entropy_backward_impl(const at::Tensor& grad_loss,
                                          const at::Tensor& logits_buffer,
                                          const at::Tensor& row_stats, const at::Tensor& target,
                                          const std::optional<at::Tensor>& weight,
                                          const CrossEntropyOptions& options,
                                          const CrossEntropyKernels& kernels);

}  // namespace ops
}  // namespace shardtorch
