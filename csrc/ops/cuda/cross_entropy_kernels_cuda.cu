// Parallel cross-entropy on CUDA. The forward pass reads each logit once
// (online max / sum-exp, target logit, weighted sum, and the copy into the
// backward buffer in the same read); the backward pass reads and writes the
// buffer once. A row is split over several blocks when there are too few rows
// to fill the GPU (64 rows over 1M classes would leave most SMs idle with one
// block per row): each block reduces its columns and a small second kernel
// merges the blocks of a row. Half and bfloat16 rows are read 16 bytes at a
// time where their alignment allows. Collectives go through NCCL (the CUDA
// communicator); the fused classifier's chunk products through cuBLASLt.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <torch/library.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "ops/cross_entropy/cross_entropy_kernel_adapter.h"
#include "ops/cross_entropy/cross_entropy_kernels.h"
#include "ops/cross_entropy/margin_cross_entropy_kernel_adapter.h"
#include "ops/cuda/cublaslt_gemm.h"

namespace shardtorch {
namespace ops {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// max, sum-exp, weighted sum of one block's columns, and a probability
// target's A and B (B relative to the block's shift, cross_entropy_kernels.h)
constexpr int kPartialStats = 5;
constexpr int kMaxSplits = 65535;  // gridDim.y

template <typename acc_t>
struct MaxSum {
  acc_t max;
  acc_t sum;
};

template <typename acc_t>
__device__ __forceinline__ MaxSum<acc_t> merge(MaxSum<acc_t> a, MaxSum<acc_t> b) {
  const acc_t m = a.max > b.max ? a.max : b.max;
  if (m == -std::numeric_limits<acc_t>::infinity()) return {m, acc_t(0)};
  return {m, a.sum * exp(a.max - m) + b.sum * exp(b.max - m)};
}

// One value into a running (max, sum-exp): one exp per value.
template <typename acc_t>
__device__ __forceinline__ void accumulate(MaxSum<acc_t>& s, acc_t v) {
  if (v == -std::numeric_limits<acc_t>::infinity()) return;
  if (v > s.max) {
    s.sum = s.sum * exp(s.max - v) + acc_t(1);
    s.max = v;
  } else {
    s.sum += exp(v - s.max);
  }
}

template <typename acc_t>
__device__ __forceinline__ MaxSum<acc_t> warp_merge(MaxSum<acc_t> v) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    MaxSum<acc_t> other{__shfl_down_sync(0xffffffffu, v.max, offset),
                        __shfl_down_sync(0xffffffffu, v.sum, offset)};
    v = merge(v, other);
  }
  return v;
}

template <typename acc_t>
__device__ __forceinline__ acc_t warp_sum(acc_t v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
  return v;
}

// The shift a probability target's B is relative to: the max, or 0 where
// that is -inf (as the CPU kernels' exp_shift).
template <typename acc_t>
__device__ __forceinline__ acc_t shift_of(acc_t max) {
  return max == -std::numeric_limits<acc_t>::infinity() ? acc_t(0) : max;
}

// Folds a part's (a, b), b relative to shift_of(max), into the running
// (a, b), b relative to shift_of(into_max); both moved to the shift of the
// larger max first (the one merge() keeps), so that b never holds sum w p z
// of large logits: the terms keep one sign where w p >= 0. The sums are
// float64 (sum_t) within a block: a row's one large probability would
// swallow the many small ones after it in float32.
template <typename acc_t, typename sum_t>
__device__ __forceinline__ void merge_probability_sums(acc_t into_max, sum_t& a, sum_t& b,
                                                       acc_t max, sum_t part_a, sum_t part_b) {
  const acc_t shift = shift_of(into_max > max ? into_max : max);
  const acc_t into_shift = shift_of(into_max), part_shift = shift_of(max);
  if (shift != into_shift) b -= a * static_cast<sum_t>(shift - into_shift);
  if (shift != part_shift) part_b -= part_a * static_cast<sum_t>(shift - part_shift);
  a += part_a;
  b += part_b;
}

