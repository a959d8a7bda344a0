#include "formats/int8.hpp"

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

namespace ktjit::formats {

// amax over |x| in the integer domain: for non-negative floats the bit patterns order like the
// values, and an integer max loop vectorizes with the baseline SSE2 the core is built for.
float row_amax(const float* x, int64_t k) {
  uint32_t amax_bits = 0;
  for (int64_t i = 0; i < k; ++i) {
    uint32_t b;
    std::memcpy(&b, x + i, 4);
    b &= 0x7fffffffu;
    amax_bits = b > amax_bits ? b : amax_bits;
  }
  float amax;
  std::memcpy(&amax, &amax_bits, 4);
  return amax;
}

namespace {

// clamp(rne(x * id), -127, 127) (|x * id| <= 127.5).
inline int32_t rne_clamp127(float x, float id) {
  return int32_t(rne_clamp(x * id, 127.0f));
}

}  // namespace

void quantize_int8_with(const float* x, int64_t k, float id, int8_t* q) {
  for (int64_t i = 0; i < k; ++i) q[i] = int8_t(rne_clamp127(x[i], id));
}

float quantize_row_int8(const float* x, int64_t k, int8_t* q) {
  const float d = row_amax(x, k) / 127.0f;
  quantize_int8_with(x, k, inverse_scale(d), q);
  return d;
}

float quantize_row_int4(const float* x, int64_t k, int8_t* q16) {
  const float d = row_amax(x, k) / 112.0f;
  const float id = inverse_scale(d);
  for (int64_t i = 0; i < k; ++i) {
    const int32_t q8 = rne_clamp127(x[i], id);
    // kt-kernel's round_4bit_s8: |q8| rounded to a multiple of 16, half away from zero.
    const int32_t q4 = q8 < 0 ? -((-q8 + 8) >> 4) : (q8 + 8) >> 4;
    q16[i] = int8_t(16 * q4);
  }
  return d;
}

void flip_sign_bits(int8_t* q, int64_t n) {
  for (int64_t i = 0; i < n; ++i) q[i] = int8_t(uint8_t(q[i]) ^ 0x80u);
}

StripLayout StripLayout::make(int64_t n, int64_t k, int lanes, int strip_vecs, int sources,
                              int bits, int kgroup, int64_t g_steps) {
  StripLayout l;
  l.n = n;
  l.k = k;
  l.bits = bits;
  l.kgroup = kgroup ? kgroup : bits == 16 ? 1 : 4;
  l.k4 = l.kgroup == 1   ? k
         : l.kgroup == 2 ? (k + 1) / 2
         : bits == 4     ? (k + 7) / 8 * 2
                         : (k + 3) / 4;
  l.g_steps = g_steps;
  l.lanes = lanes;
  l.strip_vecs = strip_vecs;
  l.sources = sources;
  const int64_t vecs_per_source = (n + lanes - 1) / lanes;  // rows padded to whole vectors
  const int64_t per_strip = strip_vecs / sources;
  l.full_strips = vecs_per_source / per_strip;
  l.tail_vecs = int(vecs_per_source % per_strip) * sources;
  return l;
}

void packed_column_source(const StripLayout& l, int64_t c, int* source, int64_t* row) {
  const int64_t full_cols = l.full_strips * l.strip_cols(l.strip_vecs);
  int64_t strip, in;
  int cols;
  if (c < full_cols) {
    cols = l.strip_cols(l.strip_vecs);
    strip = c / cols;
    in = c % cols;
  } else {
    cols = l.strip_cols(l.tail_vecs);
    strip = l.full_strips;
    in = c - full_cols;
  }
  const int64_t per_source = cols / l.sources;
  *source = int(in / per_source);
  const int64_t r = strip * l.rows_per_strip() + in % per_source;
  *row = r < l.n ? r : -1;
}

void packed_column_of(const StripLayout& l, int src, int64_t r, int64_t* strip, int* col,
                      int* strip_cols) {
  const int64_t rps = l.rows_per_strip();
  *strip = r / rps;
  *strip_cols = l.strip_cols(*strip < l.full_strips ? l.strip_vecs : l.tail_vecs);
  *col = int(src * (*strip_cols / l.sources) + r % rps);
}

void unpack_rows(const StripLayout& l, const void* packed, int src, int64_t r0, int64_t r1,
                 int64_t k0, int64_t k1, void* out, int64_t ld) {
  if (!(l.kgroup == 1 && (l.bits == 8 || l.bits == 16)) && !(l.kgroup == 2 && l.bits == 16))
    throw std::invalid_argument("unpack_rows: only bf16 and fp8 layouts");
  if (r0 < 0 || r1 > l.n || k0 < 0 || k1 > l.k || r0 > r1 || k0 > k1)
    throw std::invalid_argument("unpack_rows: range outside the matrix");
  const size_t es = size_t(l.bits / 8);
  for (int64_t r = r0; r < r1; ++r) {
    int64_t strip;
    int col, cols;
    packed_column_of(l, src, r, &strip, &col, &cols);
    const char* base = static_cast<const char*>(packed) + l.strip_offset(strip);
    char* dst = static_cast<char*>(out) + size_t((r - r0) * ld) * es;
    for (int64_t kk = k0; kk < k1; ++kk)  // [k / kgroup][column][kgroup] (fp8: fp8_strip_byte)
      std::memcpy(
          dst + size_t(kk - k0) * es,
          base + size_t(l.bits == 8 ? fp8_strip_byte(l.fp8_pair_order, cols, kk, col)
                                    : (kk / l.kgroup * cols + col) * l.kgroup + kk % l.kgroup) *
                     es,
          es);
  }
}

void pack_int8_strips(const StripLayout& l, const int8_t* const* q, const float* const* d,
                      int8_t* out, float* scale, int32_t* comp, bool offset_nibbles) {
  if (offset_nibbles && l.bits != 4)
    throw std::invalid_argument("pack_int8_strips: offset nibbles need a 4-bit layout");
  const uint8_t nib_xor = offset_nibbles ? 0x08 : 0x00;  // q4 + 8 = the nibble XOR 8
  std::memset(out, nib_xor * 0x11, size_t(l.total_bytes()));
  int64_t c = 0;
  for (int64_t s = 0; s <= l.full_strips; ++s) {
    const int vecs = s < l.full_strips ? l.strip_vecs : l.tail_vecs;
    if (vecs == 0) break;
    const int cols = l.strip_cols(vecs);
    int8_t* base = out + l.strip_offset(s);
    for (int j = 0; j < cols; ++j, ++c) {
      int src;
      int64_t row;
      packed_column_source(l, c, &src, &row);
      int32_t sum = 0;
      if (row >= 0) {
        const int8_t* qr = q[src] + row * l.k;
        for (int64_t kk = 0; kk < l.k; ++kk) {
          const int64_t off = ((kk / 4) * cols + j) * 4 + kk % 4;  // byte in 8-bit order
          if (l.bits == 8) {
            base[off] = qr[kk];
          } else {
            // Step pair p = kk/8: the byte of step 2p (at the same in-step offset) holds it.
            const int64_t step = kk / 4, in_step = off - step * cols * 4;
            const int64_t byte = (step / 2) * cols * 4 + in_step;
            if (qr[kk] % 16 != 0)
              throw std::invalid_argument(
                  "int4 weights: expected values 16 * q4 (multiples of 16), got " +
                  std::to_string(int(qr[kk])));
            const uint8_t nib = (uint8_t(qr[kk] >> 4) & 0x0f) ^ nib_xor;
            const uint8_t keep = step % 2 ? 0x0f : 0xf0;  // the other step's nibble
            base[byte] = int8_t((uint8_t(base[byte]) & keep) | (step % 2 ? nib << 4 : nib));
          }
          sum += qr[kk];
        }
      }
      scale[c] = row >= 0 ? d[src][row] : 0.0f;
      comp[c] = 128 * sum;
    }
  }
}

uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1);                                          // round half to even
  return uint16_t(u >> 16);
}

