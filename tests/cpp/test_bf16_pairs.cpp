// bf16 pair kernels at avx512_bf16 (KernelKey::variant kBf16Pairs, vdpbf16ps): the generated
// kernels against gemm_ref's twin bit for bit (on a CPU with AVX512-BF16), the twin's lane
// function against the SDM pseudo-code's corner cases, and the twin against a float64 dot
// product of the same bf16 values.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "bf16_case.hpp"
#include "formats/convert.hpp"
#include "formats/int8.hpp"
#include "jit/gemm.hpp"
#include "jit/kernel.hpp"
#include "kernel_exec.hpp"
#include "runtime/moe_layer.hpp"
#include "test_util.hpp"

namespace ktjit {
namespace {

uint32_t pair(float lo, float hi) {
  return uint32_t(formats::f32_to_bf16(lo)) | uint32_t(formats::f32_to_bf16(hi)) << 16;
}

TEST(Bf16PairLane, FollowsThePseudoCode) {
  // Two roundings, odd product first: 2^24 + 1 rounds to 2^24 (tie to even), then + 1 again;
  // a fused sum would give 2^24 + 2.
  EXPECT_EQ(vdpbf16ps_lane(0x1p24f, pair(1.0f, 1.0f), pair(1.0f, 1.0f)), 0x1p24f);
  // Odd first: acc = 1, odd product 2^24, even -2^24: (1 + 2^24) rounds to 2^24, then 0; even
  // first would give 1 - 2^24 (exact), then 1.
  EXPECT_EQ(vdpbf16ps_lane(1.0f, pair(-0x1p24f, 0x1p24f), pair(1.0f, 1.0f)), 0.0f);
  // bf16 subnormal inputs read as zero (DAZ), on either operand.
  const float sub = 0x1p-130f;  // a bf16 subnormal (exactly representable)
  EXPECT_EQ(vdpbf16ps_lane(0.0f, pair(sub, 0.0f), pair(0x1p100f, 0.0f)), 0.0f);
  EXPECT_EQ(vdpbf16ps_lane(0.0f, pair(0.0f, 0x1p100f), pair(0.0f, sub)), 0.0f);
  // A subnormal accumulator reads as zero; a subnormal result is flushed to zero.
  EXPECT_EQ(vdpbf16ps_lane(0x1p-127f, pair(0.0f, 0.0f), pair(0.0f, 0.0f)), 0.0f);
  EXPECT_EQ(vdpbf16ps_lane(0.0f, pair(0x1p-64f, 0.0f), pair(0x1p-64f, 0.0f)), 0.0f);
  EXPECT_EQ(vdpbf16ps_lane(0.0f, pair(0x1p-63f, 0.0f), pair(0x1p-63f, 0.0f)), 0x1p-126f);
  // Plain values: 1 * 2 + 3 * 4 + 0.5.
  EXPECT_EQ(vdpbf16ps_lane(0.5f, pair(1.0f, 3.0f), pair(2.0f, 4.0f)), 14.5f);
}

// The row conversion the executor uses for the pair kernels' activations equals the scalar
// f32_to_bf16 (itself checked against torch in the Python suite) on every class of input.
TEST(Bf16PairLane, RowConversionEqualsScalar) {
  std::vector<uint32_t> bits = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u,
                                0x7f800001u, 0xffffffffu, 0x7f7fffffu, 0x3f808000u, 0x3f818000u,
                                0x3f807fffu, 0x00008000u, 0x00018000u, 0x807fffffu};
  uint32_t x = 12345;
  for (int i = 0; i < 100000; ++i) bits.push_back(x = x * 1664525u + 1013904223u);
  std::vector<float> f(bits.size());
  std::memcpy(f.data(), bits.data(), bits.size() * 4);
  std::vector<uint16_t> row(f.size());
  formats::f32_to_bf16_row(f.data(), int64_t(f.size()), row.data());
  for (size_t i = 0; i < f.size(); ++i)
    ASSERT_EQ(row[i], formats::f32_to_bf16(f[i])) << std::hex << bits[i];
}

struct Problem {
  Epilogue epi;
  int64_t M, N, K;
  uint32_t seed;
  std::string repro() const {
    return "epi=" + std::to_string(int(epi)) + " M=" + std::to_string(M) +
           " N=" + std::to_string(N) + " K=" + std::to_string(K) + " seed=" + std::to_string(seed);
  }
};

// One problem the way the executor runs it: full strips, then the tail strip, each over the
// blocks of m_r rows (the pair kernels' tile: 6 over 4-vector strips, kBf16PairRows2v = 12 over
// the 2-vector strips of strip_vecs_for) and the rows left as the call's short tiles
// (GemmArgs::m_tail) that prefill_split gives, out rows scattered. Returns the outputs of the
// generated kernels (run = true) or of the twin.
std::vector<float> run(const Problem& p, bool generated, std::vector<float>* dot_check,
                       int strip_vecs = kStripVecs) {
  test::Bf16Case c = test::make_bf16_case(p.epi, p.M, p.N, p.K, p.seed, strip_vecs);
  std::vector<float*> rows;
  const int64_t step = p.M % 7 ? 7 : 5;  // a permutation: no M here is a multiple of 35
  for (int64_t m = 0; m < p.M; ++m) rows.push_back(c.out.data() + ((m * step) % p.M) * c.stride);
  const int m_r =
      strip_vecs == 2 ? kBf16PairRows2v : gemm_max_rows(IsaLevel::avx512_bf16, WeightFormat::bf16);
  const int full_cols = c.l.strip_cols(c.l.strip_vecs);
  for (int part = 0; part < 2; ++part) {
    const int64_t s0 = part ? c.l.full_strips : 0;
    const int64_t ns = part ? (c.l.tail_vecs ? 1 : 0) : c.l.full_strips;
    if (ns == 0) continue;
    KernelKey key;
    key.kind = KernelKind::gemm_prefill;
    key.isa = IsaLevel::avx512_bf16;
    key.format = WeightFormat::bf16;
    key.m_r = uint8_t(m_r);
    key.n_vec = uint8_t(part ? c.l.tail_vecs : c.l.strip_vecs);
    key.epilogue = p.epi;
    key.variant = kBf16Pairs;
    GemmArgs g{};
    g.a = reinterpret_cast<const int8_t*>(c.a.data());
    g.lda = c.lda;
    g.w = reinterpret_cast<const int8_t*>(c.w.data()) + c.l.strip_offset(s0);
    g.n_strips = ns;
    g.k4 = c.l.k4;
    g.a_scale = c.ones.data();
    g.w_scale = c.scale.data() + s0 * full_cols;
    g.w_comp = c.comp.data() + s0 * full_cols;
    g.out_rows = rows.data();
    g.out_col = s0 * gemm_strip_out_cols(IsaLevel::avx512_bf16, c.l.strip_vecs, p.epi);
    g.row_weight = c.rw.data();
    const PrefillSplit sp = prefill_split(key, p.M);  // (a 1-row tail after blocks: 4 + 3)
    g.m_blocks = sp.blocks;
    g.m_tail = sp.tail;
    g.scratch = nullptr;  // bf16 strips are k pairs already: the kernels read them in place
    if (generated) {
      if (test::run_generated(key, g).empty()) return c.out;
    } else {
      gemm_ref(key, g);
    }
  }
  if (dot_check && p.epi == Epilogue::store) {  // float64 dot products of the same bf16 values
    for (int64_t m = 0; m < p.M; ++m)
      for (int64_t n = 0; n < p.N; ++n) {
        double mag;
        const double dot = test::bf16_dot64(c, m, n, p.K, &mag);
        dot_check->push_back(float(std::fabs(rows[size_t(m)][n] - dot) /
                                   ((double(p.K) + 1) * std::ldexp(1.0, -24) * mag + 1e-30)));
      }
  }
  return c.out;
}

// M % 6 takes every tail size (0 .. 5), M = 5 a call of the tail alone; M = 7, 13 and 19 leave 1
// row after the blocks, which runs with the last block as a 4-row and a 3-row tile
// (prefill_split), M = 7 with no block before them.
const Problem kProblems[] = {
    {Epilogue::store, 6, 64, 2, 1},     {Epilogue::store, 13, 100, 30, 2},
    {Epilogue::store, 18, 64, 128, 3},  {Epilogue::store, 8, 16, 96, 4},
    {Epilogue::siluup, 16, 128, 64, 5}, {Epilogue::siluup, 29, 96, 130, 6},
    {Epilogue::accum, 15, 64, 34, 7},   {Epilogue::accum, 30, 200, 256, 8},
    {Epilogue::accum, 6, 48, 2048, 9},  {Epilogue::store, 36, 256, 512, 10},
    {Epilogue::store, 5, 64, 66, 11},   {Epilogue::store, 7, 64, 128, 12},
    {Epilogue::accum, 19, 128, 96, 13},
};

TEST(Bf16Pairs, TwinIsWithinFp32RoundingOfFloat64) {
  for (const Problem& p : kProblems) {
    std::vector<float> ratio;
    run(p, false, &ratio);
    for (float r : ratio) ASSERT_LE(r, 1.0f) << p.repro();
  }
}

TEST(Bf16Pairs, GeneratedMatchesReferenceBitwise) {
  // Natively where the CPU has AVX512-BF16, in the x86-64 interpreter elsewhere.
  if (test::emulated_level(IsaLevel::avx512_bf16) && !test::interpreter_enabled())
    GTEST_SKIP() << "no AVX512-BF16 here and KT_JIT_TEST_INTERPRET=0";
  std::printf("bf16 pair kernels: %s\n", test::level_how(IsaLevel::avx512_bf16));
  for (const Problem& p : kProblems) {
    const std::vector<float> got = run(p, true, nullptr), want = run(p, false, nullptr);
    ASSERT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * 4))
        << "vdpbf16ps kernels differ from gemm_ref: " << p.repro();
  }
}

