#include "ops/cross_entropy/parallel_linear_margin_cross_entropy_impl.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <any>
#include <cmath>
#include <optional>

#include "comm/registry.h"
#include "comm/sharded_collectives.h"
#include "ops/cross_entropy/cross_entropy_statistics.h"
#include "ops/recycled_buffers.h"
#include "ops/scratch_buffer.h"
#include "ops/cross_entropy/fused_head_driver.h"
#include "ops/cross_entropy/gemm_precision.h"
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

// Rows of `t` [n, features] divided by their clamped norms (the input rows:
// [rows, features], small beside the weight).
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

at::Tensor input_rows(const at::Tensor& input, int64_t rows) {
  return input.reshape({rows, input.size(-1)}).contiguous();
}

// What the margin head keeps of a range of columns for their gradient.
struct MarginColumns {
  at::Tensor target_slope;  // [rows] float64: d psi / d cos of the target
  // Under autocast, where the range is one chunk: its weight rows cast to the
  // GEMMs' dtype (for the input gradient); else undefined.
  at::Tensor cast_rows;
};

// The margin head: scale * cos of unit input rows and unit weight rows, the
// target's psi(cos). Without sampling its GEMMs take the raw weight rows and
// the normalisation is applied on the small side: cos = (x_unit . w_j) / n_j
// with n_j = max(|w_j|, eps), the norms computed once per call (one float per
// column), the logits' columns and their gradient's scaled by scale / n_j,
// and the weight gradient's rows projected as they are finished
// (finish_weight_rows). With sampling the kept rows are gathered once, at
// their first use (as large as the row-sparse gradient the call returns),
// and for a float32 / float64 weight (not under float16 autocast) already as
// scale * w_j / n_j, their norms taken in the same pass: the GEMMs then give the logits as they are
// and take their gradient as it is (no pass over the logits for the column
// scales, none over the rows for their norms). Under autocast a range of
// columns is cast a chunk at a time, so that no reduced-precision copy has
// the weight's size.
class MarginHead final : public FusedHead {
 public:
  MarginHead(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& kept,
             const MarginOptions& margin, int64_t rows, int64_t chunk_size,
             const CrossEntropyKernels& kernels)
      : x_(normalize_rows(input_rows(input, rows))),
        gemm_(fused_head_gemm_dtype(weight.scalar_type())),
        x_gemm_(gemm_ && x_.unit.scalar_type() == at::kFloat ? x_.unit.to(*gemm_) : x_.unit),
        w_(weight.contiguous()),
        kept_(kept),
        margin_(margin),
        chunk_size_(chunk_size),
        acc_(cross_entropy_accumulate_type(weight.scalar_type())),
        kernels_(kernels),
        rows_are_views_(!gemm_),
        scaled_unit_rows_(kept.defined() && weight.scalar_type() == acc_ && gemm_ != at::kHalf) {}
  int64_t columns() const override { return kept_.defined() ? kept_.size(0) : w_.size(0); }
  // The unit input rows, in the GEMMs' dtype (cast once under autocast).
  const at::Tensor& x_rows() const override { return x_gemm_; }
  at::TensorOptions weight_options() const override { return w_.options(); }

