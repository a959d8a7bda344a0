// AArch64 measurement loops (jit/aarch64/bench_loops_a64.cpp) and the machine limits built on
// them. Generation and the refusals are checked on every host (an x86-64 build generates NEON
// code without running it); on AArch64 (natively or under qemu-aarch64, tests/emu/run_aarch64.sh)
// the loops run, the read stream is shown to read exactly the bytes it is given, and
// measure_machine_limits() fills the NEON peaks of the selected level. No timing assertions.
#include <gtest/gtest.h>

#include <cstdint>
#include <stdexcept>
#include <vector>

#include "jit/bench_loops.hpp"
#include "jit/cpu/cpu.hpp"
#include "jit/kernel.hpp"
#include "runtime/machine_limits.hpp"
#include "test_util.hpp"

namespace ktjit {
namespace {

const IsaLevel kNeonLevels[] = {IsaLevel::neon, IsaLevel::neon_dotprod, IsaLevel::neon_bf16};

using test::peak_key;
using test::read_key;

// Which ops a NEON level has (the generator must agree).
bool neon_op_valid(IsaLevel isa, PeakOp op) {
  switch (op) {
    case PeakOp::fma_f32:
    case PeakOp::smull_sadalp: return true;
    case PeakOp::sdot: return isa != IsaLevel::neon;
    case PeakOp::bfdot: return isa == IsaLevel::neon_bf16;
    default: return false;  // x86-64 ops
  }
}

bool running_on_aarch64() {
  return cpu_features().aarch64 && selected_isa() != IsaLevel::ref;
}

TEST(A64BenchLoops, PeakVariantsGenerateOrThrow) {
  for (IsaLevel isa : kNeonLevels) {
    for (uint8_t v = 0; v < kNumPeakOps; ++v) {
      const KernelKey key = peak_key(isa, PeakOp(v));
      SCOPED_TRACE(key.describe());
      if (neon_op_valid(isa, PeakOp(v))) {
        auto k = KernelCache::generate_only(key);
        ASSERT_TRUE(k);
        EXPECT_FALSE(k->code.empty());
        EXPECT_EQ(k->code.size() % 4, 0u);  // whole A64 instructions
        EXPECT_GT(peak_ops_per_iteration(key), 0.0);
      } else {
        EXPECT_THROW(KernelCache::generate_only(key), std::invalid_argument);
        EXPECT_THROW(peak_ops_per_iteration(key), std::invalid_argument);
      }
    }
  }
  KernelKey bad = peak_key(IsaLevel::neon_bf16, PeakOp::fma_f32);
  bad.variant = kNumPeakOps;
  EXPECT_THROW(KernelCache::generate_only(bad), std::invalid_argument);
  // The NEON ops are refused at x86-64 levels and at ref wherever the x86 loops are built.
  EXPECT_THROW(KernelCache::generate_only(peak_key(IsaLevel::ref, PeakOp::sdot)),
               std::invalid_argument);
#if defined(__x86_64__)
  for (PeakOp op : {PeakOp::sdot, PeakOp::smull_sadalp, PeakOp::bfdot})
    EXPECT_THROW(KernelCache::generate_only(peak_key(IsaLevel::avx512_bf16, op)),
                 std::invalid_argument);
#endif
}

TEST(A64BenchLoops, ReadStreamGenerates) {
  for (IsaLevel isa : kNeonLevels) {
    auto k = KernelCache::generate_only(read_key(isa));
    ASSERT_TRUE(k);
    EXPECT_FALSE(k->code.empty());
  }
}

// The loop's result is the OR of its accumulators, each the XOR of the 16-byte loads it took, and
// w0 holds bytes 0..3 of that: a buffer of zeros with one byte set at an offset 0..3 modulo 16
// returns non-zero exactly when the loop read that byte.
TEST(A64BenchLoops, ReadStreamReadsExactlyItsBytes) {
  if (!running_on_aarch64()) GTEST_SKIP() << "runs on AArch64 (tests/emu/run_aarch64.sh)";
  const Kernel* k = KernelCache::instance().get(read_key(selected_isa()));
  if (!k) GTEST_SKIP() << "executable memory refused";
  auto fn = reinterpret_cast<uint32_t (*)(const void*, int64_t)>(const_cast<void*>(k->entry()));
  const int64_t bytes = 8 * 1024;
  std::vector<uint8_t> buf(size_t(bytes) + 4096, 0);
  EXPECT_EQ(fn(buf.data(), bytes), 0u);
  EXPECT_EQ(fn(buf.data(), 0), 0u);
  for (int64_t pos : {int64_t(0), int64_t(3), int64_t(1024 + 16 * 5 + 2), bytes - 16, bytes - 13,
                      bytes, bytes + 16 + 1}) {
    SCOPED_TRACE(pos);
    buf[size_t(pos)] = 0x5a;
    EXPECT_EQ(fn(buf.data(), bytes) != 0, pos < bytes);
    EXPECT_EQ(fn(buf.data(), 1024) != 0, pos < 1024);
    buf[size_t(pos)] = 0;
  }
}

TEST(A64BenchLoops, PeakLoopsRunAndLimitsAreMeasured) {
  if (!running_on_aarch64()) GTEST_SKIP() << "runs on AArch64 (tests/emu/run_aarch64.sh)";
  const IsaLevel isa = selected_isa();
  for (uint8_t v = 0; v < kNumPeakOps; ++v) {
    if (!neon_op_valid(isa, PeakOp(v))) continue;
    SCOPED_TRACE(peak_key(isa, PeakOp(v)).describe());
    const Kernel* k = KernelCache::instance().get(peak_key(isa, PeakOp(v)));
    if (!k) GTEST_SKIP() << "executable memory refused";
    auto fn = reinterpret_cast<void (*)(int64_t)>(const_cast<void*>(k->entry()));
    fn(0);
    fn(-1);
    fn(10);
    EXPECT_GT(measure_peak_gops(isa, v, 1), 0.0);
  }
  EXPECT_THROW(measure_peak_gops(isa, uint8_t(PeakOp::vpdpbusd), 1), std::invalid_argument);
  EXPECT_GT(measure_read_bandwidth_gbs(1 << 20, 2), 0.0);
  EXPECT_GT(measure_read_bandwidth_gbs_threads(2, 1 << 20, 2), 0.0);
  ReadProbe probe(1 << 20);
  EXPECT_GT(probe.pass_gbs(), 0.0);
}

}  // namespace
}  // namespace ktjit