// The 12-row tiles over 2-vector strips (strip_vecs_for): every row count from 1 to 40, so every
// tail size after 0-3 blocks and every split of 13-23 rows into two halves, each epilogue.
TEST(Bf16Pairs, TwoVectorStripTilesMatchReferenceBitwise) {
  if (test::emulated_level(IsaLevel::avx512_bf16) && !test::interpreter_enabled())
    GTEST_SKIP() << "no AVX512-BF16 here and KT_JIT_TEST_INTERPRET=0";
  const Epilogue epis[] = {Epilogue::store, Epilogue::siluup, Epilogue::accum};
  for (int64_t M = 1; M <= 40; ++M) {
    if (M == 35) continue;  // (run's row permutation needs M coprime to 7 or 5)
    const Problem p{epis[M % 3], M, M % 2 ? 80 : 64, M % 4 ? 66 : 130, uint32_t(100 + M)};
    const std::vector<float> got = run(p, true, nullptr, 2), want = run(p, false, nullptr, 2);
    ASSERT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * 4))
        << "2-vector strip tiles differ from gemm_ref: " << p.repro();
    if (M % 5 == 0) {  // and the 4-vector tiles give the same bits
      const std::vector<float> four = run(p, false, nullptr);
      ASSERT_EQ(0, std::memcmp(got.data(), four.data(), got.size() * 4)) << p.repro();
    }
  }
}

