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
        const int8_t* qs[2] = {q[0].data(), q.back().data()};
        const float* ds[2] = {d[0].data(), d.back().data()};
        std::vector<int8_t> out(size_t(l.total_bytes()));
        std::vector<float> sc(size_t(l.total_cols()));
        std::vector<int32_t> comp(size_t(l.total_cols()));
        formats::pack_int8_strips(l, qs, ds, out.data(), sc.data(), comp.data(), false);
        int64_t seen = 0, col = 0;
        for (int64_t strip = 0; strip <= l.full_strips; ++strip) {
          const int vecs = strip < l.full_strips ? l.strip_vecs : l.tail_vecs;
          const int cols = l.strip_cols(vecs);
          for (int j = 0; j < cols; ++j, ++col) {
            int src;
            int64_t row;
            formats::packed_column_source(l, col, &src, &row);
            int32_t sum = 0;
            for (int64_t kk = 0; kk < l.padded_k(); ++kk) {
              const int8_t b =
                  out[size_t(l.strip_offset(strip) + ((kk / 4) * cols + j) * 4 + kk % 4)];
              const int8_t want = (row >= 0 && kk < k) ? q[size_t(src)][size_t(row * k + kk)] : 0;
              ASSERT_EQ(b, want) << "n=" << n << " k=" << k << " col=" << col;
              sum += b;
            }
            EXPECT_EQ(comp[size_t(col)], 128 * sum);
            EXPECT_EQ(sc[size_t(col)], row >= 0 ? d[size_t(src)][size_t(row)] : 0.0f);
            if (row >= 0) ++seen;
          }
        }
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
          const int8_t* qs[2] = {q[0].data(), q.back().data()};
          const float* ds[2] = {d[0].data(), d.back().data()};
          std::vector<int8_t> out(size_t(l.total_bytes()));
          std::vector<float> sc(size_t(l.total_cols()));
          std::vector<int32_t> comp(size_t(l.total_cols()));
          formats::pack_int8_strips(l, qs, ds, out.data(), sc.data(), comp.data(), offset);
          int64_t col = 0;
          for (int64_t strip = 0; strip < l.num_strips(); ++strip) {
            const int vecs = strip < l.full_strips ? l.strip_vecs : l.tail_vecs;
            const int cols = l.strip_cols(vecs);
            for (int j = 0; j < cols; ++j, ++col) {
              int src;
              int64_t row;
              formats::packed_column_source(l, col, &src, &row);
              for (int64_t kk = 0; kk < l.padded_k(); ++kk) {
                const int64_t step = kk / 4;  // steps 2p, 2p + 1 share a byte block
                const uint8_t b = uint8_t(
                    out[size_t(l.strip_offset(strip) + ((step / 2) * cols + j) * 4 + kk % 4)]);
                const int nib = step % 2 ? b >> 4 : b & 15;
                const int q4 = offset ? nib - 8 : (nib ^ 8) - 8;
                const int want =
                    (row >= 0 && kk < k) ? q[size_t(src)][size_t(row * k + kk)] / 16 : 0;
                ASSERT_EQ(q4, want) << "offset=" << offset << " n=" << n << " k=" << k
                                    << " col=" << col << " k=" << kk;
              }
            }
          }
        }
  auto l8 = formats::StripLayout::make(4, 8, 8, 4, 1, 8);
  std::vector<int8_t> q8(32, 0), out(size_t(l8.total_bytes()));
  std::vector<float> d8(4, 1.0f), sc(size_t(l8.total_cols()));
  std::vector<int32_t> comp(size_t(l8.total_cols()));
  const int8_t* qs[1] = {q8.data()};
  const float* ds[1] = {d8.data()};
  EXPECT_THROW(formats::pack_int8_strips(l8, qs, ds, out.data(), sc.data(), comp.data(), true),
               std::invalid_argument);
}

}  // namespace
}  // namespace ktjit
