// A FIFO of tasks run one at a time on one worker thread (kt-kernel's CPUInfer queue): submit()
// returns at once, sync() waits. A task that throws does not stop the queue; its exception (the
// first one since the last sync) is rethrown by the next sync()/wait() that sees it completed.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

namespace ktjit {

class TaskQueue {
 public:
  TaskQueue();
  // Runs every task still queued, then joins the worker. Never throws (a pending task error is
  // dropped).
  ~TaskQueue();
  TaskQueue(const TaskQueue&) = delete;
  TaskQueue& operator=(const TaskQueue&) = delete;

  // Enqueues fn and returns its sequence number (1, 2, ...).
  uint64_t submit(std::function<void()> fn);
  // Blocks until at most allow_pending tasks are queued or running, then rethrows the first task
  // exception recorded since the last rethrow.
  void sync(int allow_pending = 0);
  // Blocks until task `seq` (and so every earlier one) has finished; rethrows like sync().
  void wait(uint64_t seq);

  uint64_t submitted() const;
  uint64_t completed() const;
  int64_t pending() const { return int64_t(submitted() - completed()); }

 private:
  void loop();
  void rethrow_locked(std::unique_lock<std::mutex>& lock);

  mutable std::mutex mu_;
  std::condition_variable cv_work_, cv_done_;
  std::deque<std::function<void()>> tasks_;
  uint64_t submitted_ = 0, completed_ = 0;
  // Mirrors of the counters for the short lock-free spins that save a futex wake-up (several µs
  // on a VM) when a task arrives or finishes within microseconds.
  std::atomic<uint64_t> submitted_spin_{0}, completed_spin_{0};
  bool stop_ = false;
  std::exception_ptr error_;
  std::thread worker_;  // last: started once everything above is constructed
};

}  // namespace ktjit
