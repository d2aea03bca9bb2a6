// Collectives over shared memory for the ranks of one tensor-parallel group on one machine
// (models/shm_comm.py). gloo's all-reduce of a decode step's (1, hidden) activations between two
// local processes takes ~1.3 ms of socket round trips, twice per layer; here each rank copies its
// tensor into its slot of one shared mapping, posts a sequence number, waits for every rank's
// number, and reads every slot: a few microseconds.
//
// Mapping: `world` counters, one per 64-byte line (a rank's posts do not invalidate the line
// the others spin on), then 2 buffers (by call parity) of `world` slots of `max_bytes` (rounded
// up to 64) each.
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t LINE = 64;
constexpr uint64_t YIELD_SPINS = 256;  // pauses between yields: 3 ranks on 2 cores still progress
constexpr uint64_t CLOCK_SPINS = 1 << 16;  // pauses between looks at the clock
constexpr int64_t GRAIN = 1 << 15;  // elements per thread of a sum
constexpr int64_t CHUNK = 256;  // elements summed in registers / on the stack at a time

std::atomic<double> timeout_s{120.0};

struct alignas(LINE) Counter {
  std::atomic<uint64_t> seq;  // calls this rank has posted
};
static_assert(sizeof(Counter) == LINE && std::atomic<uint64_t>::is_always_lock_free,
              "a counter is one lock-free word on a line of its own (shared between processes)");

struct Comm {
  char* base;
  int64_t rank, world, max_bytes, slot;
  uint64_t seq = 0;  // calls this rank has made
  double seconds = 0;  // spent in its collectives (copies, waiting for the others, sums): benchmarks read it

  Counter& counter(int64_t r) const { return reinterpret_cast<Counter*>(base)[r]; }
  char* slot_of(uint64_t call, int64_t r) const {
    return base + world * LINE + (int64_t(call % 2) * world + r) * slot;
  }
};

std::mutex table_mutex;
std::vector<std::unique_ptr<Comm>> table;  // NOTE: never shrinks: a handle stays valid for the process's life

Comm& comm_of(int64_t handle) {
  std::lock_guard<std::mutex> lock(table_mutex);
  TORCH_CHECK(handle >= 0 && handle < int64_t(table.size()), "no shared-memory communicator ", handle);
  return *table[handle];
}

std::string path_of(const std::string& name) {
  TORCH_CHECK(!name.empty() && name.find('/') == std::string::npos, "shm name must be non-empty, without '/'");
  return "/" + name;
}

int64_t open_comm(const std::string& name, int64_t rank, int64_t world, int64_t max_bytes, bool create) {
  TORCH_CHECK(world >= 1 && rank >= 0 && rank < world, "rank ", rank, " outside a world of ", world);
  TORCH_CHECK(max_bytes > 0, "max_bytes must be positive");
  const std::string path = path_of(name);
  const int64_t slot = (max_bytes + LINE - 1) / LINE * LINE;
  const int64_t bytes = world * LINE + 2 * world * slot;
  const int fd = ::shm_open(path.c_str(), create ? O_CREAT | O_EXCL | O_RDWR : O_RDWR, 0600);
  TORCH_CHECK(fd >= 0, "shm_open(", path, "): ", std::strerror(errno));
  int err = 0;
  if (create) {
    // NOTE: every page allocated now (zeroed: counters at 0): a /dev/shm too small for the buffers
    // is an error here instead of a SIGBUS at the first collective that touches a missing page
    err = posix_fallocate(fd, 0, bytes);
    if (err != 0) ::shm_unlink(path.c_str());
  } else {
    struct stat st;
    err = fstat(fd, &st) == 0 ? 0 : errno;
    if (err == 0 && st.st_size != bytes) {
      ::close(fd);
      TORCH_CHECK(false, path, " holds ", st.st_size, " bytes, not ", bytes,
                  ": every rank must open it with the same world_size and max_bytes");
    }
  }
  void* base = err == 0 ? mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
  if (err == 0 && base == MAP_FAILED) err = errno;
  ::close(fd);  // the mapping keeps the memory
  TORCH_CHECK(err == 0, "shared memory ", path, " (", bytes, " bytes): ", std::strerror(err));
  std::lock_guard<std::mutex> lock(table_mutex);
  table.push_back(std::make_unique<Comm>(Comm{static_cast<char*>(base), rank, world, max_bytes, slot}));
  return int64_t(table.size()) - 1;
}

void unlink_name(const std::string& name) {
  const std::string path = path_of(name);
  TORCH_CHECK(::shm_unlink(path.c_str()) == 0, "shm_unlink(", path, "): ", std::strerror(errno));
}

void set_timeout(double seconds) {
  TORCH_CHECK(seconds > 0, "the timeout must be positive");
  timeout_s.store(seconds);
}

