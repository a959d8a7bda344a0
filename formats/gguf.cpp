#include "formats/gguf.hpp"

#include <cstring>
#include <stdexcept>
#include <vector>

#include "formats/convert.hpp"

namespace ktjit::formats::gguf {

namespace {

// IQ4_NL / IQ4_XS code table (ggml's kvalues_iq4nl).
constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                   1,    13,   25,  38,  53,  69,  89,  113};

#define LUT_SIGNED \
  { -8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7 }
#define LUT_UNSIGNED \
  { 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15 }
#define LUT_IQ4 \
  { -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113 }
#define LUT_NONE \
  {}

// Q2_K and Q4_1/Q4_K share the unsigned table and Q3_K shares Q4_0's, so a gate and an up of
// those types keep 4-bit codes together.
const TypeInfo kTypes[] = {
    {GgmlType::F32, "F32", 1, 4, true, 0, false, false, LUT_NONE, 0, 0},
    {GgmlType::F16, "F16", 1, 2, true, 0, false, false, LUT_NONE, 0, 0},
    {GgmlType::BF16, "BF16", 1, 2, true, 0, false, false, LUT_NONE, 0, 0},
    {GgmlType::Q4_0, "Q4_0", 32, 18, false, 32, false, true, LUT_SIGNED, -8, 7},
    {GgmlType::Q4_1, "Q4_1", 32, 20, false, 32, true, true, LUT_UNSIGNED, 0, 15},
    {GgmlType::Q5_0, "Q5_0", 32, 22, false, 32, false, false, LUT_NONE, -16, 15},
    {GgmlType::Q5_1, "Q5_1", 32, 24, false, 32, true, false, LUT_NONE, 0, 31},
    {GgmlType::Q8_0, "Q8_0", 32, 34, false, 32, false, false, LUT_NONE, -128, 127},
    {GgmlType::Q2_K, "Q2_K", 256, 84, false, 16, true, true, LUT_UNSIGNED, 0, 3},
    {GgmlType::Q3_K, "Q3_K", 256, 110, false, 16, false, true, LUT_SIGNED, -4, 3},
    {GgmlType::Q4_K, "Q4_K", 256, 144, false, 32, true, true, LUT_UNSIGNED, 0, 15},
    {GgmlType::Q5_K, "Q5_K", 256, 176, false, 32, true, false, LUT_NONE, 0, 31},
    {GgmlType::Q6_K, "Q6_K", 256, 210, false, 16, false, false, LUT_NONE, -32, 31},
    {GgmlType::IQ4_NL, "IQ4_NL", 32, 18, false, 32, false, true, LUT_IQ4, -127, 113},
    {GgmlType::IQ4_XS, "IQ4_XS", 256, 136, false, 32, false, true, LUT_IQ4, -127, 113},
};

#undef LUT_SIGNED
#undef LUT_UNSIGNED
#undef LUT_IQ4
#undef LUT_NONE

float f16(const uint8_t* p) {
  return f16_to_f32(uint16_t(p[0] | p[1] << 8));
}

// One block in its own group: q[block], s[block / group], m[block / group] (m only for types
// with a bias). Each product below is exact in fp32 (see gguf.hpp), and the order — scale
// first, then times the code, then plus the bias — is the gguf package's.

void block_q4_0(const uint8_t* b, int8_t* q, float* s, float*) {
  s[0] = f16(b);
  for (int j = 0; j < 16; ++j) {
    q[j] = int8_t((b[2 + j] & 15) - 8);
    q[j + 16] = int8_t((b[2 + j] >> 4) - 8);
  }
}

void block_q4_1(const uint8_t* b, int8_t* q, float* s, float* m) {
  s[0] = f16(b);
  m[0] = f16(b + 2);
  for (int j = 0; j < 16; ++j) {
    q[j] = int8_t(b[4 + j] & 15);
    q[j + 16] = int8_t(b[4 + j] >> 4);
  }
}

void block_q5(const uint8_t* qh4, const uint8_t* qs, int offset, int8_t* q) {
  const uint32_t qh =
      uint32_t(qh4[0]) | uint32_t(qh4[1]) << 8 | uint32_t(qh4[2]) << 16 | uint32_t(qh4[3]) << 24;
  for (int j = 0; j < 16; ++j) {
    q[j] = int8_t(((qs[j] & 15) | ((qh >> j) & 1) << 4) - offset);
    q[j + 16] = int8_t(((qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4) - offset);
  }
}

void block_q5_0(const uint8_t* b, int8_t* q, float* s, float*) {
  s[0] = f16(b);
  block_q5(b + 2, b + 6, 16, q);
}

void block_q5_1(const uint8_t* b, int8_t* q, float* s, float* m) {
  s[0] = f16(b);
  m[0] = f16(b + 2);
  block_q5(b + 4, b + 8, 0, q);
}

void block_q8_0(const uint8_t* b, int8_t* q, float* s, float*) {
  s[0] = f16(b);
  std::memcpy(q, b + 2, 32);
}

// Q2_K: scales[16] (low nibble scale, high nibble min), qs[64], d, dmin. Element
// i = 128 h + 32 s + l holds bits 2s..2s+1 of qs[32 h + l]; group of 16 = i / 16.
void block_q2_k(const uint8_t* b, int8_t* q, float* s, float* m) {
  const uint8_t* sc = b;
  const uint8_t* qs = b + 16;
  const float d = f16(b + 80), dmin = f16(b + 82);
  for (int g = 0; g < 16; ++g) {
    s[g] = d * float(sc[g] & 15);
    m[g] = -(dmin * float(sc[g] >> 4));
  }
  for (int h = 0; h < 2; ++h)
    for (int sh = 0; sh < 4; ++sh) {
      int8_t* o = q + 128 * h + 32 * sh;
      for (int l = 0; l < 32; ++l) o[l] = int8_t((qs[32 * h + l] >> (2 * sh)) & 3);
    }
}

// Q3_K: hmask[32], qs[64], scales[12] (16 six-bit scales), d. Low 2 bits as Q2_K; the high bit
// of element i is bit i / 32 of hmask[i % 32], and a clear bit subtracts 4.
void block_q3_k(const uint8_t* b, int8_t* q, float* s, float*) {
  const uint8_t* hm = b;
  const uint8_t* qs = b + 32;
  const uint8_t* sc = b + 96;
  const float d = f16(b + 108);
  for (int j = 0; j < 16; ++j) {
    const int lo = j < 8 ? sc[j] & 15 : sc[j - 8] >> 4;
    const int hi = (sc[8 + j % 4] >> (2 * (j / 4))) & 3;
    s[j] = d * float((lo | hi << 4) - 32);
  }
  for (int h = 0; h < 2; ++h)
    for (int sh = 0; sh < 4; ++sh) {
      const int b = 4 * h + sh;  // = i / 32
      int8_t* o = q + 32 * b;
      for (int l = 0; l < 32; ++l) {
        const int lo = (qs[32 * h + l] >> (2 * sh)) & 3;
        o[l] = int8_t(lo - 4 + 4 * ((hm[l] >> b) & 1));
      }
    }
}

// Q4_K / Q5_K six-bit scales and mins of the 8 sub-blocks, packed in 12 bytes.
void scale_min_k4(const uint8_t* p, int j, int* sc, int* mn) {
  if (j < 4) {
    *sc = p[j] & 63;
    *mn = p[j + 4] & 63;
  } else {
    *sc = (p[j + 4] & 15) | (p[j - 4] >> 6) << 4;
    *mn = (p[j + 4] >> 4) | (p[j] >> 6) << 4;
  }
}

void scales_k4(const uint8_t* b, float* s, float* m) {
  const float d = f16(b), dmin = f16(b + 2);
  for (int j = 0; j < 8; ++j) {
    int sc, mn;
    scale_min_k4(b + 4, j, &sc, &mn);
    s[j] = d * float(sc);
    m[j] = -(dmin * float(mn));
  }
}

// Q4_K: d, dmin, scales[12], qs[128]; sub-block j = 2c + n is nibble n of qs[32c .. 32c + 31].
void block_q4_k(const uint8_t* b, int8_t* q, float* s, float* m) {
  scales_k4(b, s, m);
  const uint8_t* qs = b + 16;
  for (int j = 0; j < 8; ++j) {
    const uint8_t* src = qs + 32 * (j / 2);
    const int shift = 4 * (j % 2);
    for (int l = 0; l < 32; ++l) q[32 * j + l] = int8_t((src[l] >> shift) & 15);
  }
}

// Q5_K: as Q4_K with qh[32] before qs: bit j of qh[l] is the fifth bit of sub-block j, element l.
void block_q5_k(const uint8_t* b, int8_t* q, float* s, float* m) {
  scales_k4(b, s, m);
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + 48;
  for (int j = 0; j < 8; ++j) {
    const uint8_t* src = qs + 32 * (j / 2);
    const int shift = 4 * (j % 2);
    for (int l = 0; l < 32; ++l)
      q[32 * j + l] = int8_t(((src[l] >> shift) & 15) | ((qh[l] >> j) & 1) << 4);
  }
}

// Q6_K: ql[128], qh[64], scales[16] (int8), d. In half h, element i' = 64 n + m takes nibble n
// of ql[64 h + m]; element i' = 32 s + l takes bits 2s..2s+1 of qh[32 h + l] as bits 4..5.
void block_q6_k(const uint8_t* b, int8_t* q, float* s, float*) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = f16(b + 208);
  for (int g = 0; g < 16; ++g) s[g] = d * float(sc[g]);
  for (int h = 0; h < 2; ++h)
    for (int c = 0; c < 4; ++c) {  // element i = 128 h + 32 c + l
      const uint8_t* lo_src = ql + 64 * h + 32 * (c % 2);
      const uint8_t* hi_src = qh + 32 * h;
      const int lo_shift = 4 * (c / 2), hi_shift = 2 * c;
      int8_t* o = q + 128 * h + 32 * c;
      for (int l = 0; l < 32; ++l)
        o[l] = int8_t((((lo_src[l] >> lo_shift) & 15) | ((hi_src[l] >> hi_shift) & 3) << 4) - 32);
    }
}

void block_iq4_nl(const uint8_t* b, int8_t* q, float* s, float*) {
  s[0] = f16(b);
  for (int j = 0; j < 16; ++j) {
    q[j] = kIq4Values[b[2 + j] & 15];
    q[j + 16] = kIq4Values[b[2 + j] >> 4];
  }
}

// IQ4_XS: d, scales_h (u16: 2 high bits per sub-block), scales_l[4] (nibbles), qs[128]; sub-block
// j is qs[16j .. 16j + 15], low nibbles first.
void block_iq4_xs(const uint8_t* b, int8_t* q, float* s, float*) {
  const float d = f16(b);
  const int sh = b[2] | b[3] << 8;
  const uint8_t* sl = b + 4;
  const uint8_t* qs = b + 8;
  for (int j = 0; j < 8; ++j) {
    const int ls = ((sl[j / 2] >> (4 * (j % 2))) & 15) | ((sh >> (2 * j)) & 3) << 4;
    s[j] = d * float(ls - 32);
    for (int l = 0; l < 16; ++l) {
      q[32 * j + l] = kIq4Values[qs[16 * j + l] & 15];
      q[32 * j + l + 16] = kIq4Values[qs[16 * j + l] >> 4];
    }
  }
}

using BlockFn = void (*)(const uint8_t*, int8_t*, float*, float*);

BlockFn block_fn(GgmlType t) {
  switch (t) {
    case GgmlType::Q4_0: return block_q4_0;
    case GgmlType::Q4_1: return block_q4_1;
    case GgmlType::Q5_0: return block_q5_0;
    case GgmlType::Q5_1: return block_q5_1;
    case GgmlType::Q8_0: return block_q8_0;
    case GgmlType::Q2_K: return block_q2_k;
    case GgmlType::Q3_K: return block_q3_k;
    case GgmlType::Q4_K: return block_q4_k;
    case GgmlType::Q5_K: return block_q5_k;
    case GgmlType::Q6_K: return block_q6_k;
    case GgmlType::IQ4_NL: return block_iq4_nl;
    case GgmlType::IQ4_XS: return block_iq4_xs;
    default: return nullptr;
  }
}

void check_k(const TypeInfo& t, int64_t k) {
  if (k <= 0 || k % t.block != 0)
    throw std::invalid_argument(std::string("gguf ") + t.name + ": row length " +
                                std::to_string(k) + " is not a whole number of " +
                                std::to_string(t.block) + "-element blocks");
}

}  // namespace

