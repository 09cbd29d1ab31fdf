#pragma once
// Initialising shards exactly as torch::nn::Linear (and torch.nn.Linear) would,
// without ever holding the full weight: the twin of shardtorch/nn/init.py.
//
// Linear draws its weight with uniform_ on the CPU generator, one number per
// element in row-major order, then its bias. Drawing the same matrix a few
// whole rows at a time consumes the generator identically, so each rank keeps
// its slice and drops the rest: the shard equals the slice of
// torch::nn::Linear(in, out) made under the same torch::manual_seed, bitwise,
// and the generator ends in the same state. Peak extra memory: one chunk of
// max(in_features, kInitChunkElements) elements.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <utility>

#include <shardtorch/nn/init_staging.h>

namespace shardtorch {
namespace nn {

inline constexpr int64_t kInitChunkElements = int64_t{1} << 20;

struct LinearBounds {
  double weight;  // kaiming_uniform_(a = sqrt(5)) bound
  double bias;    // 1 / sqrt(fan_in)
};
LinearBounds linear_bounds(int64_t in_features);

// Fills `weight` (rows `out_range`, columns `in_range` of the full
// [out_features, in_features] matrix) and `bias` (`out_range` of the full bias,
// or all of it when bias.numel() == out_features). Draws on the CPU generator
// and copies chunk by chunk, so CUDA shards equal a CPU-built Linear, moved.
// `chunk_elements` bounds the drawing buffer (tests make it small to exercise
// many chunks); any value gives the same numbers. Python's
// shardtorch.nn.init calls this through shardtorch._C.
void init_linear_shard_(at::Tensor& weight, const std::optional<at::Tensor>& bias,
                        int64_t in_features, int64_t out_features, Range out_range, Range in_range,
                        int64_t chunk_elements = kInitChunkElements);

}  // namespace nn
}  // namespace shardtorch
