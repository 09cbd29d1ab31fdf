// Schemas and C++ entry points of parallel_cross_entropy (see the header).
#include <shardtorch/ops/parallel_cross_entropy.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace shardtorch {
namespace ops {

TORCH_LIBRARY_FRAGMENT(shard, m) {
  const std::vector<at::Tag> tags{at::Tag::pt2_compliant_tag};
  m.def(
      "parallel_cross_entropy(Tensor logits, Tensor target, Tensor? weight=None, "
      "int ignore_index=-100, float label_smoothing=0.0, float z_loss=0.0, int reduction=1, "
      "str group=\"tp\", int? num_classes=None) -> Tensor",
      tags);
  m.def(
      "_parallel_cross_entropy_forward(Tensor logits, Tensor target, Tensor? weight, "
      "int ignore_index, float label_smoothing, float z_loss, int reduction, str group, "
      "int? num_classes) -> (Tensor, Tensor, Tensor)",
      tags);
  m.def(
      "_parallel_cross_entropy_backward(Tensor grad_loss, Tensor(a!) logits_buffer, "
      "Tensor row_stats, Tensor target, Tensor? weight, int ignore_index, float label_smoothing, "
      "float z_loss, int reduction) -> ()",
      tags);
}

using ForwardSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t, double, double,
    int64_t, const std::string&, std::optional<int64_t>);

at::Tensor parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& target,
                                  const std::optional<at::Tensor>& weight, int64_t ignore_index,
                                  double label_smoothing, double z_loss, int64_t reduction,
                                  const std::string& group, std::optional<int64_t> num_classes) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("shard::parallel_cross_entropy", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                                         const std::optional<at::Tensor>&, int64_t, double, double,
                                         int64_t, const std::string&, std::optional<int64_t>)>();
  return op.call(logits, target, weight, ignore_index, label_smoothing, z_loss, reduction, group,
                 num_classes);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> parallel_cross_entropy_forward(
    const at::Tensor& logits, const at::Tensor& target, const std::optional<at::Tensor>& weight,
    int64_t ignore_index, double label_smoothing, double z_loss, int64_t reduction,
    const std::string& group, std::optional<int64_t> num_classes) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("shard::_parallel_cross_entropy_forward", "")
                       .typed<ForwardSig>();
  return op.call(logits, target, weight, ignore_index, label_smoothing, z_loss, reduction, group,
                 num_classes);
}

void parallel_cross_entropy_backward(const at::Tensor& grad_loss, const at::Tensor& logits_buffer,
                                     const at::Tensor& row_stats, const at::Tensor& target,
                                     const std::optional<at::Tensor>& weight, int64_t ignore_index,
                                     double label_smoothing, double z_loss, int64_t reduction) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("shard::_parallel_cross_entropy_backward", "")
          .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                      const std::optional<at::Tensor>&, int64_t, double, double, int64_t)>();
  op.call(grad_loss, logits_buffer, row_stats, target, weight, ignore_index, label_smoothing,
          z_loss, reduction);
}

}  // namespace ops
}  // namespace shardtorch
