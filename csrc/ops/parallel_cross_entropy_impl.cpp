#include "ops/parallel_cross_entropy_impl.h"

#include <ATen/ATen.h>

#include <limits>

#include "comm/debug_communicator.h"
#include "comm/registry.h"
#include "comm/sharded_collectives.h"
#include "ops/op_checks.h"
#include "topology/topology.h"

namespace shardtorch {
namespace ops {
namespace {

constexpr const char* kForward = "shard::parallel_cross_entropy";
constexpr const char* kBackward = "shard::_parallel_cross_entropy_backward";
constexpr const char* kFusedForward = "shard::parallel_linear_cross_entropy";
constexpr const char* kFusedBackward = "shard::_parallel_linear_cross_entropy_backward";

// Columns of the saved row_stats (float64, [rows + 1, 4]).
enum SavedRow : int64_t { kSavedLse = 0, kSavedTargetWeight = 1, kSavedValid = 2 };
// Columns of its last row.
enum SavedTrailer : int64_t {
  kTrailerClasses = 0, kTrailerOffset = 1, kTrailerWeightSum = 2, kTrailerDenominator = 3
};
constexpr int64_t kSavedColumns = 4;

// Which classes this rank holds.
struct ClassLayout {
  int64_t num_classes = 0;
  int64_t offset = 0;
  int64_t local = 0;
};

// A check that only this rank can fail (its shard size, its weight's size).
// Throwing at once would leave the other ranks waiting in the all-gather, so
// the failure travels in the gathered statistics and every rank raises after
// it (see combine_over_group).
struct LocalCheck {
  enum Code : int64_t { kOk = 0, kShardSize = 1, kWeightSize = 2, kTarget = 3 };
  int64_t code = kOk;
  std::string message;
  void fail(Code c, std::string m) {
    if (code == kOk) {
      code = c;
      message = std::move(m);
    }
  }
};

const char* describe(int64_t code) {
  switch (code) {
    case LocalCheck::kShardSize: return "its logits' class count is not its shard of the classes";
    case LocalCheck::kWeightSize: return "its class weight has neither its shard's nor all classes' size";
    default: return "a target value out of range (its targets differ from this rank's)";
  }
}

int64_t leading_rows(const at::Tensor& t) {
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) rows *= t.size(d);
  return rows;
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
                "one more class), got shard sizes ", c10::IntArrayRef(sizes), " over group ranks");
    layout.num_classes = total;
  }
  layout.offset = topology::shard_offset(layout.num_classes, size, rank);
  return layout;
}

// Every rank should hold the same targets (SHARDTORCH_DEBUG verifies it) and
// then fails alike; a rank whose targets differ must not leave the others
// waiting in the all-gather, so the failure travels with the statistics like
// the other local checks.
void check_targets(comm::Communicator& communicator, const at::Tensor& target,
                   int64_t ignore_index, int64_t num_classes, const char* op, LocalCheck& check) {
  if (comm::debug_mode_enabled()) comm::check_same_on_every_rank(communicator, target, "target", op);
  if (target.numel() == 0) return;
  const at::Tensor bad = target.ne(ignore_index).logical_and(
      target.lt(0).logical_or(target.ge(num_classes)));
  if (bad.any().item<bool>()) {
    const int64_t value = target.masked_select(bad).view(-1)[0].item<int64_t>();
    check.fail(LocalCheck::kTarget, c10::str(op, ": target values must be in [0, num_classes=",
                                             num_classes, ") or equal ignore_index=", ignore_index,
                                             ", got ", value));
  }
}

