// Activation rows to int8 for the executor: the generated quantizers (jit/quantize.hpp) where the
// selected level has them (x86 avx2 and up), formats::quantize_row_int8 otherwise. Either way the
// same bits: scale = amax / 127, q = clamp(rne(x / scale), -127, 127), XOR 0x80 when `flip`.
#pragma once

#include <cstdint>

#include "jit/cpu/cpu.hpp"
#include "jit/kernel.hpp"

namespace ktjit {

class RowQuantizer {
 public:
  RowQuantizer() = default;  // the C++ quantizer
  // The kernels of `isa` when this CPU runs them (they come from the kernel cache); none at ref,
  // the NEON levels, or a level above the selected one (the tests' interpreter levels).
  explicit RowQuantizer(IsaLevel isa);
  // Quantizes x[0, n) into q[0, n); returns the row's scale.
  float quantize(const float* x, int64_t n, int8_t* q, bool flip) const;
  // x[0, n) as bf16 into out[0, n): formats::f32_to_bf16_row's bits.
  void to_bf16(const float* x, int64_t n, uint16_t* out) const;
  bool generated() const { return amax_ != nullptr; }

 private:
  const Kernel* amax_ = nullptr;
  const Kernel* round_[2] = {nullptr, nullptr};  // plain, flipped
  const Kernel* bf16_ = nullptr;
};

}  // namespace ktjit
