// The CUDA runtime, as far as the serving path needs it: host callbacks in stream order
// (cudaLaunchHostFunc) and stream synchronisation. Resolved with dlopen at first use, so the
// build neither links nor needs CUDA; without a runtime every call reports why it is missing.
//
// Which library: $KT_JIT_CUDART if set (tests point it at a stand-in), else a libcudart the
// process has already loaded (torch's), else libcudart.so.13 / .12 / .11.0 / libcudart.so.
#pragma once

#include <cstddef>
#include <string>

namespace ktjit {

class CudaRuntime {
 public:
  using HostFn = void (*)(void*);
  // The loaded runtime, or nullptr (then load_error() says why). Thread-safe; loads once.
  static CudaRuntime* get();
  static std::string load_error();

  // Enqueue fn(data) on `stream` after the work already there; throws std::runtime_error with
  // the runtime's message on failure. Legal while the stream is being captured into a graph.
  void launch_host_func(void* stream, HostFn fn, void* data) const;
  void stream_synchronize(void* stream) const;
  // Whether `p` is device memory the host cannot write (cudaPointerGetAttributes says
  // cudaMemoryTypeDevice). False for host, pinned, managed or unknown memory, and when the
  // runtime lacks the call or cannot answer (no device): then the pointer is treated as host.
  bool is_device_pointer(const void* p) const;
  // cudaMemcpy(dst, src, bytes, cudaMemcpyDefault): any direction, synchronous for the host.
  void memcpy_default(void* dst, const void* src, size_t bytes) const;
  const std::string& path() const { return path_; }

 private:
  CudaRuntime() = default;
  void check(int err, const char* what) const;
  using LaunchHostFunc = int (*)(void*, HostFn, void*);
  using StreamSync = int (*)(void*);
  using ErrorString = const char* (*)(int);
  LaunchHostFunc launch_ = nullptr;
  StreamSync sync_ = nullptr;
  ErrorString error_string_ = nullptr;
  using PointerAttributes = int (*)(void*, const void*);
  using Memcpy = int (*)(void*, const void*, size_t, int);
  using GetLastError = int (*)();
  PointerAttributes attributes_ = nullptr;  // optional (stand-in runtimes may lack them)
  Memcpy memcpy_ = nullptr;
  GetLastError last_error_ = nullptr;
  std::string path_;
};

}  // namespace ktjit
