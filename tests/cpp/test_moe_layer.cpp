// The executor against the same executor on reference kernels (bit for bit), and its invariants:
// thread-count independence, run-to-run determinism, skipped ids.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>

#include "kernel_exec.hpp"
#include "runtime/moe_layer.hpp"
#include "test_util.hpp"

namespace ktjit {
namespace {

struct Case {
  MoEShape shape;
  int64_t T;
};

struct Data {
  std::vector<float> gate, up, down, x, w;
  std::vector<int64_t> ids;
  std::vector<uint8_t> mask;
};

Data make_data(const Case& c, uint32_t seed) {
  const auto& s = c.shape;
  Data d;
  d.gate = test::random_floats(size_t(s.experts * s.intermediate * s.hidden), seed, 0.05f);
  d.up = test::random_floats(d.gate.size(), seed + 1, 0.05f);
  d.down = test::random_floats(size_t(s.experts * s.hidden * s.intermediate), seed + 2, 0.05f);
  d.x = test::random_floats(size_t(c.T * s.hidden), seed + 3, 1.0f);
  d.w = test::random_floats(size_t(c.T * s.top_k), seed + 4, 0.3f);
  std::mt19937 rng(seed + 5);
  for (int64_t t = 0; t < c.T; ++t)
    for (int64_t j = 0; j < s.top_k; ++j) {
      int64_t e = int64_t(rng() % uint32_t(s.experts));
      if (rng() % 9 == 0) e = -1;  // skipped slot
      if (rng() % 13 == 0) e = s.experts + 3;
      d.ids.push_back(e);
    }
  d.mask.assign(size_t(s.experts), 0);
  d.mask[1] = 1;  // an expert that lives on the GPU
  return d;
}

std::vector<float> run(MoELayer& layer, const Case& c, const Data& d, ThreadPool& pool, bool ref) {
  std::vector<float> out(size_t(c.T * c.shape.hidden), -1.0f);
  layer.forward(c.T, d.x.data(), d.ids.data(), d.w.data(),
                reinterpret_cast<const bool*>(d.mask.data()), out.data(), pool, ref);
  return out;
}

TEST(MoELayer, GeneratedMatchesReferenceAndIsDeterministic) {
  const Case cases[] = {{{16, 4, 576, 352}, 1},
                        {{16, 4, 576, 352}, 3},
                        {{16, 4, 576, 352}, 64},
                        {{8, 2, 100, 40}, 17},
                        {{4, 3, 64, 24}, 300}};
  ThreadPool p1(1, 1), p2(2, 1);
  if (test::runnable_levels().empty()) GTEST_SKIP() << "this CPU runs no generated x86 level";
  uint32_t seed = 10;
  for (IsaLevel isa : test::kernel_test_levels()) {
    test::InterpretedExecutor interpret(isa);  // levels this CPU lacks: kernels interpreted
    for (const Case& c : cases) {
      Data d = make_data(c, seed++);
      const char* method = seed % 3 == 0 ? "BF16" : seed % 3 == 1 ? "AMXINT8" : "AMXINT4";
      MoELayer layer(c.shape, method, isa);
      layer.load_from_float(d.gate.data(), d.up.data(), d.down.data(), SourceDType::f32, nullptr,
                            p2);
      auto ref = run(layer, c, d, p1, true);
      auto a = run(layer, c, d, p1, false);
      auto b = run(layer, c, d, p2, false);
      auto again = run(layer, c, d, p2, false);
      const std::string where = std::string(method) + " " + isa_name(isa) +
                                " T=" + std::to_string(c.T) +
                                " H=" + std::to_string(c.shape.hidden);
      ASSERT_EQ(0, std::memcmp(a.data(), ref.data(), a.size() * 4)) << where;
      ASSERT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4)) << "1 vs 2 threads " << where;
      ASSERT_EQ(0, std::memcmp(b.data(), again.data(), b.size() * 4)) << "run to run " << where;
      ASSERT_EQ(test::InterpretedExecutor::errors(), "") << where;
    }
  }
}