// warp_merge of (max, sum) with a probability target's (a, b) beside it.
template <typename acc_t>
__device__ __forceinline__ void warp_merge_with_probabilities(MaxSum<acc_t>& v, double& a,
                                                              double& b) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    MaxSum<acc_t> other{__shfl_down_sync(0xffffffffu, v.max, offset),
                        __shfl_down_sync(0xffffffffu, v.sum, offset)};
    const double other_a = __shfl_down_sync(0xffffffffu, a, offset);
    const double other_b = __shfl_down_sync(0xffffffffu, b, offset);
    merge_probability_sums(v.max, a, b, other.max, other_a, other_b);
    v = merge(v, other);
  }
}

// kVec values loaded or stored as one (16 bytes for half and bfloat16).
template <typename scalar_t, int kVec>
struct alignas(sizeof(scalar_t) * kVec) Pack {
  scalar_t v[kVec];
};

// Block (row, split) reduces columns [split * slice, min(cols, (split + 1) *
// slice)) of its row into partials[row, split]; slice is a multiple of kVec.
// The block holding the row's target writes its logit and weight to stats.
// probs (row stride probs_stride, unit column stride; nullptr for none): a
// probability target's A and B in the same read of the logits.
template <typename scalar_t, typename prob_t, typename acc_t, int kVec>
__global__ void parallel_cross_entropy_forward_kernel(
    const scalar_t* __restrict__ logits, int64_t cols, int64_t slice, int64_t col_begin,
    const int64_t* __restrict__ target_local, const prob_t* __restrict__ probs,
    int64_t probs_stride, const acc_t* __restrict__ weight_local, acc_t* __restrict__ stats,
    acc_t* __restrict__ partials, scalar_t* __restrict__ copy_to) {
  const int64_t row = blockIdx.x;
  const int64_t begin = static_cast<int64_t>(blockIdx.y) * slice;
  const int64_t end = begin + slice < cols ? begin + slice : cols;
  const scalar_t* x = logits + row * cols;
  scalar_t* copy = copy_to != nullptr ? copy_to + row * cols : nullptr;
  const prob_t* p = probs != nullptr ? probs + row * probs_stride + col_begin : nullptr;
  constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
  MaxSum<acc_t> local{kNegInf, acc_t(0)};
  acc_t weighted = 0;
  // A probability target's sums, b relative to `shift`: this thread's
  // shift_of(local.max), b moved whenever the max grows.
  double a = 0, b = 0;
  acc_t shift = 0;
  for (int64_t j = begin + static_cast<int64_t>(threadIdx.x) * kVec; j < end;
       j += static_cast<int64_t>(blockDim.x) * kVec) {
    Pack<scalar_t, kVec> pack = *reinterpret_cast<const Pack<scalar_t, kVec>*>(x + j);
    if (copy != nullptr) *reinterpret_cast<Pack<scalar_t, kVec>*>(copy + j) = pack;
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const acc_t v = static_cast<acc_t>(pack.v[i]);
      const acc_t w = weight_local != nullptr ? weight_local[col_begin + j + i] : acc_t(1);
      weighted += w * v;
      if (p != nullptr) {
        const acc_t new_shift = shift_of(v > local.max ? v : local.max);
        if (new_shift != shift) {
          b -= a * static_cast<double>(new_shift - shift);
          shift = new_shift;
        }
        // A masked (-inf) logit under a zero probability makes b NaN, as
        // torch's -(p * log_softmax) is.
        const double wp =
            static_cast<double>(w) * static_cast<double>(static_cast<acc_t>(p[j + i]));
        a += wp;
        b += wp * static_cast<double>(v - shift);
      }
      accumulate(local, v);
    }
  }
  if (p != nullptr) {
    warp_merge_with_probabilities(local, a, b);
  } else {
    local = warp_merge(local);
  }
  weighted = warp_sum(weighted);
  __shared__ acc_t shared_max[kWarps], shared_sum[kWarps], shared_weighted[kWarps];
  __shared__ double shared_a[kWarps], shared_b[kWarps];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    shared_max[warp] = local.max;
    shared_sum[warp] = local.sum;
    shared_weighted[warp] = weighted;
    shared_a[warp] = a;
    shared_b[warp] = b;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  MaxSum<acc_t> total{kNegInf, acc_t(0)};
  acc_t total_weighted = 0;
  double total_a = 0, total_b = 0;
  for (int w = 0; w < kWarps; ++w) {
    if (p != nullptr) {
      merge_probability_sums(total.max, total_a, total_b, shared_max[w], shared_a[w], shared_b[w]);
    }
    total = merge(total, MaxSum<acc_t>{shared_max[w], shared_sum[w]});
    total_weighted += shared_weighted[w];
  }
  acc_t* part = partials + (row * gridDim.y + blockIdx.y) * kPartialStats;
  part[0] = total.max;
  part[1] = total.sum;
  part[2] = total_weighted;
  part[3] = static_cast<acc_t>(total_a);
  part[4] = static_cast<acc_t>(total_b);
  const int64_t t = target_local[row] - col_begin;
  if (t >= begin && t < end) {
    acc_t* s = stats + row * kNumRowStats;
    s[kRowTargetLogit] = static_cast<acc_t>(x[t]);
    s[kRowTargetWeight] = weight_local != nullptr ? weight_local[col_begin + t] : acc_t(1);
  }
}

