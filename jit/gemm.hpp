// The GEMM kernel family (weights int8, int4 or bf16): its call ABI and the plain C++ reference
// kernel that is both the test oracle and the fallback path. The packed weight layout is
// formats::StripLayout.
//
// Math per (row m, packed column n):
//   int8/int4: acc = Σ_k a[m][k] * w[n][k]              exact int32 (a, w in [-127, 127])
//              y   = (a_scale[m] * w_scale[n]) * float(acc)   two fp32 roundings, in that order
//   bf16:      acc = fma(a[m][k], float(w[n][k]), acc) for k = 0, 1, ... (fp32 activations)
//              y   = acc                                  (a_scale, w_scale unused)
//              Pair kernels (bf16_pair_kernel: AMX-BF16 tiles, or kBf16Pairs prefill at
//              avx512_bf16 and neon_bf16) take bf16 activations (rounded RNE by the caller); the
//              x86 kBf16Pairs ones compute, as vdpbf16ps does, for each pair p = 0, 1, ...:
//                acc = ftz(fma(daz(a[2p+1]), daz(w[n][2p+1]), daz(acc)))
//                acc = ftz(fma(daz(a[2p]),   daz(w[n][2p]),   acc))  (vdpbf16ps_lane below)
//              and the NEON ones, as bfdot does (round to odd, bfdot_lane below):
//                acc = ro(ftz(acc) + ro(ro(a[2p] * w[n][2p]) + ro(a[2p+1] * w[n][2p+1])))
//   fp8:       w'  = fp8_value(w[n][k]) * gscale[strip][group(k)][half(n)]  (one rounding)
//              acc = fma(a[m][k], w', acc) in k order;  y = (a_scale[m] * w_scale[n]) * acc
//              (decode_group_accumulate and strip_scratch_kernel keys: per-group sums, below)
//   qgroup:    (formats/grouped.hpp: w = scale[n][g] * code[n][k] + bias[n][g], g = k / G)
//              acc_g = Σ_{k in group g} a[m][k] * code[n][k]      exact int32, a in [-127, 127],
//                                                                  code in [-128, 127]
//              s_g   = Σ_{k in group g} a[m][k]                   exact int32 (GemmArgs::a_gsum)
//              t = 0; for g = 0, 1, ...:  t = fma(scale[n][g], float(acc_g), t)
//                                         t = fma(bias[n][g], float(s_g), t)   (bias variants)
//              y = a_scale[m] * t                      (= a_scale·Σ scale·acc + Σ bias·asum with
//                                                       asum = a_scale·s_g, in this fp32 order)
//              VNNI levels take the activations as signed bytes (no +128) and the codes as the
//              unsigned operand code + 128 (stored XOR 0x80, the LUT alike), so vpdpbusd yields
//              acc_g + 128·s_g and the kernel subtracts 128·s_g (from a_gsum) before converting:
//              no per-column compensation is stored or streamed. avx512 / avx2 multiply |code|
//              (unsigned) by a·sign(code) (signed) with vpmaddubsw: each pair sum is at most
//              2·128·127 < 2^15, so it never saturates, -128 included.
//   mxfp4/mxfp8 (OCP MX, K a multiple of 32): per (column n, group g = k / 32) a power-of-two
//              scale s = 2^(b - 127), b the stored exponent byte (ue8m0 e; mxfp8: e + 8, below)
//              w'  = value(w[n][k]) * s                                          (exact)
//              acc = fma(a[m][k], w', acc) in k order;  y = acc
//              mxfp4: value = e2m1 nibble {0, .5, 1, 1.5, 2, 3, 4, 6}, bit 3 the sign (mx_e2m1).
//              Strips hold per group: the columns' exponent bytes, then [k/8][column][4 bytes]:
//              the dword of a column holds its 8 nibbles of k0..k0+7 (k0 in bits 0..3), i.e. the
//              checkpoint's 4 bytes as they are (g_steps = 32 K steps, k4 = K, w_gscale unused).
//              mxfp8: value = fp16 bits (sign << 15 | magnitude << 7), the e4m3 value * 2^-8
//              exactly (subnormals too, vcvtph2ps), hence the stored e + 8. Strips hold per
//              group the exponent bytes, then [k][column] bytes as fp8.
// Epilogues: store y; siluup (gate columns then up columns of a strip):
//   h = g / (1 + exp2poly(clamp(-g, -87, 88))) * u, exp2poly as in exp_ref() below;
//   accum: out = fma(row_weight[m], y, out).
//   mx siluup variants (swiglu_ref): kSwigluClamp: g = min(g, L), u = min(max(u, -L), L)
//   (with kSwigluAlpha g = min(max(g, -L), L) too); kSwigluAlpha:
//   h = g / (1 + exp2poly(clamp(-(alpha * g), -87, 88))) * (u + 1).
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
  int64_t k4;        // K steps: K/4 for integer formats (K padded); bf16: k pairs (K at ref)
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
  int64_t g_steps;      // K steps per group (qgroup: G / 4)
  int64_t g_per_strip;  // groups per strip (qgroup: K / G)
  // qgroup only. Strips hold, per group, the group's codes (g_steps K steps) then the strip's
  // fp32 scales (one per packed column) and, with a bias, the fp32 biases: one sequential stream.
  const int8_t* lut;      // nibble variants: 16 codes (VNNI levels: code XOR 0x80), lanes' table
  const int32_t* a_gsum;  // s_g of row m at a_gsum[g * a_gsum_ld/4 + m] (VNNI or bias variants);
                          // avx2 / avx512 int4 (int4_int16_sums): Σ_k a of row m at a_gsum[m]
  int64_t a_gsum_ld;      // bytes between groups of a_gsum
  // mxfp4 / mxfp8 siluup kernels with kSwigluClamp / kSwigluAlpha: L and alpha (SPEC §4).
  float swiglu_limit;
  float swiglu_alpha;
  // scratch_pair_kernel and strip_scratch_kernel only: per-thread scratch of gemm_scratch_bytes,
  // where the kernel decodes each strip once (bf16 k pairs [k/2][column][2]; strip-scratch fp8:
  // fp16 [k][column]) and reuses it for every M block.
  void* scratch;
  // qgroup kQGroupSuper only: groups per super block and super blocks per strip (g_per_strip =
  // g_per_super * s_per_strip). Each super block starts with its header: one fp32 scale factor
  // per packed column (then, with a bias, one fp32 bias factor per column); each group's codes
  // are followed by one int8 sub-scale (then sub-bias) per column.
  int64_t g_per_super;
  int64_t s_per_strip;
  // tail_rows_kernel prefill only: rows after the m_blocks blocks (0 .. m_r - 1, or m_r + 1 ..
  // m_r + split_tail_rows for split_tail_kernel), run by the same call over the same (decoded)
  // strip (rows m_blocks * m_r onwards).
  int64_t m_tail;
  // Prefill kernels: where the call's last strip prefetches "the next strip" (the first strip of
  // the matrix the caller runs next, e.g. the next expert's), or nullptr for the strip after it
  // in memory. Every other strip prefetches the one after it.
  const int8_t* pf_last;
};
static_assert(offsetof(GemmArgs, m_blocks) == 88, "GemmArgs is part of the kernel ABI");
static_assert(offsetof(GemmArgs, g_per_strip) == 112, "GemmArgs is part of the kernel ABI");
static_assert(offsetof(GemmArgs, lut) == 120, "GemmArgs is part of the kernel ABI");
static_assert(offsetof(GemmArgs, a_gsum_ld) == 136, "GemmArgs is part of the kernel ABI");
static_assert(offsetof(GemmArgs, swiglu_limit) == 144, "GemmArgs is part of the kernel ABI");
static_assert(offsetof(GemmArgs, swiglu_alpha) == 148, "GemmArgs is part of the kernel ABI");
static_assert(offsetof(GemmArgs, scratch) == 152, "GemmArgs is part of the kernel ABI");
static_assert(offsetof(GemmArgs, g_per_super) == 160, "GemmArgs is part of the kernel ABI");
static_assert(offsetof(GemmArgs, s_per_strip) == 168, "GemmArgs is part of the kernel ABI");
static_assert(offsetof(GemmArgs, m_tail) == 176, "GemmArgs is part of the kernel ABI");
static_assert(offsetof(GemmArgs, pf_last) == 184, "GemmArgs is part of the kernel ABI");