// BF16 at avx512_bf16: experts with >= 5 rows run the vdpbf16ps pair kernels on all their rows
// (whole 6-row blocks, then the rows left as the call's short tile, GemmArgs::m_tail); the layer
// equals its twin bit for bit, with 1 and 2 threads, and differs from the fp32-activation kernels
// of avx512_vnni exactly when some expert is that long.
TEST(MoELayer, Bf16PairTierMatchesReferenceAndRunsTheLastRows) {
  // Natively where the CPU has AVX512-BF16, else through the x86-64 interpreter.
  const bool native = selected_isa() == IsaLevel::avx512_bf16 || selected_isa() == IsaLevel::amx;
  if (!native && !(test::emulated_level(IsaLevel::avx512_bf16) && test::interpreter_enabled()))
    GTEST_SKIP() << "this CPU (or KT_JIT_ISA) lacks AVX512-BF16, and the x86-64 interpreter is "
                    "off (KT_JIT_TEST_INTERPRET=0) or not on this architecture";
  test::InterpretedExecutor interpret(IsaLevel::avx512_bf16);
  const Case cases[] = {{{16, 4, 576, 352}, 64},  // ~16 rows an expert: 2 blocks and a tail
                        {{4, 3, 64, 24}, 301},    // ~226 rows
                        {{8, 2, 100, 40}, 3},     // 1-4 rows: fp32 kernels only
                        {{8, 2, 100, 40}, 17}};   // ~4 rows, some experts 5 or 6
  ThreadPool p1(1, 1), p2(2, 1);
  uint32_t seed = 700;
  for (const Case& c : cases) {
    Data d = make_data(c, seed++);
    MoELayer layer(c.shape, "BF16", IsaLevel::avx512_bf16);
    MoELayer fp32(c.shape, "BF16", IsaLevel::avx512_vnni);
    for (MoELayer* l : {&layer, &fp32})
      l->load_from_float(d.gate.data(), d.up.data(), d.down.data(), SourceDType::f32, nullptr, p2);
    const auto ref = run(layer, c, d, p1, true);
    const auto a = run(layer, c, d, p1, false);
    const auto b = run(layer, c, d, p2, false);
    const auto f = run(fp32, c, d, p1, false);
    const std::string where = "T=" + std::to_string(c.T) + " H=" + std::to_string(c.shape.hidden);
    ASSERT_EQ(0, std::memcmp(a.data(), ref.data(), a.size() * 4)) << where;
    ASSERT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4)) << "1 vs 2 threads " << where;
    std::vector<int> rows(size_t(c.shape.experts), 0);
    for (int64_t e : d.ids)
      if (e >= 0 && e < c.shape.experts && !d.mask[size_t(e)]) ++rows[size_t(e)];
    const bool long_experts = *std::max_element(rows.begin(), rows.end()) >= 5;
    EXPECT_EQ(long_experts, std::memcmp(a.data(), f.data(), a.size() * 4) != 0) << where;
    ASSERT_EQ(test::InterpretedExecutor::errors(), "") << where;
  }
}

// The tile tier's split of an expert's rows: the BF16 pair tiles of avx512_bf16 (12 rows over
// 2-vector strips) run up to 12 rows as one tile and 13-23 rows after their blocks as two halves
// (as the kernels' own tests run them), the fp8 pair tiles keep a 1-row tail, and AMX's 16-row
// BF16 tiles pad their last block. (Keys only: runs anywhere.)
TEST(MoELayer, TileTierSplitsAsThePrefillKernelsDo) {
  const GemmKernelSet bf16 =
      make_gemm_kernel_set(IsaLevel::avx512_bf16, WeightFormat::bf16, Epilogue::siluup, 0);
  ASSERT_EQ(bf16.tile_rows, 12);
  const struct {
    int64_t rows, blocks, tail;
  } cases[] = {{5, 0, 5},   {11, 0, 11}, {12, 1, 0},  {13, 0, 13}, {16, 0, 16},
               {23, 0, 23}, {24, 2, 0},  {25, 1, 13}, {30, 1, 18}, {37, 2, 13}};
  for (const auto& c : cases) {
    const PrefillSplit sp = tile_tier_split(bf16, c.rows, true);
    EXPECT_EQ(sp.blocks, c.blocks) << c.rows << " rows";
    EXPECT_EQ(sp.tail, c.tail) << c.rows << " rows";
  }
  const GemmKernelSet fp8 = make_gemm_kernel_set(IsaLevel::avx512_bf16, WeightFormat::fp8,
                                                 Epilogue::siluup, kStripVecs, 0, true);
  const PrefillSplit f = tile_tier_split(fp8, 13, true);
  EXPECT_EQ(f.blocks, 2);
  EXPECT_EQ(f.tail, 1);
  const GemmKernelSet amx =
      make_gemm_kernel_set(IsaLevel::amx, WeightFormat::bf16, Epilogue::siluup, kStripVecs);
  const PrefillSplit a = tile_tier_split(amx, 17, true);
  EXPECT_EQ(a.blocks, 2);
  EXPECT_EQ(a.tail, 0);
}