// Folds the blocks of each row (and what earlier chunks left in stats)
// together; `probabilities`: a probability target's A and B too.
template <typename acc_t>
__global__ void merge_row_partials_kernel(const acc_t* __restrict__ partials, int64_t splits,
                                          int64_t rows, bool probabilities,
                                          acc_t* __restrict__ stats) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= rows) return;
  acc_t* s = stats + row * kNumRowStats;
  MaxSum<acc_t> total{s[kRowMax], s[kRowSumExp]};
  acc_t weighted = s[kRowWeightedSum];
  acc_t a = s[kRowTargetWeight], b = s[kRowTargetLogit];
  for (int64_t split = 0; split < splits; ++split) {
    const acc_t* part = partials + (row * splits + split) * kPartialStats;
    if (probabilities) merge_probability_sums(total.max, a, b, part[0], part[3], part[4]);
    total = merge(total, MaxSum<acc_t>{part[0], part[1]});
    weighted += part[2];
  }
  s[kRowMax] = total.max;
  s[kRowSumExp] = total.sum;
  s[kRowWeightedSum] = weighted;
  if (probabilities) {
    s[kRowTargetWeight] = a;
    s[kRowTargetLogit] = b;
  }
}

// probs as in the forward kernel: the term - target_scale w_j p_j, in acc_t
// before the one rounding into the values.
template <typename scalar_t, typename prob_t, typename acc_t, int kVec>
__global__ void parallel_cross_entropy_backward_kernel(
    scalar_t* __restrict__ values, int64_t cols, int64_t slice, int64_t col_begin,
    const int64_t* __restrict__ target_local, const prob_t* __restrict__ probs,
    int64_t probs_stride, const acc_t* __restrict__ weight_local, const acc_t* __restrict__ coefs) {
  const int64_t row = blockIdx.x;
  const int64_t begin = static_cast<int64_t>(blockIdx.y) * slice;
  const int64_t end = begin + slice < cols ? begin + slice : cols;
  scalar_t* v = values + row * cols;
  const prob_t* p = probs != nullptr ? probs + row * probs_stride + col_begin : nullptr;
  const acc_t* c = coefs + row * kNumGradCoefs;
  const acc_t lse = c[kCoefLse], grad_scale = c[kCoefGradScale];
  const acc_t lse_remainder = c[kCoefLseRemainder];
  const acc_t target_scale = c[kCoefTargetScale], smooth = c[kCoefSmoothScale];
  const int64_t t = target_local[row] - col_begin;
  // All three 0: an ignored row (a probability row whose w p sums to 0 has
  // grad_scale 0 alone and keeps its probability term).
  const bool ignored = grad_scale == acc_t(0) && smooth == acc_t(0) && target_scale == acc_t(0);
  for (int64_t j = begin + static_cast<int64_t>(threadIdx.x) * kVec; j < end;
       j += static_cast<int64_t>(blockDim.x) * kVec) {
    auto* slot = reinterpret_cast<Pack<scalar_t, kVec>*>(v + j);
    Pack<scalar_t, kVec> pack = *slot;
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      acc_t g = 0;
      if (!ignored) {
        const acc_t w = weight_local != nullptr ? weight_local[col_begin + j + i] : acc_t(1);
        g = grad_scale * exp((static_cast<acc_t>(pack.v[i]) - lse) - lse_remainder) - smooth * w;
        if (j + i == t) g -= target_scale;
        if (p != nullptr) g -= target_scale * w * static_cast<acc_t>(p[j + i]);
      }
      pack.v[i] = static_cast<scalar_t>(g);
    }
    *slot = pack;
  }
}