// This rank's class weights in the stats dtype, from a sharded or full weight.
at::Tensor local_class_weight(const std::optional<at::Tensor>& weight, const ClassLayout& layout,
                              at::ScalarType acc, const c10::Device& device, const char* op,
                              LocalCheck& check) {
  if (!weight.has_value() || !weight->defined()) return at::Tensor();
  const at::Tensor& w = *weight;
  check_floating(w, "weight", op);
  TORCH_CHECK(w.device() == device, op, ": weight must be on the logits' device ", device,
              ", got ", w.device());
  TORCH_CHECK(w.dim() == 1, op, ": weight must be 1-D, got shape ", w.sizes());
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

// Local column of each row's target, -1 where the row is ignored or the
// target lives on another rank. `offset` may be a 0-d tensor (backward).
at::Tensor local_targets(const at::Tensor& target, int64_t ignore_index, const at::Tensor& offset,
                         int64_t local) {
  const at::Tensor shifted = target - offset;
  const at::Tensor mine =
      target.ne(ignore_index).logical_and(shifted.ge(0)).logical_and(shifted.lt(local));
  return at::where(mine, shifted, at::full({}, -1, target.options())).contiguous();
}

void raise_if_any_rank_failed(const at::Tensor& codes, const LocalCheck& check, const char* op) {
  TORCH_CHECK(check.code == LocalCheck::kOk, check.message);
  const at::Tensor host = codes.cpu();
  for (int64_t r = 0; r < host.size(0); ++r) {
    const auto code = static_cast<int64_t>(host[r].item<double>());
    TORCH_CHECK(code == LocalCheck::kOk, op, ": group rank ", r, " failed a check: ",
                describe(code), " (its own error says more)");
  }
}

at::Tensor fresh_row_stats(int64_t rows, at::ScalarType acc, const c10::Device& device) {
  at::Tensor stats = at::zeros({rows, kNumRowStats}, at::TensorOptions().dtype(acc).device(device));
  stats.select(1, kRowMax).fill_(-std::numeric_limits<double>::infinity());
  return stats;
}

// The one collective of the forward: every rank's per-row statistics (and, in
// an extra last row, its class count and class-weight sum), gathered so that
// each rank combines max and sum-exp itself. Returns the saved row_stats.
at::Tensor combine_over_group(comm::Communicator& communicator, const at::Tensor& stats,
                              const at::Tensor& weight_local, const at::Tensor& target,
                              const ClassLayout& layout, const CrossEntropyOptions& options,
                              const LocalCheck& check, const char* op) {
  const int64_t rows = stats.size(0);
  const auto f64 = stats.options().dtype(at::kDouble);
  at::Tensor packed = at::zeros({rows + 1, kNumRowStats}, f64);
  packed.narrow(0, 0, rows).copy_(stats);
  at::Tensor trailer = packed.select(0, rows);
  trailer.select(0, 0).fill_(static_cast<double>(layout.local));
  if (weight_local.defined()) {
    trailer.select(0, 1).copy_(weight_local.sum().to(at::kDouble));
  } else {
    trailer.select(0, 1).fill_(static_cast<double>(layout.local));
  }
  trailer.select(0, 2).fill_(static_cast<double>(check.code));
  at::Tensor gathered = at::empty({communicator.size(), rows + 1, kNumRowStats}, f64);
  communicator.all_gather(packed, gathered);
  raise_if_any_rank_failed(gathered.select(1, rows).select(1, 2), check, op);

  const at::Tensor per_rank = gathered.narrow(1, 0, rows);  // [ranks, rows, stats]
  const at::Tensor maxes = per_rank.select(2, kRowMax);
  at::Tensor row_max = std::get<0>(maxes.max(0));
  // A row whose logits are all -inf anywhere stays finite in the shift.
  row_max = at::where(row_max.isinf(), at::zeros_like(row_max), row_max);
  const at::Tensor sum_exp =
      (per_rank.select(2, kRowSumExp) * (maxes - row_max.unsqueeze(0)).exp()).sum(0);
  const at::Tensor lse = row_max + sum_exp.log();
  const at::Tensor target_logit = per_rank.select(2, kRowTargetLogit).sum(0);
  const at::Tensor weighted_sum = per_rank.select(2, kRowWeightedSum).sum(0);
  const at::Tensor target_weight = per_rank.select(2, kRowTargetWeight).sum(0);
  const at::Tensor weight_sum = gathered.select(1, rows).select(1, 1).sum();

  const double eps = options.label_smoothing;
  const double C = static_cast<double>(layout.num_classes);
  const at::Tensor valid = target.ne(options.ignore_index);
  at::Tensor row_loss = (1.0 - eps) * target_weight * (lse - target_logit);
  // Only with smoothing: masked (-inf) logits make the weighted sum -inf, and
  // 0 * -inf would turn torch's finite loss into NaN.
  if (eps != 0.0) row_loss = row_loss + (eps / C) * (weight_sum * lse - weighted_sum);
  if (options.z_loss != 0.0) row_loss = row_loss + options.z_loss * lse * lse;
  row_loss = at::where(valid, row_loss, at::zeros_like(row_loss));

  at::Tensor saved = at::zeros({rows + 1, kSavedColumns}, f64);
  at::Tensor saved_rows = saved.narrow(0, 0, rows);
  saved_rows.select(1, kSavedLse).copy_(lse);
  saved_rows.select(1, kSavedTargetWeight).copy_(target_weight);
  saved_rows.select(1, kSavedValid).copy_(valid);
  at::Tensor saved_trailer = saved.select(0, rows);
  saved_trailer.select(0, kTrailerClasses).fill_(C);
  saved_trailer.select(0, kTrailerOffset).fill_(static_cast<double>(layout.offset));
  saved_trailer.select(0, kTrailerWeightSum).copy_(weight_sum);
  // torch's mean: divided by the summed weight of the targets that count
  // (their number without class weights); 0 / 0 = NaN when all are ignored.
  saved_trailer.select(0, kTrailerDenominator).copy_(at::where(valid, target_weight, 0.0).sum());
  // The unreduced row losses ride along in the spare column until reduced.
  saved_rows.select(1, 3).copy_(row_loss);
  return saved;
}

at::Tensor reduce_loss(const at::Tensor& saved, const at::Tensor& target,
                       const CrossEntropyOptions& options, at::ScalarType out_type) {
  const int64_t rows = saved.size(0) - 1;
  const at::Tensor row_loss = saved.narrow(0, 0, rows).select(1, 3);
  at::Tensor loss;
  switch (options.reduction) {
    case 0: loss = row_loss.reshape(target.sizes()); break;
    case 2: loss = row_loss.sum(); break;
    default: loss = row_loss.sum() / saved.select(0, rows).select(0, kTrailerDenominator); break;
  }
  // A fresh tensor: the loss must not alias the saved statistics it came from.
  return loss.to(out_type, /*non_blocking=*/false, /*copy=*/true);
}

// Per-row coefficients of d loss / d logits (see softmax_grad_inplace):
// g = upstream gradient of the row (0 when ignored),
//   grad_scale   = g ((1-e) w_t + e/C sum(w) + 2 z lse)
//   target_scale = g (1-e) w_t
//   smooth_scale = g e / C
at::Tensor gradient_coefficients(const at::Tensor& grad_loss, const at::Tensor& saved,
                                 const CrossEntropyOptions& options, at::ScalarType acc,
                                 const char* op) {
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
  at::Tensor scale = (1.0 - eps) * target_weight + eps * inv_classes * trailer.select(0, kTrailerWeightSum);
  if (options.z_loss != 0.0) scale = scale + 2.0 * options.z_loss * lse;

  at::Tensor coefs = at::empty({rows, kNumGradCoefs}, saved.options());
  coefs.select(1, kCoefLse).copy_(lse);
  coefs.select(1, kCoefGradScale).copy_(g * scale);
  coefs.select(1, kCoefTargetScale).copy_(g * (1.0 - eps) * target_weight);
  coefs.select(1, kCoefSmoothScale).copy_(g * eps * inv_classes);
  return coefs.to(acc).contiguous();
}

// Backward needs this rank's class weights; a full-size weight needs the
// class offset on the host (a tiny read; sharded weights avoid it).
at::Tensor backward_class_weight(const std::optional<at::Tensor>& weight, const at::Tensor& saved,
                                 int64_t local, at::ScalarType acc) {
  if (!weight.has_value() || !weight->defined()) return at::Tensor();
  if (weight->size(0) == local) return weight->to(acc).contiguous();
  const int64_t offset = saved.select(0, saved.size(0) - 1)[kTrailerOffset].item<double>();
  return weight->narrow(0, offset, local).to(acc).contiguous();
}

at::Tensor offset_tensor(const at::Tensor& saved) {
  return saved.select(0, saved.size(0) - 1)[kTrailerOffset].to(at::kLong);
}

}  // namespace

