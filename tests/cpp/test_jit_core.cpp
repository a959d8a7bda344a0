#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <string>

#include "jit/gemm.hpp"
#include "jit/kernel.hpp"
#include "test_util.hpp"

namespace ktjit {
namespace {

KernelKey some_key(IsaLevel isa, int m_r) {
  KernelKey k;
  k.kind = KernelKind::gemm_decode;
  k.isa = isa;
  k.m_r = uint8_t(m_r);
  k.n_vec = 4;
  k.epilogue = Epilogue::siluup;
  return k;
}

TEST(JitCore, NoMappingIsWritableAndExecutable) {
  auto levels = test::runnable_levels();
  if (levels.empty()) GTEST_SKIP() << "this CPU runs no generated x86 level";
  for (IsaLevel isa : levels)
    for (int m = 1; m <= gemm_max_rows(isa); ++m)
      ASSERT_NE(KernelCache::instance().get(some_key(isa, m)), nullptr);
  std::ifstream maps("/proc/self/maps");
  std::string line;
  int lines = 0;
  while (std::getline(maps, line)) {
    ++lines;
    // Format: address perms offset dev inode path; perms like "r-xp".
    const auto sp = line.find(' ');
    const std::string perms = line.substr(sp + 1, 4);
    EXPECT_FALSE(perms[1] == 'w' && perms[2] == 'x') << "W+X mapping: " << line;
  }
  EXPECT_GT(lines, 0);
}

TEST(JitCore, CacheGeneratesOnceAndCounts) {
  auto levels = test::runnable_levels();
  if (levels.empty()) GTEST_SKIP() << "this CPU runs no generated x86 level";
  KernelKey k = some_key(levels.back(), 2);
  k.epilogue = Epilogue::accum;
  auto& c = KernelCache::instance();
  const Kernel* a = c.get(k);
  CacheStats s0 = c.stats();
  const Kernel* b = c.get(k);
  CacheStats s1 = c.stats();
  EXPECT_EQ(a, b);
  EXPECT_EQ(s1.misses, s0.misses);
  EXPECT_EQ(s1.hits, s0.hits + 1);
  EXPECT_GT(s1.bytes, 0u);
  EXPECT_GT(a->gen_us, 0.0);
}

// retire_all (tools/ab_layer.py --fresh-kernels): the next get() generates again, and the kernel
// handed out before stays where it was, published and unchanged, for whoever holds it.
TEST(JitCore, RetiredKernelsStayAliveAndGetGeneratesAgain) {
  auto levels = test::runnable_levels();
  if (levels.empty()) GTEST_SKIP() << "this CPU runs no generated x86 level";
  KernelKey k = some_key(levels.back(), 3);
  k.epilogue = Epilogue::store;
  auto& c = KernelCache::instance();
  const Kernel* a = c.get(k);
  ASSERT_NE(a, nullptr);
  EXPECT_GE(c.retire_all(), 1u);
  const CacheStats s0 = c.stats();
  const Kernel* b = c.get(k);
  ASSERT_NE(b, nullptr);
  EXPECT_NE(a, b);
  EXPECT_NE(a->entry(), b->entry());
  EXPECT_EQ(c.stats().misses, s0.misses + 1);
  EXPECT_EQ(a->code, b->code);  // the same generator, the same bytes
  ASSERT_NE(a->entry(), nullptr);
  EXPECT_EQ(std::memcmp(a->entry(), a->code.data(), a->code.size()), 0);
  EXPECT_EQ(c.get(k), b);  // cached again
}

TEST(JitCore, NamesSpellTheKey) {
  KernelKey k = some_key(IsaLevel::avx512_vnni, 4);
  EXPECT_EQ(k.name(), "gemm_decode_int8_avx512vnni_m4n64_siluup");
  k.isa = IsaLevel::avx2;
  k.m_r = 3;
  k.kind = KernelKind::gemm_prefill;
  k.epilogue = Epilogue::accum;
  EXPECT_EQ(k.name(), "gemm_prefill_int8_avx2_m3n32_accum");
  // Keys differing in any field are different kernels.
  KernelKey k2 = k;
  k2.n_vec = 2;
  EXPECT_FALSE(k == k2);
  EXPECT_NE(k.packed(), k2.packed());
}

}  // namespace
}  // namespace ktjit
