// Machine limits measured with generated loops (jit/x64/bench_loops.cpp on x86-64,
// jit/aarch64/bench_loops_a64.cpp on AArch64) on the calling process.
#include "runtime/machine_limits.hpp"

#include <sched.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "jit/bench_loops.hpp"
#include "jit/kernel.hpp"
#include "runtime/cpu_relax.hpp"
#include "runtime/thread_pool.hpp"

namespace ktjit {
namespace {

using Clock = std::chrono::steady_clock;
using ReadFn = void (*)(const void*, int64_t);
using PeakFn = void (*)(int64_t);

double seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Anonymous mapping rounded up to 2 MiB, asked for transparent huge pages. Not touched here.
class HugeBuffer {
 public:
  explicit HugeBuffer(size_t bytes) {
    const size_t huge = size_t(2) << 20;
    size_ = (std::max<size_t>(bytes, 1) + huge - 1) / huge * huge;
    void* p = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    madvise(p, size_, MADV_HUGEPAGE);  // best effort
    ptr_ = static_cast<uint8_t*>(p);
  }
  ~HugeBuffer() { munmap(ptr_, size_); }
  HugeBuffer(const HugeBuffer&) = delete;
  HugeBuffer& operator=(const HugeBuffer&) = delete;
  uint8_t* data() const { return ptr_; }

 private:
  uint8_t* ptr_ = nullptr;
  size_t size_ = 0;
};

// Portable fallback when no vector level (or no executable memory) is available.
void read_stream_ref(const void* buf, int64_t bytes) {
  const uint64_t* p = static_cast<const uint64_t*>(buf);
  uint64_t a = 0, b = 0, c = 0, d = 0;
  for (int64_t i = 0; i < bytes / 8; i += 4) {
    a += p[i];
    b ^= p[i + 1];
    c += p[i + 2];
    d |= p[i + 3];
  }
  static volatile uint64_t sink;
  (void)sink;
  sink = a + b + c + d;
}

ReadFn read_stream_fn() {
  const IsaLevel isa = selected_isa();
  if (isa == IsaLevel::ref) return &read_stream_ref;
  KernelKey key;
  key.kind = KernelKind::read_stream;
  key.isa = isa;
  key.format = WeightFormat::none;
  const Kernel* k = KernelCache::instance().get(key);
  return k ? reinterpret_cast<ReadFn>(const_cast<void*>(k->entry())) : &read_stream_ref;
}

// The CPUs this process may run on, in order.
std::vector<int> allowed_cpus() {
  std::vector<int> cpus;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0)
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &set)) cpus.push_back(c);
  if (cpus.empty()) cpus.push_back(0);
  return cpus;
}

void pin_this_thread(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  sched_setaffinity(0, sizeof(set), &set);  // 0 = the calling thread; best effort
}

class SpinBarrier {
 public:
  explicit SpinBarrier(int n) : n_(n) {}
  void wait() {
    const int gen = gen_.load(std::memory_order_acquire);
    if (count_.fetch_add(1, std::memory_order_acq_rel) + 1 == n_) {
      count_.store(0, std::memory_order_relaxed);
      gen_.fetch_add(1, std::memory_order_release);
      return;
    }
    for (int spins = 0; gen_.load(std::memory_order_acquire) == gen; ++spins) {
      if (spins > 4096)
        sched_yield();
      else
        cpu_relax();
    }
  }

 private:
  const int n_;
  std::atomic<int> count_{0};
  std::atomic<int> gen_{0};
};

size_t round_kib(size_t bytes) {
  return bytes / 1024 * 1024;
}

}  // namespace

struct ReadProbe::Buffer : HugeBuffer {
  using HugeBuffer::HugeBuffer;
};

ReadProbe::ReadProbe(size_t bytes, ThreadPool* pool) : pool_(pool) {
  const size_t n = size_t(threads());
  part_ = round_kib(bytes / n);
  bytes_ = part_ * n;
  if (bytes_ == 0) throw std::invalid_argument("ReadProbe: empty buffer");
  buf_ = std::make_unique<Buffer>(bytes_);
  fn_ = read_stream_fn();
  if (!pool_) {
    std::memset(buf_->data(), 1, bytes_);  // first touch: pages resident before any pass
    fn_(buf_->data(), int64_t(bytes_));    // warm-up pass (TLB, clocks)
    return;
  }
  pool_->run([&](int t, int) {  // each part first-touched by its reader (its pool's node)
    uint8_t* mine = buf_->data() + size_t(t) * part_;
    std::memset(mine, 1, part_);
    fn_(mine, int64_t(part_));
  });
}

