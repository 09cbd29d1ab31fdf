#include "ops/parallel_linear_cross_entropy_impl.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "comm/registry.h"
#include "ops/cross_entropy_statistics.h"

namespace shardtorch {
namespace ops {
namespace {

constexpr const char* kFusedForward = "shard::parallel_linear_cross_entropy";
constexpr const char* kFusedBackward = "shard::_parallel_linear_cross_entropy_backward";

// Logits of classes [begin, begin + width) of this rank's shard, in the
// stats dtype `acc`; the GEMM runs in x's and w's dtype (float16/bfloat16
// accumulate in float32).
at::Tensor chunk_logits(const CrossEntropyKernels& kernels, const at::Tensor& x,
                        const at::Tensor& w, const std::optional<at::Tensor>& bias, int64_t begin,
                        int64_t width, at::ScalarType acc) {
  at::Tensor bias_chunk;
  if (bias.has_value() && bias->defined()) bias_chunk = bias->narrow(0, begin, width);
  return kernels.chunk_logits(x, w.narrow(0, begin, width), bias_chunk, acc);
}

}  // namespace

at::Tensor gemm_input(const at::Tensor& input, const at::Tensor& weight, int64_t rows,
                      int64_t features) {
  return input.reshape({rows, features}).to(weight.scalar_type()).contiguous();
}

std::tuple<at::Tensor, at::Tensor> parallel_linear_cross_entropy_forward_impl(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& target, const std::optional<at::Tensor>& class_weight,
    const CrossEntropyOptions& options, int64_t chunk_size, const std::string& group,
    std::optional<int64_t> num_classes, const CrossEntropyKernels& kernels) {
  check_parallel_linear_cross_entropy_args(input, weight, bias, target, class_weight, options,
                                           chunk_size, kFusedForward);
  const CrossEntropyForwardSetup setup =
      prepare_cross_entropy_forward(group, input.device(), input.scalar_type(), weight.size(0),
                                    num_classes, target, class_weight, options, kFusedForward);
  return linear_cross_entropy_forward_by_chunks(input, weight, bias, target, options, setup,
                                                chunk_size, kernels, kFusedForward);
}

std::tuple<at::Tensor, at::Tensor> linear_cross_entropy_forward_by_chunks(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& target, const CrossEntropyOptions& options,
    const CrossEntropyForwardSetup& setup, int64_t chunk_size, const CrossEntropyKernels& kernels,
    const char* op) {
  const int64_t rows = setup.target_flat.size(0);
  const int64_t local = weight.size(0), features = weight.size(1);
  const at::Tensor x = gemm_input(input, weight, rows, features);
  const at::Tensor w = weight.contiguous();
  at::Tensor stats = fresh_row_stats(rows, setup, input.device());
  // Only one chunk of logits lives at a time.
  for (int64_t begin = 0; setup.check.code == LocalCheck::kOk && begin < local;
       begin += chunk_size) {
    const int64_t width = std::min(chunk_size, local - begin);
    kernels.accumulate_row_stats(chunk_logits(kernels, x, w, bias, begin, width, setup.acc), begin,
                                 setup.target_local, setup.weight_local, stats, at::Tensor());
  }
  at::Tensor saved = combine_over_group(setup, stats, options, op);
  at::Tensor loss = reduce_loss(saved, target, options, input.scalar_type());
  return {loss, saved};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> parallel_linear_cross_entropy_backward_impl(
    const at::Tensor& grad_loss, const at::Tensor& input, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& row_stats, const at::Tensor& target,
    const std::optional<at::Tensor>& class_weight, const CrossEntropyOptions& options,
    int64_t chunk_size, const std::string& group, std::array<bool, 3> output_mask,
    const CrossEntropyKernels& kernels) {
  TORCH_CHECK(chunk_size >= 1, kFusedBackward, ": chunk_size must be >= 1, got ", chunk_size);
  const int64_t rows = leading_rows(input).guard_int(__FILE__, __LINE__);
  const int64_t local = weight.size(0), features = weight.size(1);
  check_saved_row_stats(row_stats, rows, kFusedBackward);
  const at::ScalarType acc = cross_entropy_accumulate_type(input.scalar_type());
  const CrossEntropyBackwardSetup setup = prepare_cross_entropy_backward(
      grad_loss, row_stats, target, class_weight, options, local, acc, kFusedBackward);

  const at::Tensor x = gemm_input(input, weight, rows, features);
  const at::Tensor w = weight.contiguous();
  // The input gradient is summed over chunks in the stats dtype, so that
  // reduced-precision inputs do not lose the small chunks' contributions.
  at::Tensor grad_input_acc, grad_weight, grad_bias;
  if (output_mask[0]) grad_input_acc = at::zeros({rows, features}, x.options().dtype(acc));
  if (output_mask[1]) grad_weight = at::empty_like(w);
  if (output_mask[2] && bias.has_value() && bias->defined()) {
    grad_bias = at::empty({local}, w.options());
  }
  std::shared_ptr<comm::CommHandle> pending_reduce;
  for (int64_t begin = 0; begin < local || (begin == 0 && output_mask[0]); begin += chunk_size) {
    const int64_t width = std::min(chunk_size, local - begin);
    const bool last = begin + chunk_size >= local;
    at::Tensor chunk_acc = chunk_logits(kernels, x, w, bias, begin, width, acc);
    kernels.softmax_grad_inplace(chunk_acc, begin, setup.target_local, setup.weight_local,
                                 setup.coefs);
    // The gradient GEMMs run in the forward's GEMM dtype (tensor cores for
    // float16/bfloat16), the input gradient accumulating in float32.
    const at::Tensor chunk =
        chunk_acc.scalar_type() == x.scalar_type() ? chunk_acc : chunk_acc.to(x.scalar_type());
    if (output_mask[0]) {
      kernels.add_product(grad_input_acc, chunk, w.narrow(0, begin, width));
      // Each rank's classes contribute a part of the input gradient; the sum
      // travels while the last chunk's weight gradient is computed.
      if (last) {
        pending_reduce = comm::communicator_for(group, input.device(), kFusedBackward)
                             ->all_reduce_async(grad_input_acc);
      }
    }
    // Written in place: a row slice of the contiguous gradient is contiguous,
    // so no chunk-sized temporary is needed.
    if (output_mask[1]) {
      at::Tensor rows_of_grad = grad_weight.narrow(0, begin, width);
      at::mm_out(rows_of_grad, chunk.t(), x);
    }
    if (grad_bias.defined()) grad_bias.narrow(0, begin, width).copy_(chunk_acc.sum(0));
  }
  at::Tensor grad_input;
  if (output_mask[0]) {
    pending_reduce->wait();
    grad_input = grad_input_acc.to(input.scalar_type()).view(input.sizes());
  }
  return {grad_input, grad_weight, grad_bias};
}

}  // namespace ops
}  // namespace shardtorch
