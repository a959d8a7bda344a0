// Kernel keys, generated kernels and the process-wide kernel cache.
// A key names a tile shape and tail class, never a token count, so a model needs tens of kernels
// and decode never waits on code generation.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "jit/code_memory.hpp"
#include "jit/cpu/cpu.hpp"

namespace ktjit {

// An on/off environment switch: "1" on, "0" off, unset `unset`, anything else an error naming it.
bool env_switch(const char* name, bool unset);

enum class KernelKind : uint8_t {
  gemm_decode = 0,   // all rows of a call in one pass, strips streamed back to back
  gemm_prefill = 1,  // M-block loop inside each strip so the strip is reused from cache
  peak_loop = 2,     // throughput loop for one instruction (benchmarks)
  read_stream = 3,   // streaming read (benchmarks)
  quantize = 4,      // activation rows to int8 (jit/quantize.hpp)
};

enum class WeightFormat : uint8_t {
  none = 0,
  int8 = 1,    // int8 per-row scale
  int4 = 2,    // signed nibbles per-row scale, seen by the kernel as 16 * q4
  bf16 = 3,    // bfloat16 weights, fp32 activations and accumulation
  fp8 = 4,     // e4m3 weights with per-(strip half, k-group) scales, fp32 activations
  qgroup = 5,  // k-group scaled int8 codes (bytes or nibbles via a LUT), see gemm.hpp; the
               // variant holds kQGroupNibbles | kQGroupBias
  mxfp4 = 6,   // OCP MX: e2m1 nibbles, a power-of-two scale per (column, 32 k); fp32 activations
  mxfp8 = 7,   // OCP MX: e4m3 bytes, a power-of-two scale per (column, 32 k); fp32 activations
};

// KernelKey::variant bits of mxfp4 / mxfp8 gate/up (siluup) kernels: the SwiGLU variants of
// DeepSeek-V4 / MiniMax-M3 (SPEC §4), with L and alpha read from GemmArgs at run time.
constexpr uint8_t kSwigluClamp = 1;  // g = min(g, L), u = clamp(u, -L, L) (alpha: g clamped too)
constexpr uint8_t kSwigluAlpha = 2;  // h = g * sigmoid(alpha * g) * (u + 1)

// KernelKey::variant bits of WeightFormat::qgroup kernels.
constexpr uint8_t kQGroupNibbles = 1;  // codes stored as 4-bit indices into GemmArgs::lut
constexpr uint8_t kQGroupBias = 2;     // a per-(column, group) offset term
// Nibble codes whose 4-bit table spans at most 129 values (Q4_0, Q4_1, Q4_K, RAWINT4, GPTQ_INT4;
// not IQ4): the kernels take table + c0 (c0 = 0 or a power of two, so every entry is in [0, 129])
// as the unsigned operand of vpmaddubsw with the signed activations, no sign step, and subtract
// c0 * s_g per group. At the VNNI levels (vpdpbusd) only codes that need no offset (c0 = 0) or an
// identity table at c0 (kQGroupIdentity: Q4_0's nibble - 8), instead of the + 128 of the other
// codes there. c0's log2 + 1 is in variant bits 4..7 (0: c0 = 0). jit/gemm.hpp qgroup_code_offset.
constexpr uint8_t kQGroupOffset = 4;
// Two-level scales (GGUF's K-quants and IQ4_XS): each group's scale (and bias) is stored as an
// int8 sub-scale, multiplied in the kernel by an fp32 factor per column and super block of
// GemmArgs::g_per_super groups (a header before the super block's groups). The product is the
// exact fp32 scale a one-level layout would hold, so results are the same bits in fewer bytes
// (formats/grouped.hpp GroupedSpec::super_group). The value kStripScratch has elsewhere.
constexpr uint8_t kQGroupSuper = 8;
// 16-bit one-level scales: each group's scale (and bias) stored as fp16 (kQGroupF16) or bf16
// (kQGroupBf16) and widened exactly in the kernel (vcvtph2ps; vpmovzxwd + vpslld 16): the legacy
// GGUF types' f16 d and m, RAWINT4's bf16 and GPTQ's f16 scales, at 2 bytes instead of 4, for the
// same bits (GroupedSpec::scale_dtype). Not with kQGroupSuper.
constexpr uint16_t kQGroupF16 = 0x100;
constexpr uint16_t kQGroupBf16 = 0x200;
// Offset-code kernels below the VNNI levels whose int16 lanes cannot overflow: each vpmaddubsw
// pair sum is added into an int16 lane with vpaddw (one instruction instead of vpmaddwd + vpaddd)
// and the lanes are widened to int32 (vpmaddwd with ones) at the group's end and, in a group of
// more than formats::kQGroupI16Steps K steps, every that many steps into a part on the stack. Set
// only where the products a lane adds between widenings, of the largest stored code and
// |a| <= 127, fit int16 (formats::qgroup_int16_sums: 4-bit codes at any group, Q2_K / Q3_K's
// G 16), so the group sums, and the results, are the same bits.
constexpr uint16_t kQGroupI16 = 0x400;
// Offset nibble codes whose table (+ c0) is 0, 1, ..., 15 (Q4_0, Q4_1, Q4_K, RAWINT4, GPTQ_INT4,
// Q2_K, Q3_K): the nibble is the stored code, so the kernels skip the table lookup (vpshufb) and
// ignore GemmArgs::lut (formats::qgroup_identity_table).
constexpr uint16_t kQGroupIdentity = 0x800;
// Int32 super-block folds at avx2 (formats::qgroup_int_fold: two-level scales, no bias, byte codes
// within [-32, 32], i.e. Q6_K): the activations come as a + 128 (unsigned, the VNNI form) and the
// codes signed, so vpmaddubsw's pair sums of two K steps fit one int16 lane (vpaddw); vpmaddwd
// multiplies them by the group's int8 sub-scale (widened to both words of its column's dword)
// into the super block's int32 sums. At the super block's end the header's int32 correction
// (128 * sum of sub * group code sums) comes off and one FMA by the fp32 factor folds the sum:
// no per-group conversion, scale or FMA. The sums are exact, so the result is
// a_scale * sum over super blocks of fma(factor, float(exact sum)): fewer roundings than the
// per-group order, not the same bits (docs/FORMATS.md).
constexpr uint16_t kQGroupIntFold = 0x1000;
// Int16-lane super-block folds at avx2 (formats::qgroup_lane_fold: two-level scales over codes
// without an offset and groups of at most 32 k: 4-bit identity codes, i.e. Q4_K and Q2_K, or bytes
// in [0, 32], i.e. Q5_K): the int16 lanes (kQGroupI16) are multiplied by the group's int8
// sub-scale (vpmaddwd) into the super block's int32 sum X at the group's end (nibbles) or every
// formats::kQGroupByteLaneSteps K steps (bytes: the sub-scale pairs wait on the stack); with a
// bias, the super block's int32 bias sum Y = sum of sub-bias * s_g is formed at its end from int16
// pairs of two groups (vpmaddwd). Then t = fma(scale factor, float(X), t) and
// t = fma(bias factor, float(Y), t) once per super block: no per-group conversion, scale build or
// FMA. Fewer roundings than the per-group order, not the same bits (docs/FORMATS.md). Requires
// kQGroupSuper | kQGroupOffset (c0 = 0) | kQGroupI16, and with kQGroupNibbles kQGroupIdentity.
constexpr uint16_t kQGroupLaneFold = 0x2000;
// fp32 super-block partials at the VNNI levels (two-level scales without a bias: Q6_K, Q3_K,
// IQ4_XS): each group's int32 sum is multiplied by its int8 sub-scale alone, into an fp32 partial
// of the super block, S = fma(float(sum), float(sub), S); at the super block's end
// t = fma(S, factor, t) and S starts again at zero. One vmulps a vector less per group (the
// group scale float(sub) * factor is not built), for one FMA per super block; not the same bits as
// the per-group order (docs/FORMATS.md). With kQGroupIntFold (codes within [-32, 32]: Q6_K,
// Q3_K) the codes are signed and the activations a + 128, vpdpbusd's unsigned operand, and at the
// super block's end t = fma(S - float(the header's int32 correction), factor, t): no per-group
// 128 * s_g, no a_gsum.
constexpr uint16_t kQGroupSuperSums = 0x8000;

// KernelKey::variant bit of avx2 prefill tiles of 4 rows for int4 and some qgroup kernels
// (jit/gemm.hpp half_strip_format / half_strip_kernel): the kernel runs each 4-vector strip in
// two passes of 2 vectors (p and p + 2, so a pass holds a gate vector and its up vector), 4 rows
// x 2 vectors of sums with the 4 rows' activations broadcast once per K step. Each code vector is
// decoded once for 4 rows instead of 2: the same integer sums and epilogue, so the same bits as
// the 2-row tile.
constexpr uint16_t kHalfStrips = 0x4000;

// KernelKey::variant bit of kernels at avx512_bf16 that take bf16 activation pairs and multiply
// with vdpbf16ps: WeightFormat::bf16 prefill over the strip re-laid as k pairs (jit/gemm.hpp
// bf16_pair_kernel) and WeightFormat::fp8 decode of <= 4 rows (fp8_pair_kernel).
constexpr uint8_t kBf16Pairs = 1;
// KernelKey::variant bit of WeightFormat::fp8 one-row decode kernels at avx2: widen e4m3 in the
// fp32 domain (jit/gemm.hpp fp8_dword_decode; names end `_f32w`). e4m3 subnormal codes become
// fp32 subnormal FMA inputs there, which AMD CPUs take at full speed and Intel CPUs with a
// microcode assist, so the executor sets it on AMD (runtime/moe_layer.cpp).
constexpr uint8_t kFp8Fp32Widen = 2;
// KernelKey::variant bit, beside kBf16Pairs, of fp8 pair kernels at avx512_bf16 whose full strips
// are stored in the pair order (formats::fp8_strip_byte; names end `_perm`): the pair decode reads
// each 32 columns' k-pair bytes as 32 words without a gather and decodes them with shifts, or
// with tables in the k pairs that the scale table flags for zero-exponent codes
// (formats::kFp8FlagBytes). The layer packs that order at isa avx512_bf16 (not at amx, whose
// AMX-BF16 tiles read [k][column]).
constexpr uint8_t kFp8PairOrder = 4;

// KernelKey::variant bit of fp8 prefill kernels at the x86 levels without AVX512-BF16 (jit/gemm.hpp
// strip_scratch_kernel): each strip is decoded once into GemmArgs::scratch (fp8: fp16 values,
// widened by vcvtph2ps; mx: bf16 k pairs, read by the bf16 FMA microkernel) and every M block
// runs FMAs over it (fp32 activations). A bit of its own, clear of the SwiGLU and qgroup bits.
constexpr uint8_t kStripScratch = 8;
// KernelKey::variant bit of mxfp4 / mxfp8 prefill kernels at avx512_bf16 (jit/gemm.hpp
// mx_pair_kernel; names end `_dpbf16`): each strip decoded once into bf16 k pairs, then the bf16
// pair microkernel (vdpbf16ps) over bf16 activations; and of mxfp8 decode tiles of <= 4 rows there
// (mx8_pair_decode_kernel: vdpbf16ps group sums). kBf16Pairs is taken by kSwigluClamp there.
constexpr uint8_t kMxPairs = 0x10;

enum class Epilogue : uint8_t {
  store = 0,   // out[m][n] = y
  siluup = 1,  // strip holds gate then up columns; out[m][n] = silu(g) * u
  accum = 2,   // out[m][n] += routing_weight[m] * y
};

struct KernelKey {
  KernelKind kind = KernelKind::gemm_decode;
  IsaLevel isa = IsaLevel::ref;
  WeightFormat format = WeightFormat::int8;
  uint8_t m_r = 1;    // rows of the register tile
  uint8_t n_vec = 1;  // vectors of columns in a strip
  Epilogue epilogue = Epilogue::store;
  uint16_t variant = 0;  // family-specific (peak loops: which instruction)