ReadProbe::~ReadProbe() = default;

int ReadProbe::threads() const {
  return pool_ ? pool_->size() : 1;
}

double ReadProbe::pass_gbs() {
  if (!pool_) {
    const auto t0 = Clock::now();
    fn_(buf_->data(), int64_t(bytes_));
    const auto t1 = Clock::now();
    return double(bytes_) / seconds(t0, t1) / 1e9;
  }
  const size_t n = size_t(threads());
  std::vector<Clock::time_point> start(n), end(n);
  pool_->run([&](int t, int) {
    start[size_t(t)] = Clock::now();
    fn_(buf_->data() + size_t(t) * part_, int64_t(part_));
    end[size_t(t)] = Clock::now();
  });
  return double(bytes_) /
         seconds(*std::min_element(start.begin(), start.end()),
                 *std::max_element(end.begin(), end.end())) /
         1e9;
}

double measure_read_bandwidth_gbs(size_t bytes, int reps) {
  if (round_kib(bytes) == 0 || reps < 1)
    throw std::invalid_argument("measure_read_bandwidth_gbs: empty");
  ReadProbe probe(bytes);
  std::vector<double> gbs;
  for (int r = 0; r < reps; ++r) gbs.push_back(probe.pass_gbs());
  return median(gbs);
}

namespace {
// Runs work(t) on `threads` std::threads, thread t pinned to the t-th CPU of the process's
// affinity mask, for reps + 1 passes between barriers (pass 0 a warm-up); setup(t) runs once on
// thread t first (first touch). Per timed pass, the seconds from the first thread's start to the
// last one's end.
template <class Setup, class Work>
std::vector<double> pinned_pass_seconds(int threads, int reps, Setup setup, Work work) {
  const std::vector<int> cpus = allowed_cpus();
  SpinBarrier barrier(threads);
  const int passes = reps + 1;
  std::vector<Clock::time_point> start(size_t(threads) * passes), end(size_t(threads) * passes);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      pin_this_thread(cpus[size_t(t) % cpus.size()]);
      setup(t);
      for (int r = 0; r < passes; ++r) {
        barrier.wait();
        start[size_t(r) * threads + t] = Clock::now();
        work(t);
        end[size_t(r) * threads + t] = Clock::now();
        barrier.wait();
      }
    });
  }
  for (auto& th : pool) th.join();
  std::vector<double> secs;
  for (int r = 1; r < passes; ++r) {
    auto first = start[size_t(r) * threads], last = end[size_t(r) * threads];
    for (int t = 1; t < threads; ++t) {
      first = std::min(first, start[size_t(r) * threads + t]);
      last = std::max(last, end[size_t(r) * threads + t]);
    }
    secs.push_back(seconds(first, last));
  }
  return secs;
}
}  // namespace

double measure_read_bandwidth_gbs_threads(int threads, size_t bytes, int reps) {
  if (threads < 1 || reps < 1) throw std::invalid_argument("measure_read_bandwidth_gbs_threads");
  const size_t part = round_kib(bytes / size_t(threads));
  if (part == 0)
    throw std::invalid_argument("measure_read_bandwidth_gbs_threads: buffer too small");
  HugeBuffer buf(part * size_t(threads));
  const ReadFn fn = read_stream_fn();
  auto mine = [&](int t) { return buf.data() + size_t(t) * part; };
  std::vector<double> gbs;
  for (double sec : pinned_pass_seconds(
           threads, reps, [&](int t) { std::memset(mine(t), 1, part); },  // first touch
           [&](int t) { fn(mine(t), int64_t(part)); }))
    gbs.push_back(double(part) * threads / sec / 1e9);
  return median(gbs);
}

