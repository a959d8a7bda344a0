// Generated loops that measure the machine's own limits in the same process as a benchmark:
// the throughput of each instruction the kernels rely on, and the streaming read bandwidth.
#pragma once

#include <cstdint>
#include <vector>

#include "jit/kernel.hpp"

namespace ktjit::x64 {

// Peak-loop variants (KernelKey::variant).
enum class PeakOp : uint8_t {
  vpdpbusd = 0,    // INT8 VNNI (avx512_vnni+)
  maddubsw = 1,    // INT8 without VNNI: vpmaddubsw + vpmaddwd + vpaddd (avx2 / avx512)
  fma_f32 = 2,     // vfmadd231ps
  dpbf16 = 3,      // vdpbf16ps (avx512_bf16)
  tdpbusd = 4,     // AMX-INT8 tile multiply (amx): 16x16x64 MACs per instruction
  tdpbf16ps = 5,   // AMX-BF16 tile multiply (amx): 16x16x32 MACs per instruction
  maddubsw_w = 6,  // vpmaddubsw + vpaddw: the int16 group sums of qgroup kernels (kQGroupI16)
};

// void fn(int64_t iterations): `iterations` x an unrolled block of independent ops.
// Ops per iteration (2 per multiply-accumulate) are given by peak_ops_per_iteration().
std::vector<uint8_t> generate_peak_loop(const KernelKey& key);
double peak_ops_per_iteration(const KernelKey& key);

// void fn(const void* buf, int64_t bytes): reads every byte once with vector loads (bytes is a
// multiple of 1 KiB), folding them so the loads are not dead.
std::vector<uint8_t> generate_read_stream(const KernelKey& key);

}  // namespace ktjit::x64
