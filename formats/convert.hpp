// Scalar element conversions shared by the loaders and the serving path (fp32 is the engine's
// activation type; inputs arrive as fp32, bf16 or fp16).
#pragma once

#include <cstdint>

namespace ktjit::formats {

enum class FloatType : int { f32 = 0, bf16 = 1, f16 = 2 };

float bf16_to_f32(uint16_t h);
// Exact for every fp16 value (subnormals, infinities and NaNs included).
float f16_to_f32(uint16_t h);
// Round to nearest even; overflow gives infinity, NaN stays NaN (quiet). Exact for fp16 values.
uint16_t f32_to_f16(float f);
// dst[i] = float(src[i]) for n elements of type t.
void to_f32(const void* src, FloatType t, int64_t n, float* dst);

}  // namespace ktjit::formats
