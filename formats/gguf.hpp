// GGML block types (GGUF checkpoints, method LLAMAFILE) as K-group scaled integers.
//
// Every supported integer block type is exactly the grouped form of formats/grouped.hpp,
//
//   w[c] = scale[c / G] * code[c] + bias[c / G]          (fp32; bias only where the type has one)
//
// with int8 codes and fp32 scales/biases, and the fp32 product scale * code is exact for every
// block (f16 d has at most 11 significant bits, sub-block scale and code together at most 12:
// Q6_K 7 + 5, IQ4_XS 5 + 7), so `scale * code + bias` evaluated in fp32 (one product, one
// addition, in that order) equals the `gguf` package's numpy dequantization bit for bit:
//
//   type    G   code                         scale            bias
//   Q4_0    32  nibble - 8                   d                -
//   Q4_1    32  nibble                       d                m
//   Q5_0    32  5-bit q - 16                 d                -
//   Q5_1    32  5-bit q                      d                m
//   Q8_0    32  int8 q (-128 possible)       d                -
//   Q2_K    16  2-bit q                      d * (sc & 15)    -(dmin * (sc >> 4))
//   Q3_K    16  3-bit q - 4 (hmask bit set:  d * (sc6 - 32)   -
//               no offset) in [-4, 3]
//   Q4_K    32  nibble                       d * sc6          -(dmin * m6)
//   Q5_K    32  5-bit q                      d * sc6          -(dmin * m6)
//   Q6_K    16  6-bit q - 32                 d * sc8          -
//   IQ4_NL  32  kvalues[nibble]              d                -
//   IQ4_XS  32  kvalues[nibble]              d * (ls6 - 32)   -
//
// Types whose codes take at most 16 values carry a 16-entry table (TypeInfo::lut, nibble ->
// code) so a layer can keep 4 bits per weight. F32, F16 and BF16 are float types: only
// dequantize() takes them. Plain scalar C++; the callers split rows across threads.
#pragma once

#include <cstdint>
#include <string>

namespace ktjit::formats::gguf {

// ggml_type ids as stored in GGUF files.
enum class GgmlType : int {
  F32 = 0,
  F16 = 1,
  Q4_0 = 2,
  Q4_1 = 3,
  Q5_0 = 6,
  Q5_1 = 7,
  Q8_0 = 8,
  Q2_K = 10,
  Q3_K = 11,
  Q4_K = 12,
  Q5_K = 13,
  Q6_K = 14,
  IQ4_NL = 20,
  IQ4_XS = 23,
  BF16 = 30,
};

struct TypeInfo {
  GgmlType type;
  const char* name;
  int block;        // elements per block
  int block_bytes;  // bytes per block
  bool is_float;    // F32 / F16 / BF16: no codes, dequantize() only
  int group;        // elements per scale (integer types)
  bool bias;        // an offset term per group
  bool lut4;        // codes are at most 16 values: `lut` lists them (nibble -> code)
  int8_t lut[16];
  int code_lo, code_hi;  // the range of the decoded codes (Q6_K -32..31, Q8_0 -128..127, ...)
};

// The super block of two-level scales (formats/grouped.hpp GroupedSpec::super_group) for the type:
// its 256-element block where the block holds several groups (K-quants, IQ4_XS: every group scale
// is d, or dmin, times an integer sub-scale), else 0.
inline int super_group(const TypeInfo& t) {
  return !t.is_float && t.block > t.group ? t.block : 0;
}

// The type's description, or null when `ggml_type` is not supported.
const TypeInfo* type_info(int ggml_type);
// "F32, F16, BF16, Q4_0, ..." — for error messages.
std::string supported_types();
// Bytes of one row of k elements (k a multiple of the block size; throws otherwise).
int64_t row_bytes(const TypeInfo& t, int64_t k);

// Decodes `rows` rows of `k` elements (consecutive rows of row_bytes(t, k) bytes at `src`) into
// codes [rows, k] (int8) and scales [rows, k / group] (fp32), and biases [rows, k / group] when
// `biases` is not null. `group` may be the type's own group or any divisor of it (a scale is then
// repeated exactly), so types of different groups can share one layout. A type with a bias needs
// `biases`; a type without one writes zeros there when given. Throws std::invalid_argument for a
// float type, a k that is not whole blocks or a group that does not divide the type's.
void decode_rows(const TypeInfo& t, const void* src, int64_t rows, int64_t k, int64_t group,
                 int8_t* codes, float* scales, float* biases);

// Reference dequantizer: out [rows, k] fp32. Integer types go through decode_rows and compute
// scale * code (+ bias) in fp32; F32 is copied, F16 and BF16 widened exactly.
void dequantize_rows(const TypeInfo& t, const void* src, int64_t rows, int64_t k, float* out);

}  // namespace ktjit::formats::gguf
