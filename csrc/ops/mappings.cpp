// Schemas and C++ entry points of the communication mappings (see mappings.h).
#include <shardtorch/ops/mappings.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace shardtorch {
namespace ops {

TORCH_LIBRARY_FRAGMENT(shard, m) {
  const std::vector<at::Tag> tags{at::Tag::pt2_compliant_tag};
  m.def("copy(Tensor input, str group) -> Tensor", tags);
  m.def("reduce(Tensor input, str group) -> Tensor", tags);
  m.def("scatter(Tensor input, int dim, str group) -> Tensor", tags);
  m.def("all_gather(Tensor input, int dim, str group, SymInt? full_size=None) -> Tensor", tags);
  m.def("gather_replicated(Tensor input, int dim, str group, SymInt? full_size=None) -> Tensor",
        tags);
  m.def("reduce_scatter(Tensor input, int dim, str group) -> Tensor", tags);
}

namespace {
using UnaryFn = at::Tensor(const at::Tensor&, const std::string&);
using DimFn = at::Tensor(const at::Tensor&, int64_t, const std::string&);
using GatherFn = at::Tensor(const at::Tensor&, int64_t, const std::string&,
                            std::optional<c10::SymInt>);

template <typename Fn>
c10::TypedOperatorHandle<Fn> handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}
}  // namespace

at::Tensor copy(const at::Tensor& input, const std::string& group) {
  static auto op = handle<UnaryFn>("shard::copy");
  return op.call(input, group);
}

at::Tensor reduce(const at::Tensor& input, const std::string& group) {
  static auto op = handle<UnaryFn>("shard::reduce");
  return op.call(input, group);
}

at::Tensor scatter(const at::Tensor& input, int64_t dim, const std::string& group) {
  static auto op = handle<DimFn>("shard::scatter");
  return op.call(input, dim, group);
}

at::Tensor gather_replicated(const at::Tensor& input, int64_t dim, const std::string& group,
                             std::optional<c10::SymInt> full_size) {
  static auto op = handle<GatherFn>("shard::gather_replicated");
  return op.call(input, dim, group, std::move(full_size));
}

at::Tensor all_gather(const at::Tensor& input, int64_t dim, const std::string& group,
                      std::optional<c10::SymInt> full_size) {
  static auto op = handle<GatherFn>("shard::all_gather");
  return op.call(input, dim, group, std::move(full_size));
}

at::Tensor reduce_scatter(const at::Tensor& input, int64_t dim, const std::string& group) {
  static auto op = handle<DimFn>("shard::reduce_scatter");
  return op.call(input, dim, group);
}

}  // namespace ops
}  // namespace shardtorch
