#include "ops/cross_entropy/fused_head_driver.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "comm/registry.h"
#include "ops/recycled_buffers.h"
#include "ops/scratch_buffer.h"

namespace shardtorch {
namespace ops {
namespace {

// The targets' part of a tile, the same for every head: the per-row
// statistics of a tile's logits, and d loss / d logits in place from the
// coefficients. A target given as class probabilities (probability_target.h)
// is setup.target_probs / `probs`, this rank's columns of the tile's rows,
// which the kernels fold into the same passes; else undefined.
void add_row_statistics(const CrossEntropyKernels& kernels, const at::Tensor& logits, int64_t begin,
                        const CrossEntropyForwardSetup& setup, const at::Tensor& stats) {
  kernels.accumulate_row_stats(logits, begin, setup.target_local, setup.target_probs,
                               setup.weight_local, stats, at::Tensor());
}

// add_row_statistics for a block of rows holding every column, into fresh
// stats: where the kernels can, each logit is left as its exp(x - row max),
// so that softmax_gradient (given `stats`) needs no exp. Whether it was.
bool add_block_statistics(const CrossEntropyKernels& kernels, const at::Tensor& logits,
                          const CrossEntropyForwardSetup& setup, const at::Tensor& stats) {
  if (kernels.accumulate_row_stats_leaving_exp(logits, setup.target_local, setup.target_probs,
                                               setup.weight_local, stats)) {
    return true;
  }
  add_row_statistics(kernels, logits, 0, setup, stats);
  return false;
}

// d loss / d logits in place; `exp_stats`: the values are what
// add_block_statistics left, and these its stats, else undefined.
void softmax_gradient(const CrossEntropyKernels& kernels, const at::Tensor& values, int64_t begin,
                      const at::Tensor& target_local, const at::Tensor& weight_local,
                      const at::Tensor& probs, const at::Tensor& coefs,
                      const at::Tensor& exp_stats = at::Tensor()) {
  if (exp_stats.defined()) {
    kernels.softmax_grad_from_exp_inplace(values, target_local, probs, weight_local, coefs,
                                          exp_stats);
  } else {
    kernels.softmax_grad_inplace(values, begin, target_local, probs, weight_local, coefs);
  }
}

// The gradients of one tile (rows of `x`, columns [begin, begin + width)),
// into rows [row_begin, row_begin + rows) of the input gradient and columns
// [begin, begin + width) of the weight and bias gradients. `first_rows`: the
// tile is the first to write its columns' weight gradient; `last_rows`: the
// last, which then finishes them (FusedHead::finish_weight_rows) right after
// its GEMM wrote them: where the gradient is cast a slice at a time
// (autocast), each slice while it is still in cache.
class TileGradients {
 public:
  TileGradients(const FusedHead& head, const at::Tensor& input, const at::ScalarType acc,
                std::array<bool, 3> output_mask, int64_t slice, const std::string& group,
                const CrossEntropyKernels& kernels, const char* op)
      : head_(head), input_(input), slice_(slice), group_(group), kernels_(kernels), op_(op) {
    const int64_t rows = head.x_rows().size(0), features = head.x_rows().size(1);
    const int64_t columns = head.columns();
    // The input gradient is summed over tiles in the stats dtype, so that
    // reduced-precision inputs do not lose small tiles' contributions.
    if (output_mask[0]) {
      grads_.input = at::zeros({rows, features}, head.x_rows().options().dtype(acc));
    }
    if (output_mask[1]) {
      // Written whole by the first rows' GEMMs; the caller keeps it
      // (scratch_buffer.h), and the call after takes it again once the
      // caller has let go of it (recycled_buffers.h).
      static BufferSlot* const slot = new BufferSlot();
      grads_.weight = slot->take({columns, features}, head.weight_options(), empty_prefaulted);
    }
    if (output_mask[2] && head.has_bias()) {
      grads_.bias = at::zeros({columns}, head.weight_options().dtype(acc));
    }
  }

  FusedHeadGradients& gradients() { return grads_; }

