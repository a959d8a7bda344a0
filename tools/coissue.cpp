// Which instructions run beside a kernel's dot-product stream on this core, and which take its
// pipes: a generated loop of groups of 6 independent zmm dot instructions (`vdpbf16ps` or
// `vpdpbusd`, 24 accumulators, so one a cycle at the peak) with N copies of a probed instruction
// added to each group, timed against the bare loop in the same process.
//   build/ktjit_coissue [vdpbf16ps|vpdpbusd][_reg] [N] [probe ...]
// Prints, per probe, the extra cycles each copy costs the stream: 0 where it issues beside it, 1
// where it takes a dot instruction's slot (the bare group is 6 cycles on a core that issues one
// zmm dot a cycle, as a Zen 4; a Zen 5 issues two, and the cycles read half). The dots take their
// second source as an embedded {1to16} broadcast from memory, as the kernels did before
// 2026-11-27; with `_reg`, from a register (what a vpbroadcastd leaves): on a Zen 5 the memory
// form held the stream to 86 % of the register form. A design aid for decode
// and fold code (docs/evidence/zen4_avx512.md); speed is judged in `kt-jit bench`.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
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

// Probed instructions: each writes a rotating temporary d (zmm26..31), reads zmm24/25 or the
// 4 KiB buffer at rax, so no probe copy depends on another.
struct Probe {
  const char* name;
  std::function<void(CodeGenerator&, const Zmm& d, int i)> emit;
};
std::vector<Probe> probes() {
  const Zmm a(25), b(24);
  auto mem = [](int i) { return zword[rax + 1024 + 64 * (i % 8)]; };
  return {
      {"vmulps", [=](CodeGenerator& g, const Zmm& d, int) { g.vmulps(d, a, b); }},
      {"vfmadd231ps", [=](CodeGenerator& g, const Zmm& d, int) { g.vfmadd231ps(d, a, b); }},
      {"vcvtdq2ps", [=](CodeGenerator& g, const Zmm& d, int) { g.vcvtdq2ps(d, a); }},
      {"vpmulld", [=](CodeGenerator& g, const Zmm& d, int) { g.vpmulld(d, a, b); }},
      {"vpmaddwd", [=](CodeGenerator& g, const Zmm& d, int) { g.vpmaddwd(d, a, b); }},
      {"vpdpwssd", [=](CodeGenerator& g, const Zmm& d, int) { g.vpdpwssd(d, a, b); }},
      {"vpaddd", [=](CodeGenerator& g, const Zmm& d, int) { g.vpaddd(d, a, b); }},
      {"vpaddw", [=](CodeGenerator& g, const Zmm& d, int) { g.vpaddw(d, a, b); }},
      {"vpaddsw", [=](CodeGenerator& g, const Zmm& d, int) { g.vpaddsw(d, a, b); }},
      {"vpsubusw", [=](CodeGenerator& g, const Zmm& d, int) { g.vpsubusw(d, a, b); }},
      {"vpmaxsw", [=](CodeGenerator& g, const Zmm& d, int) { g.vpmaxsw(d, a, b); }},
      {"vpminuw", [=](CodeGenerator& g, const Zmm& d, int) { g.vpminuw(d, a, b); }},
      {"vpandd", [=](CodeGenerator& g, const Zmm& d, int) { g.vpandd(d, a, b); }},
      {"vpternlogd", [=](CodeGenerator& g, const Zmm& d, int) { g.vpternlogd(d, a, b, 0xf8); }},
      {"vpsrld", [=](CodeGenerator& g, const Zmm& d, int) { g.vpsrld(d, a, 4); }},
      {"vpsraw", [=](CodeGenerator& g, const Zmm& d, int) { g.vpsraw(d, a, 4); }},
      {"vpsllw", [=](CodeGenerator& g, const Zmm& d, int) { g.vpsllw(d, a, 8); }},
      {"vpsrlvw", [=](CodeGenerator& g, const Zmm& d, int) { g.vpsrlvw(d, a, b); }},
      {"vpshufb", [=](CodeGenerator& g, const Zmm& d, int) { g.vpshufb(d, a, b); }},
      {"vpermb", [=](CodeGenerator& g, const Zmm& d, int) { g.vpermb(d, a, b); }},
      {"vpermw", [=](CodeGenerator& g, const Zmm& d, int) { g.vpermw(d, a, b); }},
      {"vpermps", [=](CodeGenerator& g, const Zmm& d, int) { g.vpermps(d, a, b); }},
      {"vpermi2b", [=](CodeGenerator& g, const Zmm& d, int) { g.vpermi2b(d, a, b); }},
      {"vpmultishiftqb", [=](CodeGenerator& g, const Zmm& d, int) { g.vpmultishiftqb(d, a, b); }},
      {"vpunpcklbw", [=](CodeGenerator& g, const Zmm& d, int) { g.vpunpcklbw(d, a, b); }},
      {"vptestmw",
       [=](CodeGenerator& g, const Zmm&, int i) { g.vptestmw(Opmask(1 + i % 4), a, b); }},
      {"vpmovsxbd_load",
       [=](CodeGenerator& g, const Zmm& d, int i) { g.vpmovsxbd(d, xword[rax + 64 * (i % 8)]); }},
      {"vpbroadcastd_load",
       [=](CodeGenerator& g, const Zmm& d, int i) { g.vpbroadcastd(d, dword[rax + 4 * i]); }},
      {"zmm_load", [=](CodeGenerator& g, const Zmm& d, int i) { g.vmovups(d, mem(i)); }},
      {"zmm_store", [=](CodeGenerator& g, const Zmm&, int i) { g.vmovups(mem(i), a); }},
      {"ymm_store", [=](CodeGenerator& g, const Zmm&, int i) { g.vmovups(mem(i), Ymm(25)); }},
  };
}

