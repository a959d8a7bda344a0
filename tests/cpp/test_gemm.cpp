// Kernel sweep: every generated INT8 kernel at every ISA level this machine runs, over tail-heavy
// shapes, against the reference kernel (bit for bit) and the reference against plain int64 math.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <sstream>
#include <tuple>

#include "formats/convert.hpp"
#include "formats/int8.hpp"
#include "jit/gemm.hpp"
#include "jit/kernel.hpp"
#if !defined(__aarch64__)
#include "jit/x64/gemm.hpp"
#endif
#include "kernel_exec.hpp"
#include "runtime/moe_layer.hpp"
#include "test_util.hpp"

namespace ktjit {
namespace {

struct Problem {
  IsaLevel isa;
  WeightFormat fmt;
  Epilogue epi;
  int64_t M, N, K;
  uint32_t seed;
  // fp8: run strip-scratch tiles (jit/gemm.hpp strip_scratch_kernel) even where the executor does
  // not pick them (avx512, avx512_vnni); where it does (avx2, K even) they run anyway.
  bool scratch_tiles = false;
  // Every weight at its most negative code and every activation 127 (a + 128 = 255 where the
  // level offsets them): the largest int16 / int32 partial sums a kernel can meet.
  bool extreme = false;
  // fp8 at avx512_bf16 with K even runs the kBf16Pairs kernels (bf16 activations) as the executor
  // does (jit/gemm.hpp fp8_pair_kernel): from kPairTileRows rows prefill blocks of 6 rows with the
  // rest as the call's short tile (GemmArgs::m_tail; 5 rows: that tile alone), else a decode tile
  // of 1-4 rows.
  bool fp8_pairs() const {
    return isa == IsaLevel::avx512_bf16 && fmt == WeightFormat::fp8 && K % 2 == 0;
  }
  static constexpr int64_t kPairTileRows = 5;  // the executor's GemmKernelSet::tile_min_rows
  // fp8 pairs: every row as the pair prefill kernel's short tile of a call without blocks, even
  // below kPairTileRows (the tile decodes the strip itself there; the executor sends only 5).
  bool tail_alone = false;
  // Strip width in vectors (int8 at avx512_bf16: 2, its 12-row tiles, strip_vecs_for)
  int strip_vecs = kStripVecs;
  std::string repro() const {
    std::ostringstream s;
    s << "repro: KT_JIT_ISA=" << isa_name(isa) << " fmt=" << int(fmt) << " epi=" << int(epi)
      << " M=" << M << " N=" << N << " K=" << K << " seed=" << seed << " strip_vecs=" << strip_vecs;
    return s.str();
  }
};

struct Packed {
  formats::StripLayout layout;
  std::vector<int8_t> w;
  std::vector<float> scale;
  std::vector<int32_t> comp;
  std::vector<std::vector<int8_t>> q;  // per source, N x K (integer formats)
  std::vector<std::vector<float>> d;
  std::vector<std::vector<float>> wf;    // per source, N x K (bf16: the values before rounding)
  std::vector<std::vector<uint8_t>> w8;  // per source, N x K e4m3 bytes (fp8)
  std::vector<std::vector<float>> bs;    // per source, fp8 block or row scales
  std::vector<float> gscale;             // fp8 group scale table
  bool fp8_block = false;
};

using test::e4m3_value;

Packed make_weights(const Problem& p) {
  Packed pk;
  const int sources = p.epi == Epilogue::siluup ? 2 : 1;
  const bool int4 = p.fmt == WeightFormat::int4;
  const bool bf16 = p.fmt == WeightFormat::bf16;
  const bool fp8 = p.fmt == WeightFormat::fp8;
  pk.fp8_block = fp8 && p.seed % 2 == 0;  // alternate 128x128 block scales and row scales
  const int bits = bf16 ? 16 : int4 ? 4 : 8;
  // fp8 pair kernels: full strips in the pair order (the executor's layout at avx512_bf16) on two
  // problems of three, [k][column] (isa amx's, same kernels without kFp8PairOrder) on the third;
  // the pair order keeps row scales in 128-k groups too, as the executor packs it
  const bool po = p.fp8_pairs() && p.seed % 3 != 0;
  pk.layout = formats::StripLayout::make(p.N, p.K, vec_lanes(p.isa), p.strip_vecs, sources, bits,
                                         fp8    ? 1
                                         : bf16 ? bf16_kgroup(p.isa)
                                                : 0,
                                         fp8 ? (pk.fp8_block || po ? 128 : p.K) : 0);
  pk.layout.fp8_pair_order = po;
  pk.w.resize(size_t(pk.layout.total_bytes()));
  pk.scale.resize(size_t(pk.layout.total_cols()));
  pk.comp.resize(size_t(pk.layout.total_cols()));
  if (fp8) {
    test::pack_random_fp8(pk.layout, p.N, p.K, p.seed, pk.fp8_block, pk.w.data(), pk.scale.data(),
                          pk.comp.data(), pk.w8, pk.bs, pk.gscale);
    return pk;
  }
  if (bf16) {
    for (int s = 0; s < sources; ++s)
      pk.wf.push_back(test::random_floats(size_t(p.N * p.K), p.seed + 10 * uint32_t(s), 0.1f));
    const float* ws[2] = {pk.wf[0].data(), pk.wf.back().data()};
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
    // int4: 16 * [-8, 7]; `extreme`: the largest products (int4: q4 = 7, the code 15 of
    // int4_offset_nibbles, against a = +-127)
    for (auto& x : pk.q.back())
      x = p.extreme ? int8_t(int4 ? 112 : -127)
                    : int8_t(int4 ? 16 * (int(rng() % 16) - 8) : qd(rng));
    for (auto& x : pk.d.back()) x = sd(rng);
  }
  const int8_t* qs[2] = {pk.q[0].data(), pk.q.back().data()};
  const float* ds[2] = {pk.d[0].data(), pk.d.back().data()};
  formats::pack_int8_strips(pk.layout, qs, ds, pk.w.data(), pk.scale.data(), pk.comp.data(),
                            int4_offset_nibbles(p.isa, p.fmt));
  return pk;
}

KernelKey key_for(IsaLevel isa, KernelKind kind, int m_r, int n_vec, Epilogue epi,
                  WeightFormat fmt = WeightFormat::int8) {
  KernelKey k;
  k.kind = kind;
  k.isa = isa;
  k.format = fmt;
  k.m_r = uint8_t(m_r);
  k.n_vec = uint8_t(n_vec);
  k.epilogue = epi;
  return k;
}

// Runs all M rows over all strips the way the executor does: prefill blocks + a decode remainder,
// full strips then the tail strip. `use_ref` swaps every kernel for its reference twin.
void run_all(const Problem& p, const Packed& pk, const std::vector<int8_t>& a, int64_t lda,
             const std::vector<float>& as, std::vector<float*>& out_rows,
             const std::vector<float>& rw, bool use_ref, std::vector<std::string>* names) {
  const auto& l = pk.layout;
  const int max_rows = gemm_max_rows(p.isa, p.fmt);
  const int prefill_rows = gemm_prefill_rows(p.isa, p.fmt, l.strip_vecs);  // (int8 2v: 12)
  const int full_cols = l.strip_cols(l.strip_vecs);
  const int out_full = gemm_strip_out_cols(p.isa, l.strip_vecs, p.epi);
  // The executor's tile tier where the level has one for the format (make_gemm_kernel_set: fp8
  // strip-scratch tiles at avx2 with K even, int4 half-strip tiles at avx2), then prefill and
  // decode kernels for the rest.
  const GemmKernelSet ks = make_gemm_kernel_set(p.isa, p.fmt, p.epi, l.tail_vecs, 0, p.K % 2 == 0);
  const bool exec_tiles =
      ks.tile_rows && (strip_scratch_kernel(ks.tile_full) || half_strip_kernel(ks.tile_full));
  std::vector<int32_t> row_sums(size_t(p.M), 0);
  if (int4_int16_sums(p.isa, p.fmt))
    for (int64_t m = 0; m < p.M; ++m)
      for (int64_t k = 0; k < l.k; ++k) row_sums[size_t(m)] += a[size_t(m * lda + k)];
  const int tile_rows = exec_tiles ? ks.tile_rows : gemm_max_rows(p.isa, WeightFormat::bf16);
  const uint16_t tile_variant = exec_tiles ? ks.tile_full.variant : uint16_t(kStripScratch);
  const bool tiles = (exec_tiles || (p.scratch_tiles && p.K % 2 == 0)) && p.M >= tile_rows;
  auto call = [&](KernelKind kind, int m_r, int nv, int64_t s0, int64_t ns, int64_t row0,
                  int64_t blocks, uint16_t variant = 0, int64_t m_tail = 0) {
    KernelKey key = key_for(p.isa, kind, m_r, nv, p.epi, p.fmt);
    key.variant = variant;
    if (p.fp8_pairs()) key.variant = uint16_t(kBf16Pairs | (l.fp8_pair_order ? kFp8PairOrder : 0));
    // avx2 fp8 decode of 1-2 rows: the fp32-domain widen (the executor's choice on AMD) on two
    // problems of three, the fp16 route on the third
    if (p.fmt == WeightFormat::fp8 && p.isa == IsaLevel::avx2 && kind == KernelKind::gemm_decode &&
        m_r <= 2 && p.seed % 3 != 0)
      key.variant = kFp8Fp32Widen;
    GemmArgs args{};
    std::vector<uint8_t> scratch;  // the strip as k pairs (gemm_scratch_bytes)
    if (gemm_scratch_bytes(key, l.k4)) {
      scratch.resize(size_t(gemm_scratch_bytes(key, l.k4)));
      args.scratch = scratch.data();
    }
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
    args.m_tail = m_tail;
    args.w_gscale =
        pk.gscale.empty() ? nullptr : pk.gscale.data() + s0 * l.gscale_floats_per_strip();
    args.g_steps = l.g_steps;
    args.g_per_strip = l.groups();
    if (int4_int16_sums(p.isa, p.fmt)) args.a_gsum = row_sums.data() + row0;  // Σ_k a per row
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
    if (tiles) {  // strip-scratch tiles take the rows left too (GemmArgs::m_tail)
      const int64_t m_tail =
          (tile_variant & kStripScratch) && p.fmt == WeightFormat::fp8 ? p.M % tile_rows : 0;
      call(KernelKind::gemm_prefill, tile_rows, nv, s0, ns, 0, p.M / tile_rows, tile_variant,
           m_tail);
      row = p.M / tile_rows * tile_rows + m_tail;
    }
    // fp8 pair and VNNI int8 blocks take the rest too; fp8 pairs from 5 rows, blocks or not
    if (p.tail_alone && p.fp8_pairs() && p.M < max_rows) {
      KernelKey pkey = key_for(p.isa, KernelKind::gemm_prefill, max_rows, nv, p.epi, p.fmt);
      pkey.variant = kBf16Pairs;
      ASSERT_TRUE(tail_rows_kernel(pkey));
      call(KernelKind::gemm_prefill, max_rows, nv, s0, ns, 0, 0, 0, p.M);
      row = p.M;
    }
    if (p.M - row > max_rows || (p.fp8_pairs() && p.M >= Problem::kPairTileRows)) {
      KernelKey pkey = key_for(p.isa, KernelKind::gemm_prefill, prefill_rows, nv, p.epi, p.fmt);
      if (p.fp8_pairs()) pkey.variant = kBf16Pairs;
      // (int8 at the VNNI levels: 1 row after the blocks goes with the last as 4 + 3 rows; the
      // 12-row tiles run 13-23 rows as two halves)
      const PrefillSplit sp = prefill_split(pkey, p.M - row);
      call(KernelKind::gemm_prefill, prefill_rows, nv, s0, ns, row, sp.blocks, 0, sp.tail);
      row += sp.blocks * prefill_rows + sp.tail;
    }
    if (p.M > row) call(KernelKind::gemm_decode, int(p.M - row), nv, s0, ns, row, 1);
  }
}

struct Outputs {
  std::vector<float> buf;
  std::vector<float*> rows;
  int64_t stride;
};

Outputs make_outputs(int64_t M, int64_t stride, uint32_t seed) {
  Outputs o;
  o.stride = stride;
  o.buf = test::random_floats(size_t(M * stride), seed, 0.5f);
  // Rows in a scrambled order, as the down epilogue scatters to tokens: a step of 7, or the next
  // one prime to M, so the order is a permutation for every M.
  int64_t step = 7;
  while (std::gcd(step, M) != 1) ++step;
  for (int64_t m = 0; m < M; ++m) o.rows.push_back(o.buf.data() + ((m * step) % M) * stride);
  return o;
}

void check_problem(const Problem& p, std::vector<std::string>* names) {
  Packed pk = make_weights(p);
  const bool bf16 = p.fmt == WeightFormat::bf16 || p.fmt == WeightFormat::fp8;  // fp32 rows
  // Activations: int8 rows, or fp32 rows (bf16 and fp8 weights), with a stride off the row length.
  const int64_t lda = (pk.layout.padded_k() + 8) * (bf16 ? 4 : 1);
  std::mt19937 rng(p.seed + 1);
  std::uniform_int_distribution<int> qd(-127, 127);
  std::vector<int8_t> a(size_t(p.M * lda), 0);
  std::vector<float> af = test::random_floats(size_t(p.M * p.K), p.seed + 5, 1.0f);
  if (p.fp8_pairs())  // bf16 rows; the float64 check below takes the rounded values
    for (float& x : af) x = formats::bf16_to_f32(formats::f32_to_bf16(x));
  for (int64_t m = 0; m < p.M; ++m)
    for (int64_t k = 0; k < p.K; ++k) {
      if (p.fp8_pairs()) {
        const uint16_t h = formats::f32_to_bf16(af[size_t(m * p.K + k)]);
        std::memcpy(&a[size_t(m * lda + k * 2)], &h, 2);
      } else if (bf16)
        std::memcpy(&a[size_t(m * lda + k * 4)], &af[size_t(m * p.K + k)], 4);
      else
        a[size_t(m * lda + k)] = int8_t(p.extreme ? (p.seed % 2 ? 127 : -127) : qd(rng));
    }
  std::vector<int8_t> a_signed = a;
  if (!bf16 && gemm_activation_offset(p.isa, p.fmt))
    formats::flip_sign_bits(a.data(), int64_t(a.size()));
  std::vector<float> as = test::random_floats(size_t(p.M), p.seed + 2, 0.01f);
  for (auto& x : as) x = std::fabs(x) + 1e-3f;
  std::vector<float> rw = test::random_floats(size_t(p.M), p.seed + 3, 1.0f);
  const int64_t stride = pk.layout.total_cols() + 16;
  Outputs jit = make_outputs(p.M, stride, p.seed + 4), ref = make_outputs(p.M, stride, p.seed + 4);
  run_all(p, pk, a, lda, as, jit.rows, rw, false, names);
  run_all(p, pk, a, lda, as, ref.rows, rw, true, nullptr);
  ASSERT_EQ(0, std::memcmp(jit.buf.data(), ref.buf.data(), jit.buf.size() * 4)) << p.repro();

  // The reference itself against direct math on the unpacked operands: exact int64 for the
  // integer formats; for bf16, float64 over the bf16-rounded weights within fp32 accumulation
  // error.
  if (p.epi == Epilogue::store && p.fmt == WeightFormat::fp8) {
    const int64_t kb = (p.K + 127) / 128;
    for (int64_t m = 0; m < p.M; ++m)
      for (int64_t n = 0; n < p.N; ++n) {
        double acc = 0, mag = 0;
        for (int64_t k = 0; k < p.K; ++k) {
          const double sc = pk.fp8_block ? pk.bs[0][size_t((n / 128) * kb + k / 128)] : 1.0;
          const double t =
              double(af[size_t(m * p.K + k)]) * e4m3_value(pk.w8[0][size_t(n * p.K + k)]) * sc;
          acc += t;
          mag += std::fabs(t);
        }
        // y = (a_scale * w_scale) * acc; w_scale is the row scale, or 1 with block scales
        const double post = double(as[size_t(m)]) * (pk.fp8_block ? 1.0 : pk.bs[0][size_t(n)]);
        acc *= post;
        const double want_mag = mag * post;
        ASSERT_NEAR(acc, ref.rows[size_t(m)][n], 2e-6 * want_mag * double(p.K) + 1e-30)
            << p.repro() << " m=" << m << " n=" << n;
      }
  }
  if (p.epi == Epilogue::store && p.fmt == WeightFormat::bf16) {
    for (int64_t m = 0; m < p.M; ++m)
      for (int64_t n = 0; n < p.N; ++n) {
        double acc = 0, mag = 0;
        for (int64_t k = 0; k < p.K; ++k) {
          const uint32_t bits = uint32_t(formats::f32_to_bf16(pk.wf[0][size_t(n * p.K + k)])) << 16;
          float w;
          std::memcpy(&w, &bits, 4);
          acc += double(af[size_t(m * p.K + k)]) * w;
          mag += std::fabs(double(af[size_t(m * p.K + k)]) * w);
        }
        ASSERT_NEAR(acc, ref.rows[size_t(m)][n], 1e-6 * mag * double(p.K) + 1e-30)
            << p.repro() << " m=" << m << " n=" << n;
      }
  }
  if (p.epi == Epilogue::store && !bf16) {  // integer formats
    for (int64_t m = 0; m < p.M; ++m)
      for (int64_t n = 0; n < p.N; ++n) {
        int64_t acc = 0;
        for (int64_t k = 0; k < p.K; ++k)
          acc += int64_t(a_signed[size_t(m * lda + k)]) * pk.q[0][size_t(n * p.K + k)];
        const float want = (as[size_t(m)] * pk.d[0][size_t(n)]) * float(acc);
        ASSERT_EQ(want, ref.rows[size_t(m)][n]) << p.repro() << " m=" << m << " n=" << n;
      }
  }
}

// int8 at avx512_bf16 over 2-vector strips (strip_vecs_for): 12-row tiles, the rows after the
// blocks as one short tile, 13-23 rows as two halves (prefill_split), and 1-6 rows as the decode
// tiles of those strips. Every row count from 1 to 40 (0-3 blocks and each tail and split), each
// epilogue, a tail strip of one vector on odd M and K not a multiple of 16 on some: bit for bit
// against the twin, and the twin against exact int64 math (store).
TEST(Gemm, Int8TwelveRowTilesOverTwoVectorStrips) {
#if !defined(__x86_64__)
  GTEST_SKIP() << "x86 kernels";
#endif
  if (test::emulated_level(IsaLevel::avx512_bf16) && !test::interpreter_enabled())
    GTEST_SKIP() << "no AVX512-BF16 here and KT_JIT_TEST_INTERPRET=0";
  ASSERT_EQ(gemm_prefill_rows(IsaLevel::avx512_bf16, WeightFormat::int8, 2), kInt8Rows2v);
  ASSERT_EQ(gemm_prefill_rows(IsaLevel::avx512_bf16, WeightFormat::int8, 4), 6);
  ASSERT_EQ(gemm_prefill_rows(IsaLevel::avx512_vnni, WeightFormat::int8, 2), 6);
  const Epilogue epis[] = {Epilogue::store, Epilogue::siluup, Epilogue::accum};
  std::vector<std::string> names;
  for (int64_t M = 1; M <= 40; ++M) {
    Problem p{IsaLevel::avx512_bf16, WeightFormat::int8, epis[M % 3],      M,
              M % 2 ? 80 : 64,       M % 4 ? 132 : 256,  uint32_t(700 + M)};
    p.strip_vecs = 2;
    check_problem(p, &names);
    if (HasFatalFailure()) return;
  }
  // the 12-row kernels ran (and the decode tiles over 2-vector strips)
  EXPECT_NE(std::find(names.begin(), names.end(), "gemm_prefill_int8_avx512bf16_m12n32_accum"),
            names.end());
  EXPECT_NE(std::find(names.begin(), names.end(), "gemm_decode_int8_avx512bf16_m3n32_store"),
            names.end());
}

// avx2 / avx512 int4 kernels add kInt4SumSteps K steps of a * (q4 + 8) pair sums in int16
// lanes: at a = +-127 and q4 = 7 (the code 15) every pair is +-3810 and 8 steps reach +-30480.
// A kernel that summed more steps (16 steps wrap), or saturated, fails the bitwise check against
// the twin and the twin's against exact int64 math.
TEST(Gemm, Int4Int16SumsAtTheirBound) {
#if !defined(__x86_64__)
  GTEST_SKIP() << "x86 kernels";
#endif
  ASSERT_TRUE(int4_int16_sums(IsaLevel::avx2, WeightFormat::int4));
  ASSERT_TRUE(int4_int16_sums(IsaLevel::avx512, WeightFormat::int4));
  ASSERT_FALSE(int4_int16_sums(IsaLevel::avx512_vnni, WeightFormat::int4));
  ASSERT_TRUE(int4_offset_nibbles(IsaLevel::avx2, WeightFormat::int4));
  ASSERT_FALSE(int4_offset_nibbles(IsaLevel::avx512_vnni, WeightFormat::int4));
  ASSERT_FALSE(gemm_activation_offset(IsaLevel::avx2, WeightFormat::int4));
  ASSERT_FALSE(gemm_activation_offset(IsaLevel::avx2, WeightFormat::int8));
  ASSERT_TRUE(gemm_activation_offset(IsaLevel::avx512_vnni, WeightFormat::int4));
  size_t ran = 0;
  uint32_t seed = 900;
  for (IsaLevel isa : test::kernel_test_levels()) {
    if (!int4_int16_sums(isa, WeightFormat::int4)) continue;
    for (Epilogue epi : {Epilogue::store, Epilogue::siluup, Epilogue::accum})
      for (int64_t M : {1, 2, 3, 8, 13})
        for (int64_t K : {32, 64, 130, 256}) {
          Problem p{isa, WeightFormat::int4, epi, M, 40, K, seed++};
          p.extreme = true;
          check_problem(p, nullptr);
          if (HasFatalFailure()) return;
          ++ran;
        }
  }
  if (ran == 0) GTEST_SKIP() << "this CPU runs neither avx2 nor avx512 kernels";
}

// The fp8 pair order (formats::fp8_strip_byte) is a permutation of each full strip's k pairs, and
// packing then unpacking (write_weight_scale_to_buffer's path) gives back every byte: gate/up
// sources over full strips and a 36-column tail (left in [k][column]).
TEST(Fp8PairOrder, PacksAPermutationThatUnpacksExactly) {
  std::vector<int> hits(128, 0);
  for (int k = 0; k < 2; ++k)
    for (int n = 0; n < 64; ++n) ++hits[size_t(formats::fp8_strip_byte(true, 64, k, n))];
  EXPECT_EQ(std::count(hits.begin(), hits.end(), 1), 128);
  EXPECT_EQ(formats::fp8_strip_byte(true, 64, 1, 37), 64 + 22);    // j 1: d 5, r 1, h 0
  EXPECT_EQ(formats::fp8_strip_byte(true, 64, 2, 20), 128 + 17);   // pair 1, j 0: d 4, r 0, h 1
  EXPECT_EQ(formats::fp8_strip_byte(true, 48, 3, 5), 3 * 48 + 5);  // narrower strips as stored
  const int64_t N = 100, K = 260;                                  // 128-k groups, the last of 4 k
  auto l = formats::StripLayout::make(N, K, 16, kStripVecs, 2, 8, 1, 128);
  l.fp8_pair_order = true;
  std::vector<int8_t> packed(size_t(l.total_bytes()));
  std::vector<float> scale(size_t(l.total_cols())), gs;
  std::vector<int32_t> comp(size_t(l.total_cols()));
  std::vector<std::vector<uint8_t>> w8;
  std::vector<std::vector<float>> bs;
  test::pack_random_fp8(l, N, K, 77, false, packed.data(), scale.data(), comp.data(), w8, bs, gs);
  ASSERT_GT(l.full_strips, 0);
  ASSERT_GT(l.tail_vecs, 0);
  for (int src = 0; src < 2; ++src) {
    std::vector<uint8_t> back(size_t(N * K), 0xcd);
    formats::unpack_rows(l, packed.data(), src, 0, N, 0, K, back.data(), K);
    EXPECT_EQ(back, w8[size_t(src)]) << src;
  }
  // the step flags: after each group's scales, byte G - 1 - p set where k pair p of the group
  // holds a zero-exponent code in the strip's columns (here from the source rows themselves)
  for (int64_t st = 0; st < l.full_strips; ++st)
    for (int64_t g = 0; g < l.groups(); ++g) {
      const int64_t p0 = g * l.g_steps / 2, G = std::min(l.g_steps / 2, K / 2 - p0);
      const uint8_t* flags =
          reinterpret_cast<const uint8_t*>(gs.data() + st * l.gscale_floats_per_strip() +
                                           g * l.gscale_floats_per_group()) +
          formats::kFp8FlagOffset;
      for (int64_t p = 0; p < G; ++p) {
        bool zero = false;
        for (int src = 0; src < 2; ++src)
          for (int64_t r = st * 32; r < st * 32 + 32; ++r)
            for (int64_t k = 2 * (p0 + p); k < 2 * (p0 + p) + 2; ++k)
              zero = zero || (w8[size_t(src)][size_t(r * K + k)] & 0x78) == 0;
        EXPECT_EQ(flags[G - 1 - p] != 0, zero) << "strip " << st << " group " << g << " pair " << p;
      }
    }
  auto odd = l;
  odd.k = 9;
  EXPECT_THROW(
      formats::pack_fp8_strips(odd, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr),
      std::invalid_argument);
  auto wide = l;  // groups of more than 64 k pairs outgrow the flags
  wide.g_steps = 256;
  EXPECT_THROW(
      formats::pack_fp8_strips(wide, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr),
      std::invalid_argument);
}

TEST(Gemm, SweepMatchesReferenceBitwise) {
  const int64_t Ms[] = {1, 2, 3, 5, 17, 64};
  const int64_t Ns[] = {1, 7, 16, 24, 40, 64, 100};
  const int64_t Ks[] = {1, 5, 12, 64, 130};
#if !defined(__x86_64__)
  GTEST_SKIP()
      << "x86 sweep (fp8 included); the NEON sweep is A64Gemm.SweepMatchesReferenceBitwise";
#endif
  if (test::runnable_levels().empty()) GTEST_SKIP() << "this CPU runs no generated x86 level";
  uint32_t seed = 1;
  size_t checked = 0;
  for (IsaLevel isa : test::kernel_test_levels()) {
    std::printf("gemm sweep: %s (%s)\n", isa_name(isa), test::level_how(isa));
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
    // Every kernel shape the sweep used was generated at this level.
    std::sort(names.begin(), names.end());
    names.erase(std::unique(names.begin(), names.end()), names.end());
    EXPECT_GE(names.size(), 80u) << isa_name(isa);
    if (isa == IsaLevel::avx512_bf16) {  // fp8 pair decode tiles in both strip orders
      EXPECT_GT(test::count_containing(names, "decode_fp8_avx512bf16_m1n64_store_dpbf16_perm"), 0u);
      EXPECT_GT(test::count_containing(names, "_dpbf16"),
                test::count_containing(names, "_dpbf16_perm"));  // and [k][column] (amx's)
    }
    if (isa == IsaLevel::avx2) {  // both fp8 one-row decode widens ran
      EXPECT_GT(test::count_containing(names, "fp8_avx2_m1n32_store_f32w"), 0u);
      EXPECT_GT(test::count_containing(names, "fp8_avx2_m1n32_siluup_f32w"), 0u);
      EXPECT_GT(std::count(names.begin(), names.end(), "gemm_decode_fp8_avx2_m1n32_accum"), 0);
      // int4's half-strip tiles (4 rows, two passes), on full strips and on tails of every width
      for (const char* n : {"int4_avx2_m4n32_store_halves", "int4_avx2_m4n32_siluup_halves",
                            "int4_avx2_m4n32_accum_halves", "int4_avx2_m4n8_store_halves",
                            "int4_avx2_m4n16_siluup_halves", "int4_avx2_m4n24_accum_halves"})
        EXPECT_GT(test::count_containing(names, n), 0u) << n;
    }
  }
  EXPECT_GT(checked, 0u);
}

// fp8 strip-scratch tiles at every level that generates them: avx2, where the executor runs them
// (the sweep above covers that too), and avx512 / avx512_vnni, where they generate but the
// executor keeps the fp32 tiles (unmeasured there), so the zmm code is checked all the same.
TEST(Gemm, Fp8StripScratchTilesMatchReferenceBitwise) {
#if !defined(__x86_64__)
  GTEST_SKIP() << "x86 kernels";
#endif
  uint32_t seed = 7000;
  size_t checked = 0;
  for (IsaLevel isa : test::kernel_test_levels()) {
    if (!test::strip_scratch_level(isa)) continue;
    std::vector<std::string> names;
    for (Epilogue epi : {Epilogue::store, Epilogue::siluup, Epilogue::accum})
      for (int64_t M : {3, 8, 13, 64})
        for (int64_t N : {16, 40, 100})
          for (int64_t K : {2, 64, 130, 256}) {
            Problem p{isa, WeightFormat::fp8, epi, M, N, K, seed++};
            p.scratch_tiles = true;
            check_problem(p, &names);
            if (HasFatalFailure()) return;
            ++checked;
          }
    EXPECT_GT(test::count_containing(names, "_scratch"), 0u) << isa_name(isa);
  }
  if (checked == 0) GTEST_SKIP() << "no avx2 / avx512 / avx512_vnni level runs here";
}

// fp8 pair prefill at avx512_bf16 with every tail size after its 6-row blocks (GemmArgs::m_tail,
// tail_rows_kernel): 1 and 2 rows keep their group sums in zmm8-15, 3-5 on the stack; the sweep
// above meets only tails of 4 and 5. Calls over full strips decode each strip in their first block
// (the later blocks and the tail read the scratch it wrote), calls of no block (M 5) before the
// tail: N 200 gives calls of three full strips, the next strip prefetched from each first block.
// Calls of 1 .. 8 blocks over full strips run in rounds (a pass of every block and the tail per
// 64-pair group, the first decoding the group for the others: jit/x64/gemm.cpp strip_rounds),
// calls of more (M 55, 60) block by block: K 300 gives two full groups and a short one.
TEST(Gemm, Fp8PairTilesRunTheirLastRowsBitwise) {
#if !defined(__x86_64__)
  GTEST_SKIP() << "x86 kernels";
#endif
  const auto levels = test::kernel_test_levels();
  if (std::find(levels.begin(), levels.end(), IsaLevel::avx512_bf16) == levels.end())
    GTEST_SKIP() << "avx512_bf16 neither runs here nor is interpreted";
  // the rows from which the executor runs fp8 pair tiles, as run_all mirrors it
  ASSERT_EQ(make_gemm_kernel_set(IsaLevel::avx512_bf16, WeightFormat::fp8, Epilogue::siluup, 0, 0,
                                 /*k_pairs=*/true)
                .tile_min_rows,
            Problem::kPairTileRows);
  uint32_t seed = 9000;
  std::vector<std::string> names;
  for (Epilogue epi : {Epilogue::store, Epilogue::siluup, Epilogue::accum})
    // tails 5 (alone), 0, 2, 3, 4, 1, 3; 3 blocks and 4, 4 and 5, 8 and 0, 8 and 5, 9 and 1, 10
    for (int64_t M : {5, 6, 8, 9, 10, 13, 15, 22, 29, 48, 53, 55, 60})
      for (int64_t N : {16, 100, 200})
        for (int64_t K : {64, 130, 300}) {
          if (K == 300 && N != 200 && M > 15) continue;
          Problem p{IsaLevel::avx512_bf16, WeightFormat::fp8, epi, M, N, K, seed++};
          ASSERT_TRUE(p.fp8_pairs()) << p.repro();
          check_problem(p, &names);
          if (HasFatalFailure()) return;
        }
  // calls of no block, every tail size: the tail tile decodes the strip (and prefetches the next)
  for (Epilogue epi : {Epilogue::store, Epilogue::accum})
    for (int64_t M = 1; M <= 5; ++M)
      for (int64_t N : {100, 200}) {
        Problem p{IsaLevel::avx512_bf16, WeightFormat::fp8, epi, M, N, 130, seed++};
        p.tail_alone = true;
        check_problem(p, &names);
        if (HasFatalFailure()) return;
      }
  EXPECT_GT(test::count_containing(names, "fp8_avx512bf16_m6n64_siluup_dpbf16"), 0u);
  // both strip orders ran: the pair order (make_weights) and [k][column]
  EXPECT_GT(test::count_containing(names, "fp8_avx512bf16_m6n64_accum_dpbf16_perm"), 0u);
  EXPECT_GT(names.size(), test::count_containing(names, "_perm"));
}

// int8 and int4 prefill at the AVX-512 VNNI levels run the rows after its 6-row blocks as the
// call's short tile (jit/gemm.hpp int_tail_prefetch_kernel), every tail size 3-5, after one block
// (the tail tile prefetches the rest of the next strip) and after more, and a last row or two
// with the block before it as a 4-row and a 3-row tile or two 4-row tiles (split_tail_kernel,
// split_tail_rows, prefill_split) after no block, one, two and three; the sweep above meets only
// tails of 4 and 5.
TEST(Gemm, Int8VnniTailRowsBitwise) {
#if !defined(__x86_64__)
  GTEST_SKIP() << "x86 kernels";
#endif
  uint32_t seed = 9500;
  size_t checked = 0;
  for (IsaLevel isa : test::kernel_test_levels())
    for (WeightFormat fmt : {WeightFormat::int8, WeightFormat::int4}) {
      KernelKey pkey = key_for(isa, KernelKind::gemm_prefill, gemm_max_rows(isa, fmt), kStripVecs,
                               Epilogue::store, fmt);
      if (!int_tail_prefetch_kernel(pkey)) continue;
      ASSERT_EQ(gemm_max_rows(isa, fmt), 6);
      std::vector<std::string> names;
      for (Epilogue epi : {Epilogue::store, Epilogue::siluup, Epilogue::accum})
        // tails 3, 4, 5 after one block; 0, 5 after two; 5, 3 after three and four; 4 + 3 after
        // none, one, two and three; 4 + 4 after none, one, two and three
        for (int64_t M : {9, 10, 11, 12, 17, 23, 27, 7, 13, 19, 25, 8, 14, 20, 26})
          for (int64_t N : {16, 100})
            for (int64_t K : {64, 130}) {
              check_problem({isa, fmt, epi, M, N, K, seed++}, &names);
              if (HasFatalFailure()) return;
              ++checked;
            }
      EXPECT_GT(test::count_containing(
                    names, fmt == WeightFormat::int8 ? "gemm_prefill_int8" : "gemm_prefill_int4"),
                0u)
          << isa_name(isa);
      EXPECT_TRUE(split_tail_kernel(pkey));
      EXPECT_EQ(prefill_split(pkey, 13).blocks, 1);
      EXPECT_EQ(prefill_split(pkey, 13).tail, 7);
      EXPECT_EQ(split_tail_rows(pkey), 2);
      EXPECT_EQ(prefill_split(pkey, 8).blocks, 0);
      EXPECT_EQ(prefill_split(pkey, 8).tail, 8);
      EXPECT_EQ(prefill_split(pkey, 14).blocks, 1);
      EXPECT_EQ(prefill_split(pkey, 14).tail, 8);
      EXPECT_EQ(prefill_split(pkey, 15).tail, 3);
    }
  if (checked == 0) GTEST_SKIP() << "neither avx512_vnni nor avx512_bf16 runs here";
}

TEST(Gemm, SiluEpilogueMatchesMathToFp32Accuracy) {
  // The polynomial exp is an approximation: keep it within a few ulp-scale of std::exp so the
  // epilogue's SiLU is a faithful SiLU.
  for (float g = -30.0f; g <= 30.0f; g += 0.173f) {
    const float want = g / (1.0f + std::exp(-g));
    const float got = silu_mul_ref(g, 1.0f);
    EXPECT_NEAR(got, want, 1e-5f * std::fabs(want) + 1e-30f) << "g=" << g;
  }
}

TEST(Gemm, RefusesImpossibleKeys) {
#if !defined(__x86_64__)
  GTEST_SKIP() << "the x86 generators are built on x86-64 hosts only";
#endif
  EXPECT_THROW(KernelCache::generate_only(
                   key_for(IsaLevel::avx2, KernelKind::gemm_decode, 4, 4, Epilogue::store)),
               std::invalid_argument);  // avx2 holds 3 rows of 4 vectors
  EXPECT_THROW(KernelCache::generate_only(
                   key_for(IsaLevel::avx512_vnni, KernelKind::gemm_decode, 1, 3, Epilogue::siluup)),
               std::invalid_argument);  // siluup needs gate and up halves
  // half-strip tiles are avx2 int4 prefill tiles of 4 rows (and the VNNI qgroup ones of 6)
  for (auto [isa, kind, m_r, fmt] :
       {std::tuple{IsaLevel::avx512, KernelKind::gemm_prefill, 4, WeightFormat::int4},
        std::tuple{IsaLevel::avx2, KernelKind::gemm_decode, 4, WeightFormat::int4},
        std::tuple{IsaLevel::avx2, KernelKind::gemm_prefill, 2, WeightFormat::int4},
        std::tuple{IsaLevel::avx2, KernelKind::gemm_prefill, 4, WeightFormat::int8}}) {
    KernelKey k = key_for(isa, kind, m_r, 4, Epilogue::store, fmt);
    k.variant = kHalfStrips;
    EXPECT_THROW(KernelCache::generate_only(k), std::invalid_argument) << k.describe();
  }
  // the fp32-domain fp8 widen is an avx2 decode kernel of 1-2 rows
  for (auto [isa, kind, m_r] : {std::tuple{IsaLevel::avx2, KernelKind::gemm_decode, 3},
                                std::tuple{IsaLevel::avx2, KernelKind::gemm_prefill, 2},
                                std::tuple{IsaLevel::avx512, KernelKind::gemm_decode, 1}}) {
    KernelKey k = key_for(isa, kind, m_r, 4, Epilogue::store, WeightFormat::fp8);
    k.variant = kFp8Fp32Widen;
    EXPECT_THROW(KernelCache::generate_only(k), std::invalid_argument) << k.describe();
  }
  KernelKey ok =
      key_for(IsaLevel::avx2, KernelKind::gemm_decode, 1, 4, Epilogue::store, WeightFormat::fp8);
  ok.variant = kFp8Fp32Widen;
  EXPECT_EQ(KernelCache::generate_only(ok)->name, "gemm_decode_fp8_avx2_m1n32_store_f32w");
  ok.m_r = 2;
  EXPECT_EQ(KernelCache::generate_only(ok)->name, "gemm_decode_fp8_avx2_m2n32_store_f32w");
}

TEST(Gemm, GeneratesForLevelsThisCpuLacks) {
  // Generation never executes the code, so every x86 level can be generated on any x86-64 host.
#if !defined(__x86_64__)
  GTEST_SKIP() << "the x86 generators are built on x86-64 hosts only";
#endif
  for (IsaLevel isa :
       {IsaLevel::avx2, IsaLevel::avx512, IsaLevel::avx512_vnni, IsaLevel::avx512_bf16}) {
    auto k = KernelCache::generate_only(
        key_for(isa, KernelKind::gemm_prefill, gemm_max_rows(isa), 4, Epilogue::siluup));
    EXPECT_GT(k->code.size(), 100u) << k->name;
    EXPECT_NE(k->name.find(isa_tag(isa)), std::string::npos);
  }
}

#if !defined(__aarch64__)
// Which prefill tiles ask for their shares of the next strip into L1: the int8 and BF16 pair
// 12-row tiles over 2-vector strips, on a Zen 5 only (jit/x64/gemm.cpp prefill_share_l1).
TEST(Gemm, PrefillSharesGoToL1OnlyForAZen5sTwelveRowTiles) {
  auto key = [](WeightFormat fmt, int m_r, int sv, IsaLevel isa) {
    KernelKey k = key_for(isa, KernelKind::gemm_prefill, m_r, sv, Epilogue::store, fmt);
    if (fmt == WeightFormat::bf16) k.variant = kBf16Pairs;
    return k;
  };
  const IsaLevel b = IsaLevel::avx512_bf16;
  EXPECT_TRUE(x64::prefill_share_l1(key(WeightFormat::int8, 12, 2, b), true));
  EXPECT_FALSE(x64::prefill_share_l1(key(WeightFormat::int8, 12, 2, b), false));
  EXPECT_FALSE(x64::prefill_share_l1(key(WeightFormat::int8, 6, 4, b), true));
  EXPECT_FALSE(x64::prefill_share_l1(key(WeightFormat::int8, 6, 4, IsaLevel::avx512_vnni), true));
  EXPECT_FALSE(x64::prefill_share_l1(key(WeightFormat::int4, 6, 4, b), true));
  EXPECT_TRUE(x64::prefill_share_l1(key(WeightFormat::bf16, 12, 2, b), true));
  EXPECT_FALSE(x64::prefill_share_l1(key(WeightFormat::bf16, 12, 2, b), false));
  EXPECT_FALSE(x64::prefill_share_l1(key(WeightFormat::bf16, 6, 4, b), true));
}

// The prefill kernels whose tiles prefetch their rows' shares of the next strip (jit/x64/gemm.cpp
// pf_var_: int8 and int4 at the VNNI levels, the vdpbf16ps pair tiles) ask for every line of it,
// for the row counts the executor gives them (prefill_split), blocks or none: a call over strips
// 0-1 runs in the interpreter, which logs each prefetch, and the lines of strips 1 and 2 (the bytes
// after the call's last strip) must all be among them, and no prefetch of the weights outside them
// (but for the last sites' reach, 8 lines, and on a Zen 5 the 4 / 512 of them its pointer runs
// ahead: kPrefillWholeSiteBytesZen5; the next strip's scales are prefetched from their arrays). A
// speed property checked as a fact: a line left out is a demand miss to DRAM, a line asked for from
// too far away a line fetched for nothing. A call of fewer rows than S = prefill_stream_rows(key)
// (13 on a Zen 5, 7 for int4 there; elsewhere 0, the whole strip at any row count) asks for the
// first rows / S of each strip, 512 * rows / S bytes of every 512 (prefill_site_bytes), and leaves
// the rest to the hardware prefetcher: those prefixes must be covered, and the rest left alone.
// Where calls of fewer than prefill_read_ahead_rows() rows (S for BF16 pairs, S + 2 for int8, whose
// 13- and 14-row calls ask for the whole strip) also read ahead (prefill_read_ahead_bytes, a Zen
// 5), the lines asked for must be exactly the prefixes and the read-ahead's: each strip from that
// many bytes on, and past the last strip that many bytes. In the calls without the read-ahead each
// ask also carries the hint x64::prefill_share_l1 names (a Zen 5's 12-row tiles: prefetcht0).
TEST(Gemm, PrefillPrefetchCoversTheNextStrip) {
  const int64_t N = 3 * 64, K = 256;  // three full 64-column strips
  // (the 6-row tiles over 4-vector strips, and the 12-row ones over 2-vector strips of int8
  // and bf16 at avx512_bf16: strip_vecs_for)
  const std::pair<WeightFormat, int> cases[] = {{WeightFormat::int8, 4},
                                                {WeightFormat::bf16, 4},
                                                {WeightFormat::int4, 4},
                                                {WeightFormat::int8, 2},
                                                {WeightFormat::bf16, 2}};
  for (const auto& [fmt, sv] : cases)
    for (const int rows : {5, 6, 7, 8, 9, 11, 12, 13, 14, 16, 19, 20, 24, 25, 32, 47, 48, 61}) {
      const bool bf16 = fmt == WeightFormat::bf16;
      KernelKey key = key_for(IsaLevel::avx512_bf16, KernelKind::gemm_prefill, sv == 2 ? 12 : 6, sv,
                              Epilogue::store, fmt);
      if (bf16) key.variant = kBf16Pairs;
      if (!bf16 && rows < 7) continue;  // int8 / int4 prefill calls start at 7 rows
      const auto l = formats::StripLayout::make(N, K, 16, sv, 1,
                                                bf16                        ? 16
                                                : fmt == WeightFormat::int4 ? 4
                                                                            : 8,
                                                bf16 ? bf16_kgroup(key.isa) : 0);
      const int64_t strip = l.strip_offset(1) - l.strip_offset(0);
      AlignedBuffer w(size_t(l.total_bytes() + 64 * 64));  // (with room past the strips)
      std::memset(w.as<uint8_t>(), 0, size_t(l.total_bytes()));
      std::vector<float> scale(size_t(l.total_cols()), 1.0f), a_scale(size_t(rows), 1.0f);
      std::vector<int32_t> comp(size_t(l.total_cols()), 0);
      std::vector<int8_t> a(size_t(rows * K * 2), 0);  // int8 rows, or bf16 rows of 2 bytes
      std::vector<float> out(size_t(rows * N), 0.0f);
      std::vector<float*> out_rows;
      for (int r = 0; r < rows; ++r) out_rows.push_back(out.data() + r * N);
      const PrefillSplit sp = prefill_split(key, rows);
      GemmArgs args{};
      args.a = a.data();
      args.lda = bf16 ? K * 2 : K;
      args.w = w.as<int8_t>();
      args.n_strips = 2;
      args.k4 = l.k4;
      args.a_scale = a_scale.data();
      args.w_scale = scale.data();
      args.w_comp = comp.data();
      args.out_rows = out_rows.data();
      args.m_blocks = sp.blocks;
      args.m_tail = sp.tail;
      // weight lines (not the scales' own arrays) out of strips 1-2 and the last sites' 8 lines,
      // and, where a site asks for more than 512 bytes (kPrefillWholeSiteBytesZen5), the lines
      // its pointer runs ahead over the two strips
      const int64_t whole_site = prefill_strip_site_bytes(key);
      const int64_t site = prefill_site_bytes(key, rows), prefix = strip * site / whole_site;
      const int64_t read_ahead = prefill_read_ahead_bytes();
      if (read_ahead > 0 && rows < prefill_read_ahead_rows(key)) {
        // A DRAM-bound call reads ahead too: each tile prefetches the strip it reads
        // read_ahead bytes on. So the lines asked for are exactly: strip 0 from read_ahead on,
        // all of strip 1 (its prefix by strip 0's shares, the rest by its own tiles), and of
        // strip 2 the first max(prefix, read_ahead) bytes, with the shares' last sites' reach.
        ASSERT_LT(read_ahead, strip * 2);
        std::set<int64_t> got;
        const int64_t w0 = int64_t(reinterpret_cast<uint64_t>(args.w) / 64);
        for (const uint64_t line : test::prefetch_lines(key, args)) got.insert(int64_t(line) - w0);
        const int64_t L = strip / 64, ra = read_ahead / 64, pre = (prefix + 63) / 64;
        int64_t missed = 0, stray = 0;
        for (int64_t i = ra; i < L + L + std::max(pre, ra); ++i) missed += !got.count(i);
        const int64_t w_lines = int64_t(w.size() / 64);  // (the scales' arrays are elsewhere)
        for (const int64_t i : got)
          stray += i >= 0 && i < w_lines && (i < ra || i >= 2 * L + std::max(pre + 8, ra));
        EXPECT_EQ(missed, 0) << key.name() << " " << rows << " rows: lines not read ahead";
        EXPECT_EQ(stray, 0) << key.name() << " " << rows << " rows: lines asked for elsewhere";
        continue;
      }
      const uint64_t ahead =
          uint64_t(std::max<int64_t>(0, 2 * strip * (site - whole_site) / whole_site) + 63) / 64;
      const auto [missed, outside] =
          test::prefetch_cover(key, args, strip, w.size(), 8 + ahead, prefix);
      EXPECT_EQ(missed, 0) << key.name() << " " << rows << " rows (" << sp.blocks
                           << " blocks, tail " << sp.tail << "): lines of the next strips' first "
                           << prefix << " bytes never prefetched";
      EXPECT_EQ(outside, 0) << key.name() << " " << rows << " rows: prefetches outside them";
      if (prefix < strip) {  // (a DRAM-bound call) the lines past its prefix are left alone
        const auto whole = test::prefetch_cover(key, args, strip, w.size(), 8);
        EXPECT_GE(whole.missed, 2 * (strip - prefix) / 64 - 2 * 8)
            << key.name() << " " << rows << " rows: asked for more than its prefix";
      }
      // Every ask into the weights here is a share of the next strip: into L1 (prefetcht0) where
      // x64::prefill_share_l1 says so (int8: for calls of fewer than 4 blocks, 48 rows; from
      // there its first blocks take the strip, into L2; the BF16 pairs take shares at any rows),
      // else into L2 (prefetcht1).
      std::map<int, int64_t> hints;
      test::EmuOptions opt;
      const uint64_t w0 = reinterpret_cast<uint64_t>(args.w), w1 = w0 + w.size();
      opt.on_prefetch_hint = [&](uint64_t at, int hint) { hints[hint] += at >= w0 && at < w1; };
      const Kernel* k = KernelCache::instance().get(key);
      ASSERT_NE(k, nullptr) << key.name();
      test::emulate_x64(k->code.data(), k->code.size(), &args, opt);
      const int want = x64::prefill_share_l1(key) && (bf16 || rows < 48) ? 0 : 1;
      for (const auto& [hint, n] : hints)
        if (hint != want)
          EXPECT_EQ(n, 0) << key.name() << " " << rows << " rows: weight lines asked with hint "
                          << hint << ", not " << want;
      EXPECT_GT(hints[want], 0) << key.name() << " " << rows << " rows";
    }
}
#endif

#if !defined(__aarch64__)
// A call of a kernel over `n_strips` strips from `w` (pk's layout) for the prefetch tests:
// `rows` zero activation rows (bf16 for the fp8 pair kernels, else int8) and their outputs.
// Not copyable: args points into it.
struct StripCall {
  std::vector<uint8_t> a;
  std::vector<float> a_scale, out;
  std::vector<float*> out_rows;
  GemmArgs args{};
  StripCall(const Packed& pk, const Problem& p, int64_t rows, const int8_t* w, int64_t n_strips)
      : a(size_t(rows * p.K * (p.fp8_pairs() ? 2 : 1)), 0),
        a_scale(size_t(rows), 1.0f),
        out(size_t(rows * p.N), 0.0f) {
    for (int64_t r = 0; r < rows; ++r) out_rows.push_back(out.data() + r * p.N);
    const auto& l = pk.layout;
    args.a = reinterpret_cast<const int8_t*>(a.data());
    args.lda = p.K * (p.fp8_pairs() ? 2 : 1);
    args.w = w;
    args.n_strips = n_strips;
    args.k4 = l.k4;
    args.a_scale = a_scale.data();
    args.w_scale = pk.scale.data();
    args.w_comp = pk.comp.data();
    args.out_rows = out_rows.data();
    args.m_blocks = 1;
    if (!pk.gscale.empty()) {  // fp8: the group scales
      args.w_gscale = pk.gscale.data();
      args.g_steps = l.g_steps;
      args.g_per_strip = l.groups();
    }
  }
  StripCall(const StripCall&) = delete;
  StripCall& operator=(const StripCall&) = delete;
};

// fp8 pair prefill at avx512_bf16 (calls of 1 .. 8 blocks in rounds, jit/x64/gemm.cpp
// strip_rounds): every pass over a group, each block's and the tail's, asks for the next strip's
// lines of that group, so a call of P passes asks for every line of the next strip P times (the
// first pass alone asked for them faster than DRAM gave them, and the core dropped some). Calls
// of more blocks go block by block, the first block asking for each line once. Counted in the
// interpreter, which logs each prefetch, over a call of strips 0-1: the lines of strips 1 and 2.
TEST(Gemm, Fp8RoundsAskForTheNextStripInEveryPass) {
  for (const uint32_t seed : {10u, 11u}) {  // the pair order, with block and with row scales
    Problem p{IsaLevel::avx512_bf16, WeightFormat::fp8, Epilogue::store, 60, 3 * 64, 256, seed};
    const Packed pk = make_weights(p);
    const auto& l = pk.layout;
    ASSERT_TRUE(p.fp8_pairs() && l.fp8_pair_order);
    ASSERT_EQ(l.full_strips, 3);
    ASSERT_EQ(l.tail_vecs, 0);
    KernelKey key = key_for(IsaLevel::avx512_bf16, KernelKind::gemm_prefill, 6, l.strip_vecs,
                            Epilogue::store, WeightFormat::fp8);
    key.variant = uint16_t(kBf16Pairs | kFp8PairOrder);
    const int64_t strip = l.strip_offset(1) - l.strip_offset(0);
    const int64_t code_bytes = 2 * l.strip_cols(l.strip_vecs) * (p.K / 2);  // 2 bytes a k pair
    ASSERT_LE(code_bytes, strip);
    // 1 block; 1 + a tail of 3; 2 + 4; 8 + 5 (rounds: 1, 2, 3, 9 passes); 10 blocks (one by one)
    for (const int64_t rows : {6, 9, 16, 53, 60}) {
      const PrefillSplit sp = prefill_split(key, rows);
      const int64_t blocks = sp.blocks, passes = blocks <= 8 ? blocks + (sp.tail > 0) : 1;
      std::vector<uint8_t> scratch(size_t(gemm_scratch_bytes(key, l.k4)));
      StripCall call(pk, p, rows, pk.w.data(), 2);
      GemmArgs& args = call.args;
      args.m_blocks = blocks;
      args.m_tail = sp.tail;
      args.scratch = scratch.data();
      std::map<int64_t, int> asked;  // line (from the weights' first) -> times
      const auto w0 = int64_t(reinterpret_cast<uintptr_t>(pk.w.data()) / 64);
      for (const uint64_t line : test::prefetch_lines(key, args)) ++asked[int64_t(line) - w0];
      int fewest = 1 << 30, most = 0;
      for (int s = 1; s <= 2; ++s)  // strip 0 asks for strip 1's lines, strip 1 for strip 2's
        for (int64_t b = 0; b < code_bytes; b += 64) {
          const int64_t line = (l.strip_offset(s) + b) / 64;
          const int n = asked.count(line) ? asked[line] : 0;
          fewest = std::min(fewest, n);
          most = std::max(most, n);
        }
      EXPECT_EQ(fewest, passes) << key.name() << " seed " << seed << ", " << rows << " rows ("
                                << blocks << " blocks, tail " << sp.tail << ")";
      EXPECT_LE(most, passes + 1) << key.name() << " " << rows << " rows";
    }
  }
}
#endif

#if !defined(__aarch64__)
// The packed weights copied into a buffer with room past them for a decode kernel's read-ahead
// (so no other array lies there).
AlignedBuffer with_read_ahead_room(const Packed& pk) {
  AlignedBuffer w(pk.w.size() + 65536);
  std::memcpy(w.as<int8_t>(), pk.w.data(), pk.w.size());
  return w;
}
// A decode call's prefetches of its weight stream (`stream` lines from `w`), counted in the
// interpreter against the kernel's own read-ahead (x64::decode_prefetch_bytes): every line of
// the stream from the read-ahead on asked for exactly once, and no line of the weights before
// it (with no read-ahead: none of the stream).
void expect_each_line_once(const KernelKey& key, const GemmArgs& args, const int8_t* w,
                           int64_t stream, const std::string& what) {
  SCOPED_TRACE(key.name() + " " + what +
               (x64::decode_prefetch_spread(key) ? ", step by step" : ", at the loop's end"));
  const int64_t ahead = x64::decode_prefetch_bytes(key) / 64;
  ASSERT_LT(ahead, stream);
  std::map<int64_t, int> asked;  // line (from the weights' first) -> times
  const auto w0 = int64_t(reinterpret_cast<uintptr_t>(w) / 64);
  for (const uint64_t line : test::prefetch_lines(key, args)) ++asked[int64_t(line) - w0];
  int64_t missed = 0, twice = 0, early = 0;
  for (int64_t i = 0; i < stream && ahead > 0; ++i) {
    const auto it = asked.find(ahead + i);
    missed += it == asked.end();
    twice += it != asked.end() && it->second > 1;
  }
  for (const auto& [line, n] : asked) early += line >= 0 && line < ahead + (ahead ? 0 : stream);
  EXPECT_EQ(missed, 0) << "lines never asked for";
  EXPECT_EQ(twice, 0) << "lines asked for twice";
  EXPECT_EQ(early, 0) << "lines before the read-ahead";
}
#endif

#if !defined(__aarch64__)
// fp8 decode tiles (1-4 rows over the pair order, as the executor runs them at avx512_bf16)
// prefetch their weight stream x64::decode_prefetch_bytes ahead: over a call of three strips,
// every line of the stream from that many bytes on is asked for exactly once, and no line of the
// weights before it. That holds for the steps the table decode takes (a zero-exponent code in
// every fifth k pair: make_weights) and for a group's steps past its unrolled loop (K = 262: a
// last group of 3 pairs), and whether the steps ask for their own lines (decode_prefetch_spread,
// a Zen 5) or the loop for its lines at its end. A line dropped is a demand miss to DRAM, one
// asked for twice a wasted slot. Counted in the interpreter, which logs each prefetch.
TEST(Gemm, Fp8DecodeAsksForEveryLineOnce) {
  for (const uint32_t seed : {1u, 2u}) {  // the pair order, with row and with block scales
    Problem p{IsaLevel::avx512_bf16, WeightFormat::fp8, Epilogue::store, 4, 3 * 64, 262, seed};
    const Packed pk = make_weights(p);
    const auto& l = pk.layout;
    ASSERT_TRUE(p.fp8_pairs() && l.fp8_pair_order);
    ASSERT_EQ(l.full_strips, 3);
    ASSERT_EQ(l.tail_vecs, 0);
    int64_t flagged = 0;  // steps that take the table decode
    for (int64_t st = 0; st < l.full_strips; ++st)
      for (int64_t g = 0; g < l.groups(); ++g) {
        const auto* flags =
            reinterpret_cast<const uint8_t*>(pk.gscale.data() + st * l.gscale_floats_per_strip() +
                                             g * l.gscale_floats_per_group()) +
            formats::kFp8FlagOffset;
        for (int i = 0; i < formats::kFp8FlagBytes; ++i) flagged += flags[i] != 0;
      }
    ASSERT_GT(flagged, 0);
    const int64_t stream = l.strip_offset(3) / 64;  // the three strips' lines
    const AlignedBuffer w = with_read_ahead_room(pk);
    for (int rows = 1; rows <= 4; ++rows) {
      KernelKey key = key_for(IsaLevel::avx512_bf16, KernelKind::gemm_decode, rows, l.strip_vecs,
                              Epilogue::store, WeightFormat::fp8);
      key.variant = uint16_t(kBf16Pairs | kFp8PairOrder);
      const StripCall call(pk, p, rows, w.as<int8_t>(), 3);
      expect_each_line_once(key, call.args, w.as<int8_t>(), stream, "seed " + std::to_string(seed));
    }
  }
}
#endif

#if !defined(__aarch64__)
// The same for the int8 and int4 decode tiles at avx512_bf16, 1 row to the most the executor
// gives them, over three strips of the executor's width (strip_vecs_for) and K with steps past
// the unrolled loop (K = 260 / 264): every line from the read-ahead on asked for once, none
// before it, whether the tile asks step by step (decode_prefetch_spread: from 4 rows on a Zen 5)
// or at its loop's end, or not at all.
TEST(Gemm, IntDecodeTilesAskForEveryLineOnce) {
  const IsaLevel isa = IsaLevel::avx512_bf16;
  for (const WeightFormat fmt : {WeightFormat::int8, WeightFormat::int4}) {
    const int sv = strip_vecs_for(isa, fmt);
    Problem p{isa, fmt, Epilogue::store, 6, 3 * 16 * sv, fmt == WeightFormat::int8 ? 260 : 264, 5};
    p.strip_vecs = sv;
    const Packed pk = make_weights(p);
    const auto& l = pk.layout;
    ASSERT_EQ(l.full_strips, 3);
    ASSERT_EQ(l.tail_vecs, 0);
    const int64_t stream = l.strip_offset(3) / 64;
    const AlignedBuffer w = with_read_ahead_room(pk);
    const GemmKernelSet ks = make_gemm_kernel_set(isa, fmt, Epilogue::store, 0, 0, true);
    for (int rows = 1; rows <= ks.max_rows; ++rows) {
      const KernelKey key = key_for(isa, KernelKind::gemm_decode, rows, sv, Epilogue::store, fmt);
      const StripCall call(pk, p, rows, w.as<int8_t>(), 3);
      expect_each_line_once(key, call.args, w.as<int8_t>(), stream, "");
    }
  }
}
#endif

#if !defined(__aarch64__)
// Prefill accumulate tiles read-modify-write their rows' output lines, scattered over the
// tokens' partial rows (T x H fp32), which at large T come from DRAM: each tile asks for the
// next tile's lines a whole tile ahead (jit/x64/gemm.cpp prefetch_next_tile_outputs). Checked
// in the interpreter, which logs prefetches and stores in program order, over three strips: the
// tiles are the runs of output stores; every line a tile stores, but for the call's first tile,
// must have been prefetched before the tile before it stored anything, and no prefetch may fall
// on output lines the call does not write (rows past its end, the strip after its last). For
// the executor's prefill accumulate tiles: int8 at the VNNI levels and avx2, the vdpbf16ps
// pairs, avx2 int4's half-strip tiles (two passes a strip); blocks, tails, and calls of one tile.
TEST(Gemm, PrefillAccumPrefetchesTheNextTilesOutputs) {
  struct Case {
    IsaLevel isa;
    WeightFormat fmt;
    int m_r;
    uint16_t variant;
  };
  const Case cases[] = {
      {IsaLevel::avx512_bf16, WeightFormat::int8, 6, 0},
      {IsaLevel::avx512_bf16, WeightFormat::bf16, 6, kBf16Pairs},
      {IsaLevel::avx2, WeightFormat::int8, 3, 0},
      {IsaLevel::avx2, WeightFormat::int4, 4, kHalfStrips},
  };
  const int64_t K = 64;
  int checked = 0;
  for (const Case& c : cases)
    for (const int rows : {1, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 14, 16, 19, 25, 47}) {
      KernelKey key =
          key_for(c.isa, KernelKind::gemm_prefill, c.m_r, kStripVecs, Epilogue::accum, c.fmt);
      key.variant = c.variant;
      const PrefillSplit sp = prefill_split(key, rows);
      if (sp.blocks == 0 && sp.tail == 0) continue;  // (rows the call's decode tiles take)
      const bool bf16 = c.fmt == WeightFormat::bf16, int4 = c.fmt == WeightFormat::int4;
      const int lanes = vec_lanes(c.isa);
      const int64_t N = 3 * kStripVecs * lanes;  // three full strips
      const auto l = formats::StripLayout::make(N, K, lanes, kStripVecs, 1,
                                                bf16   ? 16
                                                : int4 ? 4
                                                       : 8,
                                                bf16 ? bf16_kgroup(c.isa) : 0);
      // (room past the strips for the last strip's prefetch of the next one's weights)
      const int64_t strip = l.strip_offset(1) - l.strip_offset(0);
      AlignedBuffer w(size_t(l.total_bytes() + strip + 64 * 64));
      std::memset(w.as<uint8_t>(), 0, w.size());
      // (the scales and compensations with room past them too: the last strip prefetches the
      // next one's, which must not land in the output buffer whatever the heap's layout)
      std::vector<float> scale(size_t(2 * l.total_cols()), 1.0f), a_scale(size_t(rows), 1.0f);
      std::vector<float> row_weight(size_t(rows), 1.0f);
      std::vector<int32_t> comp(size_t(2 * l.total_cols()), 0), a_gsum(size_t(rows), 0);
      std::vector<int8_t> a(size_t(rows * K * 2), 0);
      // the call's rows scattered over a partial buffer of 4 * rows + 8 rows in shuffled order,
      // each row on a cache line's start as the executor's are
      const int64_t stride = N + 16, buffer_rows = 4 * rows + 8;
      AlignedBuffer out_buf(size_t(buffer_rows * stride) * sizeof(float));
      std::memset(out_buf.as<float>(), 0, out_buf.size());
      float* const out0 = out_buf.as<float>();
      std::vector<int64_t> pick(static_cast<size_t>(buffer_rows));
      std::iota(pick.begin(), pick.end(), 0);
      std::mt19937 rng(uint32_t(rows) * 7u + uint32_t(checked));
      std::shuffle(pick.begin(), pick.end(), rng);
      std::vector<float*> out_rows;
      for (int r = 0; r < rows; ++r) out_rows.push_back(out0 + pick[size_t(r)] * stride);
      GemmArgs args{};
      args.a = a.data();
      args.lda = bf16 ? K * 2 : K;
      args.w = w.as<int8_t>();
      args.n_strips = 3;
      args.k4 = l.k4;
      args.a_scale = a_scale.data();
      args.w_scale = scale.data();
      args.w_comp = comp.data();
      args.a_gsum = a_gsum.data();
      args.row_weight = row_weight.data();
      args.out_rows = out_rows.data();
      args.m_blocks = sp.blocks;
      args.m_tail = sp.tail;
      // program order: prefetches and stores into the output buffer
      struct Event {
        bool store;
        uint64_t line;
      };
      std::vector<Event> ev;
      const uint64_t o0 = reinterpret_cast<uint64_t>(out0), o1 = o0 + out_buf.size();
      test::EmuOptions opt;
      opt.on_prefetch = [&](uint64_t at) {
        if (at >= o0 && at < o1) ev.push_back({false, at / 64});
      };
      opt.on_vector_store = [&](uint64_t at, int bytes) {
        if (at >= o0 && at < o1)
          for (uint64_t x = at / 64; x <= (at + uint64_t(bytes) - 1) / 64; ++x)
            ev.push_back({true, x});
      };
      const Kernel* k = KernelCache::instance().get(key);
      ASSERT_NE(k, nullptr) << key.name();
      test::emulate_x64(k->code.data(), k->code.size(), &args, opt);
      // tiles: the runs of stores; a line's first prefetch; each run's first event index
      std::vector<std::vector<uint64_t>> tiles;
      std::vector<size_t> tile_start;
      std::map<uint64_t, size_t> first_pf;
      std::set<uint64_t> stored;
      for (size_t i = 0; i < ev.size(); ++i) {
        if (!ev[i].store) {
          first_pf.emplace(ev[i].line, i);
          continue;
        }
        if (i == 0 || !ev[i - 1].store) {
          tiles.emplace_back();
          tile_start.push_back(i);
        }
        tiles.back().push_back(ev[i].line);
        stored.insert(ev[i].line);
      }
      const int64_t tiles_expected = 3 *
                                     (sp.blocks + (sp.tail > c.m_r ? 2
                                                   : sp.tail       ? 1
                                                                   : 0)) *
                                     (c.variant & kHalfStrips ? 2 : 1);
      EXPECT_EQ(int64_t(tiles.size()), tiles_expected) << key.name() << " " << rows << " rows";
      int64_t late = 0, wasted = 0;
      for (size_t t = 1; t < tiles.size(); ++t)
        for (uint64_t line : tiles[t]) {
          const auto it = first_pf.find(line);
          if (it == first_pf.end() || it->second > tile_start[t - 1]) ++late;
        }
      for (const auto& [line, at] : first_pf) wasted += stored.count(line) ? 0 : 1;
      EXPECT_EQ(late, 0) << key.name() << " " << rows << " rows (" << sp.blocks << " blocks, tail "
                         << sp.tail << "): output lines not prefetched a tile ahead";
      EXPECT_EQ(wasted, 0) << key.name() << " " << rows
                           << " rows: prefetches of output lines the call does not write";
      ++checked;
    }
  EXPECT_GT(checked, 40);
}
#endif

}  // namespace
}  // namespace ktjit
