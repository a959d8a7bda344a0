// The x86-64 activation quantizers of jit/quantize.hpp (avx2 and the AVX-512 levels).
#pragma once

#include <cstdint>
#include <vector>

#include "jit/kernel.hpp"

namespace ktjit::x64 {

// void fn(const QuantArgs*): key.kind quantize, format int8, variant kQuantAmax / kQuantRound /
// kQuantRoundFlip, isa avx2 or an AVX-512 level (ymm or zmm).
std::vector<uint8_t> generate_quantize(const KernelKey& key);

}  // namespace ktjit::x64