const TypeInfo* type_info(int ggml_type) {
  for (const TypeInfo& t : kTypes)
    if (int(t.type) == ggml_type) return &t;
  return nullptr;
}

std::string supported_types() {
  std::string s;
  for (const TypeInfo& t : kTypes) {
    if (!s.empty()) s += ", ";
    s += t.name;
  }
  return s;
}

int64_t row_bytes(const TypeInfo& t, int64_t k) {
  check_k(t, k);
  return k / t.block * t.block_bytes;
}

void decode_rows(const TypeInfo& t, const void* src, int64_t rows, int64_t k, int64_t group,
                 int8_t* codes, float* scales, float* biases) {
  const BlockFn fn = block_fn(t.type);
  if (t.is_float || fn == nullptr)
    throw std::invalid_argument(std::string("gguf decode: ") + t.name +
                                " is a float type (use dequantize)");
  check_k(t, k);
  if (group <= 0 || t.group % group != 0)
    throw std::invalid_argument(std::string("gguf decode: ") + t.name + " has groups of " +
                                std::to_string(t.group) + "; output group " +
                                std::to_string(group) + " does not divide it");
  if (t.bias && biases == nullptr)
    throw std::invalid_argument(std::string("gguf decode: ") + t.name +
                                " has a bias per group; biases must not be null");
  const int64_t rb = row_bytes(t, k), nb = k / t.block;
  const int gpb = t.block / t.group;     // natural groups per block
  const int64_t rep = t.group / group;   // output groups per natural group
  const int64_t out_groups = k / group;  // per row
  int8_t q[256];
  float s[16], m[16] = {};
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = static_cast<const uint8_t*>(src) + r * rb;
    int8_t* qr = codes + r * k;
    float* sr = scales + r * out_groups;
    float* br = biases ? biases + r * out_groups : nullptr;
    for (int64_t blk = 0; blk < nb; ++blk) {
      fn(row + blk * t.block_bytes, q, s, m);
      std::memcpy(qr + blk * t.block, q, size_t(t.block));
      for (int g = 0; g < gpb; ++g)
        for (int64_t x = 0; x < rep; ++x) {
          const int64_t o = (blk * gpb + g) * rep + x;
          sr[o] = s[g];
          if (br) br[o] = t.bias ? m[g] : 0.0f;
        }
    }
  }
}