  LogitChunk logits(const at::Tensor& x, int64_t begin, int64_t width,
                    const at::Tensor& target_local) const override {
    const at::ScalarType out = w_.scalar_type();
    at::Tensor cast_rows, values;
    if (rows_are_views_) {
      values = kernels_.chunk_logits(x, rows_of(begin, width), at::Tensor(), out);
    } else if (width <= chunk_size_) {
      cast_rows = gemm_rows(begin, width);
      values = kernels_.chunk_logits(x, cast_rows, at::Tensor(), out);
    } else {
      static BufferSlot* const slot = new BufferSlot();
      values = slot->take({x.size(0), width}, x.options().dtype(out), empty_scratch_buffer);
      for_each_chunk(begin, width, [&](int64_t c0, int64_t w) {
        at::Tensor part = values.narrow(1, c0 - begin, w);
        kernels_.chunk_logits_into(part, x, gemm_rows(c0, w));
      });
    }
    // cos = (x_unit . w_j) / n_j: the target's first (its margin needs the
    // cosine), then every column times scale / n_j in one pass.
    // (Rows gathered as scale * w_j / n_j: the product is that already.)
    const TargetColumns at_target = target_columns(target_local, begin, width);
    const at::Tensor at_target_value =
        values.gather(1, at_target.column).squeeze(1).to(at::kDouble);
    at::Tensor cos_target;
    if (scaled_unit_rows_) {
      cos_target = at_target_value / margin_.scale;
    } else {
      const at::Tensor inverse = inverse_norms(begin, width);
      cos_target =
          at_target_value * inverse.index_select(0, at_target.column.squeeze(1)).to(at::kDouble);
      values.mul_((inverse * margin_.scale).to(out));
    }
    const TargetMargin psi = target_margin(cos_target, margin_);
    update_target_entries_(values, at_target,
                           [&](const at::Tensor&) { return psi.value * margin_.scale; });
    return {values, MarginColumns{psi.slope, cast_rows}};
  }

  // d loss / d cos -> d loss / d (x_unit . w_j): the target's slope, then the
  // scale and 1 / n_j, so that both gradient GEMMs take the raw rows (the
  // gathered rows carry scale / n_j themselves).
  void logit_gradient(LogitChunk& chunk, int64_t begin, int64_t width,
                      const at::Tensor& target_local) const override {
    const at::Tensor& slope = std::any_cast<const MarginColumns&>(chunk.state).target_slope;
    update_target_entries_(chunk.values, target_columns(target_local, begin, width),
                           [&](const at::Tensor& g) { return g.to(at::kDouble) * slope; });
    if (scaled_unit_rows_) return;
    chunk.values.mul_((inverse_norms(begin, width) * margin_.scale).to(chunk.values.scalar_type()));
  }

  void add_input_gradient(at::Tensor& grad_x, const at::Tensor& grad, int64_t begin, int64_t width,
                          const LogitChunk& chunk) const override {
    const at::Tensor& cast_rows = std::any_cast<const MarginColumns&>(chunk.state).cast_rows;
    if (cast_rows.defined()) return kernels_.add_product(grad_x, grad, cast_rows);
    if (rows_are_views_) return kernels_.add_product(grad_x, grad, rows_of(begin, width));
    for_each_chunk(begin, width, [&](int64_t c0, int64_t w) {
      kernels_.add_product(grad_x, grad.narrow(1, c0 - begin, w), gemm_rows(c0, w));
    });
  }

  // The driver's rows are d loss / d w_j taken as if n_j were constant; the
  // normalisation's derivative takes their part along w_j out:
  // g_j -= w_j (w_j . g_j) / n_j^2 where |w_j| >= eps (else n_j is eps, a
  // constant). With rows gathered as v_j = scale * u_j (u_j = w_j / n_j) the
  // driver's rows are G_j = d loss / d v_j and d loss / d w_j =
  // (scale / n_j) (G_j - u_j (u_j . G_j)). One row-wise dot and one in-place
  // update per row. The rows are views (of the weight, or of the kept rows
  // gathered once).
  void finish_weight_rows(at::Tensor& grad_rows, int64_t begin, int64_t width,
                          const LogitChunk* /*chunk*/) const override {
    project_out_rows(grad_rows, rows_of(begin, width), begin);
  }

  void finish_input(at::Tensor& grad_x) const override { normalize_backward_(grad_x, x_); }

 private:
  template <typename F>
  void for_each_chunk(int64_t begin, int64_t width, F f) const {
    for (int64_t c0 = begin; c0 < begin + width; c0 += chunk_size_) {
      f(c0, std::min(chunk_size_, begin + width - c0));
    }
  }