TEST(Bf16Pairs, KeysAreRefusedOffTheirLevelAndKind) {
  KernelKey k;
  k.kind = KernelKind::gemm_decode;
  k.isa = IsaLevel::avx512_bf16;
  k.format = WeightFormat::bf16;
  k.m_r = 6;
  k.n_vec = 4;
  k.variant = kBf16Pairs;
  EXPECT_THROW(KernelCache::generate_only(k), std::invalid_argument);  // decode
  k.kind = KernelKind::gemm_prefill;
  k.isa = IsaLevel::avx512_vnni;
  EXPECT_THROW(KernelCache::generate_only(k), std::invalid_argument);  // no vdpbf16ps there
  k.isa = IsaLevel::avx512_bf16;
  EXPECT_NE(KernelCache::generate_only(k)->name.find("_dpbf16"), std::string::npos);
  k.variant = 2;
  EXPECT_THROW(KernelCache::generate_only(k), std::invalid_argument);  // unknown bit
}

TEST(Bf16Pairs, Fp8PairKeysAreRefusedOffTheirLevelAndShape) {
  KernelKey k;
  k.kind = KernelKind::gemm_decode;
  k.isa = IsaLevel::avx512_bf16;
  k.format = WeightFormat::fp8;
  k.m_r = 4;
  k.n_vec = 3;
  k.variant = kBf16Pairs;
  EXPECT_NE(KernelCache::generate_only(k)->name.find("_dpbf16"), std::string::npos);
  k.m_r = 5;  // decode pair tiles stop at 4 rows (the group sums take the registers)
  EXPECT_THROW(KernelCache::generate_only(k), std::invalid_argument);
  k.kind = KernelKind::gemm_prefill;
  k.m_r = 6;
  EXPECT_TRUE(scratch_pair_kernel(k));
  EXPECT_NE(KernelCache::generate_only(k)->name.find("_dpbf16"), std::string::npos);
  k.isa = IsaLevel::avx512_vnni;  // no vdpbf16ps or vpermi2b there
  EXPECT_THROW(KernelCache::generate_only(k), std::invalid_argument);
  k.isa = IsaLevel::avx512_bf16;
  k.variant = 2;
  EXPECT_THROW(KernelCache::generate_only(k), std::invalid_argument);  // unknown bit
}

