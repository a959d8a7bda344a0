// qgroup kernel sweep: every generated k-group kernel at every x86 level this machine runs (byte
// and nibble codes with several tables, with and without a bias term, codes -128 and 127 present,
// groups 16/32/128, tails in N, one and several groups in K), bit for bit against the reference
// twin; the twin against the documented fp32 order evaluated on the unpacked sources, and against
// int64 / double math over the dequantized weights.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>
#include <tuple>
#include <utility>

#include "formats/convert.hpp"
#include "formats/grouped.hpp"
#include "formats/int8.hpp"
#include "jit/bits.hpp"
#include "jit/gemm.hpp"
#include "jit/kernel.hpp"
#include "kernel_exec.hpp"
#include "runtime/moe_layer.hpp"
#include "runtime/thread_pool.hpp"
#include "test_util.hpp"

namespace ktjit {
namespace {

// Nibble tables: GGUF Q4_0 / RAWINT4 (q - 8), Q4_K (q), IQ4_NL (kvalues), and extremes.
const int8_t kLuts[4][16] = {
    {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113},
    {-128, 127, -1, 0, 1, -127, 64, -64, 100, -100, 33, -33, 7, -7, 126, -128},
};

struct Problem {
  IsaLevel isa;
  Epilogue epi;
  bool nib, bias;
  int64_t M, N, K, G;
  uint32_t seed;
  // Offset-code kernels (kQGroupOffset; the executor's choice at avx2 where the codes allow it).
  // Byte codes then lie in a narrow range (byte_range()), as Q6_K's or Q5_K's do.
  bool offset = false;
  // Two-level scales (kQGroupSuper): groups per super block (0: fp32 scales). Scales (biases) are
  // then an fp16 value per (row, super block) times integer sub-scales, as GGUF's K-quants.
  int64_t super = 0;
  // 16-bit one-level scales (kQGroupF16 / kQGroupBf16): 1 fp16, 2 bf16; values of that type.
  int half = 0;
  // int16 group sums (kQGroupI16; the executor's choice where formats::qgroup_int16_sums allows)
  bool words = false;
  // the identity table (kQGroupIdentity), likewise
  bool ident = false;
  // int32 super-block folds (kQGroupIntFold; the executor's choice at avx2 and, with psums, at
  // the VNNI levels where formats::qgroup_int_fold allows): byte codes in [-32, 31] (Q6_K) or
  // [-32, 32], stored signed, activations given to the kernels as a + 128
  bool fold = false;
  // int16-lane super-block folds (kQGroupLaneFold; the executor's choice at avx2 where
  // formats::qgroup_lane_fold allows): identity nibbles (Q4_K's table) or bytes in [0, 31] or
  // [0, 32] (Q5_K's), G <= 32, an even number of groups per super block; needs offset, words,
  // super and with nibbles ident
  bool lanes = false;
  // fp32 super-block partials (kQGroupSuperSums; the executor's choice at the VNNI levels for
  // two-level scales without a bias): needs super, no bias
  bool psums = false;
  // Every code at the table's last entry (bytes: the range's top) and every activation 127: the
  // largest sums an int16 lane meets.
  bool extreme = false;
  int lut() const { return int(seed % 4); }
  std::pair<int, int> byte_range() const {
    if (fold) return (seed / 8) % 2 ? std::make_pair(-32, 31) : std::make_pair(-32, 32);
    if (!offset) return {-128, 127};
    if (lanes) return (seed / 8) % 2 ? std::make_pair(0, 32) : std::make_pair(0, 31);  // Q5_K's
    return (seed / 8) % 2 ? std::make_pair(-32, 31) : std::make_pair(0, 31);
  }
  formats::GroupedSpec spec() const {
    formats::GroupedSpec sp;
    sp.group = G;
    sp.bias = bias;
    sp.code_bits = nib ? 4 : 8;
    if (nib) std::memcpy(sp.lut, kLuts[lut()], 16);
    std::tie(sp.code_lo, sp.code_hi) = byte_range();
    sp.super_group = super * G;
    sp.scale_dtype = half == 1   ? formats::FloatType::f16
                     : half == 2 ? formats::FloatType::bf16
                                 : formats::FloatType::f32;
    sp.int_fold = fold;
    return sp;
  }
  // c0 of the offset codes (formats::qgroup_code_offset), -1 if the codes allow none
  int c0() const { return formats::qgroup_code_offset(spec()); }
  std::string repro() const {
    std::ostringstream s;
    s << "repro: KT_JIT_ISA=" << isa_name(isa) << " epi=" << int(epi) << " nib=" << nib
      << " bias=" << bias << " lut=" << (nib ? lut() : -1) << " offset=" << offset << " M=" << M
      << " N=" << N << " K=" << K << " G=" << G << " super=" << super << " half=" << half
      << " words=" << words << " ident=" << ident << " fold=" << fold << " lanes=" << lanes
      << " psums=" << psums << " seed=" << seed << " (ktjit_tests --gtest_filter='QGroup.*')";
    return s.str();
  }
};

struct Source {
  std::vector<int8_t> codes;
  std::vector<float> scales, biases;
  formats::GroupedMatrix m;
};

struct Packed {
  formats::GroupedSpec spec;
  formats::StripLayout layout;
  std::vector<Source> src;
  std::vector<int8_t> w;
  int8_t lut[16];
};

// x as the scale type holds it (f16 rounded to nearest even, bf16 truncated; f32 unchanged).
float as_scale_type(float x, formats::FloatType t) {
  if (t == formats::FloatType::f16) return formats::f16_to_f32(formats::f32_to_f16(x));
  if (t == formats::FloatType::bf16) return formats::bf16_to_f32(uint16_t(f32_to_bits(x) >> 16));
  return x;
}

// pack_qgroup_strips must throw std::invalid_argument whose message contains `part`.
void expect_pack_error(const formats::StripLayout& l, const formats::GroupedSpec& spec,
                       const formats::GroupedSlice& sl, int offset, const std::string& part) {
  std::vector<int8_t> out(size_t(l.total_bytes()));
  try {
    formats::pack_qgroup_strips(l, spec, &sl, offset, out.data());
    FAIL() << "expected an exception containing: " << part;
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

// x rounded to 11 significant bits (as an fp16 d; its products with int8 stay exact in fp32).
float fp16_like(float x) {
  int e;
  const float m = std::frexp(x, &e);
  return std::ldexp(std::nearbyint(std::ldexp(m, 11)), e - 11);
}

Packed make_weights(const Problem& p) {
  Packed pk;
  pk.spec = p.spec();
  const auto [lo, hi] = p.byte_range();
  const int sources = p.epi == Epilogue::siluup ? 2 : 1;
  pk.layout = formats::qgroup_layout(p.N, p.K, vec_lanes(p.isa), kStripVecs, sources, pk.spec);
  std::mt19937 rng(p.seed);
  std::uniform_int_distribution<int> code(lo, hi), nib(0, 15);
  std::uniform_real_distribution<float> sd(-0.02f, 0.02f);
  pk.src.resize(size_t(sources));
  for (auto& s : pk.src) {
    s.codes.resize(size_t(p.N * p.K));
    for (auto& c : s.codes) c = p.nib ? kLuts[p.lut()][nib(rng)] : int8_t(code(rng));
    if (p.extreme)
      for (auto& c : s.codes) c = p.nib ? kLuts[p.lut()][15] : int8_t(hi);
    if (!p.nib && !p.extreme) {  // the extremes always present
      s.codes[0] = int8_t(lo);
      s.codes.back() = int8_t(hi);
      s.codes[s.codes.size() / 2] = int8_t(lo);
    }
    s.scales.resize(size_t(p.N * p.K / p.G));
    for (auto& x : s.scales) x = sd(rng);
    if (p.bias) {
      s.biases.resize(s.scales.size());
      for (auto& x : s.biases) x = sd(rng) * 3.0f;
    }
    if (p.super) {  // d (fp16, either sign) per super block times sub-scales in [-128, 127]
      std::uniform_int_distribution<int> sub(-128, 127);
      float x_d = 0;
      for (auto* v : {&s.scales, &s.biases})
        for (size_t i = 0; i < v->size(); ++i) {
          if (i % size_t(p.super) == 0) x_d = fp16_like(sd(rng));
          (*v)[i] = x_d * float(i % 7 == 3 ? 0 : sub(rng));  // zero sub-scales too
        }
    }
    for (auto* v : {&s.scales, &s.biases})  // 16-bit scales: values of that type
      for (float& x : *v) x = as_scale_type(x, pk.spec.scale_dtype);
    s.m = {s.codes.data(), s.scales.data(), p.bias ? s.biases.data() : nullptr, p.G};
  }
  formats::GroupedSlice sl[2];
  for (int s = 0; s < sources; ++s) sl[s] = {&pk.src[size_t(s)].m, p.K, 0, 0, "src"};
  pk.w.resize(size_t(pk.layout.total_bytes()));
  // what the codes are stored with: + c0 (offset codes), + 128 (other VNNI-level codes), or as
  // they are
  const int store = p.offset ? p.c0() : qgroup_flip_codes(p.isa) && !p.fold ? 128 : 0;
  formats::pack_qgroup_strips(pk.layout, pk.spec, sl, store, pk.w.data());
  formats::qgroup_kernel_lut(pk.spec, store, pk.lut);
  return pk;
}

KernelKey key_for(const Problem& p, KernelKind kind, int m_r, int n_vec) {
  KernelKey k;
  k.kind = kind;
  k.isa = p.isa;
  k.format = WeightFormat::qgroup;
  k.m_r = uint8_t(m_r);
  k.n_vec = uint8_t(n_vec);
  k.epilogue = p.epi;
  k.variant = uint8_t((p.nib ? kQGroupNibbles : 0) | (p.bias ? kQGroupBias : 0));
  if (p.offset) k.variant |= qgroup_offset_variant(p.c0());
  if (p.super) k.variant |= kQGroupSuper;
  if (p.half) k.variant |= p.half == 1 ? kQGroupF16 : kQGroupBf16;
  if (p.words) k.variant |= kQGroupI16;
  if (p.ident) k.variant |= kQGroupIdentity;
  if (p.fold) k.variant |= kQGroupIntFold;
  if (p.lanes) k.variant |= kQGroupLaneFold;
  if (p.psums) k.variant |= kQGroupSuperSums;
  return k;
}

struct Acts {
  std::vector<int8_t> a;
  int64_t lda;
  std::vector<float> as;
  std::vector<int32_t> gsum;  // [g][row], stride ld_rows
  int64_t ld_rows;
};

// All M rows over all strips as the executor runs them: its tile tier where it has one (half-strip
// tiles: avx2's, and the VNNI levels' byte codes without a bias, which take the rows after their
// blocks too), prefill blocks + a decode remainder, full strips then the tail strip.
void run_all(const Problem& p, const Packed& pk, const Acts& x, std::vector<float*>& out_rows,
             const std::vector<float>& rw, bool use_ref, std::vector<std::string>* names) {
  const auto& l = pk.layout;
  const int max_rows = gemm_max_rows(p.isa, WeightFormat::qgroup);
  const int out_full = gemm_strip_out_cols(p.isa, l.strip_vecs, p.epi);
  const GemmKernelSet ks =
      make_gemm_kernel_set(p.isa, WeightFormat::qgroup, p.epi, l.tail_vecs,
                           key_for(p, KernelKind::gemm_prefill, 1, 4).variant, false);
  const bool halves = ks.tile_rows && half_strip_kernel(ks.tile_full) && p.M >= ks.tile_rows;
  auto call = [&](KernelKind kind, int m_r, int nv, int64_t s0, int64_t ns, int64_t row0,
                  int64_t blocks, uint16_t extra = 0, int64_t m_tail = 0) {
    KernelKey key = key_for(p, kind, m_r, nv);
    key.variant |= extra;
    GemmArgs args{};
    args.m_tail = m_tail;
    args.a = x.a.data() + row0 * x.lda;
    args.lda = x.lda;
    args.w = pk.w.data() + l.strip_offset(s0);
    args.n_strips = ns;
    args.k4 = l.k4;
    args.a_scale = x.as.data() + row0;
    args.out_rows = out_rows.data() + row0;
    args.out_col = s0 * out_full;
    args.row_weight = rw.data() + row0;
    args.m_blocks = blocks;
    args.g_steps = l.g_steps;
    args.g_per_strip = l.groups();
    args.g_per_super = l.super_groups;
    args.s_per_strip = l.supers();
    args.lut = p.ident ? nullptr : pk.lut;  // identity-table kernels read no table
    args.a_gsum = x.gsum.data() + row0;
    args.a_gsum_ld = x.ld_rows * 4;
    std::vector<uint8_t> scratch;  // the group scales built once a strip (gemm_scratch_bytes)
    if (const int64_t bytes = gemm_scratch_bytes(key, l.k4)) {
      scratch.assign(size_t(bytes), 0xcd);
      args.scratch = scratch.data();
    }
    if (use_ref) {
      gemm_ref(key, args);
    } else {
      const std::string name = test::run_generated(key, args);
      if (names && !name.empty()) names->push_back(name);
    }
  };
  for (int part = 0; part < 2; ++part) {
    const int64_t s0 = part ? l.full_strips : 0;
    const int64_t ns = part ? (l.tail_vecs ? 1 : 0) : l.full_strips;
    const int nv = part ? l.tail_vecs : l.strip_vecs;
    if (ns == 0) continue;
    int64_t row = 0;
    if (halves) {
      const int64_t blocks = p.M / ks.tile_rows;
      const int64_t m_tail = tail_rows_kernel(ks.tile_full) ? p.M - blocks * ks.tile_rows : 0;
      call(KernelKind::gemm_prefill, ks.tile_rows, nv, s0, ns, 0, blocks, kHalfStrips, m_tail);
      row = blocks * ks.tile_rows + m_tail;
    }
    if (p.M - row > max_rows) {  // the rows left run in the same call where the kernel takes them
      const KernelKey pkey = key_for(p, KernelKind::gemm_prefill, max_rows, nv);
      const int64_t m_tail = tail_rows_kernel(pkey) ? (p.M - row) % max_rows : 0;
      call(KernelKind::gemm_prefill, max_rows, nv, s0, ns, row, (p.M - row) / max_rows, 0, m_tail);
      row += (p.M - row) / max_rows * max_rows + m_tail;
    }
    if (p.M > row) call(KernelKind::gemm_decode, int(p.M - row), nv, s0, ns, row, 1);
  }
}

struct Outputs {
  std::vector<float> buf;
  std::vector<float*> rows;
};

Outputs make_outputs(int64_t M, int64_t stride, uint32_t seed) {
  Outputs o;
  o.buf = test::random_floats(size_t(M * stride), seed, 0.5f);
  for (int64_t m = 0; m < M; ++m) o.rows.push_back(o.buf.data() + (M - 1 - m) * stride);
  return o;
}

void check_problem(const Problem& p, std::vector<std::string>* names) {
  const Packed pk = make_weights(p);
  Acts x;
  x.lda = p.K + 8;
  std::mt19937 rng(p.seed + 1);
  std::uniform_int_distribution<int> qd(-127, 127);
  x.a.assign(size_t(p.M * x.lda), 0x55);  // junk beyond K: must not be read
  for (int64_t m = 0; m < p.M; ++m)
    for (int64_t k = 0; k < p.K; ++k) x.a[size_t(m * x.lda + k)] = int8_t(qd(rng));
  x.a[0] = 127;
  x.a[size_t(x.lda - 9)] = -127;
  if (p.extreme)
    for (int64_t m = 0; m < p.M; ++m)
      for (int64_t k = 0; k < p.K; ++k) x.a[size_t(m * x.lda + k)] = 127;
  // what the kernels read: int32 fold kernels take a + 128 (XOR 0x80), as the executor stores it
  Acts xk = x;
  if (p.fold)
    for (int64_t m = 0; m < p.M; ++m) formats::flip_sign_bits(xk.a.data() + m * x.lda, p.K);
  x.as = test::random_floats(size_t(p.M), p.seed + 2, 0.01f);
  for (auto& v : x.as) v = std::fabs(v) + 1e-3f;
  const int64_t groups = p.K / p.G;
  x.ld_rows = p.M + 3;
  x.gsum.assign(size_t(groups * x.ld_rows), 0x7777);
  for (int64_t m = 0; m < p.M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      int32_t s = 0;
      for (int64_t k = g * p.G; k < (g + 1) * p.G; ++k) s += x.a[size_t(m * x.lda + k)];
      x.gsum[size_t(g * x.ld_rows + m)] = s;
    }
  xk.as = x.as;
  xk.gsum = x.gsum;
  xk.ld_rows = x.ld_rows;
  std::vector<float> rw = test::random_floats(size_t(p.M), p.seed + 3, 1.0f);
  const int64_t stride = pk.layout.total_cols() + 16;
  Outputs jit = make_outputs(p.M, stride, p.seed + 4), ref = make_outputs(p.M, stride, p.seed + 4);
  const Outputs before = make_outputs(p.M, stride, p.seed + 4);
  run_all(p, pk, xk, jit.rows, rw, false, names);
  run_all(p, pk, xk, ref.rows, rw, true, nullptr);
  if (std::memcmp(jit.buf.data(), ref.buf.data(), jit.buf.size() * 4) != 0) {
    for (size_t i = 0; i < jit.buf.size(); ++i)
      ASSERT_EQ(jit.buf[i], ref.buf[i]) << p.repro() << " first difference at float " << i;
  }
  if (p.epi != Epilogue::store && p.epi != Epilogue::accum) return;
  // The twin against the sources: (1) the documented fp32 order on unpacked values, exactly;
  // (2) double math over the dequantized weights w = s*c + b, y = a_scale * Σ_k a_k w_k.
  const Source& s = pk.src[0];
  for (int64_t m = 0; m < p.M; ++m)
    for (int64_t n = 0; n < p.N; ++n) {
      float t = 0.0f;
      double want = 0.0, mag = 0.0;
      // int32 folds: per super block the exact sum of sub * group dot products, then
      // t = fma(factor, float(sum), t), with factor and subs as the packer splits the scales
      // int16-lane folds: likewise, and with a bias its exact sum of sub-bias * asum, then
      // t = fma(bias factor, float(that sum), t)
      // fp32 super-block partials: per group ps = fma(float(acc), float(sub), ps), then
      // t = fma(ps, factor, t) at the super block's end; with signed codes (fold) acc is the sum
      // over a + 128, and at the end t = fma(ps - float(128 * sum of sub * code sum), factor, t)
      float fold_f = 0.0f, fold_fb = 0.0f, ps = 0.0f;
      int8_t fold_sub[256] = {}, fold_subb[256] = {};
      int64_t fold_sum = 0, fold_bsum = 0, fold_corr = 0;
      double mag_kernel = 0.0;  // the magnitudes the kernel's fp32 sums meet (a + 128 with fold)
      for (int64_t g = 0; g < groups; ++g) {
        if ((p.fold || p.lanes || p.psums) && g % p.super == 0) {
          ASSERT_TRUE(formats::factor_int8(&s.scales[size_t(n * groups + g)], int(p.super), &fold_f,
                                           fold_sub));
          if (p.bias)
            ASSERT_TRUE(formats::factor_int8(&s.biases[size_t(n * groups + g)], int(p.super),
                                             &fold_fb, fold_subb));
          fold_sum = fold_bsum = fold_corr = 0;
        }
        int64_t acc = 0, asum = 0, csum = 0;
        for (int64_t k = g * p.G; k < (g + 1) * p.G; ++k) {
          const int64_t a = x.a[size_t(m * x.lda + k)];
          acc += a * s.codes[size_t(n * p.K + k)];
          asum += a;
          csum += s.codes[size_t(n * p.K + k)];
          const double wv =
              double(s.scales[size_t(n * groups + g)]) * s.codes[size_t(n * p.K + k)] +
              (p.bias ? double(s.biases[size_t(n * groups + g)]) : 0.0);
          want += double(a) * wv;
          mag += std::fabs(double(a) * wv);
          mag_kernel += std::fabs(double(p.psums && p.fold ? a + 128 : a) * wv);
        }
        if (p.psums) {
          const int64_t sub = fold_sub[g % p.super];
          ps = std::fma(float(p.fold ? acc + 128 * csum : acc), float(sub), ps);
          fold_corr += 128 * sub * csum;
          if (g % p.super == p.super - 1) {
            if (p.fold) ps -= float(fold_corr);
            t = std::fma(ps, fold_f, t);
            ps = 0.0f;
          }
          continue;
        }
        if (p.fold || p.lanes) {
          fold_sum += fold_sub[g % p.super] * acc;
          fold_bsum += fold_subb[g % p.super] * asum;
          if (g % p.super == p.super - 1) {
            t = std::fma(fold_f, float(fold_sum), t);
            if (p.lanes && p.bias) t = std::fma(fold_fb, float(fold_bsum), t);
          }
          continue;
        }
        t = std::fma(s.scales[size_t(n * groups + g)], float(acc), t);
        if (p.bias) t = std::fma(s.biases[size_t(n * groups + g)], float(asum), t);
      }
      const float y = x.as[size_t(m)] * t;
      const float got = ref.rows[size_t(m)][n];
      const float prev = before.rows[size_t(m)][n];
      const float expect = p.epi == Epilogue::store ? y : std::fma(rw[size_t(m)], y, prev);
      ASSERT_EQ(expect, got) << p.repro() << " m=" << m << " n=" << n;
      if (p.epi == Epilogue::store) {
        want *= x.as[size_t(m)];
        ASSERT_NEAR(want, double(got),
                    4e-7 * double(2 * groups + 2) * mag_kernel * x.as[size_t(m)] + 1e-30)
            << p.repro() << " m=" << m << " n=" << n;
      }
    }
}

std::string isa_tag_of(IsaLevel isa);

TEST(QGroup, SweepMatchesReferenceBitwise) {
  // x86 levels natively or in the interpreter; on AArch64 the NEON levels this CPU runs
  if (test::runnable_levels().empty()) GTEST_SKIP() << "this CPU runs no generated level";
  const int64_t Ms[] = {1, 2, 3, 5, 7, 17};
  const int64_t Ns[] = {1, 16, 40, 100};
  const int64_t GKs[][2] = {{16, 16}, {16, 80}, {32, 32}, {32, 160}, {128, 128}, {128, 384}};
  uint32_t seed = 1;
  size_t checked = 0;
  for (IsaLevel isa : test::kernel_test_levels()) {
    std::printf("qgroup sweep: %s (%s)\n", isa_name(isa), test::level_how(isa));
    std::vector<std::string> names;
    for (Epilogue epi : {Epilogue::store, Epilogue::siluup, Epilogue::accum})
      for (bool nib : {false, true})
        for (bool bias : {false, true})
          for (int64_t M : Ms)
            for (int64_t N : Ns)
              for (const auto& gk : GKs) {
                Problem p{isa, epi, nib, bias, M, N, gk[1], gk[0], seed++};
                // offset codes: every other nibble problem whose table allows them, and every
                // other byte problem (its codes then in a narrow range); at the VNNI levels codes
                // that need no offset (c0 = 0: Q4_K's table, bytes in [0, 31]) and tables that are
                // the nibble minus c0 (Q4_0's)
                p.offset = !isa_is_neon(isa) && (p.seed / 4) % 2;
                if (p.offset && (p.c0() < 0 || (qgroup_flip_codes(isa) && p.c0() != 0 &&
                                                !formats::qgroup_identity_table(p.spec(), p.c0()))))
                  p.offset = false;
                // two-level scales on every other problem: one super block over all of K (5
                // groups for K = 80 / 160), or a header per group
                if ((p.seed / 2) % 2) p.super = (p.seed / 8) % 2 ? p.K / p.G : 1;
                // else fp16 / bf16 / fp32 one-level scales in turn
                if (!p.super) p.half = int((p.seed / 16) % 3);
                // int16 group sums on three of four offset problems that allow them
                p.words = p.offset && !qgroup_flip_codes(isa) &&
                          formats::qgroup_int16_sums(p.spec(), p.c0()) && (p.seed / 32) % 4 != 0;
                // (at the VNNI levels always where c0 > 0: their offset kernels take no table)
                p.ident = p.offset && formats::qgroup_identity_table(p.spec(), p.c0()) &&
                          ((p.seed / 64) % 4 != 0 || (qgroup_flip_codes(isa) && p.c0() != 0));
                // int32 super-block folds at avx2 on three of four byte problems with two-level
                // scales and no bias
                if (isa == IsaLevel::avx2 && !nib && !bias && p.super && (p.seed / 128) % 4 != 0) {
                  p.fold = true;
                  p.offset = p.words = p.ident = false;
                }
                // fp32 super-block partials at the VNNI levels on three of four problems with
                // two-level scales and no bias
                p.psums = qgroup_flip_codes(isa) && !bias && p.super && (p.seed / 128) % 4 != 0;
                // with signed codes (int32-fold codes: Q6_K, Q3_K) on every other such byte
                // problem
                p.fold = p.fold || (p.psums && !nib && (p.seed / 512) % 2);
                if (p.fold) p.offset = p.words = p.ident = false;
                check_problem(p, &names);
                if (HasFatalFailure()) return;
                ++checked;
              }
    std::sort(names.begin(), names.end());
    names.erase(std::unique(names.begin(), names.end()), names.end());
    EXPECT_GE(names.size(), 40u) << isa_name(isa);
    // two-level kernels ran, with and without a bias ("qg4s_", "qg8bs_", "qg4u8s_", ...)
    EXPECT_GE(test::count_containing(names, "s_" + std::string(isa_tag_of(isa))), 8u)
        << isa_name(isa);
    EXPECT_GE(test::count_containing(names, "bs_" + std::string(isa_tag_of(isa))), 4u)
        << isa_name(isa);
    // 16-bit scale kernels ran ("qg8h16_", "qg4bu8hbf_", ...)
    EXPECT_GE(test::count_containing(names, "h16_" + std::string(isa_tag_of(isa))), 8u)
        << isa_name(isa);
    EXPECT_GE(test::count_containing(names, "hbf_" + std::string(isa_tag_of(isa))), 8u)
        << isa_name(isa);
    // int16 group sums ran below VNNI ("qg4u8w_", "qg8bu0ws_", ...), 1 and 2-row tiles
    if (!isa_is_neon(isa) && !qgroup_flip_codes(isa)) {
      size_t words = 0;
      for (const auto& n : names)
        words += n.find("w_") != std::string::npos || n.find("ws_") != std::string::npos ||
                 n.find("wh16_") != std::string::npos || n.find("whbf_") != std::string::npos;
      EXPECT_GE(words, 8u) << isa_name(isa);
      EXPECT_GE(test::count_containing(names, "u8i"), 4u) << isa_name(isa);  // Q4_0-like table
      EXPECT_GE(test::count_containing(names, "u0i"), 4u) << isa_name(isa);  // Q4_K-like table
    }
    // int32 super-block folds ran at avx2, 1 and 2-row tiles, tails included; half-strip tiles of
    // the identity int16 sums without a bias (Q4_0-like u8, u0), with fp32, fp16 and bf16 scales
    // (two-level ones and long groups: HalfStripTilesMatchReference), and of the sign step
    // (Q8_0 / IQ4-like: bytes, and nibbles through a table, one- and two-level scales)
    // fp32 super-block partials ran at the VNNI levels, bytes and nibbles, decode and prefill
    if (qgroup_flip_codes(isa)) {
      // codes without an offset (Q4_K-like nibbles, Q5_K-like bytes), with and without a bias
      EXPECT_GE(test::count_containing(names, "qg4u0i"), 4u) << isa_name(isa);
      EXPECT_GE(test::count_containing(names, "qg4bu0i"), 4u) << isa_name(isa);
      EXPECT_GE(test::count_containing(names, "qg8u0"), 4u) << isa_name(isa);
      EXPECT_GE(test::count_containing(names, "qg8bu0"), 4u) << isa_name(isa);
      EXPECT_GE(test::count_containing(names, "u8i"), 4u) << isa_name(isa);  // Q4_0-like table
      EXPECT_GE(test::count_containing(names, "qg8ps_" + std::string(isa_tag_of(isa))), 4u)
          << isa_name(isa);
      EXPECT_GE(test::count_containing(names, "qg4ps_" + std::string(isa_tag_of(isa))), 4u)
          << isa_name(isa);
      EXPECT_GE(test::count_containing(names, "ps_" + std::string(isa_tag_of(isa)) + "_m3"), 1u)
          << isa_name(isa);
      EXPECT_GE(test::count_containing(names, "qg8fps_" + std::string(isa_tag_of(isa))), 4u)
          << isa_name(isa);
    }
    if (isa == IsaLevel::avx2) {
      for (const char* n : {"u8iw_avx2_m4", "u0iw_avx2_m4", "iwh16_avx2_m4", "iwhbf_avx2_m4",
                            "_qg8_avx2_m4", "_qg4_avx2_m4", "_qg4s_avx2_m4", "_qg8h16_avx2_m4"})
        EXPECT_GT(test::count_containing(names, n), 0u) << n;
      EXPECT_EQ(test::count_containing(names, "bu8iw_avx2_m4"), 0u);  // a bias: 2-row tiles
      EXPECT_GE(test::count_containing(names, "qg8fs_avx2_m2"), 3u);
      EXPECT_GE(test::count_containing(names, "qg8fs_avx2_m1"), 6u);
    }
  }
  EXPECT_GT(checked, 0u);
}

// int16-lane super-block folds at avx2 (Q4_K / Q2_K-like: identity nibbles; Q5_K-like: bytes in
// [0, 31] or [0, 32], folded every 4 K steps; two-level scales, with and without a bias): 1-, 2-
// and 4-row tiles, tail strips, super blocks of 2, 4, 8 and 16 groups of 16 and 32 k, one and
// several per strip, every code at its top with every activation 127 (each nibble lane's 16
// products at 30480, each byte lane's 8 at up to 32512) on some; bit for bit against the twin, the
// twin against the per super block order on the sources and against double math (check_problem).
TEST(QGroup, LaneFoldMatchesReference) {
  const auto levels = test::kernel_test_levels();
  if (std::find(levels.begin(), levels.end(), IsaLevel::avx2) == levels.end())
    GTEST_SKIP() << "this CPU runs no avx2 kernels";
  // {G, K, groups per super block}
  const int64_t GKS[][3] = {{32, 256, 8}, {32, 768, 8}, {16, 256, 16}, {16, 128, 4}, {32, 64, 2}};
  uint32_t seed = 7001;  // seed % 4 == 1: the Q4_K table (0 .. 15)
  size_t ran = 0;
  std::vector<std::string> names;
  for (bool nib : {true, false})
    for (Epilogue epi : {Epilogue::store, Epilogue::siluup, Epilogue::accum})
      for (bool bias : {false, true})
        for (int64_t M : {1, 2, 3, 5, 17})
          for (int64_t N : {16, 40, 100})
            for (const auto& gks : GKS) {
              Problem p{IsaLevel::avx2, epi, nib, bias, M, N, gks[1], gks[0], seed};
              seed += 4;
              p.offset = p.words = p.lanes = true;
              p.ident = nib;
              p.super = gks[2];
              p.extreme = (seed / 4) % 5 == 0;
              ASSERT_EQ(p.c0(), 0);
              ASSERT_TRUE(formats::qgroup_lane_fold(p.spec())) << p.repro();
              // nibble lanes hold a whole group; byte lanes (<= 32 * 127 a product) only G 16's
              ASSERT_EQ(formats::qgroup_int16_sums(p.spec(), 0), nib || p.G == 16) << p.repro();
              check_problem(p, &names);
              if (HasFatalFailure()) return;
              ++ran;
            }
  EXPECT_EQ(ran, 2u * 3 * 2 * 5 * 3 * 5);
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  EXPECT_GE(test::count_containing(names, "qg4u0iwls_avx2_m2"), 3u);
  EXPECT_GE(test::count_containing(names, "qg4bu0iwls_avx2_m2"), 3u);
  EXPECT_GE(test::count_containing(names, "qg4bu0iwls_avx2_m1"), 6u);
  // half-strip tiles (4 rows, two passes): full strips and tails, with and without a bias
  for (const char* n : {"qg4u0iwls_avx2_m4n32_store_halves", "qg4bu0iwls_avx2_m4n32_siluup_halves",
                        "qg4bu0iwls_avx2_m4n32_accum_halves", "qg4u0iwls_avx2_m4n8_accum_halves",
                        "qg4bu0iwls_avx2_m4n16_siluup_halves"})
    EXPECT_GT(test::count_containing(names, n), 0u) << n;
  // the byte codes' kernels: 1-, 2- and 4-row tiles, with and without a bias
  EXPECT_GE(test::count_containing(names, "qg8u0wls_avx2_m2"), 3u);
  EXPECT_GE(test::count_containing(names, "qg8bu0wls_avx2_m1"), 6u);
  for (const char* n : {"qg8u0wls_avx2_m4n32_store_halves", "qg8bu0wls_avx2_m4n32_siluup_halves",
                        "qg8bu0wls_avx2_m4n32_accum_halves", "qg8bu0wls_avx2_m4n8_accum_halves"})
    EXPECT_GT(test::count_containing(names, n), 0u) << n;
}

// Where the layer takes int16-lane folds, and the generator refusing them elsewhere.
TEST(QGroup, LaneFoldOnlyWhereItFits) {
  formats::GroupedSpec s;  // Q4_K
  s.group = 32;
  s.super_group = 256;
  s.bias = true;
  s.code_bits = 4;
  std::memcpy(s.lut, kLuts[1], 16);
  EXPECT_TRUE(formats::qgroup_lane_fold(s));
  s.group = 16;  // Q2_K's 16 groups
  EXPECT_TRUE(formats::qgroup_lane_fold(s));
  s.super_group = 512;  // 32 groups: more than the stack holds
  EXPECT_FALSE(formats::qgroup_lane_fold(s));
  s.super_group = 48;  // 3 groups: the bias pairs two
  EXPECT_FALSE(formats::qgroup_lane_fold(s));
  s.group = 64;  // lanes would widen on the way
  s.super_group = 256;
  EXPECT_FALSE(formats::qgroup_lane_fold(s));
  s.group = 32;
  std::memcpy(s.lut, kLuts[0], 16);  // Q4_0's q - 8: an offset
  EXPECT_FALSE(formats::qgroup_lane_fold(s));
  std::memcpy(s.lut, kLuts[1], 16);
  s.super_group = 0;  // one-level scales
  EXPECT_FALSE(formats::qgroup_lane_fold(s));
  s.super_group = 256;
  s.code_bits = 8;  // bytes: Q5_K's 0 .. 31 (folded every 4 K steps)
  s.code_lo = 0;
  s.code_hi = 31;
  EXPECT_TRUE(formats::qgroup_lane_fold(s));
  s.code_hi = 32;  // 8 products of 32 * 127 = 32512
  EXPECT_TRUE(formats::qgroup_lane_fold(s));
  s.code_hi = 33;  // 33528 would overflow
  EXPECT_FALSE(formats::qgroup_lane_fold(s));
  s.code_lo = -1;  // an offset
  s.code_hi = 31;
  EXPECT_FALSE(formats::qgroup_lane_fold(s));
  s.code_lo = -32;  // Q6_K: its int32 folds
  s.int_fold = true;
  EXPECT_FALSE(formats::qgroup_lane_fold(s));
#if !defined(__x86_64__)
  GTEST_SKIP() << "x86 generators only";
#endif
  Problem p{IsaLevel::avx2, Epilogue::siluup, true, true, 2, 64, 256, 32, 1};
  p.offset = p.words = p.ident = p.lanes = true;
  p.super = 8;
  EXPECT_EQ(key_for(p, KernelKind::gemm_prefill, 2, 4).name(),
            "gemm_prefill_qg4bu0iwls_avx2_m2n32_siluup");
  EXPECT_NO_THROW(KernelCache::generate_only(key_for(p, KernelKind::gemm_prefill, 2, 4)));
  for (int drop = 0; drop < 5; ++drop) {  // each required bit gone, or another level
    Problem q = p;
    if (drop == 0) q.words = false;
    if (drop == 1) q.ident = false;
    if (drop == 2) q.offset = false;
    if (drop == 3) q.super = 0;
    if (drop == 4) q.isa = IsaLevel::avx512;
    EXPECT_THROW(KernelCache::generate_only(key_for(q, KernelKind::gemm_decode, 1, 4)),
                 std::invalid_argument)
        << drop;
  }
  Problem b = p;  // Q5_K-like bytes 0 .. 31: no table, so no identity bit
  b.nib = b.ident = false;
  ASSERT_EQ(b.c0(), 0);
  EXPECT_EQ(key_for(b, KernelKind::gemm_prefill, 2, 4).name(),
            "gemm_prefill_qg8bu0wls_avx2_m2n32_siluup");
  EXPECT_NO_THROW(KernelCache::generate_only(key_for(b, KernelKind::gemm_prefill, 2, 4)));
  for (int drop = 0; drop < 3; ++drop) {
    Problem q = b;
    if (drop == 0) q.words = false;
    if (drop == 1) q.offset = false;
    if (drop == 2) q.super = 0;
    EXPECT_THROW(KernelCache::generate_only(key_for(q, KernelKind::gemm_decode, 1, 4)),
                 std::invalid_argument)
        << drop;
  }
}

// The ISA tag kernel names carry ("avx512vnni"), read off a name.
std::string isa_tag_of(IsaLevel isa) {
  KernelKey k;
  k.isa = isa;
  k.format = WeightFormat::int8;
  const std::string n = k.name();  // gemm_decode_int8_<tag>_m1n..
  const size_t b = n.find("int8_") + 5;
  return n.substr(b, n.find('_', b) - b);
}

TEST(QGroup, KernelNamesSpellTheVariant) {
#if !defined(__x86_64__)
  GTEST_SKIP() << "x86 generators only";
#endif
  Problem p{IsaLevel::avx512_vnni, Epilogue::siluup, true, true, 1, 64, 64, 32, 1};
  EXPECT_EQ(key_for(p, KernelKind::gemm_decode, 1, 4).name(),
            "gemm_decode_qg4b_avx512vnni_m1n64_siluup");
  p.nib = false;
  p.bias = false;
  p.isa = IsaLevel::avx2;
  p.epi = Epilogue::accum;
  EXPECT_EQ(key_for(p, KernelKind::gemm_prefill, 1, 4).name(), "gemm_prefill_qg8_avx2_m1n32_accum");
  Problem o{IsaLevel::avx2, Epilogue::store, true, false, 1, 64, 64, 32, 4};  // lut 0: -8 .. 7
  o.offset = true;
  EXPECT_EQ(o.c0(), 8);
  EXPECT_EQ(key_for(o, KernelKind::gemm_decode, 1, 4).name(), "gemm_decode_qg4u8_avx2_m1n32_store");
  o.super = 8;
  EXPECT_EQ(key_for(o, KernelKind::gemm_decode, 1, 4).name(),
            "gemm_decode_qg4u8s_avx2_m1n32_store");
  o.words = true;
  EXPECT_EQ(key_for(o, KernelKind::gemm_decode, 1, 4).name(),
            "gemm_decode_qg4u8ws_avx2_m1n32_store");
  o.ident = true;
  EXPECT_TRUE(formats::qgroup_identity_table(o.spec(), o.c0()));
  EXPECT_FALSE(formats::qgroup_identity_table(o.spec(), 0));
  EXPECT_EQ(key_for(o, KernelKind::gemm_decode, 1, 4).name(),
            "gemm_decode_qg4u8iws_avx2_m1n32_store");
  o.offset = false;  // int16 group sums are an offset-code option
  EXPECT_THROW(KernelCache::generate_only(key_for(o, KernelKind::gemm_decode, 1, 4)),
               std::invalid_argument);
  for (IsaLevel isa :
       {IsaLevel::avx2, IsaLevel::avx512, IsaLevel::avx512_vnni, IsaLevel::avx512_bf16}) {
    p.isa = isa;
    for (uint8_t v = 0; v < 4; ++v) {
      p.nib = v & 1;
      p.bias = v & 2;
      auto k = KernelCache::generate_only(
          key_for(p, KernelKind::gemm_prefill, gemm_max_rows(isa, WeightFormat::qgroup), 4));
      EXPECT_GT(k->code.size(), 100u) << k->name;
    }
  }
  // Impossible tiles are refused (avx2: 2 rows, their fp32 accumulators on the stack).
  p.isa = IsaLevel::avx2;
  EXPECT_EQ(gemm_max_rows(IsaLevel::avx2, WeightFormat::qgroup), 2);
  EXPECT_THROW(KernelCache::generate_only(key_for(p, KernelKind::gemm_decode, 3, 4)),
               std::invalid_argument);
}

// Groups longer than kQGroupI16Steps K steps widen their int16 lanes into int32 on the way: at
// codes + c0 = 15 and activations 127 every step adds 3810 to a lane, so 8 steps reach 30480 and 16
// would wrap. Every tile, both nibble orders of a step pair, G 48 / 64 / 128, against the twin
// bit for bit and the twin against exact math (check_problem).
TEST(QGroup, Int16SumsWidenInLongGroups) {
#if !defined(__x86_64__)
  GTEST_SKIP() << "x86 generators only";
#endif
  size_t ran = 0;
  uint32_t seed = 4000;  // seed % 4 == 0: the q - 8 table (RAWINT4, GPTQ_INT4, Q4_0)
  for (IsaLevel isa : test::kernel_test_levels()) {
    if (qgroup_flip_codes(isa)) continue;  // offset codes are the levels below VNNI
    for (Epilogue epi : {Epilogue::store, Epilogue::siluup, Epilogue::accum})
      for (int64_t G : {48, 64, 128})
        for (int64_t M : {1, 2, 3, 7}) {
          Problem p{isa, epi, true, false, M, 40, 3 * G, G, seed};
          seed += 4;
          p.offset = true;
          p.extreme = true;
          ASSERT_EQ(p.c0(), 8);
          p.words = formats::qgroup_int16_sums(p.spec(), p.c0());
          ASSERT_TRUE(p.words) << G;
          check_problem(p, nullptr);
          if (HasFatalFailure()) return;
          ++ran;
        }
  }
  if (ran == 0) GTEST_SKIP() << "this CPU runs no level below VNNI";
}

// avx2 half-strip tiles (4 rows, two passes of 2 vectors) of the identity int16 group sums
// without a bias, as the executor runs them from 4 rows: Q4_0-like (fp32 and fp16 scales),
// RAWINT4 / GPTQ-like long groups (bf16 scales, lanes widened every 8 steps, at their bound on
// some), and Q3_K-like two-level scales (G 16); bit for bit against the twin (check_problem).
TEST(QGroup, HalfStripTilesMatchReference) {
  const auto levels = test::kernel_test_levels();
  if (std::find(levels.begin(), levels.end(), IsaLevel::avx2) == levels.end())
    GTEST_SKIP() << "this CPU runs no avx2 kernels";
  struct Case {
    int64_t G, K, super;
    int half;
    const char* name;  // of the tile that must have run
  };
  const Case cases[] = {{32, 256, 0, 0, "qg4u8iw_avx2_m4"},
                        {32, 96, 0, 1, "qg4u8iwh16_avx2_m4"},
                        {128, 384, 0, 2, "qg4u8iwhbf_avx2_m4"},
                        {64, 192, 0, 0, "qg4u8iw_avx2_m4"},
                        {16, 256, 16, 0, "qg4u8iws_avx2_m4"}};
  uint32_t seed = 9000;  // seed % 4 == 0: the q - 8 table (c0 8)
  std::vector<std::string> names;
  for (const Case& c : cases)
    for (Epilogue epi : {Epilogue::store, Epilogue::siluup, Epilogue::accum})
      for (int64_t M : {4, 5, 7, 13})
        for (int64_t N : {40, 100}) {
          Problem p{IsaLevel::avx2, epi, true, false, M, N, c.K, c.G, seed};
          seed += 4;
          p.offset = p.ident = true;
          p.super = c.super;
          p.half = c.half;
          p.extreme = (seed / 4) % 3 == 0;
          ASSERT_EQ(p.c0(), 8);
          p.words = formats::qgroup_int16_sums(p.spec(), p.c0());
          ASSERT_TRUE(p.words) << p.repro();
          check_problem(p, &names);
          if (HasFatalFailure()) return;
        }
  for (const Case& c : cases)
    EXPECT_GT(test::count_containing(names, std::string(c.name) + "n32_accum_halves"), 0u)
        << c.name;
  // A bias (Q4_1-like) or an int32 fold keeps 2-row tiles: the generator refuses the bit there.
  for (bool fold : {false, true}) {
    Problem p{IsaLevel::avx2, Epilogue::store, !fold, !fold, 8, 64, 256, fold ? 16 : 32, 1};
    p.offset = p.words = p.ident = !fold;
    p.fold = fold;
    p.super = fold ? 16 : 0;
    KernelKey k = key_for(p, KernelKind::gemm_prefill, 4, 4);
    k.variant |= kHalfStrips;
    EXPECT_FALSE(half_strip_kernel(k)) << k.describe();
    EXPECT_THROW(KernelCache::generate_only(k), std::invalid_argument) << k.describe();
  }
  // tail strips: gate/up of 2 vectors, and down of 1
  EXPECT_GT(test::count_containing(names, "_m4n16_siluup_halves"), 0u);
  EXPECT_GT(test::count_containing(names, "_m4n8_accum_halves"), 0u);
}

// VNNI-level half-strip tiles (6 rows, two passes of 2 vectors) of the byte codes, as the executor
// runs them from 6 rows, the 1-5 rows after the blocks in the same call (m_tail): Q8_0-like
// (fp16 scales), fp32 and bf16 one-level scales (groups of 32 and 128), unsigned two-level byte
// codes (fp32 super-block partials), Q6_K-like signed codes (int32-fold codes with the partials),
// and with a bias Q5_1-like (fp16 scales) and Q5_K-like (two-level: the scale scratch of calls of
// 2 blocks or more) codes, offset (c0 = 0) or not; bit for bit against the twin (check_problem).
// Nibbles keep the 3-row tiles: the generator refuses the bit there.
TEST(QGroup, VnniHalfStripTilesMatchReference) {
  std::vector<IsaLevel> vnni;
  for (IsaLevel isa : test::kernel_test_levels())
    if (isa == IsaLevel::avx512_vnni || isa == IsaLevel::avx512_bf16) vnni.push_back(isa);
  if (vnni.empty()) GTEST_SKIP() << "this CPU runs no VNNI level";
  struct Case {
    int64_t G, K, super;
    int half;
    bool psums, fold, bias;
    const char* name;  // the start of the tile's name that must have run
  };
  const Case cases[] = {{32, 256, 0, 1, false, false, false, "qg8h16_"},
                        {32, 96, 0, 0, false, false, false, "qg8_"},
                        {128, 384, 0, 2, false, false, false, "qg8hbf_"},
                        {16, 256, 16, 0, true, false, false, "qg8ps_"},
                        {16, 512, 16, 0, true, true, false, "qg8fps_"},
                        {32, 256, 0, 1, false, false, true, "qg8b"},
                        {32, 512, 8, 0, false, false, true, "qg8b"}};
  uint32_t seed = 7000;
  for (IsaLevel isa : vnni) {
    std::vector<std::string> names;
    size_t offset = 0;
    for (const Case& c : cases)
      for (Epilogue epi : {Epilogue::store, Epilogue::siluup, Epilogue::accum})
        for (int64_t M : {6, 8, 9, 10, 11, 12, 13})
          for (int64_t N : {40, 72, 100}) {
            Problem p{isa, epi, false, c.bias, M, N, c.K, c.G, seed++};
            p.super = c.super;
            p.half = c.half;
            p.psums = c.psums;
            p.fold = c.fold;
            p.extreme = seed % 5 == 0;
            // bias layers: codes in [0, 31] as unsigned operands (Q5_K's, Q5_1's) where the
            // range allows, else signed
            p.offset = c.bias && (p.seed / 16) % 2;
            if (p.offset && p.c0() != 0) p.offset = false;
            offset += p.offset;
            check_problem(p, &names);
            if (HasFatalFailure()) return;
          }
    EXPECT_GT(offset, 10u);
    const std::string tag = "_" + isa_tag_of(isa) + "_m6n64_";
    for (const Case& c : cases)
      for (const char* epi : {"store", "siluup", "accum"}) {
        size_t n = 0;
        for (const auto& name : names)
          n += name.find(c.name) != std::string::npos &&
               name.find(tag + epi + "_halves") != std::string::npos;
        EXPECT_GT(n, 0u) << c.name << tag << epi;
      }
    EXPECT_GT(test::count_containing(names, "qg8bu0s_" + tag.substr(1)), 0u);    // Q5_K-like
    EXPECT_GT(test::count_containing(names, "qg8bu0h16_" + tag.substr(1)), 0u);  // Q5_1-like
    // tail strips: gate/up of 2 vectors, and down of 1
    EXPECT_GT(test::count_containing(names, "_m6n32_siluup_halves"), 0u) << isa_name(isa);
    EXPECT_GT(test::count_containing(names, "_m6n16_accum_halves"), 0u) << isa_name(isa);
    for (bool bias : {false, true}) {
      Problem p{isa, Epilogue::store, true, bias, 8, 64, 256, 32, 1};
      KernelKey k = key_for(p, KernelKind::gemm_prefill, 6, 4);
      k.variant |= kHalfStrips;
      EXPECT_FALSE(half_strip_kernel(k)) << k.describe();
      EXPECT_THROW(KernelCache::generate_only(k), std::invalid_argument) << k.describe();
    }
  }
}

// Where a group's int16 lanes cannot overflow: (G / 2) * max(code + c0) * 127 <= 32767.
TEST(QGroup, Int16SumsOnlyWhereTheyFit) {
  formats::GroupedSpec s;
  s.code_bits = 4;
  std::memcpy(s.lut, kLuts[0], 16);  // -8 .. 7, c0 8: stored 0 .. 15
  s.group = 32;
  EXPECT_TRUE(formats::qgroup_int16_sums(s, formats::qgroup_code_offset(s)));  // 16 * 15 * 127
  s.group = 64;  // a lane widens every kQGroupI16Steps steps: 16 products, not 32
  EXPECT_TRUE(formats::qgroup_int16_sums(s, 8));
  s.group = 128;
  EXPECT_TRUE(formats::qgroup_int16_sums(s, 8));
  EXPECT_FALSE(formats::qgroup_int16_sums(s, 16));  // 16 * 23 * 127 = 46736
  s.group = 32;
  EXPECT_FALSE(formats::qgroup_int16_sums(s, -1));  // no offset codes
  s.code_bits = 8;
  s.group = 16;
  s.code_lo = -32;  // Q6_K: stored 0 .. 63, 8 * 63 * 127 = 64008
  s.code_hi = 31;
  EXPECT_FALSE(formats::qgroup_int16_sums(s, formats::qgroup_code_offset(s)));
  s.code_lo = -4;  // Q3_K: stored 0 .. 7
  s.code_hi = 3;
  EXPECT_TRUE(formats::qgroup_int16_sums(s, formats::qgroup_code_offset(s)));
  s.code_lo = 0;  // 8 * 32 * 127 = 32512: the largest byte code that fits at G 16
  s.code_hi = 32;
  EXPECT_TRUE(formats::qgroup_int16_sums(s, 0));
  s.code_hi = 33;
  EXPECT_FALSE(formats::qgroup_int16_sums(s, 0));
}

// int32 super-block folds: two-level scales, no bias, byte codes within [-32, 32], super blocks
// of at most 2048 k; the generator refuses them anywhere else, the packer with an offset.
TEST(QGroup, IntFoldOnlyWhereItFits) {
  formats::GroupedSpec s;  // Q6_K
  s.group = 16;
  s.super_group = 256;
  s.code_lo = -32;
  s.code_hi = 31;
  EXPECT_TRUE(formats::qgroup_int_fold(s));
  s.code_hi = 32;  // two steps' pair sums: 2 * 2 * 255 * 32 = 32640 <= 32767
  EXPECT_TRUE(formats::qgroup_int_fold(s));
  s.code_hi = 33;
  EXPECT_FALSE(formats::qgroup_int_fold(s));
  s.code_hi = 31;
  s.code_lo = -33;
  EXPECT_FALSE(formats::qgroup_int_fold(s));
  s.code_lo = -32;
  s.bias = true;  // Q5_K-like: the bias term needs the activation sums
  EXPECT_FALSE(formats::qgroup_int_fold(s));
  s.bias = false;
  s.super_group = 0;  // one-level scales
  EXPECT_FALSE(formats::qgroup_int_fold(s));
  s.super_group = 4096;  // 4096 * 128 * 255 * 32 > 2^31
  EXPECT_FALSE(formats::qgroup_int_fold(s));
  s.super_group = 2048;
  EXPECT_TRUE(formats::qgroup_int_fold(s));
  s.super_group = 256;
  s.code_bits = 4;  // nibbles
  std::memcpy(s.lut, kLuts[0], 16);
  EXPECT_FALSE(formats::qgroup_int_fold(s));
  s.int_fold = true;
  EXPECT_THROW(formats::check_grouped_spec(s, "q"), std::invalid_argument);
  s.code_bits = 8;
  EXPECT_NO_THROW(formats::check_grouped_spec(s, "q"));
  // the header grows by an int32 per column and super block
  formats::GroupedSpec plain = s;
  plain.int_fold = false;
  const auto lf = formats::qgroup_layout(32, 512, 8, kStripVecs, 1, s);
  const auto lp = formats::qgroup_layout(32, 512, 8, kStripVecs, 1, plain);
  EXPECT_EQ(lf.total_bytes() - lp.total_bytes(), 2 * 32 * 4);
  // codes are stored signed: an offset is refused
  std::vector<int8_t> codes(size_t(32 * 512), 1);
  std::vector<float> scales(size_t(32 * 512 / 16), 0.5f);
  formats::GroupedMatrix m{codes.data(), scales.data(), nullptr, 16};
  expect_pack_error(lf, s, {&m, 512, 0, 0, "fold"}, 32, "offset 0");
#if !defined(__x86_64__)
  GTEST_SKIP() << "x86 generators only";
#endif
  // the generator: avx2 two-level byte codes only
  Problem p{IsaLevel::avx2, Epilogue::accum, false, false, 1, 64, 512, 16, 8};
  p.super = 16;
  p.fold = true;
  EXPECT_EQ(key_for(p, KernelKind::gemm_prefill, 2, 4).name(),
            "gemm_prefill_qg8fs_avx2_m2n32_accum");
  EXPECT_NO_THROW(KernelCache::generate_only(key_for(p, KernelKind::gemm_prefill, 2, 4)));
  Problem q = p;
  q.isa = IsaLevel::avx512;
  EXPECT_THROW(KernelCache::generate_only(key_for(q, KernelKind::gemm_decode, 1, 4)),
               std::invalid_argument);
  q = p;
  q.bias = true;
  EXPECT_THROW(KernelCache::generate_only(key_for(q, KernelKind::gemm_decode, 1, 4)),
               std::invalid_argument);
  q = p;
  q.super = 0;
  EXPECT_THROW(KernelCache::generate_only(key_for(q, KernelKind::gemm_decode, 1, 4)),
               std::invalid_argument);
}

TEST(QGroup, PackerNamesBadCodesAndGroups) {
  formats::GroupedSpec spec;
  spec.group = 32;
  spec.code_bits = 4;
  std::memcpy(spec.lut, kLuts[0], 16);  // -8 .. 7
  const int64_t N = 5, K = 64;
  std::vector<int8_t> codes(size_t(N * K), 3);
  codes[size_t(2 * K + 37)] = 9;  // not in the table
  std::vector<float> scales(size_t(N * K / 32), 1.0f);
  formats::GroupedMatrix m{codes.data(), scales.data(), nullptr, 32};
  auto l = formats::qgroup_layout(N, K, 16, kStripVecs, 1, spec);
  std::vector<int8_t> out(size_t(l.total_bytes()));
  formats::GroupedSlice sl{&m, K, 0, 0, "expert 4 gate"};
  expect_pack_error(l, spec, sl, 128, "expert 4 gate: row 2 column 37: code 9");
  m.group = 16;
  EXPECT_THROW(formats::pack_qgroup_strips(l, spec, &sl, 128, out.data()), std::invalid_argument);
  m.group = 32;
  // byte codes outside the spec's range (Q6_K: -32 .. 31) are refused, named
  formats::GroupedSpec q6;
  q6.group = 32;
  q6.code_lo = -32;
  q6.code_hi = 31;
  codes[size_t(2 * K + 37)] = 32;
  auto l8 = formats::qgroup_layout(N, K, 16, kStripVecs, 1, q6);
  expect_pack_error(l8, q6, sl, 32, "row 2 column 37: code 32 is outside the layer's [-32, 31]");
  // offsets: the smallest power of two that lifts the codes to >= 0, if they then fit [0, 129]
  EXPECT_EQ(formats::qgroup_code_offset(q6), 32);
  q6.code_lo = 0;
  EXPECT_EQ(formats::qgroup_code_offset(q6), 0);
  q6.code_lo = -16;
  q6.code_hi = 15;
  EXPECT_EQ(formats::qgroup_code_offset(q6), 16);
  q6.code_lo = -128;
  q6.code_hi = 127;
  EXPECT_EQ(formats::qgroup_code_offset(q6), -1);   // Q8_0
  EXPECT_EQ(formats::qgroup_code_offset(spec), 8);  // the -8 .. 7 table
  std::memcpy(spec.lut, kLuts[2], 16);
  EXPECT_EQ(formats::qgroup_code_offset(spec), -1);  // IQ4's table
  q6.code_lo = 5;
  q6.code_hi = 4;
  EXPECT_THROW(formats::check_grouped_spec(q6, "q"), std::invalid_argument);
  spec.group = 24;
  EXPECT_THROW(formats::qgroup_layout(N, K, 16, kStripVecs, 1, spec), std::invalid_argument);
  EXPECT_EQ(formats::qgroup_shard_bounds(160, 32, 2), (std::vector<int64_t>{0, 64, 160}));
  EXPECT_EQ(formats::qgroup_shard_bounds(64, 32, 4), (std::vector<int64_t>{0, 32, 64}));
}

#if !defined(__aarch64__)
// A prefill call of fewer than 8 blocks at the AVX-512 levels (avx512 and avx512_bf16 checked)
// prefetches the next strip from every tile, each its rows' share (jit/x64/gemm.cpp pf_var_,
// qg_pf_var_setup): run over strips 0-1 in the interpreter, which logs each prefetch, it must ask
// for every line of strips 1 and 2 (the bytes after the call's last strip) and for no weight line
// outside them but the last sites' reach. Layouts as Q4_K's (nibbles, sub-scales and sub-biases,
// super blocks of 8 groups), Q4_0's and Q8_0's (fp16 scales), Q6_K's (bytes, groups of 16, super
// blocks of 16) and Q5_K's (bytes with sub-biases, super blocks of 8 groups).
TEST(QGroup, PrefillPrefetchCoversTheNextStrip) {
  for (const IsaLevel isa : {IsaLevel::avx512, IsaLevel::avx512_bf16}) {
    struct Layout {
      const char* name;
      bool nib, bias;
      int64_t G, super;
      int half;
    };
    const Layout layouts[] = {{"Q4_K", true, true, 32, 8, 0},
                              {"Q4_0", true, false, 32, 0, 1},
                              {"Q8_0", false, false, 32, 0, 1},
                              {"Q6_K", false, false, 16, 16, 0},
                              {"Q5_K", false, true, 32, 8, 0}};
    // (and, at the VNNI level, the byte codes' half-strip tiles: 6 rows, two passes a tile, the
    // rows after the blocks in the same call; Q6_K as the executor runs it there, signed codes
    // with the fp32 super-block partials; Q5_K's with the scale scratch of 2 blocks or more)
    for (const bool halves : {false, true})
      for (const Layout& lay : layouts) {
        if (halves && (isa != IsaLevel::avx512_bf16 || lay.nib)) continue;
        const int mr = halves ? kHalfStripRowsVnni : gemm_max_rows(isa, WeightFormat::qgroup);
        // (the calls whose blocks share the strip: fewer than 8 blocks, 4 of two passes)
        for (int rows = halves ? mr : 1; rows < (halves ? 4 : 8) * mr; ++rows) {
          Problem p{isa, Epilogue::store, lay.nib, lay.bias, rows, 3 * 64, 512, lay.G, 7};
          p.super = lay.super;
          p.half = lay.half;
          p.psums = p.fold = halves && lay.super && !lay.bias;
          const Packed pk = make_weights(p);
          const auto& l = pk.layout;
          ASSERT_EQ(l.full_strips, 3);
          KernelKey key = key_for(p, KernelKind::gemm_prefill, mr, kStripVecs);
          if (halves) key.variant |= kHalfStrips;
          const PrefillSplit sp = prefill_split(key, rows);
          const int64_t strip = l.strip_offset(1) - l.strip_offset(0);
          AlignedBuffer w(size_t(l.total_bytes() + 64 * 64));  // (with room past the strips)
          std::memcpy(w.as<uint8_t>(), pk.w.data(), pk.w.size());
          std::vector<int8_t> a(size_t(rows * p.K), 1);
          std::vector<float> a_scale(size_t(rows), 1.0f), rw(size_t(rows), 1.0f);
          std::vector<int32_t> gsum(size_t(rows * p.K / p.G), 0);
          std::vector<float> out(size_t(rows * p.N), 0.0f);
          std::vector<float*> out_rows;
          for (int r = 0; r < rows; ++r) out_rows.push_back(out.data() + r * p.N);
          std::vector<uint8_t> scratch(
              size_t(std::max<int64_t>(gemm_scratch_bytes(key, l.k4), 64)));
          GemmArgs args{};
          args.a = a.data();
          args.lda = p.K;
          args.w = w.as<int8_t>();
          args.n_strips = 2;
          args.k4 = l.k4;
          args.a_scale = a_scale.data();
          args.out_rows = out_rows.data();
          args.row_weight = rw.data();
          args.m_blocks = sp.blocks;
          args.m_tail = sp.tail;
          args.g_steps = l.g_steps;
          args.g_per_strip = l.groups();
          args.g_per_super = l.super_groups;
          args.s_per_strip = l.supers();
          args.lut = pk.lut;
          args.a_gsum = gsum.data();
          args.a_gsum_ld = rows * 4;
          args.scratch = scratch.data();
          // the lines a site touches: two K steps' codes (a half-strip pass's: one step's)
          const uint64_t reach = lay.nib || halves ? 4 : 8;
          const auto [missed, outside] = test::prefetch_cover(key, args, strip, w.size(), reach);
          EXPECT_EQ(missed, 0) << isa_name(isa) << " " << lay.name << " " << rows << " rows ("
                               << sp.blocks << " blocks, tail " << sp.tail
                               << "): lines of the next strips never prefetched";
          EXPECT_EQ(outside, 0) << isa_name(isa) << " " << lay.name << " " << rows
                                << " rows: prefetches outside them";
        }
      }
  }
}
#endif

// Two-level scales: factor_int8 splits K-quant-like scales exactly (sub-scale -128 and zeros of
// d's sign included) and refuses what has no exact split; the packer names the super block.
TEST(QGroup, TwoLevelScalesFactorExactly) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> dd(-0.05f, 0.05f);
  std::uniform_int_distribution<int> sub(-128, 127);
  for (int trial = 0; trial < 2000; ++trial) {
    const float d = fp16_like(dd(rng));
    float x[16];
    const int n = 1 + trial % 16;
    for (int i = 0; i < n; ++i) x[i] = d * float(trial % 5 == 0 && i == 1 ? 0 : sub(rng));
    if (trial % 3 == 0) x[0] = d * -128.0f;
    float f;
    int8_t q[16];
    ASSERT_TRUE(formats::factor_int8(x, n, &f, q)) << "trial " << trial << " d " << d;
    for (int i = 0; i < n; ++i) {
      const float back = f * float(q[i]);
      ASSERT_EQ(0, std::memcmp(&back, &x[i], 4)) << "trial " << trial << " i " << i;
    }
  }
  float f;
  int8_t q[4];
  const float all_zero[2] = {-0.0f, -0.0f};
  ASSERT_TRUE(formats::factor_int8(all_zero, 2, &f, q));
  EXPECT_TRUE(std::signbit(f * float(q[0])));
  const float bad[][2] = {{1.0f, 255.0f},           // 255 > 127 times any common factor
                          {1.0f, 1.0f + 0x1p-23f},  // mantissas too far apart
                          {0.0f, -0.0f},            // zeros of both signs
                          {1.0f, INFINITY},
                          {NAN, 1.0f}};
  for (const auto& b : bad) EXPECT_FALSE(formats::factor_int8(b, 2, &f, q)) << b[0] << " " << b[1];
  // the packer: a super block whose scales do not split is named
  formats::GroupedSpec spec;
  spec.group = 16;
  spec.super_group = 32;
  const int64_t N = 3, K = 64;
  std::vector<int8_t> codes(size_t(N * K), 1);
  std::vector<float> scales(size_t(N * K / 16), 0.5f);
  scales[2 * 4 + 3] = 0.5f * 255.0f;  // row 2, super block 1
  formats::GroupedMatrix m{codes.data(), scales.data(), nullptr, 16};
  auto l = formats::qgroup_layout(N, K, 8, kStripVecs, 1, spec);
  EXPECT_EQ(l.total_bytes(), 8 * (K + 4 * 1 + 2 * 4));  // per column: codes, subs, factors
  formats::GroupedSlice sl{&m, K, 0, 0, "expert 1 down"};
  expect_pack_error(l, spec, sl, 0, "expert 1 down: row 2 super block 1: the scales");
  // 16-bit scales: a value the type does not hold is refused, named
  formats::GroupedSpec h16;
  h16.group = 16;
  h16.scale_dtype = formats::FloatType::f16;
  scales.assign(scales.size(), 0.5f);
  scales[1 * 4 + 2] = 0.1f;  // row 1, group 2
  auto lh = formats::qgroup_layout(N, K, 8, kStripVecs, 1, h16);
  EXPECT_EQ(lh.total_bytes(), 8 * (K + 4 * 2));  // per column: codes, 4 f16 scales
  expect_pack_error(lh, h16, sl, 0, "expert 1 down: row 1 group 2: scale 0.1");
  h16.super_group = 32;  // two-level scales keep fp32 factors
  EXPECT_THROW(formats::check_grouped_spec(h16, "q"), std::invalid_argument);
  spec.super_group = 40;  // not a multiple of the group
  EXPECT_THROW(formats::check_grouped_spec(spec, "q"), std::invalid_argument);
  spec.super_group = 48;  // K = 64 is not whole super blocks
  EXPECT_THROW(formats::qgroup_layout(N, K, 8, kStripVecs, 1, spec), std::invalid_argument);
}

// The executor end to end: MoELayer with grouped experts (shards, bytes/nibbles, bias) against its
// reference-twin forward (bitwise) and a float64 MoE with the same int8 activation quantization.
TEST(QGroup, MoELayerMatchesTwinAndMath) {
  const int64_t E = 4, K = 2, H = 64, I = 96;
  ThreadPool pool(2, 1);
  // 0: bytes; 1: IQ4-like tables with a bias; 2: Q4_0 gate/up, Q4_K-style down with a bias
  // (the offset-code kernels at avx2: c0 = 8 and 0); 3: Q4_K-style gate/up and Q6_K-style down
  // with two-level scales (super blocks of 2 groups; d * integer sub-scales); 4: Q4_1-style gate/up
  // with bf16 scales and biases, Q8_0-style down with f16 scales
  for (int variant = 0; variant < 5; ++variant) {
    formats::GroupedSpec gu, dn;
    gu.group = 32;
    dn.group = 16;
    gu.bias = variant == 1 || variant == 3 || variant == 4;
    dn.bias = variant == 1 || variant == 2;
    if (variant >= 1) {
      gu.code_bits = 4;
      std::memcpy(gu.lut, kLuts[variant == 1 ? 2 : variant == 2 ? 0 : 1], 16);
    }
    if (variant == 4) {
      gu.scale_dtype = formats::FloatType::bf16;
      dn.scale_dtype = formats::FloatType::f16;
    }
    if (variant == 1 || variant == 2) {
      dn.code_bits = 4;
      std::memcpy(dn.lut, kLuts[variant == 1 ? 3 : 1], 16);
    }
    if (variant == 3) {
      gu.super_group = 64;
      dn.super_group = 32;
      dn.code_lo = -32;
      dn.code_hi = 31;
    }
    std::mt19937 rng(11 + variant);
    std::uniform_int_distribution<int> code(-128, 127), nib(0, 15);
    std::uniform_real_distribution<float> sd(0.0002f, 0.0006f), bd(-0.01f, 0.01f);
    struct Mat {
      std::vector<int8_t> c;
      std::vector<float> s, b;
      std::vector<double> w;  // dequantized
    };
    auto make = [&](int64_t n, int64_t k, const formats::GroupedSpec& sp) {
      Mat m;
      m.c.resize(size_t(n * k));
      for (auto& v : m.c)
        v = sp.code_bits == 4 ? sp.lut[nib(rng)]
                              : int8_t(std::clamp(code(rng), sp.code_lo, sp.code_hi));
      m.s.resize(size_t(n * k / sp.group));
      for (auto& v : m.s) v = sd(rng) * (sp.code_bits == 4 ? 8.0f : 1.0f);
      if (sp.bias) {
        m.b.resize(m.s.size());
        for (auto& v : m.b) v = bd(rng);
      }
      if (sp.super_group) {  // d per (row, super block) times integer sub-scales, as K-quants
        const size_t per = size_t(sp.super_group / sp.group);
        std::uniform_int_distribution<int> sub(0, 63);
        for (auto* vs : {&m.s, &m.b})
          for (size_t i = 0; i < vs->size(); i += per) {
            const float d = fp16_like((*vs)[i] / 32.0f);
            for (size_t j = i; j < i + per; ++j) (*vs)[j] = d * float(sub(rng));
          }
      }
      for (auto* vs : {&m.s, &m.b})  // 16-bit scales: values of that type
        for (float& x : *vs) x = as_scale_type(x, sp.scale_dtype);
      for (int64_t r = 0; r < n; ++r)
        for (int64_t c = 0; c < k; ++c) {
          const size_t g = size_t(r * (k / sp.group) + c / sp.group);
          m.w.push_back(double(m.s[g]) * m.c[size_t(r * k + c)] + (sp.bias ? m.b[g] : 0.0));
        }
      return m;
    };
    std::vector<Mat> mats;
    for (int64_t e = 0; e < E; ++e) {
      mats.push_back(make(I, H, gu));
      mats.push_back(make(I, H, gu));
      mats.push_back(make(H, I, dn));
    }
    auto view = [&](const Mat& m, int64_t g) {
      return formats::GroupedMatrix{m.c.data(), m.s.data(), m.b.empty() ? nullptr : m.b.data(), g};
    };
    std::vector<MoELayer::GroupedExpertSource> src;
    for (int64_t e = 0; e < E; ++e)
      src.push_back({e, view(mats[size_t(3 * e)], 32), view(mats[size_t(3 * e + 1)], 32),
                     view(mats[size_t(3 * e + 2)], 16)});
    if (variant == 3) {  // two-level scales keep fewer bytes: int8 subs, fp32 per super block
      MoELayer one({E, K, H, I}, "LLAMAFILE", IsaLevel::ref, {0, I}, gu, dn);
      formats::GroupedSpec gu1 = gu, dn1 = dn;
      gu1.super_group = dn1.super_group = 0;
      MoELayer fp32({E, K, H, I}, "LLAMAFILE", IsaLevel::ref, {0, I}, gu1, dn1);
      one.load_experts_grouped(src, pool);
      fp32.load_experts_grouped(src, pool);
      // per gate/up row: scale + bias 2 bytes (fp32: 8) per group of 32, + 8 per super block
      // of 64; per down row: 1 byte (fp32: 4) per 16, + 4 per 32
      EXPECT_EQ(fp32.packed_bytes() - one.packed_bytes(),
                size_t(E * (2 * I * (H / 32 * 6 - H / 64 * 8) + H * (I / 16 * 3 - I / 32 * 4))));
    }
    const std::vector<int64_t> bounds = {0, 32, 96};
    // avx2 too where it runs (an AVX-512 CPU selects another level): its offset codes and int32
    // super-block folds are executor choices of that level only
    std::vector<IsaLevel> levels = {selected_isa(), IsaLevel::ref};
    const auto run = test::runnable_levels();
    if (selected_isa() != IsaLevel::avx2 &&
        std::find(run.begin(), run.end(), IsaLevel::avx2) != run.end())
      levels.push_back(IsaLevel::avx2);
    for (IsaLevel isa : levels) {
      MoELayer layer({E, K, H, I}, "LLAMAFILE", isa, bounds, gu, dn);
      layer.load_experts_grouped(src, pool);
      ASSERT_TRUE(layer.loaded());
      if (isa == IsaLevel::avx2) {  // Q6_K-style down takes the int32 folds, gate/up does not
        size_t fold_gu = 0, fold_dn = 0;
        for (const auto& n : layer.kernel_names()) {
          fold_gu += n.find("fs_") != std::string::npos && n.find("siluup") != std::string::npos;
          fold_dn += n.find("fs_") != std::string::npos && n.find("accum") != std::string::npos;
        }
        EXPECT_EQ(fold_gu, 0u);
        if (variant == 3)
          EXPECT_GT(fold_dn, 0u);
        else
          EXPECT_EQ(fold_dn, 0u);
      }
      for (int64_t T : {1, 9}) {
        std::vector<float> x = test::random_floats(size_t(T * H), uint32_t(T), 1.0f);
        std::vector<int64_t> ids;
        std::vector<float> w;
        for (int64_t t = 0; t < T; ++t)
          for (int64_t j = 0; j < K; ++j) {
            ids.push_back((t + 3 * j) % E);
            w.push_back(0.25f + 0.5f * float(j));
          }
        std::vector<float> out(size_t(T * H)), twin(size_t(T * H));
        layer.forward(T, x.data(), ids.data(), w.data(), nullptr, out.data(), pool);
        layer.forward(T, x.data(), ids.data(), w.data(), nullptr, twin.data(), pool, true);
        ASSERT_EQ(0, std::memcmp(out.data(), twin.data(), out.size() * 4))
            << "variant " << variant << " isa " << isa_name(isa) << " T " << T;
        // float64 reference with the kernels' activation quantization.
        double num = 0, den = 0;
        for (int64_t t = 0; t < T; ++t) {
          std::vector<int8_t> xq(static_cast<size_t>(H));
          const double xd = formats::quantize_row_int8(x.data() + t * H, H, xq.data());
          std::vector<double> y(size_t(H), 0.0);
          for (int64_t j = 0; j < K; ++j) {
            const int64_t e = ids[size_t(t * K + j)];
            const Mat &mg = mats[size_t(3 * e)], &mu = mats[size_t(3 * e + 1)],
                      &md = mats[size_t(3 * e + 2)];
            std::vector<float> h(static_cast<size_t>(I));
            for (int64_t i = 0; i < I; ++i) {
              double g = 0, u = 0;
              for (int64_t k = 0; k < H; ++k) {
                g += xq[size_t(k)] * mg.w[size_t(i * H + k)];
                u += xq[size_t(k)] * mu.w[size_t(i * H + k)];
              }
              g *= xd;
              u *= xd;
              h[size_t(i)] = float(g / (1.0 + std::exp(-g)) * u);
            }
            for (size_t b = 0; b + 1 < bounds.size(); ++b) {
              const int64_t i0 = bounds[b], n = bounds[b + 1] - i0;
              std::vector<int8_t> hq(static_cast<size_t>(n));
              const double hd = formats::quantize_row_int8(h.data() + i0, n, hq.data());
              for (int64_t c = 0; c < H; ++c) {
                double acc = 0;
                for (int64_t i = 0; i < n; ++i) acc += hq[size_t(i)] * md.w[size_t(c * I + i0 + i)];
                y[size_t(c)] += double(w[size_t(t * K + j)]) * acc * hd;
              }
            }
          }
          for (int64_t c = 0; c < H; ++c) {
            num += std::fabs(double(out[size_t(t * H + c)]) - y[size_t(c)]);
            den += std::fabs(y[size_t(c)]);
          }
        }
        EXPECT_LE(num / den, 1e-3)
            << "variant " << variant << " isa " << isa_name(isa) << " T " << T;
      }
    }
  }
  // Bounds off the down group and a missing spec are refused with the reason.
  formats::GroupedSpec g32;
  EXPECT_THROW(MoELayer({E, K, H, I}, "RAWINT4", IsaLevel::ref, {0, 40, 96}, g32, g32),
               std::invalid_argument);
  EXPECT_THROW(MoELayer({E, K, H, I}, "GPTQ_INT4", IsaLevel::ref), std::invalid_argument);
  EXPECT_EQ(MoELayer::grouped_shard_bounds(I, 32, 2), (std::vector<int64_t>{0, 32, 96}));
}

}  // namespace
}  // namespace ktjit
