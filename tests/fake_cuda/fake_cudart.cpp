// A stand-in for the three CUDA runtime functions kt-jit's stream bridge uses, so the
// stream-ordered serving path can be tested on machines without a GPU (KT_JIT_CUDART points at
// it). Each "stream" (any non-zero handle) is a FIFO run by its own thread, which is what a CUDA
// stream is to host callbacks: cudaLaunchHostFunc runs fn(data) after everything enqueued
// before it, on a runtime thread; cudaStreamSynchronize waits for the stream to drain.
// Stream handle 0xbad fails every call (error 700), to test error reporting.
// Built by the tests themselves: g++ -shared -fPIC fake_cudart.cpp -o libfakecudart.so -pthread
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

namespace {

struct Stream {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> work;
  bool busy = false;
  std::thread th;
  Stream() {
    th = std::thread([this] {
      for (;;) {
        std::function<void()> fn;
        {
          std::unique_lock<std::mutex> l(mu);
          cv.wait(l, [&] { return !work.empty(); });
          fn = std::move(work.front());
          work.pop_front();
          busy = true;
        }
        fn();
        {
          std::lock_guard<std::mutex> l(mu);
          busy = false;
        }
        cv.notify_all();
      }
    });
    th.detach();  // streams live as long as the process
  }
};

std::mutex g_mu;
std::map<void*, Stream*> g_streams;

Stream* stream(void* s) {
  std::lock_guard<std::mutex> l(g_mu);
  Stream*& p = g_streams[s];
  if (!p) p = new Stream();
  return p;
}

bool bad(void* s) {
  return reinterpret_cast<uintptr_t>(s) == 0xbad;
}

}  // namespace

extern "C" {

int cudaLaunchHostFunc(void* s, void (*fn)(void*), void* data) {
  if (bad(s)) return 700;
  Stream* st = stream(s);
  {
    std::lock_guard<std::mutex> l(st->mu);
    st->work.emplace_back([fn, data] { fn(data); });
  }
  st->cv.notify_all();
  return 0;
}

int cudaStreamSynchronize(void* s) {
  if (bad(s)) return 700;
  Stream* st = stream(s);
  std::unique_lock<std::mutex> l(st->mu);
  st->cv.wait(l, [&] { return st->work.empty() && !st->busy; });
  return 0;
}

const char* cudaGetErrorString(int err) {
  return err == 700 ? "an illegal memory access was encountered (fake)" : "fake error";
}

}  // extern "C"
