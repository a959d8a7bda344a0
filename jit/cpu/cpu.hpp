// CPU probe: the only place in kt-jit that talks to CPUID / XGETBV / arch_prctl.
// Everything else asks for an IsaLevel and the feature bits recorded here.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ktjit {

// Ordered from the portable reference path up to AMX; a higher level implies every lower one.
enum class IsaLevel : int {
  ref = 0,  // plain C++ reference kernels, no generated code
  avx2 = 1,
  avx512 = 2,
  avx512_vnni = 3,
  avx512_bf16 = 4,
  amx = 5,
};
constexpr int kNumIsaLevels = 6;

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
};

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
