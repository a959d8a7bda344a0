// int8 VNNI (or bf16 pair) prefill tiles streaming strips from DRAM, in two strip layouts:
//   build/ktjit_strip_stream [bf16] [k=K] [rows ...]        (default 6 8 10 12 14 16 20 24 32)
// Weights: 512 MiB of strips (by default K = 2048, Qwen3-30B-A3B's gate/up: int8 4-vector strips
// of 128 KiB or 2-vector strips of 64 KiB), walked start to end, so every line comes from DRAM
// once.
//   "4v": today's tiles (jit/x64/gemm.cpp): blocks of 6 rows x 4 vectors, the call's last rows
//         as the executor splits them (prefill_split: 4 + 3, int8 4 + 4 after the blocks); each
//         block reads the strip again (from L2), every tile prefetches its rows' share of the
//         next strip (8 lines a site, in bytes, 516 a site from S = 13 rows, 512 M / 13 below)
//         and, below S + 2 rows (bf16: S), its own strip 8192 bytes ahead (prefetcht0).
//   "2v": blocks of at most 12 rows x 2 vectors (24 accumulators), the rows spread evenly over
//         ceil(M / 12) blocks: a call of up to 12 rows reads every line once, in order, 8192
//         bytes ahead (prefetcht0), as the decode tiles do; more rows share the next strip as
//         "4v" does.
// Each tile's K loop is the int8 VNNI one (weight vectors loaded, each row's dword broadcast,
// vpdpbusd), or with `bf16` the pair kernels' (bf16 k pairs, vdpbf16ps; K steps of 2 k, so the
// strips are twice as long); its end stores the accumulators (no scales, no SiLU, no accumulate:
// the kernels' epilogues are left out). Prints the same-run read probe (the buffer read with plain
// loads), then GB/s of weights, Gop/s (bf16: GFLOP/s) and % of the probe per row count and layout,
// medians of 5 walks taken in turn. A design aid (docs/evidence/zen5_avx512.md, 2026-11-28, a
// thirty-seventh session); speed is judged in `kt-jit bench`, and `ktjit_kernel_bench` times the
// generated kernels themselves.
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "jit/code_memory.hpp"
#include "jit/cpu/cpu.hpp"
#include "jit/x64/generator.hpp"
#include "tools/tool_code.hpp"

using namespace ktjit;
using namespace Xbyak;
using namespace Xbyak::util;

namespace {

int g_k = 2048;       // K: Qwen3's hidden size (gate/up), or k=768 (its down)
bool g_bf16 = false;  // bf16 pairs instead of int8
// K steps (4 k each; bf16: a k pair)
int steps() {
  return g_bf16 ? g_k / 2 : g_k / 4;
}
constexpr int64_t kLda = 2 * 4096 + 64;  // activation row stride (K up to 4096)
constexpr int kAhead = 8192;             // read-ahead distance (bytes)
constexpr int64_t kBufferBytes = int64_t(512) << 20;
constexpr int kStreamRows = 13;  // S: from here a call asks for the whole next strip

struct Tile {
  int row0, rows;
};

// The tiles of one strip for a call of m rows (m == 0: the read probe, loads only).
std::vector<Tile> tiles_for(int vecs, int m) {
  std::vector<Tile> t;
  if (m == 0) return {{0, 0}};
  if (vecs == 4) {
    int blocks = m / 6, tail = m % 6;
    // prefill_split: 7 -> 4 + 3, int8 also 8 -> 4 + 4
    if (blocks > 0 && (tail == 1 || (tail == 2 && !g_bf16))) {
      --blocks;
      tail += 6;
    }
    int r = 0;
    for (int b = 0; b < blocks; ++b, r += 6) t.push_back({r, 6});
    if (tail > 6) {
      t.push_back({r, 4});
      t.push_back({r + 4, tail - 4});
    } else if (tail) {
      t.push_back({r, tail});
    }
    return t;
  }
  const int n = (m + 11) / 12;
  for (int b = 0, r = 0; b < n; ++b) {
    const int rows = m / n + (b < m % n ? 1 : 0);
    t.push_back({r, rows});
    r += rows;
  }
  return t;
}

// fn(weights, activations, out, strips)
class StreamTiles : public x64::JitGenerator {
 public:
  StreamTiles(int vecs, int m)
      : JitGenerator(g_bf16 ? IsaLevel::avx512_bf16 : IsaLevel::avx512_vnni, 1 << 20) {
    const int step = vecs * 64, strip = steps() * step;
    const std::vector<Tile> tiles = tiles_for(vecs, m);
    const bool one_pass = tiles.size() == 1;
    // The next strip's share a site (every second K step) in bytes, Q r / M.
    const int q = m >= kStreamRows ? 516 * vecs / 4 : 512 * vecs / 4 * m / kStreamRows;
    const bool ahead = m > 0 && (vecs == 2 ? one_pass : m < kStreamRows + (g_bf16 ? 0 : 2));
    Label strip_loop;
    L(strip_loop);
    lea(r11, ptr[rdi + strip]);  // the next strip, for the shares
    for (const Tile& tile : tiles) {
      const int r = tile.rows;
      for (int i = 0; i < r * vecs; ++i) vpxord(Zmm(i), Zmm(i), Zmm(i));
      mov(r8, rdi);
      lea(r9, ptr[rsi + tile.row0 * kLda]);
      mov(r10, steps() / 2);
      const int share = m ? q * (tile.row0 + r) / m - q * tile.row0 / m : 0;
      Label k_loop;
      L(k_loop);
      if (share && !(vecs == 2 && one_pass)) {
        for (int i = 0; i < 8; ++i) prefetcht1(ptr[r11 + i * 64]);
        add(r11, share);
      }
      for (int u = 0; u < 2; ++u) {
        for (int v = 0; v < vecs; ++v) {
          if (ahead) prefetcht0(ptr[r8 + u * step + v * 64 + kAhead]);
          vmovdqu8(Zmm(24 + v), ptr[r8 + u * step + v * 64]);
        }
        for (int row = 0; row < r; ++row) {
          const Zmm b(28 + row % 4);
          vpbroadcastd(b, ptr[r9 + row * kLda + u * 4]);
          for (int v = 0; v < vecs; ++v)
            if (g_bf16)
              vdpbf16ps(Zmm(row * vecs + v), b, Zmm(24 + v));
            else
              vpdpbusd(Zmm(row * vecs + v), b, Zmm(24 + v));
        }
      }
      add(r8, 2 * step);
      add(r9, 8);
      dec(r10);
      jnz(k_loop, T_NEAR);
      for (int i = 0; i < r * vecs; ++i) vmovdqu32(ptr[rdx + i * 64], Zmm(i));
    }
    add(rdi, strip);
    dec(rcx);
    jnz(strip_loop, T_NEAR);
    vzeroupper();
    ret();
  }
};

using Fn = void (*)(const void*, const void*, void*, int64_t);

}  // namespace

