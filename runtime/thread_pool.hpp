// The worker pools: `threads` threads split over `pools` pools, pool p bound to NUMA node
// numa_nodes[p] (threads pinned to the node's cores, physical cores before SMT siblings, their
// memory bound to the node). The caller is thread 0 of pool 0 and takes part; every other thread
// is a worker that spins briefly after a job (decode phases come back within microseconds), then
// sleeps on a condition variable.
//
// Two kinds of job, each one fork/join over every thread of every pool:
//   run(fn(tid, nt))     — flat: tid over all threads (loaders, whole-batch passes);
//   run_pools(fn(work))  — per pool: work.pool, work.tid/work.nt inside the pool, and
//                          work.barrier() synchronising that pool's threads only, so each pool
//                          runs its own phases on its own shard without waiting for the others.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "runtime/topology.hpp"

namespace ktjit {

class ThreadPool;

// One thread's view of a run_pools job.
struct PoolWork {
  int pool = 0, pools = 1;  // this thread's pool, of how many
  int tid = 0, nt = 1;      // this thread inside its pool
  ThreadPool* owner = nullptr;
  // Waits until every thread of this pool has arrived (a spin barrier; never sleeps).
  void barrier() const;
};

class ThreadPool {
 public:
  // topo: null = Topology::from_env() (the machine, or KT_JIT_TOPOLOGY). numa_nodes: node os
  // index per pool (default p).
  ThreadPool(int threads, int pools = 1, const std::vector<int>& numa_nodes = {},
             std::shared_ptr<const Topology> topo = nullptr);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_; }  // all threads, the caller included
  int pools() const { return int(plan_.size()); }
  int pool_size(int p) const { return plan_[size_t(p)].threads(); }
  int pool_node(int p) const { return plan_[size_t(p)].node_os; }  // NUMA node os index
  const std::vector<PoolPlan>& plan() const { return plan_; }
  const Topology& topology() const { return *topo_; }
  bool bound() const { return topo_->can_bind(); }  // threads pinned and memory bound
  std::string describe() const;  // one line: threads, pools and their nodes, topology

  // Runs fn(thread_id, num_threads) on every thread of every pool and returns when all are done.
  // An exception thrown by a thread is rethrown here; when several threads throw, the one with the
  // lowest flat thread id wins, so a job that splits items in order (split_range) reports its
  // first bad item whatever the timing. Concurrent callers (a load beside a queued forward) take
  // turns; a call from inside a job would deadlock.
  void run(const std::function<void(int, int)>& fn);
  // Runs fn(work) on every thread; see PoolWork. Same rules as run().
  void run_pools(const std::function<void(const PoolWork&)>& fn);

  // Binds untouched pages [p, p + bytes) to pool `pool`'s node (pages are placed at first
  // touch). False when not bound (synthetic topology, one node, or the OS refused: one warning).
  bool bind_memory(void* p, size_t bytes, int pool) const;

  // Process-wide pools: the first call decides threads/pools/nodes; later calls return it.
  static ThreadPool& global(int threads = 0, int pools = 1,
                            const std::vector<int>& numa_nodes = {});
  static bool global_exists();

 private:
  friend struct PoolWork;
  struct alignas(64) Sync {  // one per pool, on its own cache lines
    std::atomic<int> remaining{0};
    alignas(64) std::atomic<int> arrived{0};
    std::atomic<uint32_t> phase{0};
    int n = 1;
  };
  void worker(int pool, int tid);
  void dispatch();
  void call(int pool, int tid);
  void barrier(int pool);
  void fail(std::exception_ptr e, int flat_tid);

  std::shared_ptr<const Topology> topo_;
  std::vector<PoolPlan> plan_;
  int n_ = 1;
  bool multi_node_ = false;  // pools sit on more than one bound node
  std::vector<std::thread> threads_;
  std::unique_ptr<Sync[]> sync_;
  std::mutex run_mu_;  // one job at a time
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<bool> stop_{false};
  std::atomic<bool> failed_{false};
  const std::function<void(int, int)>* flat_job_ = nullptr;
  const std::function<void(const PoolWork&)>* pool_job_ = nullptr;
  std::vector<int> flat_offset_;  // first flat thread id of each pool
  std::mutex err_mu_;
  std::exception_ptr error_;
  int error_tid_ = 0;  // flat thread id whose exception error_ holds
};

// Contiguous [begin, end) share of `n` items for thread `tid` of `nt`.
inline void split_range(int64_t n, int tid, int nt, int64_t* begin, int64_t* end) {
  *begin = n * tid / nt;
  *end = n * (tid + 1) / nt;
}

}  // namespace ktjit
