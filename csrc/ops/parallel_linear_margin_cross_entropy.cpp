// Schemas and C++ entry points of parallel_linear_margin_cross_entropy (see
// the header).
#include <shardtorch/ops/parallel_linear_margin_cross_entropy.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace shardtorch {
namespace ops {

TORCH_LIBRARY_FRAGMENT(shard, m) {
  const std::vector<at::Tag> tags{at::Tag::pt2_compliant_tag};
  m.def(
      "parallel_linear_margin_cross_entropy(Tensor input, Tensor weight, Tensor target, "
      "float scale=64.0, float m1=1.0, float m2=0.5, float m3=0.0, bool easy_margin=False, "
      "int ignore_index=-100, float label_smoothing=0.0, int reduction=1, "
      "Tensor? sampled_classes=None, int chunk_size=4096, str group=\"tp\", "
      "int? num_classes=None) -> Tensor",
      tags);
  m.def(
      "_parallel_linear_margin_cross_entropy_forward(Tensor input, Tensor weight, Tensor target, "
      "float scale, float m1, float m2, float m3, bool easy_margin, int ignore_index, "
      "float label_smoothing, int reduction, Tensor? sampled_classes, int chunk_size, str group, "
      "int? num_classes) -> (Tensor, Tensor)",
      tags);
  m.def(
      "_parallel_linear_margin_cross_entropy_backward(Tensor grad_loss, Tensor input, "
      "Tensor weight, Tensor row_stats, Tensor target, float scale, float m1, float m2, "
      "float m3, bool easy_margin, int ignore_index, float label_smoothing, int reduction, "
      "Tensor? sampled_classes, int chunk_size, str group, bool[2] output_mask) "
      "-> (Tensor, Tensor)",
      tags);
  m.def(
      "_parallel_linear_margin_cross_entropy_forward_with_gradients(Tensor input, Tensor weight, "
      "Tensor target, float scale, float m1, float m2, float m3, bool easy_margin, "
      "int ignore_index, float label_smoothing, int reduction, Tensor? sampled_classes, "
      "int chunk_size, str group, int? num_classes, bool[2] output_mask) "
      "-> (Tensor, Tensor, Tensor, Tensor)",
      tags);
}

using OptTensor = std::optional<at::Tensor>;

at::Tensor parallel_linear_margin_cross_entropy(const at::Tensor& input, const at::Tensor& weight,
                                                const at::Tensor& target, double scale, double m1,
                                                double m2, double m3, bool easy_margin,
                                                int64_t ignore_index, double label_smoothing,
                                                int64_t reduction, const OptTensor& sampled_classes,
                                                int64_t chunk_size, const std::string& group,
                                                std::optional<int64_t> num_classes) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("shard::parallel_linear_margin_cross_entropy", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, double, double,
                            double, double, bool, int64_t, double, int64_t, const OptTensor&,
                            int64_t, const std::string&, std::optional<int64_t>)>();
  return op.call(input, weight, target, scale, m1, m2, m3, easy_margin, ignore_index,
                 label_smoothing, reduction, sampled_classes, chunk_size, group, num_classes);
}

std::tuple<at::Tensor, at::Tensor> parallel_linear_margin_cross_entropy_forward(
    const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target, double scale,
    double m1, double m2, double m3, bool easy_margin, int64_t ignore_index, double label_smoothing,
    int64_t reduction, const OptTensor& sampled_classes, int64_t chunk_size,
    const std::string& group, std::optional<int64_t> num_classes) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("shard::_parallel_linear_margin_cross_entropy_forward", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(
              const at::Tensor&, const at::Tensor&, const at::Tensor&, double, double, double,
              double, bool, int64_t, double, int64_t, const OptTensor&, int64_t, const std::string&,
              std::optional<int64_t>)>();
  return op.call(input, weight, target, scale, m1, m2, m3, easy_margin, ignore_index,
                 label_smoothing, reduction, sampled_classes, chunk_size, group, num_classes);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>
parallel_linear_margin_cross_entropy_forward_with_gradients(
    const at::Tensor& input, const at::Tensor& weight, const at::Tensor& target, double scale,
    double m1, double m2, double m3, bool easy_margin, int64_t ignore_index, double label_smoothing,
    int64_t reduction, const OptTensor& sampled_classes, int64_t chunk_size,
    const std::string& group, std::optional<int64_t> num_classes, std::array<bool, 2> output_mask) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("shard::_parallel_linear_margin_cross_entropy_forward_with_gradients",
                             "")
          .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
              const at::Tensor&, const at::Tensor&, const at::Tensor&, double, double, double,
              double, bool, int64_t, double, int64_t, const OptTensor&, int64_t, const std::string&,
              std::optional<int64_t>, std::array<bool, 2>)>();
  return op.call(input, weight, target, scale, m1, m2, m3, easy_margin, ignore_index,
                 label_smoothing, reduction, sampled_classes, chunk_size, group, num_classes,
                 output_mask);
}

std::tuple<at::Tensor, at::Tensor> parallel_linear_margin_cross_entropy_backward(
    const at::Tensor& grad_loss, const at::Tensor& input, const at::Tensor& weight,
    const at::Tensor& row_stats, const at::Tensor& target, double scale, double m1, double m2,
    double m3, bool easy_margin, int64_t ignore_index, double label_smoothing, int64_t reduction,
    const OptTensor& sampled_classes, int64_t chunk_size, const std::string& group,
    std::array<bool, 2> output_mask) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("shard::_parallel_linear_margin_cross_entropy_backward", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(
              const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
              const at::Tensor&, double, double, double, double, bool, int64_t, double, int64_t,
              const OptTensor&, int64_t, const std::string&, std::array<bool, 2>)>();
  return op.call(grad_loss, input, weight, row_stats, target, scale, m1, m2, m3, easy_margin,
                 ignore_index, label_smoothing, reduction, sampled_classes, chunk_size, group,
                 output_mask);
}

}  // namespace ops
}  // namespace shardtorch
