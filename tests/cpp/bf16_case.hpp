// The data of one bf16-pair kernel problem (AMX-BF16 and vdpbf16ps tests): random weights packed
// as x86 bf16 strips (k pairs), bf16 activation rows, routing weights and a random output buffer
// whose rows the caller scatters.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "formats/convert.hpp"
#include "formats/int8.hpp"
#include "jit/gemm.hpp"
#include "test_util.hpp"

namespace ktjit::test {

struct Bf16Case {
  formats::StripLayout l;
  std::vector<std::vector<float>> wf;  // per source, N x K, before rounding to bf16
  std::vector<uint16_t> w;             // packed strips
  std::vector<float> scale;
  std::vector<int32_t> comp;
  int64_t lda = 0;              // bytes between activation rows
  std::vector<uint16_t> a;      // M rows of bf16 activations
  std::vector<float> ones, rw;  // a_scale (unused by bf16) and routing weights
  int64_t stride = 0;           // floats between output rows
  std::vector<float> out;       // M rows of random initial outputs
};

inline Bf16Case make_bf16_case(Epilogue epi, int64_t M, int64_t N, int64_t K, uint32_t seed,
                               int strip_vecs = kStripVecs) {
  Bf16Case c;
  const int sources = epi == Epilogue::siluup ? 2 : 1;
  c.l = formats::StripLayout::make(N, K, 16, strip_vecs, sources, 16, 2);  // x86: k pairs
  for (int s = 0; s < sources; ++s)
    c.wf.push_back(random_floats(size_t(N * K), seed + 10 * uint32_t(s), 0.5f));
  const float* ws[2] = {c.wf[0].data(), c.wf.back().data()};
  c.w.resize(size_t(c.l.total_bytes() / 2));
  c.scale.resize(size_t(c.l.total_cols()));
  c.comp.resize(size_t(c.l.total_cols()));
  formats::pack_bf16_strips(c.l, ws, c.w.data(), c.scale.data(), c.comp.data());
  c.lda = K * 2 + 64;
  c.a.resize(size_t(M * c.lda / 2));
  const std::vector<float> af = random_floats(c.a.size(), seed + 1, 2.0f);
  for (size_t i = 0; i < c.a.size(); ++i) c.a[i] = formats::f32_to_bf16(af[i]);
  c.ones.assign(size_t(M), 1.0f);
  c.rw = random_floats(size_t(M), seed + 3, 1.0f);
  c.stride = c.l.total_cols() + 16;
  c.out = random_floats(size_t(M * c.stride), seed + 4, 0.5f);
  return c;
}

// Row m of the activations times column n of source 0's bf16-rounded weights in float64, and
// sum |a w| over k (the scale of the fp32 rounding bound).
inline double bf16_dot64(const Bf16Case& c, int64_t m, int64_t n, int64_t K, double* mag) {
  double dot = 0;
  *mag = 0;
  for (int64_t k = 0; k < K; ++k) {
    const double x = formats::bf16_to_f32(c.a[size_t(m * c.lda / 2 + k)]);
    const double y = formats::bf16_to_f32(formats::f32_to_bf16(c.wf[0][size_t(n * K + k)]));
    dot += x * y;
    *mag += std::fabs(x * y);
  }
  return dot;
}

}  // namespace ktjit::test
