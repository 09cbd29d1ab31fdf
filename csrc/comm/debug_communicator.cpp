#include "comm/debug_communicator.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdlib>
#include <cstring>
#include <sstream>

#include "comm/process_group_communicator.h"

namespace shardtorch {
namespace comm {
namespace {

constexpr int64_t kMaxDims = 8;
// collective, dtype, numel, ndim, sizes[kMaxDims], extra (root / peer)
constexpr int64_t kFields = 5 + kMaxDims;

enum Collective : int64_t { kAllReduce, kAllGather, kReduceScatter, kBroadcast, kSend, kRecv };
const char* collective_name(int64_t c) {
  static const char* names[] = {"all_reduce", "all_gather", "reduce_scatter",
                                "broadcast",  "send",       "recv"};
  return (c >= 0 && c < 6) ? names[c] : "?";
}

std::string describe(const int64_t* row) {
  std::ostringstream out;
  out << collective_name(row[0]) << " of " << c10::toString(static_cast<at::ScalarType>(row[1]))
      << " [";
  const int64_t ndim = std::min(row[3], kMaxDims);
  for (int64_t d = 0; d < ndim; ++d) out << (d ? ", " : "") << row[4 + d];
  out << "]";
  return out.str();
}

class DebugCommunicator final : public Communicator {
 public:
  DebugCommunicator(std::shared_ptr<Communicator> inner, const GroupInfo& group)
      : inner_(std::move(inner)),
        checker_(group.layout.name, group.process_group),
        global_ranks_(group.layout.global_ranks) {}

  int64_t rank() const override { return inner_->rank(); }
  int64_t size() const override { return inner_->size(); }
  const std::string& group_name() const override { return inner_->group_name(); }
  std::string backend_name() const override { return inner_->backend_name() + "+debug"; }

  std::shared_ptr<CommHandle> all_reduce_async(at::Tensor& t) override {
    verify(kAllReduce, t, 0);
    return inner_->all_reduce_async(t);
  }
  std::shared_ptr<CommHandle> all_gather_async(const at::Tensor& in, at::Tensor& out) override {
    verify(kAllGather, in, out.numel());
    return inner_->all_gather_async(in, out);
  }
  std::shared_ptr<CommHandle> reduce_scatter_async(const at::Tensor& in, at::Tensor& out) override {
    verify(kReduceScatter, in, out.numel());
    return inner_->reduce_scatter_async(in, out);
  }
  std::shared_ptr<CommHandle> broadcast_async(at::Tensor& t, int64_t root) override {
    verify(kBroadcast, t, root);
    return inner_->broadcast_async(t, root);
  }
  // Point-to-point calls involve two ranks only; they are not checked group-wide.
  std::shared_ptr<CommHandle> send_async(const at::Tensor& t, int64_t dst) override {
    return inner_->send_async(t, dst);
  }
  std::shared_ptr<CommHandle> recv_async(at::Tensor& t, int64_t src) override {
    return inner_->recv_async(t, src);
  }

 private:
  void verify(Collective collective, const at::Tensor& t, int64_t extra) {
    at::Tensor mine = at::zeros({kFields}, at::kLong);
    int64_t* row = mine.data_ptr<int64_t>();
    row[0] = collective;
    row[1] = static_cast<int64_t>(t.scalar_type());
    row[2] = t.numel();
    row[3] = t.dim();
    for (int64_t d = 0; d < std::min<int64_t>(t.dim(), kMaxDims); ++d) row[4 + d] = t.size(d);
    row[kFields - 1] = extra;
    at::Tensor all = at::empty({size(), kFields}, at::kLong);
    checker_.all_gather(mine, all);
    const int64_t* rows = all.data_ptr<int64_t>();
    for (int64_t r = 0; r < size(); ++r) {
      if (std::memcmp(rows + r * kFields, rows, kFields * sizeof(int64_t)) != 0) {
        TORCH_CHECK(false, "SHARDTORCH_DEBUG: ranks disagree on a collective on group '",
                    group_name(), "': global rank ", global_ranks_[r], " calls ",
                    describe(rows + r * kFields), " where global rank ", global_ranks_[0],
                    " calls ", describe(rows), " (this is global rank ", global_ranks_[rank()],
                    ")");
      }
    }
  }

  std::shared_ptr<Communicator> inner_;
  ProcessGroupCommunicator checker_;
  std::vector<int64_t> global_ranks_;
};

}  // namespace

bool debug_mode_enabled() {
  const char* value = std::getenv("SHARDTORCH_DEBUG");
  return value && std::strcmp(value, "") != 0 && std::strcmp(value, "0") != 0;
}

void check_same_on_every_rank(Communicator& communicator, const at::Tensor& tensor,
                              const char* what, const char* op) {
  const int64_t world = communicator.size();
  if (world == 1) return;
  TORCH_CHECK(!at::isFloatingType(tensor.scalar_type()) && !at::isComplexType(tensor.scalar_type()),
              "check_same_on_every_rank: integer tensors only, got ", tensor.scalar_type());
  const at::Tensor flat = tensor.contiguous().view({-1});
  at::Tensor gathered = at::empty({world * flat.numel()}, flat.options());
  // Through the debug communicator, so that differing sizes are named first.
  communicator.all_gather(flat, gathered);
  const at::Tensor blocks = gathered.view({world, flat.numel()}).to(at::kCPU, at::kLong);
  const std::vector<int64_t> global_ranks =
      group_layout(communicator.group_name(), op).global_ranks;
  for (int64_t r = 1; r < world; ++r) {
    const at::Tensor differs = blocks[r].ne(blocks[0]);
    if (!differs.any().item<bool>()) continue;
    const int64_t at_element = differs.nonzero()[0][0].item<int64_t>();
    TORCH_CHECK(false, "SHARDTORCH_DEBUG: ", op, ": every rank of group '",
                communicator.group_name(), "' must hold the same ", what, ", but global rank ",
                global_ranks[r], "'s differs from global rank ", global_ranks[0],
                "'s (first at element ", at_element, ": ", blocks[r][at_element].item<int64_t>(),
                " vs ", blocks[0][at_element].item<int64_t>(), "; this is global rank ",
                global_ranks[communicator.rank()], ")");
  }
}

std::shared_ptr<Communicator> make_debug_communicator(std::shared_ptr<Communicator> inner,
                                                      const GroupInfo& group) {
  return std::make_shared<DebugCommunicator>(std::move(inner), group);
}

}  // namespace comm
}  // namespace shardtorch
