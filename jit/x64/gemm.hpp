#pragma once

#include <cstdint>
#include <vector>

#include "jit/kernel.hpp"

namespace ktjit::x64 {

// Machine code for an INT8 GEMM key (gemm_decode / gemm_prefill); see jit/gemm.hpp.
std::vector<uint8_t> generate_gemm(const KernelKey& key);

// How many bytes ahead of its weight stream a decode kernel prefetches (0: none), and whether it
// asks for each K step's lines as the step starts (else an unrolled loop's lines together at its
// end). Tests check the kernels' prefetches against them.
int decode_prefetch_bytes(const KernelKey& key);
bool decode_prefetch_spread(const KernelKey& key);

// Whether a prefill kernel's tiles ask for their rows' shares of the next strip (the pf_var_
// sites of jit/x64/gemm.cpp) with prefetcht0, into L1, rather than prefetcht1, on a CPU that is
// (zen5) or is not a Zen 5; the second form for this CPU. Tests check the kernels' asks against it.
bool prefill_share_l1(const KernelKey& key, bool zen5);
bool prefill_share_l1(const KernelKey& key);

}  // namespace ktjit::x64