using GemmFn = void (*)(const GemmArgs*);

// How the executor calls a generated GEMM kernel: directly, unless a test installed a runner (the
// tests' x86-64 interpreter, which runs the kernels of levels this CPU lacks through the real
// executor). The runner must be thread-safe; nullptr restores the direct call.
using GemmRunner = void (*)(const Kernel& kernel, const GemmArgs& args);
void set_gemm_runner(GemmRunner runner);
bool gemm_runner_installed();  // MoELayer then accepts levels above the selected one
void run_gemm_kernel(const Kernel& kernel, const GemmArgs& args);

// Whether `fmt` is an MX format (power-of-two scales per 32-wide K group, fp32 activations;
// bf16 ones in AMX-BF16 tiles).
inline bool is_mx_format(WeightFormat fmt) {
  return fmt == WeightFormat::mxfp4 || fmt == WeightFormat::mxfp8;
}

// VNNI levels (vpdpbusd multiplies unsigned by signed bytes) take activations stored as
// a + 128 (the int8 byte XOR 0x80); the other levels take the int8 bytes as they are.
// NEON levels (sdot is signed x signed; the widening path too) take plain int8.
inline bool int8_activation_offset(IsaLevel isa) {
  return int(isa) >= int(IsaLevel::avx512_vnni) && !isa_is_neon(isa);
}

// int4 kernels below the VNNI levels (avx2, avx512) take the nibbles as unsigned codes q4 + 8
// (pack_int8_strips with offset_nibbles: the two's-complement nibble XOR 8), multiply them as
// vpmaddubsw's unsigned operand by the signed activation bytes and add 8 K steps of pair sums in
// int16 lanes before widening them to int32: |sum| <= 8 * 2 * 15 * 127 = 30480, never
// saturating. Unlike the |a| * (w * sign(a)) route of the int8 kernels there is no sign step and
// one vpmaddwd per 8 steps instead of one per step; unlike a signed nibble, the code needs no
// table to become a byte (a mask, and a shift for the high nibble). The epilogue takes
// 8 * Σ_k a (GemmArgs::a_gsum[m], the row's sum over K) off and shifts the result left by 4:
// Σ a * 16 * q4, the int32 of every other level.
inline bool int4_int16_sums(IsaLevel isa, WeightFormat fmt) {
  return (isa == IsaLevel::avx2 || isa == IsaLevel::avx512) && fmt == WeightFormat::int4;
}
constexpr int kInt4SumSteps = 8;  // K steps summed in int16 lanes (4 k each)
// Whether `fmt`'s strips at `isa` hold 4-bit codes q4 + 8 instead of two's-complement nibbles.
inline bool int4_offset_nibbles(IsaLevel isa, WeightFormat fmt) {
  return int4_int16_sums(isa, fmt);
}
// avx2 prefill tiles of kHalfStripRows rows run as two passes of 2 vectors (kHalfStrips), where
// the decode of a code vector is shared by the tile's rows: int4, the qgroup int16-lane folds
// (Q4_K, Q2_K, Q5_K), the int16 group sums of identity tables without a bias (Q4_0, Q3_K, RAWINT4,
// GPTQ_INT4) and the sign-step kernels without a bias (Q8_0, IQ4_NL, IQ4_XS: |code| and the table
// lookup shared). A bias's group end needs more registers than 4 rows leave. The executor's tile
// tier from that many rows on (runtime/moe_layer.cpp make_gemm_kernel_set).
constexpr int kHalfStripRows = 4;
inline bool half_strip_format(WeightFormat fmt, uint16_t variant) {
  if (fmt == WeightFormat::int4) return true;
  if (fmt != WeightFormat::qgroup) return false;
  if (variant & kQGroupLaneFold) return true;
  if ((variant & kQGroupBias) || (variant & kQGroupIntFold)) return false;
  // identity int16 sums, or the sign step (no offset: Q8_0, IQ4_NL, IQ4_XS)
  return ((variant & kQGroupI16) && (variant & kQGroupIdentity)) || !(variant & kQGroupOffset);
}
// At the VNNI levels, prefill tiles of kHalfStripRowsVnni rows x 2 vectors for the qgroup byte
// codes (Q8_0, Q5_0, Q5_1, Q5_K, Q6_K): the 3 x 4 tile reads 256 bytes of codes a K step for 12
// vpdpbusd and re-reads its strip (larger than L1) for every block; 6 x 2 reads half as many
// bytes a dot product. Qwen3 layers streamed from DRAM ran 1.17-1.39x faster (Q8_0, Q5_0, Q5_1,
// Q5_K) and 1.04-1.11x (Q6_K) on a Zen 5, with their experts in L3 1.06x (Q8_0) and 1.00x (Q6_K);
// a loop of the steps alone from L2 (tools/tile_loop.cpp) shows no gain, so the cause is not
// pinned down. Nibbles keep the 3 x 4 tile (Q4_0 was 1.00-1.02x faster).
constexpr int kHalfStripRowsVnni = 6;
inline bool half_strip_vnni_format(IsaLevel isa, WeightFormat fmt, uint16_t variant) {
  return (isa == IsaLevel::avx512_vnni || isa == IsaLevel::avx512_bf16) &&
         fmt == WeightFormat::qgroup && !(variant & kQGroupNibbles);
}
// Whether `fmt` (with `variant`) has half-strip tiles at `isa`: avx2's or the VNNI levels'.
inline bool half_strip_tiles(IsaLevel isa, WeightFormat fmt, uint16_t variant) {
  return isa == IsaLevel::avx2 ? half_strip_format(fmt, variant)
                               : half_strip_vnni_format(isa, fmt, variant);
}
inline bool half_strip_kernel(const KernelKey& key) {
  return (key.variant & kHalfStrips) && half_strip_tiles(key.isa, key.format, key.variant);
}
inline int half_strip_rows(IsaLevel isa) {
  return isa == IsaLevel::avx2 ? kHalfStripRows : kHalfStripRowsVnni;
}

