// The instructions whose throughput the peak loops measure (KernelKey::variant of a peak_loop
// key), shared by the x86-64 (jit/x64/bench_loops.cpp) and AArch64
// (jit/aarch64/bench_loops_a64.cpp) generators, and the arch-neutral entry points.
#pragma once

#include <cstdint>

#include "jit/kernel.hpp"

namespace ktjit {

enum class PeakOp : uint8_t {
  vpdpbusd = 0,      // INT8 VNNI (avx512_vnni+)
  maddubsw = 1,      // INT8 without VNNI: vpmaddubsw + vpmaddwd + vpaddd (avx2 / avx512)
  fma_f32 = 2,       // vfmadd231ps; fmla v.4s by element on AArch64 (every NEON level)
  dpbf16 = 3,        // vdpbf16ps (avx512_bf16)
  tdpbusd = 4,       // AMX-INT8 tile multiply (amx): 16x16x64 MACs per instruction
  tdpbf16ps = 5,     // AMX-BF16 tile multiply (amx): 16x16x32 MACs per instruction
  maddubsw_w = 6,    // vpmaddubsw + vpaddw: the int16 group sums of qgroup kernels (kQGroupI16)
  sdot = 7,          // sdot v.4s, v.16b, v.4b[0] (neon_dotprod, neon_bf16)
  smull_sadalp = 8,  // smull + smull2 + addp + sadalp: plain NEON int8 (every NEON level)
  bfdot = 9,         // bfdot v.4s, v.8h, v.2h[0] (neon_bf16)
};
constexpr uint8_t kNumPeakOps = 10;

const char* peak_op_name(PeakOp op);

// Ops (2 per multiply-accumulate) one call of the peak loop does per iteration, at the key's ISA
// (x86-64 or NEON). Throws std::invalid_argument where the ISA lacks the op.
double peak_ops_per_iteration(const KernelKey& key);

}  // namespace ktjit
