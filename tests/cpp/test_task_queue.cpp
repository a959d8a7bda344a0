#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "runtime/task_queue.hpp"

using namespace ktjit;
using namespace std::chrono_literals;

TEST(TaskQueue, SubmitReturnsAtOnceAndRunsInOrder) {
  TaskQueue q;
  std::atomic<bool> release{false};
  std::vector<int> order;
  const auto t0 = std::chrono::steady_clock::now();
  q.submit([&] {
    while (!release) std::this_thread::sleep_for(1ms);
    order.push_back(1);
  });
  for (int i = 2; i <= 5; ++i) q.submit([&order, i] { order.push_back(i); });
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s);  // nothing waited for the blocked task
  EXPECT_EQ(q.submitted(), 5u);
  EXPECT_EQ(q.completed(), 0u);
  release = true;
  q.sync();
  EXPECT_EQ(q.pending(), 0);
  EXPECT_EQ(order, (std::vector<int>{1, 2, 3, 4, 5}));
}

TEST(TaskQueue, SyncAllowPendingAndWait) {
  TaskQueue q;
  std::atomic<bool> release{false};
  std::atomic<int> done{0};
  q.submit([&] { done++; });
  const uint64_t blocked = q.submit([&] {
    while (!release) std::this_thread::sleep_for(1ms);
    done++;
  });
  q.sync(1);  // returns with the blocked task still pending
  EXPECT_EQ(done.load(), 1);
  q.wait(1);
  EXPECT_EQ(q.pending(), 1);
  release = true;
  q.wait(blocked);
  EXPECT_EQ(done.load(), 2);
}

TEST(TaskQueue, ExceptionIsRaisedAtSyncWithItsMessage) {
  TaskQueue q;
  std::atomic<int> ran{0};
  q.submit([] { throw std::runtime_error("task 1 failed: boom"); });
  q.submit([] { throw std::runtime_error("second error"); });
  q.submit([&] { ran++; });  // the queue goes on after a failure
  try {
    q.sync();
    FAIL() << "sync did not rethrow";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()), "task 1 failed: boom");
  }
  EXPECT_EQ(ran.load(), 1);
  EXPECT_NO_THROW(q.sync());  // reported once
  q.submit([&] { ran++; });
  EXPECT_NO_THROW(q.sync());
  EXPECT_EQ(ran.load(), 2);
}

TEST(TaskQueue, DestructorDrainsWorkInFlight) {
  std::atomic<int> done{0};
  {
    TaskQueue q;
    for (int i = 0; i < 20; ++i)
      q.submit([&] {
        std::this_thread::sleep_for(1ms);
        done++;
      });
    q.submit([] { throw std::runtime_error("never synced"); });
  }  // no sync: the destructor runs everything and swallows the error
  EXPECT_EQ(done.load(), 20);
}

TEST(TaskQueue, SubmitFromManyThreads) {
  TaskQueue q;
  std::atomic<int> n{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; ++t)
    ts.emplace_back([&] {
      for (int i = 0; i < 100; ++i) q.submit([&] { n++; });
    });
  for (auto& t : ts) t.join();
  q.sync();
  EXPECT_EQ(n.load(), 400);
}
