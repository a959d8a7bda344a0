// Integer weight formats with one scale per output row (kt-kernel's AMXINT8 / MOE_INT8 and
// AMXINT4 / MOE_INT4 semantics) and the int8 activations their kernels consume.
//   INT8: d = amax / 127, q = clamp(rne(w * (1/d)), -127, 127).
//   INT4: d = amax / 112, q8 = clamp(rne(w * (1/d)), -127, 127), q4 = sign(q8) * ((|q8| + 8) >> 4)
//         in [-7, 7]; the kernels see the int8 value 16 * q4, so w ~= 16 * q4 * d.
// Activations use the INT8 rule per token. This file knows the numbers and the packed strip
// layout; it knows nothing of threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace ktjit::formats {

// Quantizes one row of `k` floats into `q` (k bytes) and returns its scale d (0 for an all-zero
// row): q = clamp(rne(x * inverse_scale(d)), -127, 127), d = max |x| / 127.
float quantize_row_int8(const float* x, int64_t k, int8_t* q);

// Its two steps, for callers that do part of a row elsewhere (runtime/row_quant.cpp): max |x|
// (compared as bit patterns), and q = clamp(rne(x * id), -127, 127) with id = inverse_scale(d).
float row_amax(const float* x, int64_t k);
void quantize_int8_with(const float* x, int64_t k, float id, int8_t* q);

// 1 / d, or 0 where that is not finite (d = 0, or a row so small, max |x| < 127 * 2^-128, that
// 1 / d overflows): such rows quantize to zeros.
inline float inverse_scale(float d) {
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  return id - id == 0.0f ? id : 0.0f;  // inf - inf is NaN
}

// XOR 0x80 on every byte: int8 a <-> unsigned a + 128 (the activation form VNNI kernels take).
void flip_sign_bits(int8_t* q, int64_t n);

// INT4 quantization of one row into the int8 values 16 * q4 the kernels multiply; returns d.
float quantize_row_int4(const float* x, int64_t k, int8_t* q16);

// The pair order's step flags: after each group's scales in the scale table (gscale), 64 bytes,
// byte G - 1 - p nonzero when k pair p of the group's G holds (in a full strip's 128 bytes) an
// e4m3 code with a zero exponent field, zero or subnormal. The kernels count a group's pairs down,
// so that is the byte at the count left (jit/x64/gemm.cpp k_loop_fp8). The pair decode's shifts
// give every other code exactly; a flagged step takes the table decode. Groups of at most 64 k
// pairs: the layer packs the pair order in 128-k groups.
constexpr int kFp8FlagBytes = 64;
constexpr int64_t kFp8FlagMaxPairs = kFp8FlagBytes;
// Bytes from a pair-order group record's start (its two scales, one float per strip half) to
// its flags.
constexpr int kFp8FlagOffset = 8;
// The fp8 scale table's group record: per strip half `lanes` copies of the scale, or with the
// pair order one float per half, then the flags (72 bytes a group instead of 128 at 16 lanes).
inline int64_t fp8_gscale_group_floats(bool pair_order, int lanes) {
  return pair_order ? (kFp8FlagOffset + kFp8FlagBytes) / 4 : 2 * lanes;
}
inline int64_t fp8_gscale_index(bool pair_order, int lanes, int64_t g, int half) {
  return g * fp8_gscale_group_floats(pair_order, lanes) + half * (pair_order ? 1 : lanes);
}
inline bool fp8_zero_exponent(uint8_t b) {
  return (b & 0x78) == 0;
}