at::ScalarType cross_entropy_accumulate_type(at::ScalarType logits_type) {
  return logits_type == at::kDouble ? at::kDouble : at::kFloat;
}

void check_cross_entropy_options(const CrossEntropyOptions& options, const char* op) {
  TORCH_CHECK(options.reduction >= 0 && options.reduction <= 2, op,
              ": reduction must be 0 (none), 1 (mean) or 2 (sum), got ", options.reduction);
  TORCH_CHECK(options.label_smoothing >= 0.0 && options.label_smoothing <= 1.0, op,
              ": label_smoothing must be in [0, 1], got ", options.label_smoothing);
  TORCH_CHECK(options.z_loss >= 0.0, op, ": z_loss must be >= 0, got ", options.z_loss);
}

void check_cross_entropy_inputs(const at::Tensor& logits_like, int64_t leading_dims,
                                const at::Tensor& target, const char* op) {
  TORCH_CHECK(target.scalar_type() == at::kLong, op, ": target must be int64, got ",
              target.scalar_type());
  TORCH_CHECK(target.device() == logits_like.device(), op,
              ": target must be on the logits' device ", logits_like.device(), ", got ",
              target.device());
  TORCH_CHECK(target.dim() == leading_dims, op, ": target must have the leading shape of the ",
              "input without its last dim (", leading_dims, "-D), got shape ", target.sym_sizes());
  for (int64_t d = 0; d < leading_dims; ++d) {
    TORCH_CHECK(target.sym_size(d) == logits_like.sym_size(d), op, ": target shape ",
                target.sym_sizes(), " must match the input's leading shape ",
                logits_like.sym_sizes());
  }
}

