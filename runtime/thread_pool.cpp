#include "runtime/thread_pool.hpp"

#include <sched.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <set>
#include <string>

#include "jit/cpu/cpu.hpp"
#include "runtime/cpu_relax.hpp"

namespace ktjit {
namespace {
// Workers poll this long after a job before sleeping: long enough to cover the gap between the
// phases of one forward and between decode steps, short enough not to burn an idle core.
constexpr auto kSpin = std::chrono::microseconds(2000);
// Polls of a wait before it starts yielding the core: when there are more threads than cores
// (tests, shared machines) the thread being waited for needs the core more than the waiter.
constexpr int kPollsBeforeYield = 1024;

// Thrown inside a job when another thread of it failed, so that threads waiting at a barrier for
// the failed one leave instead of waiting forever. Never escapes run().
struct JobAborted {};

template <class Done>
void spin_until(Done done) {
  for (int i = 0; !done(); ++i) {
    if (i < kPollsBeforeYield)
      cpu_relax();
    else
      sched_yield();
  }
}

std::mutex g_pool_mu;
std::unique_ptr<ThreadPool> g_pool;
}  // namespace

void PoolWork::barrier() const {
  if (nt > 1) owner->barrier(pool);
}

ThreadPool::ThreadPool(int threads, int pools, const std::vector<int>& numa_nodes,
                       std::shared_ptr<const Topology> topo)
    : topo_(topo ? std::move(topo) : Topology::from_env()) {
  plan_ = topo_->plan(pools < 1 ? 1 : pools, threads < 1 ? 1 : threads, numa_nodes);
  n_ = 0;
  std::set<int> nodes;
  for (const PoolPlan& p : plan_) {
    flat_offset_.push_back(n_);
    n_ += p.threads();
    nodes.insert(p.node);
    if (!p.node_found)
      warn_once("numa-node-missing", "no NUMA node " + std::to_string(p.requested) +
                                         " (numa_nodes); its pool uses node " +
                                         std::to_string(p.node_os) + " instead; " +
                                         topo_->describe());
  }
  multi_node_ = topo_->can_bind() && nodes.size() > 1;
  if (!topo_->can_bind() && topo_->source() != "machine")
    warn_once("topology-not-bound",
              "topology " + topo_->source() + " is simulated: threads and memory are not bound");
  sync_ = std::make_unique<Sync[]>(plan_.size());
  for (size_t p = 0; p < plan_.size(); ++p) sync_[p].n = plan_[p].threads();
  // The caller (pool 0, thread 0) is never pinned: it is the application's thread (Python's, or
  // the serving queue's), and threads it creates later would inherit a one-core affinity.
  for (int p = 0; p < int(plan_.size()); ++p)
    for (int i = p == 0 ? 1 : 0; i < pool_size(p); ++i)
      threads_.emplace_back([this, p, i] { worker(p, i); });
  debug_log("thread pool: " + describe());
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    generation_.fetch_add(1);
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

std::string ThreadPool::describe() const {
  std::string s = std::to_string(n_) + " threads, " + std::to_string(pools()) + " pool(s) [";
  for (int p = 0; p < pools(); ++p) {
    if (p) s += ", ";
    s += "node " + std::to_string(pool_node(p)) + ": " + std::to_string(pool_size(p)) + " thr";
  }
  return s + "], " + topo_->describe();
}

void ThreadPool::worker(int pool, int tid) {
  const PoolPlan& pp = plan_[size_t(pool)];
  if (topo_->can_bind()) {
    if (!topo_->bind_thread_to_pu(pp.pus[size_t(tid)]))
      warn_once("pin", "could not pin worker threads (continuing unpinned)");
    // Scratch a worker allocates lands on its node; with one node there is nothing to choose.
    if (multi_node_ && !topo_->bind_thread_memory_to_node(pp.node))
      warn_once("membind-thread", "could not bind worker memory to its NUMA node (continuing)");
  }
  uint64_t seen = 0;
  for (;;) {
    auto spin_until_t = std::chrono::steady_clock::now() + kSpin;
    int polls = 0;
    while (generation_.load(std::memory_order_acquire) == seen) {
      ++polls;
      if ((polls & 255) == 0 && std::chrono::steady_clock::now() > spin_until_t) {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return generation_.load() != seen; });
        break;
      }
      if (polls < kPollsBeforeYield)
        cpu_relax();
      else
        sched_yield();
    }
    seen = generation_.load(std::memory_order_acquire);
    if (stop_) return;
    call(pool, tid);
    sync_[size_t(pool)].remaining.fetch_sub(1, std::memory_order_acq_rel);
  }
}

