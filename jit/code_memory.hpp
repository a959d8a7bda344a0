// W^X code memory: bytes are copied into a fresh read+write mapping, which is then flipped to
// read+execute. No mapping is ever writable and executable at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace ktjit {

class ExecutableCode {
 public:
  ExecutableCode() = default;
  ExecutableCode(const ExecutableCode&) = delete;
  ExecutableCode& operator=(const ExecutableCode&) = delete;
  ExecutableCode(ExecutableCode&& o) noexcept { swap(o); }
  ExecutableCode& operator=(ExecutableCode&& o) noexcept {
    swap(o);
    return *this;
  }
  ~ExecutableCode();

  // Returns an empty object and sets *error when the host refuses executable memory.
  static ExecutableCode publish(const uint8_t* code, size_t size, std::string* error);

  const void* entry() const { return ptr_; }
  size_t size() const { return size_; }
  explicit operator bool() const { return ptr_ != nullptr; }

 private:
  void swap(ExecutableCode& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(size_, o.size_);
    std::swap(mapped_, o.mapped_);
  }
  void* ptr_ = nullptr;
  size_t size_ = 0;
  size_t mapped_ = 0;
};

}  // namespace ktjit