int main(int argc, char** argv) {
  int first = 1;
  for (; first < argc; ++first) {
    const std::string a = argv[first];
    if (a == "bf16")
      g_bf16 = true;
    else if (a.rfind("k=", 0) == 0)
      g_k = std::atoi(a.c_str() + 2);
    else
      break;
  }
  if (g_k < 64 || g_k > 4096 || g_k % 64) {
    std::fprintf(stderr, "strip_stream: k=64 .. 4096, a multiple of 64\n");
    return 2;
  }
  const IsaLevel level = g_bf16 ? IsaLevel::avx512_bf16 : IsaLevel::avx512_vnni;
  if (!level_usable(level, cpu_features())) {
    std::fprintf(stderr, "strip_stream: this CPU does not run the %s level\n", isa_name(level));
    return 2;
  }
  std::vector<int> rows;
  for (int i = first; i < argc; ++i) rows.push_back(std::atoi(argv[i]));
  if (rows.empty()) rows = {6, 8, 10, 12, 14, 16, 20, 24, 32};
  for (int m : rows)
    if (m < 1 || m > 48) {
      std::fprintf(stderr, "strip_stream: rows 1 .. 48\n");
      return 2;
    }
  const int64_t bytes = kBufferBytes + 2 * kAhead;
  auto* w = static_cast<uint8_t*>(std::aligned_alloc(size_t(1) << 21, size_t(bytes)));
  madvise(w, size_t(bytes), MADV_HUGEPAGE);
  for (int64_t i = 0; i < bytes; ++i) w[i] = uint8_t(i * 7);
  std::vector<uint8_t> act(size_t(48 * kLda), 1);
  std::vector<uint8_t> out(48 * 4 * 64);

  struct Case {
    std::string name;
    int vecs, m;
    ExecutableCode code;
    std::vector<double> s;
  };
  std::vector<Case> cases;
  auto add = [&](int vecs, int m) {
    StreamTiles gen(vecs, m);
    ExecutableCode x = publish_or_exit(gen.bytes(), "strip_stream");
    cases.push_back({m ? std::to_string(vecs) + "v" : "probe", vecs, m, std::move(x), {}});
  };
  add(4, 0);
  for (int m : rows) {
    add(4, m);
    add(2, m);
  }
  for (int round = 0; round < 5; ++round)
    for (Case& c : cases) {
      const int64_t strips = kBufferBytes / (int64_t(steps()) * c.vecs * 64);
      auto fn = reinterpret_cast<Fn>(const_cast<void*>(c.code.entry()));
      const auto t0 = std::chrono::steady_clock::now();
      fn(w, act.data(), out.data(), strips);
      c.s.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  double probe = 0;
  for (Case& c : cases) {
    std::sort(c.s.begin(), c.s.end());
    const int64_t strip = int64_t(steps()) * c.vecs * 64;
    const double gbs = double(kBufferBytes / strip * strip) / c.s[c.s.size() / 2] / 1e9;
    const double ops = gbs * 2 * c.m / (g_bf16 ? 2 : 1);  // (bf16: 2 bytes a weight)
    if (!c.m) {
      probe = gbs;
      std::printf("read probe: %.1f GB/s\n%5s %6s %8s %8s %7s\n", gbs, "rows", "layout", "GB/s",
                  g_bf16 ? "GFLOP/s" : "Gop/s", "%probe");
      continue;
    }
    std::printf("%5d %6s %8.1f %8.0f %6.1f%%\n", c.m, c.name.c_str(), gbs, ops, 100 * gbs / probe);
  }
  std::free(w);
  return 0;
}
