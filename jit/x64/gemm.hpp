#pragma once

#include <cstdint>
#include <vector>

#include "jit/kernel.hpp"

namespace ktjit::x64 {

// Machine code for an INT8 GEMM key (gemm_decode / gemm_prefill); see jit/gemm.hpp.
std::vector<uint8_t> generate_gemm(const KernelKey& key);

}  // namespace ktjit::x64
