// The process-wide worker pool: `threads` threads (the caller is thread 0), pinned to cores,
// a fork/join per phase. Workers spin briefly after a job (decode phases come back within
// microseconds), then sleep on a condition variable.
#pragma once

#include <atomic>
#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace ktjit {

class ThreadPool {
 public:
  ThreadPool(int threads, int pools);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_; }
  int pools() const { return pools_; }
  // Runs fn(thread_id, num_threads) on every thread and returns when all are done. The first
  // exception thrown by any thread is rethrown here. Concurrent callers (a load beside a queued
  // forward) take turns; a call from inside a job would deadlock.
  void run(const std::function<void(int, int)>& fn);

  // Process-wide pool: the first call decides threads/pools; later calls return it unchanged.
  static ThreadPool& global(int threads = 0, int pools = 1);
  static bool global_exists();

 private:
  void worker(int id);
  void pin(int id);

  int n_, pools_;
  std::vector<std::thread> threads_;
  std::mutex run_mu_;  // one job at a time
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> remaining_{0};
  std::atomic<bool> stop_{false};
  const std::function<void(int, int)>* job_ = nullptr;
  std::mutex err_mu_;
  std::exception_ptr error_;
  void* topology_ = nullptr;  // hwloc_topology_t
};

// Contiguous [begin, end) share of `n` items for thread `tid` of `nt`.
inline void split_range(int64_t n, int tid, int nt, int64_t* begin, int64_t* end) {
  *begin = n * tid / nt;
  *end = n * (tid + 1) / nt;
}

}  // namespace ktjit
