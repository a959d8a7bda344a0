#include "formats/convert.hpp"

#include <cstring>

namespace ktjit::formats {

float bf16_to_f32(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: renormalise
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while (!(man & 0x400));
      u = sign | uint32_t(127 - 15 - e) << 23 | (man & 0x3ff) << 13;
    }
  } else if (exp == 0x1f) {
    u = sign | 0x7f800000u | man << 13;
  } else {
    u = sign | (exp + 127 - 15) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

void to_f32(const void* src, FloatType t, int64_t n, float* dst) {
  switch (t) {
    case FloatType::f32: std::memcpy(dst, src, size_t(n) * 4); break;
    case FloatType::bf16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
      break;
    }
    case FloatType::f16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32(s[i]);
      break;
    }
  }
}

uint16_t f32_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u);   // NaN
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65536: infinity
  if (a < 0x38800000u) {                                  // below 2^-14: fp16 subnormal or zero
    if (a < 0x33000000u) return sign;                     // below half the smallest subnormal
    const uint32_t m = (a & 0x7fffffu) | 0x800000u;       // 24-bit significand
    const int shift = 126 - int(a >> 23);                 // 14..24 (to units of 2^-24)
    const uint32_t q = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    return uint16_t(sign | (q + (rem > half || (rem == half && (q & 1)))));
  }
  const uint32_t m = a - 0x38000000u;  // rebias the exponent (127 -> 15), 13 extra mantissa bits
  const uint32_t q = m >> 13, rem = m & 0x1fffu;
  return uint16_t(sign | (q + (rem > 0x1000u || (rem == 0x1000u && (q & 1)))));
}

}  // namespace ktjit::formats
