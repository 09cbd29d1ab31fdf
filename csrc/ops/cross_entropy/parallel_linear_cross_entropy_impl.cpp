// shard::parallel_linear_cross_entropy's head for the fused-head driver
// (fused_head_driver.h): logits x w^T + b of this rank's shard.
#include "ops/cross_entropy/parallel_linear_cross_entropy_impl.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <any>

#include "ops/cross_entropy/cross_entropy_statistics.h"
#include "ops/recycled_buffers.h"
#include "ops/scratch_buffer.h"
#include "ops/cross_entropy/fused_head_driver.h"
#include "ops/cross_entropy/gemm_precision.h"
#include <shardtorch/ops/parallel_linear_cross_entropy.h>
#include <shardtorch/topology/topology.h>

namespace shardtorch {
namespace ops {
namespace {

constexpr const char* kFusedForward = "shard::parallel_linear_cross_entropy";
constexpr const char* kFusedBackward = "shard::_parallel_linear_cross_entropy_backward";
constexpr const char* kFusedWithGradients =
    "shard::_parallel_linear_cross_entropy_forward_with_gradients";

// Under autocast, the weight's columns [begin, begin + width) cast to the
// GEMM dtype, kept from the logits for the input gradient.
struct CastColumns {
  int64_t begin;
  at::Tensor weight;
};

class LinearHead final : public FusedHead {
 public:
  LinearHead(const at::Tensor& input, const at::Tensor& weight,
             const std::optional<at::Tensor>& bias, int64_t rows, at::ScalarType acc,
             int64_t chunk_size, const CrossEntropyKernels& kernels)
      : gemm_(fused_head_gemm_dtype(weight.scalar_type())),
        x_(gemm_ ? input.reshape({rows, weight.size(1)}).to(*gemm_).contiguous()
                 : gemm_input(input, weight, rows, weight.size(1))),
        w_(weight.contiguous()),
        acc_(acc),
        chunk_size_(chunk_size),
        kernels_(kernels) {
    if (bias.has_value() && bias->defined()) bias_ = *bias;
  }
  int64_t columns() const override { return w_.size(0); }
  const at::Tensor& x_rows() const override { return x_; }
  at::TensorOptions weight_options() const override { return w_.options(); }
  bool has_bias() const override { return bias_.defined(); }

  // In the stats dtype; the GEMM runs in x's dtype (float16/bfloat16
  // accumulate in float32). Under autocast the float32 weight's columns are
  // cast to it chunk_size at a time: a chunk's cast is kept for the input
  // gradient, a wider range's (a block of rows holding every column) is
  // made again there, so that no copy of the weight's size lives.
  LogitChunk logits(const at::Tensor& x, int64_t begin, int64_t width,
                    const at::Tensor&) const override {
    at::Tensor bias_chunk;
    if (bias_.defined()) bias_chunk = bias_.narrow(0, begin, width);
    if (!gemm_) return {kernels_.chunk_logits(x, w_.narrow(0, begin, width), bias_chunk, acc_), {}};
    LogitChunk chunk;
    if (width <= chunk_size_) {
      at::Tensor w_gemm = w_.narrow(0, begin, width).to(*gemm_);
      chunk = {kernels_.chunk_logits(x, w_gemm, at::Tensor(), acc_), CastColumns{begin, w_gemm}};
    } else {
      static BufferSlot* const slot = new BufferSlot();
      chunk.values = slot->take({x.size(0), width}, x.options().dtype(acc_), empty_scratch_buffer);
      for (int64_t c = 0; c < width; c += chunk_size_) {
        const int64_t w = std::min(chunk_size_, width - c);
        at::Tensor part = chunk.values.narrow(1, c, w);  // written in place, no temporary
        kernels_.chunk_logits_into(part, x, cast_columns(begin + c, w));
      }
    }
    if (bias_chunk.defined()) chunk.values.add_(bias_chunk);  // the bias in float32
    return chunk;
  }
  void logit_gradient(LogitChunk&, int64_t, int64_t, const at::Tensor&) const override {}
  void add_input_gradient(at::Tensor& grad_x, const at::Tensor& grad, int64_t begin, int64_t width,
                          const LogitChunk& chunk) const override {
    at::Tensor w;
    if (const auto* kept = std::any_cast<CastColumns>(&chunk.state)) {
      w = kept->weight.narrow(0, begin - kept->begin, width);
    } else {
      w = gemm_ ? cast_columns(begin, width) : w_.narrow(0, begin, width);
    }
    kernels_.add_product(grad_x, grad, w);
  }

