// CPU probe: the only place in kt-jit that talks to CPUID / XGETBV / arch_prctl.
// Everything else asks for an IsaLevel and the feature bits recorded here.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ktjit {

// Two families after the portable reference path. x86-64: avx2 .. amx, ordered, a higher level
// implies every lower one. AArch64: neon .. neon_bf16, appended after the x86 levels and ordered
// among themselves the same way. A level of the other family is never usable (missing_for names the
// architecture); compare levels with int() only within a family (isa_is_neon()).
enum class IsaLevel : int {
  ref = 0,  // plain C++ reference kernels, no generated code
  avx2 = 1,
  avx512 = 2,
  avx512_vnni = 3,
  avx512_bf16 = 4,
  amx = 5,
  neon = 6,          // AArch64 Advanced SIMD (every AArch64 CPU)
  neon_dotprod = 7,  // + SDOT/UDOT (HWCAP_ASIMDDP)
  neon_bf16 = 8,     // + BF16 (HWCAP2_BF16); runs the neon_dotprod kernels (see ARCHITECTURE.md)
};
constexpr int kNumIsaLevels = 9;

// The AArch64 levels (neon, neon_dotprod, neon_bf16).
constexpr bool isa_is_neon(IsaLevel level) {
  return int(level) >= int(IsaLevel::neon) && int(level) <= int(IsaLevel::neon_bf16);
}

const char* isa_name(IsaLevel level);
// Short form used inside kernel names: "avx512vnni".
const char* isa_tag(IsaLevel level);
// Accepts the names returned by isa_name(); throws std::invalid_argument listing them otherwise.
IsaLevel parse_isa(const std::string& name);

struct CpuFeatures {
  std::string vendor;
  std::string brand;
  uint32_t family = 0, model = 0;
  // CPUID bits.
  bool sse42 = false, avx = false, avx2 = false, fma = false, f16c = false, osxsave = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
  bool avx512_vnni = false, avx512_bf16 = false, avx512_vbmi = false;
  bool amx_tile = false, amx_int8 = false, amx_bf16 = false;
  // OS support (XCR0) and the AMX permission request.
  uint64_t xcr0 = 0;
  bool os_avx = false;          // XCR0 bits 1,2 (SSE, AVX state)
  bool os_avx512 = false;       // XCR0 bits 5,6,7 (opmask, ZMM_Hi256, Hi16_ZMM)
  bool os_amx = false;          // XCR0 bits 17,18 (XTILECFG, XTILEDATA)
  bool amx_permission = false;  // arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) succeeded
  std::string amx_permission_error;
  // AArch64 (getauxval): the raw words and the bits the NEON levels need.
  bool aarch64 = false;  // probed on an AArch64 CPU
  uint64_t hwcap = 0, hwcap2 = 0;
  bool asimd = false;     // HWCAP_ASIMD
  bool asimd_dp = false;  // HWCAP_ASIMDDP (sdot/udot)
  bool arm_bf16 = false;  // HWCAP2_BF16 (bfdot/bfmmla/bfcvt)
};

// The raw x86 facts the probe gathers (CPUID leaves 1, 7.0, 7.1; XCR0) and the outcome of the
// AMX permission request; the CpuFeatures are a pure function of them, so the selection rules
// can be tested with injected facts (AMX needs CPUID + XCR0 bits 17-18 + granted XTILEDATA).
struct X86CpuidFacts {
  uint32_t max_leaf = 0;
  uint32_t l1_eax = 0, l1_ecx = 0;
  uint32_t l7_eax = 0, l7_ebx = 0, l7_ecx = 0, l7_edx = 0;
  uint32_t l71_eax = 0;
  bool xcr0_valid = false;  // OSXSAVE set, XGETBV read
  uint64_t xcr0 = 0;
};
struct AmxPermission {
  bool requested = false;     // arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) was called
  long rc = -1;               // its return value
  int err = 0;                // errno when rc != 0
  uint64_t granted_mask = 0;  // arch_prctl(ARCH_GET_XCOMP_PERM): bit 18 = XTILEDATA
};
// Whether the probe asks the kernel for tile-data permission: CPUID AMX-TILE and XCR0 17-18.
bool amx_permission_needed(const X86CpuidFacts& x);
CpuFeatures x86_features_from(const X86CpuidFacts& x, const AmxPermission& perm);
// Highest usable level for these features (pure; detected_isa() is best_isa(cpu_features())).
IsaLevel best_isa(const CpuFeatures& f);

// Probed once (thread-safe), then cached.
const CpuFeatures& cpu_features();

// What `level` would need that this machine lacks (CPUID bits, OS state, permission); empty if
// usable.
std::vector<std::string> missing_for(IsaLevel level, const CpuFeatures& f);
bool level_usable(IsaLevel level, const CpuFeatures& f);

// Highest usable level on this machine.
IsaLevel detected_isa();
// detected_isa() capped by KT_JIT_ISA. Throws std::runtime_error naming the missing features when
// KT_JIT_ISA asks for a level the machine cannot run.
IsaLevel selected_isa();

// KT_JIT_DEBUG=1 logging to stderr.
bool debug_enabled();
void debug_log(const std::string& msg);

}  // namespace ktjit