// BF16 at neon_bf16: experts with >= 6 rows run the bfdot pair kernels on all their rows (the
// last 6-row block padded); the layer equals its twin (gemm_ref's bfdot_lane) bit for bit, with 1
// and 2 threads, and differs from the fp32-activation kernels of neon_dotprod exactly when some
// expert is that long.
TEST(MoELayer, NeonBf16PairTierMatchesReferenceAndPadsTheLastBlock) {
#if !defined(__aarch64__)
  GTEST_SKIP() << "runs generated AArch64 code: an AArch64 host or qemu-aarch64 "
                  "(tests/emu/run_aarch64.sh)";
#else
  if (selected_isa() != IsaLevel::neon_bf16)
    GTEST_SKIP() << "this CPU (or KT_JIT_ISA) lacks BF16 (HWCAP2_BF16): the bfdot tier needs "
                    "neon_bf16, selected "
                 << isa_name(selected_isa()) << " (qemu-aarch64 -cpu max has it)";
  const Case cases[] = {{{16, 4, 96, 40}, 40},  // ~10 rows an expert: 2 blocks, padded
                        {{4, 3, 64, 24}, 41},   // ~30 rows
                        {{16, 2, 100, 44}, 9},  // ~1 row: fp32 kernels only
                        {{6, 2, 36, 20}, 18}};  // 2 experts of exactly 6 rows (one block,
                                                // no padding), the others 0..4 rows: fp32
  ThreadPool p1(1, 1), p2(2, 1);
  uint32_t seed = 800;
  int long_cases = 0, short_cases = 0;
  for (const Case& c : cases) {
    Data d = make_data(c, seed++);
    MoELayer layer(c.shape, "BF16", IsaLevel::neon_bf16);
    MoELayer fp32(c.shape, "BF16", IsaLevel::neon_dotprod);
    bool has_tier = false;
    for (const std::string& n : layer.kernel_names())
      has_tier = has_tier || n.find("_neonbf16_m6n16_siluup_dpbf16") != std::string::npos;
    EXPECT_TRUE(has_tier) << "no bfdot tile kernel in the layer";
    for (MoELayer* l : {&layer, &fp32})
      l->load_from_float(d.gate.data(), d.up.data(), d.down.data(), SourceDType::f32, nullptr, p2);
    const auto ref = run(layer, c, d, p1, true);
    const auto a = run(layer, c, d, p1, false);
    const auto b = run(layer, c, d, p2, false);
    const auto f = run(fp32, c, d, p1, false);
    // The longest expert the layer runs (valid ids, not on the GPU).
    std::vector<int64_t> rows(size_t(c.shape.experts), 0);
    for (int64_t e : d.ids)
      if (e >= 0 && e < c.shape.experts && !d.mask[size_t(e)]) ++rows[size_t(e)];
    const int64_t longest = *std::max_element(rows.begin(), rows.end());
    const std::string where = "T=" + std::to_string(c.T) + " H=" + std::to_string(c.shape.hidden) +
                              " longest expert " + std::to_string(longest);
    ASSERT_EQ(0, std::memcmp(a.data(), ref.data(), a.size() * 4)) << where;
    ASSERT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4)) << "1 vs 2 threads " << where;
    EXPECT_EQ(longest >= 6, std::memcmp(a.data(), f.data(), a.size() * 4) != 0) << where;
    // bf16 activations cost about 2^-9 relative per activation, not more.
    double num = 0, den = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      num += std::fabs(double(a[i]) - f[i]);
      den += std::fabs(double(f[i]));
    }
    EXPECT_LT(num, 1e-2 * den) << where;
    std::printf("a64: bfdot tier: %s, relative L1 against the fp32 kernels %.2e\n", where.c_str(),
                num / den);
    (longest >= 6 ? long_cases : short_cases)++;
  }
  EXPECT_GE(long_cases, 2);
  EXPECT_GE(short_cases, 1);
#endif
}

TEST(MoELayer, AllSlotsSkippedGivesZero) {
  Case c{{8, 2, 64, 32}, 3};
  Data d = make_data(c, 99);
  for (auto& e : d.ids) e = -1;
  ThreadPool p(1, 1);
  MoELayer layer(c.shape, "MOE_INT8", selected_isa());
  layer.load_from_float(d.gate.data(), d.up.data(), d.down.data(), SourceDType::f32, nullptr, p);
  auto out = run(layer, c, d, p, false);
  for (float v : out) ASSERT_EQ(v, 0.0f);
}

