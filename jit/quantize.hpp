// Generated activation quantizers: an fp32 row to int8 with one scale per row (SPEC §4's
// activation quantization, formats::quantize_row_int8), the same bits as the C++ reference.
//
// Two kernels per level (KernelKind::quantize, format int8, variant kQuant*), called on the
// row's whole 16-value blocks (the caller finishes the last n % 16 values in C++):
//   kQuantAmax   amax[0..15] = the lane-wise max of |x| over the blocks (vandps + vmaxps; for
//                non-negative floats the value order is the bit order, so the caller's integer
//                max over these and the tail is formats' row_amax);
//   kQuantRound  q[i] = clamp(rne(x[i] * id), -127, 127) (vmulps, vminps / vmaxps by +-127,
//                vcvtps2dq: round to nearest even; clamping to integers commutes with it);
//   kQuantRoundFlip  the same XOR 0x80 (the VNNI levels' a + 128 form).
// And one more (format int8 too, for the cache key's sake):
//   kQuantBf16   q = the row as bf16, 32 bytes a block: formats::f32_to_bf16 (round half to
//                even on the bits, NaN quieted, subnormals kept), the activations of the
//                vdpbf16ps pair kernels. The compiled C++ row loop was SSE2: 2.8 % of a BF16
//                T = 4096 layer.
// runtime/row_quant.hpp drives them.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ktjit {

struct QuantArgs {
  const float* x;  // the row
  int64_t blocks;  // whole 16-value blocks of it the kernel reads
  int8_t* q;       // kQuantRound*: 16 * blocks bytes out; kQuantBf16: 32 * blocks
  float* amax;     // kQuantAmax: 16 floats out
  float id;        // kQuantRound*: 1 / scale (0 for an all-zero row)
};
static_assert(offsetof(QuantArgs, blocks) == 8, "QuantArgs is part of the kernel ABI");
static_assert(offsetof(QuantArgs, q) == 16, "QuantArgs is part of the kernel ABI");
static_assert(offsetof(QuantArgs, amax) == 24, "QuantArgs is part of the kernel ABI");
static_assert(offsetof(QuantArgs, id) == 32, "QuantArgs is part of the kernel ABI");

using QuantFn = void (*)(const QuantArgs*);

// KernelKey::variant of KernelKind::quantize kernels.
constexpr uint16_t kQuantAmax = 0;
constexpr uint16_t kQuantRound = 1;
constexpr uint16_t kQuantRoundFlip = 2;
constexpr uint16_t kQuantBf16 = 3;

}  // namespace ktjit
