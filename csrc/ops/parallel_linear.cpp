// Schemas and C++ entry points of parallel_linear and its backward.
#include <shardtorch/ops/parallel_linear.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace shardtorch {
namespace ops {

TORCH_LIBRARY_FRAGMENT(shard, m) {
  const std::vector<at::Tag> tags{at::Tag::pt2_compliant_tag};
  m.def("parallel_linear(Tensor input, Tensor weight, Tensor? bias, int? dim, str group) -> Tensor",
        tags);
  m.def(
      "_parallel_linear_backward(Tensor grad_output, Tensor input, Tensor weight, int? dim, "
      "str group, bool[3] output_mask) -> (Tensor, Tensor, Tensor)",
      tags);
}

at::Tensor parallel_linear(const at::Tensor& input, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias, std::optional<int64_t> dim,
                           const std::string& group) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("shard::parallel_linear", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            std::optional<int64_t>, const std::string&)>();
  return op.call(input, weight, bias, dim, group);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> parallel_linear_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    std::optional<int64_t> dim, const std::string& group, std::array<bool, 3> output_mask) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("shard::_parallel_linear_backward", "")
                       .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                           const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           std::optional<int64_t>, const std::string&, std::array<bool, 3>)>();
  return op.call(grad_output, input, weight, dim, group, output_mask);
}

}  // namespace ops
}  // namespace shardtorch