// Whether activations reach `fmt`'s kernels at `isa` as a + 128: the int8 and int4 kernels of
// the VNNI levels (not the qgroup kernels, whose codes are their unsigned operand, see above;
// nor avx2 / avx512 int4, whose offset nibbles are).
inline bool gemm_activation_offset(IsaLevel isa, WeightFormat fmt) {
  return fmt != WeightFormat::qgroup && int8_activation_offset(isa);
}
// mxfp4 / mxfp8 / fp8 decode kernels of <= 2 rows on AVX-512 and of 1 row on AVX2 (whose 16
// registers hold one row's group accumulators beside its accumulators; 2 rows for mxfp4 and the
// fp32-domain fp8 widen, whose fp32 accumulators wait on the stack): each scale group's
// products are summed unscaled (g = fma(a, w, g) in k order; w the decoded value, for fp8 and
// mxfp8 the value * 2^-8) and folded in once per group, acc = fma(g, scale, acc) (scale * 2^8
// for those two), instead of multiplying every weight by its scale; jit/gemm_ref.cpp follows the
// same rule.
inline bool decode_group_accumulate(const KernelKey& key);
// fp8 decode kernels of 1 or 2 rows at avx2 (decode_group_accumulate ones) with kFp8Fp32Widen (the
// executor's choice on AMD CPUs) widen the e4m3 byte in the
// fp32 domain instead of the fp16 route (whose vcvtph2ps bounds them there): vpmovsxbd, << 20,
// & 0x87f00000 gives the fp32 bits of value * 2^-120 (e4m3 subnormals become fp32 subnormals,
// exactly; the NaN codes +-480 * 2^-120 as elsewhere). The activation is taken * 2^64 (one vmulps
// per K step; exact, finite below 2^64), so a group's sum is g = fma(a * 2^64, value * 2^-120, g)
// = Σ a·value·2^-56 and the fold is acc = fma(g, scale * 2^56, acc). Partial sums the fp16 route
// would hold at or above 2^-70 are the same bits (every product and sum is the old one * 2^-48,
// no subnormal rounding); jit/gemm_ref.cpp follows this rule exactly.
inline bool fp8_dword_decode(const KernelKey& key) {
  return key.format == WeightFormat::fp8 && (key.variant & kFp8Fp32Widen);
}
inline bool decode_group_accumulate(const KernelKey& key) {
  const bool fmt = key.format == WeightFormat::mxfp4 || key.format == WeightFormat::mxfp8 ||
                   key.format == WeightFormat::fp8;
  const bool level =
      isa_is_neon(key.isa) ? false
      : key.isa == IsaLevel::avx2
          ? key.m_r == 1 ||
                (key.m_r == 2 && (fp8_dword_decode(key) || key.format == WeightFormat::mxfp4))
          : int(key.isa) >= int(IsaLevel::avx512) && key.m_r <= 2;
  return fmt && key.kind == KernelKind::gemm_decode && level;
}
// mxfp4 decode kernels of <= 2 rows on AVX-512 (the decode_group_accumulate ones) take the
// activations as int16 codes per 32-wide group (formats::quantize_mx_act_i16: 68 bytes a group,
// (q[8b+s], q[8b+s+4]) pairs then d/2) and multiply them by the weights' 2 * e2m1 codes, exact
// integers in [-12, 12], with vpdpwssd (avx512: vpmaddwd + vpaddd): the group sum is an exact
// int32 (|sum| <= 32 * 12 * 32767 < 2^24, so also exact as fp32) and is folded in once,
//   acc = fma(float(sum_g), scale_n * (d_g / 2), acc)        (scale_n = 2^(e - 127), exact)
// The packed nibbles are read with vpermw over a 32-word table: each word holds 4 nibbles, so
// 32 weights cost one shift, one permute and one dot instruction (fp32 decode: 16).
// AVX2 (its decode tiles of 1-2 rows) takes the same int16 codes: the weights' 2 * e2m1 + 12
// (unsigned) by vpshufb from a 16-byte table, vpmaddwd + vpaddd, the offset's share subtracted
// at the group end; the same exact int32 sums (jit/x64/gemm.cpp microkernel_mx_i16_avx2).
inline bool mx_int16_activations(const KernelKey& key) {
  return key.format == WeightFormat::mxfp4 && decode_group_accumulate(key);
}
// bf16 kernels that take bf16 activation pairs and read the k-pair strip in place (K even):
// AMX-BF16 tiles at isa amx, and the kBf16Pairs prefill kernels
// (vdpbf16ps) at avx512_bf16 and (bfdot, reading the k-pair strip in place) at neon_bf16.
inline bool bf16_pair_kernel(const KernelKey& key) {
  return key.format == WeightFormat::bf16 && key.kind == KernelKind::gemm_prefill &&
         (key.isa == IsaLevel::amx || (key.variant & kBf16Pairs));
}
// The BF16 pair tiles of 2-vector strips (strip_vecs_for): up to kBf16PairRows2v rows.
constexpr int kBf16PairRows2v = 12;
inline bool bf16_pair_rows2v(const KernelKey& key) {
  return key.isa == IsaLevel::avx512_bf16 && bf16_pair_kernel(key) && key.m_r == kBf16PairRows2v;
}
// The int8 prefill tiles of 2-vector strips (strip_vecs_for): up to kInt8Rows2v rows.
constexpr int kInt8Rows2v = 12;
inline bool int8_rows2v(const KernelKey& key) {
  return key.isa == IsaLevel::avx512_bf16 && key.format == WeightFormat::int8 &&
         key.kind == KernelKind::gemm_prefill && key.m_r == kInt8Rows2v;
}
// The 12-row tiles of 2-vector strips (BF16 pairs, int8).
inline bool rows2v_kernel(const KernelKey& key) {
  return bf16_pair_rows2v(key) || int8_rows2v(key);
}
// fp8 decode kernels of <= 4 rows at avx512_bf16 (variant kBf16Pairs; K and g_steps even): bf16
// activation pairs (rounded RNE by the caller), and the e4m3 bytes of k and k + 1 turned into
// the bf16 pair of their values (exact: e4m3 fits bf16) by two vpermi2b table lookups on the
// 7 magnitude bits and the sign or-ed in. Per scale group, per column, in pair order:
//   g = vdpbf16ps_lane(g, a_pair[p], w_pair[p]);  then  acc = fma(g, scale, acc)
// (decode_group_accumulate without the 2^8: these values are unscaled; full strips in the pair
// order, kFp8PairOrder, decode to value * 2^-8 and fold with scale * 2^8, the same products).
// The prefill ones (any rows, K and g_steps even) first decode each strip the same way into
// GemmArgs::scratch as bf16 pairs and run the bf16 pair microkernel over it, block after block,
// into the same group sums: the same numbers as the decode ones.
inline bool fp8_pair_kernel(const KernelKey& key) {
  return key.format == WeightFormat::fp8 && (key.variant & kBf16Pairs);
}
// AMX-BF16 kernels of fp8, mxfp4 and mxfp8 (isa amx, prefill): each strip is decoded into
// GemmArgs::scratch as bf16 k pairs ([k/2][column][2], K even), then run as AMX-BF16 tiles over
// bf16 activation rows (rounded RNE by the caller). The bf16 weight of (k, column):
//   fp8:  bf16(fp8_value(b)), exact; per K group (g_steps, the last one possibly shorter) the
//         TDPBF16PS chain starts at zero and is folded, acc = fma(g, scale, acc) (acc from +0);
//         y = (a_scale * w_scale) * acc.
//   mx:   the top 16 bits of the fp32 product value * scale (value as gemm_ref_mx reads it:
//         mx_e2m1 or mx_e4m3_scaled; scale = bits e << 23), exact unless the product is an fp32
//         subnormal, which TDPBF16PS reads as zero anyway; one chain over all of K; y = acc.
// The chains run in blocks of 16 pairs from each group's start, as the tile model computes
// TDPBF16PS (amx::tdpbf16ps_element).
// mxfp4 / mxfp8 prefill at avx512_bf16 (variant kMxPairs): each strip is decoded once into
// GemmArgs::scratch as bf16 k pairs, the same weights as amx_decoded_weight's below (the top 16
// bits of value * scale, exact unless an fp32 subnormal, which vdpbf16ps reads as zero anyway), by
// the strip-scratch kernels' decode; then 6-row blocks (and the rows left, GemmArgs::m_tail) of
// the bf16 pair microkernel over bf16 activation pairs (rounded RNE by the caller), one chain
// over all of K per lane: acc = vdpbf16ps_lane(acc, a_pair[p], w_pair[p]); y = acc.
inline bool mx_pair_kernel(const KernelKey& key) {
  return is_mx_format(key.format) && key.kind == KernelKind::gemm_prefill &&
         (key.variant & kMxPairs);
}
// mxfp8 decode tiles of <= 4 rows at avx512_bf16 (variant kMxPairs): the e4m3 bytes of k and
// k + 1 to the bf16 pair of their values by the fp8 pair decode's table lookups (fp8_pair_kernel:
// fp8_value, exact in bf16), then per 32-k group and column, over bf16 activation pairs (rounded
// RNE by the caller):
//   g = vdpbf16ps_lane(g, a_pair[p], w_pair[p]) over the group's 16 pairs (g from +0), then
//   acc = fma(g, f32_from_bits(e << 23) * 2^-8, acc)   (e: the stored exponent byte, e + 8 over
//                                                        the checkpoint's; the product exact)
// y = acc. The fp16 route's 12 vector instructions per 32 weights (widen, scale) held MXFP8 decode
// at about 55 % of the read bandwidth on a Zen 4.
inline bool mx8_pair_decode_kernel(const KernelKey& key) {
  return key.format == WeightFormat::mxfp8 && key.kind == KernelKind::gemm_decode &&
         (key.variant & kMxPairs);
}
inline bool amx_decoded_weight(const KernelKey& key) {
  return key.isa == IsaLevel::amx && key.kind == KernelKind::gemm_prefill &&
         (key.format == WeightFormat::fp8 || is_mx_format(key.format));
}
// fp8 / mxfp4 / mxfp8 prefill kernels at avx2, avx512 and avx512_vnni with variant
// kStripScratch: each strip is decoded once into GemmArgs::scratch, then every M block runs FMAs
// over the scratch with fp32 activations. The strip is decoded once for all of its M blocks
// instead of once per block.
//   fp8 (K and g_steps even): the scratch holds the fp16 bits of value * 2^-8 ([k][column], the
//        fp16 route, exact), widened by vcvtph2ps in the M blocks; per-group sums on the
//        decode_group_accumulate rule, g = fma(a[k], value * 2^-8, g) in k order, per group
//        acc = fma(g, scale * 2^8, acc) (the one-row decode tiles' numbers), the accumulators
//        held on the stack.
//   mx:  bf16 k pairs ([k/2][column][2]) of the top 16 bits of the fp32 product w' = value *
//        scale that the fp32 kernels multiply by (exact: <= 4 significant bits, unless w' is an
//        fp32 subnormal, i.e. a scale below about 2^-119, whose low bits go), read by the bf16
//        FMA microkernel; acc = fma(a[k], w', acc), y = acc.
inline bool strip_scratch_kernel(const KernelKey& key) {
  return (key.format == WeightFormat::fp8 || is_mx_format(key.format)) &&
         key.kind == KernelKind::gemm_prefill && (key.variant & kStripScratch);
}
// Prefill kernels that run GemmArgs::m_tail rows (0 .. m_r - 1) after their m_blocks blocks, as
// one short tile in the same call over the same strip: the strip-scratch kernels (over the strip
// they decoded) and the vdpbf16ps pair kernels at avx512_bf16 (bf16, fp8 pair prefill), whose
// callers would otherwise pad the last block with zero rows; and the int8 and int4 kernels of
// the AVX-512 VNNI levels (int_tail_prefetch_kernel). The AMX and NEON pair kernels keep whole
// blocks.
// int8 at avx512_vnni / avx512_bf16: the rows after the blocks ran as decode tiles over each L2
// chunk after its blocks, prefetching nothing, so DRAM idled through them (13 % of a Qwen3
// T = 256 layer). As the call's short tile they run strip by strip between the blocks, and in a
// call of fewer than 8 blocks every tile prefetches its rows' share of the next strip. int4
// (the same vpdpbusd tiles after a nibble unpack) likewise since 2026-11-28 (a thirty-sixth
// session): over Qwen3's matrices from DRAM (ktjit_kernel_bench, a Zen 5) 7-10 rows ran
// 1.04-1.12x faster, 12-26 rows 1.01-1.04x; Qwen3 INT4 layers with every expert at 7 / 8 / 10 /
// 16 rows 1.14-1.23 / 1.06-1.14 / 1.02-1.08 / 1.02-1.06x, and `kt-jit bench` at T = 128 / 256
// went from 71-74 / 81-84 % to 78-81 / 86-89 % of the vpdpbusd peak (three process pairs).
inline bool int_tail_prefetch_kernel(const KernelKey& key) {
  return (key.format == WeightFormat::int8 || key.format == WeightFormat::int4) &&
         key.kind == KernelKind::gemm_prefill &&
         (key.isa == IsaLevel::avx512_vnni || key.isa == IsaLevel::avx512_bf16);
}
// The int8 / int4 and vdpbf16ps pair kernels whose tiles prefetch their rows' shares of the next
// strip (jit/x64/gemm.cpp pf_var_) ask, in a call of M rows, for the first min(M, S) / S of it, S
// being the rows at which a strip's compute takes about as long as DRAM takes to stream it (this
// function; 0: the whole strip at any M). Below S a call is DRAM-bound and its tiles, computing
// faster than DRAM streams, asked for the strip faster than DRAM gave it, and such calls streamed
// 24-28 GB/s where 12 rows and the decode tiles streamed 31-33 (likely: prefetches this core had
// no room for were dropped and waited on as demand misses; this VM has no counters to show it).
// Asked for at DRAM's pace, the rest is left to the hardware prefetcher, which follows the reads.
// On a Zen 5 (family 26; vpdpbusd peak 1.05-1.1 Top/s and vdpbf16ps 0.52-0.56 TFLOP/s against
// 34-45 GB/s read by one core: int8 at 2 M and bf16 at M operations a weight byte, so S ~ 13-14
// for both) a 10-row int8 call over Qwen3's gate/up (ktjit_kernel_bench, weights from DRAM) ran
// 1.13-1.15x faster with S = 13, 8 rows 1.13-1.17x, 12 rows 0.98x, 14 and 16 the same; Qwen3
// layers at T = 160 (10 rows an expert) 1.06-1.07x (INT8) and 1.03-1.06x (BF16), at T = 256 the
// same (in-process A/Bs, 2026-11-28). Other CPUs keep the whole strip (not measured there).
constexpr int kPrefillStreamRowsZen5 = 13;
inline int prefill_stream_rows() {
  static const int rows = [] {
    const CpuFeatures& f = cpu_features();
    const bool amd = f.vendor == "AuthenticAMD" || f.vendor == "HygonGenuine";
    return amd && f.family >= 0x1a ? kPrefillStreamRowsZen5 : 0;
  }();
  return rows;
}
// The bytes of a strip that two K steps read, so the bytes a prefetch site (every second K step)
// asks for when a call asks for the whole next strip: 512 for int8 and the BF16 pairs; 256 for
// int4, whose K steps hold half the bytes. Until 2026-11-28 int4 asked for 512 too: each strip's
// sites asked for two strips, the next one and the one after, every line twice (Qwen3 INT4 layers
// with 256: T = 128 1.10-1.11x faster, T = 256 1.014x, in-process A/Bs on a Zen 5).
inline int64_t prefill_strip_site_bytes(const KernelKey& key) {
  // (2-vector strips: 256, a full strip's, also from a narrower tail strip, as 512 is at 4 vectors:
  // a tail strip's next strip is the next matrix's first, GemmArgs::pf_last)
  if (rows2v_kernel(key)) return 256;
  return key.format == WeightFormat::int4 ? 256 : 512;
}
// int4 streams half int8's bytes for the same multiplies, so its strips' compute meets DRAM at
// about half the rows: S = 7 for int4 on a Zen 5 (kPrefillStreamRowsZen5Int4). Its prefill calls
// start at 7 rows, so they ask for the whole next strip and never read ahead. Against S = 13
// (Qwen3 INT4 layers, in-process A/Bs, 2026-11-28): T = 128 1.023 / 1.025x, T = 256 1.013 /
// 1.020x, T = 1024 and DeepSeek-V3 T = 256 1.00x; S = 6 and 9 were 1.05x slower than 7 at
// T = 128, and with 256 bytes a site (below) S = 13 1.07x slower.
constexpr int kPrefillStreamRowsZen5Int4 = 7;
inline int prefill_stream_rows(const KernelKey& key) {
  const int s = prefill_stream_rows();
  return s > 0 && key.format == WeightFormat::int4 ? kPrefillStreamRowsZen5Int4 : s;
}
// What a call of S rows or more asks for at a site where S is set (a Zen 5): the strip's 512 bytes
// and 4 more, so that the tiles' strides are never whole lines. With 512, a call of 24 rows (four
// 6-row blocks, 128 bytes a site each: two lines) and one of 32 (96 bytes) streamed slower than
// their neighbours, the other row counts from 16 to 47 did not: Qwen3's down (N 2048, K 768,
// weights from DRAM, ktjit_kernel_bench) at 24 rows 81-84 % of the vpdpbusd peak against 87-91 % at
// 18-23 and 25-30. At 516 24 rows ran 1.10x faster (91 %), 32 rows 1.05x, gate/up (K 2048) at 24
// rows 1.02x, the rest within the noise; a Qwen3 INT8 layer at T = 384 with every expert at 24 rows
// 1.07x. 504 helped 24 rows as much, so it is the whole-line stride, not the rate; why, this VM
// cannot show (no counters). The pointer runs 4 / 512 ahead: a call's last site asks for 0.8 %
// of a strip past the strip it covers. Other CPUs keep 512 (not measured there).
constexpr int kPrefillWholeSiteBytesZen5 = 516;
// The bytes of the next strip a call of `rows` rows asks for at each prefetch site of a tile
// (every second K step): 512 (the strip's 8 lines a site; kPrefillWholeSiteBytesZen5 on a Zen 5),
// or less below prefill_stream_rows(key); int4 half of each, its K steps holding half the bytes
// (prefill_strip_site_bytes).
inline int64_t prefill_site_bytes(const KernelKey& key, int64_t rows) {
  const int64_t s = prefill_stream_rows(key), whole = prefill_strip_site_bytes(key);
  if (s == 0) return whole;
  return rows < s ? whole * rows / s : whole * kPrefillWholeSiteBytesZen5 / 512;
}
// A DRAM-bound int8 or BF16-pair call (fewer than prefill_read_ahead_rows() rows, below; the
// pf_var_ tiles of jit/x64/gemm.cpp) also reads ahead: each tile's K steps prefetch (prefetcht0)
// the strip it reads this many bytes further on, besides its share of the next strip. The share
// covers the first rows / S of the next strip and the hardware prefetcher had to find the rest
// alone, behind the first tile's reads: 8-12 rows streamed Qwen3's gate/up from DRAM at 30-33 GB/s,
// where the read probe gives 36-42. Reading 8192 bytes ahead (ktjit_kernel_bench): int8 8
// rows 1.07x (34.2 GB/s), 12 rows 1.06x; BF16 8 rows 1.12x, 12 rows 1.07x. Qwen3 layers (in-process
// A/Bs, a Zen 5, 2026-11-28): INT8 1.03-1.05x at T = 128, 1.02-1.03x at T = 192, 1.00x at T = 256;
// BF16 1.03-1.04x, 1.01-1.02x, 1.00-1.01x. For int8, the first tile of each strip alone: T = 128
// 1.02x; every call, DRAM-bound or not: T = 256 0.99x. 0 (none) where prefill_stream_rows() is 0
// (not measured there).
constexpr int kPrefillReadAheadZen5 = 8192;
inline int prefill_read_ahead_bytes() {
  return prefill_stream_rows() > 0 ? kPrefillReadAheadZen5 : 0;
}
// The rows below which a call reads ahead: S for BF16 pairs and int4 (whose calls never have
// fewer), S + 2 for int8. An int8 call of S or S + 1 rows asks for the whole next strip but
// computes it barely longer than DRAM streams it, and at 13 rows (S) ran slower than at 12 (Qwen3's
// gate/up from DRAM, ktjit_kernel_bench: 742-757 against 813 Gop/s; down 759-767 against 728).
// Reading ahead there too: 13 rows 1.12-1.15x (gate/up) and 1.09-1.14x (down), 14 rows 1.01-1.04x,
// 15 rows within 1 % either way, 16-17 rows 0.98-1.00x; Qwen3 INT8 layers at T = 224 and 256
// 0.98-1.01x of the time, 9 of 10 A/Bs below 1 (in-process, at the noise floor). BF16's pair tiles
// measured no better with it at T = 256 (1.002-1.005x the time) and keep S. (A Zen 5, 2026-11-28.)
constexpr int kPrefillReadAheadRowsOverSInt8 = 2;
inline int prefill_read_ahead_rows(const KernelKey& key) {
  const int s = prefill_stream_rows(key);
  return s > 0 && key.format == WeightFormat::int8 ? s + kPrefillReadAheadRowsOverSInt8 : s;
}
// qgroup at the AVX-512 levels likewise: its rows after the blocks ran as decode tiles, a
// separate call per L2 chunk that read each strip again from L3 (7.5 % of a Qwen3 Q4_K
// T = 256 layer's samples).
inline bool qgroup_tail_rows_kernel(const KernelKey& key) {
  return key.format == WeightFormat::qgroup && key.kind == KernelKind::gemm_prefill &&
         !isa_is_neon(key.isa) && int(key.isa) >= int(IsaLevel::avx512);
}
inline bool tail_rows_kernel(const KernelKey& key) {
  return strip_scratch_kernel(key) || int_tail_prefetch_kernel(key) ||
         qgroup_tail_rows_kernel(key) ||
         (key.isa == IsaLevel::avx512_bf16 && key.kind == KernelKind::gemm_prefill &&
          (bf16_pair_kernel(key) || fp8_pair_kernel(key) || mx_pair_kernel(key)));
}
// Of those, the int8 (and since 2026-11-28 int4) 6-row kernels of the VNNI levels take
// m_tail = m_r + 1 = 7 too, as a 4-row and a 3-row tile: a 1-row tile's K loop waits on L2 (4
// weight vectors a step feed only 4 vpdpbusd), so its row cost about two (7 rows ran at 82 % of the
// peak with the weights in cache, 8 rows at 97 %). Calls whose rows leave 1 after the blocks run
// one block fewer and those 7 rows (prefill_split). (qgroup's 3-row tiles as 2 + 2 measured no
// faster at T = 256.) The BF16 pair tiles (vdpbf16ps) likewise since 2026-11-28: over Qwen3's
// matrices from DRAM (ktjit_kernel_bench, a Zen 5) 7 rows 1.08x faster (gate/up and down), 19
// rows 1.05x, 13 rows 1.00-1.02x (DRAM-bound either way). int8 (and int4) also takes m_tail = m_r +
// 2 = 8, as two 4-row tiles, since 2026-11-28 (a thirty-fifth session): the 2-row tile after the
// blocks reads the strip back from L2 at 4 weight lines per 8 vpdpbusd. Over Qwen3's matrices from
// DRAM (ktjit_kernel_bench, a Zen 5; gate/up, down) 14 rows ran 1.03-1.05x faster, 8
// rows 1.02-1.08x, 20 1.01-1.03x, 26 and 32 0.99-1.02x; Qwen3 INT8 layers at T = 256 0.99x the
// time. Tails of 3 as 5 + 4 were no faster (15 rows 0.98-0.99x), nor BF16's pair tiles at 14 rows
// (0.96-0.99x; 20 rows 1.02-1.03x).
inline bool split_tail_kernel(const KernelKey& key) {
  const bool bf16_pairs = key.isa == IsaLevel::avx512_bf16 && bf16_pair_kernel(key);
  return ((int_tail_prefetch_kernel(key) || bf16_pairs) && key.m_r == 6) || rows2v_kernel(key);
}
// The most rows after the blocks that a split_tail_kernel runs with the last block as two tiles
// (m_tail = m_r + 1 .. m_r + this, prefill_split): 2 for int8 and int4, 1 for the BF16 pair
// tiles.
inline int split_tail_rows(const KernelKey& key) {
  if (!split_tail_kernel(key)) return 0;
  if (rows2v_kernel(key)) return key.m_r - 1;  // 13 .. 23 rows as two halves
  return int_tail_prefetch_kernel(key) ? 2 : 1;
}

