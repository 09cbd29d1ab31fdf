#include "comm/shared_memory_collectives.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/stat.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <vector>

namespace shardtorch {
namespace comm {

// One rank's counters, each on a cache line of its own: `arrived` is the last collective whose
// data it has written into its slot, `departed` the last one it has finished reading. `changes`
// counts both stores (wrapping): the futex word its peers sleep on.
struct alignas(64) SharedMemoryCollectives::RankControl {
  std::atomic<int64_t> arrived;
  char arrived_line[56];
  std::atomic<int64_t> departed;
  char departed_line[56];
  std::atomic<uint32_t> changes;
  uint32_t pad;
  int64_t pid;
  // What it brought to the collective in each buffer: bytes x 256 + dtype (written before
  // `arrived`).
  int64_t brought[2];
  char pid_line[32];
};

namespace {

constexpr int kBuffers = 2;  // collective n uses buffer n % 2: a rank may run one collective ahead

size_t segment_bytes(int64_t size) {
  return static_cast<size_t>(size) * 192 +
         static_cast<size_t>(kBuffers * size) *
             static_cast<size_t>(SharedMemoryCollectives::kSlotBytes);
}

// This host, as the ranks compare it: its name and this boot (two containers may share a name).
int64_t host_identity() {
  char name[256] = {0};
  gethostname(name, sizeof(name) - 1);
  std::string identity(name);
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string boot_id;
  if (boot >> boot_id) identity += "/" + boot_id;
  return static_cast<int64_t>(std::hash<std::string>{}(identity) & 0x7fffffffffffffffULL);
}

std::string segment_name(int64_t id) {
  char name[64];
  std::snprintf(name, sizeof(name), "/shardtorch-%016llx", static_cast<unsigned long long>(id));
  return name;
}

bool enabled() {
  const char* value = std::getenv("SHARDTORCH_SHARED_MEMORY");
  return value == nullptr || std::string(value) != "0";
}

// Sleeps while *word holds `seen` (at most `nanoseconds`): a futex shared between processes.
void sleep_while_unchanged(std::atomic<uint32_t>& word, uint32_t seen, long nanoseconds) {
  struct timespec limit = {0, nanoseconds};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT, seen, &limit, nullptr, 0);
}

void wake_sleepers(std::atomic<uint32_t>& word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr,
          0);
}

void pause_briefly() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Whether the process `pid` has exited. kill(pid, 0) alone is not enough: it succeeds on a zombie,
// a process that has exited but that its parent has not reaped yet (a parent busy in a collective
// of its own reaps nothing), so the state letter of /proc/<pid>/stat tells exit apart: 'Z'
// (zombie) or 'X' (being reaped).
bool has_exited(pid_t pid) {
  if (kill(pid, 0) != 0) return errno == ESRCH;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", static_cast<int>(pid));
  std::ifstream stat(path);
  std::string line;
  if (!std::getline(stat, line)) return false;  // no /proc here: kill's answer stands
  // "pid (comm) state ...": comm may hold spaces and parentheses, the state follows the last ')'.
  const auto name_end = line.rfind(')');
  if (name_end == std::string::npos || name_end + 2 >= line.size()) return false;
  const char state = line[name_end + 2];
  return state == 'Z' || state == 'X';
}

}  // namespace

