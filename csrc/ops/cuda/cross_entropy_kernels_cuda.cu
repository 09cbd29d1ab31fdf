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
constexpr int kPartialStats = 3;   // max, sum-exp, weighted sum of one block's columns
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

// kVec values loaded or stored as one (16 bytes for half and bfloat16).
template <typename scalar_t, int kVec>
struct alignas(sizeof(scalar_t) * kVec) Pack {
  scalar_t v[kVec];
};

// Block (row, split) reduces columns [split * slice, min(cols, (split + 1) *
// slice)) of its row into partials[row, split]; slice is a multiple of kVec.
// The block holding the row's target writes its logit and weight to stats.
template <typename scalar_t, typename acc_t, int kVec>
__global__ void parallel_cross_entropy_forward_kernel(
    const scalar_t* __restrict__ logits, int64_t cols, int64_t slice, int64_t col_begin,
    const int64_t* __restrict__ target_local, const acc_t* __restrict__ weight_local,
    acc_t* __restrict__ stats, acc_t* __restrict__ partials, scalar_t* __restrict__ copy_to) {
  const int64_t row = blockIdx.x;
  const int64_t begin = static_cast<int64_t>(blockIdx.y) * slice;
  const int64_t end = begin + slice < cols ? begin + slice : cols;
  const scalar_t* x = logits + row * cols;
  scalar_t* copy = copy_to != nullptr ? copy_to + row * cols : nullptr;
  constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
  MaxSum<acc_t> local{kNegInf, acc_t(0)};
  acc_t weighted = 0;
  for (int64_t j = begin + static_cast<int64_t>(threadIdx.x) * kVec; j < end;
       j += static_cast<int64_t>(blockDim.x) * kVec) {
    Pack<scalar_t, kVec> pack = *reinterpret_cast<const Pack<scalar_t, kVec>*>(x + j);
    if (copy != nullptr) *reinterpret_cast<Pack<scalar_t, kVec>*>(copy + j) = pack;
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const acc_t v = static_cast<acc_t>(pack.v[i]);
      weighted += (weight_local != nullptr ? weight_local[col_begin + j + i] : acc_t(1)) * v;
      accumulate(local, v);
    }
  }
  local = warp_merge(local);
  weighted = warp_sum(weighted);
  __shared__ acc_t shared_max[kWarps], shared_sum[kWarps], shared_weighted[kWarps];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    shared_max[warp] = local.max;
    shared_sum[warp] = local.sum;
    shared_weighted[warp] = weighted;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  MaxSum<acc_t> total{kNegInf, acc_t(0)};
  acc_t total_weighted = 0;
  for (int w = 0; w < kWarps; ++w) {
    total = merge(total, MaxSum<acc_t>{shared_max[w], shared_sum[w]});
    total_weighted += shared_weighted[w];
  }
  acc_t* p = partials + (row * gridDim.y + blockIdx.y) * kPartialStats;
  p[0] = total.max;
  p[1] = total.sum;
  p[2] = total_weighted;
  const int64_t t = target_local[row] - col_begin;
  if (t >= begin && t < end) {
    acc_t* s = stats + row * kNumRowStats;
    s[kRowTargetLogit] = static_cast<acc_t>(x[t]);
    s[kRowTargetWeight] = weight_local != nullptr ? weight_local[col_begin + t] : acc_t(1);
  }
}

// Folds the blocks of each row (and what earlier chunks left in stats) together.
template <typename acc_t>
__global__ void merge_row_partials_kernel(const acc_t* __restrict__ partials, int64_t splits,
                                          int64_t rows, acc_t* __restrict__ stats) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= rows) return;
  acc_t* s = stats + row * kNumRowStats;
  MaxSum<acc_t> total{s[kRowMax], s[kRowSumExp]};
  acc_t weighted = s[kRowWeightedSum];
  for (int64_t split = 0; split < splits; ++split) {
    const acc_t* p = partials + (row * splits + split) * kPartialStats;
    total = merge(total, MaxSum<acc_t>{p[0], p[1]});
    weighted += p[2];
  }
  s[kRowMax] = total.max;
  s[kRowSumExp] = total.sum;
  s[kRowWeightedSum] = weighted;
}

