#pragma once
// The machinery shared by the fused classifier heads (the plain linear
// cross-entropy and the margin loss): the forward by chunks of classes, the
// backward by chunks, the gradients in forward by blocks of rows, and the
// choice between the last two. A head says how its logits are made from the
// input rows and a range of its columns and how their gradient flows back
// (FusedHead); the driver owns the statistics, the collectives and their
// order, so that every head makes the same ones on every rank.

#include <ATen/core/Tensor.h>

#include <any>
#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <tuple>

#include "ops/cross_entropy/cross_entropy_kernels.h"
#include "ops/cross_entropy/cross_entropy_statistics.h"

namespace shardtorch {
namespace ops {

// The gradients-in-forward path's bound on a block of logits: rows x
// chunk_size elements, or this many (16 MiB of float32) where that is more,
// so that small batches are not cut into blocks too thin for a fast GEMM...
constexpr int64_t kGradientBlockMinElements = int64_t{1} << 22;
// ...and no block has fewer rows than this (unless the batch has). Where the
// bound would make blocks thinner, a block may hold as many logits as the
// weight gradient the call returns anyway (in_features rows of all columns),
// so that at a million classes the logits are still computed once; only
// below 128 features are they then recomputed. Thinner blocks cost more than
// the recomputation saves, the weight gradient being summed over every block
// (measured on CPU, 1024 rows x 256 features: blocks of 209 rows 0.80 of the
// recomputing step, 131 rows 0.89, 104 rows 0.94, 83 rows 1.03).
constexpr int64_t kGradientBlockMinRows = 128;

// Rows per block of the gradients-in-forward path for a batch of `rows` and
// at most `max_columns` columns of `features` on any rank, or 0 where blocks
// would be thinner than kGradientBlockMinRows (the logits are then
// recomputed). Every rank must pass the same values.
int64_t fused_head_gradient_block_rows(int64_t rows, int64_t max_columns, int64_t features,
                                       int64_t chunk_size);

// Logits of some columns for some rows, as a head made them; in place, their
// gradient after the driver's softmax step and the head's logit_gradient.
struct LogitChunk {
  at::Tensor values;  // [rows, width]
  std::any state;     // what the head keeps of these columns for their gradient
};

// The gradients the driver accumulates for a head: `input` [rows, features]
// in the stats dtype (summed over ranks), `weight` [columns, features] in the
// weight's dtype, `bias` [columns] in the stats dtype; each undefined where
// not asked for.
struct FusedHeadGradients {
  at::Tensor input, weight, bias;
};

// One fused head over this rank's columns (its classes in the loss: its shard,
// or the classes it keeps). Column ranges may be of any width: the driver
// asks for at most chunk_size columns when it recomputes, for all of them
// when a block of rows holds every column; a head that needs smaller pieces
// (temporaries the size of its columns) makes them itself.
class FusedHead {
 public:
  virtual ~FusedHead() = default;
  // Columns this rank brings to the loss.
  virtual int64_t columns() const = 0;
  // The input rows as the head's GEMMs take them, [rows, features]; the
  // weight gradient is grad^T x_rows in this dtype.
  virtual const at::Tensor& x_rows() const = 0;
  // The rows of the weight gradient's tensor: [columns, features] options.
  virtual at::TensorOptions weight_options() const = 0;
  virtual bool has_bias() const { return false; }
  // Logits of `x` (rows of x_rows()) for columns [begin, begin + width):
  // `target_local` [rows] holds each row's target column (-1 where not here).
  virtual LogitChunk logits(const at::Tensor& x, int64_t begin, int64_t width,
                            const at::Tensor& target_local) const = 0;
  // In place: d loss / d logits -> d loss / d the GEMM's output (plain:
  // nothing; margin: the target's slope and the scale).
  virtual void logit_gradient(LogitChunk& chunk, int64_t begin, int64_t width,
                              const at::Tensor& target_local) const = 0;
  // grad_x [rows, features] (stats dtype) += grad [rows, width] times the
  // head's weight operand of columns [begin, begin + width): the chunk's
  // whole range, or, where the GEMM dtype differs from the logits' (autocast)
  // and the chunk is wider than chunk_size, consecutive pieces of it of at
  // most chunk_size columns.
  virtual void add_input_gradient(at::Tensor& grad_x, const at::Tensor& grad, int64_t begin,
                                  int64_t width, const LogitChunk& chunk) const = 0;
  // After the weight gradient of columns [begin, begin + width) is whole:
  // its rows as the weight's (margin: the normalisation's backward). `chunk`
  // is those columns' logits where still at hand, else null.
  virtual void finish_weight_rows(at::Tensor& grad_rows, int64_t begin, int64_t width,
                                  const LogitChunk* chunk) const {}
  // After the input gradient is summed over ranks (margin: the
  // normalisation's backward).
  virtual void finish_input(at::Tensor& grad_x) const {}
};

// The gradients as the op returns them: grad_input in the input's dtype and
// shape, grad_bias in the weight's dtype.
struct FusedHeadResult {
  at::Tensor loss, row_stats, grad_input, grad_weight, grad_bias;
};

// The forward's pass over the columns, chunk_size at a time (only one chunk
// of logits lives at a time), from a prepared setup whose layout.local is
// head.columns() -> (loss, row_stats).
std::tuple<at::Tensor, at::Tensor> fused_head_forward_by_chunks(
    const FusedHead& head, const at::Tensor& input, const at::Tensor& target,
    const CrossEntropyOptions& options, const CrossEntropyForwardSetup& setup, int64_t chunk_size,
    const CrossEntropyKernels& kernels, const char* op);

// The backward, the logits recomputed chunk_size columns at a time; one
// all-reduce of the input gradient, which every rank joins (a rank without
// columns too). output_mask: input, weight, bias.
FusedHeadResult fused_head_backward_by_chunks(const FusedHead& head, const at::Tensor& input,
                                              const CrossEntropyBackwardSetup& setup,
                                              int64_t chunk_size, const std::string& group,
                                              std::array<bool, 3> output_mask,
                                              const CrossEntropyKernels& kernels, const char* op);

// The loss and its gradients for an upstream gradient of 1, in one pass where
// a block of rows holding every column fits the memory bound (decided from
// `max_columns`, which every rank must know alike, so that all take the same
// branch), else forward by chunks then backward by chunks from
// `backward_setup` (the head's, for grad_loss = 1 and the saved row_stats).
FusedHeadResult fused_head_forward_with_gradients(
    const FusedHead& head, const at::Tensor& input, const at::Tensor& target,
    const CrossEntropyOptions& options, const CrossEntropyForwardSetup& setup, int64_t max_columns,
    int64_t chunk_size, const std::string& group, std::array<bool, 3> output_mask,
    const CrossEntropyKernels& kernels, const char* op,
    const std::function<CrossEntropyBackwardSetup(const at::Tensor& grad_loss,
                                                  const at::Tensor& row_stats)>& backward_setup);

}  // namespace ops
}  // namespace shardtorch