class Loop : public x64::JitGenerator {
 public:
  // fn(buf, iterations): `iterations` times 16 groups of 6 dot instructions + n probe copies.
  Loop(bool bf16, bool reg, const Probe* p, int n) : JitGenerator(IsaLevel::avx512_bf16, 1 << 18) {
    Label top;
    mov(rax, rdi);
    for (int i = 24; i < 32; ++i) vmovups(Zmm(i), zword[rax + 64 * (i - 24)]);
    int acc = 0, t = 0;
    L(top);
    for (int g = 0; g < 16; ++g) {
      for (int j = 0; j < 6; ++j, ++acc) {
        const Zmm c(acc % 24);
        if (bf16 && reg)
          vdpbf16ps(c, Zmm(24), Zmm(25));
        else if (bf16)
          vdpbf16ps(c, Zmm(24), ptr_b[rax + 4 * j]);
        else if (reg)
          vpdpbusd(c, Zmm(24), Zmm(25));
        else
          vpdpbusd(c, Zmm(24), ptr_b[rax + 4 * j]);
      }
      for (int x = 0; x < n && p; ++x, ++t) p->emit(*this, Zmm(26 + t % 6), t);
    }
    dec(rsi);
    jnz(top, T_NEAR);
    vzeroupper();
    ret();
  }
};

// Best time of 25 calls of 2000 iterations, in ns per group.
double ns_per_group(bool bf16, bool reg, const Probe* p, int n, void* buf) {
  Loop loop(bf16, reg, p, n);
  ExecutableCode x = publish_or_exit(loop.bytes(), "coissue");
  auto fn = reinterpret_cast<void (*)(void*, int64_t)>(const_cast<void*>(x.entry()));
  constexpr int64_t kIters = 2000;
  double best = 1e30;
  for (int r = 0; r < 25; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    fn(buf, kIters);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, s);
  }
  return best / (kIters * 16) * 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  std::string dot = argc > 1 ? argv[1] : "vdpbf16ps";
  const bool reg = dot.size() > 4 && dot.compare(dot.size() - 4, 4, "_reg") == 0;
  if (reg) dot.resize(dot.size() - 4);
  if (dot != "vdpbf16ps" && dot != "vpdpbusd") {
    std::fprintf(stderr, "coissue: the stream is vdpbf16ps or vpdpbusd (+ _reg), got %s\n",
                 dot.c_str());
    return 2;
  }
  const int n = argc > 2 ? std::atoi(argv[2]) : 2;
  // the probes include VBMI and BF16 instructions: the avx512_bf16 level (which needs VBMI)
  if (!level_usable(IsaLevel::avx512_bf16, cpu_features())) {
    std::fprintf(stderr, "coissue: this CPU does not run the avx512_bf16 level\n");
    return 2;
  }
  std::vector<Probe> all = probes(), chosen;
  for (int i = 3; i < argc; ++i)
    for (const Probe& p : all)
      if (p.name == std::string(argv[i])) chosen.push_back(p);
  if (chosen.empty()) chosen = all;
  alignas(64) static uint8_t buf[4096];
  for (size_t i = 0; i < sizeof buf; ++i) buf[i] = uint8_t(0x3f ^ (i & 0x11));  // finite values
  const bool bf16 = dot == "vdpbf16ps";
  const double base = ns_per_group(bf16, reg, nullptr, 0, buf);
  std::printf("6 x %s (%s) a group: %.3f ns (%.2f GHz at one a cycle); %d probe copies a group\n",
              dot.c_str(), reg ? "register source" : "{1to16} memory source", base, 6.0 / base, n);
  std::printf("%-20s %10s %22s\n", "probe", "ns/group", "extra cycles a copy");
  for (const Probe& p : chosen) {
    const double t = ns_per_group(bf16, reg, &p, n, buf);
    std::printf("%-20s %10.3f %22.2f\n", p.name, t, (t - base) / base * 6.0 / n);
  }
  return 0;
}