template <typename scalar_t>
using acc_type_of = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

// How a [rows, cols] pass is cut: kVec-wide loads where every row start is
// 16-byte aligned, and enough blocks per row to fill the GPU.
struct RowSplit {
  int vec = 1;
  int64_t splits = 1;
  int64_t slice = 0;
};

template <typename scalar_t>
RowSplit split_rows(int64_t rows, int64_t cols, std::initializer_list<const void*> rows_at) {
  constexpr int kWide = 16 / sizeof(scalar_t);
  RowSplit split;
  bool aligned = (cols * static_cast<int64_t>(sizeof(scalar_t))) % 16 == 0;
  for (const void* p : rows_at) {
    aligned = aligned && (p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0);
  }
  split.vec = aligned ? kWide : 1;
  // About four blocks per SM in all, each with at least a few loads per thread.
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t wanted = (4 * sms + rows - 1) / std::max<int64_t>(rows, 1);
  const int64_t per_block = static_cast<int64_t>(kThreads) * split.vec * 4;
  const int64_t most = std::max<int64_t>(1, (cols + per_block - 1) / per_block);
  split.splits = std::max<int64_t>(1, std::min<int64_t>({wanted, most, kMaxSplits}));
  int64_t slice = (cols + split.splits - 1) / split.splits;
  slice = (slice + split.vec - 1) / split.vec * split.vec;
  split.slice = std::max<int64_t>(slice, split.vec);
  split.splits = (cols + split.slice - 1) / split.slice;
  return split;
}

// Calls launch(std::integral_constant<int, kVec>) with the split's load width.
template <typename scalar_t, typename Launch>
void with_vector_width(const RowSplit& split, const Launch& launch) {
  if (split.vec == 1) {
    launch(std::integral_constant<int, 1>());
  } else {
    launch(std::integral_constant<int, 16 / sizeof(scalar_t)>());
  }
}

