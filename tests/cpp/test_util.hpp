#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "jit/cpu/cpu.hpp"

namespace ktjit::test {

// x86 levels this machine can execute, lowest first (KT_JIT_ISA caps them).
inline std::vector<IsaLevel> runnable_levels() {
  std::vector<IsaLevel> v;
  for (int l = int(IsaLevel::avx2); l <= int(selected_isa()); ++l)
    if (IsaLevel(l) != IsaLevel::amx) v.push_back(IsaLevel(l));
  return v;
}

inline std::vector<float> random_floats(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

}  // namespace ktjit::test
