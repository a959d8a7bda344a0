#include "runtime/task_queue.hpp"

#include <chrono>
#include <utility>

namespace ktjit {
namespace {
// Short enough to cost nothing next to a decode forward (milliseconds) or to a caller doing
// other work between submit and sync; long enough to catch tiny tasks without sleeping.
constexpr auto kSpin = std::chrono::microseconds(50);

template <class Pred>
void spin_until(Pred done) {
  const auto end = std::chrono::steady_clock::now() + kSpin;
  for (int i = 0; !done(); ++i) {
    if ((i & 63) == 63 && std::chrono::steady_clock::now() > end) return;
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
}
}  // namespace

TaskQueue::TaskQueue() : worker_([this] { loop(); }) {}

TaskQueue::~TaskQueue() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_work_.notify_all();
  if (worker_.joinable()) worker_.join();
}

uint64_t TaskQueue::submit(std::function<void()> fn) {
  uint64_t seq;
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back(std::move(fn));
    seq = ++submitted_;
    submitted_spin_.store(seq, std::memory_order_release);
  }
  cv_work_.notify_one();
  return seq;
}

void TaskQueue::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    if (tasks_.empty() && !stop_) {
      const uint64_t done = completed_;
      lock.unlock();
      spin_until([&] { return submitted_spin_.load(std::memory_order_acquire) > done; });
      lock.lock();
    }
    cv_work_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
    if (tasks_.empty()) return;  // stop_ and drained
    std::function<void()> fn = std::move(tasks_.front());
    tasks_.pop_front();
    lock.unlock();
    std::exception_ptr err;
    try {
      fn();
    } catch (...) {
      err = std::current_exception();
    }
    fn = nullptr;  // release captures before the task counts as done
    lock.lock();
    if (err && !error_) error_ = err;
    ++completed_;
    completed_spin_.store(completed_, std::memory_order_release);
    cv_done_.notify_all();
  }
}

void TaskQueue::rethrow_locked(std::unique_lock<std::mutex>& lock) {
  if (!error_) return;
  std::exception_ptr e = std::move(error_);
  error_ = nullptr;
  lock.unlock();
  std::rethrow_exception(e);
}

void TaskQueue::sync(int allow_pending) {
  if (allow_pending < 0) allow_pending = 0;
  std::unique_lock<std::mutex> lock(mu_);
  cv_done_.wait(lock, [&] { return submitted_ - completed_ <= uint64_t(allow_pending); });
  rethrow_locked(lock);
}

void TaskQueue::wait(uint64_t seq) {
  spin_until([&] { return completed_spin_.load(std::memory_order_acquire) >= seq; });
  std::unique_lock<std::mutex> lock(mu_);
  cv_done_.wait(lock, [&] { return completed_ >= seq || completed_ >= submitted_; });
  rethrow_locked(lock);
}

uint64_t TaskQueue::submitted() const {
  std::lock_guard<std::mutex> lock(mu_);
  return submitted_;
}

uint64_t TaskQueue::completed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return completed_;
}

}  // namespace ktjit
