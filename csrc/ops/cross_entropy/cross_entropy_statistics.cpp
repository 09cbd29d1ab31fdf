#include "ops/cross_entropy/cross_entropy_statistics.h"

#include <ATen/ATen.h>

#include <limits>

#include "comm/debug_communicator.h"
#include "comm/registry.h"
#include "comm/sharded_collectives.h"
#include "ops/cross_entropy/probability_target.h"
#include <shardtorch/topology/topology.h>

namespace shardtorch {
namespace ops {
namespace {

// The packed statistics each rank contributes to the gather: [rows + 1,
// kNumRowStats] float64, its rows' RowStat columns and a trailer.
enum GatheredTrailer : int64_t {
  kGatheredLocalClasses = 0,  // this rank's class count
  kGatheredWeightSum = 1,     // sum of its class weights
  kGatheredCheckCode = 2,     // its LocalCheck::Code
  kGatheredBadTarget = 3,     // its first out-of-range target (with kTarget)
  // 1 where its check failed on its host: it raises at once, alone, and
  // joins no later collective (Communicator::raised_alone), whatever the code.
  kGatheredRaisedAlone = 4,
};
// Per rank, the gathered columns a verdict reads: code, bad target, raised alone.
constexpr int64_t kVerdictColumns = 3;

const char* describe(int64_t code) {
  switch (code) {
    case LocalCheck::kShardSize: return "its logits' class count is not its shard of the classes";
    case LocalCheck::kWeightSize:
      return "its class weight has neither its shard's nor all classes' size";
    case LocalCheck::kSampledClasses:
      return "its sampled_classes are not strictly increasing local classes holding its targets";
    case LocalCheck::kTargetSize:
      return "its probability target has neither its shard's nor all classes' size";
    default: return "a target value out of range (its targets differ from this rank's)";
  }
}

// Total classes and this rank's offset, from the caller or, failing that, one
// tiny all-gather of shard sizes (all ranks take the same branch because
// num_classes is part of the call every rank makes).
ClassLayout resolve_class_layout(comm::Communicator& communicator, int64_t local,
                                 std::optional<int64_t> num_classes, const c10::Device& device,
                                 const char* op, LocalCheck& check) {
  const int64_t size = communicator.size(), rank = communicator.rank();
  ClassLayout layout;
  layout.local = local;
  if (num_classes.has_value()) {
    layout.num_classes = *num_classes;
    TORCH_CHECK(*num_classes >= 1, op, ": num_classes must be >= 1, got ", *num_classes);
    const int64_t expected = topology::shard_size(*num_classes, size, rank);
    if (expected != local) {
      check.fail(LocalCheck::kShardSize,
                 c10::str(op, ": the last dim of the input (", local, " classes) must be rank ",
                          rank, "'s shard of num_classes=", *num_classes, " over ", size,
                          " ranks, which is ", expected));
    }
  } else {
    auto sizes = comm::exchange_sizes(communicator, local, device);
    int64_t total = 0;
    for (auto s : sizes) total += s;
    TORCH_CHECK(total >= 1, op, ": the group holds no classes at all (every shard is empty)");
    TORCH_CHECK(sizes == topology::shard_sizes(total, size), op,
                ": class shards must follow the split rule (the first total % ranks ranks hold "
                "one more class), got shard sizes ",
                c10::IntArrayRef(sizes), " over group ranks");
    layout.num_classes = total;
  }
  layout.offset = topology::shard_offset(layout.num_classes, size, rank);
  return layout;
}

// Out-of-range targets (neither a class nor ignore_index), as a flag on the
// device: reading it here would synchronise with the host; it travels with the
// statistics instead.
at::Tensor targets_out_of_range(const at::Tensor& target, int64_t ignore_index,
                                int64_t num_classes) {
  return target.ne(ignore_index).logical_and(target.lt(0).logical_or(target.ge(num_classes)));
}

// The first out-of-range target, found on the device without a host read.
at::Tensor first_bad_target(const at::Tensor& target, const at::Tensor& bad) {
  if (target.numel() == 0) return at::Tensor();
  return target.index_select(0, bad.to(at::kInt).argmax().view({1})).squeeze(0);
}

// This rank's class weights in the stats dtype, from a sharded or full weight.
at::Tensor local_class_weight(const std::optional<at::Tensor>& weight, const ClassLayout& layout,
                              at::ScalarType acc, const char* op, LocalCheck& check) {
  if (!weight.has_value() || !weight->defined()) return at::Tensor();
  const at::Tensor& w = *weight;
  const int64_t n = w.size(0);
  if (n == layout.num_classes) {
    return w.narrow(0, layout.offset, layout.local).to(acc).contiguous();
  }
  if (n != layout.local) {
    check.fail(LocalCheck::kWeightSize,
               c10::str(op, ": weight must hold this rank's ", layout.local,
                        " classes or all num_classes=", layout.num_classes, ", got ", n));
    return at::Tensor();
  }
  return w.to(acc).contiguous();
}

// This rank's columns of a probability target [rows, T] (see
// prepare_cross_entropy_forward): itself when T == local, the columns at its
// offset when T == num_classes (the same columns when local == num_classes).
at::Tensor local_probability_target(const at::Tensor& target_rows, const ClassLayout& layout,
                                    const char* op, LocalCheck& check) {
  const int64_t given = target_rows.size(1);
  if (given == layout.local) return target_rows;
  if (given == layout.num_classes) return target_rows.narrow(1, layout.offset, layout.local);
  check.fail(LocalCheck::kTargetSize,
             c10::str(op, ": a probability target's last dim must be this rank's ", layout.local,
                      " classes (sharded like the logits) or all num_classes=", layout.num_classes,
                      ", got ", given));
  return at::Tensor();
}

// Rows [rows] that count in the loss: targets that are not ignore_index;
// every row of a probability target (torch applies no ignore_index to them).
at::Tensor counted_rows(const CrossEntropyForwardSetup& setup, int64_t rows,
                        const CrossEntropyOptions& options, const c10::Device& device) {
  if (setup.probability_target) {
    return at::ones({rows}, at::TensorOptions().dtype(at::kBool).device(device));
  }
  return setup.target_flat.ne(options.ignore_index);
}

// Local column of each row's target, -1 where the row is ignored or the
// target lives on another rank. `offset` is a 0-d tensor, so that backward
// need not read it on the host.
at::Tensor local_targets(const at::Tensor& target, int64_t ignore_index, const at::Tensor& offset,
                         int64_t local) {
  const at::Tensor shifted = target - offset;
  const at::Tensor mine =
      target.ne(ignore_index).logical_and(shifted.ge(0)).logical_and(shifted.lt(local));
  return at::where(mine, shifted, at::full({}, -1, target.options())).contiguous();
}

// Every rank's check code and first bad target, as gathered ([ranks, 2],
// flattened), made into the error every rank raises ("" when all passed).
std::string check_verdict(const std::vector<double>& gathered, int64_t own_rank,
                          int64_t num_classes, int64_t ignore_index, const char* op) {
  const int64_t ranks = static_cast<int64_t>(gathered.size()) / kVerdictColumns;
  const auto code_of = [&](int64_t r) {
    return static_cast<int64_t>(gathered[kVerdictColumns * r]);
  };
  if (code_of(own_rank) == LocalCheck::kTarget) {
    return c10::str(op, ": target values must be in [0, num_classes=", num_classes,
                    ") or equal ignore_index=", ignore_index, ", got ",
                    static_cast<int64_t>(gathered[kVerdictColumns * own_rank + 1]));
  }
  if (code_of(own_rank) == LocalCheck::kSampledClasses) {  // found on the device (CUDA)
    return c10::str(op,
                    ": sampled_classes must be strictly increasing local class indices in "
                    "[0, local classes) holding every target of this rank's shard");
  }
  for (int64_t r = 0; r < ranks; ++r) {
    if (code_of(r) != LocalCheck::kOk) {
      return c10::str(op, ": group rank ", r, " failed a check: ", describe(code_of(r)),
                      " (its own error says more)");
    }
  }
  return "";
}

// Whether another rank raised alone (its check failed on its host, whatever
// the check): the collectives launched since wait for it in vain.
bool a_peer_raised_alone(const std::vector<double>& gathered, int64_t own_rank) {
  const int64_t ranks = static_cast<int64_t>(gathered.size()) / kVerdictColumns;
  for (int64_t r = 0; r < ranks; ++r) {
    if (r != own_rank && gathered[kVerdictColumns * r + 2] != 0) return true;
  }
  return false;
}

// Per-row coefficients of d loss / d logits (see softmax_grad_inplace):
// g = upstream gradient of the row (0 when ignored),
//   grad_scale   = g ((1-e) w_t + e/C sum(w) + 2 z lse)
//   target_scale = g (1-e) w_t
//   smooth_scale = g e / C
// For a probability target w_t is the saved A = sum_c w_c p_c, and
// target_scale is g (1-e), the factor of w_j p_j (the kernels' target_probs term).
at::Tensor gradient_coefficients(const at::Tensor& grad_loss, const at::Tensor& saved,
                                 const CrossEntropyOptions& options, bool probability_target,
                                 at::ScalarType acc, const char* op) {
  const int64_t rows = saved.size(0) - 1;
  const at::Tensor per_row = saved.narrow(0, 0, rows);
  const at::Tensor trailer = saved.select(0, rows);
  const at::Tensor lse = per_row.select(1, kSavedLse);
  const at::Tensor target_weight = per_row.select(1, kSavedTargetWeight);
  const at::Tensor valid = per_row.select(1, kSavedValid).ne(0);
  const at::Tensor grad = grad_loss.to(at::kDouble);
  at::Tensor g;
  if (options.reduction == 0) {
    TORCH_CHECK(grad.numel() == rows, op, ": grad_loss must have one value per row (", rows,
                ") for reduction none, got shape ", grad_loss.sizes());
    g = grad.reshape({rows});
  } else {
    TORCH_CHECK(grad.numel() == 1, op, ": grad_loss must be a scalar for reduction ",
                options.reduction, ", got shape ", grad_loss.sizes());
    g = grad.reshape({}).expand({rows});
    if (options.reduction == 1) g = g / trailer.select(0, kTrailerDenominator);
  }
  g = at::where(valid, g, at::zeros_like(g));
  const double eps = options.label_smoothing;
  const at::Tensor inv_classes = trailer.select(0, kTrailerClasses).reciprocal();
  at::Tensor scale =
      (1.0 - eps) * target_weight + eps * inv_classes * trailer.select(0, kTrailerWeightSum);
  if (options.z_loss != 0.0) scale = scale + 2.0 * options.z_loss * lse;

  at::Tensor coefs = at::empty({rows, kNumGradCoefs}, saved.options());
  const at::Tensor lse_rounded = lse.to(acc).to(at::kDouble);
  coefs.select(1, kCoefLse).copy_(lse_rounded);
  coefs.select(1, kCoefLseRemainder).copy_(lse - lse_rounded);
  coefs.select(1, kCoefGradScale).copy_(g * scale);
  coefs.select(1, kCoefTargetScale)
      .copy_(probability_target ? g * (1.0 - eps) : g * (1.0 - eps) * target_weight);
  coefs.select(1, kCoefSmoothScale).copy_(g * eps * inv_classes);
  return coefs.to(acc).contiguous();
}

at::Tensor saved_offset(const at::Tensor& saved) {
  return saved.select(0, saved.size(0) - 1)[kTrailerOffset].to(at::kLong);
}

// Backward's view of this rank's class weights. A full-size weight is sliced
// at the saved offset on the device (index_select), not read on the host.
at::Tensor backward_class_weight(const std::optional<at::Tensor>& weight, const at::Tensor& offset,
                                 int64_t local, at::ScalarType acc) {
  if (!weight.has_value() || !weight->defined()) return at::Tensor();
  if (weight->size(0) == local) return weight->to(acc).contiguous();
  const at::Tensor columns = at::arange(local, offset.options()) + offset;
  return weight->index_select(0, columns).to(acc).contiguous();
}

}  // namespace

void LocalCheck::fail(Code c, std::string m) {
  if (code == kOk) {
    code = c;
    message = std::move(m);
  }
}

CrossEntropyForwardSetup prepare_cross_entropy_forward(
    const std::string& group, const c10::Device& device, at::ScalarType input_type,
    int64_t local_classes, std::optional<int64_t> num_classes, const at::Tensor& target,
    const std::optional<at::Tensor>& class_weight, const CrossEntropyOptions& options,
    const char* op) {
  CrossEntropyForwardSetup setup;
  setup.communicator = comm::communicator_for(group, device, op);
  setup.acc = cross_entropy_accumulate_type(input_type);
  setup.layout = resolve_class_layout(*setup.communicator, local_classes, num_classes, device, op,
                                      setup.check);
  setup.weight_local = local_class_weight(class_weight, setup.layout, setup.acc, op, setup.check);
  if (is_probability_target(target)) {
    // Its rows may differ between ranks (a shard each): nothing to compare,
    // no value to check (torch checks none either).
    const int64_t rows = probability_target_rows(target);
    setup.probability_target = true;
    setup.target_probs = local_probability_target(target.reshape({rows, target.size(-1)}),
                                                  setup.layout, op, setup.check);
    setup.target_local = at::full({rows}, -1, target.options().dtype(at::kLong));
    return setup;
  }
  setup.target_flat = target.reshape({target.numel()});
  // Every rank should hold the same targets; SHARDTORCH_DEBUG verifies it.
  if (comm::debug_mode_enabled()) {
    comm::check_same_on_every_rank(*setup.communicator, setup.target_flat, "target", op);
  }
  if (setup.target_flat.numel() > 0) {
    const at::Tensor bad =
        targets_out_of_range(setup.target_flat, options.ignore_index, setup.layout.num_classes);
    setup.check.target_out_of_range = bad.any();
    setup.check.first_bad_target = first_bad_target(setup.target_flat, bad);
  }
  setup.target_local =
      local_targets(setup.target_flat, options.ignore_index,
                    at::scalar_tensor(setup.layout.offset, target.options()), local_classes);
  return setup;
}

at::Tensor fresh_row_stats(int64_t rows, const CrossEntropyForwardSetup& setup,
                           const c10::Device& device) {
  at::Tensor stats =
      at::zeros({rows, kNumRowStats}, at::TensorOptions().dtype(setup.acc).device(device));
  stats.select(1, kRowMax).fill_(-std::numeric_limits<double>::infinity());
  return stats;
}

at::Tensor combine_over_group(const CrossEntropyForwardSetup& setup, const at::Tensor& stats,
                              const CrossEntropyOptions& options, const char* op,
                              bool give_verdict) {
  comm::Communicator& communicator = *setup.communicator;
  const ClassLayout& layout = setup.layout;
  const int64_t rows = stats.size(0);
  const auto f64 = stats.options().dtype(at::kDouble);
  at::Tensor packed = at::zeros({rows + 1, kNumRowStats}, f64);
  packed.narrow(0, 0, rows).copy_(stats);
  at::Tensor trailer = packed.select(0, rows);
  trailer.select(0, kGatheredLocalClasses).fill_(static_cast<double>(layout.local));
  if (setup.weight_local.defined()) {
    trailer.select(0, kGatheredWeightSum).copy_(setup.weight_local.sum().to(at::kDouble));
  } else {
    trailer.select(0, kGatheredWeightSum).fill_(static_cast<double>(layout.local));
  }
  at::Tensor code = trailer.select(0, kGatheredCheckCode);
  code.fill_(static_cast<double>(setup.check.code));
  trailer.select(0, kGatheredRaisedAlone).fill_(setup.check.code == LocalCheck::kOk ? 0.0 : 1.0);
  if (setup.check.code == LocalCheck::kOk) {
    // The checks found on the device, never read here: a bad target first.
    if (setup.check.sampled_classes_bad.defined()) {
      code.copy_(at::where(setup.check.sampled_classes_bad,
                           static_cast<double>(LocalCheck::kSampledClasses), 0.0));
    }
    if (setup.check.target_out_of_range.defined()) {
      code.copy_(at::where(setup.check.target_out_of_range,
                           static_cast<double>(LocalCheck::kTarget), code));
      trailer.select(0, kGatheredBadTarget).copy_(setup.check.first_bad_target);
    }
  }
  at::Tensor gathered = at::empty({communicator.size(), rows + 1, kNumRowStats}, f64);
  communicator.all_gather(packed, gathered);
  const at::Tensor checks = gathered.select(1, rows).narrow(1, kGatheredCheckCode, kVerdictColumns);
  // A check only this rank knows failed: it raises now, its peers from the
  // verdict (after aborting the collectives they launched meanwhile). It
  // reads what the others found first (a host wait, on this failing path
  // only): where every rank failed one, none waits for another.
  if (setup.check.code != LocalCheck::kOk) {
    communicator.synchronize();
    const bool everyone = checks.select(1, 2).ne(0).all().item<bool>();
    if (!everyone) communicator.raised_alone(setup.check.message);
    TORCH_CHECK(false, setup.check.message,
                everyone ? " (every rank of the group failed an argument check of its own and "
                           "raised it at once: none left the others waiting)"
                         : "");
  }
  if (give_verdict) {
    const int64_t own_rank = communicator.rank(), num_classes = layout.num_classes;
    const int64_t ignore_index = options.ignore_index;
    communicator.raise_if(checks, [=](const std::vector<double>& values) {
      return comm::CheckOutcome(check_verdict(values, own_rank, num_classes, ignore_index, op),
                                a_peer_raised_alone(values, own_rank));
    });
  }
  // Where the verdict comes later (CUDA), a failed check makes this forward's
  // loss and gradients NaN meanwhile, never a plausible wrong number.
  const at::Tensor any_failed = checks.select(1, 0).ne(0).any();

  const at::Tensor per_rank = gathered.narrow(1, 0, rows);  // [ranks, rows, stats]
  const at::Tensor maxes = per_rank.select(2, kRowMax);
  at::Tensor row_max = std::get<0>(maxes.max(0));
  // A row whose logits are all -inf anywhere stays finite in the shift.
  row_max = at::where(row_max.isinf(), at::zeros_like(row_max), row_max);
  const at::Tensor sum_exp =
      (per_rank.select(2, kRowSumExp) * (maxes - row_max.unsqueeze(0)).exp()).sum(0);
  const at::Tensor lse =
      at::where(any_failed, std::numeric_limits<double>::quiet_NaN(), row_max + sum_exp.log());
  at::Tensor target_logit = per_rank.select(2, kRowTargetLogit);
  if (setup.probability_target) {
    // Each rank's B is relative to its own max (0 where -inf, the kernels'
    // shift): rebased to row_max, every term keeps one sign, and the loss
    // below is A (lse - row_max) - B, with no difference of large sums.
    const at::Tensor rank_shift = at::where(maxes.isneginf(), at::zeros_like(maxes), maxes);
    target_logit =
        target_logit - per_rank.select(2, kRowTargetWeight) * (row_max.unsqueeze(0) - rank_shift);
  }
  target_logit = target_logit.sum(0);
  const at::Tensor weighted_sum = per_rank.select(2, kRowWeightedSum).sum(0);
  const at::Tensor target_weight = per_rank.select(2, kRowTargetWeight).sum(0);
  const at::Tensor weight_sum = gathered.select(1, rows).select(1, kGatheredWeightSum).sum();

  const double eps = options.label_smoothing;
  // The classes in the loss: every rank's count, summed. That is num_classes
  // (the shards were checked above) unless a margin loss sampled classes.
  const at::Tensor C = gathered.select(1, rows).select(1, kGatheredLocalClasses).sum();
  const at::Tensor valid = counted_rows(setup, rows, options, stats.device());
  // Class indices: w_t (lse - x_t); probabilities: A lse - B with the target
  // columns holding A = sum w p and B = sum w p (x - row_max)
  // (probability_target.h).
  at::Tensor row_loss = setup.probability_target
                            ? (1.0 - eps) * (target_weight * (lse - row_max) - target_logit)
                            : (1.0 - eps) * target_weight * (lse - target_logit);
  // Only with smoothing: masked (-inf) logits make the weighted sum -inf, and
  // 0 * -inf would turn torch's finite loss into NaN.
  if (eps != 0.0) row_loss = row_loss + eps * C.reciprocal() * (weight_sum * lse - weighted_sum);
  if (options.z_loss != 0.0) row_loss = row_loss + options.z_loss * lse * lse;
  row_loss = at::where(valid, row_loss, at::zeros_like(row_loss));

  at::Tensor saved = at::zeros({rows + 1, kNumSavedStats}, f64);
  at::Tensor saved_rows = saved.narrow(0, 0, rows);
  saved_rows.select(1, kSavedLse).copy_(lse);
  saved_rows.select(1, kSavedTargetWeight).copy_(target_weight);
  saved_rows.select(1, kSavedValid).copy_(valid);
  saved_rows.select(1, kSavedRowLoss).copy_(row_loss);
  at::Tensor saved_trailer = saved.select(0, rows);
  saved_trailer.select(0, kTrailerClasses).copy_(C);
  saved_trailer.select(0, kTrailerOffset).fill_(static_cast<double>(layout.offset));
  saved_trailer.select(0, kTrailerWeightSum).copy_(weight_sum);
  // torch's mean: divided by the summed weight of the targets that count
  // (their number without class weights); 0 / 0 = NaN when all are ignored.
  // For probabilities torch divides by the rows, whatever the weights.
  if (setup.probability_target) {
    saved_trailer.select(0, kTrailerDenominator).fill_(static_cast<double>(rows));
  } else {
    saved_trailer.select(0, kTrailerDenominator).copy_(at::where(valid, target_weight, 0.0).sum());
  }
  return saved;
}

CrossEntropyForwardSetup rows_of_setup(const CrossEntropyForwardSetup& setup, int64_t begin,
                                       int64_t count) {
  CrossEntropyForwardSetup block = setup;
  if (setup.target_flat.defined()) block.target_flat = setup.target_flat.narrow(0, begin, count);
  if (setup.target_probs.defined()) block.target_probs = setup.target_probs.narrow(0, begin, count);
  block.target_local = setup.target_local.narrow(0, begin, count);
  return block;
}

at::Tensor join_saved_row_blocks(const std::vector<at::Tensor>& blocks) {
  std::vector<at::Tensor> rows;
  at::Tensor denominator;
  for (const at::Tensor& b : blocks) {
    const int64_t n = b.size(0) - 1;
    rows.push_back(b.narrow(0, 0, n));
    const at::Tensor d = b.select(0, n).select(0, kTrailerDenominator);
    denominator = denominator.defined() ? denominator + d : d;
  }
  at::Tensor trailer = blocks.front().narrow(0, blocks.front().size(0) - 1, 1).clone();
  trailer.select(1, kTrailerDenominator).copy_(denominator);
  rows.push_back(trailer);
  return at::cat(rows, 0);
}

at::Tensor mean_divisor_factor(const at::Tensor& saved) {
  const int64_t rows = saved.size(0) - 1;
  const at::Tensor any_valid = saved.narrow(0, 0, rows).select(1, kSavedValid).ne(0).any();
  const at::Tensor denominator = saved.select(0, rows).select(0, kTrailerDenominator);
  return at::where(any_valid, denominator.reciprocal(), at::zeros_like(denominator));
}

at::Tensor reduce_loss(const at::Tensor& saved, const at::Tensor& target,
                       const CrossEntropyOptions& options, at::ScalarType out_type) {
  const int64_t rows = saved.size(0) - 1;
  const at::Tensor row_loss = saved.narrow(0, 0, rows).select(1, kSavedRowLoss);
  at::Tensor loss;
  switch (options.reduction) {
    case 0: {
      std::vector<int64_t> shape = target.sizes().vec();
      if (is_probability_target(target)) shape.pop_back();  // one loss per row
      loss = row_loss.reshape(shape);
      break;
    }
    case 2: loss = row_loss.sum(); break;
    default: loss = row_loss.sum() / saved.select(0, rows).select(0, kTrailerDenominator); break;
  }
  // A fresh tensor: the loss must not alias the saved statistics it came from.
  return loss.to(out_type, /*non_blocking=*/false, /*copy=*/true);
}

CrossEntropyBackwardSetup prepare_cross_entropy_backward(
    const at::Tensor& grad_loss, const at::Tensor& row_stats, const at::Tensor& target,
    const std::optional<at::Tensor>& class_weight, const CrossEntropyOptions& options,
    int64_t local_classes, at::ScalarType acc, const char* op) {
  check_cross_entropy_options(options, op);
  const int64_t rows = row_stats.size(0) - 1;
  const bool probabilities = is_probability_target(target);
  TORCH_CHECK(probabilities ? target.dim() >= 1 && probability_target_rows(target) == rows
                            : target.numel() == rows,
              op, ": target must have ", rows,
              probabilities ? " rows of probabilities" : " elements", ", got shape ",
              target.sizes());
  const at::Tensor offset = saved_offset(row_stats);
  CrossEntropyBackwardSetup setup;
  setup.coefs = gradient_coefficients(grad_loss, row_stats, options, probabilities, acc, op);
  if (probabilities) {
    setup.target_local = at::full({rows}, -1, target.options().dtype(at::kLong));
    setup.target_probs =
        local_probability_columns(target.reshape({rows, target.size(-1)}), offset, local_classes);
  } else {
    setup.target_local =
        local_targets(target.reshape({rows}), options.ignore_index, offset, local_classes);
  }
  setup.weight_local = backward_class_weight(class_weight, offset, local_classes, acc);
  return setup;
}

}  // namespace ops
}  // namespace shardtorch
