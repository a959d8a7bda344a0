// Bit casts between fp32 and its IEEE bits (C++17 has no std::bit_cast).
#pragma once

#include <cstdint>
#include <cstring>

namespace ktjit {

inline uint32_t f32_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float f32_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace ktjit
