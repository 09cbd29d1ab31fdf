// shardtorch._C: the Python face of the C++ core, for what Python needs that the ops (in
// torch.ops.shard) do not give, so that Python never re-implements it: the topology arithmetic;
// group registration, timeouts and deferred checks; collectives by group name (for the Python
// package's own traffic); the exact initialisation of shards that the
// C++ layers share; the CPU memory tracker and the ops' buffers; and a few queries the tests read
// (names starting with an underscore). The test doubles are a module of their own,
// shardtorch._C_testing (testing_module.cpp).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
// torch's type casters for at::Tensor (needs libtorch_python).
#include <torch/csrc/utils/pybind.h>

#include "comm/registry.h"
#include "python/collectives_binding.h"
#include "ops/cpu/vector_isa.h"
#include "ops/recycled_buffers.h"
#include "ops/scratch_buffer.h"
#include <shardtorch/nn/embedding_init.h>
#include <shardtorch/nn/init.h>
#include "python/deferred_check_counts.h"
#include <shardtorch/build_info.h>
#include <shardtorch/topology/topology.h>
#include "utils/cpu_memory_tracker.h"

namespace py = pybind11;
using shardtorch::topology::TensorParallelTopology;

PYBIND11_MODULE(_C, m) {
  m.doc() = "shardtorch C++ core";

  m.def("shard_size", &shardtorch::topology::shard_size, py::arg("total"), py::arg("parts"),
        py::arg("index"));
  m.def("shard_offset", &shardtorch::topology::shard_offset, py::arg("total"), py::arg("parts"),
        py::arg("index"));
  m.def("shard_sizes", &shardtorch::topology::shard_sizes, py::arg("total"), py::arg("parts"));

  py::class_<TensorParallelTopology>(m, "TensorParallelTopology")
      .def(py::init<int64_t, int64_t, int64_t>(), py::arg("world_size"), py::arg("rank"),
           py::arg("group_size"))
      .def_property_readonly("world_size", &TensorParallelTopology::world_size)
      .def_property_readonly("rank", &TensorParallelTopology::rank)
      .def_property_readonly("tensor_parallel_size", &TensorParallelTopology::tensor_parallel_size)
      .def_property_readonly("data_parallel_size", &TensorParallelTopology::data_parallel_size)
      .def_property_readonly("tensor_parallel_rank", &TensorParallelTopology::tensor_parallel_rank)
      .def_property_readonly("data_parallel_rank", &TensorParallelTopology::data_parallel_rank)
      .def("tensor_parallel_groups", &TensorParallelTopology::tensor_parallel_groups)
      .def("data_parallel_groups", &TensorParallelTopology::data_parallel_groups)
      .def("tensor_parallel_group_ranks", &TensorParallelTopology::tensor_parallel_group_ranks)
      .def("data_parallel_group_ranks", &TensorParallelTopology::data_parallel_group_ranks);

  m.def("register_group", &shardtorch::comm::register_group_by_c10d_name, py::arg("name"),
        py::arg("c10d_group_name"), py::arg("global_ranks") = std::vector<int64_t>{},
        "Register a group created by torch.distributed under `name` for the shard ops.");
  // Dropping a group may destroy an NCCL communicator, which can wait: not under the GIL.
  m.def("unregister_group", &shardtorch::comm::unregister_group, py::arg("name"),
        py::call_guard<py::gil_scoped_release>());
  m.def("clear_groups", &shardtorch::comm::clear_groups, py::call_guard<py::gil_scoped_release>());
  // May wait for the device: not under the GIL.
  m.def("check_deferred", &shardtorch::comm::check_deferred, py::arg("group") = std::string(),
        py::call_guard<py::gil_scoped_release>(),
        "Gives now the verdicts of the argument checks the group's (every group's when empty) "
        "CUDA communicators deferred; raises the first failed one.");
  m.def(
      "_deferred_check_counts",
      [](const std::string& group) {
        return shardtorch::python::counts_dict(shardtorch::comm::deferred_check_counts(group));
      },
      py::arg("group") = std::string(),
      "Summed over the group's (every group's when empty) communicators made so far: launches, "
      "deferred checks pending and settled, waits (settled checks whose copy was not ready "
      "when due: the host blocked on a CUDA event, which sync_debug_mode does not see), and "
      "dropped (left unread after a verdict said a rank left).");
  // How many collectives later a CUDA communicator gives a deferred check's verdict.
  m.attr("_DEFERRED_CHECK_LAG") = shardtorch::comm::DeferredChecks::kDefaultLag;
  m.def("has_group", &shardtorch::comm::has_group, py::arg("name"));
  // The Python package's own collectives (shardtorch/distributed/collectives.py).
  shardtorch::python::bind_collectives(m);
  m.def("group_names", &shardtorch::comm::group_names);
  m.def(
      "group_timeout",
      [](const std::string& name) {
        return std::chrono::duration<double>(shardtorch::comm::group_timeout(name, "group_timeout"))
            .count();
      },
      py::arg("name"),
      "Seconds a collective of the group may run before it fails (what NCCL's watchdog enforces).");

  // The one exact Linear initialisation, shared with the C++ ParallelLinear.
  m.def(
      "init_linear_shard_",
      [](at::Tensor weight, std::optional<at::Tensor> bias, int64_t in_features,
         int64_t out_features, shardtorch::nn::Range out_range, shardtorch::nn::Range in_range,
         int64_t chunk_elements) {
        shardtorch::nn::init_linear_shard_(weight, bias, in_features, out_features, out_range,
                                           in_range, chunk_elements);
      },
      py::arg("weight"), py::arg("bias"), py::arg("in_features"), py::arg("out_features"),
      py::arg("out_range"), py::arg("in_range"), py::arg("chunk_elements"));
  // The one exact Embedding initialisation, shared with the C++ ParallelEmbedding.
  m.def(
      "init_embedding_shard_",
      [](at::Tensor weight, int64_t num_embeddings, int64_t embedding_dim,
         shardtorch::nn::Range row_range, shardtorch::nn::Range col_range,
         std::optional<int64_t> padding_idx, int64_t chunk_elements) {
        shardtorch::nn::init_embedding_shard_(weight, num_embeddings, embedding_dim, row_range,
                                              col_range, padding_idx, chunk_elements);
      },
      py::arg("weight"), py::arg("num_embeddings"), py::arg("embedding_dim"), py::arg("row_range"),
      py::arg("col_range"), py::arg("padding_idx"), py::arg("chunk_elements"));
  // The margin loss's class weights: a normal_(mean, std) table, sliced.
  m.def(
      "init_normal_shard_",
      [](at::Tensor weight, int64_t rows, int64_t cols, shardtorch::nn::Range row_range,
         shardtorch::nn::Range col_range, double mean, double std, int64_t chunk_elements) {
        shardtorch::nn::init_normal_shard_(weight, rows, cols, row_range, col_range, mean, std,
                                           chunk_elements);
      },
      py::arg("weight"), py::arg("rows"), py::arg("cols"), py::arg("row_range"),
      py::arg("col_range"), py::arg("mean"), py::arg("std"), py::arg("chunk_elements"));
  m.def("install_cpu_memory_tracker", &shardtorch::utils::install_cpu_memory_tracker);
  m.def("cpu_memory_tracker_installed", &shardtorch::utils::cpu_memory_tracker_installed);
  m.def("cpu_memory_stats", [] {
    auto stats = shardtorch::utils::cpu_memory_stats();
    return py::make_tuple(stats.current_bytes, stats.peak_bytes);
  });
  m.def("reset_cpu_peak_memory", &shardtorch::utils::reset_cpu_peak_memory);
  m.def("free_recycled_buffers", &shardtorch::ops::free_recycled_buffers);
  // For tests: the ops' per-call scratch buffers (float32, CPU), as they allocate them.
  m.def(
      "_empty_scratch_buffer",
      [](std::vector<int64_t> sizes) {
        return shardtorch::ops::empty_scratch_buffer(sizes, at::TensorOptions().dtype(at::kFloat));
      },
      py::arg("sizes"));
  // For tests: an op's large outputs written whole (float32, CPU), as they allocate them.
  m.def(
      "_empty_prefaulted",
      [](std::vector<int64_t> sizes) {
        return shardtorch::ops::empty_prefaulted(sizes, at::TensorOptions().dtype(at::kFloat));
      },
      py::arg("sizes"));
  // For tests: which compiled variant the hand-written CPU kernels run.
  m.def("_cpu_vector_isa", [] {
    switch (shardtorch::ops::cpu_vector_isa()) {
      case shardtorch::ops::VectorIsa::kAvx512: return "avx512";
      case shardtorch::ops::VectorIsa::kAvx2: return "avx2";
      default: return "baseline";
    }
  });

  m.attr("cuda_built") = py::bool_(shardtorch::kBuiltWithCuda);
  m.attr("version") = shardtorch::kVersion;
}