// Packed strip layout of one weight matrix for the integer GEMM kernels.
// Columns are grouped in strips of `strip_vecs` vectors of `lanes` columns; inside a strip the
// bytes are [k4][column][4 consecutive k] (VNNI order) so one K step of a strip is one contiguous
// read. A fused gate/up matrix (`sources == 2`) puts half a strip of gate rows then the same rows
// of up. 4-bit strips hold two K steps per byte block: for K steps 2p and 2p+1 and each vector,
// the vector's bytes of step 2p in the low nibbles and of step 2p+1 in the high nibbles (K is
// padded to a multiple of 8).
struct StripLayout {
  int64_t n = 0;       // output rows of each source (N, or I for fused gate/up)
  int64_t k = 0;       // logical K
  int64_t k4 = 0;      // ceil(K / 4)
  int lanes = 16;      // columns per vector
  int strip_vecs = 4;  // vectors per full strip
  int sources = 1;     // 1, or 2 for gate/up
  int bits = 8;        // 8, 4 (nibbles) or 16 (bf16)
  int kgroup = 4;      // K elements per step: 4 (integer dot products), 2 (bf16) or 1
  int64_t full_strips = 0;
  int tail_vecs = 0;  // vectors in the last, narrower strip (0 = none)
  // fp8 only (K even): full 64-column strips hold each k pair's bytes in the order the
  // avx512_bf16 pair decode consumes them (fp8_strip_byte), so it needs no gather.
  bool fp8_pair_order = false;

  // kgroup: 0 picks the integer dot-product grouping (4) for 4/8 bits and 1 for 16 bits (x86
  // and NEON bf16 pass 2: k pairs); fp8
  // strips are 8 bits with kgroup 1. g_steps: fp8 scale group in K steps (0 = no groups).
  static StripLayout make(int64_t n, int64_t k, int lanes, int strip_vecs, int sources,
                          int bits = 8, int kgroup = 0, int64_t g_steps = 0);
  int64_t g_steps = 0;
  int64_t groups() const { return g_steps ? (k4 + g_steps - 1) / g_steps : 0; }
  int64_t num_strips() const { return full_strips + (tail_vecs ? 1 : 0); }
  // fp8 scale table: per strip, per group, the record of fp8_gscale_group_floats.
  int64_t gscale_floats_per_group() const { return fp8_gscale_group_floats(fp8_pair_order, lanes); }
  int64_t gscale_index(int64_t g, int half) const {
    return fp8_gscale_index(fp8_pair_order, lanes, g, half);
  }
  int64_t gscale_floats_per_strip() const { return groups() * gscale_floats_per_group(); }
  int64_t gscale_floats() const { return num_strips() * gscale_floats_per_strip(); }
  // qgroup (formats/grouped.hpp): bytes per packed column per group stored after each group's
  // codes (fp32 scale, and fp32 bias); MX (formats/mx.hpp): 1, the exponent byte stored before
  // each group's weights; 0 for every other format.
  int64_t group_extra = 0;
  // qgroup two-level scales: groups per super block (0: none) and bytes per packed column of each
  // super block's header (its fp32 factors).
  int64_t super_groups = 0;
  int64_t super_extra = 0;
  int64_t supers() const { return super_groups ? groups() / super_groups : 0; }
  int strip_cols(int vecs) const { return vecs * lanes; }
  int64_t strip_bytes(int vecs) const {
    return k4 * kgroup * strip_cols(vecs) * bits / 8 +
           (groups() * group_extra + supers() * super_extra) * strip_cols(vecs);
  }
  // Output rows covered by one full strip (per source).
  int64_t rows_per_strip() const { return int64_t(strip_vecs) * lanes / sources; }
  int64_t total_cols() const {
    return full_strips * strip_cols(strip_vecs) + strip_cols(tail_vecs);
  }
  int64_t total_bytes() const {
    return k4 * kgroup * total_cols() * bits / 8 +
           (groups() * group_extra + supers() * super_extra) * total_cols();
  }
  int64_t strip_offset(int64_t s) const { return s * strip_bytes(strip_vecs); }
  int64_t padded_k() const { return k4 * kgroup; }
};