void ThreadPool::fail(std::exception_ptr e, int flat_tid) {
  std::lock_guard<std::mutex> lock(err_mu_);
  if (!error_ || flat_tid < error_tid_) {  // the lowest thread's: its items come first
    error_ = e;
    error_tid_ = flat_tid;
  }
  failed_.store(true, std::memory_order_release);
}

void ThreadPool::call(int pool, int tid) {
  try {
    if (flat_job_) {
      (*flat_job_)(flat_offset_[size_t(pool)] + tid, n_);
    } else {
      PoolWork w;
      w.pool = pool;
      w.pools = pools();
      w.tid = tid;
      w.nt = pool_size(pool);
      w.owner = this;
      (*pool_job_)(w);
    }
  } catch (const JobAborted&) {
  } catch (...) {
    fail(std::current_exception(), flat_offset_[size_t(pool)] + tid);
  }
}

// Sense-free generation barrier: the last thread to arrive resets the count and advances the
// phase; the others wait for the phase to move.
void ThreadPool::barrier(int pool) {
  Sync& s = sync_[size_t(pool)];
  const uint32_t phase = s.phase.load(std::memory_order_acquire);
  if (s.arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == s.n) {
    s.arrived.store(0, std::memory_order_relaxed);
    s.phase.store(phase + 1, std::memory_order_release);
    return;
  }
  spin_until([&] {
    return s.phase.load(std::memory_order_acquire) != phase ||
           failed_.load(std::memory_order_acquire);
  });
  if (s.phase.load(std::memory_order_acquire) == phase) throw JobAborted{};
}

void ThreadPool::dispatch() {
  error_ = nullptr;
  failed_.store(false, std::memory_order_relaxed);
  for (int p = 0; p < pools(); ++p) {
    sync_[size_t(p)].remaining.store(p == 0 ? pool_size(p) - 1 : pool_size(p),
                                     std::memory_order_relaxed);
    sync_[size_t(p)].arrived.store(0, std::memory_order_relaxed);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    generation_.fetch_add(1, std::memory_order_acq_rel);
  }
  cv_.notify_all();
  call(0, 0);
  for (int p = 0; p < pools(); ++p)
    spin_until([&] { return sync_[size_t(p)].remaining.load(std::memory_order_acquire) == 0; });
  flat_job_ = nullptr;
  pool_job_ = nullptr;
  if (error_) std::rethrow_exception(error_);
}

void ThreadPool::run(const std::function<void(int, int)>& fn) {
  std::lock_guard<std::mutex> run_lock(run_mu_);
  if (n_ == 1) {
    fn(0, 1);
    return;
  }
  flat_job_ = &fn;
  pool_job_ = nullptr;
  dispatch();
}

void ThreadPool::run_pools(const std::function<void(const PoolWork&)>& fn) {
  std::lock_guard<std::mutex> run_lock(run_mu_);
  if (n_ == 1) {
    PoolWork w;
    w.owner = this;
    fn(w);
    return;
  }
  flat_job_ = nullptr;
  pool_job_ = &fn;
  dispatch();
}

bool ThreadPool::bind_memory(void* p, size_t bytes, int pool) const {
  if (!multi_node_ || pool < 0 || pool >= pools()) return false;
  if (topo_->bind_area_to_node(p, bytes, plan_[size_t(pool)].node)) return true;
  warn_once("membind-area",
            "could not bind packed weights to their NUMA node (placed by first touch instead)");
  return false;
}

ThreadPool& ThreadPool::global(int threads, int pools, const std::vector<int>& numa_nodes) {
  std::lock_guard<std::mutex> lock(g_pool_mu);
  if (!g_pool) {
    if (threads <= 0) threads = int(std::thread::hardware_concurrency());
    g_pool = std::make_unique<ThreadPool>(threads, pools, numa_nodes);
  }
  return *g_pool;
}

bool ThreadPool::global_exists() {
  std::lock_guard<std::mutex> lock(g_pool_mu);
  return bool(g_pool);
}

}  // namespace ktjit
