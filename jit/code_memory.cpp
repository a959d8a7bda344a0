#include "jit/code_memory.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace ktjit {

ExecutableCode::~ExecutableCode() {
  if (ptr_) munmap(ptr_, mapped_);
}

ExecutableCode ExecutableCode::publish(const uint8_t* code, size_t size, std::string* error) {
  ExecutableCode out;
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  const size_t len = (size + page - 1) / page * page;
  void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    if (error) *error = std::string("mmap: ") + std::strerror(errno);
    return out;
  }
  std::memcpy(p, code, size);
  // AArch64 instruction caches are not coherent with data writes: clean and invalidate the range
  // (a no-op on x86-64).
  __builtin___clear_cache(static_cast<char*>(p), static_cast<char*>(p) + size);
  if (mprotect(p, len, PROT_READ | PROT_EXEC) != 0) {
    if (error) *error = std::string("mprotect(PROT_READ|PROT_EXEC): ") + std::strerror(errno);
    munmap(p, len);
    return out;
  }
  out.ptr_ = p;
  out.size_ = size;
  out.mapped_ = len;
  return out;
}

}  // namespace ktjit
