// Packing of k-group scaled integer matrices (formats/grouped.hpp) into the qgroup strips.
#include "formats/grouped.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "jit/bits.hpp"

namespace ktjit::formats {

void check_grouped_spec(const GroupedSpec& spec, const std::string& what) {
  if (spec.group <= 0 || spec.group % 16 != 0)
    throw std::invalid_argument(what + ": group must be a positive multiple of 16, got " +
                                std::to_string(spec.group));
  if (spec.code_bits != 8 && spec.code_bits != 4)
    throw std::invalid_argument(what + ": code_bits must be 8 or 4, got " +
                                std::to_string(spec.code_bits));
  if (spec.super_group < 0 || (spec.super_group && (spec.super_group % spec.group != 0 ||
                                                    spec.super_group / spec.group > 256)))
    throw std::invalid_argument(what + ": super_group must be 0 or 1 to 256 times the group " +
                                std::to_string(spec.group) + ", got " +
                                std::to_string(spec.super_group));
  if (spec.super_group && spec.scale_dtype != FloatType::f32)
    throw std::invalid_argument(what +
                                ": two-level scales (super_group) keep fp32 factors; scale_dtype "
                                "must be f32 with them");
  if (spec.int_fold && !qgroup_int_fold(spec))
    throw std::invalid_argument(what +
                                ": int32 super-block folds need two-level scales without a bias "
                                "and byte codes within [-32, 32]");
  if (spec.code_lo < -128 || spec.code_hi > 127 || spec.code_lo > spec.code_hi)
    throw std::invalid_argument(what + ": code range must lie in [-128, 127] with lo <= hi, got [" +
                                std::to_string(spec.code_lo) + ", " + std::to_string(spec.code_hi) +
                                "]");
}

StripLayout qgroup_layout(int64_t n, int64_t k, int lanes, int strip_vecs, int sources,
                          const GroupedSpec& spec) {
  check_grouped_spec(spec, "qgroup layout");
  const int64_t unit = qgroup_unit(spec);
  if (k <= 0 || k % unit != 0)
    throw std::invalid_argument(
        "qgroup layout: K = " + std::to_string(k) + " is not a positive multiple of the " +
        (spec.super_group ? "super block " : "group ") + std::to_string(unit));
  StripLayout l =
      StripLayout::make(n, k, lanes, strip_vecs, sources, spec.code_bits, 4, spec.group / 4);
  const int per = spec.bias ? 2 : 1;  // scale (and bias) per column
  l.group_extra = (spec.super_group ? 1 : spec.scale_dtype == FloatType::f32 ? 4 : 2) * per;
  if (spec.super_group) {
    l.super_groups = spec.super_group / spec.group;
    l.super_extra = 4 * per + (spec.int_fold ? 4 : 0);  // fp32 factors (+ int32 corrections)
  }
  return l;
}

bool factor_int8(const float* x, int n, float* factor, int8_t* q) {
  uint32_t g = 0;  // gcd of the odd mantissas
  int emin = 1 << 20, zero_sign = -1;
  for (int i = 0; i < n; ++i) {
    uint32_t b;
    std::memcpy(&b, &x[i], 4);
    const uint32_t e = (b >> 23) & 0xff, f = b & 0x7fffff;
    if (e == 0xff) return false;  // inf / NaN
    if (e == 0 && f == 0) {       // a zero: factor * 0 must give its sign
      const int sgn = int(b >> 31);
      if (zero_sign >= 0 && zero_sign != sgn) return false;
      zero_sign = sgn;
      continue;
    }
    uint32_t m = e ? f | 0x800000u : f;
    int ex = (e ? int(e) : 1) - 150;  // |x| = m * 2^ex
    const int tz = __builtin_ctz(m);
    m >>= tz;
    ex += tz;
    uint32_t a = g, c = m;  // gcd(g, m)
    while (c) {
      const uint32_t t = a % c;
      a = c;
      c = t;
    }
    g = a;
    emin = std::min(emin, ex);
  }
  // |factor| = g * 2^emin (exact: g < 2^24, the exponent within fp32's); its sign is the zeros'
  // if there are any, else whichever keeps the quotients in [-128, 127] (+128 needs a negative
  // factor)
  for (int sign = 0; sign < 2; ++sign) {
    if (zero_sign >= 0 && sign != zero_sign) continue;
    const float f = (g ? std::ldexp(float(g), emin) : 1.0f) * (sign ? -1.0f : 1.0f);
    bool ok = true;
    for (int i = 0; ok && i < n; ++i) {
      const float r = x[i] / f;
      ok = r >= -128.0f && r <= 127.0f && r == std::nearbyint(r);
      if (!ok) break;
      q[i] = int8_t(r);
      const float back = f * float(q[i]);
      ok = std::memcmp(&back, &x[i], 4) == 0;
    }
    if (ok) {
      *factor = f;
      return true;
    }
  }
  return false;
}

void qgroup_kernel_lut(const GroupedSpec& spec, int offset, int8_t out[16]) {
  for (int i = 0; i < 16; ++i) out[i] = int8_t(uint8_t(spec.lut[i] + offset));
}

int qgroup_code_offset(const GroupedSpec& spec) {
  int lo = spec.code_lo, hi = spec.code_hi;
  if (spec.code_bits == 4) {
    lo = 127;
    hi = -128;
    for (int8_t v : spec.lut) {
      lo = std::min(lo, int(v));
      hi = std::max(hi, int(v));
    }
  }
  int c0 = 0;
  while (lo + c0 < 0) c0 = c0 ? 2 * c0 : 1;
  return hi + c0 <= 129 ? c0 : -1;
}

bool qgroup_int16_sums(const GroupedSpec& spec, int c0) {
  if (c0 < 0) return false;
  int hi = spec.code_hi;
  if (spec.code_bits == 4) {
    hi = -128;
    for (int8_t v : spec.lut) hi = std::max(hi, int(v));
  }
  // a lane adds G / 2 products, or 16 where the kernels widen every kQGroupI16Steps K steps
  const int64_t products = std::min<int64_t>(spec.group, 4 * kQGroupI16Steps) / 2;
  return products * int64_t(hi + c0) * 127 <= 32767;
}

bool qgroup_int_fold(const GroupedSpec& spec) {
  return spec.super_group > 0 && spec.super_group <= 2048 && !spec.bias && spec.code_bits == 8 &&
         spec.code_lo >= -32 && spec.code_hi <= 32;
}

bool qgroup_lane_fold(const GroupedSpec& spec) {
  if (spec.super_group <= 0 || spec.group > 32 || spec.int_fold ||
      spec.scale_dtype != FloatType::f32)
    return false;
  if (spec.code_bits == 4 ? !qgroup_identity_table(spec, 0) : spec.code_lo < 0 || spec.code_hi > 32)
    return false;
  const int64_t groups = spec.super_group / spec.group;
  return groups % 2 == 0 && groups <= kQGroupLaneMaxGroups;
}

bool qgroup_identity_table(const GroupedSpec& spec, int offset) {
  if (spec.code_bits != 4) return false;
  for (int i = 0; i < 16; ++i)
    if (spec.lut[i] + offset != i) return false;
  return true;
}

void pack_qgroup_strips(const StripLayout& l, const GroupedSpec& spec, const GroupedSlice* src,
                        int offset, int8_t* out) {
  const bool nib = spec.code_bits == 4;
  const int64_t G = spec.group;
  if (spec.int_fold && offset != 0)
    throw std::invalid_argument(
        "pack_qgroup_strips: int32 super-block folds store the codes "
        "signed (offset 0), got offset " +
        std::to_string(offset));
  for (int s = 0; s < l.sources; ++s) {
    const GroupedSlice& x = src[s];
    if (!x.m || !x.m->codes || !x.m->scales)
      throw std::invalid_argument(x.name + ": codes and scales are required");
    if (x.m->group != G)
      throw std::invalid_argument(x.name + ": group " + std::to_string(x.m->group) +
                                  " does not match the layer's " + std::to_string(G));
    if (x.m->biases && !spec.bias)
      throw std::invalid_argument(x.name +
                                  ": has biases but the layer was built without a bias term");
    if (x.k0 % G != 0 || x.ld % G != 0)
      throw std::invalid_argument(x.name + ": column slice not on group boundaries");
    if (spec.super_group && x.k0 % spec.super_group != 0)
      throw std::invalid_argument(x.name + ": column slice not on super block boundaries");
  }
  int nibble_of[256];
  for (int& v : nibble_of) v = -1;
  for (int i = 15; i >= 0; --i) nibble_of[uint8_t(spec.lut[i])] = i;  // first entry wins
  std::memset(out, 0, size_t(l.total_bytes()));
  const int64_t groups = l.groups();
  int64_t c = 0;
  for (int64_t s = 0; s <= l.full_strips; ++s) {
    const int vecs = s < l.full_strips ? l.strip_vecs : l.tail_vecs;
    if (vecs == 0) break;
    const int cols = l.strip_cols(vecs);
    const int64_t code_bytes = l.g_steps * cols * 4 * l.bits / 8;
    const int64_t group_bytes = code_bytes + cols * l.group_extra;
    const int64_t sg = l.super_groups ? l.super_groups : groups;  // groups between headers
    const int64_t header = l.super_extra * cols, super_bytes = sg * group_bytes + header;
    uint8_t* base = reinterpret_cast<uint8_t*>(out) + l.strip_offset(s);
    for (int j = 0; j < cols; ++j, ++c) {
      int si;
      int64_t row;
      packed_column_source(l, c, &si, &row);
      if (row < 0) continue;  // padding: zero codes, scales and biases
      const GroupedSlice& x = src[si];
      const int64_t r = x.r0 + row;
      const int8_t* codes = x.m->codes + r * x.ld + x.k0;
      const int64_t gld = x.ld / G, g0 = x.k0 / G;
      for (int64_t g = 0; g < groups; ++g) {
        uint8_t* gb = base + (g / sg) * super_bytes + header + (g % sg) * group_bytes;
        for (int64_t st = 0; st < l.g_steps; ++st)
          for (int q = 0; q < 4; ++q) {
            const int64_t k = (g * l.g_steps + st) * 4 + q;
            const int8_t code = codes[k];
            if (!nib) {
              if (code < spec.code_lo || code > spec.code_hi)
                throw std::invalid_argument(
                    x.name + ": row " + std::to_string(r) + " column " + std::to_string(x.k0 + k) +
                    ": code " + std::to_string(int(code)) + " is outside the layer's [" +
                    std::to_string(spec.code_lo) + ", " + std::to_string(spec.code_hi) + "]");
              gb[st * cols * 4 + j * 4 + q] = uint8_t(code + offset);
              continue;
            }
            const int idx = nibble_of[uint8_t(code)];
            if (idx < 0)
              throw std::invalid_argument(
                  x.name + ": row " + std::to_string(r) + " column " + std::to_string(x.k0 + k) +
                  ": code " + std::to_string(int(code)) + " is not in the layer's 4-bit table");
            gb[(st / 2) * cols * 4 + j * 4 + q] |= uint8_t(idx << (st % 2 ? 4 : 0));
          }
        if (l.super_groups) continue;  // two-level: each super block's factors below
        for (int t = 0; t < (spec.bias ? 2 : 1); ++t) {
          const float* v = t ? x.m->biases : x.m->scales;  // null biases: zeros
          const float f = v ? v[r * gld + g0 + g] : 0.0f;
          if (spec.scale_dtype == FloatType::f32) {
            std::memcpy(gb + code_bytes + (t * cols + j) * 4, &f, 4);
            continue;
          }
          const bool f16 = spec.scale_dtype == FloatType::f16;
          const uint16_t h = f16 ? f32_to_f16(f) : uint16_t(f32_to_bits(f) >> 16);
          const float back = f16 ? f16_to_f32(h) : bf16_to_f32(h);
          if (f32_to_bits(back) != f32_to_bits(f) || f != f)
            throw std::invalid_argument(
                x.name + ": row " + std::to_string(r) + " group " + std::to_string(x.k0 / G + g) +
                ": " + (t ? "bias " : "scale ") + std::to_string(f) + " is not exactly a" +
                (f16 ? "n f16" : " bf16") + " value (the layer keeps " + (f16 ? "f16" : "bf16") +
                " scales)");
          std::memcpy(gb + code_bytes + (t * cols + j) * 2, &h, 2);
        }
      }
      for (int64_t b = 0; l.super_groups && b < groups / sg; ++b)
        for (int t = 0; t < (spec.bias ? 2 : 1); ++t) {
          const float* v = t ? x.m->biases : x.m->scales;  // null biases: zeros
          float vals[256], f;
          int8_t q[256];
          for (int64_t i = 0; i < sg && i < 256; ++i)
            vals[i] = v ? v[r * gld + g0 + b * sg + i] : 0;
          if (sg > 256 || !factor_int8(vals, int(sg), &f, q))
            throw std::invalid_argument(
                x.name + ": row " + std::to_string(r) + " super block " +
                std::to_string((x.k0 + b * sg * G) / spec.super_group) + ": the " +
                (t ? "biases" : "scales") +
                " of its groups are not an fp32 factor times int8 sub-scales (two-level "
                "scales need the K-quant form d * sc)");
          uint8_t* sb = base + b * super_bytes;
          std::memcpy(sb + (t * cols + j) * 4, &f, 4);
          for (int64_t i = 0; i < sg; ++i)
            sb[header + i * group_bytes + code_bytes + t * cols + j] = uint8_t(q[i]);
          if (!spec.int_fold) continue;
          // the + 128 of the activations: 128 * sum_i sub_i * (sum of group i's codes), after
          // the factors (|value| <= 128 * 128 * super_group * 32 < 2^31)
          int64_t corr = 0;
          for (int64_t i = 0; i < sg; ++i) {
            int64_t cs = 0;
            for (int64_t k = (b * sg + i) * G; k < (b * sg + i + 1) * G; ++k) cs += codes[k];
            corr += int64_t(q[i]) * cs;
          }
          const int32_t c32 = int32_t(128 * corr);
          std::memcpy(sb + (cols + j) * 4, &c32, 4);
        }
    }
  }
}

void unpack_qgroup_row(const StripLayout& l, const GroupedSpec& spec, const uint8_t* packed,
                       int offset, int src, int64_t row, int64_t k0, int64_t k1, int8_t* codes,
                       float* scales, float* biases) {
  const int64_t G = spec.group;
  if (k0 < 0 || k1 > l.k || k0 > k1 || k0 % G != 0 || k1 % G != 0)
    throw std::invalid_argument("unpack_qgroup_row: columns [" + std::to_string(k0) + ", " +
                                std::to_string(k1) + ") are not whole groups of " +
                                std::to_string(G) + " within K = " + std::to_string(l.k));
  int64_t strip;
  int col, cols;
  packed_column_of(l, src, row, &strip, &col, &cols);
  const bool nib = spec.code_bits == 4;
  const int64_t code_bytes = l.g_steps * cols * 4 * l.bits / 8;
  const int64_t group_bytes = code_bytes + cols * l.group_extra;
  const int64_t sg = l.super_groups ? l.super_groups : l.groups();
  const int64_t header = l.super_extra * cols, super_bytes = sg * group_bytes + header;
  // group g's scale (t = 0) or bias (t = 1): fp32, or int8 sub * the super block's fp32 factor
  auto factor = [&](const uint8_t* sb, const uint8_t* gb, int t) {
    float f;
    if (spec.scale_dtype != FloatType::f32) {
      uint16_t h;
      std::memcpy(&h, gb + code_bytes + (t * cols + col) * 2, 2);
      return spec.scale_dtype == FloatType::f16 ? f16_to_f32(h) : bf16_to_f32(h);
    }
    if (!l.super_groups) {
      std::memcpy(&f, gb + code_bytes + (t * cols + col) * 4, 4);
      return f;
    }
    std::memcpy(&f, sb + (t * cols + col) * 4, 4);
    return float(int8_t(gb[code_bytes + t * cols + col])) * f;
  };
  for (int64_t g = k0 / G; g < k1 / G; ++g) {
    const uint8_t* sb = packed + l.strip_offset(strip) + (g / sg) * super_bytes;
    const uint8_t* gb = sb + header + (g % sg) * group_bytes;
    for (int64_t st = 0; st < l.g_steps; ++st)
      for (int q = 0; q < 4; ++q) {
        const int64_t k = (g * l.g_steps + st) * 4 + q;
        int8_t code;
        if (nib) {
          const uint8_t b = gb[(st / 2) * cols * 4 + col * 4 + q];
          code = spec.lut[(st % 2 ? b >> 4 : b) & 15];
        } else {
          code = int8_t(uint8_t(gb[st * cols * 4 + col * 4 + q] - offset));
        }
        codes[k - k0] = code;
      }
    scales[g - k0 / G] = factor(sb, gb, 0);
    if (biases) biases[g - k0 / G] = spec.bias ? factor(sb, gb, 1) : 0.0f;
  }
}

std::vector<int64_t> qgroup_shard_bounds(int64_t I, int64_t group, int shards) {
  if (group <= 0 || I <= 0 || I % group != 0)
    throw std::invalid_argument("qgroup_shard_bounds: I = " + std::to_string(I) +
                                " is not a positive multiple of the group " +
                                std::to_string(group));
  const int64_t units = I / group;
  if (shards < 1) shards = 1;
  if (shards > units) shards = int(units);
  std::vector<int64_t> b;
  for (int s = 0; s <= shards; ++s) b.push_back(units * s / shards * group);
  return b;
}

}  // namespace ktjit::formats
