#include <gtest/gtest.h>

#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include "jit/cpu/cpu.hpp"

namespace ktjit {
namespace {

std::set<std::string> proc_cpuinfo_flags() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  std::set<std::string> flags;
  while (std::getline(f, line)) {
    if (line.rfind("flags", 0) == 0) {
      std::istringstream s(line.substr(line.find(':') + 1));
      std::string w;
      while (s >> w) flags.insert(w);
      break;
    }
  }
  return flags;
}

TEST(Cpu, ProbeAgreesWithKernelFlags) {
  // The kernel's /proc/cpuinfo is an independent reading of the same CPUID bits.
#if !defined(__x86_64__)
  GTEST_SKIP()
      << "x86 CPUID flags; on AArch64 the probe is checked by A64Cpu.* (test_a64_gemm.cpp)";
#endif
  auto flags = proc_cpuinfo_flags();
  if (flags.empty()) GTEST_SKIP() << "no /proc/cpuinfo flags line on this system";
  const CpuFeatures& f = cpu_features();
  EXPECT_EQ(f.avx2, flags.count("avx2") == 1);
  EXPECT_EQ(f.fma, flags.count("fma") == 1);
  EXPECT_EQ(f.avx512f, flags.count("avx512f") == 1);
  EXPECT_EQ(f.avx512bw, flags.count("avx512bw") == 1);
  EXPECT_EQ(f.avx512_vnni, flags.count("avx512_vnni") == 1);
  EXPECT_EQ(f.avx512_bf16, flags.count("avx512_bf16") == 1);
  EXPECT_EQ(f.amx_tile, flags.count("amx_tile") == 1);
}

TEST(Cpu, LevelsAreMonotonic) {
  const CpuFeatures& f = cpu_features();
  bool below_ok = true;
  for (int l = 1; l < kNumIsaLevels; ++l) {
    if (isa_is_neon(IsaLevel(l)) != f.aarch64) continue;  // the other architecture's levels
    const bool ok = level_usable(IsaLevel(l), f);
    if (ok)
      EXPECT_TRUE(below_ok) << "level " << isa_name(IsaLevel(l))
                            << " usable but a lower one is not";
    below_ok = below_ok && ok;
  }
  EXPECT_TRUE(level_usable(detected_isa(), f));
  if (int(detected_isa()) + 1 < kNumIsaLevels)
    EXPECT_FALSE(level_usable(IsaLevel(int(detected_isa()) + 1), f));
}

TEST(Cpu, AmxNeedsCpuidXcr0AndPermission) {
  CpuFeatures f;  // a CPU with everything up to avx512_bf16 and AMX in CPUID
  f.avx2 = f.fma = f.f16c = f.os_avx = true;
  f.avx512f = f.avx512bw = f.avx512vl = f.avx512dq = f.os_avx512 = true;
  f.avx512_vnni = f.avx512_bf16 = f.avx512_vbmi = true;
  f.amx_tile = f.amx_int8 = f.amx_bf16 = true;
  f.os_amx = true;
  f.amx_permission = false;
  EXPECT_FALSE(level_usable(IsaLevel::amx, f));
  EXPECT_TRUE(level_usable(IsaLevel::avx512_bf16, f));
  f.amx_permission = true;
  EXPECT_TRUE(level_usable(IsaLevel::amx, f));
  f.os_amx = false;  // the OS does not enable tile state
  EXPECT_FALSE(level_usable(IsaLevel::amx, f));
  auto missing = missing_for(IsaLevel::amx, f);
  ASSERT_FALSE(missing.empty());
  EXPECT_NE(missing[0].find("XCR0"), std::string::npos);
}

TEST(Cpu, Avx512Bf16LevelNeedsVbmi) {
  CpuFeatures f;  // Cooper Lake: AVX512-BF16 without VBMI (the level's FP8 decode uses vpermi2b)
  f.avx2 = f.fma = f.f16c = f.os_avx = true;
  f.avx512f = f.avx512bw = f.avx512vl = f.avx512dq = f.os_avx512 = true;
  f.avx512_vnni = f.avx512_bf16 = true;
  EXPECT_TRUE(level_usable(IsaLevel::avx512_vnni, f));
  EXPECT_FALSE(level_usable(IsaLevel::avx512_bf16, f));
  auto missing = missing_for(IsaLevel::avx512_bf16, f);
  ASSERT_EQ(missing.size(), 1u);
  EXPECT_NE(missing[0].find("vbmi"), std::string::npos);
  f.avx512_vbmi = true;
  EXPECT_TRUE(level_usable(IsaLevel::avx512_bf16, f));
}

TEST(Cpu, AvxStateDisabledByOsRefusesAvx2) {
  CpuFeatures f;
  f.avx2 = f.fma = f.f16c = true;
  f.os_avx = false;
  EXPECT_FALSE(level_usable(IsaLevel::avx2, f));
  EXPECT_TRUE(level_usable(IsaLevel::ref, f));
}

TEST(Cpu, ParseIsaNames) {
  for (int l = 0; l < kNumIsaLevels; ++l) EXPECT_EQ(parse_isa(isa_name(IsaLevel(l))), IsaLevel(l));
  EXPECT_THROW(parse_isa("avx1024"), std::invalid_argument);
}

}  // namespace
}  // namespace ktjit
