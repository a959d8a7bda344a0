// Serving bindings: kt_jit._core.TaskQueue, the FIFO of MoE forwards behind KTMoEWrapper's
// submit_forward / sync_forward (runtime/task_queue.hpp). Tasks are C++ closures over raw data
// pointers; the Python objects those pointers belong to (tensors, the layer) are kept alive by
// the queue object until their task has finished, so a wrapper may be dropped with work in flight.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "formats/convert.hpp"
#include "python/py_moe_layer.hpp"
#include "runtime/cuda_bridge.hpp"
#include "runtime/task_queue.hpp"

namespace py = pybind11;
using namespace ktjit;

namespace {

struct PyTaskQueue {
  // Touched only with the GIL held. Declared before q so that q (which drains and joins) is
  // destroyed first.
  std::deque<std::pair<uint64_t, py::object>> keep;
  std::unique_ptr<TaskQueue> q = std::make_unique<TaskQueue>();

  ~PyTaskQueue() {
    if (!q) return;
    py::gil_scoped_release release;  // queued Python callables need the GIL to finish
    q.reset();
  }

  void release_done() {
    const uint64_t done = q->completed();
    while (!keep.empty() && keep.front().first <= done) keep.pop_front();
  }

  void hold(uint64_t seq, py::object o) {
    if (!o.is_none()) keep.emplace_back(seq, std::move(o));
  }

  template <class Wait>
  void blocking(Wait&& w) {
    try {
      {
        py::gil_scoped_release release;
        w();
      }
    } catch (...) {
      release_done();
      throw;
    }
    release_done();
  }
};

// The forward task of one submit: layer.forward over T rows in chunks; incremental adds the
// result into out. Pointers are raw: their owners are kept alive by the caller.
std::function<void()> forward_task(MoELayer* layer, int64_t T, uintptr_t x, uintptr_t ids,
                                   uintptr_t w, uintptr_t mask, uintptr_t out, bool incremental,
                                   int64_t chunk) {
  const int64_t H = layer->shape().hidden, K = layer->shape().top_k;
  if (chunk <= 0) chunk = T > 0 ? T : 1;
  return [=] {
    if (T == 0) return;
    std::lock_guard<std::mutex> lock(pool_mutex());
    ThreadPool& pool = ThreadPool::global();
    const float* xs = reinterpret_cast<const float*>(x);
    const int64_t* is = reinterpret_cast<const int64_t*>(ids);
    const float* ws = reinterpret_cast<const float*>(w);
    const bool* ms = reinterpret_cast<const bool*>(mask);
    float* dst = reinterpret_cast<float*>(out);
    float* res = dst;
    thread_local std::vector<float> scratch;  // incremental: result here, then added to out
    if (incremental) {
      scratch.resize(size_t(T * H));
      res = scratch.data();
    }
    for (int64_t s = 0; s < T; s += chunk) {
      const int64_t n = std::min(chunk, T - s);
      layer->forward(n, xs + s * H, is + s * K, ws + s * K, ms, res + s * H, pool);
    }
    if (incremental)
      for (int64_t i = 0, n = T * H; i < n; ++i) dst[i] += res[i];
  };
}

MoELayer* native_layer(py::object& layer_obj) {
  PyMoELayer& pl = layer_obj.cast<PyMoELayer&>();
  if (!pl.layer) throw std::invalid_argument("submit_forward: the layer has no native state");
  return pl.layer.get();
}

uint64_t submit_forward(PyTaskQueue& self, py::object layer_obj, int64_t T, uintptr_t x,
                        uintptr_t ids, uintptr_t w, uintptr_t mask, uintptr_t out, bool incremental,
                        int64_t chunk, py::object keepalive) {
  MoELayer* layer = native_layer(layer_obj);
  if (T < 0) throw std::invalid_argument("submit_forward: T must be >= 0");
  self.release_done();
  const uint64_t seq =
      self.q->submit(forward_task(layer, T, x, ids, w, mask, out, incremental, chunk));
  self.hold(seq, layer_obj);
  self.hold(seq, std::move(keepalive));
  return seq;
}

// One forward enqueued in CUDA stream order (kt-kernel's submit_with_cuda_stream /
// sync_with_cuda_stream): launch_submit puts a host callback on the stream that enqueues the
// forward when the stream reaches it (after the staging copies before it); launch_wait puts one
// that blocks the stream until that forward has finished (so the output copy after it sees the
// result). Both callbacks read only this object, so a captured CUDA graph replays them as they
// are. The owner (Python) keeps it, its layer and its buffers alive while callbacks may run.
struct StreamForward {
  TaskQueue* q = nullptr;
  py::object queue_obj, layer_obj, buffers;  // owners of the raw pointers below
  std::function<void()> task;
  std::atomic<uint64_t> seq{0};
  std::mutex mu;
  std::string error;  // the failure of the last forward, raised by take_error()

