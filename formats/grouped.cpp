// Packing of k-group scaled integer matrices (formats/grouped.hpp) into the qgroup strips.
#include "formats/grouped.hpp"

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace ktjit::formats {

void check_grouped_spec(const GroupedSpec& spec, const std::string& what) {
  if (spec.group <= 0 || spec.group % 16 != 0)
    throw std::invalid_argument(what + ": group must be a positive multiple of 16, got " +
                                std::to_string(spec.group));
  if (spec.code_bits != 8 && spec.code_bits != 4)
    throw std::invalid_argument(what + ": code_bits must be 8 or 4, got " +
                                std::to_string(spec.code_bits));
  if (spec.code_lo < -128 || spec.code_hi > 127 || spec.code_lo > spec.code_hi)
    throw std::invalid_argument(what + ": code range must lie in [-128, 127] with lo <= hi, got [" +
                                std::to_string(spec.code_lo) + ", " + std::to_string(spec.code_hi) +
                                "]");
}

StripLayout qgroup_layout(int64_t n, int64_t k, int lanes, int strip_vecs, int sources,
                          const GroupedSpec& spec) {
  check_grouped_spec(spec, "qgroup layout");
  if (k <= 0 || k % spec.group != 0)
    throw std::invalid_argument("qgroup layout: K = " + std::to_string(k) +
                                " is not a positive multiple of the group " +
                                std::to_string(spec.group));
  StripLayout l =
      StripLayout::make(n, k, lanes, strip_vecs, sources, spec.code_bits, 4, spec.group / 4);
  l.group_extra = spec.bias ? 8 : 4;
  return l;
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

void pack_qgroup_strips(const StripLayout& l, const GroupedSpec& spec, const GroupedSlice* src,
                        int offset, int8_t* out) {
  const bool nib = spec.code_bits == 4;
  const int64_t G = spec.group;
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
        uint8_t* gb = base + g * group_bytes;
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
        const float sc = x.m->scales[r * gld + g0 + g];
        std::memcpy(gb + code_bytes + j * 4, &sc, 4);
        if (spec.bias) {
          const float bi = x.m->biases ? x.m->biases[r * gld + g0 + g] : 0.0f;
          std::memcpy(gb + code_bytes + (cols + j) * 4, &bi, 4);
        }
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
  for (int64_t g = k0 / G; g < k1 / G; ++g) {
    const uint8_t* gb = packed + l.strip_offset(strip) + g * group_bytes;
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
    std::memcpy(scales + (g - k0 / G), gb + code_bytes + col * 4, 4);
    if (biases) {
      if (spec.bias)
        std::memcpy(biases + (g - k0 / G), gb + code_bytes + (cols + col) * 4, 4);
      else
        biases[g - k0 / G] = 0.0f;
    }
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