  // Rows [begin, begin + width) of the weight in the loss's column order: a
  // view of the weight, or of the kept rows gathered at the first use (not
  // before: kept classes that failed their check must not be gathered).
  at::Tensor rows_of(int64_t begin, int64_t width) const {
    if (!kept_.defined()) return w_.narrow(0, begin, width);
    if (!gathered_.defined()) gather_kept_rows();
    return gathered_.narrow(0, begin, width);
  }

  // The kept rows, as they are or (scaled_unit_rows_) as scale * w_j / n_j
  // with their norms: in one pass over each row on the CPU.
  void gather_kept_rows() const {
    static BufferSlot* const slot = new BufferSlot();
    gathered_ = slot->take({kept_.size(0), w_.size(1)}, w_.options(), empty_scratch_buffer);
    if (!scaled_unit_rows_) {
      at::index_select_out(gathered_, w_, 0, kept_);
      return;
    }
    norms_ = at::empty({kept_.size(0)}, w_.options());
    kernels_.gather_scaled_unit_rows(gathered_, norms_, w_, kept_, margin_.scale, kNormEps);
  }

  // Under autocast: rows [begin, begin + width) cast to the GEMMs' dtype.
  at::Tensor gemm_rows(int64_t begin, int64_t width) const {
    return rows_of(begin, width).to(*gemm_);
  }

  // |w_j| of columns [begin, begin + width), unclamped, in the accumulate
  // dtype. Made for every column at the first use, in one pass over the rows
  // (a chunk at a time where they must be upcast).
  at::Tensor norms(int64_t begin, int64_t width) const {
    if (scaled_unit_rows_ && !gathered_.defined()) gather_kept_rows();
    if (!norms_.defined()) {
      if (w_.scalar_type() == acc_) {
        norms_ = at::linalg_vector_norm(rows_of(0, columns()), 2, {1});
      } else {
        norms_ = at::empty({columns()}, w_.options().dtype(acc_));
        for_each_chunk(0, columns(), [&](int64_t c0, int64_t w) {
          at::Tensor out = norms_.narrow(0, c0, w);
          at::linalg_vector_norm_out(out, rows_of(c0, w).to(acc_), 2, {1});
        });
      }
    }
    return norms_.narrow(0, begin, width);
  }

  // 1 / max(|w_j|, eps) of columns [begin, begin + width).
  at::Tensor inverse_norms(int64_t begin, int64_t width) const {
    return norms(begin, width).clamp_min(kNormEps).reciprocal();
  }

  // grad_rows [n, features] = a_j grad_rows_j - b_j rows_j (rows_j . grad_rows_j)
  // for columns [begin, begin + n): raw rows, a_j = 1 and b_j = 1 / n_j^2;
  // rows v_j = scale * w_j / n_j, a_j = scale / n_j and b_j = 1 / (scale n_j);
  // b_j = 0 where |w_j| < eps (n_j is then eps, a constant). The kernels
  // take each row's dot and update in one pass where they can.
  void project_out_rows(at::Tensor& grad_rows, const at::Tensor& rows, int64_t begin) const {
    const int64_t n = rows.size(0);
    const at::Tensor norms = this->norms(begin, n);
    const at::Tensor unclamped = norms.ge(kNormEps);
    at::Tensor a, b;  // [n], small
    if (scaled_unit_rows_) {
      a = norms.clamp_min(kNormEps).reciprocal().mul_(margin_.scale);
      b = at::where(unclamped, (norms * margin_.scale).reciprocal(), 0.0);
    } else {
      b = at::where(unclamped, (norms * norms).reciprocal(), 0.0);
    }
    kernels_.project_out_rows(grad_rows, rows, a, b, acc_);
  }

