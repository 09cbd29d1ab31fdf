// Parallel cross-entropy on CUDA: one block per row; the forward pass reads
// each logit once (online max / sum-exp, target logit, weighted sum, and the
// copy into the backward buffer in the same read), the backward pass reads and
// writes the buffer once. Collectives go through NCCL (the CUDA
// communicator); the fused classifier's chunk products through ATen (cuBLAS).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <torch/library.h>

#include <cuda_runtime.h>

#include <limits>
#include <type_traits>

#include "ops/cross_entropy_kernel_adapter.h"
#include "ops/cross_entropy_kernels.h"

namespace shardtorch {
namespace ops {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

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

template <typename scalar_t, typename acc_t>
__global__ void parallel_cross_entropy_forward_kernel(const scalar_t* __restrict__ logits,
                                                      int64_t cols, int64_t col_begin,
                                                      const int64_t* __restrict__ target_local,
                                                      const acc_t* __restrict__ weight_local,
                                                      acc_t* __restrict__ stats,
                                                      scalar_t* __restrict__ copy_to) {
  const int64_t row = blockIdx.x;
  const scalar_t* x = logits + row * cols;
  constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
  MaxSum<acc_t> local{kNegInf, acc_t(0)};
  acc_t weighted = 0;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    const scalar_t raw = x[j];
    if (copy_to != nullptr) copy_to[row * cols + j] = raw;
    const acc_t v = static_cast<acc_t>(raw);
    weighted += (weight_local != nullptr ? weight_local[col_begin + j] : acc_t(1)) * v;
    local = merge(local, MaxSum<acc_t>{v, v == kNegInf ? acc_t(0) : acc_t(1)});
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
  acc_t* s = stats + row * kNumRowStats;
  MaxSum<acc_t> total{s[kRowMax], s[kRowSumExp]};
  for (int w = 0; w < kWarps; ++w) {
    total = merge(total, MaxSum<acc_t>{shared_max[w], shared_sum[w]});
    s[kRowWeightedSum] += shared_weighted[w];
  }
  s[kRowMax] = total.max;
  s[kRowSumExp] = total.sum;
  const int64_t t = target_local[row] - col_begin;
  if (t >= 0 && t < cols) {
    s[kRowTargetLogit] = static_cast<acc_t>(x[t]);
    s[kRowTargetWeight] = weight_local != nullptr ? weight_local[col_begin + t] : acc_t(1);
  }
}

template <typename scalar_t, typename acc_t>
__global__ void parallel_cross_entropy_backward_kernel(scalar_t* __restrict__ values, int64_t cols,
                                                       int64_t col_begin,
                                                       const int64_t* __restrict__ target_local,
                                                       const acc_t* __restrict__ weight_local,
                                                       const acc_t* __restrict__ coefs) {
  const int64_t row = blockIdx.x;
  scalar_t* v = values + row * cols;
  const acc_t* c = coefs + row * kNumGradCoefs;
  const acc_t lse = c[kCoefLse], grad_scale = c[kCoefGradScale];
  const acc_t lse_remainder = c[kCoefLseRemainder];
  const acc_t target_scale = c[kCoefTargetScale], smooth = c[kCoefSmoothScale];
  const int64_t t = target_local[row] - col_begin;
  const bool ignored = grad_scale == acc_t(0) && smooth == acc_t(0);
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    acc_t g = 0;
    if (!ignored) {
      g = grad_scale * exp((static_cast<acc_t>(v[j]) - lse) - lse_remainder) -
          smooth * (weight_local != nullptr ? weight_local[col_begin + j] : acc_t(1));
      if (j == t) g -= target_scale;
    }
    v[j] = static_cast<scalar_t>(g);
  }
}

template <typename scalar_t>
using acc_type_of = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

class CudaCrossEntropyKernels final : public CrossEntropyKernels {
 public:
  void accumulate_row_stats(const at::Tensor& logits, int64_t col_begin,
                            const at::Tensor& target_local, const at::Tensor& weight_local,
                            const at::Tensor& stats, const at::Tensor& copy_to) const override {
    const int64_t rows = logits.size(0), cols = logits.size(1);
    if (rows == 0) return;
    auto stream = at::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, logits.scalar_type(), "parallel_cross_entropy_forward_cuda", [&] {
          using acc_t = acc_type_of<scalar_t>;
          parallel_cross_entropy_forward_kernel<scalar_t, acc_t><<<rows, kThreads, 0, stream>>>(
              logits.const_data_ptr<scalar_t>(), cols, col_begin,
              target_local.const_data_ptr<int64_t>(),
              weight_local.defined() ? weight_local.const_data_ptr<acc_t>() : nullptr,
              stats.data_ptr<acc_t>(), copy_to.defined() ? copy_to.data_ptr<scalar_t>() : nullptr);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
  }

  void softmax_grad_inplace(const at::Tensor& values, int64_t col_begin,
                            const at::Tensor& target_local, const at::Tensor& weight_local,
                            const at::Tensor& coefs) const override {
    const int64_t rows = values.size(0), cols = values.size(1);
    if (rows == 0) return;
    auto stream = at::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, values.scalar_type(), "parallel_cross_entropy_backward_cuda",
        [&] {
          using acc_t = acc_type_of<scalar_t>;
          parallel_cross_entropy_backward_kernel<scalar_t, acc_t><<<rows, kThreads, 0, stream>>>(
              values.data_ptr<scalar_t>(), cols, col_begin, target_local.const_data_ptr<int64_t>(),
              weight_local.defined() ? weight_local.const_data_ptr<acc_t>() : nullptr,
              coefs.const_data_ptr<acc_t>());
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(shard, CUDA, m) {
  CrossEntropyKernelAdapter<CudaCrossEntropyKernels>::register_kernels(m);
}

}  // namespace ops
}  // namespace shardtorch