std::unique_ptr<SharedMemoryCollectives> SharedMemoryCollectives::create(
    c10d::ProcessGroup& group, const std::string& group_name, std::chrono::milliseconds timeout) {
  // Its own profiler range: the setup's Gloo collectives happen once per group, not per step.
  RECORD_FUNCTION("shm:setup", std::vector<c10::IValue>({c10::IValue(group_name)}));
  const int64_t rank = group.getRank(), size = group.getSize();
  // Every rank's host and whether it wants the segment: the same verdict on every rank.
  auto mine = at::tensor({host_identity(), static_cast<int64_t>(enabled())}, at::kLong);
  std::vector<std::vector<at::Tensor>> everyone(1);
  for (int64_t r = 0; r < size; ++r) everyone[0].push_back(at::empty({2}, at::kLong));
  std::vector<at::Tensor> inputs{mine};
  group.allgather(everyone, inputs)->wait();
  for (const auto& other : everyone[0]) {
    if (other[0].item<int64_t>() != mine[0].item<int64_t>() || other[1].item<int64_t>() == 0) {
      return nullptr;
    }
  }
  // Rank 0 names and makes the segment; every rank maps it; all learn whether every rank could.
  auto id = at::zeros({1}, at::kLong);
  const size_t bytes = segment_bytes(size);
  int fd = -1;
  if (rank == 0) {
    std::random_device random;
    for (int attempt = 0; attempt < 8 && fd < 0; ++attempt) {
      const int64_t candidate =
          (static_cast<int64_t>(random()) << 31 ^ random() ^ getpid()) & 0x7fffffffffffffffLL;
      fd = shm_open(segment_name(candidate).c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
      if (fd >= 0) {
        id.fill_(candidate);
        // Reserve the pages now: a tmpfs that is too small (a container's 64 MiB /dev/shm) fails
        // here and every rank falls back to the process group, instead of a SIGBUS at a later
        // write.
        if (posix_fallocate(fd, 0, static_cast<off_t>(bytes)) != 0) {
          close(fd);
          shm_unlink(segment_name(candidate).c_str());
          fd = -1;
          id.fill_(0);
          break;
        }
      }
    }
  }
  std::vector<at::Tensor> id_tensors{id};
  group.broadcast(id_tensors)->wait();
  const int64_t segment = id.item<int64_t>();
  void* base = MAP_FAILED;
  if (segment != 0) {
    if (rank != 0) fd = shm_open(segment_name(segment).c_str(), O_RDWR, 0600);
    if (fd >= 0) {
      base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      close(fd);
    }
  }
  if (base != MAP_FAILED) {
    static_cast<RankControl*>(base)[rank].pid = getpid();
  }
  auto every_rank = [&](bool mine_ok) {
    auto ok = at::tensor({static_cast<int64_t>(mine_ok)}, at::kLong);
    std::vector<at::Tensor> tensors{ok};
    c10d::AllreduceOptions minimum;
    minimum.reduceOp = c10d::ReduceOp::MIN;
    group.allreduce(tensors, minimum)->wait();
    return ok.item<int64_t>() == 1;
  };
  bool usable = every_rank(base != MAP_FAILED);  // also: every pid is written before it is read
  if (rank == 0 && segment != 0)
    shm_unlink(segment_name(segment).c_str());  // gone with the last map
  if (usable) {
    // A dead peer is told by its pid: every rank must see every other's (one pid namespace).
    bool sees_peers = true;
    for (int64_t r = 0; r < size; ++r) {
      const pid_t pid = static_cast<pid_t>(static_cast<RankControl*>(base)[r].pid);
      sees_peers = sees_peers && pid > 0 && (kill(pid, 0) == 0 || errno == EPERM);
    }
    usable = every_rank(sees_peers);
  }
  if (!usable) {
    if (base != MAP_FAILED) munmap(base, bytes);
    return nullptr;
  }
  return std::unique_ptr<SharedMemoryCollectives>(
      new SharedMemoryCollectives(group_name, rank, size, base, bytes, timeout));
}

SharedMemoryCollectives::SharedMemoryCollectives(std::string group_name, int64_t rank, int64_t size,
                                                 void* base, size_t bytes,
                                                 std::chrono::milliseconds timeout)
    : group_name_(std::move(group_name)),
      rank_(rank),
      size_(size),
      base_(base),
      bytes_(bytes),
      timeout_(timeout) {
  static_assert(sizeof(RankControl) == 192, "segment_bytes assumes 192-byte rank controls");
}

SharedMemoryCollectives::~SharedMemoryCollectives() { munmap(base_, bytes_); }

SharedMemoryCollectives::RankControl& SharedMemoryCollectives::control(int64_t rank) const {
  return static_cast<RankControl*>(base_)[rank];
}

char* SharedMemoryCollectives::slot(int64_t sequence, int64_t rank) const {
  const int64_t buffer = sequence % kBuffers;
  return static_cast<char*>(base_) + static_cast<size_t>(size_) * 192 +
         static_cast<size_t>(buffer * size_ + rank) * static_cast<size_t>(kSlotBytes);
}

void SharedMemoryCollectives::wait_for_all(bool arrived, int64_t target,
                                           const char* collective) const {
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  for (int64_t r = 0; r < size_; ++r) {
    auto& counter = arrived ? control(r).arrived : control(r).departed;
    int64_t spins = 0;
    while (counter.load(std::memory_order_acquire) < target) {
      // Spin while the peer is about to arrive; then sleep on its futex word, so that waiting ranks
      // leave the cores to the ones still computing (ranks may outnumber cores).
      if (++spins < 2048) {
        pause_briefly();
        continue;
      }
      const uint32_t seen = control(r).changes.load(std::memory_order_acquire);
      if (counter.load(std::memory_order_acquire) >= target) break;
      sleep_while_unchanged(control(r).changes, seen, 20 * 1000 * 1000);
      const pid_t pid = static_cast<pid_t>(control(r).pid);
      // Exit first, then the counter: a peer that did its part and then exited (the last
      // collective of its program) has not failed this one.
      const bool exited = has_exited(pid);
      if (counter.load(std::memory_order_acquire) >= target) break;
      TORCH_CHECK(!exited, "shardtorch: ", collective, " on group '", group_name_,
                  "' failed: rank ", r, " of the group (pid ", pid,
                  ") exited while the others waited for it (shared memory)");
      TORCH_CHECK(std::chrono::steady_clock::now() < deadline, "shardtorch: ", collective,
                  " on group '", group_name_, "' timed out after ", timeout_.count(),
                  " ms waiting for rank ", r, " of the group (shared memory)");
    }
  }
}

int64_t SharedMemoryCollectives::begin(const at::Tensor& input, const char* collective) {
  const int64_t bytes = input.numel() * static_cast<int64_t>(input.element_size());
  TORCH_CHECK(input.is_cpu() && input.is_contiguous() && bytes <= kSlotBytes,
              "shardtorch: ", collective,
              " through shared memory takes a contiguous CPU tensor of at most ", kSlotBytes,
              " bytes, got ", bytes, " bytes");
  const int64_t sequence = ++sequence_;
  // The slot is free once every rank has read what it held two collectives ago.
  wait_for_all(false, sequence - kBuffers, collective);
  std::memcpy(slot(sequence, rank_), input.data_ptr(), static_cast<size_t>(bytes));
  const int64_t brought = bytes * 256 + static_cast<int64_t>(input.scalar_type());
  control(rank_).brought[sequence % kBuffers] = brought;
  control(rank_).arrived.store(sequence, std::memory_order_release);
  announce();
  wait_for_all(true, sequence, collective);
  // Gloo refuses tensors that differ across ranks; reading another size here would be silent.
  for (int64_t r = 0; r < size_; ++r) {
    const int64_t theirs = control(r).brought[sequence % kBuffers];
    if (theirs != brought) {
      end(sequence);  // every rank sees the difference and raises: the sequence stays agreed
      TORCH_CHECK(false, "shardtorch: ", collective, " on group '", group_name_, "': rank ", r,
                  " of the group brought ", theirs / 256, " bytes of ",
                  c10::toString(static_cast<c10::ScalarType>(theirs % 256)), ", this rank (", rank_,
                  ") ", bytes, " bytes of ", c10::toString(input.scalar_type()),
                  " (every rank must bring the same size and dtype)");
    }
  }
  return sequence;
}

void SharedMemoryCollectives::end(int64_t sequence) {
  control(rank_).departed.store(sequence, std::memory_order_release);
  announce();
}

void SharedMemoryCollectives::announce() {
  control(rank_).changes.fetch_add(1, std::memory_order_acq_rel);
  wake_sleepers(control(rank_).changes);
}

void SharedMemoryCollectives::all_reduce(at::Tensor& tensor) {
  RECORD_FUNCTION("shm:all_reduce", std::vector<c10::IValue>({c10::IValue(group_name_)}));
  const int64_t sequence = begin(tensor, "all_reduce");
  const auto options = tensor.options();
  // Every rank adds the slots in rank order: the same bits everywhere.
  tensor.copy_(at::from_blob(slot(sequence, 0), tensor.sizes(), options));
  for (int64_t r = 1; r < size_; ++r) {
    tensor.add_(at::from_blob(slot(sequence, r), tensor.sizes(), options));
  }
  end(sequence);
}

void SharedMemoryCollectives::all_gather(const at::Tensor& input, at::Tensor& output) {
  RECORD_FUNCTION("shm:all_gather", std::vector<c10::IValue>({c10::IValue(group_name_)}));
  const int64_t sequence = begin(input, "all_gather");
  auto blocks = output.view({size_, input.numel()});
  for (int64_t r = 0; r < size_; ++r) {
    blocks[r].copy_(at::from_blob(slot(sequence, r), {input.numel()}, input.options()));
  }
  end(sequence);
}

}  // namespace comm
}  // namespace shardtorch