void dequantize_rows(const TypeInfo& t, const void* src, int64_t rows, int64_t k, float* out) {
  check_k(t, k);
  if (t.is_float) {
    const FloatType ft = t.type == GgmlType::F32   ? FloatType::f32
                         : t.type == GgmlType::F16 ? FloatType::f16
                                                   : FloatType::bf16;
    to_f32(src, ft, rows * k, out);
    return;
  }
  // One row at a time through the decoder: scale * code, then + bias, each rounded to fp32.
  const int64_t ng = k / t.group;
  std::vector<int8_t> q(static_cast<size_t>(k));
  std::vector<float> s(static_cast<size_t>(ng)), m(static_cast<size_t>(ng));
  const int64_t rb = row_bytes(t, k);
  for (int64_t r = 0; r < rows; ++r) {
    decode_rows(t, static_cast<const uint8_t*>(src) + r * rb, 1, k, t.group, q.data(), s.data(),
                t.bias ? m.data() : nullptr);
    float* o = out + r * k;
    for (int64_t c = 0; c < k; ++c) {
      const float p = s[size_t(c / t.group)] * float(q[size_t(c)]);
      o[c] = t.bias ? p + m[size_t(c / t.group)] : p;
    }
  }
}

}  // namespace ktjit::formats::gguf
