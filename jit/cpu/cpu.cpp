#include "jit/cpu/cpu.hpp"

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#elif defined(__aarch64__)
#include <sys/auxv.h>
#endif

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>

namespace ktjit {
namespace {

#if defined(__x86_64__)
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
constexpr long kArchGetXcompPerm = 0x1022;
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

  // The raw facts, then a pure function of them (tests inject facts:
  // tests/cpp/test_amx_probe.cpp). Tile data permission is requested only when CPUID and XCR0 both
  // report AMX, and counts only when ARCH_GET_XCOMP_PERM then lists XTILEDATA.
  X86CpuidFacts x;
  x.max_leaf = max_leaf;
  if (max_leaf >= 1) {
    Regs r1 = cpuid(1);
    x.l1_eax = r1.a;
    x.l1_ecx = r1.c;
  }
  if (max_leaf >= 7) {
    Regs r7 = cpuid(7, 0);
    x.l7_eax = r7.a;
    x.l7_ebx = r7.b;
    x.l7_ecx = r7.c;
    x.l7_edx = r7.d;
    if (r7.a >= 1) x.l71_eax = cpuid(7, 1).a;
  }
  if (bit(x.l1_ecx, 27)) {  // OSXSAVE: XGETBV is valid
    x.xcr0_valid = true;
    x.xcr0 = xgetbv0();
  }
  AmxPermission perm;
  if (amx_permission_needed(x)) {
    perm.requested = true;
    perm.rc = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata);
    perm.err = perm.rc != 0 ? errno : 0;
    unsigned long mask = 0;
    if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &mask) == 0) perm.granted_mask = mask;
  }
  CpuFeatures d = x86_features_from(x, perm);
  d.vendor = f.vendor;
  d.brand = f.brand;
  return d;
}
#elif defined(__aarch64__)
// Linux's AArch64 hwcaps (asm/hwcap.h), spelled out so the probe builds against any libc headers.
constexpr uint64_t kHwcapAsimd = 1ull << 1;
constexpr uint64_t kHwcapAsimddp = 1ull << 20;
constexpr uint64_t kHwcap2Bf16 = 1ull << 14;

CpuFeatures probe() {
  CpuFeatures f;
  f.aarch64 = true;
  f.vendor = "AArch64";
  f.hwcap = getauxval(AT_HWCAP);
  f.hwcap2 = getauxval(AT_HWCAP2);
  f.asimd = (f.hwcap & kHwcapAsimd) != 0;
  f.asimd_dp = (f.hwcap & kHwcapAsimddp) != 0;
  f.arm_bf16 = (f.hwcap2 & kHwcap2Bf16) != 0;
  char buf[64];
  std::snprintf(buf, sizeof buf, "AArch64 (HWCAP 0x%llx, HWCAP2 0x%llx)",
                (unsigned long long)f.hwcap, (unsigned long long)f.hwcap2);
  f.brand = buf;
  f.amx_permission_error = "not requested (not an x86-64 CPU)";
  return f;
}
#else
CpuFeatures probe() {
  CpuFeatures f;
  f.vendor = "unknown";
  f.amx_permission_error = "not requested (not an x86-64 CPU)";
  return f;
}
#endif

IsaLevel detect(const CpuFeatures& f) {
  for (int l = kNumIsaLevels - 1; l > 0; --l) {
    if (level_usable(IsaLevel(l), f)) return IsaLevel(l);
  }
  return IsaLevel::ref;
}

}  // namespace

bool amx_permission_needed(const X86CpuidFacts& x) {
  const bool amx_tile = x.max_leaf >= 7 && ((x.l7_edx >> 24) & 1u);
  return amx_tile && x.xcr0_valid && (x.xcr0 & 0x60000) == 0x60000;
}

