#include "runtime/cuda_bridge.hpp"

#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace ktjit {
namespace {

std::once_flag g_once;
CudaRuntime* g_rt = nullptr;
std::string g_error;

}  // namespace

CudaRuntime* CudaRuntime::get() {
  std::call_once(g_once, [] {
    std::vector<std::string> names;
    const char* env = std::getenv("KT_JIT_CUDART");
    if (env && *env) {
      names.push_back(env);
    } else {
      names = {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"};
    }
    void* h = nullptr;
    std::string path;
    // A runtime already in the process (torch's) first, so both share one CUDA context.
    for (int pass = 0; pass < 2 && !h; ++pass)
      for (const auto& n : names) {
        h = dlopen(n.c_str(), RTLD_LAZY | RTLD_LOCAL | (pass == 0 ? RTLD_NOLOAD : 0));
        if (h) {
          path = n;
          break;
        }
      }
    if (!h) {
      const char* e = dlerror();
      g_error = "no CUDA runtime could be loaded (tried " + names.front() +
                (names.size() > 1 ? " and others" : "") + "): " + (e ? e : "not found");
      return;
    }
    auto* rt = new CudaRuntime();
    rt->path_ = path;
    rt->launch_ = reinterpret_cast<LaunchHostFunc>(dlsym(h, "cudaLaunchHostFunc"));
    rt->sync_ = reinterpret_cast<StreamSync>(dlsym(h, "cudaStreamSynchronize"));
    rt->error_string_ = reinterpret_cast<ErrorString>(dlsym(h, "cudaGetErrorString"));
    rt->attributes_ = reinterpret_cast<PointerAttributes>(dlsym(h, "cudaPointerGetAttributes"));
    rt->memcpy_ = reinterpret_cast<Memcpy>(dlsym(h, "cudaMemcpy"));
    rt->last_error_ = reinterpret_cast<GetLastError>(dlsym(h, "cudaGetLastError"));
    if (!rt->launch_ || !rt->sync_ || !rt->error_string_) {
      g_error = path + " lacks cudaLaunchHostFunc / cudaStreamSynchronize / cudaGetErrorString";
      delete rt;
      return;
    }
    g_rt = rt;  // lives as long as the process, like the library it points into
  });
  return g_rt;
}

std::string CudaRuntime::load_error() {
  get();
  return g_error;
}

void CudaRuntime::check(int err, const char* what) const {
  if (err != 0)
    throw std::runtime_error(std::string(what) + " failed: " + error_string_(err) + " (error " +
                             std::to_string(err) + ")");
}

void CudaRuntime::launch_host_func(void* stream, HostFn fn, void* data) const {
  check(launch_(stream, fn, data), "cudaLaunchHostFunc");
}

void CudaRuntime::stream_synchronize(void* stream) const {
  check(sync_(stream), "cudaStreamSynchronize");
}

bool CudaRuntime::is_device_pointer(const void* p) const {
  if (!attributes_ || !p) return false;
  // struct cudaPointerAttributes (CUDA >= 11): {cudaMemoryType type; int device;
  // void* devicePointer; void* hostPointer;}; room to spare for later additions.
  alignas(8) unsigned char attr[256] = {};
  if (attributes_(attr, p) != 0) {
    if (last_error_) last_error_();  // clear the sticky "last error" the failed query left
    return false;
  }
  int type;
  std::memcpy(&type, attr, sizeof(type));
  return type == 2;  // cudaMemoryTypeDevice (1 host/pinned, 3 managed: host-writable)
}

void CudaRuntime::memcpy_default(void* dst, const void* src, size_t bytes) const {
  if (!memcpy_) throw std::runtime_error(path_ + " lacks cudaMemcpy");
  check(memcpy_(dst, src, bytes, 4 /* cudaMemcpyDefault */), "cudaMemcpy");
}

}  // namespace ktjit
