// AArch64: the HWCAP probe and the NEON GEMM generator (jit/aarch64/gemm_a64.cpp).
// On an AArch64 build (natively or under qemu-aarch64, tests/emu/run_aarch64.sh) every generated
// NEON kernel at every level the CPU runs is checked against gemm_ref bit for bit, over small
// tail-heavy shapes (emulation is 30-700x slower). On x86-64 the generator still runs (it is what
// kt-jit-dump --isa neon prints), so generation and the refusals are checked there too.
//   KT_JIT_EXPECT_ISA=<level>  A64Cpu.SelectedLevelIsExpected fails unless that level is selected
//                              (the qemu run asserts neon_bf16 under -cpu max, neon under
//                              -cpu cortex-a72).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <utility>

#include "formats/int8.hpp"
#include "jit/gemm.hpp"
#include "jit/kernel.hpp"
#include "test_util.hpp"

namespace ktjit {
namespace {

const IsaLevel kNeonLevels[] = {IsaLevel::neon, IsaLevel::neon_dotprod, IsaLevel::neon_bf16};

KernelKey a64_key(IsaLevel isa, KernelKind kind, int m_r, int n_vec, Epilogue epi,
                  WeightFormat fmt) {
  KernelKey k;
  k.kind = kind;
  k.isa = isa;
  k.format = fmt;
  k.m_r = uint8_t(m_r);
  k.n_vec = uint8_t(n_vec);
  k.epilogue = epi;
  return k;
}

// ---- probe ----------------------------------------------------------------------------------

TEST(A64Cpu, NeonLevelsFollowTheHwcaps) {
  CpuFeatures f;
  f.aarch64 = true;
  f.asimd = true;
  EXPECT_TRUE(level_usable(IsaLevel::neon, f));
  EXPECT_FALSE(level_usable(IsaLevel::neon_dotprod, f));
  EXPECT_FALSE(level_usable(IsaLevel::avx2, f));  // never the other architecture's levels
  f.asimd_dp = true;
  EXPECT_TRUE(level_usable(IsaLevel::neon_dotprod, f));
  EXPECT_FALSE(level_usable(IsaLevel::neon_bf16, f));
  auto missing = missing_for(IsaLevel::neon_bf16, f);
  ASSERT_EQ(missing.size(), 1u);
  EXPECT_NE(missing[0].find("HWCAP2_BF16"), std::string::npos);
  f.arm_bf16 = true;
  EXPECT_TRUE(level_usable(IsaLevel::neon_bf16, f));
  CpuFeatures x86;  // an x86 CPU with everything: still no NEON level
  x86.avx2 = x86.fma = x86.f16c = x86.os_avx = true;
  EXPECT_TRUE(level_usable(IsaLevel::avx2, x86));
  EXPECT_FALSE(level_usable(IsaLevel::neon, x86));
  EXPECT_EQ(parse_isa("neon_dotprod"), IsaLevel::neon_dotprod);
  EXPECT_STREQ(isa_tag(IsaLevel::neon_dotprod), "neondot");
}

TEST(A64Cpu, ProbeMatchesThisArchitecture) {
  const CpuFeatures& f = cpu_features();
#if defined(__aarch64__)
  EXPECT_TRUE(f.aarch64);
  EXPECT_TRUE(f.asimd) << "every AArch64 Linux CPU has Advanced SIMD";
  const IsaLevel want = f.asimd_dp && f.arm_bf16 ? IsaLevel::neon_bf16
                        : f.asimd_dp             ? IsaLevel::neon_dotprod
                                                 : IsaLevel::neon;
  EXPECT_EQ(detected_isa(), want);
  std::printf("a64: hwcap 0x%llx hwcap2 0x%llx asimddp %d bf16 %d detected %s\n",
              (unsigned long long)f.hwcap, (unsigned long long)f.hwcap2, int(f.asimd_dp),
              int(f.arm_bf16), isa_name(detected_isa()));
#else
  EXPECT_FALSE(f.aarch64);
  EXPECT_FALSE(isa_is_neon(detected_isa()));
  EXPECT_FALSE(level_usable(IsaLevel::neon, f));
#endif
}

TEST(A64Cpu, SelectedLevelIsExpected) {
  const char* want = std::getenv("KT_JIT_EXPECT_ISA");
  std::printf("a64: selected isa %s\n", isa_name(selected_isa()));
  if (!want || !*want)
    GTEST_SKIP() << "KT_JIT_EXPECT_ISA not set (tests/emu/run_aarch64.sh sets it)";
  EXPECT_STREQ(isa_name(selected_isa()), want);
}

// ---- generation (any host) ------------------------------------------------------------------

TEST(A64Gemm, GeneratesEveryNeonKernelOnAnyHost) {
  size_t kernels = 0;
  for (IsaLevel isa : kNeonLevels)
    for (WeightFormat fmt :
         {WeightFormat::int8, WeightFormat::int4, WeightFormat::bf16, WeightFormat::fp8})
      for (Epilogue epi : {Epilogue::store, Epilogue::siluup, Epilogue::accum})
        for (KernelKind kind : {KernelKind::gemm_decode, KernelKind::gemm_prefill})
          for (int nv = 1; nv <= kStripVecs; ++nv) {
            if (epi == Epilogue::siluup && nv % 2) continue;
            for (int m = 1; m <= gemm_max_rows(isa, fmt); ++m) {
              auto k = KernelCache::generate_only(a64_key(isa, kind, m, nv, epi, fmt));
              ASSERT_GT(k->code.size(), 64u) << k->name;
              ASSERT_EQ(k->code.size() % 4, 0u) << k->name;
              ASSERT_NE(k->name.find(isa_tag(isa)), std::string::npos) << k->name;
              ++kernels;
            }
          }
  // The bfdot pair kernels: bf16 prefill at neon_bf16, every tile.
  for (Epilogue epi : {Epilogue::store, Epilogue::siluup, Epilogue::accum})
    for (int nv = 1; nv <= kStripVecs; ++nv) {
      if (epi == Epilogue::siluup && nv % 2) continue;
      for (int m = 1; m <= gemm_max_rows(IsaLevel::neon_bf16, WeightFormat::bf16); ++m) {
        KernelKey key =
            a64_key(IsaLevel::neon_bf16, KernelKind::gemm_prefill, m, nv, epi, WeightFormat::bf16);
        key.variant = kBf16Pairs;
        ASSERT_TRUE(bf16_pair_kernel(key));
        auto k = KernelCache::generate_only(key);
        ASSERT_GT(k->code.size(), 64u) << k->name;
        ASSERT_NE(k->name.find("_neonbf16_"), std::string::npos) << k->name;
        ASSERT_NE(k->name.find("_dpbf16"), std::string::npos) << k->name;
        ++kernels;
      }
    }
  // qgroup (GGUF, RAWINT4, GPTQ_INT4): bytes or nibbles, with and without a bias, each scale
  // form, every tile.
  for (IsaLevel isa : kNeonLevels)
    for (uint16_t variant :
         {uint16_t(0), uint16_t(kQGroupNibbles | kQGroupBias | kQGroupSuper),
          uint16_t(kQGroupNibbles | kQGroupF16), uint16_t(kQGroupBias | kQGroupBf16)})
      for (Epilogue epi : {Epilogue::store, Epilogue::siluup, Epilogue::accum})
        for (KernelKind kind : {KernelKind::gemm_decode, KernelKind::gemm_prefill})
          for (int nv = 2; nv <= kStripVecs; nv += 2)
            for (int m = 1; m <= gemm_max_rows(isa, WeightFormat::qgroup); ++m) {
              KernelKey key = a64_key(isa, kind, m, nv, epi, WeightFormat::qgroup);
              key.variant = variant;
              auto k = KernelCache::generate_only(key);
              ASSERT_GT(k->code.size(), 64u) << k->name;
              ASSERT_NE(k->name.find("_qg"), std::string::npos) << k->name;
              ASSERT_NE(k->name.find(isa_tag(isa)), std::string::npos) << k->name;
              ++kernels;
            }
  // mxfp4 / mxfp8: every tile, the siluup ones with each SwiGLU variant.
  for (IsaLevel isa : kNeonLevels)
    for (WeightFormat fmt : {WeightFormat::mxfp4, WeightFormat::mxfp8})
      for (uint8_t variant : {uint8_t(0), uint8_t(kSwigluClamp), uint8_t(kSwigluAlpha),
                              uint8_t(kSwigluClamp | kSwigluAlpha)})
        for (Epilogue epi : {Epilogue::store, Epilogue::siluup, Epilogue::accum})
          for (KernelKind kind : {KernelKind::gemm_decode, KernelKind::gemm_prefill})
            for (int nv = 1; nv <= kStripVecs; ++nv) {
              if ((epi == Epilogue::siluup && nv % 2) || (variant && epi != Epilogue::siluup))
                continue;
              for (int m = 1; m <= gemm_max_rows(isa, fmt); ++m) {
                KernelKey key = a64_key(isa, kind, m, nv, epi, fmt);
                key.variant = variant;
                auto k = KernelCache::generate_only(key);
                ASSERT_GT(k->code.size(), 64u) << k->name;
                ASSERT_NE(k->name.find(isa_tag(isa)), std::string::npos) << k->name;
                ++kernels;
              }
            }
  EXPECT_GT(kernels, 1000u);
  EXPECT_EQ(gemm_max_rows(IsaLevel::neon_dotprod, WeightFormat::mxfp4), 4);
  EXPECT_EQ(gemm_max_rows(IsaLevel::neon, WeightFormat::qgroup), 2);
  EXPECT_EQ(gemm_max_rows(IsaLevel::neon_dotprod, WeightFormat::qgroup), 3);
  EXPECT_EQ(gemm_max_rows(IsaLevel::neon_bf16, WeightFormat::fp8), 2);
  EXPECT_EQ(bf16_kgroup(IsaLevel::neon), 2);  // k-pair strips on every NEON level
  EXPECT_EQ(bf16_kgroup(IsaLevel::neon_bf16), 2);
  EXPECT_EQ(bf16_kgroup(IsaLevel::ref), 1);
  EXPECT_EQ(vec_lanes(IsaLevel::neon), 4);
  EXPECT_FALSE(int8_activation_offset(IsaLevel::neon_bf16));
  EXPECT_EQ(KernelCache::generate_only(a64_key(IsaLevel::neon_dotprod, KernelKind::gemm_decode, 1,
                                               4, Epilogue::store, WeightFormat::int8))
                ->name,
            "gemm_decode_int8_neondot_m1n16_store");
}

TEST(A64Gemm, RefusesWhatItDoesNotBuild) {
  // mx: 4 rows (scales, activations and a k's weights in registers), the SwiGLU bits only on
  // siluup, and no x86 strip-scratch tiles.
  EXPECT_THROW(KernelCache::generate_only(a64_key(IsaLevel::neon_bf16, KernelKind::gemm_prefill, 5,
                                                  4, Epilogue::store, WeightFormat::mxfp4)),
               std::invalid_argument);
  for (auto [epi, variant] : {std::make_pair(Epilogue::accum, uint16_t(kSwigluClamp)),
                              std::make_pair(Epilogue::siluup, uint16_t(kStripScratch))}) {
    KernelKey key =
        a64_key(IsaLevel::neon, KernelKind::gemm_prefill, 2, 4, epi, WeightFormat::mxfp8);
    key.variant = variant;
    EXPECT_THROW(KernelCache::generate_only(key), std::invalid_argument) << key.describe();
  }
  // fp8: 2 rows (group sums beside the accumulators) and no x86 variants.
  EXPECT_THROW(KernelCache::generate_only(a64_key(IsaLevel::neon, KernelKind::gemm_prefill, 3, 4,
                                                  Epilogue::store, WeightFormat::fp8)),
               std::invalid_argument);
  {
    KernelKey key = a64_key(IsaLevel::neon_bf16, KernelKind::gemm_decode, 1, 4, Epilogue::store,
                            WeightFormat::fp8);
    key.variant = kFp8Fp32Widen;
    EXPECT_THROW(KernelCache::generate_only(key), std::invalid_argument);
  }
  EXPECT_THROW(KernelCache::generate_only(a64_key(IsaLevel::neon, KernelKind::gemm_decode, 5, 4,
                                                  Epilogue::store, WeightFormat::int8)),
               std::invalid_argument);  // the widening path holds 4 rows
  // qgroup: group sums beside the accumulators (3 rows with sdot, 2 on the widening path), and
  // none of x86's avx2 variants (offset codes, int16 sums, identity table, int32 folds).
  EXPECT_THROW(KernelCache::generate_only(a64_key(IsaLevel::neon, KernelKind::gemm_prefill, 3, 4,
                                                  Epilogue::store, WeightFormat::qgroup)),
               std::invalid_argument);
  EXPECT_THROW(KernelCache::generate_only(a64_key(IsaLevel::neon_bf16, KernelKind::gemm_prefill, 4,
                                                  4, Epilogue::store, WeightFormat::qgroup)),
               std::invalid_argument);
  for (uint16_t variant :
       {uint16_t(kQGroupNibbles | qgroup_offset_variant(8)),
        uint16_t(kQGroupSuper | kQGroupIntFold), uint16_t(kQGroupSuper | kQGroupF16)}) {
    KernelKey key = a64_key(IsaLevel::neon_dotprod, KernelKind::gemm_decode, 1, 4, Epilogue::store,
                            WeightFormat::qgroup);
    key.variant = variant;
    EXPECT_THROW(KernelCache::generate_only(key), std::invalid_argument) << key.describe();
  }
  EXPECT_THROW(KernelCache::generate_only(a64_key(IsaLevel::neon_dotprod, KernelKind::gemm_decode,
                                                  7, 4, Epilogue::store, WeightFormat::int8)),
               std::invalid_argument);
  EXPECT_THROW(KernelCache::generate_only(a64_key(IsaLevel::neon, KernelKind::gemm_decode, 1, 3,
                                                  Epilogue::siluup, WeightFormat::bf16)),
               std::invalid_argument);
  // bfdot needs FEAT_BF16 (neon_bf16) and the executor's padded blocks (prefill).
  for (auto [isa, kind] : {std::make_pair(IsaLevel::neon_dotprod, KernelKind::gemm_prefill),
                           std::make_pair(IsaLevel::neon_bf16, KernelKind::gemm_decode)}) {
    KernelKey key = a64_key(isa, kind, 6, 4, Epilogue::store, WeightFormat::bf16);
    key.variant = kBf16Pairs;
    EXPECT_THROW(KernelCache::generate_only(key), std::invalid_argument) << key.describe();
  }
}

// ---- execution (AArch64 only) ---------------------------------------------------------------

struct Problem {
  IsaLevel isa;
  WeightFormat fmt;
  Epilogue epi;
  int64_t M, N, K;
  uint32_t seed;
  std::string repro() const {
    std::ostringstream s;
    s << "repro: KT_JIT_ISA=" << isa_name(isa) << " fmt=" << int(fmt) << " epi=" << int(epi)
      << " M=" << M << " N=" << N << " K=" << K << " seed=" << seed;
    return s.str();
  }
};

struct Packed {
  formats::StripLayout layout;
  std::vector<int8_t> w;
  std::vector<float> scale;
  std::vector<int32_t> comp;
  std::vector<std::vector<int8_t>> q;
  std::vector<std::vector<float>> d;
  std::vector<std::vector<uint8_t>> w8;  // fp8: per source, N x K e4m3 bytes
  std::vector<std::vector<float>> bs;    // fp8: per source, block or row scales
  std::vector<float> gscale;             // fp8: the group scale table
  bool fp8_block = false;
};

using test::e4m3_value;

Packed make_weights(const Problem& p) {
  Packed pk;
  const int sources = p.epi == Epilogue::siluup ? 2 : 1;
  const bool int4 = p.fmt == WeightFormat::int4, bf16 = p.fmt == WeightFormat::bf16;
  const bool fp8 = p.fmt == WeightFormat::fp8;
  pk.fp8_block = fp8 && p.seed % 2 == 0;  // alternate 128x128 block scales and row scales
  pk.layout = formats::StripLayout::make(p.N, p.K, vec_lanes(p.isa), kStripVecs, sources,
                                         bf16   ? 16
                                         : int4 ? 4
                                                : 8,
                                         bf16  ? bf16_kgroup(p.isa)
                                         : fp8 ? 1
                                               : 0,  // bf16: k pairs
                                         fp8 ? (pk.fp8_block ? 128 : p.K) : 0);
  pk.w.resize(size_t(pk.layout.total_bytes()));
  pk.scale.resize(size_t(pk.layout.total_cols()));
  pk.comp.resize(size_t(pk.layout.total_cols()));
  if (fp8) {
    test::pack_random_fp8(pk.layout, p.N, p.K, p.seed, pk.fp8_block, pk.w.data(), pk.scale.data(),
                          pk.comp.data(), pk.w8, pk.bs, pk.gscale);
    return pk;
  }
  if (bf16) {
    std::vector<std::vector<float>> wf;
    for (int s = 0; s < sources; ++s)
      wf.push_back(test::random_floats(size_t(p.N * p.K), p.seed + 10 * uint32_t(s), 0.1f));
    const float* ws[2] = {wf[0].data(), wf.back().data()};
    formats::pack_bf16_strips(pk.layout, ws, reinterpret_cast<uint16_t*>(pk.w.data()),
                              pk.scale.data(), pk.comp.data());
    return pk;
  }
  std::mt19937 rng(p.seed);
  std::uniform_int_distribution<int> qd(-127, 127);
  std::uniform_real_distribution<float> sd(0.001f, 0.02f);
  for (int s = 0; s < sources; ++s) {
    pk.q.emplace_back(size_t(p.N * p.K));
    pk.d.emplace_back(size_t(p.N));
    for (auto& x : pk.q.back()) x = int8_t(int4 ? 16 * (qd(rng) % 8) : qd(rng));  // 16*[-7,7]
    for (auto& x : pk.d.back()) x = sd(rng);
  }
  const int8_t* qs[2] = {pk.q[0].data(), pk.q.back().data()};
  const float* ds[2] = {pk.d[0].data(), pk.d.back().data()};
  formats::pack_int8_strips(pk.layout, qs, ds, pk.w.data(), pk.scale.data(), pk.comp.data(), false);
  return pk;
}

// All M rows over all strips the way the executor calls kernels: prefill blocks of max rows plus
// one decode call for the remainder, full strips then the tail strip.
void run_all(const Problem& p, const Packed& pk, const std::vector<int8_t>& a, int64_t lda,
             const std::vector<float>& as, std::vector<float*>& out_rows,
             const std::vector<float>& rw, bool use_ref, std::vector<std::string>* names) {
  const auto& l = pk.layout;
  const int max_rows = gemm_max_rows(p.isa, p.fmt);
  const int full_cols = l.strip_cols(l.strip_vecs);
  const int out_full = gemm_strip_out_cols(p.isa, l.strip_vecs, p.epi);
  auto call = [&](KernelKind kind, int m_r, int nv, int64_t s0, int64_t ns, int64_t row0,
                  int64_t blocks) {
    KernelKey key = a64_key(p.isa, kind, m_r, nv, p.epi, p.fmt);
    GemmArgs args{};
    args.a = a.data() + row0 * lda;
    args.lda = lda;
    args.w = pk.w.data() + l.strip_offset(s0);
    args.n_strips = ns;
    args.k4 = l.k4;
    args.a_scale = as.data() + row0;
    args.w_scale = pk.scale.data() + s0 * full_cols;
    args.w_comp = pk.comp.data() + s0 * full_cols;
    args.out_rows = out_rows.data() + row0;
    args.out_col = s0 * out_full;
    args.row_weight = rw.data() + row0;
    args.m_blocks = blocks;
    args.w_gscale =
        pk.gscale.empty() ? nullptr : pk.gscale.data() + s0 * l.gscale_floats_per_strip();
    args.g_steps = l.g_steps;
    args.g_per_strip = l.groups();
    if (use_ref) {
      gemm_ref(key, args);
    } else {
      const Kernel* k = KernelCache::instance().get(key);
      ASSERT_NE(k, nullptr) << key.name();
      if (names) names->push_back(k->name);
      reinterpret_cast<GemmFn>(const_cast<void*>(k->entry()))(&args);
    }
  };
  for (int part = 0; part < 2; ++part) {
    const int64_t s0 = part ? l.full_strips : 0;
    const int64_t ns = part ? (l.tail_vecs ? 1 : 0) : l.full_strips;
    const int nv = part ? l.tail_vecs : l.strip_vecs;
    if (ns == 0) continue;
    int64_t row = 0;
    if (p.M > max_rows) {
      call(KernelKind::gemm_prefill, max_rows, nv, s0, ns, 0, p.M / max_rows);
      row = p.M / max_rows * max_rows;
    }
    if (p.M > row) call(KernelKind::gemm_decode, int(p.M - row), nv, s0, ns, row, 1);
  }
}

void check_problem(const Problem& p, std::vector<std::string>* names) {
  Packed pk = make_weights(p);
  const bool f32_rows = p.fmt == WeightFormat::bf16 || p.fmt == WeightFormat::fp8;
  const int64_t lda = (pk.layout.padded_k() + 8) * (f32_rows ? 4 : 1);
  std::mt19937 rng(p.seed + 1);
  std::uniform_int_distribution<int> qd(-127, 127);
  std::vector<int8_t> a(size_t(p.M * lda), 0);
  std::vector<float> af = test::random_floats(size_t(p.M * p.K), p.seed + 5, 1.0f);
  for (int64_t m = 0; m < p.M; ++m)
    for (int64_t k = 0; k < p.K; ++k) {
      if (f32_rows)
        std::memcpy(&a[size_t(m * lda + k * 4)], &af[size_t(m * p.K + k)], 4);
      else
        a[size_t(m * lda + k)] = int8_t(qd(rng));
    }
  std::vector<float> as = test::random_floats(size_t(p.M), p.seed + 2, 0.01f);
  for (auto& x : as) x = std::fabs(x) + 1e-3f;
  // Routing weights; some gate values large enough to reach the exp clamps.
  std::vector<float> rw = test::random_floats(size_t(p.M), p.seed + 3, 1.0f);
  const int64_t stride = pk.layout.total_cols() + 16;
  std::vector<float> jit_buf = test::random_floats(size_t(p.M * stride), p.seed + 4, 0.5f);
  std::vector<float> ref_buf = jit_buf;
  std::vector<float*> jit_rows, ref_rows;
  for (int64_t m = 0; m < p.M; ++m) {  // rows scrambled, as the down epilogue scatters to tokens
    jit_rows.push_back(jit_buf.data() + ((m * 7) % p.M) * stride);
    ref_rows.push_back(ref_buf.data() + ((m * 7) % p.M) * stride);
  }
  run_all(p, pk, a, lda, as, jit_rows, rw, false, names);
  if (::testing::Test::HasFatalFailure()) return;
  run_all(p, pk, a, lda, as, ref_rows, rw, true, nullptr);
  ASSERT_EQ(0, std::memcmp(jit_buf.data(), ref_buf.data(), jit_buf.size() * 4)) << p.repro();
  // The reference itself against exact int64 math for the integer formats.
  if (p.epi == Epilogue::store && !f32_rows) {
    for (int64_t m = 0; m < p.M; ++m)
      for (int64_t n = 0; n < p.N; ++n) {
        int64_t acc = 0;
        for (int64_t k = 0; k < p.K; ++k)
          acc += int64_t(a[size_t(m * lda + k)]) * pk.q[0][size_t(n * p.K + k)];
        const float want = (as[size_t(m)] * pk.d[0][size_t(n)]) * float(acc);
        ASSERT_EQ(want, ref_rows[size_t(m)][n]) << p.repro() << " m=" << m << " n=" << n;
      }
  }
  // fp8: the reference against float64 over e4m3 decoded from its definition, within fp32
  // summation error.
  if (p.epi == Epilogue::store && p.fmt == WeightFormat::fp8) {
    const int64_t kb = (p.K + 127) / 128;
    for (int64_t m = 0; m < p.M; ++m)
      for (int64_t n = 0; n < p.N; ++n) {
        double want = 0, mag = 0;
        for (int64_t k = 0; k < p.K; ++k) {
          const double s =
              pk.fp8_block ? pk.bs[0][size_t((n / 128) * kb + k / 128)] : pk.bs[0][size_t(n)];
          const double t =
              double(af[size_t(m * p.K + k)]) * e4m3_value(pk.w8[0][size_t(n * p.K + k)]) * s;
          want += t;
          mag += std::fabs(t);
        }
        want *= as[size_t(m)];
        const double got = ref_rows[size_t(m)][n];
        // fp32 rounding of every product and partial sum: at most (K + 2) ulps of the magnitude
        ASSERT_LE(std::fabs(got - want), double(p.K + 2) * 0x1p-23 * mag * as[size_t(m)] + 1e-30)
            << p.repro() << " m=" << m << " n=" << n;
      }
  }
}

TEST(A64Gemm, SweepMatchesReferenceBitwise) {
#if !defined(__aarch64__)
  GTEST_SKIP() << "runs generated AArch64 code: an AArch64 host or qemu-aarch64 "
                  "(tests/emu/run_aarch64.sh)";
#endif
  // Emulation-sized: M covers decode 1..max rows and prefill blocks plus a remainder (max rows is
  // 4 or 6), N full strips of 16 columns and tails (siluup strips hold 8 gate + 8 up rows), K the
  // unrolled loop and its tail (int4 pads K to 8).
  const int64_t Ms[] = {1, 3, 5, 6, 13};
  const int64_t Ns[] = {1, 7, 16, 24, 40};
  const int64_t Ks[] = {1, 5, 12, 36};
  const auto levels = test::runnable_levels();
  if (levels.empty()) GTEST_SKIP() << "no NEON level selected (KT_JIT_ISA=ref?)";
  uint32_t seed = 1;
  size_t checked = 0;
  for (IsaLevel isa : levels) {
    std::vector<std::string> names;
    for (WeightFormat fmt :
         {WeightFormat::int8, WeightFormat::int4, WeightFormat::bf16, WeightFormat::fp8})
      for (Epilogue epi : {Epilogue::store, Epilogue::siluup, Epilogue::accum})
        for (int64_t M : Ms)
          for (int64_t N : Ns)
            for (int64_t K : Ks) {
              check_problem({isa, fmt, epi, M, N, K, seed++}, &names);
              if (HasFatalFailure()) return;
              ++checked;
            }
    // fp8 over several 128-wide scale groups, the last one short (and one row-scale group).
    for (Epilogue epi : {Epilogue::store, Epilogue::siluup, Epilogue::accum})
      for (int64_t M : {int64_t(1), int64_t(2), int64_t(5)})
        for (int64_t N : {int64_t(16), int64_t(40)})
          for (uint32_t parity : {0u, 1u}) {
            const uint32_t s = seed++ * 2 + parity;  // even seeds: block scales, odd: rows
            check_problem({isa, WeightFormat::fp8, epi, M, N, 261, s}, &names);
            if (HasFatalFailure()) return;
            ++checked;
          }
    std::sort(names.begin(), names.end());
    names.erase(std::unique(names.begin(), names.end()), names.end());
    EXPECT_GE(names.size(), 80u) << isa_name(isa);
    std::printf("a64: %s: %zu kernels generated, run and equal to gemm_ref\n", isa_name(isa),
                names.size());
  }
  std::printf("a64: sweep %zu problems at %zu level(s)\n", checked, levels.size());
  EXPECT_GT(checked, 0u);
}

TEST(A64Gemm, SiluClampsAndSpecialValuesMatchReference) {
#if !defined(__aarch64__)
  GTEST_SKIP() << "runs generated AArch64 code: an AArch64 host or qemu-aarch64";
#endif
  // bf16 weights of 1.0 and one K step make the gate/up values the activations themselves, so
  // the epilogue sees chosen values: the clamps at -87/88, zeros, tiny and huge gates.
  const auto levels = test::runnable_levels();
  if (levels.empty()) GTEST_SKIP() << "no NEON level selected";
  const float gates[8] = {-200.0f, -88.5f, -87.0f, -1e-20f, 0.0f, 3.5f, 87.9f, 300.0f};
  for (IsaLevel isa : levels) {
    formats::StripLayout l =
        formats::StripLayout::make(8, 1, 4, kStripVecs, 2, 16, bf16_kgroup(isa));  // one k pair
    std::vector<float> ones(8, 1.0f);
    const float* ws[2] = {ones.data(), ones.data()};
    std::vector<uint16_t> w(size_t(l.total_bytes() / 2));
    std::vector<float> scale(size_t(l.total_cols()));
    std::vector<int32_t> comp(size_t(l.total_cols()));
    formats::pack_bf16_strips(l, ws, w.data(), scale.data(), comp.data());
    for (float g : gates) {
      float a[4] = {g, 0, 0, 0};
      float out_jit[8] = {}, out_ref[8] = {};
      float* rows_jit[1] = {out_jit};
      float* rows_ref[1] = {out_ref};
      GemmArgs args{};
      args.a = reinterpret_cast<const int8_t*>(a);
      args.lda = 16;
      args.w = reinterpret_cast<const int8_t*>(w.data());
      args.n_strips = 1;
      args.k4 = 1;
      args.a_scale = ones.data();
      args.w_scale = scale.data();
      args.w_comp = comp.data();
      args.out_rows = rows_jit;
      args.row_weight = ones.data();
      KernelKey key =
          a64_key(isa, KernelKind::gemm_decode, 1, 4, Epilogue::siluup, WeightFormat::bf16);
      const Kernel* k = KernelCache::instance().get(key);
      ASSERT_NE(k, nullptr);
      reinterpret_cast<GemmFn>(const_cast<void*>(k->entry()))(&args);
      args.out_rows = rows_ref;
      gemm_ref(key, args);
      ASSERT_EQ(0, std::memcmp(out_jit, out_ref, sizeof out_jit)) << "g=" << g << " " << k->name;
    }
  }
}

// ---- bfdot: the twin's lane rule and the pair kernels ---------------------------------------

// Two floats that are bf16 values as a pair, element 2p in the low half.
uint32_t bf_pair(float lo, float hi) {
  return uint32_t(formats::f32_to_bf16(lo)) | uint32_t(formats::f32_to_bf16(hi)) << 16;
}
uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// bfdot_lane against hand-computed and float64 expectations: each case names what a wrong rule
// (round to nearest even, one rounding, no flush, overflow to the largest finite) would give.
TEST(A64BfdotLane, FollowsTheArmPseudoCode) {
  const float one_up = 0x1.000002p0f;  // 1 + 2^-23, odd
  // Round to odd, the final add: 1 + 2^-24 is a tie (RNE: 1.0); the truncation 1.0 is inexact,
  // so its last bit is set.
  EXPECT_EQ(bits(bfdot_lane(1.0f, bf_pair(0x1p-12f, 0), bf_pair(0x1p-12f, 0))), bits(one_up));
  // Below half an ulp (3 * 2^-25 = 0.375 ulp): RNE 1.0, round to odd 1 + 2^-23.
  EXPECT_EQ(bits(bfdot_lane(1.0f, bf_pair(0x1.8p-13f, 0), bf_pair(0x1p-12f, 0))), bits(one_up));
  // Above half an ulp from an odd value: RNE rounds up to 1 + 2^-22, round to odd truncates.
  EXPECT_EQ(bits(bfdot_lane(one_up, bf_pair(0x1.8p-12f, 0), bf_pair(0x1p-12f, 0))), bits(one_up));
  // Round to odd, the pair sum: 2^24 + 1 needs 25 bits and becomes 2^24 + 2 (RNE: 2^24) before
  // the accumulator -2^24 is added; one rounding of the whole sum would give 1.
  EXPECT_EQ(bfdot_lane(-0x1p24f, bf_pair(0x1p12f, 1.0f), bf_pair(0x1p12f, 1.0f)), 2.0f);
  // Exponent gaps: a far smaller term only sets the sticky (last) bit.
  EXPECT_EQ(bits(bfdot_lane(1.0f, bf_pair(0x1p-30f, 0), bf_pair(0x1p-30f, 0))), bits(one_up));
  // 2^60 - 1 truncates to the largest float below 2^60 (odd already); RNE gives 2^60.
  EXPECT_EQ(bits(bfdot_lane(0x1p60f, bf_pair(-1.0f, 0), bf_pair(1.0f, 0))), 0x5d7fffffu);
  // The gap inside the pair: 2^40 + 2^-40 rounds to 2^40 + 2^17, which survives the
  // cancellation with -2^40 (float64 and RNE give 0).
  EXPECT_EQ(bfdot_lane(-0x1p40f, bf_pair(0x1p20f, 0x1p-20f), bf_pair(0x1p20f, 0x1p-20f)), 0x1p17f);
  // The pair's order does not matter (one commutative add), unlike vdpbf16ps's.
  EXPECT_EQ(bfdot_lane(1.0f, bf_pair(-0x1p24f, 0x1p24f), bf_pair(1.0f, 1.0f)), 1.0f);
  EXPECT_EQ(bfdot_lane(1.0f, bf_pair(0x1p24f, -0x1p24f), bf_pair(1.0f, 1.0f)), 1.0f);
  // Flush to zero: bf16 subnormal inputs read as zero (sign kept), on either operand.
  const float sub = 0x1p-130f;  // a bf16 subnormal
  ASSERT_EQ(formats::f32_to_bf16(sub), 0x0008);
  EXPECT_EQ(bfdot_lane(0.0f, bf_pair(sub, 0), bf_pair(0x1p100f, 0)), 0.0f);
  EXPECT_EQ(bfdot_lane(0.0f, bf_pair(0, 0x1p100f), bf_pair(0, -sub)), 0.0f);
  // A subnormal accumulator reads as zero: 2^-127 + 2^-126 gives 2^-126 (float64: 1.5 * 2^-126).
  EXPECT_EQ(bfdot_lane(0x1p-127f, bf_pair(0x1p-63f, 0), bf_pair(0x1p-63f, 0)), 0x1p-126f);
  // Results below 2^-126 flush to zero, sign kept: a product (2^-128) and a sum (+-2^-127).
  EXPECT_EQ(bits(bfdot_lane(0.0f, bf_pair(0x1p-64f, 0), bf_pair(0x1p-64f, 0))), 0u);
  EXPECT_EQ(bfdot_lane(0.0f, bf_pair(0x1p-63f, 0), bf_pair(0x1p-63f, 0)), 0x1p-126f);
  EXPECT_EQ(bits(bfdot_lane(0x1.8p-126f, bf_pair(-0x1p-63f, 0), bf_pair(0x1p-63f, 0))), 0u);
  EXPECT_EQ(bits(bfdot_lane(-0x1.8p-126f, bf_pair(0x1p-63f, 0), bf_pair(0x1p-63f, 0))),
            0x80000000u);
  // Signed zeros: x + (-x) is +0; -0 + -0 stays -0.
  EXPECT_EQ(bits(bfdot_lane(-3.0f, bf_pair(1.5f, 0), bf_pair(2.0f, 0))), 0u);
  EXPECT_EQ(bits(bfdot_lane(-0.0f, bf_pair(-0.0f, -0.0f), bf_pair(1.0f, 1.0f))), 0x80000000u);
  // Overflow goes to infinity (round to odd of FCVTXN would stop at the largest finite)...
  const float fmax = 0x1.fffffep127f;
  EXPECT_EQ(bfdot_lane(0.0f, bf_pair(0x1p100f, 0), bf_pair(0x1p100f, 0)), INFINITY);
  EXPECT_EQ(bfdot_lane(fmax, bf_pair(0x1p52f, 0), bf_pair(0x1p52f, 0)), INFINITY);  // = 2^128
  // ...but only when the exact value reaches 2^128: fmax + half an ulp truncates to fmax (RNE:
  // a tie from an odd value, rounded up to infinity).
  EXPECT_EQ(bfdot_lane(fmax, bf_pair(0x1p52f, 0), bf_pair(0x1p51f, 0)), fmax);
  EXPECT_EQ(bfdot_lane(-fmax, bf_pair(-0x1p52f, 0), bf_pair(0x1p52f, 0)), -INFINITY);
  // Any NaN gives the default NaN: NaN inputs, inf * 0, inf - inf.
  EXPECT_EQ(bits(bfdot_lane(1.0f, 0xffa1u, bf_pair(1.0f, 0))), 0x7fc00000u);
  EXPECT_EQ(bits(bfdot_lane(NAN, 0, 0)), 0x7fc00000u);
  EXPECT_EQ(bits(bfdot_lane(1.0f, bf_pair(INFINITY, 0), bf_pair(0, 0))), 0x7fc00000u);
  EXPECT_EQ(bits(bfdot_lane(-INFINITY, bf_pair(INFINITY, 0), bf_pair(1.0f, 0))), 0x7fc00000u);
  // Plain values: 1 * 2 + 3 * 4 + 0.5.
  EXPECT_EQ(bfdot_lane(0.5f, bf_pair(1.0f, 3.0f), bf_pair(2.0f, 4.0f)), 14.5f);
  // Random lanes against float64: where the pair sum is exact in fp32 (both products' exponents
  // within 7) and the accumulator within 20 binades of it (so the whole sum is exact in float64),
  // the result is the exact sum when that is a float, else the odd one of the two floats around
  // it: the definition of round to odd, checked without the twin's code.
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> ex(-40, 40), mant(0, 127), gap(0, 7), shift(-20, 20);
  auto bf = [&](int e) {
    return std::ldexp(1.0f + float(mant(rng)) / 128, e) * (rng() % 2 ? -1.0f : 1.0f);
  };
  size_t inexact = 0;
  for (int i = 0; i < 200000; ++i) {
    const int e = ex(rng);
    const float a0 = bf(e), b0 = bf(0), a1 = bf(e - gap(rng)), b1 = bf(0);
    const float acc = std::ldexp(float(int(rng() % (1u << 24)) + 1), e + shift(rng) - 24) *
                      (rng() % 2 ? -1.0f : 1.0f);
    const double pair = double(a0) * b0 + double(a1) * b1;
    ASSERT_EQ(double(float(pair)), pair) << "the pair sum should be exact here";
    const double exact = double(acc) + pair;
    const float r = bfdot_lane(acc, bf_pair(a0, a1), bf_pair(b0, b1));
    float lo = float(exact), hi;  // the floats around the exact sum
    if (double(lo) == exact) {
      ASSERT_EQ(r, lo) << i;
      continue;
    }
    ++inexact;
    if (double(lo) > exact) {
      hi = lo;
      lo = std::nextafter(hi, -INFINITY);
    } else {
      hi = std::nextafter(lo, INFINITY);
    }
    ASSERT_TRUE(double(lo) < exact && exact < double(hi)) << i;
    ASSERT_TRUE(r == lo || r == hi) << i << ": " << acc << " + " << pair;
    ASSERT_EQ(bits(r) & 1, 1u) << i << ": " << acc << " + " << pair;
  }
  EXPECT_GT(inexact, 50000u);
}

// The bfdot pair kernels (neon_bf16, prefill, kBf16Pairs) against gemm_ref's twin bit for bit:
// every tile of 1..6 rows (the executor uses 6, padding the last block), one and two blocks, odd
// and even K (an odd K ends with a zero k in the strip and in the rows), full and tail strips, the
// three epilogues; activations and weights include bf16 subnormals and tiny and huge values so
// the flushes and the rounding of big terms are exercised.
TEST(A64Gemm, BfdotPairKernelsMatchReferenceBitwise) {
#if !defined(__aarch64__)
  GTEST_SKIP() << "runs generated AArch64 code: an AArch64 host or qemu-aarch64 "
                  "(tests/emu/run_aarch64.sh)";
#else
  if (selected_isa() != IsaLevel::neon_bf16)
    GTEST_SKIP() << "this CPU (or KT_JIT_ISA) lacks BF16 (HWCAP2_BF16): bfdot kernels need "
                    "neon_bf16, selected "
                 << isa_name(selected_isa()) << " (qemu-aarch64 -cpu max has it)";
  const int64_t Ns[] = {4, 12, 16, 40};
  const int64_t Ks[] = {1, 2, 7, 10, 33};
  uint32_t seed = 900;
  size_t checked = 0;
  std::vector<std::string> names;
  for (Epilogue epi : {Epilogue::store, Epilogue::siluup, Epilogue::accum})
    for (int m_r = 1; m_r <= 6; ++m_r)
      for (int64_t blocks : {1, 2})
        for (int64_t N : Ns)
          for (int64_t K : Ks) {
            const int64_t M = m_r * blocks;
            Problem p{IsaLevel::neon_bf16, WeightFormat::bf16, epi, M, N, K, ++seed};
            Packed pk = make_weights(p);
            // Random weights with special values mixed in: subnormal, tiny and huge bf16.
            std::mt19937 rng(seed);
            uint16_t* w16 = reinterpret_cast<uint16_t*>(pk.w.data());
            const auto& l = pk.layout;
            for (int64_t i = 0; i < l.total_bytes() / 2; ++i) {
              if (w16[i] == 0) continue;  // padding stays zero
              const uint32_t r = rng() % 64;
              if (r == 0) w16[i] = uint16_t(0x0001 + rng() % 0x7f);       // subnormal
              if (r == 1) w16[i] = uint16_t((w16[i] & 0x807f) | 0x0080);  // 2^-126 range
              if (r == 2) w16[i] = uint16_t((w16[i] & 0x807f) | 0x7180);  // ~2^100
            }
            const int64_t lda = l.padded_k() * 2 + 16;  // bf16 rows, zero past K
            std::vector<int8_t> a(size_t(M * lda), 0);
            const std::vector<float> af = test::random_floats(size_t(M * K), seed + 5, 1.0f);
            for (int64_t m = 0; m < M; ++m)
              for (int64_t k = 0; k < K; ++k) {
                uint16_t h = formats::f32_to_bf16(af[size_t(m * K + k)]);
                const uint32_t r = rng() % 64;
                if (r == 0) h = uint16_t(0x8001 + rng() % 0x7f);
                if (r == 1) h = uint16_t((h & 0x807f) | 0x0200);  // ~2^-122
                std::memcpy(&a[size_t(m * lda + k * 2)], &h, 2);
              }
            const std::vector<float> as(size_t(M), 1.0f);
            const std::vector<float> rw = test::random_floats(size_t(M), seed + 3, 1.0f);
            const int64_t stride = l.total_cols() + 16;
            std::vector<float> jit_buf = test::random_floats(size_t(M * stride), seed + 4, 0.5f);
            std::vector<float> ref_buf = jit_buf;
            std::vector<float*> jit_rows, ref_rows;
            for (int64_t m = 0; m < M; ++m) {
              jit_rows.push_back(jit_buf.data() + ((m * 5) % M) * stride);
              ref_rows.push_back(ref_buf.data() + ((m * 5) % M) * stride);
            }
            const int full_cols = l.strip_cols(l.strip_vecs);
            const int out_full = gemm_strip_out_cols(p.isa, l.strip_vecs, epi);
            for (bool ref : {false, true})
              for (int part = 0; part < 2; ++part) {
                const int64_t s0 = part ? l.full_strips : 0;
                const int64_t ns = part ? (l.tail_vecs ? 1 : 0) : l.full_strips;
                if (ns == 0) continue;
                KernelKey key = a64_key(p.isa, KernelKind::gemm_prefill, m_r,
                                        part ? l.tail_vecs : l.strip_vecs, epi, p.fmt);
                key.variant = kBf16Pairs;
                GemmArgs args{};
                args.a = a.data();
                args.lda = lda;
                args.w = pk.w.data() + l.strip_offset(s0);
                args.n_strips = ns;
                args.k4 = l.k4;  // k pairs
                args.a_scale = as.data();
                args.w_scale = pk.scale.data() + s0 * full_cols;
                args.w_comp = pk.comp.data() + s0 * full_cols;
                args.out_rows = ref ? ref_rows.data() : jit_rows.data();
                args.out_col = s0 * out_full;
                args.row_weight = rw.data();
                args.m_blocks = blocks;
                if (ref) {
                  gemm_ref(key, args);
                  continue;
                }
                const Kernel* k = KernelCache::instance().get(key);
                ASSERT_NE(k, nullptr) << key.name();
                names.push_back(k->name);
                reinterpret_cast<GemmFn>(const_cast<void*>(k->entry()))(&args);
              }
            ASSERT_EQ(0, std::memcmp(jit_buf.data(), ref_buf.data(), jit_buf.size() * 4))
                << p.repro() << " m_r=" << m_r << " blocks=" << blocks;
            ++checked;
          }
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  EXPECT_GE(names.size(), 30u);
  std::printf(
      "a64: bfdot pair kernels at neon_bf16: %zu problems, %zu kernels, the same bits as "
      "gemm_ref's bfdot_lane\n",
      checked, names.size());
#endif
}

}  // namespace
}  // namespace ktjit