// The margin head's projection of its weight gradient's rows (see
// CrossEntropyKernels::project_out_rows): one warp per row takes the row's dot
// and updates it, both reads of the row in the warp's registers and L1, no
// temporary of the rows' size and one launch for any number of rows.
template <typename scalar_t, typename acc_t>
__global__ void project_out_rows_kernel(scalar_t* __restrict__ grad,
                                        const scalar_t* __restrict__ rows, int64_t n,
                                        int64_t features, const acc_t* __restrict__ a,
                                        const acc_t* __restrict__ b) {
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= n) return;
  scalar_t* g = grad + row * features;
  const scalar_t* w = rows + row * features;
  acc_t dot = 0;
  for (int64_t c = lane; c < features; c += 32) {
    dot += static_cast<acc_t>(g[c]) * static_cast<acc_t>(w[c]);
  }
  for (int offset = 16; offset > 0; offset /= 2) dot += __shfl_down_sync(0xffffffffu, dot, offset);
  dot = __shfl_sync(0xffffffffu, dot, 0);
  const acc_t scale = a ? a[row] : acc_t(1);
  const acc_t along = dot * b[row];
  for (int64_t c = lane; c < features; c += 32) {
    g[c] =
        static_cast<scalar_t>(scale * static_cast<acc_t>(g[c]) - along * static_cast<acc_t>(w[c]));
  }
}

// A row-major operand as cuBLASLt takes it (column-major): the tensor itself
// when it is contiguous, the contiguous tensor it is a transposed view of
// (the weight gradient's grad^T) marked transposed, else a contiguous copy.
struct GemmOperand {
  at::Tensor data;
  bool transposed;
  int64_t ld;
};

GemmOperand gemm_operand(const at::Tensor& t) {
  if (t.is_contiguous()) return {t, false, t.size(1)};
  const at::Tensor back = t.t();
  if (back.is_contiguous()) return {back, true, back.size(1)};
  const at::Tensor copy = t.contiguous();
  return {copy, false, copy.size(1)};
}

// Calls f(pointer, row stride) with a probability target's data in its own
// dtype (nullptr, 0 and none_t's type where there is none); a target whose
// columns are not adjacent is copied first.
template <typename none_t, typename F>
void with_probabilities(const at::Tensor& target_probs, const F& f) {
  if (!target_probs.defined()) {
    f(static_cast<const none_t*>(nullptr), int64_t{0});
    return;
  }
  const at::Tensor probs = target_probs.size(1) <= 1 || target_probs.stride(1) == 1
                               ? target_probs
                               : target_probs.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, probs.scalar_type(),
                                  "parallel_cross_entropy_probabilities_cuda",
                                  [&] { f(probs.const_data_ptr<scalar_t>(), probs.stride(0)); });
}

class CudaCrossEntropyKernels final : public CrossEntropyKernels {
 public:
  void accumulate_row_stats(const at::Tensor& logits, int64_t col_begin,
                            const at::Tensor& target_local, const at::Tensor& target_probs,
                            const at::Tensor& weight_local, const at::Tensor& stats,
                            const at::Tensor& copy_to) const override {
    const int64_t rows = logits.size(0), cols = logits.size(1);
    if (rows == 0 || cols == 0) return;
    auto stream = at::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, logits.scalar_type(), "parallel_cross_entropy_forward_cuda", [&] {
          using logit_t = scalar_t;
          using acc_t = acc_type_of<logit_t>;
          const RowSplit split = split_rows<logit_t>(
              rows, cols,
              {logits.const_data_ptr(), copy_to.defined() ? copy_to.const_data_ptr() : nullptr});
          at::Tensor partials = at::empty({rows, split.splits, kPartialStats}, stats.options());
          const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(split.splits));
          with_probabilities<logit_t>(target_probs, [&](const auto* probs, int64_t probs_stride) {
            using prob_t = std::remove_cv_t<std::remove_pointer_t<decltype(probs)>>;
            const auto launch = [&](auto vec) {
              constexpr int kVec = decltype(vec)::value;
              parallel_cross_entropy_forward_kernel<logit_t, prob_t, acc_t, kVec>
                  <<<grid, kThreads, 0, stream>>>(
                      logits.const_data_ptr<logit_t>(), cols, split.slice, col_begin,
                      target_local.const_data_ptr<int64_t>(), probs, probs_stride,
                      weight_local.defined() ? weight_local.const_data_ptr<acc_t>() : nullptr,
                      stats.data_ptr<acc_t>(), partials.data_ptr<acc_t>(),
                      copy_to.defined() ? copy_to.data_ptr<logit_t>() : nullptr);
            };
            with_vector_width<logit_t>(split, launch);
          });
          C10_CUDA_KERNEL_LAUNCH_CHECK();
          const int merge_threads = 128;
          merge_row_partials_kernel<acc_t>
              <<<static_cast<unsigned>((rows + merge_threads - 1) / merge_threads), merge_threads,
                 0, stream>>>(partials.const_data_ptr<acc_t>(), split.splits, rows,
                              target_probs.defined(), stats.data_ptr<acc_t>());
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
  }