TEST(Bf16Pairs, Fp8AtAvx512Bf16PairsWhenKSplitsIntoPairs) {
  for (IsaLevel isa : {IsaLevel::avx512_bf16, IsaLevel::amx}) {
    const GemmKernelSet ks = make_gemm_kernel_set(isa, WeightFormat::fp8, Epilogue::siluup, 2, 0,
                                                  /*k_pairs=*/true);
    // prefill tiles: vdpbf16ps at avx512_bf16 (6 rows, from 5), AMX-BF16 at amx (16 rows)
    const bool amx = isa == IsaLevel::amx;
    EXPECT_EQ(ks.tile_rows, amx ? 16 : 6) << isa_name(isa);
    EXPECT_EQ(ks.tile_min_rows, amx ? 16 : 5);
    EXPECT_EQ(ks.tile_full.isa, isa);
    EXPECT_TRUE(scratch_pair_kernel(ks.tile_full));
    EXPECT_EQ(tail_rows_kernel(ks.tile_full), !amx);  // AMX pads the last block instead
    EXPECT_FALSE(fp8_pair_kernel(ks.prefill_full));  // fp32 kernels for short experts' blocks
    for (int m = 1; m <= ks.max_rows; ++m) {
      EXPECT_EQ(fp8_pair_kernel(ks.decode_full[size_t(m - 1)]), m <= 4) << m;
      EXPECT_EQ(fp8_pair_kernel(ks.decode_tail[size_t(m - 1)]), m <= 4) << m;
    }
  }
  // An odd K (or scale group) keeps every fp8 kernel on fp32 activations; so do lower levels.
  const GemmKernelSet odd =
      make_gemm_kernel_set(IsaLevel::avx512_bf16, WeightFormat::fp8, Epilogue::accum, 0, 0, false);
  EXPECT_EQ(odd.tile_rows, 0);
  for (const KernelKey& k : odd.keys()) EXPECT_FALSE(fp8_pair_kernel(k)) << k.name();
  for (const KernelKey& k :
       make_gemm_kernel_set(IsaLevel::avx512_vnni, WeightFormat::fp8, Epilogue::accum, 0, 0, true)
           .keys())
    EXPECT_FALSE(fp8_pair_kernel(k)) << k.name();
}