 private:
  at::Tensor cast_columns(int64_t begin, int64_t width) const {
    return w_.narrow(0, begin, width).to(*gemm_);
  }

  std::optional<at::ScalarType> gemm_;  // the autocast GEMM dtype, if any
  at::Tensor x_, w_, bias_;
  at::ScalarType acc_;
  int64_t chunk_size_;
  const CrossEntropyKernels& kernels_;
};

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
  const LinearHead head(input, weight, bias, setup.target_local.size(0), setup.acc, chunk_size,
                        kernels);
  return fused_head_forward_by_chunks(head, input, target, options, setup, chunk_size, kernels,
                                      kFusedForward);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> parallel_linear_cross_entropy_backward_impl(
    const at::Tensor& grad_loss, const at::Tensor& input, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& row_stats, const at::Tensor& target,
    const std::optional<at::Tensor>& class_weight, const CrossEntropyOptions& options,
    int64_t chunk_size, const std::string& group, std::array<bool, 3> output_mask,
    const CrossEntropyKernels& kernels) {
  TORCH_CHECK(chunk_size >= 1, kFusedBackward, ": chunk_size must be >= 1, got ", chunk_size);
  const int64_t rows = leading_rows(input).guard_int(__FILE__, __LINE__);
  check_saved_row_stats(row_stats, rows, kFusedBackward);
  const at::ScalarType acc = cross_entropy_accumulate_type(input.scalar_type());
  const LinearHead head(input, weight, bias, rows, acc, chunk_size, kernels);
  const FusedHeadResult grads = fused_head_backward_by_chunks(
      head, input,
      prepare_cross_entropy_backward(grad_loss, row_stats, target, class_weight, options,
                                     weight.size(0), acc, kFusedBackward),
      chunk_size, group, output_mask, kernels, kFusedBackward);
  return {grads.grad_input, grads.grad_weight, grads.grad_bias};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
parallel_linear_cross_entropy_forward_with_gradients_impl(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& target, const std::optional<at::Tensor>& class_weight,
    const CrossEntropyOptions& options, int64_t chunk_size, const std::string& group,
    std::optional<int64_t> num_classes, std::array<bool, 3> output_mask,
    const CrossEntropyKernels& kernels) {
  check_parallel_linear_cross_entropy_args(input, weight, bias, target, class_weight, options,
                                           chunk_size, kFusedWithGradients);
  TORCH_CHECK(options.reduction != 0, kFusedWithGradients,
              ": needs reduction mean or sum (a scalar loss), got reduction none");
  const CrossEntropyForwardSetup setup = prepare_cross_entropy_forward(
      group, input.device(), input.scalar_type(), weight.size(0), num_classes, target, class_weight,
      options, kFusedWithGradients);
  const LinearHead head(input, weight, bias, setup.target_local.size(0), setup.acc, chunk_size,
                        kernels);
  // The largest shard, which every rank knows.
  const int64_t max_columns =
      topology::shard_size(setup.layout.num_classes, setup.communicator->size(), 0);
  const FusedHeadResult out = fused_head_forward_with_gradients(
      head, input, target, options, setup, max_columns, chunk_size, group, output_mask, kernels,
      kFusedWithGradients, [&](const at::Tensor& grad_loss, const at::Tensor& row_stats) {
        // A probability target: this rank's columns, already at hand (no copy).
        const at::Tensor& local_target = setup.probability_target ? setup.target_probs : target;
        return prepare_cross_entropy_backward(grad_loss, row_stats, local_target, class_weight,
                                              options, weight.size(0), setup.acc,
                                              kFusedWithGradients);
      });
  return {out.loss, out.row_stats, out.grad_input, out.grad_weight, out.grad_bias};
}

}  // namespace ops
}  // namespace shardtorch