// A prefill call over `rows` rows (the executor's, and the tests'): its m_blocks, and its m_tail
// where the kernel takes the rows after the blocks (else they are left to decode tiles).
struct PrefillSplit {
  int64_t blocks, tail;
};
inline PrefillSplit prefill_split(const KernelKey& key, int64_t rows) {
  PrefillSplit s{rows / key.m_r, tail_rows_kernel(key) ? rows % key.m_r : 0};
  if (s.blocks > 0 && s.tail >= 1 && s.tail <= split_tail_rows(key)) {
    --s.blocks;
    s.tail += key.m_r;
  }
  return s;
}
// Rows a kernel call computes: m_blocks blocks of m_r rows (prefill; tail_rows_kernel then m_tail
// more), or m_r (decode).
inline int64_t gemm_call_rows(const KernelKey& key, const GemmArgs& args) {
  if (key.kind != KernelKind::gemm_prefill) return key.m_r;
  return args.m_blocks * key.m_r + (tail_rows_kernel(key) ? args.m_tail : 0);
}
// Kernels that need GemmArgs::scratch (k4 * 32 * n_vec bytes) for the strip decoded to bf16
// pairs: fp8 and mx pair prefill and the AMX-BF16 kernels of decoded formats (and the strip-scratch
// kernels above, whose 16-bit values take as many bytes).
inline bool scratch_pair_kernel(const KernelKey& key) {
  return (fp8_pair_kernel(key) && key.kind == KernelKind::gemm_prefill) || mx_pair_kernel(key) ||
         amx_decoded_weight(key);
}
// AMX-INT8 kernels of int4 (isa amx, prefill): each strip's nibbles are decoded into
// GemmArgs::scratch as the int8 strip of the values 16 * q4 ([k4][column][4], exact), then run as
// the int8 ones (a + 128 activations, w_comp): gemm_ref's int4 numbers, bit for bit.
inline bool amx_int4_kernel(const KernelKey& key) {
  return key.isa == IsaLevel::amx && key.kind == KernelKind::gemm_prefill &&
         key.format == WeightFormat::int4;
}
// qgroup prefill kernels on zmm whose group ends build each scale (and bias) vector from the
// int8 sub-scales and the super block's fp32 factor, float(sub) * factor (kQGroupSuper without
// the fp32 super-block partials or the lane / int32 folds: Q4_K, Q5_K and Q2_K, whose biases keep
// them per group): in a call of two or more M blocks the first block's group ends store the
// vectors they build to GemmArgs::scratch ([group][scale, bias][vector] fp32, 1 or 2 x n_vec x
// 64 bytes a group), and the later blocks' group ends read them there. The same products in the
// same FMAs: the same bits. On Zen 4 the vmulps of those products shared the pipes of the tile's
// 96 vpdpbusd a group (docs/evidence/zen4_avx512.md, tools/coissue.cpp).
inline bool qgroup_scale_scratch_kernel(const KernelKey& key) {
  return key.format == WeightFormat::qgroup && key.kind == KernelKind::gemm_prefill &&
         !isa_is_neon(key.isa) && int(key.isa) >= int(IsaLevel::avx512) &&
         (key.variant & kQGroupSuper) &&
         !(key.variant & (kQGroupSuperSums | kQGroupLaneFold | kQGroupIntFold));
}
// Bytes of GemmArgs::scratch a kernel needs for `k4` K steps (0: it reads none). (qgroup scale
// scratch: at most k4 / 4 groups, G >= 16, of 2 x n_vec vectors.)
inline int64_t gemm_scratch_bytes(const KernelKey& key, int64_t k4) {
  if (amx_int4_kernel(key)) return k4 * 64 * key.n_vec;
  return scratch_pair_kernel(key) || strip_scratch_kernel(key) || qgroup_scale_scratch_kernel(key)
             ? k4 * 32 * key.n_vec
             : 0;
}
// Prefill kernels that take bf16 activation rows in whole blocks of m_r rows (the executor pads
// the last block, where the kernel does not run its last rows itself: tail_rows_kernel): bf16
// pair kernels, fp8 and mx pair prefill and the AMX kernels of decoded formats.
inline bool block_pair_kernel(const KernelKey& key) {
  return bf16_pair_kernel(key) || scratch_pair_kernel(key);
}
// One fp32 lane of vdpbf16ps (the SDM's pseudo-code; Zen 4 measured equal): the odd products
// first, then the even, each one fp32 rounding (a bf16 product is exact in fp32), with bf16 and
// fp32 subnormal inputs read as zero and subnormal results flushed to zero (sign kept).
// `a` and `b` hold the pair as two bf16, element 2p in the low half.
float vdpbf16ps_lane(float acc, uint32_t a, uint32_t b);
// One fp32 lane of AArch64 BFDOT (the Arm ARM's BFDotAdd with FEAT_EBF16 absent or FPCR.EBF 0;
// FPCR is ignored): prod = ro(ro(a0 * b0) + ro(a1 * b1)), result = ro(acc + prod), where ro
// rounds the exact value to fp32 with round to odd (truncate, then set the last bit if inexact),
// flushes results whose exact exponent is below -126 to zero (sign kept), overflows to infinity,
// and gives the default NaN (0x7fc00000) for any NaN; bf16 and fp32 subnormal inputs read as
// zero, and x + (-x) is +0. Checked against qemu 7.2's bfdotadd under -cpu max on 10 million
// random lanes (subnormals, cancellations, exponent gaps, inf/NaN): no mismatch.
// `a` and `b` hold the pair as two bf16, element 2p in the low half.
float bfdot_lane(float acc, uint32_t a, uint32_t b);
// qgroup: codes are stored (and the LUT passed) XOR 0x80 at this level, except the signed codes of
// kQGroupIntFold keys.
inline bool qgroup_flip_codes(IsaLevel isa) {
  return int8_activation_offset(isa);
}
// qgroup kOffsetCodes keys (kQGroupOffset): the offset c0 the table carries (0 or a power of two).
inline int qgroup_code_offset(const KernelKey& key) {
  const int s = (key.variant >> 4) & 0xf;
  return (key.variant & kQGroupOffset) && s ? 1 << (s - 1) : 0;
}
// The variant bits of offset codes with offset c0 (0 or a power of two up to 128).
inline uint8_t qgroup_offset_variant(int c0) {
  int s = 0;
  while (c0 >> s) ++s;
  return uint8_t(kQGroupOffset | s << 4);
}
// qgroup kQGroupF16 / kQGroupBf16 keys: their 16-bit scales, 1 fp16, 2 bf16 (0: none).
inline int qgroup_half_scales(const KernelKey& key) {
  return key.variant & kQGroupF16 ? 1 : key.variant & kQGroupBf16 ? 2 : 0;
}
// qgroup kQGroupI16 keys: the K steps an int16 lane sums before it is widened or folded into int32
// (formats::kQGroupI16Steps, or kQGroupByteLaneSteps for the byte codes' int16-lane folds).
int qgroup_lane_steps(const KernelKey& key);
// qgroup: whether the kernels read GemmArgs::a_gsum (the VNNI offset, the bias term, or the
// offset codes' c0 * s_g).
inline bool qgroup_needs_gsum(const KernelKey& key) {
  return (key.variant & kQGroupBias) ||
         (qgroup_flip_codes(key.isa) && !(key.variant & (kQGroupIntFold | kQGroupOffset))) ||
         qgroup_code_offset(key);
}