  void softmax_grad_inplace(const at::Tensor& values, int64_t col_begin,
                            const at::Tensor& target_local, const at::Tensor& target_probs,
                            const at::Tensor& weight_local,
                            const at::Tensor& coefs) const override {
    const int64_t rows = values.size(0), cols = values.size(1);
    if (rows == 0 || cols == 0) return;
    auto stream = at::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, values.scalar_type(), "parallel_cross_entropy_backward_cuda",
        [&] {
          using value_t = scalar_t;
          using acc_t = acc_type_of<value_t>;
          const RowSplit split = split_rows<value_t>(rows, cols, {values.const_data_ptr()});
          const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(split.splits));
          with_probabilities<value_t>(target_probs, [&](const auto* probs, int64_t probs_stride) {
            using prob_t = std::remove_cv_t<std::remove_pointer_t<decltype(probs)>>;
            const auto launch = [&](auto vec) {
              constexpr int kVec = decltype(vec)::value;
              parallel_cross_entropy_backward_kernel<value_t, prob_t, acc_t, kVec>
                  <<<grid, kThreads, 0, stream>>>(
                      values.data_ptr<value_t>(), cols, split.slice, col_begin,
                      target_local.const_data_ptr<int64_t>(), probs, probs_stride,
                      weight_local.defined() ? weight_local.const_data_ptr<acc_t>() : nullptr,
                      coefs.const_data_ptr<acc_t>());
            };
            with_vector_width<value_t>(split, launch);
          });
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
  }

  // cuBLASLt: float16/bfloat16 products accumulated and returned in float32.
  at::Tensor chunk_logits(const at::Tensor& x, const at::Tensor& w_chunk,
                          const at::Tensor& bias_chunk, at::ScalarType out) const override {
    const int64_t rows = x.size(0), features = x.size(1), width = w_chunk.size(0);
    at::Tensor logits = at::empty({rows, width}, x.options().dtype(out));
    if (rows == 0 || width == 0) return logits;
    const at::Tensor bias = bias_chunk.defined() ? bias_chunk.to(out).contiguous() : at::Tensor();
    if (features == 0)
      return bias.defined() ? logits.copy_(bias.expand({rows, width})) : logits.zero_();
    // logits^T [width, rows] = w_chunk [width, f] x^T, column-major.
    cuda::cublaslt_gemm(/*transpose_a=*/true, /*transpose_b=*/false, width, rows, features, w_chunk,
                        features, x, features, logits, width, bias);
    return logits;
  }

  // Straight into the block's columns: `out` is a column range of a
  // row-major block, so its rows are `out.stride(0)` apart, which is the
  // column-major C^T's leading dimension; no temporary, no copy.
  void chunk_logits_into(at::Tensor& out, const at::Tensor& x,
                         const at::Tensor& w_chunk) const override {
    const int64_t rows = x.size(0), features = x.size(1), width = w_chunk.size(0);
    TORCH_CHECK(out.dim() == 2 && out.size(0) == rows && out.size(1) == width,
                "chunk_logits_into: out must be [", rows, ", ", width, "], got ", out.sizes());
    const bool writable = out.stride(1) == 1 && out.stride(0) >= std::max<int64_t>(width, 1) &&
                          x.is_contiguous() && w_chunk.is_contiguous();
    if (!writable) {
      out.copy_(chunk_logits(x, w_chunk, at::Tensor(), out.scalar_type()));
      return;
    }
    if (rows == 0 || width == 0) return;
    if (features == 0) {
      out.zero_();
      return;
    }
    // out^T [width, rows] = w_chunk [width, f] x^T, column-major, ld = out's row stride.
    cuda::cublaslt_gemm(/*transpose_a=*/true, /*transpose_b=*/false, width, rows, features, w_chunk,
                        features, x, features, out, out.stride(0), at::Tensor());
  }