void f32_to_bf16_row(const float* x, int64_t n, uint16_t* out) {
  // The same rounding as f32_to_bf16, written as selects so the compiler vectorizes it (SSE2).
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, x + i, 4);
    const uint32_t nan = (u >> 16) | 0x40;
    const uint32_t rne = (u + 0x7fffu + ((u >> 16) & 1)) >> 16;
    out[i] = uint16_t((u & 0x7fffffffu) > 0x7f800000u ? nan : rne);
  }
}

void pack_bf16_strips(const StripLayout& l, const float* const* w, uint16_t* out, float* scale,
                      int32_t* comp) {
  std::memset(out, 0, size_t(l.total_bytes()));
  int64_t c = 0;
  for (int64_t s = 0; s <= l.full_strips; ++s) {
    const int vecs = s < l.full_strips ? l.strip_vecs : l.tail_vecs;
    if (vecs == 0) break;
    const int cols = l.strip_cols(vecs);
    uint16_t* base = out + l.strip_offset(s) / 2;
    for (int j = 0; j < cols; ++j, ++c) {
      int src;
      int64_t row;
      packed_column_source(l, c, &src, &row);
      if (row >= 0)
        for (int64_t kk = 0; kk < l.k; ++kk)  // [k / kgroup][column][kgroup]
          base[(kk / l.kgroup * cols + j) * l.kgroup + kk % l.kgroup] =
              f32_to_bf16(w[src][row * l.k + kk]);
      scale[c] = 1.0f;
      comp[c] = 0;
    }
  }
}

