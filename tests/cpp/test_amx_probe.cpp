// The AMX selection rule as a pure function of injected probe facts: CPUID (AMX-TILE, AMX-INT8,
// AMX-BF16), XCR0 bits 17-18 (XTILECFG, XTILEDATA) and the arch_prctl permission outcome. The
// level is never usable unless all three hold, and the permission is requested only when CPUID
// and XCR0 both report AMX.
#include <gtest/gtest.h>

#include <cerrno>

#include "jit/cpu/cpu.hpp"

namespace ktjit {
namespace {

// A Sapphire Rapids-like CPU: AVX-512 + VNNI + BF16 + AMX in CPUID, the OS enabling every state.
X86CpuidFacts spr_facts() {
  X86CpuidFacts x;
  x.max_leaf = 0x20;
  x.l1_eax = 0x806f8;  // family 6, model 0x8f
  x.l1_ecx = (1u << 12) | (1u << 20) | (1u << 27) | (1u << 28) |
             (1u << 29);  // fma sse4.2 osxsave avx f16c
  x.l7_eax = 1;
  x.l7_ebx = (1u << 5) | (1u << 16) | (1u << 17) | (1u << 30) | (1u << 31);  // avx2 f dq bw vl
  x.l7_ecx = (1u << 1) | (1u << 11);                                         // vbmi vnni
  x.l7_edx = (1u << 22) | (1u << 24) | (1u << 25);                           // amx bf16/tile/int8
  x.l71_eax = 1u << 5;                                                       // avx512_bf16
  x.xcr0_valid = true;
  x.xcr0 = 0x7 | 0xe0 | 0x60000;
  return x;
}

AmxPermission granted() {
  AmxPermission p;
  p.requested = true;
  p.rc = 0;
  p.granted_mask = (1ull << 17) | (1ull << 18);
  return p;
}

TEST(AmxProbe, AllFactsPresentSelectsAmx) {
  const X86CpuidFacts x = spr_facts();
  EXPECT_TRUE(amx_permission_needed(x));
  const CpuFeatures f = x86_features_from(x, granted());
  EXPECT_EQ(f.family, 6u);
  EXPECT_EQ(f.model, 0x8fu);
  EXPECT_TRUE(f.amx_tile && f.amx_int8 && f.amx_bf16 && f.os_amx && f.amx_permission);
  EXPECT_TRUE(missing_for(IsaLevel::amx, f).empty());
  EXPECT_EQ(best_isa(f), IsaLevel::amx);
}

TEST(AmxProbe, PermissionRefusedNeverSelectsAmx) {
  AmxPermission p;
  p.requested = true;
  p.rc = -1;
  p.err = EPERM;
  const CpuFeatures f = x86_features_from(spr_facts(), p);
  EXPECT_FALSE(f.amx_permission);
  EXPECT_NE(f.amx_permission_error.find("ARCH_REQ_XCOMP_PERM"), std::string::npos);
  EXPECT_EQ(best_isa(f), IsaLevel::avx512_bf16);
  const auto m = missing_for(IsaLevel::amx, f);
  ASSERT_EQ(m.size(), 1u);
  EXPECT_NE(m[0].find("permission"), std::string::npos);
}

TEST(AmxProbe, SyscallOkButXtiledataNotGrantedNeverSelectsAmx) {
  AmxPermission p = granted();
  p.granted_mask = 1ull << 17;  // XTILECFG only
  const CpuFeatures f = x86_features_from(spr_facts(), p);
  EXPECT_FALSE(f.amx_permission);
  EXPECT_EQ(best_isa(f), IsaLevel::avx512_bf16);
}

TEST(AmxProbe, PermissionNotRequestedNeverSelectsAmx) {
  const CpuFeatures f = x86_features_from(spr_facts(), AmxPermission{});
  EXPECT_FALSE(f.amx_permission);
  EXPECT_EQ(best_isa(f), IsaLevel::avx512_bf16);
}

TEST(AmxProbe, OsWithoutTileStateIsNotAskedAndNeverSelectsAmx) {
  for (uint64_t drop : {uint64_t(0x20000), uint64_t(0x40000), uint64_t(0x60000)}) {
    X86CpuidFacts x = spr_facts();
    x.xcr0 &= ~drop;
    EXPECT_FALSE(amx_permission_needed(x)) << std::hex << x.xcr0;
    // Even a (stale) granted permission does not make the level usable without XCR0.
    const CpuFeatures f = x86_features_from(x, granted());
    EXPECT_FALSE(f.os_amx);
    EXPECT_FALSE(f.amx_permission);
    EXPECT_EQ(best_isa(f), IsaLevel::avx512_bf16);
    bool names_xcr0 = false;
    for (auto& s : missing_for(IsaLevel::amx, f)) names_xcr0 |= s.find("XCR0") != std::string::npos;
    EXPECT_TRUE(names_xcr0);
  }
}

TEST(AmxProbe, CpuidWithoutAmxIsNotAskedAndNeverSelectsAmx) {
  for (uint32_t drop : {1u << 24, 1u << 25, 1u << 22}) {
    X86CpuidFacts x = spr_facts();
    x.l7_edx &= ~drop;
    const CpuFeatures f = x86_features_from(x, granted());
    EXPECT_EQ(best_isa(f), IsaLevel::avx512_bf16) << "dropped CPUID.7.0:EDX bit " << drop;
    if (drop == (1u << 24)) {
      EXPECT_FALSE(amx_permission_needed(x));
    }
  }
  X86CpuidFacts x = spr_facts();
  x.l1_ecx &= ~(1u << 27);  // no OSXSAVE: XCR0 unreadable, so nothing above ref
  x.xcr0_valid = false;
  EXPECT_FALSE(amx_permission_needed(x));
  EXPECT_EQ(best_isa(x86_features_from(x, granted())), IsaLevel::ref);
}

TEST(AmxProbe, ThisMachineAgreesWithTheFacts) {
  // The live probe goes through the same function: AMX is selected only with every fact present.
  const CpuFeatures& f = cpu_features();
  if (f.aarch64) GTEST_SKIP() << "x86 probe";
  EXPECT_EQ(best_isa(f), detected_isa());
  if (detected_isa() == IsaLevel::amx) {
    EXPECT_TRUE(f.amx_tile && f.amx_int8 && f.os_amx && f.amx_permission);
  } else {
    EXPECT_FALSE(f.amx_tile && f.amx_int8 && f.amx_bf16 && f.os_amx && f.amx_permission &&
                 level_usable(IsaLevel::avx512_bf16, f));
  }
}

}  // namespace
}  // namespace ktjit
