#include "jit/cpu/cpu.hpp"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>

namespace ktjit {
namespace {

struct Regs {
  uint32_t a = 0, b = 0, c = 0, d = 0;
};

Regs cpuid(uint32_t leaf, uint32_t sub = 0) {
  Regs r;
  __cpuid_count(leaf, sub, r.a, r.b, r.c, r.d);
  return r;
}

// XGETBV is a plain (non-vector) instruction; only valid when CPUID.1:ECX.OSXSAVE is set.
uint64_t xgetbv0() {
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (uint64_t(hi) << 32) | lo;
}

bool bit(uint32_t v, int i) {
  return (v >> i) & 1u;
}

// Linux asks processes to request AMX tile-data state before using it (since 5.16).
constexpr long kArchReqXcompPerm = 0x1023;
constexpr long kXfeatureXtiledata = 18;

CpuFeatures probe() {
  CpuFeatures f;
  Regs r0 = cpuid(0);
  char vendor[13] = {};
  std::memcpy(vendor + 0, &r0.b, 4);
  std::memcpy(vendor + 4, &r0.d, 4);
  std::memcpy(vendor + 8, &r0.c, 4);
  f.vendor = vendor;
  uint32_t max_leaf = r0.a;

  Regs ext = cpuid(0x80000000u);
  if (ext.a >= 0x80000004u) {
    char brand[49] = {};
    for (uint32_t i = 0; i < 3; ++i) {
      Regs r = cpuid(0x80000002u + i);
      std::memcpy(brand + 16 * i + 0, &r.a, 4);
      std::memcpy(brand + 16 * i + 4, &r.b, 4);
      std::memcpy(brand + 16 * i + 8, &r.c, 4);
      std::memcpy(brand + 16 * i + 12, &r.d, 4);
    }
    f.brand = brand;
    while (!f.brand.empty() && f.brand.back() == ' ') f.brand.pop_back();
    size_t s = f.brand.find_first_not_of(' ');
    f.brand = s == std::string::npos ? "" : f.brand.substr(s);
  }

  if (max_leaf >= 1) {
    Regs r1 = cpuid(1);
    uint32_t base_family = (r1.a >> 8) & 0xf, base_model = (r1.a >> 4) & 0xf;
    f.family = base_family == 0xf ? base_family + ((r1.a >> 20) & 0xff) : base_family;
    f.model = (base_family == 0x6 || base_family == 0xf) ? (((r1.a >> 16) & 0xf) << 4) | base_model
                                                         : base_model;
    f.sse42 = bit(r1.c, 20);
    f.fma = bit(r1.c, 12);
    f.osxsave = bit(r1.c, 27);
    f.avx = bit(r1.c, 28);
    f.f16c = bit(r1.c, 29);
  }
  if (max_leaf >= 7) {
    Regs r7 = cpuid(7, 0);
    f.avx2 = bit(r7.b, 5);
    f.avx512f = bit(r7.b, 16);
    f.avx512dq = bit(r7.b, 17);
    f.avx512bw = bit(r7.b, 30);
    f.avx512vl = bit(r7.b, 31);
    f.avx512_vbmi = bit(r7.c, 1);
    f.avx512_vnni = bit(r7.c, 11);
    f.amx_bf16 = bit(r7.d, 22);
    f.amx_tile = bit(r7.d, 24);
    f.amx_int8 = bit(r7.d, 25);
    if (r7.a >= 1) {
      Regs r71 = cpuid(7, 1);
      f.avx512_bf16 = bit(r71.a, 5);
    }
  }
  if (f.osxsave) {
    f.xcr0 = xgetbv0();
    f.os_avx = (f.xcr0 & 0x6) == 0x6;
    f.os_avx512 = f.os_avx && (f.xcr0 & 0xe0) == 0xe0;
    f.os_amx = (f.xcr0 & 0x60000) == 0x60000;
  }
  if (f.amx_tile && f.os_amx) {
    long rc = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata);
    f.amx_permission = rc == 0;
    if (rc != 0) f.amx_permission_error = std::strerror(errno);
  } else {
    f.amx_permission_error = "not requested (no AMX in CPUID or XCR0)";
  }
  return f;
}

IsaLevel detect(const CpuFeatures& f) {
  for (int l = kNumIsaLevels - 1; l > 0; --l) {
    if (level_usable(IsaLevel(l), f)) return IsaLevel(l);
  }
  return IsaLevel::ref;
}

}  // namespace

const char* isa_name(IsaLevel level) {
  switch (level) {
    case IsaLevel::ref: return "ref";
    case IsaLevel::avx2: return "avx2";
    case IsaLevel::avx512: return "avx512";
    case IsaLevel::avx512_vnni: return "avx512_vnni";
    case IsaLevel::avx512_bf16: return "avx512_bf16";
    case IsaLevel::amx: return "amx";
  }
  return "?";
}

