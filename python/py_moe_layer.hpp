// The Python-facing MoE layer object, shared by python/bindings.cpp (the MoELayer class) and
// python/bindings_serving.cpp (the task queue that runs layers asynchronously).
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <mutex>

#include "runtime/moe_layer.hpp"
#include "runtime/thread_pool.hpp"

namespace ktjit {

// Serializes the Python side's forwards on the process-wide ThreadPool (ThreadPool::run is not
// reentrant): direct MoELayer.forward calls and the serving queue's tasks both take it.
inline std::mutex& pool_mutex() {
  static std::mutex m;
  return m;
}

struct PyMoELayer {
  std::unique_ptr<MoELayer> layer;

  void forward(int64_t T, uintptr_t x, uintptr_t ids, uintptr_t w, uintptr_t mask, uintptr_t out,
               bool reference) {
    pybind11::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(pool_mutex());
    layer->forward(T, reinterpret_cast<const float*>(x), reinterpret_cast<const int64_t*>(ids),
                   reinterpret_cast<const float*>(w), reinterpret_cast<const bool*>(mask),
                   reinterpret_cast<float*>(out), ThreadPool::global(), reference);
  }
};

}  // namespace ktjit
