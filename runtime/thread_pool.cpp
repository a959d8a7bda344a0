#include "runtime/thread_pool.hpp"

#include <hwloc.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>

#include "jit/cpu/cpu.hpp"

namespace ktjit {
namespace {
// Workers poll this long after a job before sleeping: long enough to cover the gap between the
// phases of one forward and between decode steps, short enough not to burn an idle core.
constexpr auto kSpin = std::chrono::microseconds(2000);

std::mutex g_pool_mu;
std::unique_ptr<ThreadPool> g_pool;
}  // namespace

ThreadPool::ThreadPool(int threads, int pools)
    : n_(threads < 1 ? 1 : threads), pools_(pools < 1 ? 1 : pools) {
  hwloc_topology_t topo = nullptr;
  if (hwloc_topology_init(&topo) == 0 && hwloc_topology_load(topo) == 0) {
    topology_ = topo;
  } else {
    if (topo) hwloc_topology_destroy(topo);
    std::fprintf(stderr,
                 "[kt-jit] warning: hwloc could not load the topology; threads are not pinned\n");
  }
  // The caller (thread 0) is never pinned: it is the application's thread (Python's, or the
  // serving queue's), and threads it creates later would inherit a one-core affinity.
  for (int i = 1; i < n_; ++i) threads_.emplace_back([this, i] { worker(i); });
  debug_log("thread pool: " + std::to_string(n_) + " threads, " + std::to_string(pools_) +
            " pool(s)");
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    generation_.fetch_add(1);
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
  if (topology_) hwloc_topology_destroy(static_cast<hwloc_topology_t>(topology_));
}

// Worker i runs on physical core i (first PU of the core) so SMT siblings are used last; core 0
// is left to the caller.
void ThreadPool::pin(int id) {
  auto topo = static_cast<hwloc_topology_t>(topology_);
  if (!topo) return;
  const int ncores = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_CORE);
  if (ncores <= 0) return;
  hwloc_obj_t core = hwloc_get_obj_by_type(topo, HWLOC_OBJ_CORE, unsigned(id % ncores));
  if (!core || !core->cpuset) return;
  hwloc_bitmap_t set = hwloc_bitmap_dup(core->cpuset);
  hwloc_bitmap_singlify(set);
  if (hwloc_set_cpubind(topo, set, HWLOC_CPUBIND_THREAD) != 0) {
    static std::atomic<bool> warned{false};
    if (!warned.exchange(true))
      std::fprintf(stderr,
                   "[kt-jit] warning: could not pin worker threads (continuing unpinned)\n");
  }
  hwloc_bitmap_free(set);
}

void ThreadPool::worker(int id) {
  pin(id);
  uint64_t seen = 0;
  for (;;) {
    auto spin_until = std::chrono::steady_clock::now() + kSpin;
    int polls = 0;
    while (generation_.load(std::memory_order_acquire) == seen) {
      if ((++polls & 255) == 0 && std::chrono::steady_clock::now() > spin_until) {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return generation_.load() != seen; });
        break;
      }
      __builtin_ia32_pause();
    }
    seen = generation_.load(std::memory_order_acquire);
    if (stop_) return;
    try {
      (*job_)(id, n_);
    } catch (...) {
      std::lock_guard<std::mutex> lock(err_mu_);
      if (!error_) error_ = std::current_exception();
    }
    remaining_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

void ThreadPool::run(const std::function<void(int, int)>& fn) {
  std::lock_guard<std::mutex> run_lock(run_mu_);
  if (n_ == 1) {
    fn(0, 1);
    return;
  }
  error_ = nullptr;
  job_ = &fn;
  remaining_.store(n_ - 1, std::memory_order_release);
  {
    std::lock_guard<std::mutex> lock(mu_);
    generation_.fetch_add(1, std::memory_order_acq_rel);
  }
  cv_.notify_all();
  try {
    fn(0, n_);
  } catch (...) {
    std::lock_guard<std::mutex> lock(err_mu_);
    if (!error_) error_ = std::current_exception();
  }
  while (remaining_.load(std::memory_order_acquire) != 0) __builtin_ia32_pause();
  job_ = nullptr;
  if (error_) std::rethrow_exception(error_);
}

ThreadPool& ThreadPool::global(int threads, int pools) {
  std::lock_guard<std::mutex> lock(g_pool_mu);
  if (!g_pool) {
    if (threads <= 0) threads = int(std::thread::hardware_concurrency());
    g_pool = std::make_unique<ThreadPool>(threads, pools);
  }
  return *g_pool;
}

bool ThreadPool::global_exists() {
  std::lock_guard<std::mutex> lock(g_pool_mu);
  return bool(g_pool);
}

}  // namespace ktjit