TEST(MoELayer, RejectsUnbuiltMethodAndBadMap) {
  EXPECT_THROW(MoELayer({8, 2, 64, 32}, "NOT_A_METHOD", IsaLevel::ref), std::invalid_argument);
  MoELayer layer({2, 1, 8, 8}, "AMXINT8", IsaLevel::ref);
  std::vector<float> g(2 * 8 * 8, 0.1f);
  int64_t map[2] = {0, 5};
  ThreadPool p(1, 1);
  EXPECT_THROW(layer.load_from_float(g.data(), g.data(), g.data(), SourceDType::f32, map, p),
               std::invalid_argument);
  std::vector<float> x(8), out(8);
  int64_t ids[1] = {0};
  float w[1] = {1};
  EXPECT_THROW(layer.forward(1, x.data(), ids, w, nullptr, out.data(), p), std::runtime_error);
}

}  // namespace
}  // namespace ktjit

namespace ktjit {
namespace {

TEST(MoELayer, UnevenShardsMatchReferenceAndOneShard) {
  // Shards of different widths have different tail strips, so different kernels.
  const Case c{{6, 2, 160, 88}, 9};
  if (test::runnable_levels().empty()) GTEST_SKIP() << "this CPU runs no generated x86 level";
  ThreadPool p(2, 1);
  for (IsaLevel isa : test::runnable_levels()) {
    Data d = make_data(c, 77);
    MoELayer one(c.shape, "BF16", isa);
    MoELayer three(c.shape, "BF16", isa, std::vector<int64_t>{0, 16, 56, 88});
    for (MoELayer* l : {&one, &three})
      l->load_from_float(d.gate.data(), d.up.data(), d.down.data(), SourceDType::f32, nullptr, p);
    auto a = run(one, c, d, p, false);
    auto b = run(three, c, d, p, false);
    auto r = run(three, c, d, p, true);
    ASSERT_EQ(0, std::memcmp(b.data(), r.data(), b.size() * 4)) << isa_name(isa);
    float amax = 0;
    for (float v : a) amax = std::max(amax, std::fabs(v));
    for (size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], b[i], 1e-5f * amax) << i;
  }
  EXPECT_THROW(MoELayer(c.shape, "BF16", IsaLevel::ref, std::vector<int64_t>{0, 40, 30, 88}),
               std::invalid_argument);
}

TEST(MoELayer, LayersShareTheForwardScratchSafely) {
  // Every layer's forward takes one per-process scratch in turn (moe_layer.cpp shared_scratch):
  // two layers of different shapes and methods on their own pools, run from two threads at once
  // and interleaved at different T, give the bits each gives alone.
  if (test::runnable_levels().empty()) GTEST_SKIP() << "this CPU runs no generated x86 level";
  const IsaLevel isa = test::runnable_levels().back();
  const Case ca{{16, 4, 576, 352}, 300}, cb{{12, 2, 448, 256}, 200};
  ThreadPool pa(1, 1), pb(1, 1);
  const Data da = make_data(ca, 5), db = make_data(cb, 6);
  MoELayer la(ca.shape, "AMXINT8", isa), lb(cb.shape, "BF16", isa);
  la.load_from_float(da.gate.data(), da.up.data(), da.down.data(), SourceDType::f32, nullptr, pa);
  lb.load_from_float(db.gate.data(), db.up.data(), db.down.data(), SourceDType::f32, nullptr, pb);
  const std::vector<float> wa = run(la, ca, da, pa, false), wb = run(lb, cb, db, pb, false);
  std::atomic<int> bad{0};
  // 60 rounds natively made the race a certain segfault without the scratch mutex; under qemu
  // (the AArch64 suite) a few rounds keep the suite short (60 took 130-210 s there).
#if defined(__aarch64__)
  constexpr int kRounds = 3;
#else
  constexpr int kRounds = 60;
#endif
  auto loop = [&](MoELayer& l, const Case& c, const Data& d, ThreadPool& p,
                  const std::vector<float>& want) {
    for (int i = 0; i < kRounds; ++i)
      if (run(l, c, d, p, false) != want) ++bad;
  };
  std::thread ta(loop, std::ref(la), std::cref(ca), std::cref(da), std::ref(pa), std::cref(wa));
  std::thread tb(loop, std::ref(lb), std::cref(cb), std::cref(db), std::ref(pb), std::cref(wb));
  ta.join();
  tb.join();
  EXPECT_EQ(bad.load(), 0) << isa_name(isa);
}

}  // namespace
}  // namespace ktjit
