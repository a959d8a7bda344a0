// Generated measurement loops: every (ISA, peak op) either generates code or throws
// std::invalid_argument, and the loops run where the CPU supports them. No timing assertions.
#include <gtest/gtest.h>

#include <cstdint>
#include <stdexcept>
#include <vector>

#include "jit/kernel.hpp"
#include "jit/x64/bench_loops.hpp"
#include "runtime/machine_limits.hpp"
#include "runtime/thread_pool.hpp"
#include "runtime/topology.hpp"
#include "test_util.hpp"

namespace ktjit {
namespace {

using x64::PeakOp;

const IsaLevel kX86Levels[] = {IsaLevel::avx2, IsaLevel::avx512, IsaLevel::avx512_vnni,
                               IsaLevel::avx512_bf16, IsaLevel::amx};
const PeakOp kOps[] = {PeakOp::vpdpbusd, PeakOp::maddubsw,  PeakOp::fma_f32,   PeakOp::dpbf16,
                       PeakOp::tdpbusd,  PeakOp::tdpbf16ps, PeakOp::maddubsw_w};

using test::peak_key;
using test::read_key;

bool op_valid(IsaLevel isa, PeakOp op) {
  switch (op) {
    case PeakOp::vpdpbusd: return int(isa) >= int(IsaLevel::avx512_vnni);
    case PeakOp::dpbf16: return int(isa) >= int(IsaLevel::avx512_bf16);
    case PeakOp::tdpbusd:
    case PeakOp::tdpbf16ps: return isa == IsaLevel::amx;
    default: return int(isa) >= int(IsaLevel::avx2);
  }
}

TEST(BenchLoops, PeakVariantsGenerateOrThrow) {
  for (IsaLevel isa : kX86Levels) {
    for (PeakOp op : kOps) {
      const KernelKey key = peak_key(isa, op);
      SCOPED_TRACE(key.describe());
      if (op_valid(isa, op)) {
        auto k = KernelCache::generate_only(key);
        ASSERT_TRUE(k);
        EXPECT_FALSE(k->code.empty());
        EXPECT_GT(peak_ops_per_iteration(key), 0.0);
      } else {
        EXPECT_THROW(KernelCache::generate_only(key), std::invalid_argument);
        EXPECT_THROW(peak_ops_per_iteration(key), std::invalid_argument);
      }
    }
  }
  for (PeakOp op : kOps)
    EXPECT_THROW(KernelCache::generate_only(peak_key(IsaLevel::ref, op)), std::invalid_argument);
  KernelKey bad = peak_key(IsaLevel::avx512_bf16, PeakOp::fma_f32);
  bad.variant = 17;
  EXPECT_THROW(KernelCache::generate_only(bad), std::invalid_argument);
}

TEST(BenchLoops, ReadStreamGenerates) {
  for (IsaLevel isa : kX86Levels) {
    auto k = KernelCache::generate_only(read_key(isa));
    ASSERT_TRUE(k);
    EXPECT_FALSE(k->code.empty());
  }
  EXPECT_THROW(KernelCache::generate_only(read_key(IsaLevel::ref)), std::invalid_argument);
}

TEST(BenchLoops, ReadStreamRuns) {
  const IsaLevel isa = detected_isa();
  if (isa == IsaLevel::ref) GTEST_SKIP() << "no vector ISA on this CPU";
  const Kernel* k = KernelCache::instance().get(read_key(isa));
  if (!k) GTEST_SKIP() << "executable memory refused";
  std::vector<uint8_t> buf(64 * 1024, 3);
  auto fn = reinterpret_cast<void (*)(const void*, int64_t)>(const_cast<void*>(k->entry()));
  fn(buf.data(), int64_t(buf.size()));
  fn(buf.data(), 1024);
  fn(buf.data(), 0);
  // Through the runtime API too (small buffer, few reps): any positive rate.
  EXPECT_GT(measure_read_bandwidth_gbs(1 << 20, 2), 0.0);
  EXPECT_GT(measure_read_bandwidth_gbs_threads(2, 1 << 20, 2), 0.0);
}

// The probe `kt-jit bench` pairs with multi-thread forwards: one part of whole KiB per pool thread
// (every thread of every pool, by ThreadPool::run's flat ids), the rest of `bytes` dropped.
TEST(BenchLoops, ReadProbeSplitsOverThePool) {
  const IsaLevel isa = detected_isa();
  if (isa == IsaLevel::ref) GTEST_SKIP() << "no vector ISA on this CPU";
  if (!KernelCache::instance().get(read_key(isa))) GTEST_SKIP() << "executable memory refused";
  ReadProbe alone(10000);
  EXPECT_EQ(alone.threads(), 1);
  EXPECT_EQ(alone.bytes(), 9216u);
  ThreadPool three(3, 1);
  ReadProbe split(10000, &three);  // 3333 bytes a thread: 3 KiB each
  EXPECT_EQ(split.threads(), 3);
  EXPECT_EQ(split.bytes(), 3u * 3072u);
  EXPECT_GT(split.pass_gbs(), 0.0);
  EXPECT_THROW(ReadProbe(2000, &three), std::invalid_argument);  // under 1 KiB a thread
#if !defined(KT_JIT_NO_HWLOC)  // (synthetic topologies are hwloc's)
  ThreadPool pools(5, 2, {}, Topology::synthetic("node:2 core:2 pu:1"));  // 2 + 3 threads
  ReadProbe flat(5 << 20, &pools);
  EXPECT_EQ(flat.threads(), 5);
  EXPECT_EQ(flat.bytes(), size_t(5) << 20);
  for (int i = 0; i < 3; ++i) EXPECT_GT(flat.pass_gbs(), 0.0);
#endif
}

TEST(BenchLoops, PeakLoopsRun) {
  const CpuFeatures& f = cpu_features();
  int ran = 0;
  for (IsaLevel isa : kX86Levels) {
    if (!level_usable(isa, f)) continue;
    for (PeakOp op : kOps) {
      if (!op_valid(isa, op)) continue;
      SCOPED_TRACE(peak_key(isa, op).describe());
      const Kernel* k = KernelCache::instance().get(peak_key(isa, op));
      if (!k) GTEST_SKIP() << "executable memory refused";
      auto fn = reinterpret_cast<void (*)(int64_t)>(const_cast<void*>(k->entry()));
      fn(0);
      fn(-1);
      fn(10);
      ++ran;
    }
  }
  if (ran == 0) GTEST_SKIP() << "no vector ISA on this CPU";
  // Calling the peak measurement for an op the ISA lacks throws.
  EXPECT_THROW(measure_peak_gops(IsaLevel::avx2, uint8_t(PeakOp::vpdpbusd), 1),
               std::invalid_argument);
  // The loop on several threads at once: the same refusals, and a positive aggregate rate.
  EXPECT_THROW(measure_peak_gops_threads(IsaLevel::avx2, uint8_t(PeakOp::vpdpbusd), 2, 1),
               std::invalid_argument);
  EXPECT_THROW(measure_peak_gops_threads(IsaLevel::avx2, uint8_t(PeakOp::fma_f32), 0, 1),
               std::invalid_argument);
  if (level_usable(IsaLevel::avx2, f))
    EXPECT_GT(measure_peak_gops_threads(IsaLevel::avx2, uint8_t(PeakOp::fma_f32), 2, 1), 0.0);
}

}  // namespace
}  // namespace ktjit
