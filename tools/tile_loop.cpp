// A qgroup prefill tile's K loop alone, its code bytes in a buffer that fits L1 or not:
//   build/ktjit_tile_loop [buffer KiB ...]        (default 16 64 128 256 512)
// Byte codes as the VNNI qgroup kernels lay them out (per group of 4 K steps, 4 code vectors of
// 64 bytes a step, then 64 bytes of sub-scales), walked start to end by two tiles: 3 rows x 4
// vectors (12 vpdpbusd a step, all 4 vectors loaded) in one pass, and 6 rows x 2 vectors in two
// passes (vectors 0 and 2, then 1 and 3: the half-strip tiles), each bare and with a group end
// every 4 steps as Q6_K's (the 12 int32 sums converted, the sub-scale vectors widened and
// converted, 12 FMAs into the fp32 sums). Prints % of a register-only vpdpbusd stream timed in
// the same run. Nothing streams from DRAM meanwhile, as it does in a layer. A design aid
// (docs/FORMATS.md "VNNI half-strip tiles"); speed is judged in `kt-jit bench`.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "jit/code_memory.hpp"
#include "jit/cpu/cpu.hpp"
#include "jit/x64/generator.hpp"
#include "tools/tool_code.hpp"

using namespace ktjit;
using namespace Xbyak;
using namespace Xbyak::util;

namespace {

// fn(codes, acts, iterations): rdi codes, rsi activation rows (3 KiB apart), rdx count. Each
// iteration walks the buffer's groups (4 K steps of 4 code vectors, 64 bytes each, then 64 bytes
// of sub-scales): once with all 4 vectors (3 x 4), or twice (6 x 2: vectors 0 and 2, then 1 and 3,
// as the two passes of a half-strip tile). group_end adds the fold. peak: 48 register-only
// vpdpbusd into 12 sums a group, no loads.
class TileLoop : public x64::JitGenerator {
 public:
  TileLoop(int rows, int vecs, int64_t groups, bool group_end, bool peak)
      : JitGenerator(IsaLevel::avx512_bf16, 1 << 16) {
    for (int i = 0; i < 32; ++i) vpxord(Zmm(i), Zmm(i), Zmm(i));
    Label top;
    L(top);
    for (int pass = 0; pass < 4 / vecs; ++pass) {
      Label group;
      mov(r9, rdi);
      mov(r10, rsi);
      mov(r11, groups);
      L(group);
      for (int a = 12; a < 24; ++a) vpxord(Zmm(a), Zmm(a), Zmm(a));
      for (int k = 0; k < 4; ++k) {
        if (peak) {
          for (int a = 12; a < 24; ++a) vpdpbusd(Zmm(a), Zmm(28), Zmm(24 + a % 4));
          continue;
        }
        // tile vector v is strip vector pass + v * (4 / vecs)
        for (int v = 0; v < vecs; ++v)
          vmovdqu8(Zmm(24 + v), ptr[r9 + (k * 4 + pass + v * (4 / vecs)) * 64]);
        for (int m = 0; m < rows; ++m) {
          vpbroadcastd(Zmm(28), ptr[r10 + m * 3072 + k * 4]);
          for (int v = 0; v < vecs; ++v) vpdpbusd(Zmm(12 + m * vecs + v), Zmm(28), Zmm(24 + v));
        }
      }
      if (group_end) {
        for (int a = 12; a < 24; ++a) vcvtdq2ps(Zmm(a), Zmm(a));
        for (int v = 0; v < vecs; ++v) {
          vpmovsxbd(Zmm(24), ptr[r9 + 1024 + (pass + v * (4 / vecs)) * 16]);
          vcvtdq2ps(Zmm(24), Zmm(24));
          for (int m = 0; m < rows; ++m)
            vfmadd231ps(Zmm(m * vecs + v), Zmm(12 + m * vecs + v), Zmm(24));
        }
      }
      add(r9, 1088);
      add(r10, 16);
      dec(r11);
      jnz(group, T_NEAR);
    }
    dec(rdx);
    jnz(top, T_NEAR);
    vzeroupper();
    ret();
  }
};

// Best of 9 calls, in ns per vpdpbusd.
double ns_per_dot(int rows, int vecs, int64_t groups, bool group_end, bool peak, uint8_t* codes,
                  uint8_t* acts) {
  TileLoop loop(rows, vecs, groups, group_end, peak);
  ExecutableCode x = publish_or_exit(loop.bytes(), "tile_loop");
  auto fn = reinterpret_cast<void (*)(void*, void*, int64_t)>(const_cast<void*>(x.entry()));
  const int64_t dots_per_iter = groups * 48 * (peak ? 1 : 4 / vecs);  // (6 x 2: two passes)
  const int64_t iters = std::max<int64_t>(1, int64_t(4e7) / dots_per_iter);
  fn(codes, acts, std::max<int64_t>(1, iters / 10));
  double best = 1e30;
  for (int r = 0; r < 9; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    fn(codes, acts, iters);
    best = std::min(best,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best / (double(iters) * dots_per_iter) * 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  if (!level_usable(IsaLevel::avx512_vnni, cpu_features())) {
    std::fprintf(stderr, "tile_loop: this CPU does not run the avx512_vnni level\n");
    return 2;
  }
  std::vector<int64_t> kib;
  for (int i = 1; i < argc; ++i) kib.push_back(std::atoll(argv[i]));
  if (kib.empty()) kib = {16, 64, 128, 256, 512};
  for (int64_t k : kib)
    if (k < 2) {
      std::fprintf(stderr, "tile_loop: buffers of at least 2 KiB\n");
      return 2;
    }
  const int64_t max_bytes = *std::max_element(kib.begin(), kib.end()) * 1024;
  // (rows 3 KiB apart: each group's 4 steps read 16 bytes of a row, the rows overlap: values only)
  std::vector<uint8_t> codes(size_t(max_bytes + 4096), 3), acts(size_t(6 * 3072 + max_bytes), 1);
  const double peak = ns_per_dot(3, 4, 16, false, true, codes.data(), acts.data());
  std::printf("register-only vpdpbusd: %.4f ns each; %% of that below\n", peak);
  std::printf("%9s %12s %12s %12s %12s\n", "KiB", "3x4 bare", "3x4 fold", "6x2 bare", "6x2 fold");
  for (int64_t k : kib) {
    const int64_t groups = k * 1024 / 1088;
    std::printf("%9lld", static_cast<long long>(k));
    for (auto [rows, vecs] : {std::pair{3, 4}, std::pair{6, 2}})
      for (bool fold : {false, true})
        std::printf(
            " %11.1f%%",
            100.0 * peak / ns_per_dot(rows, vecs, groups, fold, false, codes.data(), acts.data()));
    std::printf("\n");
  }
  return 0;
}