  NormalizedRows x_;
  std::optional<at::ScalarType> gemm_;  // the autocast GEMM dtype, if any
  at::Tensor x_gemm_;                   // x_.unit in the GEMMs' dtype
  at::Tensor w_, kept_;
  MarginOptions margin_;
  int64_t chunk_size_;
  at::ScalarType acc_;
  const CrossEntropyKernels& kernels_;
  // Columns' weight rows are slices of the weight (or of the gathered kept
  // rows) as the GEMMs take them (no cast): any range is one GEMM, no copy.
  bool rows_are_views_;
  // With sampling, for a float32 / float64 weight: the kept rows are
  // gathered as scale * w_j / n_j (gather_kept_rows). Not under float16
  // autocast: the logits' gradient would then be cast to float16 without its
  // factor scale / n_j (about 2^8 with PartialFC's weights) and its small
  // values would lose their bits among float16's subnormals.
  bool scaled_unit_rows_;
  mutable at::Tensor gathered_;  // with sampling: the kept rows [columns, features]
  mutable at::Tensor norms_;     // [columns] |w_j|, unclamped (the projection's mask needs it)
};

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

// The backward's coefficients and targets, the targets as columns of the kept
// classes where sampled.
CrossEntropyBackwardSetup margin_backward_setup(const at::Tensor& grad_loss,
                                                const at::Tensor& row_stats,
                                                const at::Tensor& target,
                                                const CrossEntropyOptions& options,
                                                const std::optional<at::Tensor>& sampled_classes,
                                                int64_t local, at::ScalarType acc, const char* op) {
  CrossEntropyBackwardSetup setup = prepare_cross_entropy_backward(
      grad_loss, row_stats, target, std::nullopt, options, local, acc, op);
  if (is_sampled(sampled_classes)) {
    setup.target_local =
        targets_among_kept(sampled_classes->contiguous(), setup.target_local).target;
  }
  return setup;
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
  const MarginHead head(input, weight, prepared.kept, margin, prepared.setup.target_flat.size(0),
                        chunk_size, kernels);
  return fused_head_forward_by_chunks(head, input, target, options, prepared.setup, chunk_size,
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
  check_saved_row_stats(row_stats, rows, kMarginBackward);
  const at::ScalarType acc = cross_entropy_accumulate_type(input.scalar_type());
  at::Tensor kept;
  if (is_sampled(sampled_classes)) kept = kept_row_indices(*sampled_classes, weight.size(0));
  const MarginHead head(input, weight, kept, margin, rows, chunk_size, kernels);
  const FusedHeadResult grads = fused_head_backward_by_chunks(
      head, input,
      margin_backward_setup(grad_loss, row_stats, target, options, sampled_classes, weight.size(0),
                            acc, kMarginBackward),
      chunk_size, group, {output_mask[0], output_mask[1], false}, kernels, kMarginBackward);
  return {grads.grad_input, grads.grad_weight};
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
  const MarginForwardSetup prepared =
      prepare_margin_forward(input, weight, target, margin, options, sampled_classes, chunk_size,
                             group, num_classes, kWithGradients);
  const CrossEntropyForwardSetup& setup = prepared.setup;
  // The most columns any rank brings, which every rank must know alike: the
  // largest shard, or with sampling (where ranks keep different counts) the
  // largest count kept, one tiny all-gather.
  int64_t max_columns = 0;
  if (prepared.kept.defined()) {
    for (int64_t n :
         comm::exchange_sizes(*setup.communicator, setup.layout.local, input.device())) {
      max_columns = std::max(max_columns, n);
    }
  } else {
    max_columns = topology::shard_size(setup.layout.num_classes, setup.communicator->size(), 0);
  }
  const MarginHead head(input, weight, prepared.kept, margin, setup.target_flat.size(0), chunk_size,
                        kernels);
  const FusedHeadResult out = fused_head_forward_with_gradients(
      head, input, target, options, setup, max_columns, chunk_size, group,
      {output_mask[0], output_mask[1], false}, kernels, kWithGradients,
      [&](const at::Tensor& grad_loss, const at::Tensor& row_stats) {
        return margin_backward_setup(grad_loss, row_stats, target, options, sampled_classes,
                                     weight.size(0), setup.acc, kWithGradients);
      });
  return {out.loss, out.row_stats, out.grad_input, out.grad_weight};
}

}  // namespace ops
}  // namespace shardtorch