  void add_product(at::Tensor& acc, const at::Tensor& a, const at::Tensor& b) const override {
    product(acc, a, b, /*accumulate=*/true);
  }

  void write_product(at::Tensor& out, const at::Tensor& a, const at::Tensor& b) const override {
    product(out, a, b, /*accumulate=*/false);
  }

  void project_out_rows(at::Tensor& grad_rows, const at::Tensor& rows, const at::Tensor& a,
                        const at::Tensor& b, at::ScalarType acc) const override {
    const int64_t n = rows.size(0), features = rows.size(1);
    const bool row_major = grad_rows.is_contiguous() && rows.is_contiguous() &&
                           grad_rows.scalar_type() == rows.scalar_type();
    if (!row_major) return CrossEntropyKernels::project_out_rows(grad_rows, rows, a, b, acc);
    if (n == 0 || features == 0) return;
    const at::Tensor b_acc = b.to(acc).contiguous();
    const at::Tensor a_acc = a.defined() ? a.to(acc).contiguous() : at::Tensor();
    constexpr int kRowsPerBlock = kThreads / 32;
    const auto blocks = static_cast<unsigned>((n + kRowsPerBlock - 1) / kRowsPerBlock);
    auto stream = at::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, rows.scalar_type(), "margin_project_out_rows_cuda", [&] {
          using acc_t = acc_type_of<scalar_t>;
          TORCH_CHECK(b_acc.scalar_type() == c10::CppTypeToScalarType<acc_t>::value,
                      "project_out_rows: the coefficients must be in the rows' accumulate dtype, "
                      "got ",
                      b_acc.scalar_type());
          project_out_rows_kernel<scalar_t, acc_t><<<blocks, kThreads, 0, stream>>>(
              grad_rows.data_ptr<scalar_t>(), rows.const_data_ptr<scalar_t>(), n, features,
              a_acc.defined() ? a_acc.const_data_ptr<acc_t>() : nullptr,
              b_acc.const_data_ptr<acc_t>());
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
  }

 private:
  static void product(at::Tensor& acc, const at::Tensor& a, const at::Tensor& b, bool accumulate) {
    const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
    if (m == 0 || n == 0) return;
    if (k == 0) {
      if (!accumulate) acc.zero_();
      return;
    }
    // acc^T [n, m] (+)= b^T [n, k] a^T [k, m], column-major; a transposed
    // view (the weight gradient's grad^T) goes to cuBLASLt as such, no copy.
    const GemmOperand A = gemm_operand(a), B = gemm_operand(b);
    cuda::cublaslt_gemm(B.transposed, A.transposed, n, m, k, B.data, B.ld, A.data, A.ld, acc, n,
                        at::Tensor(), accumulate);
  }
};

}  // namespace

// The three losses that run on these kernels, each with its internal ops.
TORCH_LIBRARY_IMPL(shard, CUDA, m) {
  CrossEntropyKernelAdapter<CudaCrossEntropyKernels>::register_parallel_cross_entropy(m);
  CrossEntropyKernelAdapter<CudaCrossEntropyKernels>::register_parallel_linear_cross_entropy(m);
  MarginCrossEntropyKernelAdapter<
      CudaCrossEntropyKernels>::register_parallel_linear_margin_cross_entropy(m);
}

}  // namespace ops
}  // namespace shardtorch