inline void pause() {
#if defined(__x86_64__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

[[noreturn]] void missing(const Comm& c, uint64_t target, const char* op) {
  std::string ranks;
  for (int64_t r = 0; r < c.world; ++r)
    if (c.counter(r).seq.load(std::memory_order_acquire) < target)
      ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  TORCH_CHECK(false, op, ": rank(s) ", ranks, " of ", c.world, " did not arrive at call ", target, " within ",
              timeout_s.load(), " s (dead or stuck); this communicator is unusable now");
}

// Post this rank's slot for the next call (already written), then wait for every rank's.
uint64_t post_and_wait(Comm& c, const char* op) {
  const uint64_t call = c.seq++, target = call + 1;
  c.counter(c.rank).seq.store(target, std::memory_order_release);  // NOTE: publishes the slot written before it
  const auto start = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < c.world; ++r) {
    for (uint64_t spins = 1; c.counter(r).seq.load(std::memory_order_acquire) < target; ++spins) {
      pause();
      if (spins % YIELD_SPINS == 0) sched_yield();
      if (spins % CLOCK_SPINS == 0 &&
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > timeout_s.load())
        missing(c, target, op);
    }
  }
  return call;
}

at::Tensor checked(const at::Tensor& x, const Comm& c, const char* op) {
  TORCH_CHECK(x.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(x.nbytes() <= size_t(c.max_bytes), op, ": x has ", x.nbytes(), " bytes, more than this communicator's ",
              "max_bytes (", c.max_bytes, "); open it with a larger max_bytes");
  return x.contiguous();
}

// out = slot 0 + slot 1 + ... in rank order, in fp32, rounded once: bitwise the same on every rank.
template <typename T>
void sum_slots(const Comm& c, uint64_t call, int64_t n, T* out) {
  at::parallel_for(0, n, GRAIN, [&](int64_t a, int64_t b) {
    float acc[CHUNK];
    for (int64_t i = a; i < b; i += CHUNK) {
      const int64_t m = std::min(CHUNK, b - i);
      const T* s = reinterpret_cast<const T*>(c.slot_of(call, 0)) + i;
      for (int64_t j = 0; j < m; ++j) acc[j] = float(s[j]);
      for (int64_t r = 1; r < c.world; ++r) {
        s = reinterpret_cast<const T*>(c.slot_of(call, r)) + i;
        for (int64_t j = 0; j < m; ++j) acc[j] += float(s[j]);
      }
      for (int64_t j = 0; j < m; ++j) out[i + j] = T(acc[j]);
    }
  });
}

// NOTE: two buffers suffice: a rank starts call k + 2 (overwriting its slot of call k's buffer)
// only after call k + 1 returned, i.e. after every rank posted call k + 1, which each did only
// after it finished reading call k's slots.
// Adds the wall time of one collective to its communicator's total, however the call ends.
struct Timed {
  Comm& c;
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  ~Timed() { c.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); }
};

at::Tensor all_reduce(const at::Tensor& x, int64_t handle) {
  Comm& c = comm_of(handle);
  Timed timed{c};
  const at::Tensor xc = checked(x, c, "shm_all_reduce");
  const auto dtype = xc.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "shm_all_reduce: float32, bfloat16 or float16 only");
  std::memcpy(c.slot_of(c.seq, c.rank), xc.data_ptr(), xc.nbytes());
  const uint64_t call = post_and_wait(c, "shm_all_reduce");
  at::Tensor out = at::empty(xc.sizes(), xc.options());
  const int64_t n = xc.numel();
  if (dtype == at::kFloat) sum_slots(c, call, n, out.data_ptr<float>());
  else if (dtype == at::kBFloat16) sum_slots(c, call, n, out.data_ptr<c10::BFloat16>());
  else sum_slots(c, call, n, out.data_ptr<c10::Half>());
  return out;
}

// Every rank's x (one shape on all), concatenated along the last dim: (..., world * last).
at::Tensor all_gather(const at::Tensor& x, int64_t handle) {
  Comm& c = comm_of(handle);
  Timed timed{c};
  TORCH_CHECK(x.dim() >= 1, "shm_all_gather: x needs a last dim");
  const at::Tensor xc = checked(x, c, "shm_all_gather");
  std::memcpy(c.slot_of(c.seq, c.rank), xc.data_ptr(), xc.nbytes());
  const uint64_t call = post_and_wait(c, "shm_all_gather");
  std::vector<int64_t> shape(xc.sizes().begin(), xc.sizes().end());
  shape.back() *= c.world;
  at::Tensor out = at::empty(shape, xc.options());
  const int64_t row = xc.size(-1) * xc.element_size(), rows = xc.numel() / std::max<int64_t>(xc.size(-1), 1);
  char* dst = static_cast<char*>(out.data_ptr());  // (rows, world, row bytes)
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t r = 0; r < c.world; ++r) std::memcpy(dst + (i * c.world + r) * row, c.slot_of(call, r) + i * row, row);
  return out;
}

std::tuple<int64_t, double> stats(int64_t handle) {
  const Comm& c = comm_of(handle);
  return {int64_t(c.seq), c.seconds};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnserve, m) {
  m.def("shm_stats(int handle) -> (int, float)", &stats);
  m.def("shm_open(str name, int rank, int world_size, int max_bytes, bool create) -> int", &open_comm);
  m.def("shm_unlink(str name) -> ()", &unlink_name);
  m.def("shm_set_timeout(float seconds) -> ()", &set_timeout);
  // shm_all_reduce and shm_all_gather are defined in models/shm_comm.py (with their fake kernels)
}

TORCH_LIBRARY_IMPL(attnserve, CPU, m) {
  m.impl("shm_all_reduce", &all_reduce);
  m.impl("shm_all_gather", &all_gather);
}
