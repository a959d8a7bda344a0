// AArch64 (NEON) GEMM generator: the same GemmArgs ABI and math as jit/x64/gemm.cpp, emitted with
// asmjit's a64 backend. Built into every kt-jit build: an x86-64 build only generates (kt-jit-dump
// --isa neon), an AArch64 build publishes and runs the code.
#pragma once

#include <cstdint>
#include <vector>

#include "jit/kernel.hpp"

namespace ktjit::aarch64 {

// Machine code for a gemm_decode / gemm_prefill key at a NEON level (int8, int4, bf16 weights).
// Throws std::invalid_argument for formats or tiles the NEON generator does not build.
std::vector<uint8_t> generate_gemm(const KernelKey& key);

}  // namespace ktjit::aarch64
