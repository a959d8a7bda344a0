#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "formats/int8.hpp"
#include "jit/bench_loops.hpp"
#include "jit/cpu/cpu.hpp"
#include "jit/kernel.hpp"

namespace ktjit::test {

// Generated levels this machine can execute, lowest first (KT_JIT_ISA caps them): the x86 levels
// on x86-64, the NEON levels on AArch64.
inline std::vector<IsaLevel> runnable_levels() {
  std::vector<IsaLevel> v;
#if defined(__aarch64__)
  if (isa_is_neon(selected_isa()))
    for (int l = int(IsaLevel::neon); l <= int(selected_isa()); ++l) v.push_back(IsaLevel(l));
#else
  for (int l = int(IsaLevel::avx2); l <= int(selected_isa()); ++l)
    if (IsaLevel(l) != IsaLevel::amx) v.push_back(IsaLevel(l));
#endif
  return v;
}

inline std::vector<float> random_floats(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// The x86 levels that generate strip-scratch tiles (jit/gemm.hpp strip_scratch_kernel).
inline bool strip_scratch_level(IsaLevel isa) {
  return isa == IsaLevel::avx2 || isa == IsaLevel::avx512 || isa == IsaLevel::avx512_vnni;
}

// How many of `names` contain `part`.
inline size_t count_containing(const std::vector<std::string>& names, const std::string& part) {
  return size_t(std::count_if(names.begin(), names.end(), [&](const std::string& n) {
    return n.find(part) != std::string::npos;
  }));
}

// Keys of the measurement loops (jit/bench_loops.hpp).
inline KernelKey peak_key(IsaLevel isa, PeakOp op) {
  KernelKey k;
  k.kind = KernelKind::peak_loop;
  k.isa = isa;
  k.format = WeightFormat::none;
  k.variant = uint8_t(op);
  return k;
}
inline KernelKey read_key(IsaLevel isa) {
  KernelKey k;
  k.kind = KernelKind::read_stream;
  k.isa = isa;
  k.format = WeightFormat::none;
  return k;
}

// e4m3fn decoded from its definition (independent of the kernels' bit trick); NaN codes -> 480.
inline double e4m3_value(uint8_t b) {
  const int sign = b >> 7, e = (b >> 3) & 15, m = b & 7;
  const double mag = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
  return sign ? -mag : mag;
}

// Random fp8 weights for an N x K problem of `layout.sources` sources, packed into `out`, `scale`
// and `comp`: every e4m3 code (NaN codes included), 128x128 block scales (`block`) or row scales.
// Fills, per source, the e4m3 bytes `w8` (N x K) and the scales `bs`, and the group scale table.
inline void pack_random_fp8(const formats::StripLayout& l, int64_t N, int64_t K, uint32_t seed,
                            bool block, int8_t* out, float* scale, int32_t* comp,
                            std::vector<std::vector<uint8_t>>& w8,
                            std::vector<std::vector<float>>& bs, std::vector<float>& gscale) {
  std::mt19937 rng(seed);
  const int64_t nb = (N + 127) / 128, kb = (K + 127) / 128;
  for (int s = 0; s < l.sources; ++s) {
    w8.emplace_back(size_t(N * K));
    // Every code, but zero-exponent codes (zero, subnormals) only in every fifth k pair: the
    // pair order's shift decode runs the other steps and the table decode those (its flags).
    for (int64_t i = 0; i < N * K; ++i) {
      uint8_t b = uint8_t(rng() & 0xff);
      if (formats::fp8_zero_exponent(b) && (i % K) / 2 % 5 != 0) b |= 0x08;
      w8.back()[size_t(i)] = b;
    }
    bs.push_back(random_floats(size_t(block ? nb * kb : N), seed + 7 + uint32_t(s)));
    for (auto& v : bs.back()) v = std::fabs(v) * 0.01f + 1e-4f;
  }
  gscale.resize(size_t(std::max<int64_t>(l.gscale_floats(), 1)));
  const uint8_t* ws[2] = {w8[0].data(), w8.back().data()};
  const float* ss[2] = {bs[0].data(), bs.back().data()};
  formats::pack_fp8_strips(l, ws, block ? ss : nullptr, block ? nullptr : ss,
                           reinterpret_cast<uint8_t*>(out), scale, comp, gscale.data());
}

}  // namespace ktjit::test