  static void on_submit(void* p) {
    auto* f = static_cast<StreamForward*>(p);
    f->seq.store(f->q->submit(f->task), std::memory_order_release);
  }
  static void on_wait(void* p) {
    auto* f = static_cast<StreamForward*>(p);
    try {
      f->q->wait(f->seq.load(std::memory_order_acquire));
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lock(f->mu);
      f->error = e.what();
    }
  }
};

CudaRuntime& cuda_runtime() {
  CudaRuntime* rt = CudaRuntime::get();
  if (!rt)
    throw std::runtime_error("cuda_stream: a non-zero stream needs the CUDA runtime; " +
                             CudaRuntime::load_error());
  return *rt;
}

// The decode fast path: validates nothing the Python side has not (it checks a cached signature
// of the inputs), copies the caller's tensors into the staging buffers here — converting bf16 /
// fp16 activations and weights and int32 ids on the way — and enqueues the forward. One call
// instead of three torch copies and a submit.
uint64_t submit_forward_staged(PyTaskQueue& self, py::object layer_obj, int64_t T, uintptr_t x,
                               int x_type, uintptr_t ids, bool ids_int32, uintptr_t w, int w_type,
                               uintptr_t stage_x, uintptr_t stage_ids, uintptr_t stage_w,
                               uintptr_t mask, uintptr_t out, bool incremental, int64_t chunk,
                               py::object keepalive) {
  PyMoELayer& pl = layer_obj.cast<PyMoELayer&>();
  if (!pl.layer) throw std::invalid_argument("submit_forward: the layer has no native state");
  if (T <= 0) throw std::invalid_argument("submit_forward_staged: T must be > 0");
  for (int t : {x_type, w_type})
    if (t < 0 || t > 2) throw std::invalid_argument("submit_forward_staged: bad float type code");
  const int64_t H = pl.layer->shape().hidden, K = pl.layer->shape().top_k;
  formats::to_f32(reinterpret_cast<const void*>(x), formats::FloatType(x_type), T * H,
                  reinterpret_cast<float*>(stage_x));
  formats::to_f32(reinterpret_cast<const void*>(w), formats::FloatType(w_type), T * K,
                  reinterpret_cast<float*>(stage_w));
  int64_t* sid = reinterpret_cast<int64_t*>(stage_ids);
  if (ids_int32) {
    const int32_t* src = reinterpret_cast<const int32_t*>(ids);
    for (int64_t i = 0; i < T * K; ++i) sid[i] = src[i];
  } else {
    std::memcpy(sid, reinterpret_cast<const void*>(ids), size_t(T * K) * 8);
  }
  return submit_forward(self, std::move(layer_obj), T, stage_x, stage_ids, stage_w, mask, out,
                        incremental, chunk, std::move(keepalive));
}

uint64_t submit_callable(PyTaskQueue& self, py::object fn) {
  if (!PyCallable_Check(fn.ptr())) throw py::type_error("submit: expected a callable");
  PyObject* raw = fn.ptr();  // kept alive by self.keep until the task has run
  self.release_done();
  const uint64_t seq = self.q->submit([raw] {
    py::gil_scoped_acquire gil;
    try {
      py::handle callable(raw);
      callable();
    } catch (py::error_already_set& e) {
      throw std::runtime_error(e.what());
    }
  });
  self.hold(seq, std::move(fn));
  return seq;
}

}  // namespace

