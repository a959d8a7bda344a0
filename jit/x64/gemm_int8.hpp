#pragma once

#include <cstdint>
#include <vector>

#include "jit/kernel.hpp"

namespace ktjit::x64 {

// Machine code for an INT8 GEMM key (gemm_decode / gemm_prefill); see jit/gemm_int8.hpp.
std::vector<uint8_t> generate_gemm_int8(const KernelKey& key);

}  // namespace ktjit::x64