TEST(Bf16Pairs, Bf16AndMxAtAvx512Bf16GetThePairTier) {
  const GemmKernelSet ks =
      make_gemm_kernel_set(IsaLevel::avx512_bf16, WeightFormat::bf16, Epilogue::siluup, 2);
  EXPECT_EQ(ks.tile_rows, kBf16PairRows2v);  // over 2-vector strips (strip_vecs_for)
  EXPECT_EQ(ks.tile_full.n_vec, 2);
  EXPECT_EQ(ks.tile_min_rows, 5);
  EXPECT_EQ(ks.tile_full.variant, kBf16Pairs);
  EXPECT_EQ(ks.tile_full.kind, KernelKind::gemm_prefill);
  EXPECT_EQ(ks.tile_tail.n_vec, 2);
  EXPECT_TRUE(bf16_pair_kernel(ks.tile_full));
  EXPECT_TRUE(tail_rows_kernel(ks.tile_full));  // the rows after the blocks: no padding
  EXPECT_FALSE(tail_rows_kernel(
      make_gemm_kernel_set(IsaLevel::amx, WeightFormat::bf16, Epilogue::siluup, 2).tile_full));
  EXPECT_FALSE(bf16_pair_kernel(ks.prefill_full));  // the fp32 kernels stay for short experts
  for (IsaLevel isa : {IsaLevel::avx2, IsaLevel::avx512, IsaLevel::avx512_vnni})
    EXPECT_EQ(make_gemm_kernel_set(isa, WeightFormat::bf16, Epilogue::accum, 0).tile_rows, 0);
  // int8 has none; fp8 only with K and its groups even (k_pairs, FP8 tests)
  for (WeightFormat f : {WeightFormat::int8, WeightFormat::fp8})
    EXPECT_EQ(make_gemm_kernel_set(IsaLevel::avx512_bf16, f, Epilogue::accum, 0).tile_rows, 0);
  // mx decodes each strip to bf16 pairs (mx_pair_kernel), its SwiGLU bits kept beside kMxPairs
  for (WeightFormat f : {WeightFormat::mxfp4, WeightFormat::mxfp8}) {
    const GemmKernelSet mx = make_gemm_kernel_set(IsaLevel::avx512_bf16, f, Epilogue::siluup, 2,
                                                  kSwigluClamp | kSwigluAlpha);
    EXPECT_EQ(mx.tile_rows, 6);
    EXPECT_EQ(mx.tile_min_rows, 5);
    EXPECT_EQ(mx.tile_full.variant, kMxPairs | kSwigluClamp | kSwigluAlpha);
    EXPECT_TRUE(mx_pair_kernel(mx.tile_tail));
    EXPECT_TRUE(tail_rows_kernel(mx.tile_full));
    EXPECT_EQ(gemm_scratch_bytes(mx.tile_full, 64), 64 * 64 * 2);  // K 64 x 64 columns of bf16
    EXPECT_FALSE(mx_pair_kernel(mx.prefill_full));
    // isa amx keeps its AMX-BF16 tiles; the levels below avx512_bf16 their strip-scratch ones
    EXPECT_FALSE(
        mx_pair_kernel(make_gemm_kernel_set(IsaLevel::amx, f, Epilogue::accum, 0).tile_full));
    EXPECT_FALSE(mx_pair_kernel(
        make_gemm_kernel_set(IsaLevel::avx512_vnni, f, Epilogue::accum, 0).tile_full));
  }
}

}  // namespace
}  // namespace ktjit