// Strips are 4 vectors of columns wide; a tail strip may hold fewer vectors.
constexpr int kStripVecs = 4;
// BF16 at avx512_bf16 packs strips of 2 vectors (32 columns) instead, since 2026-11-28 (a
// thirty-seventh session): its vdpbf16ps pair tiles then hold up to kBf16PairRows2v rows x 2
// vectors (24 accumulators), so a call of up to 12 rows reads each weight line once, in order, as
// a decode tile does, where 6-row blocks over 4-vector strips read each strip once per block, the
// first from DRAM, the others from L2 (tools/strip_stream.cpp: 93-96 % of the read probe at 7-12
// rows against 79-88 %), and the rows after the blocks run as two halves (split_tail_rows). Qwen3
// BF16 layers (in-process A/Bs on a Zen 5): T = 128 1.03-1.06x, T = 256 1.04-1.05x faster, T =
// 1024 1.00x, decode the same (with its one-row tiles' prefetch, decode_prefetch_bytes). Their
// code was 2.7x larger (452 against 170 KiB a Qwen3 layer) until the tail tiles were shared
// (jit/x64/gemm.cpp tail_tiles_shared: 203 KiB). KT_JIT_BF16_NARROW_STRIPS=0 keeps 4-vector strips
// (read when a layer is built).
// int8 at avx512_bf16 likewise since 2026-11-29 (a thirty-eighth session): 12-row x 2-vector
// vpdpbusd tiles (kInt8Rows2v; gemm_prefill_rows) and the decode tiles of 1-6 rows over the same
// strips. Qwen3 INT8 layers (in-process A/Bs on a Zen 5): T = 128 1.04x, T = 256 1.03-1.04x faster
// (2 threads 1.04x), T = 1024 1.00x, decode T = 1 / 4 the same (DeepSeek-V3 too). 282 KiB of
// code a Qwen3 layer against 222. KT_JIT_INT8_NARROW_STRIPS=0 keeps 4-vector strips. isa amx keeps
// 4 vectors for both (its AMX tiles read 64-column strips).
inline int strip_vecs_for(IsaLevel isa, WeightFormat fmt) {
  if (isa == IsaLevel::avx512_bf16 && fmt == WeightFormat::int8)
    return env_switch("KT_JIT_INT8_NARROW_STRIPS", true) ? 2 : kStripVecs;
  const bool narrow = isa == IsaLevel::avx512_bf16 && fmt == WeightFormat::bf16;
  return narrow && env_switch("KT_JIT_BF16_NARROW_STRIPS", true) ? 2 : kStripVecs;
}