namespace {
// The peak loop for `op` at `isa` and its ops per iteration; throws as measure_peak_gops does.
// Null when executable memory is refused.
PeakFn peak_loop(IsaLevel isa, uint8_t op, const char* who, double* ops_per_iter) {
  KernelKey key;
  key.kind = KernelKind::peak_loop;
  key.isa = isa;
  key.format = WeightFormat::none;
  key.variant = op;
  *ops_per_iter = peak_ops_per_iteration(key);  // throws for invalid combos
  if (!level_usable(isa, cpu_features()))
    throw std::invalid_argument(std::string(who) + ": this CPU cannot run isa " + isa_name(isa));
  const Kernel* k = KernelCache::instance().get(key);
  return k ? reinterpret_cast<PeakFn>(const_cast<void*>(k->entry())) : nullptr;
}

// Iterations of `fn` that take about 30 ms on the calling thread (after a full-length warm-up
// for the clock ramp).
int64_t peak_iterations(PeakFn fn) {
  // Calibrate: grow until a run takes >= 2 ms, then size each rep to ~30 ms.
  int64_t iters = 1000;
  double t = 0;
  for (;;) {
    const auto t0 = Clock::now();
    fn(iters);
    t = seconds(t0, Clock::now());
    if (t >= 2e-3 || iters > (int64_t(1) << 40)) break;
    iters *= 4;
  }
  iters = std::max<int64_t>(1, int64_t(double(iters) * 30e-3 / std::max(t, 1e-9)));
  fn(iters);  // warm-up at full length (clock ramp)
  return iters;
}
}  // namespace

double measure_peak_gops(IsaLevel isa, uint8_t op, int reps) {
  if (reps < 1) throw std::invalid_argument("measure_peak_gops: reps < 1");
  double ops_per_iter = 0;
  const PeakFn fn = peak_loop(isa, op, "measure_peak_gops", &ops_per_iter);
  if (!fn) return 0;
  const int64_t iters = peak_iterations(fn);
  std::vector<double> gops;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    fn(iters);
    const auto t1 = Clock::now();
    gops.push_back(ops_per_iter * double(iters) / seconds(t0, t1) / 1e9);
  }
  return *std::max_element(gops.begin(), gops.end());  // see the header
}

double measure_peak_gops_threads(IsaLevel isa, uint8_t op, int threads, int reps) {
  if (threads < 1 || reps < 1) throw std::invalid_argument("measure_peak_gops_threads");
  double ops_per_iter = 0;
  const PeakFn fn = peak_loop(isa, op, "measure_peak_gops_threads", &ops_per_iter);
  if (!fn) return 0;
  const int64_t iters = peak_iterations(fn);  // sized on the caller; every thread runs as many
  std::vector<double> gops;
  for (double sec : pinned_pass_seconds(threads, reps, [](int) {}, [&](int) { fn(iters); }))
    gops.push_back(ops_per_iter * double(iters) * threads / sec / 1e9);
  return *std::max_element(gops.begin(), gops.end());
}

MachineLimits measure_machine_limits(IsaLevel isa) {
  MachineLimits m;
  m.read_gbs_1t = measure_read_bandwidth_gbs();
  if (allowed_cpus().size() >= 2) m.read_gbs_2t = measure_read_bandwidth_gbs_threads(2);
  auto peak = [&](PeakOp op) {
    try {
      return measure_peak_gops(isa, uint8_t(op));
    } catch (const std::invalid_argument&) {
      return 0.0;  // the ISA lacks the op (or the CPU cannot run the ISA)
    }
  };
  m.peak_fma_gflops = peak(PeakOp::fma_f32);
  if (isa_is_neon(isa)) {
    m.peak_sdot_gops = peak(PeakOp::sdot);
    m.peak_smull_gops = peak(PeakOp::smull_sadalp);
    m.peak_bfdot_gflops = peak(PeakOp::bfdot);
    return m;
  }
  m.peak_vnni_gops = peak(PeakOp::vpdpbusd);
  m.peak_maddubsw_gops = peak(PeakOp::maddubsw);
  m.peak_maddubsw_w_gops = peak(PeakOp::maddubsw_w);
  m.peak_bf16_gflops = peak(PeakOp::dpbf16);
  m.peak_amx_int8_gops = peak(PeakOp::tdpbusd);
  m.peak_amx_bf16_gflops = peak(PeakOp::tdpbf16ps);
  return m;
}

}  // namespace ktjit