  void add(LogitChunk& chunk, const at::Tensor& x, int64_t row_begin, int64_t begin, int64_t width,
           const at::Tensor& target_local, bool first_rows, bool last_rows, bool last_tile) {
    head_.logit_gradient(chunk, begin, width, target_local);
    if (grads_.bias.defined()) {
      at::Tensor bias_rows = grads_.bias.narrow(0, begin, width);
      if (first_rows) {
        at::sum_out(bias_rows, chunk.values, at::IntArrayRef{0});
      } else {
        bias_rows.add_(chunk.values.sum(0));
      }
    }
    at::Tensor grad_x;
    if (grads_.input.defined()) grad_x = grads_.input.narrow(0, row_begin, x.size(0));
    if (chunk.values.scalar_type() == x.scalar_type()) {
      if (grad_x.defined()) head_.add_input_gradient(grad_x, chunk.values, begin, width, chunk);
      // Each rank's columns contribute a part of the input gradient, whole
      // after the last tile's GEMM: its sum over the ranks travels during the
      // weight gradient's GEMM, where the ranks' uneven pace is absorbed
      // instead of waited for.
      if (last_tile) join_input_sum();
      add_weight_product(&chunk, chunk.values, x, begin, width, first_rows, last_rows);
    } else {
      // The GEMMs run in the head's GEMM dtype (tensor cores for float16 /
      // bfloat16): the gradient is cast slice_ columns at a time, so that
      // neither its copy nor the CPU GEMM's reduced-precision output of the
      // weight gradient's rows grows with the block.
      for (int64_t c = 0; c < width; c += slice_) {
        const int64_t w = std::min(slice_, width - c);
        const at::Tensor grad = chunk.values.narrow(1, c, w).to(x.scalar_type());
        if (grad_x.defined()) head_.add_input_gradient(grad_x, grad, begin + c, w, chunk);
        if (last_tile && c + w >= width) join_input_sum();  // as above
        add_weight_product(w == width ? &chunk : nullptr, grad, x, begin + c, w, first_rows,
                           last_rows);
      }
    }
  }

  // Every rank joins the input gradient's sum once, with columns or without.
  void join_input_sum() {
    if (grads_.input.defined() && !pending_) {
      pending_ =
          comm::communicator_for(group_, input_.device(), op_)->all_reduce_async(grads_.input);
    }
  }

  // Waits for the sum, finishes the input gradient, and scales every
  // gradient by `factor` (0-d, or undefined for none) before the casts.
  FusedHeadResult finish(const at::Tensor& factor) {
    join_input_sum();
    if (pending_) pending_->wait();
    if (grads_.input.defined()) head_.finish_input(grads_.input);
    FusedHeadResult out;
    for (at::Tensor* g : {&grads_.input, &grads_.weight, &grads_.bias}) {
      if (factor.defined() && g->defined()) g->mul_(factor);
    }
    if (grads_.input.defined()) {
      out.grad_input = grads_.input.to(input_.scalar_type()).view(input_.sizes());
    }
    out.grad_weight = grads_.weight;
    if (grads_.bias.defined()) {
      out.grad_bias = grads_.bias.to(c10::typeMetaToScalarType(head_.weight_options().dtype()));
    }
    return out;
  }

 private:
  // The weight gradient's rows of columns [begin, begin + width) = (or +=)
  // grad^T x, written in place (a row slice of the contiguous gradient is
  // contiguous: no temporary of the weight's size), then finished if these
  // are the last rows (`whole`: the tile's logits where they are these
  // columns' exactly, else null).
  void add_weight_product(const LogitChunk* whole, const at::Tensor& grad, const at::Tensor& x,
                          int64_t begin, int64_t width, bool first_rows, bool last_rows) {
    if (!grads_.weight.defined()) return;
    at::Tensor rows_of_grad = grads_.weight.narrow(0, begin, width);
    write_weight_product(rows_of_grad, grad, x, first_rows);
    if (last_rows) head_.finish_weight_rows(rows_of_grad, begin, width, whole);
  }

  // Reduced-precision GEMM operands (autocast) go into the float32 master
  // weight's gradient too: the kernels' products accumulate in float32.
  void write_weight_product(at::Tensor& rows_of_grad, const at::Tensor& grad, const at::Tensor& x,
                            bool first_rows) {
    if (first_rows) {
      kernels_.write_product(rows_of_grad, grad.t(), x);
    } else {
      kernels_.add_product(rows_of_grad, grad.t(), x);
    }
  }

