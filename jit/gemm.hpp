// The GEMM kernel family (weights int8, int4 or bf16): its call ABI and the plain C++ reference
// kernel that is both the test oracle and the fallback path. The packed weight layout is
// formats::StripLayout.
//
// Math per (row m, packed column n):
//   int8/int4: acc = Σ_k a[m][k] * w[n][k]              exact int32 (a, w in [-127, 127])
//              y   = (a_scale[m] * w_scale[n]) * float(acc)   two fp32 roundings, in that order
//   bf16:      acc = fma(a[m][k], float(w[n][k]), acc) for k = 0, 1, ... (fp32 activations)
//              y   = acc                                  (a_scale, w_scale unused)
//   fp8:       w'  = fp8_value(w[n][k]) * gscale[strip][group(k)][half(n)]  (one rounding)
//              acc = fma(a[m][k], w', acc) in k order;  y = (a_scale[m] * w_scale[n]) * acc
// Epilogues: store y; siluup (gate columns then up columns of a strip):
//   h = g / (1 + exp2poly(clamp(-g, -87, 88))) * u, exp2poly as in exp_ref() below;
//   accum: out = fma(row_weight[m], y, out).
#pragma once

#include <cstddef>
#include <cstdint>

#include "jit/kernel.hpp"

namespace ktjit {

// Passed by pointer to every generated GEMM kernel (offsets are part of the ABI).
struct GemmArgs {
  const int8_t* a;   // activations, row m at a + m*lda: int8 (see int8_activation_offset) or fp32
  int64_t lda;       // bytes
  const int8_t* w;   // first packed strip
  int64_t n_strips;  // strips of this kernel's width to process
  int64_t k4;        // K steps: K/4 for integer formats (K padded), K for bf16
  const float* a_scale;     // per row
  const float* w_scale;     // per packed column of the first strip onwards
  const int32_t* w_comp;    // per packed column: 128 * Σ_k w (VNNI's unsigned-activation offset)
  float* const* out_rows;   // per row output pointer
  int64_t out_col;          // first output column (floats) for the first strip
  const float* row_weight;  // per row routing weight (accum epilogue)
  int64_t m_blocks;         // prefill kernels: number of m_r-row blocks
  // fp8 only: per strip, per k-group, per half (gate, up; equal for plain matrices) one scale
  // repeated over a vector (so it is a full-width memory operand), strips back to back.
  const float* w_gscale;
  int64_t g_steps;      // K steps per group
  int64_t g_per_strip;  // groups per strip
};
static_assert(offsetof(GemmArgs, m_blocks) == 88, "GemmArgs is part of the kernel ABI");
static_assert(offsetof(GemmArgs, g_per_strip) == 112, "GemmArgs is part of the kernel ABI");

using GemmFn = void (*)(const GemmArgs*);

// VNNI levels (vpdpbusd multiplies unsigned by signed bytes) take activations stored as
// a + 128 (the int8 byte XOR 0x80); the other levels take the int8 bytes as they are.
inline bool int8_activation_offset(IsaLevel isa) {
  return int(isa) >= int(IsaLevel::avx512_vnni);
}

// Strips are 4 vectors of columns wide; a tail strip may hold fewer vectors.
constexpr int kStripVecs = 4;
// Register-tile rows the prefill kernel uses at each level (limited by the register file).
int gemm_max_rows(IsaLevel isa, WeightFormat fmt = WeightFormat::int8);

// The value an fp8 (e4m3fn) byte decodes to in the kernels: exact for every finite code,
// subnormals included; 0x7f/0xff (NaN in e4m3fn) decode as +-480 (what their bits would mean).
// The kernels build it the same way: magnitude bits to fp32 bits 26..20 plus an exponent bias of
// 120, and for e == 0 one more exponent step minus 2^-6 (exact), so no fp32 subnormal ever
// reaches an arithmetic instruction (denormal operands cost a microcode assist on Intel).
inline float fp8_value(uint8_t b) {
  uint32_t bits = (uint32_t(b & 0x7f) << 20) + (120u << 23);
  float f;
  if ((b & 0x78) == 0) {
    bits += 1u << 23;
    __builtin_memcpy(&f, &bits, 4);
    f -= 0.015625f;  // 2^-6
  } else {
    __builtin_memcpy(&f, &bits, 4);
  }
  return (b & 0x80) ? -f : f;
}

// Output columns written per strip of `n_vec` vectors.
inline int gemm_strip_out_cols(IsaLevel isa, int n_vec, Epilogue e) {
  return (e == Epilogue::siluup ? n_vec / 2 : n_vec) * vec_lanes(isa);
}

// Reference twin of a generated kernel: same ABI, same numerics, bit for bit.
// `m_rows` is the number of rows of one block (the key's m_r).
void gemm_ref(const KernelKey& key, const GemmArgs& args);

// The polynomial exp used by the SiLU epilogue (kt-kernel's exp_avx512 coefficients).
float exp_ref(float x);
float silu_mul_ref(float g, float u);

}  // namespace ktjit
