#pragma once
// shard::parallel_cross_entropy: torch.nn.functional.cross_entropy of logits
// whose classes are split over a tensor-parallel group, without ever gathering
// them.
//
//   parallel_cross_entropy(Tensor logits, Tensor target, Tensor? weight=None,
//       int ignore_index=-100, float label_smoothing=0.0, float z_loss=0.0,
//       int reduction=1, str group="tp", int? num_classes=None) -> Tensor
//
//   logits        [*, local_classes], this rank's shard of the classes (the
//                 first total % size ranks hold one more class); float64,
//                 float32, float16 or bfloat16. Never modified.
//   target        [*] int64 global class indices, identical on every rank.
//                 A value outside [0, num_classes) that is not ignore_index
//                 raises on every rank: the check's result travels in the
//                 gathered statistics (on CUDA, the one host read of the
//                 forward).
//                 Or class probabilities, as F.cross_entropy takes them: a
//                 floating tensor (the logits' dtype or float32) shaped like
//                 the logits, [*, local_classes] sharded like them, or
//                 [*, num_classes] whole (the op takes this rank's columns);
//                 the last dim tells which, and where the two sizes are equal
//                 (one rank) they are the same columns. Any other size raises
//                 on every rank. ignore_index does not apply; label smoothing
//                 and weights combine as torch's: loss_i = -sum_c w_c p'_ic
//                 log_softmax_ic, p' = (1-e) p + e/C; mean divides by the
//                 rows (not by the weights). No gradient flows to the target
//                 (a target that requires grad raises). See
//                 probability_target.h.
//   weight        class weights: this rank's shard [local_classes] or all of
//                 them [num_classes].
//   reduction     at::Reduction: 0 none (loss shaped like the logits
//                 without their last dim), 1 mean
//                 (weighted as torch: sum / sum of target weights over rows
//                 that are not ignored; NaN when all rows are ignored), 2 sum.
//   label_smoothing  torch's formula over all classes, weights included:
//                 (1-e) w[t] (lse - x_t) + e/C sum_c w_c (lse - x_c).
//   z_loss        adds z_loss * lse^2 to each row that is not ignored (PaLM's
//                 auxiliary term), unweighted; "mean" divides it by the same
//                 denominator as the cross-entropy.
//   num_classes   total classes when the caller knows them (saves one tiny
//                 collective); checked against the split rule.
//
// A check that only one rank can fail (its shard size, its weight's size) is
// carried in the gathered statistics, so every rank raises, none hangs.
//
// Communication: forward, one all-gather of packed per-row statistics
// [max, sum-exp, target logit, weighted logit sum, target weight] (for
// probabilities the target columns hold sum w p x and sum w p) (plus one
// tiny all-gather of shard sizes when num_classes is not given); backward,
// none. Accumulation is float32 (float64 for float64 logits).
//
// Internals, also ops so that TorchScript, torch.compile and C++ autograd see
// them:
//   _parallel_cross_entropy_forward(...) -> (loss, logits_buffer, row_stats)
//     logits_buffer: an op-owned copy of the logits as [rows, local_classes],
//     written by the same pass that reads them, which backward turns into the
//     gradient in place. row_stats: float64 [rows + 1, 4], per row
//     (lse, target weight, not-ignored, unreduced loss) and a last row
//     (num_classes, class offset, sum of class weights, mean denominator).
//   _parallel_cross_entropy_backward(grad_loss, Tensor(a!) logits_buffer,
//     row_stats, target, weight, ignore_index, label_smoothing, z_loss,
//     reduction) -> (): logits_buffer becomes d loss / d logits.

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <tuple>

namespace shardtorch {
namespace ops {

at::Tensor parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& target,
                                  const std::optional<at::Tensor>& weight, int64_t ignore_index,
                                  double label_smoothing, double z_loss, int64_t reduction,
                                  const std::string& group, std::optional<int64_t> num_classes);

std::tuple<at::Tensor, at::Tensor, at::Tensor> parallel_cross_entropy_forward(
    const at::Tensor& logits, const at::Tensor& target, const std::optional<at::Tensor>& weight,
    int64_t ignore_index, double label_smoothing, double z_loss, int64_t reduction,
    const std::string& group, std::optional<int64_t> num_classes);

void parallel_cross_entropy_backward(const at::Tensor& grad_loss, const at::Tensor& logits_buffer,
                                     const at::Tensor& row_stats, const at::Tensor& target,
                                     const std::optional<at::Tensor>& weight, int64_t ignore_index,
                                     double label_smoothing, double z_loss, int64_t reduction);

}  // namespace ops
}  // namespace shardtorch