void pack_fp8_strips(const StripLayout& l, const uint8_t* const* w, const float* const* block,
                     const float* const* row, uint8_t* out, float* scale, int32_t* comp,
                     float* gscale) {
  if (l.fp8_pair_order && l.k % 2)
    throw std::invalid_argument("pack_fp8_strips: the pair order needs an even K");
  if (l.fp8_pair_order && (l.g_steps <= 0 || l.g_steps % 2 || l.g_steps / 2 > kFp8FlagMaxPairs))
    throw std::invalid_argument("pack_fp8_strips: the pair order needs even groups of at most " +
                                std::to_string(2 * kFp8FlagMaxPairs) + " k");
  std::memset(out, 0, size_t(l.total_bytes()));
  const int64_t kb = (l.k + 127) / 128;
  const int64_t groups = l.groups();
  int64_t c = 0;
  for (int64_t s = 0; s < l.num_strips(); ++s) {
    const int vecs = s < l.full_strips ? l.strip_vecs : l.tail_vecs;
    const int cols = l.strip_cols(vecs);
    uint8_t* base = out + l.strip_offset(s);
    float* gs = gscale + s * l.gscale_floats_per_strip();
    int64_t half_block[2] = {-1, -1};
    for (int j = 0; j < cols; ++j, ++c) {
      int src;
      int64_t r;
      packed_column_source(l, c, &src, &r);
      const int half = l.sources == 2 ? src : 0;
      if (r >= 0) {
        for (int64_t kk = 0; kk < l.k; ++kk)
          base[fp8_strip_byte(l.fp8_pair_order, cols, kk, j)] = w[src][r * l.k + kk];
        if (block) {
          if (half_block[half] >= 0 && half_block[half] != r / 128)
            throw std::invalid_argument("fp8: a strip's rows cross a 128-row scale block");
          half_block[half] = r / 128;
        }
      }
      scale[c] = block ? 1.0f : (r >= 0 ? row[src][r] : 0.0f);
      comp[c] = 0;
    }
    const int64_t gf = l.gscale_floats_per_group();
    for (int h = 0; h < 2; ++h) {
      const int src = l.sources == 2 ? h : 0;
      for (int64_t g = 0; g < groups; ++g) {
        float v = 1.0f;
        const int hb = l.sources == 2 ? h : 0;
        if (block && half_block[hb] >= 0) v = block[src][half_block[hb] * kb + g];
        for (int i = 0; i < (l.fp8_pair_order ? 1 : l.lanes); ++i) gs[l.gscale_index(g, h) + i] = v;
      }
    }
    for (int64_t g = 0; g < groups && l.fp8_pair_order; ++g) {
      uint8_t* flags = reinterpret_cast<uint8_t*>(gs + g * gf) + kFp8FlagOffset;
      std::memset(flags, 0, kFp8FlagBytes);
      if (cols == 64) {  // (narrower strips take the gather decode, which reads no flags)
        const int64_t p0 = g * (l.g_steps / 2), p1 = std::min((g + 1) * (l.g_steps / 2), l.k / 2);
        for (int64_t p = p0; p < p1; ++p) {
          const uint8_t* step = base + p * 128;
          bool zero = false;
          for (int i = 0; i < 128; ++i) zero = zero || fp8_zero_exponent(step[i]);
          if (zero) flags[p1 - 1 - p] = 1;
        }
      }
    }
  }
}

}  // namespace ktjit::formats