// Byte offset of (k, column n) in an fp8 strip of `cols` columns: [k][column], or with the pair
// order on a 64-column strip, per k pair 128 bytes, per 32 columns j 64 of them, byte
// 4 d + 2 r + h holding (k pair's row r, column 32 j + 16 h + d): read as 32 words, each word's
// low bytes are the pairs of columns 32 j + d and its high bytes those of 32 j + 16 + d, which
// the pair decode turns into bf16 pairs with shifts and one mask (jit/x64/gemm.cpp
// fp8_pair_decode).
inline int64_t fp8_strip_byte(bool pair_order, int cols, int64_t k, int n) {
  if (!pair_order || cols != 64) return k * cols + n;
  const int c = n % 32;
  return (k / 2) * 128 + (n / 32) * 64 + 4 * (c % 16) + 2 * int(k % 2) + c / 16;
}

// Packs quantized rows (`q[src]` is n x k int8 row-major — for 4 bits the values 16 * q4 —
// `d[src]` n scales) into `out`
// (layout.total_bytes()), `scale` and `comp` (layout.total_cols() each). Padding is zero.
// 4-bit strips hold each q4 as its two's-complement nibble, or with `offset_nibbles` as the
// unsigned code q4 + 8 (the nibble XOR 8; padding is then code 8), which the avx2 / avx512 int4
// kernels multiply (jit/gemm.hpp int4_offset_nibbles).
void pack_int8_strips(const StripLayout& layout, const int8_t* const* q, const float* const* d,
                      int8_t* out, float* scale, int32_t* comp, bool offset_nibbles);

// The logical (source, row) held by packed column `c`, or row -1 for padding.
void packed_column_source(const StripLayout& layout, int64_t c, int* source, int64_t* row);

// Inverse of packed_column_source: the strip holding row `r` of source `src`, the row's column
// inside that strip and the strip's width in columns.
void packed_column_of(const StripLayout& layout, int src, int64_t r, int64_t* strip, int* col,
                      int* strip_cols);

// Copies elements [k0, k1) of rows [r0, r1) of source `src` out of a bf16 (2-byte elements,
// kgroup 1 or 2) or fp8 (1-byte, kgroup 1) packed matrix into `out` (row stride `ld`
// elements): the original checkpoint bytes, as packed.
void unpack_rows(const StripLayout& layout, const void* packed, int src, int64_t r0, int64_t r1,
                 int64_t k0, int64_t k1, void* out, int64_t ld);

// bfloat16 strips (layout.bits == 16): `w[src]` is n x k fp32 row-major, rounded to bf16 (RNE);
// elements are [k / kgroup][column][kgroup] inside a strip: [k][column] with kgroup 1 (the
// reference level), k pairs with kgroup 2 (x86 and NEON, jit/gemm.hpp bf16_kgroup; an odd K ends
// with a zero). Scales are set to 1 and compensations to 0.
void pack_bf16_strips(const StripLayout& layout, const float* const* w, uint16_t* out, float* scale,
                      int32_t* comp);
uint16_t f32_to_bf16(float f);
// f32_to_bf16 over n values.
void f32_to_bf16_row(const float* x, int64_t n, uint16_t* out);

// fp8 (e4m3) strips (bits 8, kgroup 1, g_steps = the scale group along K): `w[src]` is n x k
// bytes row-major. Scales: `block[src]` [ceil(n/128), ceil(k/128)] (128x128 blocks, g_steps must
// be 128) or, when block is null, `row[src]` [n] (one group over K). Writes the bytes, the
// per-column scale (1 for blocks, the row scale otherwise), zero compensations and the group
// scale table (scale * 2^120, see gemm.hpp). Throws if a strip half straddles two row blocks.
void pack_fp8_strips(const StripLayout& layout, const uint8_t* const* w, const float* const* block,
                     const float* const* row, uint8_t* out, float* scale, int32_t* comp,
                     float* gscale);

// clamp(rne(v), -limit, limit) for |v| < 2^22: adding and removing 1.5 * 2^23 rounds half to even
// (as std::nearbyint in the default mode), without a libm call per value. The activation
// quantizers' rounding (int8 rows, MXFP4 decode's int16 codes).
inline float rne_clamp(float v, float limit) {
  constexpr float kRound = 12582912.0f;
  v = (v + kRound) - kRound;
  v = v > limit ? limit : v;
  return v < -limit ? -limit : v;
}

}  // namespace ktjit::formats
