// K-group scaled integer weights: the common form of GGUF's block types (Q4_0 ... Q6_K, IQ4_*),
// RAWINT4 / GPTQ_INT4 (nibble - 8 with group scales) and any per-row scheme with finer scales.
//
//   w[r][c] = scale[r][c / group] * code[r][c] + bias[r][c / group]        (bias optional)
//
// Codes are int8 (any value in [-128, 127]). A format whose codes are at most 16 distinct values
// (4-bit types) names them in a 16-entry table `lut`; the layer then stores each code as the
// nibble i with lut[i] == code and the kernels decode nibbles through the table.
// Loaders (formats/gguf, the HF INT4 loaders) produce GroupedMatrix views; runtime/moe_layer
// packs them into strips for the generated kernels.
#pragma once

#include <cstdint>

namespace ktjit::formats {

// One matrix [n, k], row-major views (k % group == 0).
struct GroupedMatrix {
  const int8_t* codes = nullptr;  // n x k
  const float* scales = nullptr;  // n x (k / group)
  const float* biases = nullptr;  // n x (k / group), or null: no offset term
  int64_t group = 0;
};

// How a layer stores one matrix kind (fused gate/up, or down). Gate and up share one spec.
struct GroupedSpec {
  int64_t group = 32;   // K elements per scale group
  bool bias = false;    // an offset term per group (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K)
  int code_bits = 8;    // 8: codes stored as bytes; 4: nibbles decoded through `lut`
  int8_t lut[16] = {};  // code_bits == 4: the code each nibble value stands for
};

}  // namespace ktjit::formats
