// AMX-INT8 prefill GEMM generator (IsaLevel::amx, WeightFormat::int8, KernelKind::gemm_prefill).
// Same GemmArgs ABI, packed strips, a+128 activations and per-column compensation as the
// avx512_vnni kernels, so gemm_ref is its reference twin bit for bit. See docs/ARCHITECTURE.md
// "AMX" for the tile allocation, tails and configuration.
#pragma once

#include <cstdint>
#include <vector>

#include "jit/amx_model.hpp"
#include "jit/kernel.hpp"

namespace ktjit::x64 {

// Rows of one AMX M block (the A and C tiles' rows); keys at isa amx take m_r in 1..16.
constexpr int kAmxTileRows = 16;

// Whether `key` names an AMX kernel this generator builds.
bool amx_gemm_supported(const KernelKey& key);

// Machine code for an AMX key. `log`, when given, receives every tile instruction as emitted
// (offset, length, operands), in code order.
std::vector<uint8_t> generate_amx_gemm(const KernelKey& key,
                                       std::vector<amx::AmxOp>* log = nullptr);

}  // namespace ktjit::x64