const char* isa_tag(IsaLevel level) {
  switch (level) {
    case IsaLevel::ref: return "ref";
    case IsaLevel::avx2: return "avx2";
    case IsaLevel::avx512: return "avx512";
    case IsaLevel::avx512_vnni: return "avx512vnni";
    case IsaLevel::avx512_bf16: return "avx512bf16";
    case IsaLevel::amx: return "amx";
  }
  return "?";
}

IsaLevel parse_isa(const std::string& name) {
  for (int l = 0; l < kNumIsaLevels; ++l) {
    if (name == isa_name(IsaLevel(l))) return IsaLevel(l);
  }
  throw std::invalid_argument(
      "unknown ISA level '" + name +
      "'; expected one of: amx, avx512_bf16, avx512_vnni, avx512, avx2, ref");
}

std::vector<std::string> missing_for(IsaLevel level, const CpuFeatures& f) {
  std::vector<std::string> m;
  auto need = [&](bool have, const char* what) {
    if (!have) m.emplace_back(what);
  };
  int l = int(level);
  if (l >= int(IsaLevel::avx2)) {
    need(f.avx2, "avx2 (CPUID)");
    need(f.fma, "fma (CPUID)");
    need(f.f16c, "f16c (CPUID)");
    need(f.os_avx, "AVX register state (XCR0 bits 1-2)");
  }
  if (l >= int(IsaLevel::avx512)) {
    need(f.avx512f, "avx512f (CPUID)");
    need(f.avx512bw, "avx512bw (CPUID)");
    need(f.avx512vl, "avx512vl (CPUID)");
    need(f.avx512dq, "avx512dq (CPUID)");
    need(f.os_avx512, "AVX-512 register state (XCR0 bits 5-7)");
  }
  if (l >= int(IsaLevel::avx512_vnni)) need(f.avx512_vnni, "avx512_vnni (CPUID)");
  if (l >= int(IsaLevel::avx512_bf16)) need(f.avx512_bf16, "avx512_bf16 (CPUID)");
  if (l >= int(IsaLevel::amx)) {
    need(f.amx_tile, "amx_tile (CPUID)");
    need(f.amx_int8, "amx_int8 (CPUID)");
    need(f.amx_bf16, "amx_bf16 (CPUID)");
    need(f.os_amx, "AMX tile state (XCR0 bits 17-18)");
    if (f.amx_tile && f.os_amx)
      need(f.amx_permission, "AMX permission (arch_prctl ARCH_REQ_XCOMP_PERM refused)");
  }
  return m;
}

bool level_usable(IsaLevel level, const CpuFeatures& f) {
  return missing_for(level, f).empty();
}

bool debug_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("KT_JIT_DEBUG");
    return v && *v && std::strcmp(v, "0") != 0;
  }();
  return on;
}

void debug_log(const std::string& msg) {
  if (debug_enabled()) std::fprintf(stderr, "[kt-jit] %s\n", msg.c_str());
}

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = probe();
  return f;
}

IsaLevel detected_isa() {
  static const IsaLevel l = [] {
    const CpuFeatures& f = cpu_features();
    IsaLevel best = detect(f);
    if (debug_enabled()) {
      debug_log("cpu: " + f.vendor + " '" + f.brand + "' family " + std::to_string(f.family) +
                " model " + std::to_string(f.model));
      for (int i = kNumIsaLevels - 1; i > int(best); --i) {
        std::string why;
        for (auto& s : missing_for(IsaLevel(i), f)) why += (why.empty() ? "" : ", ") + s;
        debug_log(std::string("isa ") + isa_name(IsaLevel(i)) + " refused: missing " + why);
      }
      debug_log(std::string("isa detected: ") + isa_name(best));
    }
    return best;
  }();
  return l;
}

IsaLevel selected_isa() {
  static std::once_flag once;
  static IsaLevel selected = IsaLevel::ref;
  static std::string error;
  std::call_once(once, [] {
    IsaLevel best = detected_isa();
    selected = best;
    const char* cap = std::getenv("KT_JIT_ISA");
    if (cap && *cap) {
      IsaLevel want;
      try {
        want = parse_isa(cap);
      } catch (const std::exception& e) {
        error = std::string("KT_JIT_ISA: ") + e.what();
        return;
      }
      if (int(want) > int(best)) {
        std::string why;
        for (auto& s : missing_for(want, cpu_features())) why += (why.empty() ? "" : ", ") + s;
        error = std::string("KT_JIT_ISA=") + cap +
                " asks for a level this machine cannot run (missing: " + why +
                "); the best available level is " + isa_name(best);
        return;
      }
      selected = want;
      debug_log(std::string("isa capped by KT_JIT_ISA to ") + isa_name(want));
    }
    debug_log(std::string("isa selected: ") + isa_name(selected));
  });
  if (!error.empty()) throw std::runtime_error(error);
  return selected;
}

}  // namespace ktjit