CpuFeatures x86_features_from(const X86CpuidFacts& x, const AmxPermission& perm) {
  auto bit = [](uint32_t v, int i) { return ((v >> i) & 1u) != 0; };
  CpuFeatures f;
  if (x.max_leaf >= 1) {
    const uint32_t a = x.l1_eax, base_family = (a >> 8) & 0xf, base_model = (a >> 4) & 0xf;
    f.family = base_family == 0xf ? base_family + ((a >> 20) & 0xff) : base_family;
    f.model = (base_family == 0x6 || base_family == 0xf) ? (((a >> 16) & 0xf) << 4) | base_model
                                                         : base_model;
    f.sse42 = bit(x.l1_ecx, 20);
    f.fma = bit(x.l1_ecx, 12);
    f.osxsave = bit(x.l1_ecx, 27);
    f.avx = bit(x.l1_ecx, 28);
    f.f16c = bit(x.l1_ecx, 29);
  }
  if (x.max_leaf >= 7) {
    f.avx2 = bit(x.l7_ebx, 5);
    f.avx512f = bit(x.l7_ebx, 16);
    f.avx512dq = bit(x.l7_ebx, 17);
    f.avx512bw = bit(x.l7_ebx, 30);
    f.avx512vl = bit(x.l7_ebx, 31);
    f.avx512_vbmi = bit(x.l7_ecx, 1);
    f.avx512_vnni = bit(x.l7_ecx, 11);
    f.amx_bf16 = bit(x.l7_edx, 22);
    f.amx_tile = bit(x.l7_edx, 24);
    f.amx_int8 = bit(x.l7_edx, 25);
    if (x.l7_eax >= 1) f.avx512_bf16 = bit(x.l71_eax, 5);
  }
  if (f.osxsave && x.xcr0_valid) {
    f.xcr0 = x.xcr0;
    f.os_avx = (f.xcr0 & 0x6) == 0x6;
    f.os_avx512 = f.os_avx && (f.xcr0 & 0xe0) == 0xe0;
    f.os_amx = (f.xcr0 & 0x60000) == 0x60000;
  }
  if (!amx_permission_needed(x)) {
    f.amx_permission_error = "not requested (no AMX in CPUID or XCR0)";
  } else if (!perm.requested) {
    f.amx_permission_error = "not requested";
  } else if (perm.rc != 0) {
    f.amx_permission_error = std::string("ARCH_REQ_XCOMP_PERM refused: ") + std::strerror(perm.err);
  } else if (!((perm.granted_mask >> 18) & 1u)) {
    f.amx_permission_error = "ARCH_GET_XCOMP_PERM does not list XTILEDATA";
  } else {
    f.amx_permission = true;
  }
  return f;
}

IsaLevel best_isa(const CpuFeatures& f) {
  return detect(f);
}

const char* isa_name(IsaLevel level) {
  switch (level) {
    case IsaLevel::ref: return "ref";
    case IsaLevel::avx2: return "avx2";
    case IsaLevel::avx512: return "avx512";
    case IsaLevel::avx512_vnni: return "avx512_vnni";
    case IsaLevel::avx512_bf16: return "avx512_bf16";
    case IsaLevel::amx: return "amx";
    case IsaLevel::neon: return "neon";
    case IsaLevel::neon_dotprod: return "neon_dotprod";
    case IsaLevel::neon_bf16: return "neon_bf16";
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
    case IsaLevel::neon: return "neon";
    case IsaLevel::neon_dotprod: return "neondot";
    case IsaLevel::neon_bf16: return "neonbf16";
  }
  return "?";
}

IsaLevel parse_isa(const std::string& name) {
  for (int l = 0; l < kNumIsaLevels; ++l) {
    if (name == isa_name(IsaLevel(l))) return IsaLevel(l);
  }
  throw std::invalid_argument(
      "unknown ISA level '" + name +
      "'; expected one of: amx, avx512_bf16, avx512_vnni, avx512, avx2, neon_bf16, "
      "neon_dotprod, neon, ref");
}

std::vector<std::string> missing_for(IsaLevel level, const CpuFeatures& f) {
  std::vector<std::string> m;
  auto need = [&](bool have, const char* what) {
    if (!have) m.emplace_back(what);
  };
  int l = int(level);
  if (isa_is_neon(level)) {
    if (!f.aarch64) {
      m.emplace_back("an AArch64 CPU (this is not one)");
      return m;
    }
    need(f.asimd, "asimd (HWCAP_ASIMD)");
    if (l >= int(IsaLevel::neon_dotprod)) need(f.asimd_dp, "asimddp (HWCAP_ASIMDDP)");
    if (l >= int(IsaLevel::neon_bf16)) need(f.arm_bf16, "bf16 (HWCAP2_BF16)");
    return m;
  }
  if (l >= int(IsaLevel::avx2) && f.aarch64) {
    m.emplace_back("an x86-64 CPU (this is AArch64)");
    return m;
  }
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
  if (l >= int(IsaLevel::avx512_bf16)) {
    need(f.avx512_bf16, "avx512_bf16 (CPUID)");
    // The level's FP8 kernels decode e4m3 with vpermi2b. Every AVX512-BF16 CPU but Cooper Lake
    // has VBMI (Sapphire Rapids and later, Zen 4 and later); Cooper Lake runs avx512_vnni.
    need(f.avx512_vbmi, "avx512_vbmi (CPUID)");
  }
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
        if (isa_is_neon(IsaLevel(i)) != f.aarch64) continue;  // the other architecture's levels
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
      if (int(want) > int(best) || !level_usable(want, cpu_features())) {
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
