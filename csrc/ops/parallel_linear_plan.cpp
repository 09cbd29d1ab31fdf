#include "ops/parallel_linear_plan.h"

#include "comm/registry.h"
#include "ops/op_checks.h"
#include <shardtorch/topology/topology.h>

#include <c10/core/SymInt.h>

namespace shardtorch {
namespace ops {

// Feature counts decide the plan, so they are specialised (guarded) when traced
// with symbolic shapes; batch dimensions stay symbolic.
static int64_t concrete(const c10::SymInt& size) { return size.guard_int(__FILE__, __LINE__); }

LinearPlan plan_parallel_linear(const at::Tensor& input, const at::Tensor& weight,
                                const std::optional<at::Tensor>& bias, std::optional<int64_t> dim,
                                const std::string& group, const char* op) {
  TORCH_CHECK(!dim.has_value() || *dim == 0 || *dim == 1 || *dim == -1, op,
              ": dim must be None, 0, 1 or -1, got ", *dim);
  TORCH_CHECK(input.dim() >= 1, op, ": input must have at least 1 dimension [*, in_features], got ",
              input.sym_sizes());
  TORCH_CHECK(weight.dim() == 2, op, ": weight must be 2-D [out_features, in_features], got ",
              weight.sym_sizes());
  check_floating(input, "input", op);
  check_same_dtype_device(input, "input", weight, "weight", op);
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->dim() == 1 && concrete(bias->sym_size(0)) == concrete(weight.sym_size(0)), op,
                ": bias must be 1-D of size weight.size(0) = ", weight.sym_size(0), ", got ",
                bias->sym_sizes());
    check_same_dtype_device(input, "input", *bias, "bias", op);
  }

  LinearPlan plan;
  const int64_t in_features = concrete(input.sym_size(-1));
  const int64_t weight_in = concrete(weight.sym_size(1));
  if (!dim.has_value()) {
    TORCH_CHECK(in_features == weight_in, op,
                ": input.size(-1) must equal in_features = ", weight_in,
                " (weight.size(1)), got input of shape ", input.sym_sizes());
    return plan;
  }
  auto info = comm::group_layout(group, op);
  plan.group_rank = info.rank;
  plan.group_size = info.size;
  if (*dim != 0) {
    plan.mode = LinearMode::kColumn;
    TORCH_CHECK(in_features == weight_in, op,
                "(dim=1): input.size(-1) must equal in_features = ", weight_in,
                " (weight.size(1)), got input of shape ", input.sym_sizes());
    return plan;
  }
  plan.mode = LinearMode::kRow;
  const int64_t local = weight_in;
  if (in_features != local) {
    const int64_t expected = topology::shard_size(in_features, info.size, info.rank);
    TORCH_CHECK(expected == local, op, "(dim=0): input.size(-1) must be this rank's input shard (",
                local, " = weight.size(1)) or the whole in_features whose shard on rank ",
                info.rank, " of ", info.size, " is ", local, "; got input of shape ",
                input.sym_sizes(), " (a whole input of ", in_features, " features gives this rank ",
                expected, ")");
    plan.input_is_whole = true;
    plan.input_offset = topology::shard_offset(in_features, info.size, info.rank);
    plan.whole_in_features = in_features;
  }
  return plan;
}

}  // namespace ops
}  // namespace shardtorch