template <typename scalar_t, typename acc_t, int kVec>
__global__ void parallel_cross_entropy_backward_kernel(scalar_t* __restrict__ values, int64_t cols,
                                                       int64_t slice, int64_t col_begin,
                                                       const int64_t* __restrict__ target_local,
                                                       const acc_t* __restrict__ weight_local,
                                                       const acc_t* __restrict__ coefs) {
  const int64_t row = blockIdx.x;
  const int64_t begin = static_cast<int64_t>(blockIdx.y) * slice;
  const int64_t end = begin + slice < cols ? begin + slice : cols;
  scalar_t* v = values + row * cols;
  const acc_t* c = coefs + row * kNumGradCoefs;
  const acc_t lse = c[kCoefLse], grad_scale = c[kCoefGradScale];
  const acc_t lse_remainder = c[kCoefLseRemainder];
  const acc_t target_scale = c[kCoefTargetScale], smooth = c[kCoefSmoothScale];
  const int64_t t = target_local[row] - col_begin;
  const bool ignored = grad_scale == acc_t(0) && smooth == acc_t(0);
  for (int64_t j = begin + static_cast<int64_t>(threadIdx.x) * kVec; j < end;
       j += static_cast<int64_t>(blockDim.x) * kVec) {
    auto* slot = reinterpret_cast<Pack<scalar_t, kVec>*>(v + j);
    Pack<scalar_t, kVec> pack = *slot;
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      acc_t g = 0;
      if (!ignored) {
        g = grad_scale * exp((static_cast<acc_t>(pack.v[i]) - lse) - lse_remainder) -
            smooth * (weight_local != nullptr ? weight_local[col_begin + j + i] : acc_t(1));
        if (j + i == t) g -= target_scale;
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

class CudaCrossEntropyKernels final : public CrossEntropyKernels {
 public:
  void accumulate_row_stats(const at::Tensor& logits, int64_t col_begin,
                            const at::Tensor& target_local, const at::Tensor& weight_local,
                            const at::Tensor& stats, const at::Tensor& copy_to) const override {
    const int64_t rows = logits.size(0), cols = logits.size(1);
    if (rows == 0 || cols == 0) return;
    auto stream = at::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, logits.scalar_type(), "parallel_cross_entropy_forward_cuda", [&] {
          using acc_t = acc_type_of<scalar_t>;
          const RowSplit split = split_rows<scalar_t>(
              rows, cols,
              {logits.const_data_ptr(), copy_to.defined() ? copy_to.const_data_ptr() : nullptr});
          at::Tensor partials = at::empty({rows, split.splits, kPartialStats}, stats.options());
          const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(split.splits));
          const auto launch = [&](auto vec) {
            constexpr int kVec = decltype(vec)::value;
            parallel_cross_entropy_forward_kernel<scalar_t, acc_t, kVec>
                <<<grid, kThreads, 0, stream>>>(
                    logits.const_data_ptr<scalar_t>(), cols, split.slice, col_begin,
                    target_local.const_data_ptr<int64_t>(),
                    weight_local.defined() ? weight_local.const_data_ptr<acc_t>() : nullptr,
                    stats.data_ptr<acc_t>(), partials.data_ptr<acc_t>(),
                    copy_to.defined() ? copy_to.data_ptr<scalar_t>() : nullptr);
          };
          with_vector_width<scalar_t>(split, launch);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
          const int merge_threads = 128;
          merge_row_partials_kernel<acc_t>
              <<<static_cast<unsigned>((rows + merge_threads - 1) / merge_threads), merge_threads,
                 0, stream>>>(partials.const_data_ptr<acc_t>(), split.splits, rows,
                              stats.data_ptr<acc_t>());
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
  }

  void softmax_grad_inplace(const at::Tensor& values, int64_t col_begin,
                            const at::Tensor& target_local, const at::Tensor& weight_local,
                            const at::Tensor& coefs) const override {
    const int64_t rows = values.size(0), cols = values.size(1);
    if (rows == 0 || cols == 0) return;
    auto stream = at::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, values.scalar_type(), "parallel_cross_entropy_backward_cuda",
        [&] {
          using acc_t = acc_type_of<scalar_t>;
          const RowSplit split = split_rows<scalar_t>(rows, cols, {values.const_data_ptr()});
          const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(split.splits));
          const auto launch = [&](auto vec) {
            constexpr int kVec = decltype(vec)::value;
            parallel_cross_entropy_backward_kernel<scalar_t, acc_t, kVec>
                <<<grid, kThreads, 0, stream>>>(
                    values.data_ptr<scalar_t>(), cols, split.slice, col_begin,
                    target_local.const_data_ptr<int64_t>(),
                    weight_local.defined() ? weight_local.const_data_ptr<acc_t>() : nullptr,
                    coefs.const_data_ptr<acc_t>());
          };
          with_vector_width<scalar_t>(split, launch);
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

  // Many rows of a million classes a block (64 at 2^26): a few launches per
  // block of rows instead of one per row; temporaries of 256 MiB in float32.
  int64_t probability_block_elements() const override { return int64_t(1) << 26; }

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
