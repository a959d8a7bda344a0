// OCP microscaling (MX) weights: MXFP4 (e2m1 nibbles) and MXFP8 (e4m3 bytes), each with one ue8m0
// power-of-two scale per (row, 32-wide K group) — DeepSeek-V4 / MiniMax-M3 checkpoints. The
// packer turns checkpoint rows into the strips the mxfp4 / mxfp8 kernels read (jit/gemm.hpp):
// per 32-wide K group, the strip's scale exponent bytes (one per column) then the group's weight
// bytes as they are — one sequential stream.
// This file knows the numbers and the layout; it knows nothing of threads.
#pragma once

#include <cstdint>

#include "formats/int8.hpp"

namespace ktjit::formats {

constexpr int64_t kMxGroup = 32;  // K elements per scale

// The strip layout of an MX matrix of `n` rows (per source) and `k` columns (k % 32 == 0).
StripLayout mx_layout(int64_t n, int64_t k, int lanes, int strip_vecs, int sources, bool fp4);

// The stored exponent byte for ue8m0 exponent `e`: the kernels widen it to the fp32 bits
// byte << 23, i.e. 2^(e-127) for MXFP4 (byte e; e = 0 gives 0, as kt-kernel's bf16 conversion
// does) and 2^(e-119) for MXFP8 (byte e + 8: its kernels decode e4m3 * 2^-8). Throws
// std::invalid_argument for e = 255 (NaN in ue8m0) and, for MXFP8, e >= 247 (the folded 2^8
// would overflow fp32; such weights are beyond 2^120 anyway).
uint8_t mx_stored_exponent(uint8_t e, bool fp4);
// The fp32 scale the kernels multiply by for a stored exponent byte: bits byte << 23.
float mx_stored_scale(uint8_t stored);

// Packs source matrices into `out` (layout.total_bytes()): per strip, per group, `cols` stored
// exponent bytes then the group's weights ([k/8][column][4 bytes] for MXFP4, [k][column] for
// MXFP8, 32 k). `w[src]` row r starts at w[src] + r * w_ld bytes (n rows of k/2
// bytes for MXFP4: low nibble = even k; k bytes for MXFP8), `e[src]` row r at e[src] + r * e_ld
// (k/32 ue8m0 bytes). Padding columns are zero weights with zero scales.
void pack_mx_strips(const StripLayout& layout, bool fp4, const uint8_t* const* w, int64_t w_ld,
                    const uint8_t* const* e, int64_t e_ld, uint8_t* out);

// Reference dequantization of one MX row (for tests): k floats value * 2^(e-127) in fp32 —
// the kernels' w' (e = 0: 0 for MXFP4, 2^-127 for MXFP8).
void mx_dequantize_row(bool fp4, const uint8_t* w, const uint8_t* e, int64_t k, float* out);

// MXFP4 decode activations (jit/gemm.hpp mx_int16_activations): per 32-wide K group, q = the
// values quantized to int16 against the group's own scale d = amax / 32767 (q = rne(x * 32767 /
// amax), |q| <= 32767; an all-zero group gives d = 0), stored as 64 bytes of int16 pairs, the
// dword of (block b = 0..3, step s = 0..3) holding (q[8b + s], q[8b + s + 4]), then d / 2 as fp32
// (the kernels multiply the codes by 2 * e2m1, exact integers), then the int32
// kMxI16CodeOffset * Σq (modulo 2^32). A non-finite amax stores zero codes and a NaN scale, so
// the output is NaN as with fp32 activations.
constexpr int64_t kMxI16GroupBytes = 72;
// What avx2's MXFP4 decode adds to every weight code: its vpshufb table holds 2 * e2m1 + 12
// (0..24, so no sign step) and the word's high byte reads entry 0 (12), so each int16 weight word
// is code + 12 + 12 * 256; the kernel subtracts this offset times the group's Σq (the int32
// above) once per group. Its int32 sums may wrap, but the result Σ code * q fits int32 (at most
// 32 * 12 * 32767), so the wrapped arithmetic gives it exactly.
constexpr int32_t kMxI16CodeOffset = 12 + 12 * 256;
inline int64_t mx_act_i16_bytes(int64_t k) {
  return k / kMxGroup * kMxI16GroupBytes;
}
void quantize_mx_act_i16(const float* x, int64_t k, uint8_t* out);
// The int16 code of element k of a row in that layout, and the group's stored d / 2.
int16_t mx_act_i16_code(const uint8_t* row, int64_t k);
float mx_act_i16_half_scale(const uint8_t* row, int64_t group);

}  // namespace ktjit::formats
