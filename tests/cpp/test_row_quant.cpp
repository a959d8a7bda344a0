// The generated activation quantizers (jit/quantize.hpp) against formats::quantize_row_int8 bit for
// bit: every x86 level natively or in the interpreter, row lengths with and without a tail, round-
// to-even ties, an all-zero row, one large value among small ones, subnormals; and the executor's
// RowQuantizer (kernels plus the C++ tail) on the selected level.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "formats/int8.hpp"
#include "jit/bits.hpp"
#include "jit/kernel.hpp"
#include "jit/quantize.hpp"
#include "runtime/row_quant.hpp"
#include "tests/cpp/kernel_exec.hpp"
#include "tests/cpp/test_util.hpp"

namespace ktjit {
namespace {

// Rows of every kind the tests run, each `n` long.
std::vector<std::vector<float>> rows_of(int64_t n, uint32_t seed) {
  std::vector<std::vector<float>> rows;
  rows.push_back(test::random_floats(size_t(n), seed, 0.7f));
  rows.push_back(std::vector<float>(size_t(n), 0.0f));  // scale 0, id 0
  std::vector<float> ties(static_cast<size_t>(n));      // amax 127: x * id = x, ties at k + 0.5
  for (int64_t i = 0; i < n; ++i) ties[size_t(i)] = float(int((i * 37) % 255) - 127) + 0.5f;
  ties[size_t(n / 2)] = -127.0f;
  for (auto& v : ties) v = std::fmax(-127.0f, std::fmin(127.0f, v));
  rows.push_back(ties);
  std::vector<float> spike = test::random_floats(size_t(n), seed + 1, 1e-3f);
  spike[size_t((seed * 7) % uint32_t(n))] = 3.0e4f;  // most values round to 0
  rows.push_back(spike);
  std::vector<float> tiny(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) tiny[size_t(i)] = (i % 3 ? 1.0f : -1.0f) * 1e-40f * float(i % 7);
  rows.push_back(tiny);  // subnormal inputs
  return rows;
}

const int64_t kLengths[] = {16, 32, 48, 64, 80, 112, 768, 2048, 7168};

#if !defined(__aarch64__)
// Runs the quantize kernel `variant` of `isa` on `args`: natively, or in the interpreter.
void run_quant_kernel(IsaLevel isa, uint16_t variant, const QuantArgs& args) {
  KernelKey key;
  key.kind = KernelKind::quantize;
  key.isa = isa;
  key.format = WeightFormat::int8;
  key.variant = variant;
  const Kernel* k = KernelCache::instance().get(key);
  ASSERT_NE(k, nullptr) << key.name();
  if (test::emulated_level(isa))
    test::emulate_x64(k->code.data(), k->code.size(), &args);
  else
    reinterpret_cast<QuantFn>(const_cast<void*>(k->entry()))(&args);
}
#endif

TEST(RowQuant, KernelsMatchTheCxxQuantizerBitwise) {
#if defined(__aarch64__)
  GTEST_SKIP() << "the quantizer kernels are x86 (AArch64 runs formats::quantize_row_int8)";
#else
  size_t checked = 0;
  for (IsaLevel isa : test::kernel_test_levels()) {
    auto run = [&](uint16_t variant, const QuantArgs& args) {
      run_quant_kernel(isa, variant, args);
    };
    for (int64_t n : kLengths)
      for (const auto& x : rows_of(n, uint32_t(n))) {
        std::vector<int8_t> want(static_cast<size_t>(n));
        const float d = formats::quantize_row_int8(x.data(), n, want.data());
        // amax: the lanes' max is the row's (n is whole blocks here)
        float lanes[16];
        for (auto& v : lanes) v = -1.0f;
        QuantArgs args{x.data(), n / 16, nullptr, lanes, 0.0f};
        run(kQuantAmax, args);
        float amax = 0.0f;
        for (float v : lanes) amax = std::fmax(amax, v);
        ASSERT_EQ(amax / 127.0f, d) << isa_name(isa) << " n=" << n;
        const float id = formats::inverse_scale(d);
        for (bool flip : {false, true}) {
          std::vector<int8_t> q(size_t(n + 16), 0x55);  // bytes after the row stay
          args.q = q.data();
          args.id = id;
          run(flip ? kQuantRoundFlip : kQuantRound, args);
          std::vector<int8_t> w = want;
          if (flip) formats::flip_sign_bits(w.data(), n);
          ASSERT_EQ(std::memcmp(q.data(), w.data(), size_t(n)), 0)
              << isa_name(isa) << " n=" << n << " flip=" << flip;
          for (int64_t i = n; i < n + 16; ++i) ASSERT_EQ(q[size_t(i)], 0x55);
          ++checked;
        }
      }
  }
  EXPECT_GT(checked, 0u);
#endif
}

// Values whose bf16 rounding has an edge: ties to even both ways, just off a tie, the carry into
// the exponent and to infinity, infinities, NaNs (quiet, signalling, with payload bits only in
// the low half), subnormals, zeros of both signs, and random values of every magnitude.
std::vector<float> bf16_edges(int64_t n, uint32_t seed) {
  const uint32_t bits[] = {0x3f808000u, 0x3f818000u, 0x3f808001u, 0x3f807fffu, 0x3fffffffu,
                           0x7f7fffffu, 0xff7fffffu, 0x7f800000u, 0xff800000u, 0x7fc00000u,
                           0x7f800001u, 0xff800001u, 0x7fbfffffu, 0x7f80ffffu, 0x00000001u,
                           0x00008000u, 0x80018000u, 0x007fffffu, 0x00000000u, 0x80000000u};
  std::vector<float> x = test::random_floats(size_t(n), seed, 1.0f);
  std::mt19937 rng(seed);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    if (i % 3 == 0)
      u = bits[size_t(i / 3) % (sizeof(bits) / sizeof(bits[0]))];
    else if (i % 3 == 1)
      u = rng();  // any bit pattern: every exponent, NaNs included
    else
      continue;
    std::memcpy(&x[size_t(i)], &u, 4);
  }
  return x;
}

// The bf16 row converter (kQuantBf16) against formats::f32_to_bf16 bit for bit, every x86 level,
// natively or in the interpreter; the words after the row stay.
TEST(RowQuant, Bf16KernelMatchesTheCxxRoundingBitwise) {
#if defined(__aarch64__)
  GTEST_SKIP() << "the converter kernels are x86 (AArch64 runs formats::f32_to_bf16_row)";
#else
  size_t checked = 0;
  for (IsaLevel isa : test::kernel_test_levels()) {
    for (int64_t n : {16, 32, 48, 256, 2048})
      for (uint32_t seed : {1u, 2u, 3u}) {
        const std::vector<float> x = bf16_edges(n, seed + uint32_t(n));
        std::vector<uint16_t> got(size_t(n + 16), 0x5555);
        QuantArgs args{x.data(), n / 16, reinterpret_cast<int8_t*>(got.data()), nullptr, 0.0f};
        run_quant_kernel(isa, kQuantBf16, args);
        if (HasFatalFailure()) return;
        for (int64_t i = 0; i < n; ++i)
          ASSERT_EQ(got[size_t(i)], formats::f32_to_bf16(x[size_t(i)]))
              << isa_name(isa) << " n=" << n << " i=" << i << " bits=0x" << std::hex
              << f32_to_bits(x[size_t(i)]);
        for (int64_t i = n; i < n + 16; ++i) ASSERT_EQ(got[size_t(i)], 0x5555);
        ++checked;
      }
  }
  EXPECT_GT(checked, 0u);
#endif
}

// The executor's path: the kernels on the whole blocks, C++ on the last n % 16 values (or all of a
// row shorter than a block); the same scale and bytes as formats::quantize_row_int8.
TEST(RowQuant, RowQuantizerMatchesTheCxxQuantizer) {
  const RowQuantizer rq(selected_isa());
#if !defined(__aarch64__)
  EXPECT_EQ(rq.generated(), int(selected_isa()) >= int(IsaLevel::avx2)) << isa_name(selected_isa());
#endif
  for (int64_t n : {1, 15, 16, 17, 33, 100, 768, 2049, 7169})
    for (const auto& x : rows_of(n, uint32_t(n) + 5))
      for (bool flip : {false, true}) {
        std::vector<int8_t> want(static_cast<size_t>(n)), got(static_cast<size_t>(n));
        const float dw = formats::quantize_row_int8(x.data(), n, want.data());
        if (flip) formats::flip_sign_bits(want.data(), n);
        const float dg = rq.quantize(x.data(), n, got.data(), flip);
        ASSERT_EQ(dg, dw) << "n=" << n;
        ASSERT_EQ(std::memcmp(got.data(), want.data(), size_t(n)), 0)
            << "n=" << n << " flip=" << flip;
      }
  for (int64_t n : {1, 15, 16, 17, 33, 100, 768, 2049, 7169}) {
    const std::vector<float> x = bf16_edges(n, uint32_t(n) + 9);
    std::vector<uint16_t> got(static_cast<size_t>(n));
    rq.to_bf16(x.data(), n, got.data());
    for (int64_t i = 0; i < n; ++i)
      ASSERT_EQ(got[size_t(i)], formats::f32_to_bf16(x[size_t(i)])) << "n=" << n << " i=" << i;
  }
}

}  // namespace
}  // namespace ktjit