std::vector<c10::SymInt> cross_entropy_loss_shape(const at::Tensor& target, int64_t reduction) {
  if (reduction == 0) return target.sym_sizes().vec();
  return {};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> parallel_cross_entropy_forward_impl(
    const at::Tensor& logits, const at::Tensor& target, const std::optional<at::Tensor>& weight,
    const CrossEntropyOptions& options, const std::string& group,
    std::optional<int64_t> num_classes, const CrossEntropyKernels& kernels) {
  check_cross_entropy_options(options, kForward);
  TORCH_CHECK(logits.dim() >= 1, kForward,
              ": logits must be [*, local_classes] (at least 1-D), got a scalar");
  check_floating(logits, "logits", kForward);
  check_cross_entropy_inputs(logits, logits.dim() - 1, target, kForward);
  const int64_t rows = leading_rows(logits), local = logits.size(-1);
  const at::ScalarType acc = cross_entropy_accumulate_type(logits.scalar_type());

  auto communicator = comm::communicator_for(group, logits.device(), kForward);
  LocalCheck check;
  const ClassLayout layout =
      resolve_class_layout(*communicator, local, num_classes, logits.device(), kForward, check);
  const at::Tensor target_flat = target.reshape({rows});
  check_targets(*communicator, target_flat, options.ignore_index, layout.num_classes, kForward, check);
  const at::Tensor weight_local = local_class_weight(weight, layout, acc, logits.device(), kForward, check);
  const at::Tensor target_local =
      local_targets(target_flat, options.ignore_index,
                    at::scalar_tensor(layout.offset, target.options()), local);

  // The caller's logits are only read: the buffer is the op's own copy,
  // written in the pass that computes the statistics.
  const at::Tensor x = logits.reshape({rows, local}).contiguous();
  at::Tensor buffer = at::empty({rows, local}, logits.options());
  at::Tensor stats = fresh_row_stats(rows, acc, logits.device());
  if (check.code == LocalCheck::kOk) {
    kernels.accumulate_row_stats(x, 0, target_local, weight_local, stats, buffer);
  }
  at::Tensor saved = combine_over_group(*communicator, stats, weight_local, target_flat, layout,
                                        options, check, kForward);
  at::Tensor loss = reduce_loss(saved, target, options, logits.scalar_type());
  return {loss, buffer, saved};
}

void parallel_cross_entropy_backward_impl(const at::Tensor& grad_loss,
                                          const at::Tensor& logits_buffer,
                                          const at::Tensor& row_stats, const at::Tensor& target,
                                          const std::optional<at::Tensor>& weight,
                                          const CrossEntropyOptions& options,
                                          const CrossEntropyKernels& kernels) {
  check_cross_entropy_options(options, kBackward);
  TORCH_CHECK(logits_buffer.dim() == 2 && logits_buffer.is_contiguous(), kBackward,
              ": logits_buffer must be the contiguous [rows, local_classes] buffer of the "
              "forward, got shape ", logits_buffer.sizes());
  const int64_t rows = logits_buffer.size(0), local = logits_buffer.size(1);
  TORCH_CHECK(row_stats.dim() == 2 && row_stats.size(0) == rows + 1 &&
                  row_stats.size(1) == kSavedColumns && row_stats.scalar_type() == at::kDouble,
              kBackward, ": row_stats must be the float64 [rows + 1, ", kSavedColumns,
              "] statistics of the forward, got ", row_stats.scalar_type(), " ",
              row_stats.sizes());
  TORCH_CHECK(target.numel() == rows, kBackward, ": target must have ", rows,
              " elements, got shape ", target.sizes());
  const at::ScalarType acc = cross_entropy_accumulate_type(logits_buffer.scalar_type());
  const at::Tensor target_flat = target.reshape({rows});
  const at::Tensor coefs = gradient_coefficients(grad_loss, row_stats, options, acc, kBackward);
  const at::Tensor target_local =
      local_targets(target_flat, options.ignore_index, offset_tensor(row_stats), local);
  const at::Tensor weight_local = backward_class_weight(weight, row_stats, local, acc);
  kernels.softmax_grad_inplace(logits_buffer, 0, target_local, weight_local, coefs);
}

std::tuple<at::Tensor, at::Tensor> parallel_linear_cross_entropy_forward_impl(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& target, const std::optional<at::Tensor>& class_weight,
    const CrossEntropyOptions& options, int64_t chunk_size, const std::string& group,
    std::optional<int64_t> num_classes, const CrossEntropyKernels& kernels) {
  const char* op = kFusedForward;
  check_cross_entropy_options(options, op);
  TORCH_CHECK(chunk_size >= 1, op, ": chunk_size must be >= 1, got ", chunk_size);
  TORCH_CHECK(input.dim() >= 1, op, ": input must be [*, in_features], got a scalar");
  TORCH_CHECK(weight.dim() == 2, op, ": weight must be 2-D [local_classes, in_features], got ",
              weight.sizes());
  check_floating(input, "input", op);
  check_same_dtype_device(input, "input", weight, "weight", op);
  TORCH_CHECK(input.size(-1) == weight.size(1), op, ": input.size(-1) must equal in_features = ",
              weight.size(1), " (weight.size(1)), got input of shape ", input.sizes());
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0), op,
                ": bias must be 1-D of size weight.size(0) = ", weight.size(0), ", got ",
                bias->sizes());
    check_same_dtype_device(input, "input", *bias, "bias", op);
  }
  check_cross_entropy_inputs(input, input.dim() - 1, target, op);
  const int64_t rows = leading_rows(input), local = weight.size(0), features = weight.size(1);
  const at::ScalarType acc = cross_entropy_accumulate_type(input.scalar_type());

  auto communicator = comm::communicator_for(group, input.device(), op);
  LocalCheck check;
  const ClassLayout layout =
      resolve_class_layout(*communicator, local, num_classes, input.device(), op, check);
  const at::Tensor target_flat = target.reshape({rows});
  check_targets(*communicator, target_flat, options.ignore_index, layout.num_classes, op, check);
  const at::Tensor weight_local = local_class_weight(class_weight, layout, acc, input.device(), op, check);
  const at::Tensor target_local =
      local_targets(target_flat, options.ignore_index,
                    at::scalar_tensor(layout.offset, target.options()), local);

  const at::Tensor x = input.reshape({rows, features}).contiguous();
  const at::Tensor w = weight.contiguous();
  at::Tensor stats = fresh_row_stats(rows, acc, input.device());
  // Only one chunk of logits lives at a time.
  for (int64_t begin = 0; check.code == LocalCheck::kOk && begin < local; begin += chunk_size) {
    const int64_t width = std::min(chunk_size, local - begin);
    const at::Tensor w_chunk = w.narrow(0, begin, width);
    const at::Tensor chunk = has_bias ? at::addmm(bias->narrow(0, begin, width), x, w_chunk.t())
                                      : at::mm(x, w_chunk.t());
    kernels.accumulate_row_stats(chunk, begin, target_local, weight_local, stats, at::Tensor());
  }
  at::Tensor saved = combine_over_group(*communicator, stats, weight_local, target_flat, layout,
                                        options, check, op);
  at::Tensor loss = reduce_loss(saved, target, options, input.scalar_type());
  return {loss, saved};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> parallel_linear_cross_entropy_backward_impl(
    const at::Tensor& grad_loss, const at::Tensor& input, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& row_stats, const at::Tensor& target,
    const std::optional<at::Tensor>& class_weight, const CrossEntropyOptions& options,
    int64_t chunk_size, const std::string& group, std::array<bool, 3> output_mask,
    const CrossEntropyKernels& kernels) {
  const char* op = kFusedBackward;
  check_cross_entropy_options(options, op);
  TORCH_CHECK(chunk_size >= 1, op, ": chunk_size must be >= 1, got ", chunk_size);
  const int64_t rows = leading_rows(input), local = weight.size(0), features = weight.size(1);
  TORCH_CHECK(row_stats.dim() == 2 && row_stats.size(0) == rows + 1 &&
                  row_stats.size(1) == kSavedColumns && row_stats.scalar_type() == at::kDouble,
              op, ": row_stats must be the float64 [rows + 1, ", kSavedColumns,
              "] statistics of the forward, got ", row_stats.scalar_type(), " ", row_stats.sizes());
  const bool has_bias = bias.has_value() && bias->defined();
  const at::ScalarType acc = cross_entropy_accumulate_type(input.scalar_type());
  const at::Tensor target_flat = target.reshape({rows});
  const at::Tensor coefs = gradient_coefficients(grad_loss, row_stats, options, acc, op);
  const at::Tensor target_local =
      local_targets(target_flat, options.ignore_index, offset_tensor(row_stats), local);
  const at::Tensor weight_local = backward_class_weight(class_weight, row_stats, local, acc);

  const at::Tensor x = input.reshape({rows, features}).contiguous();
  const at::Tensor w = weight.contiguous();
  // The input gradient is summed over chunks in the stats dtype, so that
  // reduced-precision inputs do not lose the small chunks' contributions.
  at::Tensor grad_input_acc, grad_weight, grad_bias;
  if (output_mask[0]) grad_input_acc = at::zeros({rows, features}, x.options().dtype(acc));
  if (output_mask[1]) grad_weight = at::empty_like(w);
  if (output_mask[2] && has_bias) grad_bias = at::empty({local}, w.options());
  std::shared_ptr<comm::CommHandle> pending_reduce;
  for (int64_t begin = 0; begin < local || (begin == 0 && output_mask[0]); begin += chunk_size) {
    const int64_t width = std::min(chunk_size, local - begin);
    const bool last = begin + chunk_size >= local;
    const at::Tensor w_chunk = w.narrow(0, begin, width);
    at::Tensor chunk = has_bias ? at::addmm(bias->narrow(0, begin, width), x, w_chunk.t())
                                : at::mm(x, w_chunk.t());
    kernels.softmax_grad_inplace(chunk, begin, target_local, weight_local, coefs);
    if (output_mask[0]) {
      if (chunk.scalar_type() == acc) {
        grad_input_acc.addmm_(chunk, w_chunk);
      } else {
        grad_input_acc.add_(at::mm(chunk, w_chunk));
      }
      // Each rank's classes contribute a part of the input gradient; the sum
      // travels while the last chunk's weight gradient is computed.
      if (last) {
        pending_reduce =
            comm::communicator_for(group, input.device(), op)->all_reduce_async(grad_input_acc);
      }
    }
    // Written in place: a row slice of the contiguous gradient is contiguous,
    // so no chunk-sized temporary is needed.
    if (output_mask[1]) {
      at::Tensor rows_of_grad = grad_weight.narrow(0, begin, width);
      at::mm_out(rows_of_grad, chunk.t(), x);
    }
    if (grad_bias.defined()) {
      at::Tensor rows_of_grad = grad_bias.narrow(0, begin, width);
      at::sum_out(rows_of_grad, chunk, 0);
    }
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