  const FusedHead& head_;
  const at::Tensor& input_;
  int64_t slice_;  // columns per cast of a reduced-precision gradient
  const std::string& group_;
  const CrossEntropyKernels& kernels_;
  const char* op_;
  FusedHeadGradients grads_;
  std::shared_ptr<comm::CommHandle> pending_;
};

// Blocks of rows, each holding all of this rank's columns: a block's
// statistics are combined over the group (one all-gather per block), then
// its logits become their gradient in place and go into the input and weight
// gradients. Three GEMMs per row, none recomputed, and one exp per logit
// where the kernels can (add_block_statistics).
FusedHeadResult by_row_blocks(const FusedHead& head, const at::Tensor& input,
                              const at::Tensor& target, const CrossEntropyOptions& options,
                              const CrossEntropyForwardSetup& setup, int64_t block_rows,
                              int64_t chunk_size, const std::string& group,
                              std::array<bool, 3> output_mask, const CrossEntropyKernels& kernels,
                              const char* op) {
  const int64_t rows = setup.target_local.size(0), columns = head.columns();
  const at::Tensor& x = head.x_rows();
  // One block knows the mean's divisor when its coefficients are made; blocks
  // sum their gradients and divide once at the end.
  const bool one_block = block_rows >= rows;
  CrossEntropyOptions coef_options = options;
  if (!one_block) coef_options.reduction = 2;
  const at::Tensor one = at::ones({}, x.options().dtype(at::kDouble));
  const bool compute = columns > 0 && setup.check.code == LocalCheck::kOk;

  TileGradients tiles(head, input, setup.acc, output_mask, chunk_size, group, kernels, op);
  std::vector<at::Tensor> saved_blocks;
  for (int64_t begin = 0; begin < rows; begin += block_rows) {
    const int64_t count = std::min(block_rows, rows - begin);
    const CrossEntropyForwardSetup block = rows_of_setup(setup, begin, count);
    const at::Tensor xb = x.narrow(0, begin, count);
    at::Tensor stats = fresh_row_stats(count, block, input.device());
    LogitChunk chunk;
    bool exp_left = false;
    if (compute) {
      chunk = head.logits(xb, 0, columns, block.target_local);
      exp_left = add_block_statistics(kernels, chunk.values, block, stats);
    }
    // Every block carries the whole batch's checks: the first's verdict raises them.
    saved_blocks.push_back(
        combine_over_group(block, stats, options, op, /*give_verdict=*/begin == 0));
    if (compute) {
      // A probability target's block is already this rank's columns (no copy).
      const at::Tensor block_target =
          setup.probability_target ? block.target_probs : block.target_flat;
      const at::Tensor coefs =
          prepare_cross_entropy_backward(one, saved_blocks.back(), block_target, std::nullopt,
                                         coef_options, columns, setup.acc, op)
              .coefs;
      softmax_gradient(kernels, chunk.values, 0, block.target_local, block.weight_local,
                       block.target_probs, coefs, exp_left ? stats : at::Tensor());
      const bool last_block = begin + count >= rows;
      tiles.add(chunk, xb, begin, 0, columns, block.target_local, begin == 0, last_block,
                last_block);
    }
  }
  tiles.join_input_sum();
  at::Tensor saved = join_saved_row_blocks(saved_blocks);
  at::Tensor factor;
  if (!one_block && options.reduction == 1) factor = mean_divisor_factor(saved);
  FusedHeadResult out = tiles.finish(factor);
  out.loss = reduce_loss(saved, target, options, input.scalar_type());
  out.row_stats = saved;
  return out;
}

}  // namespace

int64_t fused_head_gradient_block_rows(int64_t rows, int64_t max_columns, int64_t features,
                                       int64_t chunk_size) {
  if (rows <= 0) return 0;
  int64_t fit = rows;
  if (max_columns > 0) {
    fit = std::max(rows * chunk_size, kGradientBlockMinElements) / max_columns;
    // Blocks that thin would have the logits computed twice: a block may
    // then hold as many logits as the weight gradient has values.
    if (fit < std::min(rows, kGradientBlockMinRows)) fit = std::max(fit, features);
  }
  if (fit >= rows) return rows;
  if (fit < kGradientBlockMinRows) return 0;
  const int64_t blocks = (rows + fit - 1) / fit;
  return (rows + blocks - 1) / blocks;  // blocks of even size
}

std::tuple<at::Tensor, at::Tensor> fused_head_forward_by_chunks(
    const FusedHead& head, const at::Tensor& input, const at::Tensor& target,
    const CrossEntropyOptions& options, const CrossEntropyForwardSetup& setup, int64_t chunk_size,
    const CrossEntropyKernels& kernels, const char* op) {
  const int64_t rows = setup.target_local.size(0), columns = head.columns();
  at::Tensor stats = fresh_row_stats(rows, setup, input.device());
  for (int64_t begin = 0; setup.check.code == LocalCheck::kOk && begin < columns;
       begin += chunk_size) {
    const int64_t width = std::min(chunk_size, columns - begin);
    const LogitChunk chunk = head.logits(head.x_rows(), begin, width, setup.target_local);
    add_row_statistics(kernels, chunk.values, begin, setup, stats);
  }
  at::Tensor saved = combine_over_group(setup, stats, options, op);
  at::Tensor loss = reduce_loss(saved, target, options, input.scalar_type());
  return {loss, saved};
}

FusedHeadResult fused_head_backward_by_chunks(const FusedHead& head, const at::Tensor& input,
                                              const CrossEntropyBackwardSetup& setup,
                                              int64_t chunk_size, const std::string& group,
                                              std::array<bool, 3> output_mask,
                                              const CrossEntropyKernels& kernels, const char* op) {
  const int64_t columns = head.columns();
  const at::Tensor& x = head.x_rows();
  TileGradients tiles(head, input, cross_entropy_accumulate_type(input.scalar_type()), output_mask,
                      chunk_size, group, kernels, op);
  for (int64_t begin = 0; begin < columns; begin += chunk_size) {
    const int64_t width = std::min(chunk_size, columns - begin);
    LogitChunk chunk = head.logits(x, begin, width, setup.target_local);
    softmax_gradient(kernels, chunk.values, begin, setup.target_local, setup.weight_local,
                     setup.target_probs, setup.coefs);
    tiles.add(chunk, x, 0, begin, width, setup.target_local, /*first_rows=*/true,
              /*last_rows=*/true, begin + chunk_size >= columns);
  }
  return tiles.finish(at::Tensor());
}

FusedHeadResult fused_head_forward_with_gradients(
    const FusedHead& head, const at::Tensor& input, const at::Tensor& target,
    const CrossEntropyOptions& options, const CrossEntropyForwardSetup& setup, int64_t max_columns,
    int64_t chunk_size, const std::string& group, std::array<bool, 3> output_mask,
    const CrossEntropyKernels& kernels, const char* op,
    const std::function<CrossEntropyBackwardSetup(const at::Tensor& grad_loss,
                                                  const at::Tensor& row_stats)>& backward_setup) {
  const int64_t rows = setup.target_local.size(0);
  const int64_t block_rows =
      fused_head_gradient_block_rows(rows, max_columns, head.x_rows().size(1), chunk_size);
  FusedHeadResult out;
  if (block_rows > 0) {
    out = by_row_blocks(head, input, target, options, setup, block_rows, chunk_size, group,
                        output_mask, kernels, op);
  } else {
    // Too many columns for a block of rows within the memory bound: the
    // logits are computed twice, chunk by chunk, as the separate backward would.
    auto [loss, saved] =
        fused_head_forward_by_chunks(head, input, target, options, setup, chunk_size, kernels, op);
    out = fused_head_backward_by_chunks(
        head, input, backward_setup(at::ones({}, input.options().dtype(at::kDouble)), saved),
        chunk_size, group, output_mask, kernels, op);
    out.loss = loss;
    out.row_stats = saved;
  }
  // This op made collectives after the one that carried its checks (blocks,
  // the input gradient's sum). Where a rank raised a check alone there, they
  // wait for it in vain, and so would a host sync on this op's results
  // (loss.item()): the communicator's watchdog reads that verdict as soon as
  // its copy is on the host and aborts (comm/deferred_checks.h, poll), so the
  // op returns without waiting for the device, and the host runs on into
  // backward.
  return out;
}

}  // namespace ops
}  // namespace shardtorch
