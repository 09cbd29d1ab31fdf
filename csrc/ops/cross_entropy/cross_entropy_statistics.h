#pragma once
// The device-independent algorithm of the parallel cross-entropy, shared by
// the plain op and the one fused with the classifier: which classes this rank
// holds, the checks only one rank can fail, the one all-gather of per-row
// statistics, the loss formula and the gradient coefficients. The passes over
// [rows, classes] data are a device's CrossEntropyKernels.

#include <ATen/core/Tensor.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "ops/cross_entropy/cross_entropy_checks.h"
#include "ops/cross_entropy/cross_entropy_kernels.h"
#include "ops/cross_entropy/cross_entropy_saved_stats.h"

namespace shardtorch {
namespace ops {

// Which classes this rank holds.
struct ClassLayout {
  int64_t num_classes = 0;
  int64_t offset = 0;
  int64_t local = 0;
};

// A check that only this rank can fail (its shard size, its weight's size,
// its targets). Throwing at once would leave the other ranks waiting in the
// all-gather, so the failure travels in the gathered statistics and every
// rank raises after it. Out-of-range targets are found on the device and
// never read on the host before the gather.
struct LocalCheck {
  enum Code : int64_t {
    kOk = 0,
    kShardSize = 1,
    kWeightSize = 2,
    kTarget = 3,
    kSampledClasses = 4,  // the margin loss's sampled_classes
    kTargetSize = 5,      // a probability target's class count
  };
  int64_t code = kOk;
  std::string message;
  at::Tensor target_out_of_range;  // 0-d bool on the device, or undefined
  at::Tensor first_bad_target;     // 0-d int64 on the device: the first such value
  // 0-d bool on the device, or undefined: the margin loss's sampled_classes
  // check, left on a CUDA device (a host read per step otherwise).
  at::Tensor sampled_classes_bad;
  void fail(Code c, std::string m);
};

// What both ops' forwards derive from their arguments before touching data.
struct CrossEntropyForwardSetup {
  std::shared_ptr<comm::Communicator> communicator;
  ClassLayout layout;
  LocalCheck check;
  at::ScalarType acc = at::kFloat;
  at::Tensor target_flat;   // [rows] class indices (a probability target: undefined)
  at::Tensor target_local;  // [rows]: the target's local column, or -1 (always with probabilities)
  at::Tensor weight_local;  // [local] in the stats dtype, or undefined
  // A probability target: this rank's columns [rows, local] (a view of the
  // caller's target in its dtype; undefined when its size check failed), which
  // the kernels' row pass folds in (CrossEntropyKernels' target_probs).
  bool probability_target = false;
  at::Tensor target_probs;
};

// Resolves the class layout (from num_classes, or one tiny all-gather of
// shard sizes without it), checks what only this rank can fail (carried to
// the gather), and localises targets and class weights. Arguments must have
// passed the op's cross_entropy_checks.h check. A probability target [*, T]
// is this rank's shard when T == local_classes and the whole distribution,
// sliced here, when T == num_classes; when the two are equal (one rank, or a
// rank holding every class) both readings are the same columns. Any other T
// fails this rank's check (kTargetSize), so every rank raises.
CrossEntropyForwardSetup prepare_cross_entropy_forward(
    const std::string& group, const c10::Device& device, at::ScalarType input_type,
    int64_t local_classes, std::optional<int64_t> num_classes, const at::Tensor& target,
    const std::optional<at::Tensor>& class_weight, const CrossEntropyOptions& options,
    const char* op);

// Stats [rows, kNumRowStats] ready for CrossEntropyKernels::accumulate_row_stats.
at::Tensor fresh_row_stats(int64_t rows, const CrossEntropyForwardSetup& setup,
                           const c10::Device& device);

// The one collective of the forward: every rank's per-row statistics and its
// check result, gathered, combined and checked: every rank raises if any
// failed (Communicator::raise_if: at once on CPU; on CUDA, without a host
// wait, from the group's 8th collective after this one or check_deferred,
// while this forward's loss and gradients are NaN). Returns the saved row_stats.
// give_verdict=false: the checks only make this call's results NaN, and raise
// nowhere (a later block of rows of one op carries the checks of its first,
// whose verdict raises them).
at::Tensor combine_over_group(const CrossEntropyForwardSetup& setup, const at::Tensor& stats,
                              const CrossEntropyOptions& options, const char* op,
                              bool give_verdict = true);

// For the fused losses that go over the batch in blocks of rows (their
// gradients in forward): the setup restricted to rows [begin, begin + count)
// (its combine_over_group then gathers only those rows; the target check stays
// the whole batch's, so every block raises what the first would), and one
// saved row_stats from the blocks' own (their rows in order, the trailer of
// the first with the mean's divisor summed over all).
CrossEntropyForwardSetup rows_of_setup(const CrossEntropyForwardSetup& setup, int64_t begin,
                                       int64_t count);
at::Tensor join_saved_row_blocks(const std::vector<at::Tensor>& blocks);
// 1 / the mean's divisor of saved row_stats (0 where every target is ignored,
// whose gradients are 0, as torch's): a 0-d float64 tensor on its device,
// for gradients summed over blocks of rows before the divisor was known.
at::Tensor mean_divisor_factor(const at::Tensor& saved);

// The loss from the saved row_stats, a fresh tensor of `out_type`.
at::Tensor reduce_loss(const at::Tensor& saved, const at::Tensor& target,
                       const CrossEntropyOptions& options, at::ScalarType out_type);

// What both ops' backwards derive from the saved statistics.
struct CrossEntropyBackwardSetup {
  at::Tensor coefs;         // [rows, kNumGradCoefs] in the stats dtype
  at::Tensor target_local;  // [rows]
  at::Tensor weight_local;  // [local] in the stats dtype, or undefined
  // A probability target: this rank's columns [rows, local]; the kernels'
  // backward pass subtracts its term, scaled by the coefficients'
  // kCoefTargetScale column (g (1 - e)).
  at::Tensor target_probs;
};

CrossEntropyBackwardSetup prepare_cross_entropy_backward(
    const at::Tensor& grad_loss, const at::Tensor& row_stats, const at::Tensor& target,
    const std::optional<at::Tensor>& class_weight, const CrossEntropyOptions& options,
    int64_t local_classes, at::ScalarType acc, const char* op);

}  // namespace ops
}  // namespace shardtorch
