// Microbenchmark of one generated INT8, INT4 or BF16 GEMM kernel, its weights hot or streamed:
//   build/ktjit_kernel_bench [isa] [M] [N] [K] [epilogue: store|siluup|accum] [int8|int4|bf16]
//                            [copies] [scatter]
// With copies > 1 the calls cycle over that many copies of the packed weights (an expert's
// matrix each, e.g. N 2048 K 768 for Qwen3's down), so the weights stream from DRAM while the
// rows and outputs stay in cache, as in a MoE layer; the default 1 keeps the weights hot. With
// scatter = T > M the output rows are instead M of T rows (a random set, 32 sets cycled call by
// call) of a T x N fp32 buffer allocated as the layer's partial rows are, so each call writes
// rows it has not touched lately, as down writes its tokens' rows in a layer at T tokens.
// Prints Gop/s next to the same run's peak of the instructions the kernel uses: vpdpbusd;
// vpmaddubsw + vpmaddwd + vpaddd, or + vpaddw for int4's int16 sums; FMA for bf16, but vdpbf16ps
// for bf16 at avx512_bf16 from the pair tiles' tile_min_rows on; at isa amx the tile multiply,
// tdpbusd or tdpbf16ps, for the AMX prefill kernels. The bf16 rows of the pair and AMX-BF16 tiles
// are the bits of this bench's fp32 rows: timing, not values. Speed is judged here and in
// `kt-jit bench`, never in tests.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "formats/int8.hpp"
#include "jit/bench_loops.hpp"
#include "jit/cpu/cpu.hpp"
#include "jit/gemm.hpp"
#include "jit/x64/bench_loops.hpp"
#include "runtime/machine_limits.hpp"
#include "runtime/moe_layer.hpp"

using namespace ktjit;

