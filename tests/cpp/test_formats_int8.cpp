#include <gtest/gtest.h>

#include <cmath>

#include "formats/int8.hpp"
#include "test_util.hpp"

namespace ktjit {
namespace {

TEST(FormatInt8, QuantizeMatchesNaiveRoundHalfEven) {
  for (uint32_t seed = 0; seed < 50; ++seed) {
    std::vector<float> x = test::random_floats(257, seed, seed % 2 ? 1e-3f : 10.0f);
    if (seed % 5 == 0)  // exact halves after scaling: amax = 127 gives d = 1
      for (size_t i = 0; i < x.size(); ++i)
        x[i] = float(int(i % 255) - 127) + (i % 3 ? 0.5f : 0.0f);
    std::vector<int8_t> q(x.size());
    const float d = formats::quantize_row_int8(x.data(), int64_t(x.size()), q.data());
    float amax = 0;
    for (float v : x) amax = std::fmax(amax, std::fabs(v));
    ASSERT_EQ(d, amax / 127.0f);
    const float id = 1.0f / d;
    for (size_t i = 0; i < x.size(); ++i) {
      const float want = std::fmin(127.0f, std::fmax(-127.0f, std::nearbyint(x[i] * id)));
      ASSERT_EQ(int(q[i]), int(want)) << "seed " << seed << " i " << i << " x " << x[i];
    }
  }
  std::vector<float> zeros(10, 0.0f);
  std::vector<int8_t> q(10, 5);
  EXPECT_EQ(formats::quantize_row_int8(zeros.data(), 10, q.data()), 0.0f);
  for (int8_t v : q) EXPECT_EQ(v, 0);
}

// Packs `q` / `d` (one or two sources) into fresh buffers the size the layout asks for.
struct Packed {
  std::vector<int8_t> out;
  std::vector<float> sc;
  std::vector<int32_t> comp;
};
Packed pack(const formats::StripLayout& l, const std::vector<std::vector<int8_t>>& q,
            const std::vector<std::vector<float>>& d, bool offset_nibbles) {
  Packed p{std::vector<int8_t>(size_t(l.total_bytes())), std::vector<float>(size_t(l.total_cols())),
           std::vector<int32_t>(size_t(l.total_cols()))};
  const int8_t* qs[2] = {q[0].data(), q.back().data()};
  const float* ds[2] = {d[0].data(), d.back().data()};
  formats::pack_int8_strips(l, qs, ds, p.out.data(), p.sc.data(), p.comp.data(), offset_nibbles);
  return p;
}

// Calls f(strip's byte offset, strip's columns, column in the strip, packed column, source, row)
// for every packed column in order; row is -1 for padding.
template <class F>
void for_each_packed_column(const formats::StripLayout& l, F f) {
  int64_t col = 0;
  for (int64_t strip = 0; strip < l.num_strips(); ++strip) {
    const int cols = l.strip_cols(strip < l.full_strips ? l.strip_vecs : l.tail_vecs);
    for (int j = 0; j < cols; ++j, ++col) {
      int src;
      int64_t row;
      formats::packed_column_source(l, col, &src, &row);
      f(l.strip_offset(strip), cols, j, col, src, row);
    }
  }
}

TEST(FormatInt8, PackedColumnsRoundTrip) {
  // Every logical (source, row, k) lands at exactly one packed byte, and padding is zero.
  for (int sources : {1, 2})
    for (int64_t n : {1, 15, 16, 33, 70})
      for (int64_t k : {1, 6, 64}) {
        auto l = formats::StripLayout::make(n, k, 16, 4, sources);
        std::vector<std::vector<int8_t>> q(size_t(sources), std::vector<int8_t>(size_t(n * k)));
        std::vector<std::vector<float>> d(static_cast<size_t>(sources),
                                          std::vector<float>(static_cast<size_t>(n)));
        for (int s = 0; s < sources; ++s)
          for (int64_t i = 0; i < n * k; ++i)
            q[size_t(s)][size_t(i)] = int8_t((i * 7 + s * 3) % 251 - 125);
        for (int s = 0; s < sources; ++s)
          for (int64_t i = 0; i < n; ++i) d[size_t(s)][size_t(i)] = float(i + 1 + 100 * s);
        const Packed pk = pack(l, q, d, false);
        int64_t seen = 0;
        for_each_packed_column(
            l, [&](int64_t base, int cols, int j, int64_t col, int src, int64_t row) {
              int32_t sum = 0;
              for (int64_t kk = 0; kk < l.padded_k(); ++kk) {
                const int8_t b = pk.out[size_t(base + ((kk / 4) * cols + j) * 4 + kk % 4)];
                const int8_t want = (row >= 0 && kk < k) ? q[size_t(src)][size_t(row * k + kk)] : 0;
                ASSERT_EQ(b, want) << "n=" << n << " k=" << k << " col=" << col;
                sum += b;
              }
              EXPECT_EQ(pk.comp[size_t(col)], 128 * sum);
              EXPECT_EQ(pk.sc[size_t(col)], row >= 0 ? d[size_t(src)][size_t(row)] : 0.0f);
              if (row >= 0) ++seen;
            });
        EXPECT_EQ(seen, n * sources);
      }
}

// 4-bit strips: every logical (source, row, k) lands in exactly one nibble, holding q4 in two's
// complement or, with offset nibbles (the avx2 / avx512 int4 kernels), the code q4 + 8; padding
// decodes to 0 both ways. An 8-bit layout refuses offset nibbles.
TEST(FormatInt8, Int4NibblesBothForms) {
  for (bool offset : {false, true})
    for (int sources : {1, 2})
      for (int64_t n : {1, 17, 70})
        for (int64_t k : {3, 8, 40}) {
          auto l = formats::StripLayout::make(n, k, 8, 4, sources, 4);
          std::vector<std::vector<int8_t>> q(size_t(sources), std::vector<int8_t>(size_t(n * k)));
          std::vector<std::vector<float>> d(static_cast<size_t>(sources),
                                            std::vector<float>(static_cast<size_t>(n), 1.0f));
          for (int s = 0; s < sources; ++s)
            for (int64_t i = 0; i < n * k; ++i)
              q[size_t(s)][size_t(i)] = int8_t(16 * ((i * 5 + s * 3) % 16 - 8));  // -8 .. 7
          const std::vector<int8_t> out = pack(l, q, d, offset).out;
          for_each_packed_column(l, [&](int64_t base, int cols, int j, int64_t col, int src,
                                        int64_t row) {
            for (int64_t kk = 0; kk < l.padded_k(); ++kk) {
              const int64_t step = kk / 4;  // steps 2p, 2p + 1 share a byte block
              const uint8_t b = uint8_t(out[size_t(base + ((step / 2) * cols + j) * 4 + kk % 4)]);
              const int nib = step % 2 ? b >> 4 : b & 15;
              const int q4 = offset ? nib - 8 : (nib ^ 8) - 8;
              const int want = (row >= 0 && kk < k) ? q[size_t(src)][size_t(row * k + kk)] / 16 : 0;
              ASSERT_EQ(q4, want) << "offset=" << offset << " n=" << n << " k=" << k
                                  << " col=" << col << " kk=" << kk;
            }
          });
        }
  const auto l8 = formats::StripLayout::make(4, 8, 8, 4, 1, 8);
  EXPECT_THROW(pack(l8, {std::vector<int8_t>(32, 0)}, {std::vector<float>(4, 1.0f)}, true),
               std::invalid_argument);
}

}  // namespace
}  // namespace ktjit
