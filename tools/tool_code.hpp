// The developer microbenchmarks' (tools/*.cpp) way to run what their generators emitted: the code
// published executable, or the tool exits naming itself and the reason.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "jit/code_memory.hpp"

namespace ktjit {

inline ExecutableCode publish_or_exit(const std::vector<uint8_t>& code, const char* tool) {
  std::string err;
  ExecutableCode x = ExecutableCode::publish(code.data(), code.size(), &err);
  if (!x) {
    std::fprintf(stderr, "%s: %s\n", tool, err.c_str());
    std::exit(1);
  }
  return x;
}

}  // namespace ktjit
