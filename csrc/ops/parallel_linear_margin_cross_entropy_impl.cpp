#include "ops/parallel_linear_margin_cross_entropy_impl.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include "comm/registry.h"
#include "comm/sharded_collectives.h"
#include "ops/cross_entropy_statistics.h"
#include <shardtorch/ops/parallel_linear_cross_entropy.h>
#include <shardtorch/topology/topology.h>

namespace shardtorch {
namespace ops {
namespace {

constexpr const char* kMarginForward = "shard::parallel_linear_margin_cross_entropy";
constexpr const char* kMarginBackward = "shard::_parallel_linear_margin_cross_entropy_backward";
constexpr const char* kWithGradients =
    "shard::_parallel_linear_margin_cross_entropy_forward_with_gradients";
// F.normalize's eps: rows are divided by max(norm, eps), so that the op is
// F.normalize's composition exactly, gradient included.
constexpr double kNormEps = 1e-12;
// sin(theta) below this is an exactly (anti-)aligned pair: the slope of the
// margin there is taken with this in the denominator instead of 0.
constexpr double kTinySine = 1e-30;

// Rows of `t` [n, features] divided by their clamped norms.
struct NormalizedRows {
  at::Tensor unit;  // [n, features]
  at::Tensor norm;  // [n, 1] clamped norms
  at::Tensor kept;  // [n, 1] 1 where the norm was not clamped (the projection applies), else 0
};

NormalizedRows normalize_rows(const at::Tensor& t) {
  const at::Tensor raw = at::linalg_vector_norm(t, 2, {1}, /*keepdim=*/true);
  NormalizedRows rows;
  rows.norm = raw.clamp_min(kNormEps);
  rows.unit = t / rows.norm;
  rows.kept = raw.ge(kNormEps).to(t.scalar_type());
  return rows;
}

// d loss / d t from d loss / d unit, in place in `grad` [n, features]: the
// derivative of t / max(|t|, eps), i.e. (g - u (u . g)) / |t| where unclamped.
void normalize_backward_(at::Tensor& grad, const NormalizedRows& rows) {
  const at::Tensor along = (grad * rows.unit).sum(1, /*keepdim=*/true) * rows.kept;
  grad.sub_(rows.unit * along).div_(rows.norm);
}

// psi(cos) of the target class and d psi / d cos (see the op's header), in
// float64: these are [rows] vectors, and the margin's trigonometry is where
// float32 would lose the most.
struct TargetMargin {
  at::Tensor value;
  at::Tensor slope;
};

TargetMargin target_margin(const at::Tensor& cosine, const MarginOptions& m) {
  const at::Tensor c = cosine.to(at::kDouble).clamp(-1.0, 1.0);
  const at::Tensor sine = (1.0 - c * c).clamp_min(0.0).sqrt();
  at::Tensor main, main_slope;
  if (m.m1 == 1.0) {
    // cos(theta + m2) without acos: exact for CosFace (m2 = 0), insightface's
    // ArcFace formula otherwise.
    main = c * std::cos(m.m2) - sine * std::sin(m.m2) - m.m3;
    main_slope = m.m2 == 0.0 ? at::ones_like(c)
                             : std::cos(m.m2) + std::sin(m.m2) * c / sine.clamp_min(kTinySine);
  } else {
    const at::Tensor angle = m.m1 * c.acos() + m.m2;
    main = angle.cos() - m.m3;
    main_slope = m.m1 * angle.sin() / sine.clamp_min(kTinySine);
  }
  at::Tensor use_main, fallback;
  if (m.easy_margin) {
    use_main = c.gt(0.0);
    fallback = c;
  } else {
    use_main = c.gt(std::cos((kPi - m.m2) / m.m1));
    fallback = c - m.m3 - m.m2 * std::sin(kPi - m.m2);
  }
  return {at::where(use_main, main, fallback), at::where(use_main, main_slope, 1.0)};
}

// Which of this chunk's columns, if any, each row's target is.
struct TargetColumns {
  at::Tensor here;    // [rows] bool
  at::Tensor column;  // [rows, 1] int64, clamped into the chunk
};

TargetColumns target_columns(const at::Tensor& target_local, int64_t begin, int64_t width) {
  return {target_local.ge(begin).logical_and(target_local.lt(begin + width)),
          (target_local - begin).clamp(0, width - 1).unsqueeze(1)};
}

// Replaces each row's target entry of `values` [rows, width] by f(entry)
// where the target is in the chunk (the other rows rewrite their own value).
template <typename F>
void update_target_entries_(at::Tensor& values, const TargetColumns& at_target, F f) {
  const at::Tensor current = values.gather(1, at_target.column).squeeze(1);
  const at::Tensor updated =
      at::where(at_target.here, f(current).to(values.scalar_type()), current);
  values.scatter_(1, at_target.column, updated.unsqueeze(1));
}

// Rows [begin, begin + width) of the weight in the loss's column order.
at::Tensor weight_rows_of(const at::Tensor& w, const at::Tensor& kept, int64_t begin,
                          int64_t width) {
  return kept.defined() ? w.index_select(0, kept.narrow(0, begin, width))
                        : w.narrow(0, begin, width);
}

// One chunk of the margin logits: columns [begin, begin + width) of the
// classes in the loss (this rank's shard, or its kept classes).
struct MarginChunk {
  at::Tensor logits;  // [rows, width]: scale * cos, the target's scale * psi(cos)
  NormalizedRows weight_rows;
  TargetColumns at_target;
  at::Tensor target_slope;  // [rows] float64: d psi / d cos of the target
};

MarginChunk margin_chunk(const at::Tensor& x_unit, const at::Tensor& w,
                         const at::Tensor& kept_classes, int64_t begin, int64_t width,
                         const at::Tensor& target_local, const MarginOptions& margin) {
  MarginChunk chunk;
  chunk.weight_rows = normalize_rows(weight_rows_of(w, kept_classes, begin, width));
  chunk.logits = at::mm(x_unit, chunk.weight_rows.unit.t());
  chunk.at_target = target_columns(target_local, begin, width);
  const at::Tensor cos_target = chunk.logits.gather(1, chunk.at_target.column).squeeze(1);
  const TargetMargin psi = target_margin(cos_target, margin);
  chunk.target_slope = psi.slope;
  chunk.logits.mul_(margin.scale);
  update_target_entries_(chunk.logits, chunk.at_target,
                         [&](const at::Tensor&) { return psi.value * margin.scale; });
  return chunk;
}

// Each row's target as a column of the kept classes (-1 where not kept or not
// local), and whether some local target is missing from them.
struct KeptTargets {
  at::Tensor target;   // [rows] int64
  at::Tensor missing;  // 0-d bool
};

KeptTargets targets_among_kept(const at::Tensor& kept, const at::Tensor& target_local) {
  const int64_t k = kept.size(0);
  const at::Tensor local = target_local.ge(0);
  if (k == 0) {
    return {at::full_like(target_local, -1), local.any()};
  }
  const at::Tensor position = at::searchsorted(kept, target_local).clamp_max(k - 1);
  const at::Tensor hit = local.logical_and(kept.index_select(0, position).eq(target_local));
  return {at::where(hit, position, at::full({}, -1, position.options())),
          local.logical_and(hit.logical_not()).any()};
}

// Forward with sampled classes: their targets among the kept classes, and
// this rank's check of its sampled_classes, carried to the gather so that
// every rank raises. On the CPU it is read at once (it names the fault); on
// CUDA it stays on the device (no host wait) and the gather's verdict raises.
void use_kept_classes(CrossEntropyForwardSetup& setup, const at::Tensor& kept) {
  const int64_t k = kept.size(0), local = setup.layout.local;
  KeptTargets among = targets_among_kept(kept, setup.target_local);
  const at::Tensor no = at::zeros({}, kept.options().dtype(at::kBool));
  const at::Tensor out_of_range = k > 0 ? kept.lt(0).logical_or(kept.ge(local)).any() : no;
  const at::Tensor not_increasing =
      k > 1 ? kept.narrow(0, 1, k - 1).le(kept.narrow(0, 0, k - 1)).any() : no;
  const at::Tensor faults = at::stack({out_of_range, not_increasing, among.missing});
  setup.target_local = among.target;
  setup.layout.local = k;  // the classes this rank brings to the loss
  if (kept.is_cuda() && local > 0) {
    setup.check.sampled_classes_bad = faults.any();
    return;
  }
  const at::Tensor host = faults.cpu();
  const bool* bad = host.const_data_ptr<bool>();
  if (bad[0] || bad[1] || bad[2]) {
    setup.check.fail(
        LocalCheck::kSampledClasses,
        c10::str(kMarginForward,
                 ": sampled_classes must be strictly increasing local class indices in ", "[0, ",
                 local, ") holding every target of this rank's shard, got ",
                 bad[0]   ? "an index out of range"
                 : bad[1] ? "indices not strictly increasing"
                          : "a target that is not among them"));
  }
}

at::Tensor x_rows(const at::Tensor& input, int64_t rows) {
  return input.reshape({rows, input.size(-1)}).contiguous();
}

// The gradients in forward over blocks of rows, each holding all the classes
// in the loss (as the fused cross-entropy's, parallel_linear_cross_entropy.h):
// a block's margin logits are made chunk by chunk into one buffer, combined
// over the group (one all-gather per block), turned into d loss / d cos in
// place and multiplied into the unit-input and unit-weight gradients; the
// normalisations' backward runs once at the end. Three GEMMs per row.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> margin_by_row_blocks(
    const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target,
    const MarginOptions& margin, const CrossEntropyOptions& options, const at::Tensor& kept,
    const CrossEntropyForwardSetup& setup, int64_t block_rows, int64_t chunk_size,
    const std::string& group, std::array<bool, 2> output_mask, const CrossEntropyKernels& kernels) {
  const int64_t rows = setup.target_flat.size(0);
  const int64_t columns = setup.layout.local, features = weight.size(1);
  const at::ScalarType acc = setup.acc;
  NormalizedRows x = normalize_rows(x_rows(input, rows));
  const at::Tensor w = weight.contiguous();
  // One block knows the mean's divisor when its coefficients are made; blocks
  // sum their gradients and divide once at the end.
  const bool one_block = block_rows >= rows;
  CrossEntropyOptions coef_options = options;
  if (!one_block) coef_options.reduction = 2;
  const at::Tensor one = at::ones({}, x.unit.options().dtype(at::kDouble));
  const at::Tensor target_flat = target.reshape({rows});
  const bool compute = columns > 0 && setup.check.code == LocalCheck::kOk;

  at::Tensor grad_unit, grad_weight;
  if (output_mask[0]) grad_unit = at::zeros({rows, features}, x.unit.options().dtype(acc));
  if (output_mask[1]) grad_weight = at::empty({columns, features}, w.options());
  std::vector<at::Tensor> saved_blocks;
  std::shared_ptr<comm::CommHandle> pending_reduce;
  for (int64_t begin = 0; begin < rows; begin += block_rows) {
    const int64_t count = std::min(block_rows, rows - begin);
    const CrossEntropyForwardSetup block = rows_of_setup(setup, begin, count);
    const at::Tensor xb = x.unit.narrow(0, begin, count);
    at::Tensor stats = fresh_row_stats(count, block, input.device());
    at::Tensor values, slope;
    if (compute) {
      values = at::empty({count, columns}, xb.options());
      slope = at::zeros({count}, xb.options().dtype(at::kDouble));
      for (int64_t c0 = 0; c0 < columns; c0 += chunk_size) {
        const int64_t width = std::min(chunk_size, columns - c0);
        const MarginChunk chunk = margin_chunk(xb, w, kept, c0, width, block.target_local, margin);
        values.narrow(1, c0, width).copy_(chunk.logits);
        slope = at::where(chunk.at_target.here, chunk.target_slope, slope);
      }
      kernels.accumulate_row_stats(values, 0, block.target_local, at::Tensor(), stats,
                                   at::Tensor());
    }
    saved_blocks.push_back(combine_over_group(block, stats, options, kWithGradients));
    if (compute) {
      const CrossEntropyBackwardSetup coefs = prepare_cross_entropy_backward(
          one, saved_blocks.back(), target_flat.narrow(0, begin, count), std::nullopt, coef_options,
          weight.size(0), acc, kWithGradients);
      // block.target_local: the targets among the loss's columns (kept ones).
      kernels.softmax_grad_inplace(values, 0, block.target_local, at::Tensor(), coefs.coefs);
      update_target_entries_(values, target_columns(block.target_local, 0, columns),
                             [&](const at::Tensor& g) { return g.to(at::kDouble) * slope; });
      values.mul_(margin.scale);
      for (int64_t c0 = 0; c0 < columns; c0 += chunk_size) {
        const int64_t width = std::min(chunk_size, columns - c0);
        const at::Tensor g = values.narrow(1, c0, width);
        if (output_mask[0]) {
          const at::Tensor w_unit = normalize_rows(weight_rows_of(w, kept, c0, width)).unit;
          at::Tensor rows_of_grad = grad_unit.narrow(0, begin, count);
          if (g.scalar_type() == acc) {
            rows_of_grad.addmm_(g, w_unit);
          } else {
            rows_of_grad.add_(at::mm(g, w_unit));
          }
        }
        if (output_mask[1]) {
          at::Tensor rows_of_grad = grad_weight.narrow(0, c0, width);
          if (begin == 0) {
            at::mm_out(rows_of_grad, g.t(), xb);
          } else {
            rows_of_grad.addmm_(g.t(), xb);
          }
        }
      }
    }
    // Each rank's classes contribute a part; the sum travels while the last
    // weight rows are normalised back.
    if (begin + count >= rows && output_mask[0]) {
      pending_reduce = comm::communicator_for(group, input.device(), kWithGradients)
                           ->all_reduce_async(grad_unit);
    }
  }
  if (output_mask[1] && compute) {
    for (int64_t c0 = 0; c0 < columns; c0 += chunk_size) {
      const int64_t width = std::min(chunk_size, columns - c0);
      at::Tensor rows_of_grad = grad_weight.narrow(0, c0, width);
      normalize_backward_(rows_of_grad, normalize_rows(weight_rows_of(w, kept, c0, width)));
    }
  }
  at::Tensor grad_input;
  if (output_mask[0]) {
    pending_reduce->wait();
    normalize_backward_(grad_unit, x);
    grad_input = grad_unit.to(input.scalar_type()).view(input.sizes());
  }
  at::Tensor saved = join_saved_row_blocks(saved_blocks);
  if (!one_block && options.reduction == 1) {
    const at::Tensor factor = mean_divisor_factor(saved);
    for (at::Tensor* g : {&grad_input, &grad_weight}) {
      if (g->defined()) g->mul_(factor);
    }
  }
  at::Tensor loss = reduce_loss(saved, target, options, input.scalar_type());
  return {loss, saved, grad_input, grad_weight};
}

// The kept classes as row indices of the weight. On CUDA their check is not
// read before use (use_kept_classes): clamped, so that bad ones index rows
// that exist (the loss is NaN and the verdict raises) and never fault.
at::Tensor kept_row_indices(const at::Tensor& sampled_classes, int64_t local) {
  const at::Tensor kept = sampled_classes.contiguous();
  return kept.is_cuda() && local > 0 ? kept.clamp(0, local - 1) : kept;
}

// What both forwards derive before touching data: the checked arguments, the
// forward setup and, with sampling, the kept classes (one host read).
struct MarginForwardSetup {
  CrossEntropyForwardSetup setup;
  at::Tensor kept;  // undefined without sampling
};

MarginForwardSetup prepare_margin_forward(const at::Tensor& input, const at::Tensor& weight,
                                          const at::Tensor& target, const MarginOptions& margin,
                                          const CrossEntropyOptions& options,
                                          const std::optional<at::Tensor>& sampled_classes,
                                          int64_t chunk_size, const std::string& group,
                                          std::optional<int64_t> num_classes, const char* op) {
  check_parallel_linear_margin_cross_entropy_args(input, weight, target, margin, options,
                                                  sampled_classes, chunk_size, op);
  MarginForwardSetup prepared;
  prepared.setup =
      prepare_cross_entropy_forward(group, input.device(), input.scalar_type(), weight.size(0),
                                    num_classes, target, std::nullopt, options, op);
  if (is_sampled(sampled_classes)) {
    const int64_t local = prepared.setup.layout.local;
    use_kept_classes(prepared.setup, sampled_classes->contiguous());
    prepared.kept = kept_row_indices(*sampled_classes, local);
  }
  return prepared;
}

// The loss's statistics chunk by chunk (only one chunk of logits lives at a
// time), combined over the group -> (loss, row_stats).
std::tuple<at::Tensor, at::Tensor> margin_forward_by_chunks(
    const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target,
    const MarginOptions& margin, const CrossEntropyOptions& options,
    const MarginForwardSetup& prepared, int64_t chunk_size, const CrossEntropyKernels& kernels,
    const char* op) {
  const CrossEntropyForwardSetup& setup = prepared.setup;
  const int64_t rows = setup.target_flat.size(0), columns = setup.layout.local;
  const NormalizedRows x = normalize_rows(x_rows(input, rows));
  const at::Tensor w = weight.contiguous();
  at::Tensor stats = fresh_row_stats(rows, setup, input.device());
  for (int64_t begin = 0; setup.check.code == LocalCheck::kOk && begin < columns;
       begin += chunk_size) {
    const int64_t width = std::min(chunk_size, columns - begin);
    const MarginChunk chunk =
        margin_chunk(x.unit, w, prepared.kept, begin, width, setup.target_local, margin);
    kernels.accumulate_row_stats(chunk.logits, begin, setup.target_local, at::Tensor(), stats,
                                 at::Tensor());
  }
  at::Tensor saved = combine_over_group(setup, stats, options, op);
  at::Tensor loss = reduce_loss(saved, target, options, input.scalar_type());
  return {loss, saved};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> parallel_linear_margin_cross_entropy_forward_impl(
    const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target,
    const MarginOptions& margin, const CrossEntropyOptions& options,
    const std::optional<at::Tensor>& sampled_classes, int64_t chunk_size, const std::string& group,
    std::optional<int64_t> num_classes, const CrossEntropyKernels& kernels) {
  const MarginForwardSetup prepared =
      prepare_margin_forward(input, weight, target, margin, options, sampled_classes, chunk_size,
                             group, num_classes, kMarginForward);
  return margin_forward_by_chunks(input, weight, target, margin, options, prepared, chunk_size,
                                  kernels, kMarginForward);
}

std::tuple<at::Tensor, at::Tensor> parallel_linear_margin_cross_entropy_backward_impl(
    const at::Tensor& grad_loss, const at::Tensor& input, const at::Tensor& weight,
    const at::Tensor& row_stats, const at::Tensor& target, const MarginOptions& margin,
    const CrossEntropyOptions& options, const std::optional<at::Tensor>& sampled_classes,
    int64_t chunk_size, const std::string& group, std::array<bool, 2> output_mask,
    const CrossEntropyKernels& kernels) {
  check_margin_options(margin, kMarginBackward);
  TORCH_CHECK(chunk_size >= 1, kMarginBackward, ": chunk_size must be >= 1, got ", chunk_size);
  const int64_t rows = leading_rows(input).guard_int(__FILE__, __LINE__);
  const int64_t features = weight.size(1);
  check_saved_row_stats(row_stats, rows, kMarginBackward);
  const at::ScalarType acc = cross_entropy_accumulate_type(input.scalar_type());
  CrossEntropyBackwardSetup setup = prepare_cross_entropy_backward(
      grad_loss, row_stats, target, std::nullopt, options, weight.size(0), acc, kMarginBackward);
  at::Tensor kept;
  int64_t columns = weight.size(0);
  if (is_sampled(sampled_classes)) {
    setup.target_local =
        targets_among_kept(sampled_classes->contiguous(), setup.target_local).target;
    kept = kept_row_indices(*sampled_classes, weight.size(0));
    columns = kept.size(0);
  }

  NormalizedRows x = normalize_rows(x_rows(input, rows));
  const at::Tensor w = weight.contiguous();
  // The gradient of the unit input rows, summed over chunks (and ranks) in
  // the stats dtype, so that reduced-precision inputs keep small chunks'
  // contributions.
  at::Tensor grad_unit, grad_weight;
  if (output_mask[0]) grad_unit = at::zeros({rows, features}, x.unit.options().dtype(acc));
  if (output_mask[1]) grad_weight = at::empty({columns, features}, w.options());
  std::shared_ptr<comm::CommHandle> pending_reduce;
  auto reduce_grad_unit = [&] {
    pending_reduce =
        comm::communicator_for(group, input.device(), kMarginBackward)->all_reduce_async(grad_unit);
  };
  for (int64_t begin = 0; begin < columns; begin += chunk_size) {
    const int64_t width = std::min(chunk_size, columns - begin);
    MarginChunk chunk = margin_chunk(x.unit, w, kept, begin, width, setup.target_local, margin);
    at::Tensor& grad = chunk.logits;  // d loss / d logits, then d loss / d cos, in place
    kernels.softmax_grad_inplace(grad, begin, setup.target_local, at::Tensor(), setup.coefs);
    update_target_entries_(grad, chunk.at_target, [&](const at::Tensor& g) {
      return g.to(at::kDouble) * chunk.target_slope;
    });
    grad.mul_(margin.scale);
    const at::Tensor& w_unit = chunk.weight_rows.unit;
    if (output_mask[0]) {
      if (grad.scalar_type() == acc) {
        grad_unit.addmm_(grad, w_unit);
      } else {
        grad_unit.add_(at::mm(grad, w_unit));
      }
      // Each rank's classes contribute a part; the sum travels while the last
      // chunk's weight gradient is computed.
      if (begin + chunk_size >= columns) reduce_grad_unit();
    }
    if (output_mask[1]) {
      // Written in place: a row slice of the contiguous gradient is contiguous.
      at::Tensor rows_of_grad = grad_weight.narrow(0, begin, width);
      at::mm_out(rows_of_grad, grad.t(), x.unit);
      normalize_backward_(rows_of_grad, chunk.weight_rows);
    }
  }
  at::Tensor grad_input;
  if (output_mask[0]) {
    if (!pending_reduce) reduce_grad_unit();  // no class here: still join the sum
    pending_reduce->wait();
    normalize_backward_(grad_unit, x);
    grad_input = grad_unit.to(input.scalar_type()).view(input.sizes());
  }
  return {grad_input, grad_weight};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>
parallel_linear_margin_cross_entropy_forward_with_gradients_impl(
    const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target,
    const MarginOptions& margin, const CrossEntropyOptions& options,
    const std::optional<at::Tensor>& sampled_classes, int64_t chunk_size, const std::string& group,
    std::optional<int64_t> num_classes, std::array<bool, 2> output_mask,
    const CrossEntropyKernels& kernels) {
  TORCH_CHECK(options.reduction != 0, kWithGradients,
              ": needs reduction mean or sum (a scalar loss), got reduction none");
  const int64_t rows = leading_rows(input).guard_int(__FILE__, __LINE__);
  const MarginForwardSetup prepared =
      prepare_margin_forward(input, weight, target, margin, options, sampled_classes, chunk_size,
                             group, num_classes, kWithGradients);
  const CrossEntropyForwardSetup& setup = prepared.setup;
  const at::Tensor& kept = prepared.kept;
  // Decided from the most columns any rank brings, so that every rank makes
  // the same collectives: the largest shard, or with sampling (where ranks
  // keep different counts) the largest count kept, one tiny all-gather.
  int64_t most_columns = 0;
  if (kept.defined()) {
    for (int64_t n :
         comm::exchange_sizes(*setup.communicator, setup.layout.local, input.device())) {
      most_columns = std::max(most_columns, n);
    }
  } else {
    most_columns = topology::shard_size(setup.layout.num_classes, setup.communicator->size(), 0);
  }
  const int64_t block_rows =
      parallel_linear_cross_entropy_gradient_block_rows(rows, most_columns, chunk_size);
  if (block_rows > 0) {
    return margin_by_row_blocks(input, weight, target, margin, options, kept, setup, block_rows,
                                chunk_size, group, output_mask, kernels);
  }
  // Blocks would be too thin: the logits computed twice, chunk by chunk.
  auto [loss, saved] = margin_forward_by_chunks(input, weight, target, margin, options, prepared,
                                                chunk_size, kernels, kWithGradients);
  auto [grad_input, grad_weight] = parallel_linear_margin_cross_entropy_backward_impl(
      at::ones({}, input.options().dtype(at::kDouble)), input, weight, saved, target, margin,
      options, sampled_classes, chunk_size, group, output_mask, kernels);
  return {loss, saved, grad_input, grad_weight};
}

}  // namespace ops
}  // namespace shardtorch