void register_serving(py::module_& m) {
  m.def(
      "cuda_runtime",
      [] {
        CudaRuntime* rt = CudaRuntime::get();
        return rt ? py::object(py::str(rt->path())) : py::object(py::none());
      },
      "The CUDA runtime library the stream bridge uses, or None (see cuda_runtime_error()).");
  m.def("cuda_runtime_error", &CudaRuntime::load_error);
  m.def(
      "cuda_is_device_pointer",
      [](uintptr_t p) {
        CudaRuntime* rt = CudaRuntime::get();
        return rt && rt->is_device_pointer(reinterpret_cast<const void*>(p));
      },
      py::arg("ptr"), "Whether ptr is CUDA device memory (False without a runtime or a device).");
  m.def(
      "cuda_memcpy",
      [](uintptr_t dst, uintptr_t src, size_t bytes) {
        CudaRuntime& rt = cuda_runtime();
        py::gil_scoped_release release;
        rt.memcpy_default(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), bytes);
      },
      py::arg("dst"), py::arg("src"), py::arg("bytes"),
      "cudaMemcpy(dst, src, bytes, cudaMemcpyDefault).");
  m.def(
      "cuda_stream_synchronize",
      [](uintptr_t stream) {
        CudaRuntime& rt = cuda_runtime();
        py::gil_scoped_release release;
        rt.stream_synchronize(reinterpret_cast<void*>(stream));
      },
      py::arg("stream"));
  py::class_<StreamForward>(m, "StreamForward",
                            "A forward run in CUDA stream order through host callbacks "
                            "(cudaLaunchHostFunc); see kt_jit.serving.")
      .def(py::init([](py::object queue_obj, py::object layer_obj, int64_t T, uintptr_t x,
                       uintptr_t ids, uintptr_t w, uintptr_t mask, uintptr_t out, bool incremental,
                       int64_t chunk, py::object buffers) {
             auto f = std::make_unique<StreamForward>();
             f->q = queue_obj.cast<PyTaskQueue&>().q.get();
             if (T <= 0) throw std::invalid_argument("StreamForward: T must be > 0");
             f->task =
                 forward_task(native_layer(layer_obj), T, x, ids, w, mask, out, incremental, chunk);
             f->queue_obj = std::move(queue_obj);
             f->layer_obj = std::move(layer_obj);
             f->buffers = std::move(buffers);
             return f;
           }),
           py::arg("queue"), py::arg("layer"), py::arg("T"), py::arg("x_ptr"), py::arg("ids_ptr"),
           py::arg("w_ptr"), py::arg("mask_ptr"), py::arg("out_ptr"), py::arg("incremental"),
           py::arg("chunk"), py::arg("buffers"))
      .def(
          "launch_submit",
          [](StreamForward& f, uintptr_t stream) {
            cuda_runtime().launch_host_func(reinterpret_cast<void*>(stream),
                                            &StreamForward::on_submit, &f);
          },
          py::arg("stream"))
      .def(
          "launch_wait",
          [](StreamForward& f, uintptr_t stream) {
            cuda_runtime().launch_host_func(reinterpret_cast<void*>(stream),
                                            &StreamForward::on_wait, &f);
          },
          py::arg("stream"))
      .def("take_error", [](StreamForward& f) {
        std::lock_guard<std::mutex> lock(f.mu);
        std::string e;
        std::swap(e, f.error);
        return e;
      });
  py::class_<PyTaskQueue>(m, "TaskQueue",
                          "One worker thread running submitted tasks in order (kt-kernel's "
                          "CPUInfer queue). Errors inside a task are raised at the next sync/wait.")
      .def(py::init<>())
      .def("submit_forward", &submit_forward, py::arg("layer"), py::arg("T"), py::arg("x_ptr"),
           py::arg("ids_ptr"), py::arg("w_ptr"), py::arg("mask_ptr"), py::arg("out_ptr"),
           py::arg("incremental") = false, py::arg("chunk") = 0, py::arg("keepalive") = py::none(),
           "Enqueue layer.forward over T rows in chunks of `chunk` (x fp32 [T,H], ids int64 "
           "[T,K], w fp32 [T,K], mask bool [E] or 0, out fp32 [T,H]); incremental adds the result "
           "into out. `keepalive` (and the layer) are held until the task finishes. Returns the "
           "task's sequence number.")
      .def("submit_forward_staged", &submit_forward_staged, py::arg("layer"), py::arg("T"),
           py::arg("x_ptr"), py::arg("x_type"), py::arg("ids_ptr"), py::arg("ids_int32"),
           py::arg("w_ptr"), py::arg("w_type"), py::arg("stage_x_ptr"), py::arg("stage_ids_ptr"),
           py::arg("stage_w_ptr"), py::arg("mask_ptr"), py::arg("out_ptr"),
           py::arg("incremental") = false, py::arg("chunk") = 0, py::arg("keepalive") = py::none(),
           "submit_forward after copying contiguous inputs into the staging buffers: x [T,H] "
           "and w [T,K] of type code 0 f32 / 1 bf16 / 2 f16 to fp32, ids [T,K] int64 or int32 "
           "to int64. T > 0.")
      .def("submit", &submit_callable, py::arg("fn"),
           "Enqueue a Python callable (run on the worker thread with the GIL).")
      .def(
          "sync",
          [](PyTaskQueue& self, int allow_pending) {
            self.blocking([&] { self.q->sync(allow_pending); });
          },
          py::arg("allow_pending") = 0,
          "Wait until at most allow_pending tasks remain; raise the first task error.")
      .def(
          "wait",
          [](PyTaskQueue& self, uint64_t seq) { self.blocking([&] { self.q->wait(seq); }); },
          py::arg("seq"), "Wait until task `seq` has finished; raise the first task error.")
      .def_property_readonly("submitted", [](const PyTaskQueue& s) { return s.q->submitted(); })
      .def_property_readonly("completed", [](const PyTaskQueue& s) { return s.q->completed(); })
      .def_property_readonly("pending", [](const PyTaskQueue& s) { return s.q->pending(); })
      .def_property_readonly("held", [](const PyTaskQueue& s) { return s.keep.size(); });
}
