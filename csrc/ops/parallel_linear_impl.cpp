#include "ops/parallel_linear_impl.h"

#include <ATen/ATen.h>

#include "comm/registry.h"
#include "comm/sharded_collectives.h"
#include "ops/parallel_linear_plan.h"
#include <shardtorch/topology/topology.h>

namespace shardtorch {
namespace ops {
namespace {

constexpr const char* kLinearForward = "shard::parallel_linear";
constexpr const char* kLinearBackward = "shard::_parallel_linear_backward";

// Rows of the [*, features] tensor seen as a matrix (explicit, since a
// zero-feature shard makes reshape(-1, 0) ambiguous).
int64_t leading_rows(const at::Tensor& t) {
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) rows *= t.size(d);
  return rows;
}

// The slice of the input this rank multiplies with its weight, as [M, K].
at::Tensor local_input_2d(const at::Tensor& input, const at::Tensor& weight,
                          const LinearPlan& plan) {
  at::Tensor x = plan.input_is_whole ? input.narrow(-1, plan.input_offset, weight.size(1)) : input;
  return x.reshape({leading_rows(input), weight.size(1)}).contiguous();
}

std::vector<int64_t> with_last(at::IntArrayRef sizes, int64_t last) {
  std::vector<int64_t> out(sizes.begin(), sizes.end());
  out.back() = last;
  return out;
}

}  // namespace

at::Tensor parallel_linear_forward_impl(const at::Tensor& input, const at::Tensor& weight,
                                        const std::optional<at::Tensor>& bias,
                                        std::optional<int64_t> dim, const std::string& group,
                                        const LinearMath& math) {
  const LinearPlan plan = plan_parallel_linear(input, weight, bias, dim, group, kLinearForward);
  const at::Tensor b = bias.has_value() ? *bias : at::Tensor();
  const at::Tensor w = weight.contiguous();
  const at::Tensor x = local_input_2d(input, weight, plan);
  const auto out_shape = with_last(input.sizes(), weight.size(0));
  if (plan.mode != LinearMode::kRow) return math.forward(x, w, b).view(out_shape);

  // Row-parallel: partial products summed over the group; the whole bias is
  // added once, by group rank 0, before the sum, so no extra pass is needed.
  at::Tensor partial = math.forward(x, w, plan.group_rank == 0 ? b : at::Tensor());
  auto communicator = comm::communicator_for(group, input.device(), kLinearForward);
  communicator->all_reduce(partial);
  return partial.view(out_shape);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> parallel_linear_backward_impl(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    std::optional<int64_t> dim, const std::string& group, std::array<bool, 3> output_mask,
    const LinearMath& math) {
  const LinearPlan plan =
      plan_parallel_linear(input, weight, std::nullopt, dim, group, kLinearBackward);
  TORCH_CHECK(grad_output.size(-1) == weight.size(0), kLinearBackward,
              ": grad_output.size(-1) must equal weight.size(0) = ", weight.size(0), ", got ",
              grad_output.sizes());
  const at::Tensor grad =
      grad_output.reshape({leading_rows(grad_output), weight.size(0)}).contiguous();
  const at::Tensor w = weight.contiguous();

  at::Tensor grad_input, grad_weight, grad_bias;
  comm::PendingTensor pending_gather;
  std::shared_ptr<comm::CommHandle> pending_reduce;
  if (output_mask[0]) {
    grad_input = math.grad_input(grad, w);
    // Launched before the weight gradient so the two overlap.
    if (plan.mode == LinearMode::kColumn) {
      pending_reduce = comm::communicator_for(group, input.device(), kLinearBackward)
                           ->all_reduce_async(grad_input);
    } else if (plan.mode == LinearMode::kRow && plan.input_is_whole) {
      auto communicator = comm::communicator_for(group, input.device(), kLinearBackward);
      pending_gather = comm::all_gather_along_dim_async(
          *communicator, grad_input, 1,
          topology::shard_sizes(plan.whole_in_features, plan.group_size));
    }
  }
  if (output_mask[1]) grad_weight = math.grad_weight(grad, local_input_2d(input, weight, plan));
  if (output_mask[2]) grad_bias = grad.sum(0);
  if (pending_reduce) pending_reduce->wait();
  if (pending_gather.handle) grad_input = pending_gather.finish();
  if (grad_input.defined()) grad_input = grad_input.view(input.sizes());
  return {grad_input, grad_weight, grad_bias};
}

}  // namespace ops
}  // namespace shardtorch
