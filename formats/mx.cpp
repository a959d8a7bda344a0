#include "formats/mx.hpp"

#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

#include "jit/gemm.hpp"

namespace ktjit::formats {

StripLayout mx_layout(int64_t n, int64_t k, int lanes, int strip_vecs, int sources, bool fp4) {
  if (k % kMxGroup != 0)
    throw std::invalid_argument("MX weights: K must be a multiple of 32, got " + std::to_string(k));
  StripLayout l = StripLayout::make(n, k, lanes, strip_vecs, sources, fp4 ? 4 : 8, 1, kMxGroup);
  l.group_extra = 1;  // one exponent byte per column and group
  return l;
}

uint8_t mx_stored_exponent(uint8_t e, bool fp4) {
  if (e == 255) throw std::invalid_argument("MX scale: ue8m0 exponent 255 is NaN");
  if (!fp4 && e >= 247)
    throw std::invalid_argument("MXFP8 scale: ue8m0 exponent " + std::to_string(int(e)) + " (2^" +
                                std::to_string(int(e) - 127) +
                                ") is above the supported 246 (2^119)");
  return fp4 ? e : uint8_t(e + 8);
}

float mx_stored_scale(uint8_t stored) {
  const uint32_t bits = uint32_t(stored) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

void pack_mx_strips(const StripLayout& l, bool fp4, const uint8_t* const* w, int64_t w_ld,
                    const uint8_t* const* e, int64_t e_ld, uint8_t* out) {
  std::memset(out, 0, size_t(l.total_bytes()));
  const int64_t groups = l.groups();
  int64_t c = 0;
  for (int64_t s = 0; s < l.num_strips(); ++s) {
    const int vecs = s < l.full_strips ? l.strip_vecs : l.tail_vecs;
    const int cols = l.strip_cols(vecs);
    const int64_t wbytes = kMxGroup * cols / (fp4 ? 2 : 1);  // one group's weights
    uint8_t* base = out + l.strip_offset(s);
    for (int j = 0; j < cols; ++j, ++c) {
      int src;
      int64_t r;
      packed_column_source(l, c, &src, &r);
      if (r < 0) continue;
      const uint8_t* row = w[src] + r * w_ld;
      const uint8_t* er = e[src] + r * e_ld;
      for (int64_t g = 0; g < groups; ++g) {
        uint8_t* gb = base + g * (cols + wbytes);
        gb[j] = mx_stored_exponent(er[g], fp4);
        uint8_t* gw = gb + cols;
        if (fp4) {  // [k/8][column][4 bytes]: the row's 4 bytes of k0..k0+7 as they are
          for (int64_t b = 0; b < kMxGroup / 8; ++b)
            std::memcpy(gw + (b * cols + j) * 4, row + (g * kMxGroup) / 2 + b * 4, 4);
        } else {
          for (int64_t kk = 0; kk < kMxGroup; ++kk) gw[kk * cols + j] = row[g * kMxGroup + kk];
        }
      }
    }
  }
}

void mx_dequantize_row(bool fp4, const uint8_t* w, const uint8_t* e, int64_t k, float* out) {
  for (int64_t kk = 0; kk < k; ++kk) {
    const uint8_t ex = e[kk / kMxGroup];
    uint32_t bits = uint32_t(ex) << 23;
    float s;
    std::memcpy(&s, &bits, 4);
    if (ex == 0) s = fp4 ? 0.0f : 0x1p-127f;
    const float v = fp4 ? mx_e2m1(kk % 2 ? w[kk / 2] >> 4 : w[kk / 2] & 0x0f) : fp8_value(w[kk]);
    out[kk] = v * s;
  }
}

void quantize_mx_act_i16(const float* x, int64_t k, uint8_t* out) {
  for (int64_t g = 0; g < k / kMxGroup; ++g, x += kMxGroup, out += kMxI16GroupBytes) {
    float amax = 0.0f;
    bool finite = true;
    for (int i = 0; i < kMxGroup; ++i) {  // comparisons, not std::fmax: no libm call per value
      const float a = std::fabs(x[i]);
      amax = a > amax ? a : amax;
      finite = finite && std::isfinite(x[i]);
    }
    int16_t q[kMxGroup] = {};
    float half_d;
    if (!finite) {
      half_d = std::numeric_limits<float>::quiet_NaN();
    } else if (amax == 0.0f) {
      half_d = 0.0f;
    } else {
      const float inv = 32767.0f / amax;
      // |x * inv| <= 32767 and a rounding; std::nearbyint's libm call per value took 7 % of
      // MXFP4 decode at DeepSeek-V3 T = 1
      for (int i = 0; i < kMxGroup; ++i) q[i] = int16_t(rne_clamp(x[i] * inv, 32767.0f));
      half_d = amax / 32767.0f * 0.5f;
    }
    for (int b = 0; b < 4; ++b)
      for (int s = 0; s < 4; ++s) {
        const int16_t pair[2] = {q[8 * b + s], q[8 * b + s + 4]};
        std::memcpy(out + (4 * b + s) * 4, pair, 4);
      }
    std::memcpy(out + 64, &half_d, 4);
    int64_t sum = 0;
    for (int i = 0; i < kMxGroup; ++i) sum += q[i];
    const uint32_t offset_sum = uint32_t(uint64_t(int64_t(kMxI16CodeOffset) * sum));
    std::memcpy(out + 68, &offset_sum, 4);
  }
}

int16_t mx_act_i16_code(const uint8_t* row, int64_t k) {
  const int64_t g = k / kMxGroup, kl = k % kMxGroup, b = kl / 8, r = kl % 8;
  int16_t q;
  std::memcpy(&q, row + g * kMxI16GroupBytes + (4 * b + r % 4) * 4 + (r / 4) * 2, 2);
  return q;
}

float mx_act_i16_half_scale(const uint8_t* row, int64_t group) {
  float d;
  std::memcpy(&d, row + group * kMxI16GroupBytes + 64, 4);
  return d;
}

}  // namespace ktjit::formats
