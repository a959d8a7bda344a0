#pragma once

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "jit/cpu/cpu.hpp"

namespace ktjit::test {

// Generated levels this machine can execute, lowest first (KT_JIT_ISA caps them): the x86 levels
// on x86-64, the NEON levels on AArch64.
inline std::vector<IsaLevel> runnable_levels() {
  std::vector<IsaLevel> v;
#if defined(__aarch64__)
  if (isa_is_neon(selected_isa()))
    for (int l = int(IsaLevel::neon); l <= int(selected_isa()); ++l) v.push_back(IsaLevel(l));
#else
  for (int l = int(IsaLevel::avx2); l <= int(selected_isa()); ++l)
    if (IsaLevel(l) != IsaLevel::amx) v.push_back(IsaLevel(l));
#endif
  return v;
}

inline std::vector<float> random_floats(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// The x86 levels that generate strip-scratch tiles (jit/gemm.hpp strip_scratch_kernel).
inline bool strip_scratch_level(IsaLevel isa) {
  return isa == IsaLevel::avx2 || isa == IsaLevel::avx512 || isa == IsaLevel::avx512_vnni;
}

// How many of `names` contain `part`.
inline size_t count_containing(const std::vector<std::string>& names, const std::string& part) {
  return size_t(std::count_if(names.begin(), names.end(), [&](const std::string& n) {
    return n.find(part) != std::string::npos;
  }));
}

}  // namespace ktjit::test