int main(int argc, char** argv) {
  IsaLevel isa = argc > 1 ? parse_isa(argv[1]) : selected_isa();
  if (isa != IsaLevel::ref && !level_usable(isa, cpu_features())) {
    std::fprintf(stderr, "isa %s: this CPU (or its OS) cannot run it\n", isa_name(isa));
    return 2;
  }
  const int64_t M = argc > 2 ? std::atoll(argv[2]) : 60;
  const int64_t N = argc > 3 ? std::atoll(argv[3]) : 256;
  const int64_t K = argc > 4 ? std::atoll(argv[4]) : 2048;
  const std::string epi_s = argc > 5 ? argv[5] : "store";
  const Epilogue epi = epi_s == "siluup"  ? Epilogue::siluup
                       : epi_s == "accum" ? Epilogue::accum
                                          : Epilogue::store;
  const std::string fmt_s = argc > 6 ? argv[6] : "int8";
  const int64_t copies = argc > 7 ? std::max<int64_t>(1, std::atoll(argv[7])) : 1;
  const int64_t scatter = argc > 8 ? std::atoll(argv[8]) : 0;
  const bool int4 = fmt_s == "int4", bf16 = fmt_s == "bf16";
  if (!int4 && !bf16 && fmt_s != "int8") {
    std::fprintf(stderr, "format: expected int8, int4 or bf16, got %s\n", fmt_s.c_str());
    return 2;
  }
  const WeightFormat fmt = int4   ? WeightFormat::int4
                           : bf16 ? WeightFormat::bf16
                                  : WeightFormat::int8;
  const int lanes = vec_lanes(isa);
  auto l = formats::StripLayout::make(N, K, lanes, strip_vecs_for(isa, fmt),
                                      epi == Epilogue::siluup ? 2 : 1,
                                      bf16   ? 16
                                      : int4 ? 4
                                             : 8,
                                      bf16 ? bf16_kgroup(isa) : 0);
  std::mt19937 rng(1);
  const size_t wbytes = size_t(l.total_bytes() + 63) / 64 * 64;
  AlignedBuffer wbuf(wbytes * size_t(copies));  // the layer's weights are 64-byte aligned too
  int8_t* w = wbuf.as<int8_t>();
  std::vector<float> d(size_t(N), 0.01f), sc(size_t(l.total_cols()));
  std::vector<int32_t> comp(size_t(l.total_cols()));
  if (bf16) {
    std::vector<float> wf(size_t(N * K));
    for (auto& x : wf) x = float(int(rng() % 2001) - 1000) * 1e-4f;
    const float* ws[2] = {wf.data(), wf.data()};
    formats::pack_bf16_strips(l, ws, reinterpret_cast<uint16_t*>(w), sc.data(), comp.data());
  } else {
    std::vector<int8_t> q(size_t(N * K));
    for (auto& x : q) x = int8_t(int4 ? 16 * (int(rng() % 16) - 8) : int(rng() % 255) - 127);
    const int8_t* qs[2] = {q.data(), q.data()};
    const float* ds[2] = {d.data(), d.data()};
    formats::pack_int8_strips(l, qs, ds, w, sc.data(), comp.data(), int4_offset_nibbles(isa, fmt));
  }
  for (int64_t c = 1; c < copies; ++c) std::memcpy(w + size_t(c) * wbytes, w, wbytes);
  // Rows as the executor lays them out: int8 (every a is 1), or fp32 for bf16 with the row
  // stride moved off a multiple of 1 KiB (runtime/moe_layer.cpp unaliased_stride).
  int64_t lda = bf16 ? (l.padded_k() * 4 + 63) / 64 * 64 : l.padded_k();
  if (bf16 && lda % 1024 == 0) lda += 64;
  std::vector<int8_t> a(size_t(M * lda), 1);
  if (bf16)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) {
        const float x = float(int(rng() % 2001) - 1000) * 1e-3f;
        std::memcpy(&a[size_t(m * lda + k * 4)], &x, 4);
      }
  std::vector<float> as(size_t(M), 0.01f), rw(size_t(M), 0.5f), out(size_t(M * l.total_cols()));
  std::vector<float*> rows;
  for (int64_t m = 0; m < M; ++m) rows.push_back(out.data() + m * l.total_cols());
  constexpr int kScatterSets = 32;
  AlignedBuffer partial;  // huge pages from 2 MiB on, as the layer's scratch (moe_layer.cpp)
  if (scatter > M) {
    const int64_t stride = l.total_cols() + 16;  // off a multiple of 1 KiB, as the layer's
    partial = AlignedBuffer(size_t(scatter * stride) * 4);
    std::memset(partial.as<float>(), 0, size_t(scatter * stride) * 4);
    std::vector<int64_t> tokens(static_cast<size_t>(scatter));
    for (int64_t t = 0; t < scatter; ++t) tokens[size_t(t)] = t;
    rows.clear();
    for (int set = 0; set < kScatterSets; ++set) {
      std::shuffle(tokens.begin(), tokens.end(), rng);
      std::sort(tokens.begin(), tokens.begin() + M);  // an expert's rows in token order
      for (int64_t m = 0; m < M; ++m)
        rows.push_back(partial.as<float>() + tokens[size_t(m)] * stride);
    }
  }
  // The executor's half-strip tiles where it runs them (avx2 int4, unless KT_JIT_HALF_STRIPS=0),
  // else its prefill (or, for M up to a tile, decode) kernel.
  const GemmKernelSet ks = make_gemm_kernel_set(isa, fmt, epi, 0, 0, K % 2 == 0);
  const bool halves = ks.tile_rows && half_strip_kernel(ks.tile_full) && M >= ks.tile_rows;
  // At isa amx the AMX tiles' 16-row blocks (M a multiple of 16 measures them alone; the
  // executor sends any other rows to the VNNI tiles).
  const bool amx_tiles = isa == IsaLevel::amx && ks.tile_rows && M >= ks.tile_rows;
  // BF16 at avx512_bf16: the vdpbf16ps pair tiles the executor runs from tile_min_rows rows
  // (its rows' bf16 pairs here the bits of the fp32 rows: timing, not values).
  const bool pair_tiles = bf16 && isa == IsaLevel::avx512_bf16 && ks.tile_rows &&
                          (ks.tile_full.variant & kBf16Pairs) && M >= ks.tile_min_rows;
  const int mr = halves || amx_tiles || pair_tiles ? ks.tile_rows : ks.prefill_full.m_r;
  KernelKey key;
  // (M up to the decode tiles' rows: a decode tile, as the executor runs it; more: the prefill
  // kernel, which may take fewer rows than its m_r, int8's 12-row tiles at avx512_bf16)
  const bool prefill = M > std::min(mr, ks.max_rows) || halves;
  key.kind = prefill ? KernelKind::gemm_prefill : KernelKind::gemm_decode;
  key.isa = isa;
  key.format = fmt;
  key.m_r = uint8_t(prefill ? mr : M);
  key.n_vec = uint8_t(l.strip_vecs);
  key.epilogue = epi;
  if (halves) key.variant = ks.tile_full.variant;
  if (amx_tiles || pair_tiles) key = ks.tile_full;
  const Kernel* k = KernelCache::instance().get(key);
  if (!k) return 1;
  GemmArgs args{a.data(),    lda,         w, l.full_strips, l.k4,  as.data(), sc.data(),
                comp.data(), rows.data(), 0, rw.data(),     M / mr};
  AlignedBuffer scratch(size_t(gemm_scratch_bytes(key, l.k4)) + 64);  // int4 at amx decodes here
  args.scratch = scratch.as<int8_t>();
  std::vector<int32_t> row_sums(size_t(M), int32_t(l.k));  // Σ_k a of each row (every a is 1)
  args.a_gsum = row_sums.data();
  auto fn = reinterpret_cast<GemmFn>(const_cast<void*>(k->entry()));
  // prefill kernels that take the rows after their blocks (tail_rows_kernel) run all M, as in
  // the layer; others the whole blocks
  if (key.kind == KernelKind::gemm_prefill && !halves && !amx_tiles) {
    const PrefillSplit sp = prefill_split(key, M);
    args.m_blocks = sp.blocks;
    args.m_tail = sp.tail;
  }
  const int64_t rows_done = gemm_call_rows(key, args);
  const double ops = 2.0 * double(rows_done) * double(l.full_strips * l.strip_cols(l.strip_vecs)) *
                     double(l.padded_k());
  std::vector<double> t;
  const int reps = int(std::max<int64_t>(200, 3 * copies));
  for (int rep = 0; rep < reps; ++rep) {
    args.w = w + size_t(rep % copies) * wbytes;
    if (scatter > M) args.out_rows = rows.data() + (rep % kScatterSets) * M;
    // the last strip prefetches the next matrix, as the executor asks (GemmArgs::pf_last)
    args.pf_last = copies > 1 ? w + size_t((rep + 1) % copies) * wbytes : nullptr;
    auto t0 = std::chrono::steady_clock::now();
    fn(&args);
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  const double gops = ops / t[t.size() / 2] / 1e9, best = ops / t[0] / 1e9;
  const bool vnni = int(isa) >= int(IsaLevel::avx512_vnni);
  const bool tiles = isa == IsaLevel::amx && key.kind == KernelKind::gemm_prefill;
  const PeakOp op = tiles && bf16               ? PeakOp::tdpbf16ps
                    : tiles                     ? PeakOp::tdpbusd
                    : pair_tiles                ? PeakOp::dpbf16
                    : bf16                      ? PeakOp::fma_f32
                    : vnni                      ? PeakOp::vpdpbusd
                    : int4_int16_sums(isa, fmt) ? PeakOp::maddubsw_w
                                                : PeakOp::maddubsw;
  const char* op_name = op == PeakOp::tdpbf16ps    ? "tdpbf16ps"
                        : op == PeakOp::tdpbusd    ? "tdpbusd"
                        : op == PeakOp::dpbf16     ? "vdpbf16ps"
                        : bf16                     ? "FMA"
                        : vnni                     ? "vpdpbusd"
                        : op == PeakOp::maddubsw_w ? "vpmaddubsw+vpaddw"
                                                   : "vpmaddubsw+vpmaddwd+vpaddd";
  const double peak = measure_peak_gops(isa, uint8_t(op), 5);
  std::printf(
      "%s M=%lld N=%lld K=%lld x%lld: median %.1f Gop/s = %.0f%%, best %.1f Gop/s = %.0f%% of the "
      "same-run %s peak (%.1f Gop/s)\n",
      k->name.c_str(), (long long)rows_done,
      (long long)(l.full_strips * l.strip_cols(l.strip_vecs)), (long long)K, (long long)copies,
      gops, 100 * gops / peak, best, 100 * best / peak, op_name, peak);
  return 0;
}
