// Generated measurement loops for AArch64 (asmjit a64): the throughput of each instruction the
// NEON kernels rely on, and the streaming read bandwidth. The same ABI as jit/x64/bench_loops.hpp,
// so runtime/machine_limits.cpp measures either architecture the same way. Built into every
// kt-jit build (like the NEON GEMM generator): an x86-64 build only generates them.
#pragma once

#include <cstdint>
#include <vector>

#include "jit/bench_loops.hpp"
#include "jit/kernel.hpp"

namespace ktjit::aarch64 {

// void fn(int64_t iterations): `iterations` x an unrolled block of independent chains of the
// key's PeakOp (fma_f32, sdot, smull_sadalp, bfdot) at a NEON level; iterations <= 0 do nothing.
std::vector<uint8_t> generate_peak_loop(const KernelKey& key);
double peak_ops_per_iteration_a64(const KernelKey& key);

// void fn(const void* buf, int64_t bytes): reads every byte once with 128-bit loads (bytes is a
// multiple of 1 KiB), folding them so the loads are not dead.
std::vector<uint8_t> generate_read_stream(const KernelKey& key);

}  // namespace ktjit::aarch64