  bool operator==(const KernelKey& o) const {
    return kind == o.kind && isa == o.isa && format == o.format && m_r == o.m_r &&
           n_vec == o.n_vec && epilogue == o.epilogue && variant == o.variant;
  }
  uint64_t packed() const {
    return uint64_t(kind) | uint64_t(isa) << 8 | uint64_t(format) << 16 | uint64_t(m_r) << 24 |
           uint64_t(n_vec) << 32 | uint64_t(epilogue) << 40 | uint64_t(variant) << 48;
  }
  // e.g. "gemm_decode_int8_avx512vnni_m4n64_siluup": family, format, ISA, tile, epilogue.
  std::string name() const;
  // e.g. "kind=gemm_decode isa=avx512_vnni fmt=int8 m_r=4 n_vec=4 epi=siluup".
  std::string describe() const;
};

struct KernelKeyHash {
  size_t operator()(const KernelKey& k) const { return std::hash<uint64_t>()(k.packed()); }
};

// Columns held by one vector register at an ISA level (int32 / fp32 lanes).
int vec_lanes(IsaLevel isa);

struct Kernel {
  KernelKey key;
  std::string name;
  std::vector<uint8_t> code;  // kept for dumps and perf maps
  ExecutableCode exec;        // empty when not published (dump-only or W^X refused)
  double gen_us = 0;
  const void* entry() const { return exec.entry(); }
};

struct CacheStats {
  uint64_t hits = 0, misses = 0, bytes = 0;
  double gen_us = 0;
};

// Key -> kernel, generated once, thread-safe. Kernels are immutable once published and live as
// long as the process.
class KernelCache {
 public:
  static KernelCache& instance();