// Register-tile rows the prefill kernel uses at each level (limited by the register file).
int gemm_max_rows(IsaLevel isa, WeightFormat fmt = WeightFormat::int8);
// Rows of the prefill tile of a layout of `strip_vecs` vectors: kInt8Rows2v for int8 over
// 2-vector strips at avx512_bf16, else gemm_max_rows.
inline int gemm_prefill_rows(IsaLevel isa, WeightFormat fmt, int strip_vecs) {
  return isa == IsaLevel::avx512_bf16 && fmt == WeightFormat::int8 && strip_vecs <= 2
             ? kInt8Rows2v
             : gemm_max_rows(isa, fmt);
}

// The value an fp8 (e4m3fn) byte decodes to in the kernels: exact for every finite code,
// subnormals included; 0x7f/0xff (NaN in e4m3fn) decode as +-480 (what their bits would mean).
// Built here from fp32 bits: magnitude bits to bits 26..20 plus an exponent bias of 120, and for
// e == 0 one more exponent step minus 2^-6 (exact). The kernels take the fp16 route instead (the
// byte's bits as fp16 = value * 2^-8, widened by vcvtph2ps, scale * 2^8), equal bit for bit; in
// neither does an fp32 subnormal reach an arithmetic instruction (a microcode assist on Intel).
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

