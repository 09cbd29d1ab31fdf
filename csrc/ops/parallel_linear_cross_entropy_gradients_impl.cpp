// shard::_parallel_linear_cross_entropy_forward_with_gradients: the fused
// loss and its gradients in one call, so that backward only scales them.
#include "ops/parallel_linear_cross_entropy_impl.h"

#include <ATen/ATen.h>
#include <ATen/FunctionalTensorWrapper.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>

#include <algorithm>
#include <vector>

#include "comm/registry.h"
#include "ops/cross_entropy_statistics.h"
#include <shardtorch/ops/parallel_linear_cross_entropy.h>
#include <shardtorch/topology/topology.h>

namespace shardtorch {
namespace ops {
namespace {

constexpr const char* kOp = "shard::_parallel_linear_cross_entropy_forward_with_gradients";

// The classifier's logits, block by block of rows, each block holding all of
// this rank's classes: its statistics are combined over the group (one
// all-gather per block), then the block becomes d loss / d logits in place
// and goes into the input and weight gradients. Three GEMMs per row, none
// recomputed.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> by_row_blocks(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& target, const std::optional<at::Tensor>& class_weight,
    const CrossEntropyOptions& options, const CrossEntropyForwardSetup& setup, int64_t block_rows,
    const std::string& group, std::array<bool, 3> output_mask, const CrossEntropyKernels& kernels) {
  const int64_t rows = setup.target_flat.size(0);
  const int64_t local = weight.size(0), features = weight.size(1);
  const at::Tensor x = gemm_input(input, weight, rows, features);
  const at::Tensor w = weight.contiguous();
  const bool with_bias = bias.has_value() && bias->defined();
  // One block knows the mean's divisor when its coefficients are made; blocks
  // sum their gradients and divide once at the end.
  const bool one_block = block_rows >= rows;
  CrossEntropyOptions coef_options = options;
  if (!one_block) coef_options.reduction = 2;
  const at::Tensor one = at::ones({}, x.options().dtype(at::kDouble));
  const at::Tensor target_flat = target.reshape({rows});

  at::Tensor grad_input, grad_weight, grad_bias;
  if (output_mask[0]) grad_input = at::zeros({rows, features}, x.options().dtype(setup.acc));
  if (output_mask[1]) grad_weight = at::empty_like(w);
  if (output_mask[2] && with_bias) grad_bias = at::zeros({local}, w.options().dtype(setup.acc));
  std::vector<at::Tensor> saved_blocks;
  std::shared_ptr<comm::CommHandle> pending_reduce;
  for (int64_t begin = 0; begin < rows; begin += block_rows) {
    const int64_t count = std::min(block_rows, rows - begin);
    const bool last = begin + count >= rows;
    const CrossEntropyForwardSetup block = rows_of_setup(setup, begin, count);
    const at::Tensor xb = x.narrow(0, begin, count);
    at::Tensor stats = fresh_row_stats(count, block, input.device());
    at::Tensor values;
    if (local > 0 && block.check.code == LocalCheck::kOk) {
      at::Tensor bias_all;
      if (with_bias) bias_all = *bias;
      values = kernels.chunk_logits(xb, w, bias_all, setup.acc);
      kernels.accumulate_row_stats(values, 0, block.target_local, block.weight_local, stats,
                                   at::Tensor());
    }
    saved_blocks.push_back(combine_over_group(block, stats, options, kOp));
    if (values.defined()) {
      const CrossEntropyBackwardSetup coefs = prepare_cross_entropy_backward(
          one, saved_blocks.back(), target_flat.narrow(0, begin, count), class_weight, coef_options,
          local, setup.acc, kOp);
      kernels.softmax_grad_inplace(values, 0, coefs.target_local, coefs.weight_local, coefs.coefs);
      // Summed over the block's rows without a class-sized temporary.
      if (grad_bias.defined()) grad_bias.addmv_(values.t(), at::ones({count}, values.options()));
      // The gradient GEMMs run in the GEMM dtype, the input gradient
      // accumulating in the stats dtype (as the separate backward does).
      if (values.scalar_type() != x.scalar_type()) values = values.to(x.scalar_type());
      if (output_mask[0]) {
        at::Tensor rows_of_grad = grad_input.narrow(0, begin, count);
        kernels.add_product(rows_of_grad, values, w);
      }
    }
    // Each rank's classes contribute a part of the input gradient; the sum
    // travels while the last block's weight gradient is computed.
    if (last && output_mask[0]) {
      pending_reduce =
          comm::communicator_for(group, input.device(), kOp)->all_reduce_async(grad_input);
    }
    if (values.defined() && output_mask[1]) {
      if (begin == 0) {
        at::mm_out(grad_weight, values.t(), xb);  // in place: no weight-sized temporary
      } else {
        grad_weight.addmm_(values.t(), xb);
      }
    }
  }
  if (pending_reduce) pending_reduce->wait();
  at::Tensor saved = join_saved_row_blocks(saved_blocks);
  if (!one_block && options.reduction == 1) {
    const at::Tensor factor = mean_divisor_factor(saved);
    for (at::Tensor* g : {&grad_input, &grad_weight, &grad_bias}) {
      if (g->defined()) g->mul_(factor);
    }
  }
  at::Tensor loss = reduce_loss(saved, target, options, input.scalar_type());
  if (grad_input.defined()) grad_input = grad_input.to(input.scalar_type()).view(input.sizes());
  if (grad_bias.defined()) grad_bias = grad_bias.to(w.scalar_type());
  return {loss, saved, grad_input, grad_weight, grad_bias};
}

}  // namespace

int64_t parallel_linear_cross_entropy_gradient_block_rows(int64_t rows, int64_t max_local_classes,
                                                          int64_t chunk_size) {
  if (rows <= 0) return 0;
  const int64_t budget = std::max(rows * chunk_size, kGradientBlockMinElements);
  const int64_t fit = max_local_classes > 0 ? budget / max_local_classes : rows;
  if (fit >= rows) return rows;
  if (fit < kGradientBlockMinRows) return 0;
  const int64_t blocks = (rows + fit - 1) / fit;
  return (rows + blocks - 1) / blocks;  // blocks of even size
}

bool parallel_linear_cross_entropy_gradients_in_forward(const at::Tensor& weight, int64_t reduction,
                                                        bool any_gradient) {
  const auto type = weight.scalar_type();
  return reduction != 0 && (type == at::kFloat || type == at::kDouble) && any_gradient;
}

at::Tensor parallel_linear_cross_entropy_apply_upstream(const at::Tensor& gradient,
                                                        const at::Tensor& grad_loss,
                                                        bool in_place) {
  TORCH_CHECK(grad_loss.numel() == 1, "shard::parallel_linear_cross_entropy",
              ": the upstream gradient of a reduced loss must be one value, got shape ",
              grad_loss.sizes());
  // loss.backward()'s 1 on CPU, where reading it costs nothing: no pass over
  // a weight-sized gradient. Not while torch.compile traces (the value is
  // not known then).
  const bool traced = c10::impl::TorchDispatchModeTLS::any_modes_set() ||
                      grad_loss.unsafeGetTensorImpl()->is_python_dispatch() ||
                      at::functionalization::impl::isFunctionalTensor(grad_loss);
  if (!traced && grad_loss.is_cpu() && grad_loss.item<double>() == 1.0) return gradient;
  const at::Tensor factor = grad_loss.reshape({});
  return in_place ? gradient.mul_(factor) : gradient.mul(factor);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
parallel_linear_cross_entropy_forward_with_gradients_impl(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& target, const std::optional<at::Tensor>& class_weight,
    const CrossEntropyOptions& options, int64_t chunk_size, const std::string& group,
    std::optional<int64_t> num_classes, std::array<bool, 3> output_mask,
    const CrossEntropyKernels& kernels) {
  check_parallel_linear_cross_entropy_args(input, weight, bias, target, class_weight, options,
                                           chunk_size, kOp);
  TORCH_CHECK(options.reduction != 0, kOp,
              ": needs reduction mean or sum (a scalar loss), got reduction none");
  const int64_t rows = leading_rows(input).guard_int(__FILE__, __LINE__);
  const CrossEntropyForwardSetup setup =
      prepare_cross_entropy_forward(group, input.device(), input.scalar_type(), weight.size(0),
                                    num_classes, target, class_weight, options, kOp);
  // Decided from the largest shard, which every rank knows: all ranks take the
  // same branch and make the same collectives.
  const int64_t ranks = setup.communicator->size();
  const int64_t block_rows = parallel_linear_cross_entropy_gradient_block_rows(
      rows, topology::shard_size(setup.layout.num_classes, ranks, 0), chunk_size);
  if (block_rows > 0) {
    return by_row_blocks(input, weight, bias, target, class_weight, options, setup, block_rows,
                         group, output_mask, kernels);
  }
  // Too many classes for a block of rows within the memory bound: the logits
  // are computed twice, chunk by chunk, as the separate backward would.
  auto [loss, saved] = linear_cross_entropy_forward_by_chunks(input, weight, bias, target, options,
                                                              setup, chunk_size, kernels, kOp);
  auto [grad_input, grad_weight, grad_bias] = parallel_linear_cross_entropy_backward_impl(
      at::ones({}, input.options().dtype(at::kDouble)), input, weight, bias, saved, target,
      class_weight, options, chunk_size, group, output_mask, kernels);
  return {loss, saved, grad_input, grad_weight, grad_bias};
}

}  // namespace ops
}  // namespace shardtorch