  // Generates (if needed) and publishes the kernel into executable memory. Returns nullptr when
  // executable memory is refused: callers then use the reference path (a warning is logged once).
  const Kernel* get(const KernelKey& key);
  // Generates without publishing (any ISA, including ones this CPU cannot run). Not cached.
  static std::unique_ptr<Kernel> generate_only(const KernelKey& key);

  CacheStats stats() const;
  bool exec_refused() const { return exec_refused_.load(); }
  // Forgets every kernel generated so far (returns how many): later get()s generate afresh, so a
  // setting the generators read when they generate takes effect for the next layer built; the
  // forgotten kernels stay alive for the layers that hold them. For in-process A/Bs of
  // generator settings (tools/ab_layer.py --fresh-kernels); not for serving.
  size_t retire_all();

 private:
  KernelCache();
  void on_published(const Kernel& k);

  mutable std::mutex mu_;
  std::unordered_map<KernelKey, std::unique_ptr<Kernel>, KernelKeyHash> map_;
  std::vector<std::unique_ptr<Kernel>> retired_;  // retire_all(): kept for their holders
  std::atomic<uint64_t> hits_{0};
  uint64_t misses_ = 0, bytes_ = 0;
  double gen_us_ = 0;
  std::atomic<bool> exec_refused_{false};
  std::atomic<bool> dump_refused_{false};  // KT_JIT_DUMP's warning, said once
  std::string dump_dir_;
  bool perf_map_ = false;
};

// Dispatch from a key to its generator: machine code bytes for the key.
std::vector<uint8_t> generate_code(const KernelKey& key);

}  // namespace ktjit
