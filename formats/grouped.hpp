// K-group scaled integer weights: the common form of GGUF's block types (Q4_0 ... Q6_K, IQ4_*),
// RAWINT4 / GPTQ_INT4 (nibble - 8 with group scales) and any per-row scheme with finer scales.
//
//   w[r][c] = scale[r][c / group] * code[r][c] + bias[r][c / group]        (bias optional)
//
// Codes are int8 (any value in [-128, 127]). A format whose codes are at most 16 distinct values
// (4-bit types) names them in a 16-entry table `lut`; the layer then stores each code as the
// nibble i with lut[i] == code and the kernels decode nibbles through the table.
// Loaders (formats/gguf, the HF INT4 loaders) produce GroupedMatrix views; runtime/moe_layer
// packs them into strips for the generated kernels.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "formats/convert.hpp"
#include "formats/int8.hpp"

namespace ktjit::formats {

// One matrix [n, k], row-major views (k % group == 0).
struct GroupedMatrix {
  const int8_t* codes = nullptr;  // n x k
  const float* scales = nullptr;  // n x (k / group)
  const float* biases = nullptr;  // n x (k / group), or null: no offset term
  int64_t group = 0;
};

// How a layer stores one matrix kind (fused gate/up, or down). Gate and up share one spec.
struct GroupedSpec {
  int64_t group = 32;   // K elements per scale group
  bool bias = false;    // an offset term per group (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K)
  int code_bits = 8;    // 8: codes stored as bytes; 4: nibbles decoded through `lut`
  int8_t lut[16] = {};  // code_bits == 4: the code each nibble value stands for
  // code_bits == 8: the range the format's codes lie in (Q6_K -32..31, Q5_K 0..31, ...); the
  // packer refuses codes outside it. A narrow range lets avx2 take offset codes (jit/kernel.hpp
  // kQGroupOffset).
  int code_lo = -128, code_hi = 127;
  // Two-level scales (0: off): K elements per super block, a multiple of `group`. The layer then
  // stores each group's scale (and bias) as an int8 sub-scale times an fp32 factor per (column,
  // super block), found by the packer so that factor * sub equals the fp32 scale exactly (GGUF's
  // K-quants and IQ4_XS are d * int sub-scale: super_group 256). The kernels compute the same
  // fp32 scale, so the results do not change; Q4_K streams 0.59 bytes a weight instead of 0.75.
  // K of every matrix (and shard of down) must then be whole super blocks.
  int64_t super_group = 0;
  // One-level scales (and biases) stored as fp16 or bf16 instead of fp32 (not with super_group):
  // exact for scales that came from such a checkpoint (GGUF's legacy types' f16 d and m, RAWINT4's
  // bf16, GPTQ's f16); the packer refuses a value the type does not hold exactly. Half the bytes
  // of fp32 scales, the same result bits (the kernels widen exactly).
  FloatType scale_dtype = FloatType::f32;
  // Int32 super-block folds (jit/kernel.hpp kQGroupIntFold; set by the layer at avx2, and with
  // fp32 super-block partials at the VNNI levels, where qgroup_int_fold allows): byte codes stored
  // signed (offset 0), the activations taken as a + 128 (unsigned); at avx2 the int8 sub-scales
  // multiplied in int32 and one fp32 fold per super block. Each super block's header then holds,
  // after the fp32 factor of every column, an int32 per column: 128 * sum over its groups of sub *
  // (sum of the group's codes), the term the + 128 adds.
  bool int_fold = false;
};

// K elements of a matrix's smallest whole unit: the super block, or the group.
inline int64_t qgroup_unit(const GroupedSpec& spec) {
  return spec.super_group ? spec.super_group : spec.group;
}

// Factors fp32 values x[0 .. n) as factor * q[i] with q int8, exactly in fp32 (zeros of the sign
// factor * 0 gives). Returns false when no such factor exists (non-finite values, mantissas too
// far apart, or zeros of both signs).
bool factor_int8(const float* x, int n, float* factor, int8_t* q);

// ---- packing for the qgroup kernels (formats/grouped.cpp; layout in docs/FORMATS.md) -----------
// Strips as the integer formats ([k/4][column][4 k] bytes; 4-bit: two K steps per byte block, the
// even step in the low nibbles), and per strip and group: the group's codes, then one fp32 scale
// per packed column, then (spec.bias) one fp32 bias per packed column. Padding columns have zero
// codes, scales and biases. With two-level scales, each super block starts with a header (one
// fp32 scale factor per packed column, then with a bias one fp32 bias factor per column) and each
// group's scales and biases are int8 (one byte per packed column each).

// Throws std::invalid_argument (naming `what`) unless group is a positive multiple of 16,
// code_bits is 8 or 4, code_lo <= code_hi lie in [-128, 127] and super_group is 0 or a positive
// multiple of group, and scale_dtype is f32 with a super_group.
void check_grouped_spec(const GroupedSpec& spec, const std::string& what);

// The strip layout of a matrix [n, k] (k a multiple of spec.group) in `sources` sources (2: fused
// gate/up) for `lanes`-column vectors.
StripLayout qgroup_layout(int64_t n, int64_t k, int lanes, int strip_vecs, int sources,
                          const GroupedSpec& spec);

// One source of a pack: rows [r0, r0 + layout.n) and columns [k0, k0 + layout.k) of `m`, whose
// rows are `ld` codes long (k0 a multiple of the group). `name` appears in error messages.
struct GroupedSlice {
  const GroupedMatrix* m = nullptr;
  int64_t ld = 0, r0 = 0, k0 = 0;
  std::string name;
};

// Packs `src[0 .. layout.sources)` into `out` (layout.total_bytes()). With two-level scales, a
// super block whose scales (or biases) factor_int8 cannot split throws std::invalid_argument naming
// the matrix, row and super block. Byte codes are stored as
// uint8(code + offset): 128 for the VNNI kernels (= code XOR 0x80, their unsigned operand), c0 for
// offset codes (qgroup_code_offset), else 0. Throws std::invalid_argument naming the matrix, row
// and column of a code the 4-bit table lacks or outside the spec's byte range, or for a group size
// / bias presence that does not match the spec (a null `biases` under a bias spec packs zero
// biases).
void pack_qgroup_strips(const StripLayout& layout, const GroupedSpec& spec, const GroupedSlice* src,
                        int offset, int8_t* out);

// Inverse of pack_qgroup_strips for one row: row `row` of source `src`, columns [k0, k1) (whole
// groups) of a pack made with `spec` and `offset`: the codes (int8, k1 - k0 of them), the group
// scales ((k1 - k0) / group) and, when `biases` is not null, the group biases.
void unpack_qgroup_row(const StripLayout& layout, const GroupedSpec& spec, const uint8_t* packed,
                       int offset, int src, int64_t row, int64_t k0, int64_t k1, int8_t* codes,
                       float* scales, float* biases);

// The 16-entry table the nibble kernels take: each code + offset as a byte (as the packer stores
// byte codes).
void qgroup_kernel_lut(const GroupedSpec& spec, int offset, int8_t out[16]);

// The offset c0 of the offset-code kernels (jit/kernel.hpp kQGroupOffset) for the spec's codes
// (the 4-bit table's entries, or the byte range): 0 when every code is in [0, 127], else the
// smallest power of two with every code + c0 in [0, 129] (vpmaddubsw's pair sums then stay within
// int16 for activations in [-127, 127]); -1 when none exists (IQ4's table spans -127..113, Q8_0
// the whole byte).
int qgroup_code_offset(const GroupedSpec& spec);

// Whether offset codes with offset c0 (>= 0) let a group accumulate in int16 lanes (jit/kernel.hpp
// kQGroupI16): each lane sums the products of a stored code (code + c0, at most the largest) and
// an activation in [-127, 127], two a K step, and the kernels widen the lanes into int32 every
// kQGroupI16Steps K steps of a longer group, so min(group, 32) / 2 * max(code + c0) * 127 must
// stay within 32767. True for Q4_0 / Q4_1 / Q4_K / RAWINT4 and GPTQ_INT4 at any group of 32 or
// more (15), Q2_K and Q3_K (G 16).
constexpr int kQGroupI16Steps = 8;
bool qgroup_int16_sums(const GroupedSpec& spec, int c0);

// Whether the spec allows int32 super-block folds (GroupedSpec::int_fold, jit/kernel.hpp
// kQGroupIntFold): two-level scales without a bias, byte codes within [-32, 32] (so two K steps'
// vpmaddubsw pair sums of codes and unsigned activations, 2 * 2 * 255 * 32 = 32640, fit int16),
// and super blocks short enough that the int32 sums cannot overflow (super_group * 128 * 255 * 32
// < 2^31). Q6_K is such a type.
bool qgroup_int_fold(const GroupedSpec& spec);

// Whether the layer may take int16-lane super-block folds at avx2 (jit/kernel.hpp
// kQGroupLaneFold): two-level scales over codes stored as they are (no offset), groups of at most
// 32 k, and an even number of at most kQGroupLaneMaxGroups groups per super block (the bias sums
// pair two groups' s_g, each |s_g| <= 32 * 127, in int16). The codes are either 4-bit nibbles that
// are their own value (the identity table: Q4_K, Q2_K), whose lanes take a whole group (16
// products of <= 15 * 127), or bytes in [0, 32] (Q5_K), whose lanes are folded every
// kQGroupByteLaneSteps K steps (8 products of <= 32 * 127 = 32512). The int32 sums then stay below
// 2^31 with any int8 sub-scales.
constexpr int kQGroupLaneMaxGroups = 16;
constexpr int kQGroupByteLaneSteps = 4;
bool qgroup_lane_fold(const GroupedSpec& spec);

// Whether the nibble table plus `offset` is 0, 1, ..., 15 (jit/kernel.hpp kQGroupIdentity).
bool qgroup_identity_table(const GroupedSpec& spec, int offset);

// Shard bounds [0, ..., I] splitting I into `shards` parts on multiples of `group` (as even as
// whole groups allow; fewer parts when I has fewer groups).
std::vector<int64_t> qgroup_shard_bounds(int64_t I, int64_t group, int shards);

}  // namespace ktjit::formats