// bf16 strips on the x86 and NEON levels hold k pairs, [k/2][column][2] (StripLayout kgroup 2: a
// vector of 16 columns x 2 k is one 64-byte load, vdpbf16ps's and tdpbf16ps's B operand as it is,
// and two fp32 vectors by one shift and one and; on NEON a 128-bit load is 4 columns x 2 k, bfdot's
// .8h operand as it is, and two fp32 vectors by shl #16 and bic); the reference level keeps
// [k][column]. args.k4 then counts k pairs (an odd K ends with a zero k).
inline int bf16_kgroup(IsaLevel isa) {
  return isa != IsaLevel::ref ? 2 : 1;
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
// The mx siluup epilogue for KernelKey::variant `v` (kSwigluClamp | kSwigluAlpha).
float swiglu_ref(float g, float u, uint8_t v, float limit, float alpha);

// The e2m1 value of a nibble (bit 3 = sign): 0, .5, 1, 1.5, 2, 3, 4, 6.
inline float mx_e2m1(uint8_t nib) {
  static constexpr float kMag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  return nib & 8 ? -kMag[nib & 7] : kMag[nib & 7];
}
// The value the mxfp8 kernels give an e4m3 byte before scaling: e4m3 * 2^-8 (fp16 bits
// sign << 15 | (b & 0x7f) << 7, widened exactly); 0x7f / 0xff (NaN in e4m3fn) give +-480 * 2^-8.
inline float mx_e4m3_scaled(uint8_t b) {
  return fp8_value(b) * 0.00390625f;  // exact: a power of two, no underflow (>= 2^-17)
}

}  // namespace ktjit
