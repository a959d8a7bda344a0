// Generated loops that measure the machine's own limits in the same process as a benchmark:
// the throughput of each instruction the kernels rely on, and the streaming read bandwidth.
#pragma once

#include <cstdint>
#include <vector>

#include "jit/bench_loops.hpp"
#include "jit/kernel.hpp"

namespace ktjit::x64 {

// Peak-loop variants (KernelKey::variant): the x86-64 members of ktjit::PeakOp.
using ktjit::PeakOp;

// void fn(int64_t iterations): `iterations` x an unrolled block of independent ops.
// Ops per iteration (2 per multiply-accumulate) are given by ktjit::peak_ops_per_iteration().
std::vector<uint8_t> generate_peak_loop(const KernelKey& key);
double peak_ops_per_iteration_x64(const KernelKey& key);

// void fn(const void* buf, int64_t bytes): reads every byte once with vector loads (bytes is a
// multiple of 1 KiB), folding them so the loads are not dead.
std::vector<uint8_t> generate_read_stream(const KernelKey& key);

}  // namespace ktjit::x64
