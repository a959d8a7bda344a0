// Microbenchmark of one generated INT8 (or INT4) GEMM kernel with its weights hot in cache:
//   build/ktjit_kernel_bench [isa] [M] [N] [K] [epilogue: store|siluup|accum] [int8|int4]
// Prints Gop/s next to the same run's vpdpbusd / maddubsw peak. Speed is judged here and in
// `kt-jit bench`, never in tests.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "formats/int8.hpp"
#include "jit/gemm.hpp"
#include "jit/x64/bench_loops.hpp"
#include "runtime/machine_limits.hpp"
#include "runtime/moe_layer.hpp"

using namespace ktjit;

int main(int argc, char** argv) {
  IsaLevel isa = argc > 1 ? parse_isa(argv[1]) : selected_isa();
  const int64_t M = argc > 2 ? std::atoll(argv[2]) : 60;
  const int64_t N = argc > 3 ? std::atoll(argv[3]) : 256;
  const int64_t K = argc > 4 ? std::atoll(argv[4]) : 2048;
  const std::string epi_s = argc > 5 ? argv[5] : "store";
  const Epilogue epi = epi_s == "siluup"  ? Epilogue::siluup
                       : epi_s == "accum" ? Epilogue::accum
                                          : Epilogue::store;
  const bool int4 = argc > 6 && std::string(argv[6]) == "int4";
  const int lanes = vec_lanes(isa);
  auto l = formats::StripLayout::make(N, K, lanes, kStripVecs, epi == Epilogue::siluup ? 2 : 1,
                                      int4 ? 4 : 8);
  std::mt19937 rng(1);
  std::vector<int8_t> q(size_t(N * K));
  AlignedBuffer wbuf(size_t(l.total_bytes()));  // the layer's weights are 64-byte aligned too
  int8_t* w = wbuf.as<int8_t>();
  for (auto& x : q) x = int8_t(int4 ? 16 * (int(rng() % 16) - 8) : int(rng() % 255) - 127);
  std::vector<float> d(size_t(N), 0.01f), sc(size_t(l.total_cols()));
  std::vector<int32_t> comp(size_t(l.total_cols()));
  const int8_t* qs[2] = {q.data(), q.data()};
  const float* ds[2] = {d.data(), d.data()};
  const WeightFormat fmt = int4 ? WeightFormat::int4 : WeightFormat::int8;
  formats::pack_int8_strips(l, qs, ds, w, sc.data(), comp.data(), int4_offset_nibbles(isa, fmt));
  const int64_t lda = l.padded_k();
  std::vector<int8_t> a(size_t(M * lda), 1);
  std::vector<float> as(size_t(M), 0.01f), rw(size_t(M), 0.5f), out(size_t(M * l.total_cols()));
  std::vector<float*> rows;
  for (int64_t m = 0; m < M; ++m) rows.push_back(out.data() + m * l.total_cols());
  const int mr = gemm_max_rows(isa, fmt);
  KernelKey key;
  key.kind = M > mr ? KernelKind::gemm_prefill : KernelKind::gemm_decode;
  key.isa = isa;
  key.format = fmt;
  key.m_r = uint8_t(M > mr ? mr : M);
  key.n_vec = kStripVecs;
  key.epilogue = epi;
  const Kernel* k = KernelCache::instance().get(key);
  if (!k) return 1;
  GemmArgs args{a.data(),    lda,         w, l.full_strips, l.k4,  as.data(), sc.data(),
                comp.data(), rows.data(), 0, rw.data(),     M / mr};
  std::vector<int32_t> row_sums(size_t(M), int32_t(l.k));  // Σ_k a of each row (every a is 1)
  args.a_gsum = row_sums.data();
  auto fn = reinterpret_cast<GemmFn>(const_cast<void*>(k->entry()));
  const int64_t rows_done = M > mr ? M / mr * mr : M;
  const double ops =
      2.0 * double(rows_done) * double(l.full_strips * l.strip_cols(4)) * double(l.padded_k());
  std::vector<double> t;
  for (int rep = 0; rep < 200; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    fn(&args);
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  const double gops = ops / t[t.size() / 2] / 1e9, best = ops / t[0] / 1e9;
  const bool vnni = int(isa) >= int(IsaLevel::avx512_vnni);
  const double peak =
      measure_peak_gops(isa, uint8_t(vnni ? x64::PeakOp::vpdpbusd : x64::PeakOp::maddubsw), 5);
  std::printf(
      "%s M=%lld N=%lld K=%lld: median %.1f Gop/s = %.0f%%, best %.1f Gop/s = %.0f%% of the "
      "same-run %s peak (%.1f Gop/s)\n",
      k->name.c_str(), (long long)rows_done, (long long)(l.full_strips * l.strip_cols(4)),
      (long long)K, gops, 100 * gops / peak, best, 100 * best / peak,
      vnni ? "vpdpbusd" : "maddubsw", peak);
  return 0;
}
