// INT8 GEMM generator: a loop nest of small emit steps
//   strips -> [prefill: M blocks] -> K (4 bytes per step) -> dot4 microkernel -> epilogue.
// Accumulator lanes hold one output column each, summed over 4 k per step, on every ISA level:
//   avx512_vnni+: vpdpbusd (activation bytes flipped to unsigned, offset removed by w_comp)
//   avx512:       |a| * (w with a's sign) via vpmaddubsw, exact because |a|,|w| <= 127,
//                 then vpmaddwd with ones to int32
//   avx2:         the same with vpsignb on ymm.
// qgroup (k-group scaled codes, see gemm.hpp) runs the same strip / M-block / K nest with an
// outer group loop: int32 group accumulators beside the fp32 ones, the group's scales (and biases)
// read from the weight stream right after its codes, and a different dot product per level
// (signed activations x unsigned code + 128 with vpdpbusd; |code| x a·sign(code) with vpmaddubsw).
#include "jit/x64/gemm.hpp"

#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "formats/grouped.hpp"
#include "formats/mx.hpp"
#include "jit/gemm.hpp"
#include "jit/x64/generator.hpp"

namespace ktjit::x64 {

// How far ahead decode kernels prefetch their weight stream. 3072 bytes was the best of
// 0/1024/2048/3072 at DeepSeek-V3 T = 1 for MXFP4, FP8, BF16 and INT8 on a Xeon (2026-11-22). On
// AMD at avx2 (a Zen 3 VM, two sessions of alternating processes against adjacent read probes,
// docs/BENCHMARKS.md) the integer formats with the least work per byte, int8 and the qgroup
// (GGUF / RAWINT4 / GPTQ) kernels, streamed closer to the probe at 1536 (INT8, Q4_K, Q8_0), while
// FP8 and MXFP4 did worse there and BF16 and INT4 were split: so they take 1536, everything else
// 3072. On AMD at the AVX-512 levels (a Zen 4 VM, 2026-11-26, in-process A/B of layers generated
// with each distance, DeepSeek-V3 T = 1) no software prefetch beat the old defaults for every
// format (BF16 1.11x, Q6_K 1.24x, Q5_K 1.19x, Q8_0 1.09x, Q4_0 1.09x, FP8 1.07x, INT8 1.06x,
// INT4 1.06x, MXFP4 1.02x; 8192 was no better than those). The qgroup kernels of nibbles with
// super blocks and biases (Q4_K) ran 2.3x slower without and kept 8192 until the super blocks'
// header touch (k_loop_qgroup, 2026-11-27) closed the hole in their stream that the hardware
// prefetcher had stalled on; with it no prefetch beat 8192 by 1.15-1.23x (DeepSeek-V3 and Qwen3,
// T = 1 and 4). On a Zen 5 (family 26, 2026-11-27, alternating processes against adjacent read
// probes, docs/BENCHMARKS.md) the nibble streams (Q4_K and the other 4-bit qgroup codes, MXFP4,
// INT4) reached the probe only with a software prefetch: 4096 bytes ahead took Q4_K from 74-78 %
// to 92-96 % of it, MXFP4 from 69-79 % to 81-89 %, INT4 from 88-94 % to 90-97 % (Qwen3 and
// DeepSeek-V3, T = 1 and 4); FP8 ran 1.5-8 % faster 8192 bytes ahead (5 of 5 process pairs, Qwen3
// and DeepSeek-V3, T = 1 and 4), and MXFP8 (not measured then) streamed at only 38-49 % of the
// probes without, 78-85 % with 8192 (16384: 78-84 %; a twenty-eighth session); the other byte
// formats stayed without (INT8 98-100 % without, 94 % with it; BF16, Q6_K, Q8_0 the same either
// way). Those were one-row figures. Tiles of more rows compute longer per byte, and there the
// hardware prefetcher alone fell behind: on the Zen 5 (2026-11-28, ktjit_kernel_bench, Qwen3's
// matrices from DRAM, medians of 3 alternating rounds) int8 streamed gate/up at 36 / 35 / 33 GB/s
// with 4 / 5 / 6 rows and no prefetch against 39 / 40 / 39 at 8192, int4 at 37 / 36 / 33 with
// 4096 against 40 / 40 / 38, bf16 at 38 / 35 / 33 with 2 / 3 / 4 rows against 40 / 39 / 38 (down
// alike, DeepSeek-V3's gate/up too); 1-3 rows (int8, int4) and 1 row (bf16) gained nothing. So on
// a Zen 5 int8 and int4 tiles of >= 4 rows and bf16 tiles of >= 2 read 8192 bytes ahead
// (kDecodePrefetchZen5Rows): Qwen3 layers with every expert at 6 rows 1.12x (INT8) and 1.09x
// (INT4), at 4 rows 1.05x (INT4) and 1.07x (BF16); random routing at T = 64 1.04x (INT4) and
// 1.03x (BF16), INT8 at T = 96 1.015x (in-process A/Bs, docs/evidence/zen5_avx512.md). MXFP4's
// tiles, compute-bound at those rows, measured no gain (T = 64 1.00x). The qgroup tiles (<= 3
// rows) of byte codes likewise from 2 rows: Qwen3 GGUF layers at T = 24 / 48 (1.5 / 3 rows an
// expert) Q8_0 1.11 / 1.08-1.10x, Q5_K 1.11 / 1.13x, Q5_0 1.09x (T = 48) faster, but not Q6_K,
// whose fp32 super-block sums (kQGroupSuperSums) ran 1.00-1.05x slower with it; the nibble codes
// (4096) gained 0-4 % and keep it. KT_JIT_DECODE_PREFETCH=
// <bytes> (0 = none, a multiple of 64 up to 65536) overrides it for every kernel this process
// generates.
constexpr int kDecodePrefetch = 3072, kDecodePrefetchAmdInt = 1536, kDecodePrefetchZen5Nib = 4096,
              kDecodePrefetchZen5Fp8 = 8192, kDecodePrefetchZen5Rows = 8192,
              kDecodePrefetchZen5Bf16Narrow = 4096, kDecodePrefetchZen5Fp8Spread = 4096;
// The rows from which a Zen 5's int8 / int4, bf16 and qgroup byte-code decode tiles take
// kDecodePrefetchZen5Rows.
constexpr int kZen5RowsPrefetchIntMinRows = 4, kZen5RowsPrefetchBf16MinRows = 2,
              kZen5RowsPrefetchQGroupMinRows = 2;
// An AMD CPU of family 26 on (a Zen 5), where the decode prefetch was tuned apart.
static bool zen5_cpu() {
  static const bool zen5 = cpu_features().vendor == "AuthenticAMD" && cpu_features().family >= 0x1a;
  return zen5;
}
// On a Zen 5 the fp8 pair decode tiles (<= 4 rows) and the int8 / int4 tiles of
// kZen5RowsPrefetchIntMinRows rows or more ask for each K step's lines as the step starts, not
// for an unrolled loop's lines together at its end. The bunched prefetches held the one-row fp8
// tiles' stream to about 0.9x INT8's over the same bytes; with the decode removed (a load and two
// dots a line, timing only) dropping the prefetch made them 1.08x faster, so the bunch itself
// cost bandwidth. Spread, 4096 bytes ahead: Qwen3 FP8 at T = 1 0.93-0.95x the time of the bunched
// 8192; the int8 / int4 rows, still 8192 ahead, Qwen3 INT8 at T = 64 0.985x, INT4 at T = 32-64
// 0.975-0.986x (in-process A/Bs, docs/evidence/zen5_avx512.md, a forty-second session).
bool decode_prefetch_spread(const KernelKey& key) {
  if (!zen5_cpu() || key.kind != KernelKind::gemm_decode || vec_lanes(key.isa) != 16) return false;
  const bool int_rows = (key.format == WeightFormat::int8 || key.format == WeightFormat::int4) &&
                        key.m_r >= kZen5RowsPrefetchIntMinRows;
  return fp8_pair_kernel(key) || int_rows;
}
// The 12-row tiles over 2-vector strips (rows2v_kernel: int8 and the BF16 pairs) on a Zen 5 ask
// for their shares of the next strip into L1. Over Qwen3's matrices from DRAM (ktjit_kernel_bench,
// 3 alternating rounds) int8 down's 16-row calls ran 1.04-1.06x faster, its 8-row ones 1.08x,
// gate/up's 16 rows 1.01x, 24 rows 1.00-1.10x; Qwen3 INT8 layers (in-process A/Bs, AB / BA) T =
// 128 0.977 / 0.966x the time, T = 256 0.995 / 0.993x (2 threads 0.970 / 0.974x), T = 64 0.990 /
// 0.995x, T = 1024 the same; BF16 layers T = 128 0.990 / 0.991x, T = 256 0.996 / 0.993x (2
// threads 0.991 / 0.991x), T = 1024 0.995 / 0.997x. The int4, FP8 and qgroup tiles measured no
// gain that held (T = 256: INT4 0.995 / 0.994x, FP8 1.004 / 1.006x, Q4_K 0.945 / 0.999x with one
// order's first layer slow) and keep prefetcht1, as every tile does on other CPUs: a Zen 4 VM's
// 6-row blocks over 4-vector strips ran about 1.35x slower with prefetcht0 (2026-11-27).
bool prefill_share_l1(const KernelKey& key, bool zen5) {
  return zen5 && rows2v_kernel(key);
}
bool prefill_share_l1(const KernelKey& key) {
  return prefill_share_l1(key, zen5_cpu());
}

int decode_prefetch_bytes(const KernelKey& key) {
  static const int env_bytes = [] {
    const char* env = std::getenv("KT_JIT_DECODE_PREFETCH");
    if (!env || !*env) return -1;
    char* end = nullptr;
    const long v = std::strtol(env, &end, 10);
    if (*end || v < 0 || v > 65536 || v % 64)
      throw std::invalid_argument(std::string("KT_JIT_DECODE_PREFETCH: expected a byte count, a "
                                              "multiple of 64 in [0, 65536], got '") +
                                  env + "'");
    return int(v);
  }();
  if (env_bytes >= 0) return env_bytes;
  static const bool amd =
      cpu_features().vendor == "AuthenticAMD" || cpu_features().vendor == "HygonGenuine";
  const WeightFormat fmt = key.format;
  if (amd && vec_lanes(key.isa) == 16) {
    if (!zen5_cpu()) return 0;
    const bool nibbles = fmt == WeightFormat::int4 || fmt == WeightFormat::mxfp4 ||
                         (fmt == WeightFormat::qgroup && (key.variant & kQGroupNibbles));
    const bool e4m3 = fmt == WeightFormat::fp8 || fmt == WeightFormat::mxfp8;
    const bool int_rows = (fmt == WeightFormat::int8 || fmt == WeightFormat::int4) &&
                          key.m_r >= kZen5RowsPrefetchIntMinRows;
    const bool bf16_rows = fmt == WeightFormat::bf16 && key.m_r >= kZen5RowsPrefetchBf16MinRows;
    const bool qgroup_rows = fmt == WeightFormat::qgroup && !nibbles &&
                             !(key.variant & kQGroupSuperSums) &&
                             key.m_r >= kZen5RowsPrefetchQGroupMinRows;
    if (int_rows || bf16_rows || qgroup_rows) return kDecodePrefetchZen5Rows;
    // bf16's one-row tiles over the 2-vector strips of strip_vecs_for: DeepSeek-V3 BF16 at T = 1
    // ran 1.015-1.028x slower than over 4-vector strips without a prefetch, 0.986-0.996x with 4096
    // bytes, 1.03-1.06x with 8192 (in-process A/Bs on a Zen 5).
    if (fmt == WeightFormat::bf16 && key.n_vec <= 2) return kDecodePrefetchZen5Bf16Narrow;
    if (e4m3)
      return decode_prefetch_spread(key) ? kDecodePrefetchZen5Fp8Spread : kDecodePrefetchZen5Fp8;
    return nibbles ? kDecodePrefetchZen5Nib : 0;
  }
  const bool lean_int = fmt == WeightFormat::int8 || fmt == WeightFormat::qgroup;
  return amd && lean_int ? kDecodePrefetchAmdInt : kDecodePrefetch;
}

namespace {

using namespace Xbyak;
using namespace Xbyak::util;

class GemmGenerator : public JitGenerator {
 public:
  // Up to 128 KiB of code: a prefill kernel holds a tile for each way its blocks prefetch and
  // for every tail size (the int8 siluup kernels at the VNNI levels pass 64 KiB; the 12-row
  // kernels of rows2v_kernel, with 11 tail sizes and 11 splits, 68-128 KB with their tail tiles
  // shared, about 340 KB before: 512). Only one tile's K loop
  // runs at a time, so the size costs no instruction-cache misses in the loops.
  explicit GemmGenerator(const KernelKey& key)
      : JitGenerator(key.isa, rows2v_kernel(key) ? 512 * 1024 : 128 * 1024),
        key_(key),
        lanes_(vec_lanes(key.isa)),
        nv_(key.n_vec),
        mr_(key.m_r),
        vnni_(int(key.isa) >= int(IsaLevel::avx512_vnni)),
        int4_(key.format == WeightFormat::int4),
        i4w_(int4_int16_sums(key.isa, key.format)),
        bf16_(key.format == WeightFormat::bf16),
        pairs_(bf16_ && (key.variant & kBf16Pairs)),
        fp8_(key.format == WeightFormat::fp8),
        fp8p_(fp8_pair_kernel(key)),
        mxp_(mx_pair_kernel(key)),
        sfma_(strip_scratch_kernel(key)),
        prefill_(key.kind == KernelKind::gemm_prefill),
        mx8d_(mx8_pair_decode_kernel(key)),
        fp8po_(fp8_ && (key.variant & kFp8PairOrder)),
        pf_spread_(decode_prefetch_spread(key)),
        qg_(key.format == WeightFormat::qgroup),
        qg4_(qg_ && (key.variant & kQGroupNibbles)),
        qgb_(qg_ && (key.variant & kQGroupBias)),
        qgo_(qg_ && (key.variant & kQGroupOffset)),
        qgs_(qg_ && (key.variant & kQGroupSuper)),
        qgh_(qg_ ? qgroup_half_scales(key) : 0),
        qgs2_(qg_ && key.isa == IsaLevel::avx2 && key.m_r > 1),
        qgw_(qg_ && (key.variant & kQGroupI16)),
        qgi_(qg_ && (key.variant & kQGroupIdentity)),
        qgf_(qg_ && (key.variant & kQGroupIntFold)),
        qgf32_(qgf_ && !vnni_),
        qgl_(qg_ && (key.variant & kQGroupLaneFold)),
        qgp_(qg_ && (key.variant & kQGroupSuperSums)),
        qglb_(qgl_ && !qg4_),
        qss_(qgroup_scale_scratch_kernel(key)),
        qc0_(qgroup_code_offset(key)),
        gsum_(qg_ && qgroup_needs_gsum(key)),
        nib_(int4_ || qg4_),
        mx4_(key.format == WeightFormat::mxfp4),
        mx8_(key.format == WeightFormat::mxfp8),
        mx_(mx4_ || mx8_),
        gacc_(decode_group_accumulate(key) || fp8p_ || (sfma_ && fp8_)),
        i16_(mx_int16_activations(key)),
        fp8dw_(fp8_dword_decode(key)),
        sv_(key.n_vec),
        half_(half_strip_kernel(key)) {
    if (key.format != WeightFormat::int8 && key.format != WeightFormat::int4 &&
        key.format != WeightFormat::bf16 && key.format != WeightFormat::fp8 && !qg_ && !mx_)
      throw std::invalid_argument(
          "gemm: weight format must be int8, int4, bf16, fp8, qgroup, mxfp4 or mxfp8");
    if (mx_ && ((key.variant & ~(kSwigluClamp | kSwigluAlpha | kStripScratch | kMxPairs)) ||
                ((key.variant & ~(kStripScratch | kMxPairs)) && key.epilogue != Epilogue::siluup)))
      throw std::invalid_argument("gemm: mx variant bits are siluup SwiGLU options: " +
                                  key.describe());
    if (bf16_ && (key.variant & ~kBf16Pairs))
      throw std::invalid_argument("gemm: unknown bf16 variant bits: " + key.describe());
    if (pairs_ &&
        (key.kind != KernelKind::gemm_prefill || int(key.isa) < int(IsaLevel::avx512_bf16)))
      throw std::invalid_argument(
          "gemm: bf16 pair kernels (vdpbf16ps) are prefill kernels at "
          "avx512_bf16: " +
          key.describe());
    if (fp8_ && (key.variant & ~(kBf16Pairs | kStripScratch | kFp8Fp32Widen | kFp8PairOrder)))
      throw std::invalid_argument("gemm: unknown fp8 variant bits: " + key.describe());
    if (fp8dw_ && (key.isa != IsaLevel::avx2 || !decode_group_accumulate(key) ||
                   (key.variant & ~kFp8Fp32Widen)))
      throw std::invalid_argument("gemm: the fp32-domain fp8 widen is for 1-2 row avx2 decode: " +
                                  key.describe());
    if ((key.variant & kStripScratch) && !qg_ &&
        (!(fp8_ || mx_) || key.kind != KernelKind::gemm_prefill ||
         (fp8_ && (key.variant & kBf16Pairs)) || key.isa == IsaLevel::avx512_bf16))
      throw std::invalid_argument(
          "gemm: strip-scratch kernels are fp8 / mx prefill below avx512_bf16: " + key.describe());
    if ((key.variant & kMxPairs) && mx_ &&
        (!(mxp_ || (mx8d_ && key.m_r <= kFp8PairMaxRows)) || key.isa != IsaLevel::avx512_bf16 ||
         (key.variant & kStripScratch)))
      throw std::invalid_argument(
          "gemm: mx pair kernels (vdpbf16ps) are prefill, or mxfp8 decode of <= 4 rows, at "
          "avx512_bf16: " +
          key.describe());
    if (fp8po_ && !fp8p_)
      throw std::invalid_argument("gemm: the fp8 pair order is for the pair kernels: " +
                                  key.describe());
    if (fp8p_ && (key.isa != IsaLevel::avx512_bf16 ||
                  (key.kind == KernelKind::gemm_decode && key.m_r > kFp8PairMaxRows)))
      throw std::invalid_argument(
          "gemm: fp8 pair kernels (vdpbf16ps) are at avx512_bf16, decode ones of <= 4 rows: " +
          key.describe());
    if (qg_ &&
        ((key.variant & ~(kQGroupNibbles | kQGroupBias | kQGroupOffset | kQGroupSuper | 0xf0 |
                          kQGroupF16 | kQGroupBf16 | kQGroupI16 | kQGroupIdentity | kQGroupIntFold |
                          kQGroupLaneFold | kQGroupSuperSums | kHalfStrips)) ||
         ((key.variant & 0xf0) && !qgo_) ||
         __builtin_popcount(key.variant & (kQGroupSuper | kQGroupF16 | kQGroupBf16)) > 1))
      throw std::invalid_argument("gemm: unknown qgroup variant bits: " + key.describe());
    if (qgo_ && ((vnni_ && qc0_ != 0 && !qgi_) || qc0_ > 128))
      throw std::invalid_argument(
          "gemm: offset codes take an offset <= 128, at the VNNI levels none or an identity "
          "nibble table: " +
          key.describe());
    if (qgw_ && (!qgo_ || vnni_))
      throw std::invalid_argument(
          "gemm: int16 group sums are for offset codes below the VNNI levels: " + key.describe());
    if (qgl_ && (key.isa != IsaLevel::avx2 || !qgs_ || (qg4_ && !qgi_) || !qgo_ || qc0_ != 0 ||
                 !qgw_ || qgf_))
      throw std::invalid_argument(
          "gemm: int16-lane super-block folds are avx2 kernels of two-level byte or identity "
          "nibble codes without an offset, with int16 group sums: " +
          key.describe());
    if (qgf_ &&
        ((key.isa != IsaLevel::avx2 && !(vnni_ && qgp_)) || !qgs_ || qgb_ || qg4_ || qgo_ || qgw_))
      throw std::invalid_argument(
          "gemm: int32 super-block folds are avx2 kernels (or, signed codes, VNNI-level fp32 "
          "super-block partials) of two-level byte codes without a bias or offset: " +
          key.describe());
    if (qgp_ && (!vnni_ || !qgs_ || qgb_ || qgw_ || qgl_))
      throw std::invalid_argument(
          "gemm: fp32 super-block partials are VNNI-level kernels of two-level scales without a "
          "bias: " +
          key.describe());
    if (qgi_ && !(qgo_ && qg4_))
      throw std::invalid_argument("gemm: the identity table is for offset nibble codes: " +
                                  key.describe());
    if (key.isa == IsaLevel::ref || key.isa == IsaLevel::amx)
      throw std::invalid_argument("gemm: no x86 vector generator for isa " +
                                  std::string(isa_name(key.isa)));
    if ((key.variant & kHalfStrips) && (!half_ || !prefill_ || mr_ != half_strip_rows(key.isa)))
      throw std::invalid_argument(
          "gemm: half-strip tiles are prefill tiles of " + std::to_string(kHalfStripRows) +
          " rows for int4 and the qgroup kernels of half_strip_format at avx2, of " +
          std::to_string(kHalfStripRowsVnni) +
          " for those of half_strip_vnni_format at the VNNI levels: " + key.describe());
    // strip-scratch kernels run the bf16 microkernel, so they take its tile
    const int max_rows = half_ ? half_strip_rows(key.isa)
                         : key.isa == IsaLevel::avx512_bf16 && bf16_pair_kernel(key) && sv_ <= 2
                             ? kBf16PairRows2v  // (2-vector strips: strip_vecs_for)
                         : prefill_ && key.format == WeightFormat::int8
                             ? gemm_prefill_rows(key.isa, key.format, sv_)  // (12 over 2 vectors)
                             : gemm_max_rows(key.isa, sfma_ ? WeightFormat::bf16 : key.format);
    if (nv_ < 1 || nv_ > kStripVecs || mr_ < 1 || mr_ > max_rows)
      throw std::invalid_argument("gemm: tile out of range: " + key.describe());
    if (key.epilogue == Epilogue::siluup && nv_ % 2)
      throw std::invalid_argument("gemm: siluup needs an even number of vectors");
    if (half_) nv_ = std::min(2, sv_);  // the widest pass (the stack slots)
    generate();
  }

 private:
  // ---- register roles -------------------------------------------------------------------
  const Reg64 reg_args = rdi;
  const Reg64 reg_w = rsi;  // weight stream
  const Reg64 reg_a = r8;   // rows 0..2 of the current block, advanced along K
  const Reg64 reg_a3 = r9;  // rows 3..5
  const Reg64 reg_lda = r10;
  const Reg64 reg_k = r11;       // K-step counter
  const Reg64 reg_row = rbx;     // first row of the current block
  const Reg64 reg_wscale = r12;  // strip's scales
  const Reg64 reg_comp = r13;    // strip's compensation
  const Reg64 reg_col = r14;     // strip's first output column, in bytes
  const Reg64 reg_mb = r15;      // M-block counter (prefill)
  const Reg64 reg_strip = rbp;   // strip start (prefill re-reads it per block)
  const Reg64 reg_tmp = rax;
  const Reg64 reg_tmp2 = rdx;
  const Reg64 reg_pf = rcx;  // prefill: next line of the next strip to prefetch
  // stack: [rsp] strips left

  int acc_idx(int m, int v) const { return m * nv_ + v; }
  Xmm acc(int m, int v) const { return vreg(acc_idx(m, v)); }
  // Scratch for the K loop lives above the accumulators.
  Xmm wreg(int v) const { return vreg(num_vregs() - 8 + v); }  // zmm only: 24..27
  Xmm bcast() const { return vreg(num_vregs() - 4); }          // broadcast activation
  Xmm aux() const { return vreg(num_vregs() - 3); }            // sign or mask of activation
  // Two temporaries on zmm (the second takes wreg(3)'s slot, unused without VNNI), one on ymm.
  Xmm tmp(int i) const { return vreg(zmm_isa() && (i & 1) ? num_vregs() - 5 : num_vregs() - 2); }
  Xmm ones16() const { return vreg(num_vregs() - 1); }

  int strip_cols() const { return sv_ * lanes_; }
  int strip_k4_bytes() const { return strip_cols() * 4; }
  // Weight bytes per K step: 4-bit strips hold two steps per strip_k4_bytes() block.
  // bf16 strips hold a k pair per step, 4 bytes per column. fp8 pair kernels step by k pairs.
  int step_bytes() const {
    return fp8p_          ? 2 * strip_cols()
           : fp8_ || mx8_ ? strip_cols()
           : mx4_         ? strip_cols() / 2
           : bf16_        ? strip_cols() * 4  // a k pair (bf16_kgroup 2)
           : nib_         ? strip_k4_bytes() / 2
                          : strip_k4_bytes();
  }
  // qgroup: bytes after each group's codes (fp32 scales, then fp32 biases, one per column; with
  // two-level scales int8 sub-scales and sub-biases), and of a super block's header (fp32 factors).
  int qg_extra_bytes() const { return strip_cols() * qg_elem_bytes() * (qgb_ ? 2 : 1); }
  // bytes of one group scale (or bias) per column: int8 sub-scale, fp16 / bf16 or fp32
  int qg_elem_bytes() const { return qgs_ ? 1 : qgh_ ? 2 : 4; }
  int qg_header_bytes() const {
    return strip_cols() * 4 * (qgb_ ? 2 : 1) + (qgf_ ? strip_cols() * 4 : 0);
  }
  // Bytes of one strip into `r` (the next strip starts there).
  void strip_bytes_to(const Reg64& r) {
    if (mx_) {  // per group: one exponent byte per column, then the group's weights
      mov(r, arg(offsetof(GemmArgs, g_steps)));
      imul(r, r, step_bytes());
      add(r, strip_cols());
      imul(r, arg(offsetof(GemmArgs, g_per_strip)));
      return;
    }
    if (qg_) {
      mov(r, arg(offsetof(GemmArgs, g_steps)));
      imul(r, r, step_bytes());
      add(r, qg_extra_bytes());
      if (qgs_) {  // super blocks: their groups, then the header
        imul(r, arg(offsetof(GemmArgs, g_per_super)));
        add(r, qg_header_bytes());
        imul(r, arg(offsetof(GemmArgs, s_per_strip)));
      } else {
        imul(r, arg(offsetof(GemmArgs, g_per_strip)));
      }
    } else {
      mov(r, arg(offsetof(GemmArgs, k4)));
      imul(r, r, fp8p_ ? strip_cols() : step_bytes());  // fp8 pair steps are two K steps
    }
  }
  // qgroup registers: the row block's a_gsum entry of the current group, and groups left.
  const Reg64 reg_gsum = r12;  // (reg_wscale: qgroup scales live in the weight stream)
  const Reg64 reg_gc = r13;    // (reg_comp: no per-column compensation)
  // two-level scales: the current super block's header, and its groups left (free in the loop)
  const Reg64 reg_sb = rax;
  const Reg64 reg_sg = rdx;
  // qgroup vector registers: fp32 accumulators are acc(m, v) (the epilogues' inputs), the int32
  // group accumulators follow them; scratch sits at the top of the register file.
  Xmm qacc(int m, int v) const { return qgs2_ ? acc(m, v) : vreg(mr_ * nv_ + m * nv_ + v); }
  //   VNNI (zmm 24..31): 4 code vectors, broadcast, LUT, 0x0F mask, temporary.
  //   avx512 (zmm 16..27): 4 |code| vectors, broadcast, negated broadcast, 2 temporaries, LUT,
  //     0x0F mask, zero, 16-bit ones; code signs in k1..k4.
  //   avx2 (ymm 8..15): broadcast, ones, LUT, 0x0F mask, 2 x (codes, signed activations).
  Xmm qw(int v) const {
    return vnni_ ? vreg(24 + v) : zmm_isa() ? vreg(16 + v) : vreg(12 + (v & 1));
  }
  Xmm qs(int v) const { return vreg(14 + (v & 1)); }  // avx2: a·sign(code)
  Xmm qbcast() const { return vnni_ ? vreg(28) : zmm_isa() ? vreg(20) : vreg(8); }
  Xmm qneg() const { return vreg(21); }
  Xmm qtmp(int i) const { return vnni_ ? vreg(31) : zmm_isa() ? vreg(22 + (i & 1)) : qs(i); }
  // avx2 half-strip tiles: rows 2 and 3 broadcast into ymm 9 and 10, so a table moves to ymm 11
  // and the nibble mask and the ones come from memory (qmask_in_memory, widen_lanes).
  Xmm qlut() const { return vnni_ ? vreg(29) : zmm_isa() ? vreg(24) : half_ ? vreg(11) : vreg(10); }
  Xmm qmask() const { return vnni_ ? vreg(30) : zmm_isa() ? vreg(25) : vreg(11); }
  bool qmask_in_memory() const { return half_ && qg4_ && !qgi_; }
  Xmm qzero() const { return vreg(26); }
  Xmm qones() const { return zmm_isa() ? vreg(27) : vreg(9); }
  // d = vpmaddwd(s, 16-bit ones): the lanes' widening, with qones(), or the ones from memory in
  // half-strip tiles, whose third row's broadcast takes ymm 9.
  void widen_lanes(const Xmm& d, const Xmm& s) {
    if (half_)
      vpmaddwd(d, s, cpool(c_ones16_));
    else
      vpmaddwd(d, s, qones());
  }
  // fp8: the group scale table walks with rax through the K loop; rdx counts a group's steps.
  const Reg64 reg_gs = rax;
  const Reg64 reg_gk = rdx;
  // a group's record in the fp8 scale table: two halves' scales, then with the pair order the
  // group's step flags (formats::StripLayout::gscale_floats_per_group)
  int gs_strip_bytes_per_group() const {
    return int(formats::fp8_gscale_group_floats(fp8po_, lanes_)) * 4;
  }
  // fp8 full strips in the pair order (formats::fp8_strip_byte): decoded as words, the values
  // * 2^-8 (the group scales * 2^8)
  bool fp8w() const { return fp8po_ && sv_ == kStripVecs; }
  bool fp8_fast_ = false;  // fp8w: this step has no zero-exponent code (shift decode)
  // bf16: one broadcast activation per row of the tile, above the accumulators.
  Xmm row_bcast(int m) const { return vreg(zmm_isa() ? 24 + m : 12 + m); }
  Xmm bf16_tmp(int v) const { return vreg(zmm_isa() ? 30 + (v & 1) : 15); }
  int out_cols() const { return gemm_strip_out_cols(key_.isa, sv_, key_.epilogue); }

  Address arg(size_t off) const { return qword[reg_args + off]; }
  // Rows 6..11 (the BF16 pair tiles of 2-vector strips): rax and rdx, free in their K loop (the
  // tile's start and its epilogue use them as scratch around it).
  const Reg64 reg_a6 = rax;
  const Reg64 reg_a9 = rdx;
  RegExp a_row(int m) const {
    const Reg64& base = m < 3 ? reg_a : m < 6 ? reg_a3 : m < 9 ? reg_a6 : reg_a9;
    switch (m % 3) {
      case 0: return RegExp(base);
      case 1: return base + reg_lda;
      default: return base + reg_lda * 2;
    }
  }
  Address vmem(const RegExp& e) const { return zmm_isa() ? zword[e] : yword[e]; }
  Address cpool(Label& l) const { return zmm_isa() ? zword[rip + l] : yword[rip + l]; }

  // ---- loop nest --------------------------------------------------------------------------
  void generate() {
    const int stack = mx_    ? kMxAccStack + (mx_stack_acc() ? mr_ * nv_ * vec_bytes() : 0)
                      : fp8_ ? kFp8AccStack + (fp8_stack_acc() ? mr_ * nv_ * 64 : 0)
                      : qg_  ? qf_scale_slot(nv_) + (qgw_ || qgp_ ? mr_ * nv_ * vec_bytes() : 0) +
                                  (qgl_ && qgb_ ? formats::kQGroupLaneMaxGroups * 32 : 0)
                      : i4w_ ? kI4AccStack + mr_ * nv_ * vec_bytes()
                             : 16;
    rounds_stack_ = stack;
    const int rounds = rounds_kernel() ? kRoundScalars + kRoundRows * nv_ * 64 + 64 : 0;
    pf_slot_ = stack + rounds;  // pf_var_kernel: the call's rows, a tile's stride, the units a site
    preamble(pf_slot_ + (pf_var_kernel() ? 32 : 0));
    load_params();
    if (rounds_kernel()) {  // the rows' accumulator slots, 64-byte aligned
      lea(reg_tmp, ptr[rsp + rounds_stack_ + kRoundScalars + 63]);
      and_(reg_tmp, -64);
      mov(qword[rsp + rounds_stack_ + kRoundSlots], reg_tmp);
    }
    if (pf_var_kernel()) {  // the call's rows, for pf_var_stride
      call_rows(reg_tmp);
      mov(qword[rsp + pf_slot_], reg_tmp);
      if (qg_)
        qg_pf_var_setup();
      else
        pf_site_bytes_setup();
    }
    Label strip_loop, done;
    mov(reg_tmp, arg(offsetof(GemmArgs, n_strips)));
    test(reg_tmp, reg_tmp);
    jle(done, T_NEAR);
    mov(qword[rsp], reg_tmp);
    L(strip_loop);
    {
      mov(reg_strip, reg_w);
      prefetch_next_scales();
      if (scratch_pairs()) {  // the strip decoded into the scratch once, for every block
        mov(reg_pf, arg(offsetof(GemmArgs, scratch)));
        mov(reg_tmp2, reg_strip);
        mov(reg_tmp, arg(offsetof(GemmArgs, k4)));
        shr(reg_tmp, 1);
        // (fused_first kernels decode in their first block, or in the tail tile of a call
        // without blocks, instead)
        if ((sfma_ || mxp_) && mx_ && !fused_first())
          mx_fma_repack();
        else if (sfma_)
          fp8_fma_repack();
        else if (!fused_first())
          fp8_pair_repack();
      }
      if (prefill_) {
        Label mb_done, strip_done;
        xor_(reg_row.cvt32(), reg_row.cvt32());
        // The first pf_blocks blocks each prefetch their share of the next strip into L2 (one
        // line per two K steps: an eighth of it, below DRAM speed), so the next strip's DRAM
        // stream overlaps this strip's compute; later blocks only re-read this strip from L2.
        // Pair kernels pull more lines a step (microkernel_pairs, microkernel_sfma).
        const int pf_blocks = pairs_                   ? kPairPrefetchBlocks
                              : fp8p_ || mxp_ || sfma_ ? 1
                              : half_                  ? kPrefetchBlocks / 2  // two passes a block
                              : int8_rows2v(key_)      ? kPrefetchBlocks / 2  // 2-vector strips
                                                       : kPrefetchBlocks;
        // The vdpbf16ps pair kernels that take their tail rows prefetch from every tile
        // (pf_var_): blocks 0-1 taking half each asked for the strip faster than DRAM gave it
        // (a Qwen3 BF16 layer on a Zen 5 ran 1.12-1.14x faster at T = 256, 1.06-1.08x at 1024).
        const bool pair_var = pairs_ && pf_var_kernel();
        strip_bytes_to(reg_pf);
        add(reg_pf, reg_strip);
        {  // the call's last strip prefetches GemmArgs::pf_last where the caller gave one
          Label keep;
          cmp(qword[rsp], 1);
          jne(keep, T_NEAR);
          mov(reg_tmp, arg(offsetof(GemmArgs, pf_last)));
          test(reg_tmp, reg_tmp);
          jz(keep, T_NEAR);
          mov(reg_pf, reg_tmp);
          L(keep);
        }
        Label blocks;
        if (rounds_kernel()) {  // calls of 1 .. kRoundBlocks blocks: group by group
          mov(reg_mb, arg(offsetof(GemmArgs, m_blocks)));
          cmp(reg_mb, 1);
          jl(blocks, T_NEAR);
          cmp(reg_mb, kRoundBlocks);
          jg(blocks, T_NEAR);
          strip_rounds();
          jmp(strip_done, T_NEAR);
        }
        L(blocks);
        mov(reg_mb, arg(offsetof(GemmArgs, m_blocks)));
        test(reg_mb, reg_mb);
        jle(mb_done, T_NEAR);  // (reg_pf set for a fused tail tile)
        if (pf_blocks > kFewPrefetchBlocks) {
          // A call of fewer blocks (e.g. 16 rows: two 6-row blocks) would leave most of the
          // next strip to demand misses: its first kFewPrefetchBlocks blocks prefetch
          // pf_blocks / kFewPrefetchBlocks lines at each site instead, the whole strip (int8 at
          // the VNNI levels and qgroup at the AVX-512 levels: every tile its share, below).
          Label many, after;
          cmp(reg_mb, pf_blocks);
          jge(many, T_NEAR);
          auto old_rule = [&] {
            pf_lines_ = pf_blocks / kFewPrefetchBlocks;
            block_loop(kFewPrefetchBlocks);
            pf_lines_ = 1;
          };
          if (pf_var_kernel()) {
            // Every block and the tail tiles prefetch, each its rows' share of the next strip
            // (pf_var_stride), so the strip is asked for at the rate it is computed. Before
            // (until a twenty-seventh session, 2026-11-27) blocks 0-1 took half each, asking
            // for it faster than DRAM gave it and then stalling on it: 16 rows streamed at
            // 62-73 % of the peak on a Zen 5, with this 86-93 %. qgroup likewise (a
            // twenty-eighth session: Qwen3 GGUF layers at T = 256 1.12-1.36x faster).
            Label old;
            if (qg_) {  // (a site's share of the strip more than it touches: the old rule)
              cmp(qword[rsp + pf_slot_ + 16], 0);
              je(old, T_NEAR);
            }
            pf_var_ = true;
            // (fewer than pf_blocks here: each prefetches)
            with_read_ahead([&] { block_loop(kAllBlocks); });
            pf_var_ = false;
            if (qg_) {
              jmp(after, T_NEAR);
              L(old);
              old_rule();
            }
          } else {
            old_rule();
          }
          jmp(after, T_NEAR);
          L(many);
          // (full-strip int4 tiles: half of them, its K steps holding half the bytes; with 8 the
          // blocks asked for the strip after the next too: prefill_strip_site_bytes. The same
          // time at T = 1024 and 4096, Qwen3 INT4 layers, in-process A/Bs on a Zen 5.)
          block_loop(int4_ && !half_ ? pf_blocks / 2 : pf_blocks);
          L(after);
        } else if (pair_var) {  // every block its share, whatever the call's rows
          pf_var_ = true;
          with_read_ahead([&] { block_loop(kAllBlocks); });
          pf_var_ = false;
        } else {
          block_loop(pf_blocks);
        }
        L(mb_done);
        if (tail_rows_kernel(key_)) {
          if (pair_var) {
            pf_var_ = true;
            with_read_ahead([&] { tail_rows(true); });
            pf_var_ = false;
          } else if (pf_var_kernel()) {
            // After fewer than pf_blocks blocks (or none: a 7-row call) the tail tiles
            // prefetch their share of the next strip, as the blocks did (pf_var_stride).
            Label no_pf, tail_done;
            cmp(reg_row, pf_blocks * mr_);
            jge(no_pf, T_NEAR);
            if (qg_) {  // (the old rule: the blocks took it all)
              cmp(qword[rsp + pf_slot_ + 16], 0);
              je(no_pf, T_NEAR);
            }
            pf_var_ = true;
            with_read_ahead([&] { tail_rows(true); });
            pf_var_ = false;
            jmp(tail_done, T_NEAR);
            L(no_pf);
            tail_rows(false);
            L(tail_done);
          } else {
            tail_rows(false);
          }
        }
        L(strip_done);
        // Leave reg_w at the next strip whether or not any block ran.
        strip_bytes_to(reg_tmp);
        lea(reg_w, ptr[reg_strip + reg_tmp]);
      } else {
        xor_(reg_row.cvt32(), reg_row.cvt32());
        compute_block(false);  // leaves reg_w at the next strip
      }
      if (!qg_) {
        add(reg_wscale, strip_cols() * 4);
        add(reg_comp, strip_cols() * 4);
      }
      add(reg_col, out_cols() * 4);
      if (fp8_) {
        mov(reg_tmp, arg(offsetof(GemmArgs, g_per_strip)));
        imul(reg_tmp, reg_tmp, gs_strip_bytes_per_group());
        add(qword[rsp + 8], reg_tmp);
      }
      dec(qword[rsp]);
      jnz(strip_loop, T_NEAR);
    }
    L(done);
    postamble();
    emit_constants();
  }

  // The next strip's column scales and compensations (w_scale, w_comp: their own arrays, 4 bytes
  // a column), asked for as this strip starts. They are the only reads outside the weight
  // stream, once per strip in the epilogue, where they could miss to DRAM twice a strip.
  void prefetch_next_scales() {
    if (qg_ || bf16_ || mx_) return;  // qgroup scales ride in the weight stream; bf16, mx: none
    const int bytes = strip_cols() * 4;
    for (int off = 0; off < bytes; off += 64) {
      prefetcht0(ptr[reg_wscale + bytes + off]);
      if (vnni_ && !fp8_) prefetcht0(ptr[reg_comp + bytes + off]);
    }
  }

  void load_params() {
    mov(reg_w, arg(offsetof(GemmArgs, w)));
    mov(reg_lda, arg(offsetof(GemmArgs, lda)));
    mov(reg_wscale, arg(offsetof(GemmArgs, w_scale)));
    mov(reg_comp, arg(offsetof(GemmArgs, w_comp)));
    mov(reg_col, arg(offsetof(GemmArgs, out_col)));
    shl(reg_col, 2);
    if (qg_) return;  // qgroup constants: per block (the epilogues use their registers)
    if (!vnni_ && !bf16_ && !fp8_ && !mx_ && !i4w_) vmovups(ones16(), cpool(c_ones16_));
    if (fp8_) {
      mov(reg_tmp, arg(offsetof(GemmArgs, w_gscale)));
      mov(qword[rsp + 8], reg_tmp);  // this strip's scale table
    }
  }

  // The M blocks of a prefill call (reg_mb > 0 of them, from row 0) over the current strip, the
  // first pf_blocks of them prefetching the next one (at reg_pf).
  void block_loop(int pf_blocks) {
    Label mb_loop, no_pf, next;
    const bool all = pf_blocks == kAllBlocks;
    L(mb_loop);
    if (scratch_pairs())
      mov(reg_w, arg(offsetof(GemmArgs, scratch)));
    else
      mov(reg_w, reg_strip);
    if (!all) {
      cmp(reg_row, pf_blocks * mr_);
      jge(no_pf, T_NEAR);
    }
    if (fused_first()) {  // pf_blocks is 1 (not kAllBlocks): this is the call's first block
      mov(reg_w, reg_strip);
      mov(reg_sw, arg(offsetof(GemmArgs, scratch)));
      fuse_ = true;
      compute_block(true);
      fuse_ = false;
    } else {
      compute_block(true);
    }
    if (!all) {
      jmp(next, T_NEAR);
      L(no_pf);
      compute_block(false);
    }
    L(next);
    add(reg_row, mr_);
    dec(reg_mb);
    jnz(mb_loop, T_NEAR);
  }

  // tail_rows_kernel: the call's GemmArgs::m_tail rows after its blocks (reg_row, 1 .. m_r - 1
  // of them) as one short tile over the same strip, prefetching the next strip at reg_pf where
  // asked (int_tail_prefetch_kernel). Strip-scratch kernels read the strip they decoded (those
  // rows would otherwise run the decode tiles, which decode every weight again); the vdpbf16ps
  // pair kernels the strip in place or, fp8, its decoded pairs (their callers would otherwise pad
  // the last block with zero rows); int8 and int4 the strip in place.
  // split_tail_kernel: m_tail = m_r + 1 (7) runs as a 4-row and a 3-row tile, and for int8 / int4
  // m_r + 2 (8) as two 4-row tiles (split_tail_rows). The int8 / int4 tail tiles prefetch with
  // pf_var_ (each its rows' share of the next strip).
  void tail_rows(bool prefetch_next) {
    Label done;
    const int rows = mr_;
    if (fused_first()) {  // a call of no block: the tail tile decodes the strip, stores nothing,
      Label blocks_ran;   // and prefetches the next one as a first block would
      test(reg_row, reg_row);
      jnz(blocks_ran, T_NEAR);
      for (int t = 1; t < rows; ++t) {
        Label next;
        cmp(arg(offsetof(GemmArgs, m_tail)), t);
        jne(next, T_NEAR);
        mov(reg_w, reg_strip);
        mr_ = t;
        fuse_ = true;
        fuse_store_ = false;
        compute_block(true);
        fuse_ = false;
        fuse_store_ = true;
        mr_ = rows;
        jmp(done, T_NEAR);
        L(next);
      }
      jmp(done, T_NEAR);
      L(blocks_ran);
    }
    if (rows2v_kernel(key_)) {
      tail_tiles_shared(prefetch_next, done);
      L(done);
      return;
    }
    for (int t = 1; t < rows; ++t) {
      Label next;
      cmp(arg(offsetof(GemmArgs, m_tail)), t);
      jne(next, T_NEAR);
      tail_tile(t, prefetch_next);
      jmp(done, T_NEAR);
      L(next);
    }
    for (int t = rows + 1; t <= rows + split_tail_rows(key_); ++t) {
      Label next;
      cmp(arg(offsetof(GemmArgs, m_tail)), t);
      jne(next, T_NEAR);
      const int r0 = (t + 1) / 2, r1 = t / 2;
      mov(reg_w, reg_strip);
      mr_ = r0;
      compute_block(prefetch_next);
      add(reg_row, r0);
      mov(reg_w, reg_strip);
      mr_ = r1;
      compute_block(prefetch_next);
      sub(reg_row, r0);
      mr_ = rows;
      jmp(done, T_NEAR);
      L(next);
    }
    L(done);
  }

  // The 12-row tiles (rows2v_kernel): 11 tail sizes and 11 splits of 13-23 rows into halves of
  // 6-12 rows. Each tile size is emitted once, as a body that returns through the stack slot
  // [rsp + pf_slot_ + 24] (a `call` would move rsp, which the tiles address their slots by), and a
  // split runs the bodies of its two halves: a tile body per split half had made each kernel about
  // 340 KB and a Qwen3 INT8 layer's generation 4.7 ms (bar 5 ms).
  void tail_tiles_shared(bool prefetch_next, Label& done) {
    if (!pf_var_kernel())  // (the slot is in the frame pf_var_kernel() reserves)
      throw std::logic_error("gemm: shared tail tiles need the pf_var_ stack slots");
    const int rows = mr_;
    const RegExp ret_slot = rsp + pf_slot_ + 24;
    Label body[std::max(kInt8Rows2v, kBf16PairRows2v) + 1];  // (rows2v_kernel: m_r 12)
    auto run = [&](int t, Label& back) {
      lea(reg_tmp, ptr[rip + back]);
      mov(qword[ret_slot], reg_tmp);
      jmp(body[t], T_NEAR);
    };
    for (int t = 1; t < rows; ++t) {
      Label next;
      cmp(arg(offsetof(GemmArgs, m_tail)), t);
      jne(next, T_NEAR);
      run(t, done);
      L(next);
    }
    bool used_full = false;
    for (int t = rows + 1; t <= rows + split_tail_rows(key_); ++t) {
      Label next, second, fin;
      cmp(arg(offsetof(GemmArgs, m_tail)), t);
      jne(next, T_NEAR);
      const int r0 = (t + 1) / 2, r1 = t / 2;
      used_full |= r0 == rows;
      run(r0, second);
      L(second);
      add(reg_row, r0);
      run(r1, fin);
      L(fin);
      sub(reg_row, r0);
      jmp(done, T_NEAR);
      L(next);
    }
    jmp(done, T_NEAR);
    for (int t = 1; t <= (used_full ? rows : rows - 1); ++t) {
      L(body[t]);
      tail_tile(t, prefetch_next);
      jmp(qword[ret_slot]);
    }
  }
  // One tile of t rows from reg_row over the strip (or its decoded scratch): tail_rows.
  void tail_tile(int t, bool prefetch_next) {
    const int rows = mr_;
    if (scratch_pairs())
      mov(reg_w, arg(offsetof(GemmArgs, scratch)));
    else
      mov(reg_w, reg_strip);
    mr_ = t;
    compute_block(prefetch_next);
    mr_ = rows;
  }

  // One register tile: rows [reg_row, reg_row + mr) x the current strip, over all of K. Half-strip
  // tiles run it as passes over the strip's vectors p and p + P (P = half the strip's vectors,
  // rounded up): tile vector v of pass p is strip vector sv(v) = p + v * P in every address (codes,
  // scales, factors, outputs), so a siluup pass holds gate vector p and its up vector p + P. Each
  // pass walks the whole strip and prefetches its share of the next one, as a 2-row block does
  // (generate() halves the blocks that prefetch).
  void compute_block(bool prefetch_next) {
    if (!half_) {
      compute_tile(prefetch_next);
      return;
    }
    const int passes = (sv_ + 1) / 2;
    for (int p = 0; p < passes; ++p) {
      p_ = p;
      nv_ = p + passes < sv_ ? 2 : 1;
      vstride_ = passes;
      if (p > 0) mov(reg_w, reg_strip);
      compute_tile(prefetch_next);
    }
    p_ = 0;
    nv_ = std::min(2, sv_);
    vstride_ = 1;
  }
  // Prefill accumulate tiles: the next tile's output lines into L2 (prefetcht1), a whole tile
  // ahead of its own prefetcht0 (compute_tile). With only that one, issued as the tile starts,
  // the epilogue still waited on its loads: Qwen3's down (N 2048, K 768, a 6 x 64 x 768 tile)
  // writing 256 rows scattered over 32 MB ran at 86 % of the vpdpbusd peak, 93-94 % with this
  // (ktjit_kernel_bench avx512_bf16 256 2048 768 accum int8 128 4096, a Zen 5; weights
  // streamed). Asking for the next tile's lines with prefetcht0 instead was slower in the layer.
  // The next tile is the next rows at this strip, or after the call's last rows the first
  // rows at the next strip; no row past the call's end is read from out_rows, and nothing is
  // asked for after its last strip. rax and rdx are free at a tile's start (the K loop and the
  // epilogue set them); [rsp] holds the strips left.
  void prefetch_next_tile_outputs() {
    Label wrap, done;
    call_rows(reg_tmp2);
    const int rows = key_.m_r;  // the next tile's, at most
    auto fetch = [&](int col_off) {
      shl(reg_tmp, 3);  // row index -> its pointer (out_row_ptr)
      add(reg_tmp, arg(offsetof(GemmArgs, out_rows)));
      mov(reg_tmp, qword[reg_tmp]);
      add(reg_tmp, reg_col);
      for (int v = 0; v < nv_; ++v) prefetcht1(ptr[reg_tmp + col_off + sv(v) * vec_bytes()]);
    };
    lea(reg_tmp, ptr[reg_row + mr_]);
    cmp(reg_tmp, reg_tmp2);
    jge(wrap, T_NEAR);
    for (int i = 0; i < rows; ++i) {
      if (i > 0) {
        lea(reg_tmp, ptr[reg_row + mr_ + i]);
        cmp(reg_tmp, reg_tmp2);
        jge(done, T_NEAR);
      }
      fetch(0);
    }
    jmp(done, T_NEAR);
    L(wrap);  // the next strip's first rows, unless this is the call's last strip
    cmp(qword[rsp], 1);
    jle(done, T_NEAR);
    for (int i = 0; i < rows; ++i) {
      if (i > 0) {
        cmp(reg_tmp2, i);
        jle(done, T_NEAR);
      }
      mov(reg_tmp.cvt32(), i);
      fetch(out_cols() * 4);
    }
    L(done);
  }
  // The strip vector that tile vector v stands for (compute_block).
  int sv(int v) const { return p_ + v * vstride_; }
  void compute_tile(bool prefetch_next) {
    if (prefetch_next && pf_var_) pf_var_stride();
    // Prefill accumulate tiles ask for their output lines before the K loop: the rows are the
    // tokens' partial rows (T x H fp32), which at large T outgrow the caches, and the epilogue's
    // read-modify-write of 6 rows x 4 lines waited on DRAM once per tile. The K loop hides the
    // fetch (the lines fall back to L2 as the strip streams through L1). The previous tile has
    // asked for them into L2 already (prefetch_next_tile_outputs, which this one then calls).
    if (prefill_ && key_.epilogue == Epilogue::accum) {
      for (int m = 0; m < mr_; ++m) {
        out_row_ptr(reg_tmp, m);
        for (int v = 0; v < nv_; ++v) prefetcht0(ptr[reg_tmp + sv(v) * vec_bytes()]);
      }
      prefetch_next_tile_outputs();
    }
    mov(reg_a, reg_row);
    imul(reg_a, reg_lda);
    add(reg_a, arg(offsetof(GemmArgs, a)));
    if (mr_ > 3) {
      lea(reg_a3, ptr[reg_a + reg_lda * 2]);
      add(reg_a3, reg_lda);
    }
    if (mr_ > 6) {  // (pair tiles only: the max_rows check)
      lea(reg_a6, ptr[reg_a3 + reg_lda * 2]);
      add(reg_a6, reg_lda);
    }
    if (mr_ > 9) {
      lea(reg_a9, ptr[reg_a6 + reg_lda * 2]);
      add(reg_a9, reg_lda);
    }
    if (qg_) load_params_qgroup();
    if ((fp8p_ || mx8d_) && !prefill_) fp8_pair_constants();
    if (fuse_ && fp8p_) fp8_fused_constants();
    if ((bf16_ || sfma_) && !pairs_ && zmm_isa())
      vmovups(Zmm(29), zword[rip + c_hi16_]);  // odd-k mask
    if (i16_ && zmm_isa())
      vmovups(Zmm(29), zword[rip + c_e2m1_w_]);  // 2 * e2m1 as int16, twice
    else if (i16_)  // avx2: |2 * e2m1| bytes in both lanes, and the word nibble mask
      mx_i16_avx2_constants();
    else if (mx4_ && zmm_isa() && mr_ < 6 && !sfma_ && !mxp_)
      vmovups(Zmm(29), zword[rip + c_e2m1_]);  // e2m1 table
    if (i4w_) vmovups(aux(), cpool(c_0f_));    // the nibble mask
    if (int4_mask_reg()) vmovups(aux(), cpool(c_f0_));
    zero_accumulators();
    k_loop(prefetch_next);
    if (fp8_stack_acc() || mx_stack_acc() || qgs2_ || i4w_)
      for (int m = 0; m < mr_; ++m)
        for (int v = 0; v < nv_; ++v) vmovups(acc(m, v), vmem(rsp + acc_slot(m, v)));
    epilogue();
  }

  void zero_accumulators() {
    // fp8 pair / scratch tiles, avx2 2-row fp8 (fp32-domain) and mxfp4 decode tiles and qgroup
    // 2-row avx2 tiles: the fp32 accumulators wait on the stack; the registers hold the group sums
    // (int4 below VNNI: the int32 sums on the stack, the int16 sums in the registers)
    if (fp8_stack_acc() || mx_stack_acc() || qgs2_ || i4w_) {
      const Xmm z = vreg(num_vregs() - 1);
      vpxord_any(z);
      for (int m = 0; m < mr_; ++m)
        for (int v = 0; v < nv_; ++v) vmovups(vmem(rsp + acc_slot(m, v)), z);
      if (!i4w_) return;
    }
    for (int m = 0; m < mr_; ++m)
      for (int v = 0; v < nv_; ++v) {
        if (zmm_isa())
          vpxord(acc(m, v), acc(m, v), acc(m, v));
        else
          vpxor(acc(m, v), acc(m, v), acc(m, v));
      }
  }

  // K steps unrolled by kUnroll (addresses by displacement), then the remaining steps one by one.
  static constexpr int kUnroll = 4;
  static constexpr int kPrefetchBlocks = 8;
  // Calls of fewer blocks than that prefetch the next strip from their first kFewPrefetchBlocks
  // blocks, pf_lines_ lines at each prefetch site (generate()).
  static constexpr int kFewPrefetchBlocks = 2;
  int pf_lines_ = 1;
  // pf_var_ tiles (int_tail_prefetch_kernel and qgroup_tail_rows_kernel calls of
  // fewer than kPrefetchBlocks blocks, half as many of half-strip tiles, and the vdpbf16ps pair
  // kernels that take their tail rows, whose blocks 0-1 took half each): each prefetch site (every
  // second K step) touches pf_var_lines() lines from reg_pf and moves reg_pf on by the tile's
  // stride, L bytes with L = floor(Q (row + rows) / M) - floor(Q row / M) for a tile of `rows`
  // rows from `row` in a call of M rows: the tiles' shares of the Q bytes a site in all, as their
  // rows'. int8 / int4 and BF16 pairs: Q = prefill_site_bytes(key, M), the strip's 512 bytes a
  // site (int4 256) or, in a DRAM-bound call of fewer than prefill_stream_rows(key) rows, less
  // (pf_site_bytes_setup); qgroup: qg_pf_var_setup. In bytes, not whole lines, since 2026-11-28 (a
  // thirty-second session): with L in lines (Q = 8) a tile's share was rounded: a 2-row tail of 14
  // rows asked for 2 lines a site in a third of a 6-row block's time and the block for 3 (14
  // rows 1.10x faster in bytes; Qwen3 layers at T = 256 1.04-1.06x for INT8, 1.05x for BF16,
  // in-process A/Bs on a Zen 5). int8 and BF16 tiles touch 8 lines (at least 449 bytes past reg_pf,
  // whatever its offset in a line), more than any tile's stride of the executor's calls
  // (prefill_split; BF16 pairs from 5 rows): a call of one tile moves by Q, 512 from a line start
  // (its pointer stays on line starts) or, below prefill_stream_rows(), at most 512 * 6 / 13 (236
  // bytes: a tile is at most 6 rows), and the largest share of a call of several tiles is 6 of 8
  // rows' (385 bytes; 7 rows run as 4 + 3; where S is set, 6 of 13 rows' of Q = 516, 238 bytes), so
  // the sites cover the lines asked for (Gemm.PrefillPrefetchCoversTheNextStrip). A block touches 8
  // whatever its L (16 rows: 3 lines): this core drops a software prefetch it has no room for (a
  // loop of prefetches alone retires at 100 GB/s), and the lines touched again are asked for again;
  // a Qwen3 INT8 layer at T = 256 ran 1.05x faster than with 4 (a Zen 5). The tiles of fewer than 5
  // rows touched 4 until the shares were in bytes (8 measured the same at 8-14 rows). qgroup tiles
  // touch a K step pair's code lines (nibbles 4, bytes 8: 1.08x faster than 8 for Q4_K at T = 256);
  // the VNNI half-strip passes, each walking all of a strip's sites, count the sites of every pass
  // (qg_pf_var_setup) and touch one step's (4).
  bool pf_var_ = false;
  bool pf_var_kernel() const {
    return int_tail_prefetch_kernel(key_) || (pairs_ && tail_rows_kernel(key_)) ||
           (qg_ && qgroup_tail_rows_kernel(key_));
  }
  static constexpr int kAllBlocks = 1 << 20;  // block_loop: every block prefetches
  int pf_var_lines() const { return qg_ ? (half_ ? 1 : 2) * step_bytes() / 64 : 8; }
  // [rsp + pf_slot_]: the call's rows M, [rsp + pf_slot_ + 8]: the tile's stride, [+ 16]: the
  // bytes a site, Q (pf_site_bytes_setup, qg_pf_var_setup; qgroup: 0 where that is more than a
  // site touches: the old rule)
  int pf_slot_ = 0;
  void pf_var_site() {
    for (int i = 0; i < pf_var_lines(); ++i) {
      if (prefill_share_l1(key_))  // (a Zen 5's 12-row tiles)
        prefetcht0(ptr[reg_pf + i * 64]);
      else
        prefetcht1(ptr[reg_pf + i * 64]);
    }
    add(reg_pf, qword[rsp + pf_slot_ + 8]);
  }
  // int8 / int4 and BF16 pairs: Q = prefill_site_bytes(key, M) with M in reg_tmp (and at [rsp +
  // pf_slot_]).
  void pf_site_bytes_setup() {
    const int s = prefill_stream_rows(key_);
    Label whole, set;
    if (s > 0) {
      cmp(reg_tmp, s);
      jge(whole, T_NEAR);
      imul(reg_tmp, reg_tmp, int(prefill_strip_site_bytes(key_)));
      mov(qword[rsp + pf_slot_ + 8], s);  // (the stride's slot: each tile sets it)
      xor_(reg_tmp2.cvt32(), reg_tmp2.cvt32());
      div(qword[rsp + pf_slot_ + 8]);
      jmp(set, T_NEAR);
    }
    L(whole);
    mov(reg_tmp,
        prefill_site_bytes(key_, s));  // (512, or on a Zen 5 516: kPrefillWholeSiteBytesZen5)
    L(set);
    mov(qword[rsp + pf_slot_ + 16], reg_tmp);
  }
  // qgroup: a strip's sites are its groups' K step pairs and group ends; with Sb bytes a strip and
  // n sites, C = ceil(Sb / n) bytes a site, and a tile's stride is in bytes,
  // floor(C (row + rows) / M) - floor(C row / M), the tiles' strides at a site adding up to C. A
  // tile's sites cover its n strides (each touches its stride's lines or more), the tiles follow
  // each other, and the last site's touch reaches n C >= Sb. Where C is more than a site touches
  // (no layout of today's formats) the slot holds 0 and the old rule prefetches.
  void qg_pf_var_setup() {
    Label fits, none;
    mov(reg_tmp, arg(offsetof(GemmArgs, g_steps)));
    shr(reg_tmp, 1);
    add(reg_tmp, 1);
    imul(reg_tmp, arg(offsetof(GemmArgs, g_per_strip)));  // n
    if (half_) imul(reg_tmp, reg_tmp, (sv_ + 1) / 2);     // each pass walks the strip's sites
    test(reg_tmp, reg_tmp);
    jle(none, T_NEAR);  // (no groups: no K loop to prefetch from, and no division by 0)
    mov(qword[rsp + pf_slot_ + 16], reg_tmp);
    strip_bytes_to(reg_tmp);
    add(reg_tmp, qword[rsp + pf_slot_ + 16]);
    sub(reg_tmp, 1);
    xor_(reg_tmp2.cvt32(), reg_tmp2.cvt32());
    div(qword[rsp + pf_slot_ + 16]);  // C
    cmp(reg_tmp, 64 * pf_var_lines());
    jbe(fits, T_NEAR);
    L(none);
    xor_(reg_tmp.cvt32(), reg_tmp.cvt32());
    L(fits);
    mov(qword[rsp + pf_slot_ + 16], reg_tmp);
  }
  // The tile's stride in bytes, floor(Q (row + rows) / M) - floor(Q row / M) (int8, BF16 pairs:
  // pf_site_bytes_setup; qgroup: Q = C, qg_pf_var_setup).
  void pf_var_stride() {
    lea(reg_tmp, ptr[reg_row + mr_]);
    imul(reg_tmp, qword[rsp + pf_slot_ + 16]);
    xor_(reg_tmp2.cvt32(), reg_tmp2.cvt32());
    div(qword[rsp + pf_slot_]);
    mov(qword[rsp + pf_slot_ + 8], reg_tmp);
    mov(reg_tmp, reg_row);
    imul(reg_tmp, qword[rsp + pf_slot_ + 16]);
    xor_(reg_tmp2.cvt32(), reg_tmp2.cvt32());
    div(qword[rsp + pf_slot_]);
    mov(reg_tmp2, qword[rsp + pf_slot_ + 8]);
    sub(reg_tmp2, reg_tmp);
    mov(qword[rsp + pf_slot_ + 8], reg_tmp2);
  }
  // fp8 pair prefill in rounds (rounds_kernel): a call of 1 .. kRoundBlocks blocks runs each
  // strip group by group (64 k pairs, one scale per strip half), every block and the tail rows
  // one pass over the group: the first block decodes the group's codes into the first 16 KB of
  // the scratch (microkernel_fp8_fused) and the other passes read them there, while they are in
  // L1. Each pass folds its group sums into its rows' fp32 slots on the stack, and the epilogues
  // run after the last group. Block by block, the first block wrote the whole strip's bf16 pairs
  // (twice its fp8 bytes) to L2 and every later block read them back from there: at
  // Qwen3-30B-A3B T = 256 (16 rows an expert) dropping only those writes made the layer
  // 1.06-1.10x faster (a Zen 5). Same sums in the same order: the same bits as the blocks.
  // Every pass asks for the next strip's lines of its group (two lines a k pair, each line once
  // a pass), the later passes again from where the first began (kRoundPrefetch). The first pass
  // runs a fraction of the group's time (at 16 rows about a third), so alone it asked for the
  // lines faster than one core's DRAM stream gives them, and this core drops a software
  // prefetch it has no room for: a Qwen3 FP8 layer at T = 256 then ran 45-55 ms from process to
  // process (each process steady), the extra time on the first pass's weight loads (perf
  // samples on the decode right after them). With every pass asking: 45-47 ms in every process
  // (2026-11-29, a Zen 5: 8 alternating process pairs 45.2-46.2 against 45.4-52.7 ms; in-process
  // A/Bs 0.88-0.99x; T = 128 1.00x).
  static constexpr int kRoundBlocks = 8;
  bool rounds_ = false;
  int rounds_stack_ = 0;  // [rsp + rounds_stack_ + kRound*]: the scalars below, then the slots
  static constexpr int kRoundCodes = 0;    // the first block's position in the strip's codes
  static constexpr int kRoundKBytes = 8;   // the activations' bytes before the group
  static constexpr int kRoundScales = 16;  // the group's scale entry
  static constexpr int kRoundPairs = 24;   // the group's k pairs
  static constexpr int kRoundSlots = 32;   // the slots (64-byte aligned): row r at r * nv_ * 64
  static constexpr int kRoundPrefetch = 40;  // the group's first line of the next strip (reg_pf)
  static constexpr int kRoundScalars = 64;
  static constexpr int kRoundRows = (kRoundBlocks + 1) * 6;
  bool rounds_kernel() const {
    return fused_first() && fp8p_ && mr_ == 6 && tail_rows_kernel(key_);
  }
  // The strip half (its group scale) of tile vector v: siluup strips hold gate, then up.
  int fp8_half(int v) const {
    return v < (key_.epilogue == Epilogue::siluup ? nv_ / 2 : nv_) ? 0 : 1;
  }
  // dst: the call's rows, m_blocks * m_r (the key's) + m_tail (tail_rows_kernel)
  void call_rows(const Reg64& dst) {
    mov(dst, arg(offsetof(GemmArgs, m_blocks)));
    imul(dst, dst, key_.m_r);
    if (tail_rows_kernel(key_)) add(dst, arg(offsetof(GemmArgs, m_tail)));
  }
  // reg_tmp: the slots of row reg_row
  void round_slots() {
    mov(reg_tmp, reg_row);
    imul(reg_tmp, reg_tmp, nv_ * 64);
    add(reg_tmp, qword[rsp + rounds_stack_ + kRoundSlots]);
  }
  // One pass: the group's k pairs over rows reg_row .. + mr_, folded into their slots.
  void round_pass(bool first) {
    mov(reg_a, reg_row);
    imul(reg_a, reg_lda);
    add(reg_a, arg(offsetof(GemmArgs, a)));
    add(reg_a, qword[rsp + rounds_stack_ + kRoundKBytes]);
    if (mr_ > 3) {
      lea(reg_a3, ptr[reg_a + reg_lda * 2]);
      add(reg_a3, reg_lda);
    }
    mov(reg_gs, qword[rsp + rounds_stack_ + kRoundScales]);
    mov(reg_gk, qword[rsp + rounds_stack_ + kRoundPairs]);
    if (first) {
      mov(reg_w, qword[rsp + rounds_stack_ + kRoundCodes]);
      mov(reg_sw, arg(offsetof(GemmArgs, scratch)));
      fp8_fused_constants();
      mov(qword[rsp + rounds_stack_ + kRoundPrefetch], reg_pf);
    } else {
      mov(reg_w, arg(offsetof(GemmArgs, scratch)));
      mov(reg_pf, qword[rsp + rounds_stack_ + kRoundPrefetch]);  // the group's lines again
    }
    zero_gacc();
    fuse_ = first;
    fp8_group_steps(true);  // every pass asks for the next strip's lines of the group
    fuse_ = false;
    if (first) mov(qword[rsp + rounds_stack_ + kRoundCodes], reg_w);
    round_slots();
    const Xmm t = vreg(num_vregs() - 1);
    for (int h = 0; h < 2; ++h) vmovups(Zmm(29 + h), zword[rsp + kFp8ScaleStack + h * 64]);
    for (int m = 0; m < mr_; ++m)
      for (int v = 0; v < nv_; ++v) {
        const Address slot = zword[reg_tmp + (m * nv_ + v) * 64];
        vmovups(t, slot);
        vfmadd231ps(t, gacc(m, v), Zmm(29 + fp8_half(v)));
        vmovups(slot, t);
      }
  }
  // `body` with mr_ set to the call's m_tail (1 .. m_r - 1), if any.
  template <class Body>
  void for_round_tail(Body&& body) {
    const int rows = mr_;
    Label done;
    for (int t = 1; t < rows; ++t) {
      Label next;
      cmp(arg(offsetof(GemmArgs, m_tail)), t);
      jne(next, T_NEAR);
      mr_ = t;
      body();
      mr_ = rows;
      jmp(done, T_NEAR);
      L(next);
    }
    L(done);
  }
  void strip_rounds() {
    rounds_ = true;
    const int rows = mr_;
    {  // the call's rows' slots, zeroed
      Label row;
      const Xmm z = vreg(num_vregs() - 1);
      vpxord(z, z, z);
      call_rows(reg_mb);
      mov(reg_tmp, qword[rsp + rounds_stack_ + kRoundSlots]);
      L(row);
      for (int v = 0; v < nv_; ++v) vmovups(zword[reg_tmp + v * 64], z);
      add(reg_tmp, nv_ * 64);
      dec(reg_mb);
      jnz(row, T_NEAR);
    }
    if (key_.epilogue == Epilogue::accum) {
      // the rows' output lines into L2 for the epilogues after the last group
      Label row;
      call_rows(reg_mb);
      xor_(reg_row.cvt32(), reg_row.cvt32());
      L(row);
      out_row_ptr(reg_tmp, 0);
      for (int v = 0; v < nv_; ++v) prefetcht1(ptr[reg_tmp + sv(v) * vec_bytes()]);
      inc(reg_row);
      cmp(reg_row, reg_mb);
      jl(row, T_NEAR);
    }
    mov(qword[rsp + rounds_stack_ + kRoundCodes], reg_strip);
    mov(qword[rsp + rounds_stack_ + kRoundKBytes], 0);
    mov(reg_tmp, qword[rsp + 8]);
    mov(qword[rsp + rounds_stack_ + kRoundScales], reg_tmp);
    mov(reg_k, arg(offsetof(GemmArgs, k4)));
    shr(reg_k, 1);
    Label group, blocks_done;
    L(group);
    {
      mov(reg_gs, qword[rsp + rounds_stack_ + kRoundScales]);
      fp8_group_scales();
      mov(reg_gk, arg(offsetof(GemmArgs, g_steps)));
      shr(reg_gk, 1);
      cmp(reg_gk, reg_k);
      cmovg(reg_gk, reg_k);  // the last group may be short
      sub(reg_k, reg_gk);
      mov(qword[rsp + rounds_stack_ + kRoundPairs], reg_gk);
      xor_(reg_row.cvt32(), reg_row.cvt32());
      round_pass(true);
      mov(reg_mb, arg(offsetof(GemmArgs, m_blocks)));
      Label block;
      L(block);
      add(reg_row, rows);
      dec(reg_mb);
      jz(blocks_done, T_NEAR);
      round_pass(false);
      jmp(block, T_NEAR);
      L(blocks_done);
      for_round_tail([&] { round_pass(false); });
      mov(reg_tmp, qword[rsp + rounds_stack_ + kRoundPairs]);
      shl(reg_tmp, 2);
      add(qword[rsp + rounds_stack_ + kRoundKBytes], reg_tmp);
      add(qword[rsp + rounds_stack_ + kRoundScales], gs_strip_bytes_per_group());
      test(reg_k, reg_k);
      jnz(group, T_NEAR);
    }
    auto ends = [&] {  // the rows' sums into the accumulators, then the epilogue
      round_slots();
      for (int m = 0; m < mr_; ++m)
        for (int v = 0; v < nv_; ++v) vmovups(acc(m, v), zword[reg_tmp + (m * nv_ + v) * 64]);
      epilogue();
    };
    xor_(reg_row.cvt32(), reg_row.cvt32());
    mov(reg_mb, arg(offsetof(GemmArgs, m_blocks)));
    Label end;
    L(end);
    ends();
    add(reg_row, rows);
    dec(reg_mb);
    jnz(end, T_NEAR);
    for_round_tail(ends);
    rounds_ = false;
  }

  // One group's k steps (reg_gk of them, from reg_w; reg_gs at the group's scale entry).
  void fp8_group_steps(bool prefetch_next) {
    Label inner, tail, gdone;
    // The pair order's decoding steps (decode tiles, a prefill call's first block) check the
    // step's flag, the byte at the pairs left in the group (formats::kFp8FlagBytes), and take
    // the shift decode, or the table decode out of line.
    const bool flags = fp8w() && (!prefill_ || fuse_);
    auto flag = [&](int u) { return byte[reg_gs + reg_gk + (formats::kFp8FlagOffset - 1 - u)]; };
    // fp8 pair prefill reads the strip's k-pair copy in the scratch (scratch_pairs), with
    // vdpbf16ps or (strip-scratch kernels) the bf16 FMA microkernel.
    auto step = [&](int u) {
      if (fuse_)
        microkernel_fp8_fused(u, prefetch_next);
      else if (sfma_)
        microkernel_sfma(u, prefetch_next);
      else if (scratch_pairs())
        microkernel_pairs(u, prefetch_next);
      else
        microkernel(u, prefetch_next);
    };
    auto move_on = [&](int steps) {
      if (fuse_) {
        advance_pairs(steps, prefetch_next, fp8p_step_bytes());
        if (fuse_store_) add(reg_sw, nv_ * 64 * steps);
      } else if (sfma_)
        advance_sfma(steps, prefetch_next);
      else if (scratch_pairs())
        advance_pairs(steps, prefetch_next);
      else
        advance(steps, prefetch_next);
    };
    L(inner);
    cmp(reg_gk, kUnroll);
    jl(tail, T_NEAR);
    Label slow[kUnroll + 1], back[kUnroll + 1];
    auto checked_step = [&](int u, int label) {
      if (flags) {
        cmp(flag(u), 0);
        jne(slow[label], T_NEAR);
        fp8_fast_ = true;
      }
      step(u);
      fp8_fast_ = false;
      if (flags) L(back[label]);
    };
    for (int u = 0; u < kUnroll; ++u) checked_step(u, u);
    move_on(kUnroll);
    sub(reg_gk, kUnroll);
    jmp(inner, T_NEAR);
    for (int u = 0; u <= kUnroll && flags; ++u) {  // flagged steps: the table decode
      L(slow[u]);
      step(u < kUnroll ? u : 0);
      jmp(back[u], T_NEAR);
    }
    L(tail);
    test(reg_gk, reg_gk);
    jz(gdone, T_NEAR);
    checked_step(0, kUnroll);
    move_on(1);
    dec(reg_gk);
    jmp(tail, T_NEAR);
    L(gdone);
  }

  // fp8: K steps in groups that share one scale per strip half; within a group as k_loop.
  void k_loop_fp8(bool prefetch_next) {
    Label group, done;
    mov(reg_k, arg(offsetof(GemmArgs, k4)));
    if (fp8p_ || sfma_) shr(reg_k, 1);  // pair kernels count k pairs (K and g_steps even)
    mov(reg_gs, qword[rsp + 8]);
    test(reg_k, reg_k);
    jle(done, T_NEAR);
    L(group);
    {
      fp8_group_scales();
      if (gacc_) zero_gacc();
      mov(reg_gk, arg(offsetof(GemmArgs, g_steps)));
      if (fp8p_ || sfma_) shr(reg_gk, 1);
      cmp(reg_gk, reg_k);
      cmovg(reg_gk, reg_k);  // the last group may be short
      sub(reg_k, reg_gk);
      fp8_group_steps(prefetch_next);
      if (gacc_) {  // acc += g * scale (* 2^8 for the fp16 route): one rounding per group
        auto fold = [&](const Xmm& dst, const Xmm& g, int h) {
          if (fp8_scale_regs())
            vfmadd231ps(dst, g, Zmm(28 + h));
          else
            vfmadd231ps(dst, g, vmem(rsp + kFp8ScaleStack + h * vec_bytes()));
        };
        for (int m = 0; m < mr_; ++m)
          for (int v = 0; v < nv_; ++v) {
            const int h = fp8_half(v);
            if (fp8_stack_acc()) {
              const Address slot = vmem(rsp + fp8_acc_slot(m, v));
              const Xmm t = vreg(num_vregs() - 1);
              vmovups(t, slot);
              fold(t, gacc(m, v), h);
              vmovups(slot, t);
            } else {
              fold(acc(m, v), gacc(m, v), h);
            }
          }
      }
      add(reg_gs, gs_strip_bytes_per_group());
      test(reg_k, reg_k);
      jnz(group, T_NEAR);
    }
    L(done);
  }

  void load_params_qgroup() {
    if (qg4_ && qgi_) vmovups(qmask(), cpool(c_0f_));  // the nibble is the code: no table
    if (qg4_ && !qgi_) {
      mov(reg_tmp, arg(offsetof(GemmArgs, lut)));
      if (qmask_in_memory()) {
        vbroadcasti128(Ymm(qlut().getIdx()), ptr[reg_tmp]);
        return;  // the sign path's ones come from memory too
      }
      if (zmm_isa())
        vbroadcasti32x4(Zmm(qlut().getIdx()),
                        ptr[reg_tmp]);  // the 16-entry table in every 128-bit lane
      else
        vbroadcasti128(Ymm(qlut().getIdx()), ptr[reg_tmp]);
      vmovups(qmask(), cpool(c_0f_));
    }
    if (!vnni_ && !qgf_ && !qgl_ && !half_) vmovups(qones(), cpool(c_ones16_));
    if (!vnni_ && zmm_isa()) vpxord(qzero(), qzero(), qzero());
  }

  // body(fa) on the fp32 accumulator of (row m, vector v): its register, or (2-row avx2 tiles)
  // `tmp` loaded from its stack slot and stored back.
  template <class Body>
  void with_fp32_acc(int m, int v, const Xmm& tmp, Body&& body) {
    const Xmm fa = qgs2_ ? tmp : acc(m, v);
    if (qgs2_) vmovups(fa, vmem(rsp + acc_slot(m, v)));
    body(fa);
    if (qgs2_) vmovups(vmem(rsp + acc_slot(m, v)), fa);
  }
  // t = 8 columns' int8 sub-scales at `subs`, each in both words of its column's dword (the
  // other operand of a vpmaddwd over int16 pair sums).
  void sub_scale_pairs(const Xmm& t, const Address& subs) {
    vpmovsxbd(t, subs);
    vpshufb(t, t, cpool(c_dupw_));
  }

  // reg_gsum: the first group's a_gsum entry of the M block's first row.
  void gsum_of_block_rows() {
    mov(reg_gsum, arg(offsetof(GemmArgs, a_gsum)));
    lea(reg_gsum, ptr[reg_gsum + reg_row * 4]);
  }

  // qss_ (qgroup_scale_scratch_kernel): in a call of kQssMinBlocks or more M blocks, the first
  // block's group ends build the scale (and bias) vectors, float(sub) * factor, as before and also
  // store them to GemmArgs::scratch ([group][scale, bias][vector]; the write pointer at [rsp + 8]),
  // and the later blocks' group ends load them there (reg_sb walks the scratch instead of the
  // super blocks' headers). Calls of fewer blocks build them in every group end as before.
  // (A pass over the strip's scales before the blocks cost more at T = 256: 4.8 % of the gate/up
  // kernel in a profile, for the same stores.)
  enum class Qss { off, store, load };
  Qss qss_mode_ = Qss::off;
  int qss_group_bytes() const { return (qgb_ ? 2 : 1) * sv_ * vec_bytes(); }
  static constexpr int kQssMinBlocks = 2;
  static constexpr int kQssWriteStack = 8;  // [rsp + 8]: the first block's scratch write pointer
  // Jumps to `few` for a call of fewer blocks, to `first` in its first block (reg_row 0).
  void qss_branch(Label& few, Label& first) {
    cmp(arg(offsetof(GemmArgs, m_blocks)), kQssMinBlocks);
    jl(few, T_NEAR);
    test(reg_row, reg_row);
    jz(first, T_NEAR);
  }

  // qgroup: for each group, zero the int32 accumulators, run its K steps, then fold them into the
  // fp32 accumulators with the group's scales (and biases) that follow its codes in the stream.
  void k_loop_qgroup(bool prefetch_next) {
    Label group, done;
    mov(reg_gc, arg(offsetof(GemmArgs, g_per_strip)));
    if (gsum_) gsum_of_block_rows();
    test(reg_gc, reg_gc);
    jle(done, T_NEAR);
    if (qgs_) xor_(reg_sg.cvt32(), reg_sg.cvt32());
    if (qss_) {  // the scratch: read by the later blocks (reg_sb), written by the first
      mov(reg_sb, arg(offsetof(GemmArgs, scratch)));
      mov(qword[rsp + kQssWriteStack], reg_sb);
    }
    // The stack slots start at zero: int16 group sums' int32 parts (each group end that used
    // them zeroes them), or the fp32 super-block partials' sums t (the fp32 accumulators then
    // hold the super block's partials S).
    if (qgw_ || qgp_) {
      const Xmm z = qend_tmp(0);
      vpxord_any(z);
      for (int m = 0; m < mr_; ++m)
        for (int v = 0; v < nv_; ++v) vmovups(vmem(rsp + qw_part_slot(m, v)), z);
    }
    L(group);
    {
      if (qgs_) {  // a new super block: its header (the fp32 factors) is read by each group end
        Label same;
        test(reg_sg, reg_sg);
        jnz(same, T_NEAR);
        Label header, loads;
        if (qss_) {  // the later blocks of a call of several keep reg_sb on the scratch
          qss_branch(header, header);
          jmp(loads, T_NEAR);
        }
        L(header);
        mov(reg_sb, reg_w);
        L(loads);
        // The header is read at the super block's end. Decode kernels without a software
        // prefetch (decode_prefetch_bytes) touch its lines now, so the stream stays gapless for
        // the hardware prefetcher: skipping them (8 lines with the signed codes' correction) cut
        // a Zen 4's Q6_K decode stream from ~25 to ~19 GB/s.
        if (!prefill_ && decode_prefetch_bytes(key_) == 0)
          for (int o = 0; o < qg_header_bytes(); o += 64) prefetcht0(ptr[reg_sb + o]);
        advance_w(qg_header_bytes());
        mov(reg_sg, arg(offsetof(GemmArgs, g_per_super)));
        L(same);
        dec(reg_sg);
      }
      if (!qgroup_first_writes())
        for (int m = 0; m < mr_; ++m)
          for (int v = 0; v < nv_; ++v) vpxord_any(qacc(m, v));
      qgroup_steps(prefetch_next);
      if (qss_) {  // three group ends: vectors loaded, built and stored, or built
        Label few, first, ended;
        qss_branch(few, first);
        qss_mode_ = Qss::load;
        qgroup_group_end(prefetch_next);
        jmp(ended, T_NEAR);
        L(first);
        qss_mode_ = Qss::store;
        qgroup_group_end(prefetch_next);
        jmp(ended, T_NEAR);
        L(few);
        qss_mode_ = Qss::off;
        qgroup_group_end(prefetch_next);
        L(ended);
      } else {
        qgroup_group_end(prefetch_next);
      }
      if (qgp_) {  // the super block's last group: t = fma(S, factor, t), S = 0; signed codes
        // (kQGroupIntFold): t = fma(S - float(correction), factor, t), the header's int32
        // correction (128 * sum of sub * group code sums: 128 times an integer below 2^24, exact
        // in fp32)
        Label more;
        test(reg_sg, reg_sg);
        jnz(more, T_NEAR);
        const Xmm f = qend_tmp(0), c = qend_tmp(1);
        for (int v = 0; v < nv_; ++v) {
          vmovups(f, vmem(reg_sb + sv(v) * vec_bytes()));
          if (qgf_) vcvtdq2ps(c, vmem(reg_sb + (sv_ + sv(v)) * vec_bytes()));
          for (int m = 0; m < mr_; ++m) {
            if (qgf_) vsubps(acc(m, v), acc(m, v), c);
            vfmadd213ps(acc(m, v), f, vmem(rsp + qw_part_slot(m, v)));
            vmovups(vmem(rsp + qw_part_slot(m, v)), acc(m, v));
            vpxord_any(acc(m, v));
          }
        }
        L(more);
      }
      dec(reg_gc);
      jnz(group, T_NEAR);
    }
    L(done);
    if (qgp_)  // the sums back where the epilogues read them
      for (int m = 0; m < mr_; ++m)
        for (int v = 0; v < nv_; ++v) vmovups(acc(m, v), vmem(rsp + qw_part_slot(m, v)));
  }

  // Int32 super-block folds (kQGroupIntFold, avx2): per super block the int32 sums start at zero;
  // per group the sub-scales become int16 pairs on the stack (qf_scale_slot), then its K steps
  // run two at a time (microkernel_qgroup_fold); at the super block's end the header's int32
  // correction comes off and one FMA by its fp32 factor folds each sum.
  void k_loop_qgroup_fold(bool prefetch_next) {
    Label super, group, done;
    const Reg64 reg_cb = r12;  // bytes of a group's codes: its sub-scales follow them
    mov(reg_gc, arg(offsetof(GemmArgs, s_per_strip)));
    mov(reg_cb, arg(offsetof(GemmArgs, g_steps)));
    imul(reg_cb, reg_cb, step_bytes());
    test(reg_gc, reg_gc);
    jle(done, T_NEAR);
    L(super);
    {
      mov(reg_sb, reg_w);
      advance_w(qg_header_bytes());
      for (int m = 0; m < mr_; ++m)
        for (int v = 0; v < nv_; ++v) vpxord_any(qacc(m, v));
      mov(reg_sg, arg(offsetof(GemmArgs, g_per_super)));
      L(group);
      {
        // each column's int8 sub-scale in both words of its dword (vpmaddwd's other operand)
        const Xmm t = vreg(14);
        for (int v = 0; v < nv_; ++v) {
          sub_scale_pairs(t, qword[reg_w + reg_cb + v * 8]);
          vmovdqu(vmem(rsp + qf_scale_slot(v)), t);
        }
        qgroup_steps(prefetch_next);
        advance_w(qg_extra_bytes());  // the sub-scales
        qgroup_prefetch_scales(prefetch_next);
        dec(reg_sg);
        jnz(group, T_NEAR);
      }
      const Xmm fa_tmp = vreg(15);
      for (int v = 0; v < nv_; ++v)
        for (int m = 0; m < mr_; ++m) {
          vpsubd(qacc(m, v), qacc(m, v), vmem(reg_sb + (strip_cols() + v * lanes_) * 4));
          vcvtdq2ps(qacc(m, v), qacc(m, v));
          with_fp32_acc(m, v, fa_tmp, [&](const Xmm& fa) {
            vfmadd231ps(fa, qacc(m, v), vmem(reg_sb + v * vec_bytes()));
          });
        }
      dec(reg_gc);
      jnz(super, T_NEAR);
    }
    L(done);
  }

  // Two K steps (u even) of an int32 fold tile: the rows' activations (a + 128) broadcast for both
  // steps (ymm 8-11), each code vector loaded once per step (12, 13) for all rows; per (row,
  // vector) two vpmaddubsw (|pair| <= 2 * 255 * 32), their int16 sum (<= 32640: exact), vpmaddwd
  // by the sub-scales and vpaddd into the super block's sum (14, 15 temporaries).
  void microkernel_qgroup_fold(int u) {
    if (u % 2) return;
    const Xmm c[2] = {vreg(12), vreg(13)};
    const Xmm t0 = vreg(14), t1 = vreg(15);
    auto b = [&](int m, int j) { return vreg(8 + 2 * m + j); };
    for (int m = 0; m < mr_; ++m)
      for (int j = 0; j < 2; ++j) vpbroadcastd(b(m, j), dword[a_row(m) + 4 * (u + j)]);
    for (int v = 0; v < nv_; ++v) {
      for (int j = 0; j < 2; ++j) vmovdqu(c[j], weight_mem(v, u + j));
      for (int m = 0; m < mr_; ++m) {
        vpmaddubsw(t0, b(m, 0), c[0]);
        vpmaddubsw(t1, b(m, 1), c[1]);
        vpaddw(t0, t0, t1);
        vpmaddwd(t0, t0, vmem(rsp + qf_scale_slot(v)));
        vpaddd(qacc(m, v), qacc(m, v), t0);
      }
    }
  }
  // Int16-lane super-block folds (kQGroupLaneFold, avx2; groups of <= 8 K steps): per group the
  // int16 lanes (qacc) start at zero and take its K steps (vpaddw); at its end vpmaddwd by the
  // sub-scales (in both words of each column's dword) and vpaddd add them into the super block's
  // int32 sums X on the stack (qw_part_slot), and the group's sub-biases are copied to the stack
  // (ql_bias_slot). Byte codes (<= 32: 8 products of a lane reach 32512) fold every
  // kQGroupByteLaneSteps K steps instead, with the group's sub-scale pairs from the stack
  // (qf_scale_slot, written before its steps). At the super block's end, with a bias, Y = sum of
  // sub-bias * s_g is formed in the qacc registers two groups at a time (int16 pairs: (s_2p,
  // s_2p+1) of the row broadcast, the columns' (sub-bias_2p, sub-bias_2p+1) from vpunpcklbw +
  // vpmovsxbw; vpmaddwd, vpaddd), then t = fma(scale factor, float(X), t), t = fma(bias factor,
  // float(Y), t).
  void k_loop_qgroup_lanes(bool prefetch_next) {
    Label super, group, pair, done;
    mov(reg_gc, arg(offsetof(GemmArgs, s_per_strip)));
    if (qgb_) gsum_of_block_rows();
    test(reg_gc, reg_gc);
    jle(done, T_NEAR);
    const Xmm t = vreg(14), u = vreg(13), mbv = vreg(12);
    const Xmm b[4] = {vreg(8), vreg(15), vreg(9), vreg(10)};  // the rows' s_g pairs
    L(super);
    {
      mov(reg_sb, reg_w);
      advance_w(qg_header_bytes());
      vpxor(t, t, t);
      for (int m = 0; m < mr_; ++m)
        for (int v = 0; v < nv_; ++v) vmovdqu(vmem(rsp + qw_part_slot(m, v)), t);
      mov(reg_sg, arg(offsetof(GemmArgs, g_per_super)));
      L(group);
      {
        dec(reg_sg);  // the groups after this one: its sub-bias slot
        if (qglb_) {  // the sub-scale pairs, after the group's codes, to the stack for its folds
          mov(reg_k, arg(offsetof(GemmArgs, g_steps)));
          imul(reg_k, reg_k, step_bytes());
          for (int v = 0; v < nv_; ++v) {
            sub_scale_pairs(t, qword[reg_w + reg_k + sv(v) * lanes_]);
            vmovdqu(vmem(rsp + qf_scale_slot(v)), t);
          }
        }
        if (!qgroup_first_writes())
          for (int m = 0; m < mr_; ++m)
            for (int v = 0; v < nv_; ++v) vpxor(qacc(m, v), qacc(m, v), qacc(m, v));
        qgroup_steps(prefetch_next);  // its first step writes the int16 lanes (bytes: folds them)
        for (int v = 0; v < nv_ && !qglb_; ++v) {
          sub_scale_pairs(t, qword[reg_w + sv(v) * lanes_]);
          for (int m = 0; m < mr_; ++m) lane_fold(m, v, t);
        }
        if (qgb_) {  // the strip_cols() sub-biases: one ymm, or (tail strips) a qword a vector
          lea(reg_k, ptr[reg_sg * 8]);
          if (sv_ == kStripVecs) {
            vmovdqu(t, yword[reg_w + strip_cols()]);
            vmovdqu(yword[rsp + reg_k * 4 + ql_bias_slot()], t);
          } else {  // every vector's, whatever the pass (the pairs below read by strip vector)
            for (int v = 0; v < sv_; ++v) {
              vmovq(Xmm(t.getIdx()), qword[reg_w + strip_cols() + v * lanes_]);
              vmovq(qword[rsp + reg_k * 4 + ql_bias_slot() + v * lanes_], Xmm(t.getIdx()));
            }
          }
        }
        advance_w(qg_extra_bytes());
        qgroup_prefetch_scales(prefetch_next);
        test(reg_sg, reg_sg);
        jnz(group, T_NEAR);
      }
      if (qgb_) {
        for (int m = 0; m < mr_; ++m)
          for (int v = 0; v < nv_; ++v) vpxor(qacc(m, v), qacc(m, v), qacc(m, v));
        mov(reg_sg, arg(offsetof(GemmArgs, g_per_super)));
        shr(reg_sg, 1);
        mov(reg_k, arg(offsetof(GemmArgs, g_per_super)));
        shl(reg_k, 5);
        lea(reg_k, ptr[rsp + reg_k + ql_bias_slot() - 32]);  // group 2p's slot; 2p + 1 below it
        L(pair);
        {
          for (int m = 0; m < mr_; ++m) vmovd(Xmm(b[m].getIdx()), dword[reg_gsum + m * 4]);
          add(reg_gsum, arg(offsetof(GemmArgs, a_gsum_ld)));
          for (int m = 0; m < mr_; ++m) {
            const Xmm x(b[m].getIdx());
            vpinsrw(x, x, word[reg_gsum + m * 4], 1);
            vpbroadcastd(b[m], x);
          }
          add(reg_gsum, arg(offsetof(GemmArgs, a_gsum_ld)));
          for (int v = 0; v < nv_; ++v) {
            const Xmm xm(mbv.getIdx()), xu(u.getIdx());
            vmovq(xm, qword[reg_k + sv(v) * lanes_]);
            vmovq(xu, qword[reg_k - 32 + sv(v) * lanes_]);
            vpunpcklbw(xm, xm, xu);
            vpmovsxbw(mbv, xm);
            for (int m = 0; m < mr_; ++m) {
              vpmaddwd(t, mbv, b[m]);
              vpaddd(qacc(m, v), qacc(m, v), t);
            }
          }
          sub(reg_k, 64);
          dec(reg_sg);
          jnz(pair, T_NEAR);
        }
      }
      for (int v = 0; v < nv_; ++v)
        for (int m = 0; m < mr_; ++m)
          with_fp32_acc(m, v, u, [&](const Xmm& fa) {
            vcvtdq2ps(t, vmem(rsp + qw_part_slot(m, v)));
            vfmadd231ps(fa, t, vmem(reg_sb + sv(v) * vec_bytes()));
            if (qgb_) {
              vcvtdq2ps(qacc(m, v), qacc(m, v));
              vfmadd231ps(fa, qacc(m, v), vmem(reg_sb + (sv_ + sv(v)) * vec_bytes()));
            }
          });
      dec(reg_gc);
      jnz(super, T_NEAR);
    }
    L(done);
  }
  // X of (row m, vector v) += vpmaddwd(its int16 lanes, the sub-scale pairs `subs`).
  void lane_fold(int m, int v, const Operand& subs) {
    vpmaddwd(qacc(m, v), qacc(m, v), subs);
    vpaddd(qacc(m, v), qacc(m, v), vmem(rsp + qw_part_slot(m, v)));
    vmovdqu(vmem(rsp + qw_part_slot(m, v)), qacc(m, v));
  }
  // Int16-lane folds with a bias: the sub-biases of the super block's group with r groups after
  // it at ql_bias_slot() + 32 r.
  int ql_bias_slot() const { return qw_part_slot(mr_, 0); }
  // The stack slot of vector v's int16 sub-scale pairs (int32 folds, byte lane folds), above the
  // 2-row tiles' fp32 accumulators; qf_scale_slot(nv_) is the qgroup kernels' stack size.
  int qf_scale_slot(int v) const {
    return (qgs2_ ? kQgAccStack + mr_ * nv_ * 64 : 16) + (qgf32_ || qglb_ ? v * 32 : 0);
  }
  // int16 group sums (kQGroupI16): the int32 part of (row m, vector v)'s group sum that groups of
  // more than kQGroupI16Steps K steps widen into on the way, above the other slots; fp32
  // super-block partials (kQGroupSuperSums): (row m, vector v)'s fp32 sum over the super blocks
  // done.
  int qw_part_slot(int m, int v) const { return qf_scale_slot(nv_) + (m * nv_ + v) * vec_bytes(); }

  void vpxord_any(const Xmm& x) {
    if (zmm_isa())
      vpxord(x, x, x);
    else
      vpxor(x, x, x);
  }

  // Registers free at a group end (the codes' and broadcasts' scratch; the table, mask and ones
  // stay): 6 at VNNI levels (8 for byte codes, which take no table or mask: a 6-row half-strip
  // tile's rows' s_g, scale and bias vectors), 8 at avx512, 5 at avx2.
  Xmm qend_tmp(int i) const {
    static constexpr int kVnni[] = {24, 25, 26, 27, 28, 31, 29, 30};
    if (vnni_ && qg4_ && i >= 6) throw std::logic_error("gemm: 6 group-end registers with nibbles");
    static constexpr int kZmm[] = {16, 17, 18, 19, 20, 21, 22, 23};
    static constexpr int kYmm[] = {8, 12, 13, 14, 15};
    return vreg(vnni_ ? kVnni[i] : zmm_isa() ? kZmm[i] : kYmm[i]);
  }
  // The group's scale (b = 0) or bias (b = 1) vector v as fp32 in `t`: 16-bit values widened
  // exactly, or two-level float(sub) * factor (exact: the one-level fp32 scale).
  void qgroup_scale_vector(const Xmm& t, int v, int b) {
    if (qgh_) {
      const RegExp h = reg_w + (b * strip_cols() + sv(v) * lanes_) * 2;
      const Address half = zmm_isa() ? Address(yword[h]) : Address(xword[h]);
      if (qgh_ == 1) {
        vcvtph2ps(t, half);
      } else {
        vpmovzxwd(t, half);
        vpslld(t, t, 16);
      }
      return;
    }
    const RegExp sub = reg_w + b * strip_cols() + sv(v) * lanes_;
    if (zmm_isa())
      vpmovsxbd(t, xword[sub]);
    else
      vpmovsxbd(t, qword[sub]);
    vcvtdq2ps(t, t);
    if (!qgp_)  // fp32 super-block partials take the factor at the super block's end
      vmulps(t, t, vmem(reg_sb + (b * sv_ + sv(v)) * vec_bytes()));
  }

  // t = fma(scale_g, float(acc_g), t); t = fma(bias_g, float(s_g), t); VNNI: acc_g -= 128 * s_g
  // first (the codes' +128), offset codes: acc_g -= c0 * s_g. Two passes: the rows' group sums
  // become fp32 (s_g kept for the bias term), then each scale (bias) vector is built once for all
  // rows of the tile.
  void qgroup_group_end(bool prefetch_next) {
    if (qgw_) {  // the int16 lanes' sums in int32, plus the parts a long group widened on the way
      for (int m = 0; m < mr_; ++m)
        for (int v = 0; v < nv_; ++v) widen_lanes(qacc(m, v), qacc(m, v));
      Label whole;
      cmp(arg(offsetof(GemmArgs, g_steps)), formats::kQGroupI16Steps);
      jle(whole, T_NEAR);
      const Xmm z = qend_tmp(0);
      vpxord_any(z);
      for (int m = 0; m < mr_; ++m)
        for (int v = 0; v < nv_; ++v) {
          vpaddd(qacc(m, v), qacc(m, v), vmem(rsp + qw_part_slot(m, v)));
          vmovups(vmem(rsp + qw_part_slot(m, v)), z);
        }
      L(whole);
    }
    // 128 * s_g at the VNNI levels, but for offset codes (qgo_) and the signed codes of the int32
    // folds (the super block's header instead); c0 * s_g for offset codes
    int shift = vnni_ && !qgf_ && !qgo_ ? 7 : -1;
    for (int b = 0; qc0_ >> b; ++b) shift = b;  // log2(c0) (a power of two)
    const int kept = qgb_ ? mr_ : 0;            // qend_tmp(m): row m's s_g as fp32
    for (int m = 0; m < mr_; ++m) {
      const Xmm gs = qend_tmp(qgb_ ? m : kept);  // s_g of the row, broadcast
      const Xmm gc = qend_tmp(kept + 1);         // 128 * s_g (VNNI), c0 * s_g (offset codes)
      if (gsum_) vpbroadcastd(gs, dword[reg_gsum + m * 4]);
      if (shift >= 0) vpslld(gc, gs, uint8_t(shift));
      if (qgb_) vcvtdq2ps(gs, gs);
      for (int v = 0; v < nv_; ++v) {
        if (shift >= 0) vpsubd(qacc(m, v), qacc(m, v), gc);
        vcvtdq2ps(qacc(m, v), qacc(m, v));
      }
    }
    const bool built = qgs_ || qgh_;  // scale vectors built in registers (fp32: memory operands)
    const Xmm sc = qend_tmp(kept), bi = qend_tmp(kept + 1);
    // the fp32 accumulator: in its register, or (2-row avx2 tiles) loaded from the stack
    const Xmm fa_tmp = qgs2_ ? qend_tmp(kept + 2) : sc;  // (avx2 2-row tiles only)
    const Reg64 qss_w = reg_k;  // (free after the group's K steps)
    if (qss_mode_ == Qss::store) mov(qss_w, qword[rsp + kQssWriteStack]);
    for (int v = 0; v < nv_; ++v) {
      if (qss_mode_ == Qss::load) {  // built by the call's first block
        vmovups(sc, vmem(reg_sb + sv(v) * vec_bytes()));
        if (qgb_) vmovups(bi, vmem(reg_sb + (sv_ + sv(v)) * vec_bytes()));
      } else if (built) {
        qgroup_scale_vector(sc, v, 0);
        if (qgb_) qgroup_scale_vector(bi, v, 1);
        if (qss_mode_ == Qss::store) {
          vmovups(vmem(qss_w + sv(v) * vec_bytes()), sc);
          if (qgb_) vmovups(vmem(qss_w + (sv_ + sv(v)) * vec_bytes()), bi);
        }
      }
      for (int m = 0; m < mr_; ++m)
        with_fp32_acc(m, v, fa_tmp, [&](const Xmm& fa) {
          if (built) {
            vfmadd231ps(fa, qacc(m, v), sc);
            if (qgb_) vfmadd231ps(fa, qend_tmp(m), bi);
          } else {
            vfmadd231ps(fa, qacc(m, v), vmem(reg_w + sv(v) * vec_bytes()));
            if (qgb_) vfmadd231ps(fa, qend_tmp(m), vmem(reg_w + (sv_ + sv(v)) * vec_bytes()));
          }
        });
    }
    advance_w(qg_extra_bytes());
    if (qss_mode_ == Qss::load) add(reg_sb, qss_group_bytes());
    if (qss_mode_ == Qss::store) add(qword[rsp + kQssWriteStack], qss_group_bytes());
    if (gsum_) add(reg_gsum, arg(offsetof(GemmArgs, a_gsum_ld)));
    qgroup_prefetch_scales(prefetch_next);
  }

  // A group's K steps. g_steps is a multiple of 4 (G a multiple of 16): whole unrolled
  // iterations, nibble pairs (and the int32 folds' step pairs) never split.
  void qgroup_steps(bool prefetch_next) {
    Label inner, end;
    const bool peel = qgroup_first_writes();  // the group's first steps unrolled on their own
    auto steps = [&](int n, bool first) {
      first_step_ = first;
      for (int u = 0; u < n; ++u) microkernel(u, prefetch_next);
      first_step_ = false;
      advance(n, prefetch_next);
    };
    auto widen = [&] {
      for (int m = 0; m < mr_; ++m)
        for (int v = 0; v < nv_; ++v)
          if (half_)
            widen_int16_sums(qacc(m, v), cpool(c_ones16_), rsp + qw_part_slot(m, v), qend_tmp(0));
          else
            widen_int16_sums(qacc(m, v), qones(), rsp + qw_part_slot(m, v), qend_tmp(0));
    };
    mov(reg_k, arg(offsetof(GemmArgs, g_steps)));
    if (qglb_) {  // byte lane folds: every kQGroupByteLaneSteps steps write the lanes, then fold
      static_assert(formats::kQGroupByteLaneSteps == kUnroll);
      L(inner);
      steps(kUnroll, true);
      for (int v = 0; v < nv_; ++v)
        for (int m = 0; m < mr_; ++m) lane_fold(m, v, vmem(rsp + qf_scale_slot(v)));
      sub(reg_k, kUnroll);
      jg(inner, T_NEAR);
      return;
    }
    if (qgw_ && !qgl_) {  // int16 lanes: kQGroupI16Steps steps, then (group not done) widen
      static_assert(formats::kQGroupI16Steps == 2 * kUnroll);
      Label eight;
      // kQGroupI16Steps steps (then, the group not done, widen and go on at `eight`) or a last 4
      auto block = [&](bool first) {
        Label four;
        cmp(reg_k, formats::kQGroupI16Steps);
        jl(four, T_NEAR);
        steps(formats::kQGroupI16Steps, first);
        sub(reg_k, formats::kQGroupI16Steps);
        jle(end, T_NEAR);
        widen();
        jmp(eight, T_NEAR);
        L(four);  // g_steps is a multiple of 4: a group's last (or only) 4 steps
        steps(kUnroll, first);
        if (first) jmp(end, T_NEAR);
      };
      if (peel) block(true);  // the group's first block writes the lanes
      L(eight);
      block(false);
      L(end);
      return;
    }
    if (peel) {
      steps(kUnroll, true);
      sub(reg_k, kUnroll);
      jle(end, T_NEAR);
    }
    L(inner);
    steps(kUnroll, false);
    sub(reg_k, kUnroll);
    jg(inner, T_NEAR);
    L(end);
  }
  // At a group's end: the next strip's scale lines, pf_lines_ per group and block.
  void qgroup_prefetch_scales(bool prefetch_next) {
    if (!prefetch_next) return;
    if (pf_var_) {
      pf_var_site();
      return;
    }
    for (int i = 0; i < pf_lines_; ++i) prefetcht1(ptr[reg_pf + i * 64]);
    add(reg_pf, 64 * pf_lines_);
  }

  // The codes of vector v at K step u into `dst` as the level multiplies them: bytes as stored
  // (VNNI: code + 128, offset codes code + c0), or the nibble looked up in the lanes' 16-entry
  // table (identity tables: the nibble itself).
  void qgroup_codes(const Xmm& dst, int v, int u) {
    const Address mem = weight_mem(v, u);
    if (!qg4_) {
      if (zmm_isa())
        vmovdqu8(dst, mem);
      else
        vmovdqu(dst, mem);
      return;
    }
    if (zmm_isa()) {
      if (u % 2 == 0) {
        vpandd(dst, qmask(), mem);
      } else {
        vpsrlw(dst, mem, 4);
        vpandd(dst, dst, qmask());
      }
    } else {
      if (qmask_in_memory()) {
        vmovdqu(dst, mem);
        if (u % 2) vpsrlw(dst, dst, 4);
        vpand(dst, dst, cpool(c_0f_));
      } else if (u % 2 == 0) {
        vpand(dst, qmask(), mem);
      } else {
        vmovdqu(dst, mem);
        vpsrlw(dst, dst, 4);
        vpand(dst, dst, qmask());
      }
    }
    if (!qgi_) vpshufb(dst, qlut(), dst);
  }

  // The int16 pair sums `t` (vpmaddubsw's) into the group accumulator: int16 lanes (kQGroupI16,
  // widened at the group end), else int32 (vpmaddwd with ones, then vpaddd).
  void qgroup_add_pairs(const Xmm& acc, const Xmm& t) {
    if (qgw_) {
      vpaddw(acc, acc, t);
      return;
    }
    widen_lanes(t, t);
    vpaddd(acc, acc, t);
  }
  // vpmaddubsw(src1 unsigned, src2 signed) into the group accumulator through `t`. The group's
  // first step (`first`, see qgroup_steps) writes the accumulator instead: the int16 pair sums
  // themselves, or (int32) their vpmaddwd with ones, so no group starts by zeroing it.
  void qgroup_madd(const Xmm& acc, const Xmm& t, const Xmm& src1, const Operand& src2, bool first) {
    if (first && qgw_) {
      vpmaddubsw(acc, src1, src2);
      return;
    }
    vpmaddubsw(t, src1, src2);
    if (first)
      widen_lanes(acc, t);
    else
      qgroup_add_pairs(acc, t);
  }
  // Whether a group's first K step writes its accumulators (qgroup_madd) rather than adding to
  // zeroed ones: every qgroup kernel but the VNNI ones (vpdpbusd only accumulates) and the int32
  // folds (whose sums run over a super block).
  bool qgroup_first_writes() const { return !vnni_ && !qgf_; }

  void microkernel_qgroup(int u) {
    if (qgf32_) {
      microkernel_qgroup_fold(u);
      return;
    }
    const bool first = first_step_ && u == 0;
    if (qgs2_) {  // avx2, 2 rows: each code vector decoded once for both rows (ymm 8, 15: the rows'
      // broadcasts; 12: codes; 13: |codes|; 14: products; 9 ones, 10 table, 11 mask). Half-strip
      // tiles keep rows 2 and 3 in ymm 9 and 10: their ones come from memory, a table sits in 11
      // and then the mask comes from memory (qlut, qmask_in_memory, widen_lanes).
      const Xmm b[4] = {vreg(8), vreg(15), vreg(9), vreg(10)};
      const Xmm w = vreg(12), wa = vreg(13), t = vreg(14);
      for (int m = 0; m < mr_; ++m) vpbroadcastd(b[m], dword[a_row(m) + 4 * u]);
      for (int v = 0; v < nv_; ++v) {
        qgroup_codes(w, v, u);
        if (!qgo_) vpabsb(wa, w);
        for (int m = 0; m < mr_; ++m) {
          if (qgo_) {  // offset codes: (code + c0) unsigned x signed a
            qgroup_madd(qacc(m, v), t, w, b[m], first);
          } else {  // |code| x a * sign(code)
            vpsignb(t, b[m], w);
            qgroup_madd(qacc(m, v), t, wa, t, first);
          }
        }
      }
      return;
    }
    if (qgo_ && !vnni_) {  // offset codes: acc += (code + c0) * a, the table's entries in [0, 129]
      const bool pre = zmm_isa();  // zmm: the code vectors decoded once for the tile's rows
      if (pre)
        for (int v = 0; v < nv_; ++v) qgroup_codes(qw(v), v, u);
      for (int m = 0; m < mr_; ++m) {
        vpbroadcastd(qbcast(), dword[a_row(m) + 4 * u]);
        for (int v = 0; v < nv_; ++v) {
          const Xmm w = qw(v), t = pre ? qtmp(v) : w;
          if (!pre) qgroup_codes(w, v, u);
          // pair sums <= 2 * 129 * 127 < 2^15: exact
          qgroup_madd(qacc(m, v), t, w, qbcast(), first);
        }
      }
      return;
    }
    if (vnni_) {  // acc += (code + 128) * a over 4 k (unsigned x signed), or (code + c0) * a for
      // offset codes (qgo_); with the signed codes of kQGroupIntFold (a + 128) * code (the
      // header's correction comes off per super block)
      for (int v = 0; v < nv_; ++v) qgroup_codes(qw(v), v, u);
      for (int m = 0; m < mr_; ++m) {
        vpbroadcastd(qbcast(), dword[a_row(m) + 4 * u]);
        for (int v = 0; v < nv_; ++v)
          if (qgf_)
            vpdpbusd(qacc(m, v), qbcast(), qw(v));
          else
            vpdpbusd(qacc(m, v), qw(v), qbcast());
      }
      return;
    }
    if (zmm_isa()) {  // |code| x (a negated where code < 0): opmask k(1+v) = code < 0
      for (int v = 0; v < nv_; ++v) {
        qgroup_codes(qw(v), v, u);
        vpmovb2m(Opmask(1 + v), qw(v));
        vpabsb(qw(v), qw(v));  // -128 -> 0x80, which is 128 as the unsigned operand
      }
      for (int m = 0; m < mr_; ++m) {
        vpbroadcastd(qbcast(), dword[a_row(m) + 4 * u]);
        vpsubb(qneg(), qzero(), qbcast());
        for (int v = 0; v < nv_; ++v) {
          const Xmm t = qtmp(v);
          vpblendmb(t | Opmask(1 + v), qbcast(), qneg());
          qgroup_madd(qacc(m, v), t, qw(v), t, first);
        }
      }
      return;
    }
    for (int m = 0; m < mr_; ++m) {  // avx2: vpsignb applies the code's sign to a
      vpbroadcastd(qbcast(), dword[a_row(m) + 4 * u]);
      for (int v = 0; v < nv_; ++v) {
        const Xmm w = qw(v), sa = qs(v);
        qgroup_codes(w, v, u);
        vpsignb(sa, qbcast(), w);
        vpabsb(w, w);
        qgroup_madd(qacc(m, v), w, w, sa, first);
      }
    }
  }

  void k_loop(bool prefetch_next) {
    if (i4w_) {
      k_loop_int4w(prefetch_next);
      return;
    }
    if (qg_) {
      if (qgf32_)
        k_loop_qgroup_fold(prefetch_next);
      else if (qgl_)
        k_loop_qgroup_lanes(prefetch_next);
      else
        k_loop_qgroup(prefetch_next);
      return;
    }
    if (fp8_) {
      k_loop_fp8(prefetch_next);
      return;
    }
    if (fuse_ && mxp_) {
      k_loop_mx_fused(prefetch_next);
      return;
    }
    if (mx8d_) {
      k_loop_mx8_pairs();
      return;
    }
    if (mx_ && !sfma_ && !mxp_) {
      k_loop_mx(prefetch_next);
      return;
    }
    // K steps (bf16, mx strip-scratch: k pairs) unrolled by kUnroll, then one by one.
    auto step = [&](int u) {
      if (sfma_)
        microkernel_sfma(u, prefetch_next);
      else if (pairs_ || mxp_)
        microkernel_pairs(u, prefetch_next);
      else
        microkernel(u, prefetch_next);
    };
    auto move_on = [&](int steps) {
      if (sfma_)
        advance_sfma(steps, prefetch_next);
      else if (pairs_ || mxp_)
        advance_pairs(steps, prefetch_next);
      else
        advance(steps, prefetch_next);
    };
    Label loop, tail, tail_loop, done;
    mov(reg_k, arg(offsetof(GemmArgs, k4)));
    if (sfma_ || mxp_) shr(reg_k, 1);  // mx strip-scratch and pair kernels: k pairs (K % 32 == 0)
    cmp(reg_k, kUnroll);
    jl(tail, T_NEAR);
    L(loop);
    {
      for (int u = 0; u < kUnroll; ++u) step(u);
      move_on(kUnroll);
      sub(reg_k, kUnroll);
      cmp(reg_k, kUnroll);
      jge(loop, T_NEAR);
    }
    L(tail);
    test(reg_k, reg_k);
    jle(done, T_NEAR);
    L(tail_loop);
    {
      // 4-bit strips pack two K steps per byte block (k4 is even), so their tail goes by pairs.
      const int g = int4_ ? 2 : 1;
      for (int u = 0; u < g; ++u) step(u);
      move_on(g);
      sub(reg_k, g);
      jnz(tail_loop, T_NEAR);
    }
    L(done);
  }

  // int4 below the VNNI levels (int4_int16_sums): kInt4SumSteps K steps at a time add their
  // vpmaddubsw pair sums in the int16 accumulator registers, then widen them into the int32 sums
  // on the stack; the tail (an even number of steps below kInt4SumSteps) likewise.
  static constexpr int kI4AccStack = 16;
  void k_loop_int4w(bool prefetch_next) {
    Label loop, tail, tail_loop, done;
    mov(reg_k, arg(offsetof(GemmArgs, k4)));
    cmp(reg_k, kInt4SumSteps);
    jl(tail, T_NEAR);
    L(loop);
    {
      first_step_ = true;  // the lanes' first step writes them (the flush leaves them as they are)
      for (int u = 0; u < kInt4SumSteps; ++u) microkernel(u, prefetch_next);
      first_step_ = false;
      advance(kInt4SumSteps, prefetch_next);
      int4w_flush();
      sub(reg_k, kInt4SumSteps);
      cmp(reg_k, kInt4SumSteps);
      jge(loop, T_NEAR);
    }
    for (int m = 0; m < mr_; ++m)  // the flushed lanes were left as they were: zero for the tail
      for (int v = 0; v < nv_; ++v) vpxord_any(acc(m, v));
    L(tail);
    test(reg_k, reg_k);
    jle(done, T_NEAR);
    L(tail_loop);
    {
      for (int u = 0; u < 2; ++u) microkernel(u, prefetch_next);  // k4 is even: whole pairs
      advance(2, prefetch_next);
      sub(reg_k, 2);
      jnz(tail_loop, T_NEAR);
    }
    int4w_flush();
    L(done);
  }
  void int4w_flush() {  // the lanes are left as they are: the next block's first step writes them
    for (int m = 0; m < mr_; ++m)  // ones16() is free: these kernels take the ones from memory
      for (int v = 0; v < nv_; ++v)
        widen_int16_sums(acc(m, v), cpool(c_ones16_), rsp + acc_slot(m, v), ones16(), false);
  }
  // The int32 sum at `slot` += vpmaddwd(int16 sums, ones) (through `t`); with `zero`, the int16
  // sums start again at zero. int4 K loops and long qgroup groups (kQGroupI16) widen their lanes
  // with it.
  void widen_int16_sums(const Xmm& sums, const Operand& ones, const RegExp& slot, const Xmm& t,
                        bool zero = true) {
    vpmaddwd(t, sums, ones);
    vpaddd(t, t, vmem(slot));
    vmovups(vmem(slot), t);
    if (zero) vpxord_any(sums);
  }
  // One K step: each vector's nibbles (low nibble: even step, high: odd), the unsigned codes
  // q4 + 8 (int4_offset_nibbles), masked with the 0x0F bytes held in aux() and multiplied by every
  // row's signed activations, broadcast into its own register where the tile leaves them free
  // (avx2: its 2-row tiles; zmm: <= 5 rows), else reloaded per vector; |pair| <= 2 * 15 * 127.
  void microkernel_int4w(int u) {
    const Xmm w = tmp(0), t = ones16();
    const bool held = mr_ * nv_ + mr_ <= num_vregs() - 4;
    auto row = [&](int m) { return held ? vreg(mr_ * nv_ + m) : bcast(); };
    if (held)
      for (int m = 0; m < mr_; ++m) vpbroadcastd(row(m), dword[a_row(m) + 4 * u]);
    for (int v = 0; v < nv_; ++v) {
      vmovups(w, weight_mem(v, u));
      if (u % 2) vpsrlw(w, w, 4);
      if (zmm_isa())
        vpandd(w, w, aux());
      else
        vpand(w, w, aux());
      for (int m = 0; m < mr_; ++m) {
        if (!held) vpbroadcastd(row(m), dword[a_row(m) + 4 * u]);
        if (first_step_ && u == 0) {
          vpmaddubsw(acc(m, v), w, row(m));
          continue;
        }
        vpmaddubsw(t, w, row(m));
        vpaddw(acc(m, v), acc(m, v), t);
      }
    }
  }

  // bf16 pairs (vdpbf16ps): reg_w walks the strip ([k/2][column][2], nv_ * 64 bytes a pair; fp8
  // and mx pair prefill: the scratch it decoded the strip into),
  // reg_a / reg_a3 the bf16 activation rows (4 bytes a pair). Per pair: the strip's vectors into
  // wreg, then one vdpbf16ps per (row, vector) with the row's pair broadcast from memory. While
  // prefetching, bf16 tiles that take their call's tail rows (avx512_bf16) pull their share of
  // the next strip (pf_var_); others each pair step two lines of it (a full strip holds 4 lines
  // a K pair), so the first kPairPrefetchBlocks = 2 blocks (every pair call has >= 2) cover it;
  // an fp8 or mxfp8 strip holds about 2 lines a K pair and an mxfp4 one about 1, so the first
  // block pulls that many (pair_pf_bytes) and covers it. k_loop drives these over the k pairs
  // (k_loop_fp8 for fp8 pair prefill, into the group sums).
  static constexpr int kPairPrefetchBlocks = 2;
  int pair_pf_bytes() const { return mxp_ && mx4_ ? 64 : 128; }  // (mx: ~3 % short, the scales)
  void microkernel_pairs(int u, bool prefetch_next) {
    if (prefetch_next && pf_var_) {
      if (u % 2 == 0) pf_var_site();
    } else if (prefetch_next)
      for (int off = 0; off < pair_pf_bytes(); off += 64)
        prefetcht1(ptr[reg_pf + u * pair_pf_bytes() + off]);
    if (ahead_)
      for (int v = 0; v < nv_; ++v)
        prefetcht0(ptr[reg_w + (u * nv_ + v) * 64 + prefill_read_ahead_bytes()]);
    for (int v = 0; v < nv_; ++v) vmovups(wreg(v), zword[reg_w + (u * nv_ + v) * 64]);
    // The row's pair goes through a register (one vpbroadcastd, renamed row after row) rather
    // than as an embedded {1to16} broadcast per vdpbf16ps: on a Zen 5 a 6 x 4 tile of
    // memory-broadcast dots ran at 86 % of the dot peak, register broadcasts at 99-100 %
    // (the same for vpdpbusd; docs/BENCHMARKS.md, Zen 5).
    const Xmm b = fp8p_ && fp8_scale_regs() ? vreg(30) : bcast();  // zmm28-29: the group scales
    for (int m = 0; m < mr_; ++m) {
      vpbroadcastd(b, dword[a_row(m) + 4 * u]);
      for (int v = 0; v < nv_; ++v) vdpbf16ps(fp8p_ ? gacc(m, v) : acc(m, v), wreg(v), b);
    }
  }
  void advance_pairs(int pairs, bool prefetch_next, int w_bytes_per_pair = 0) {
    if (prefetch_next && !pf_var_) add(reg_pf, pair_pf_bytes() * pairs);
    advance_rows(4 * pairs);
    add(reg_w, (w_bytes_per_pair ? w_bytes_per_pair : nv_ * 64) * pairs);
  }

  // Moves the weight stream on by `bytes`. Decode kernels first prefetch the lines that many
  // bytes further on at decode_prefetch_bytes() ahead: the stream is sequential over the whole
  // call (strip after strip), and the hardware prefetcher alone left 10-25 % of the read
  // bandwidth unused on a Xeon (not on a Zen 4: decode_prefetch_bytes).
  void advance_w(int bytes) {
    const int ahead = decode_prefetch_bytes(key_);
    if (!prefill_ && ahead > 0)
      for (int off = 0; off < bytes; off += 64) prefetcht0(ptr[reg_w + ahead + off]);
    add(reg_w, bytes);
  }
  void advance(int steps, bool prefetch_next) {
    const int a_bytes = bf16_ ? 8 : 4;  // bf16 FMA kernels: two fp32 activations a step
    if (prefetch_next && !pf_var_) add(reg_pf, 64 * pf_lines_ * ((steps + 1) / 2));
    advance_rows(a_bytes * steps);
    if (pf_spread_)  // (the steps asked for their lines: microkernel)
      add(reg_w, step_bytes() * steps);
    else
      advance_w(step_bytes() * steps);
  }
  // Moves the tile's row pointers (a_row: 3 rows each) on by `bytes`.
  void advance_rows(int bytes) {
    add(reg_a, bytes);
    if (mr_ > 3) add(reg_a3, bytes);
    if (mr_ > 6) add(reg_a6, bytes);  // (the 12-row tiles: rows2v_kernel)
    if (mr_ > 9) add(reg_a9, bytes);
  }

  // One K step (`u` steps past the pointers): 4 k for every (row, vector) of the tile.
  void microkernel(int u, bool prefetch_next) {
    if (prefetch_next && u % 2 == 0 && pf_var_) {
      pf_var_site();
    } else if (prefetch_next && u % 2 == 0) {
      for (int i = 0; i < pf_lines_; ++i) prefetcht1(ptr[reg_pf + (u / 2 * pf_lines_ + i) * 64]);
    }
    if (pf_spread_) {  // this step's lines, decode_prefetch_bytes() on (advance leaves them)
      const int ahead = decode_prefetch_bytes(key_);
      for (int off = 0; off < step_bytes() && ahead > 0; off += 64)
        prefetcht0(ptr[reg_w + u * step_bytes() + ahead + off]);
    }
    if (i4w_) {
      microkernel_int4w(u);
      return;
    }
    if (bf16_) {
      microkernel_bf16(u);
      return;
    }
    if (fp8p_) {
      microkernel_fp8_pairs(u);
      return;
    }
    if (fp8_) {
      microkernel_fp8(u);
      return;
    }
    if (mx_) {
      microkernel_mx(u);
      return;
    }
    if (qg_) {
      microkernel_qgroup(u);
      return;
    }
    const bool preload = vnni_ && (mr_ > 1 || int4_);
    if (ahead_)
      for (int v = 0; v < nv_; ++v)
        prefetcht0(
            ptr[reg_w + u * strip_k4_bytes() + sv(v) * vec_bytes() + prefill_read_ahead_bytes()]);
    if (preload)
      for (int v = 0; v < nv_; ++v) load_weights(wreg(v), v, u);
    for (int m = 0; m < mr_; ++m) {
      load_activation(m, u);
      for (int v = 0; v < nv_; ++v) {
        if (vnni_) {
          if (preload)
            vpdpbusd(acc(m, v), bcast(), wreg(v));
          else
            vpdpbusd(acc(m, v), bcast(), weight_mem(v, u));
        } else {
          dot4_signed(acc(m, v), v, u);
        }
      }
    }
  }

  // bf16: acc += a[m][k] * float(w[k][n]), k in order. A step is a k pair: each dword of the
  // strip holds (w[2s][n], w[2s+1][n]), so the even weight as fp32 is the dword << 16 and the odd
  // one the dword & 0xffff0000. zmm: both straight from memory, FMAs with the row's activation
  // broadcast from memory ({1to16}); ymm (16 registers): the even pass then the odd pass, each
  // with the rows' activations broadcast into row_bcast.
  void microkernel_bf16(int u) {
    const RegExp w0 = reg_w + u * strip_cols() * 4;  // a k pair of bf16
    if (zmm_isa()) {
      const Zmm even(30), odd(31), mask(29);
      for (int v = 0; v < nv_; ++v) {
        vpslld(even, zword[w0 + v * 64], 16);
        vpandd(odd, mask, zword[w0 + v * 64]);
        for (int m = 0; m < mr_; ++m) vfmadd231ps(acc(m, v), even, ptr_b[a_row(m) + 8 * u]);
        for (int m = 0; m < mr_; ++m) vfmadd231ps(acc(m, v), odd, ptr_b[a_row(m) + 8 * u + 4]);
      }
      return;
    }
    const Ymm t = Ymm(15);
    for (int half = 0; half < 2; ++half) {
      for (int m = 0; m < mr_; ++m) vbroadcastss(row_bcast(m), dword[a_row(m) + 8 * u + 4 * half]);
      for (int v = 0; v < nv_; ++v) {
        vmovdqu(t, yword[w0 + v * 32]);
        if (half == 0)
          vpslld(t, t, 16);
        else
          vpand(t, t, yword[rip + c_hi16_]);
        for (int m = 0; m < mr_; ++m) vfmadd231ps(acc(m, v), t, row_bcast(m));
      }
    }
  }

  // fp8: the byte as fp16 bits — sign-extended to a word, << 7, & 0xbf80 keeps the sign and the
  // 7 magnitude bits, i.e. the e4m3 value * 2^-8 (subnormal codes become fp16 subnormals) — then
  // vcvtph2ps widens it exactly (no fp32 subnormal is ever an operand); times the strip half's
  // group scale * 2^8 (fp8_group_scales, exact), so w' rounds exactly as value * scale; then one
  // FMA per row. The NaN codes (S.1111.111) decode as +-480 * scale, as in gemm_ref.
  static constexpr int kFp8ScaleStack = 16;  // [rsp]: strips left, [rsp + 8]: the scale table
  // fp8 pair kernels of 3-4 rows: the group sums take the accumulator registers (zmm0-15) and the
  // accumulators wait on the stack, one load / FMA / store per group (64 k pairs).
  static constexpr int kFp8AccStack = kFp8ScaleStack + 2 * 64;
  static constexpr int kFp8PairMaxRows = 4;
  // (And avx2 two-row fp32-domain decode: its 8 group sums take ymm0-7.)
  bool fp8_stack_acc() const {
    return (fp8p_ && mr_ > 2) || (sfma_ && fp8_) || (fp8dw_ && mr_ == 2);
  }
  // fp8 pair prefill reads the strip decoded to bf16 k pairs in GemmArgs::scratch (bf16 strips
  // are k pairs already: the bf16 pair kernels read them in place); strip-scratch kernels their
  // decoded strip there too.
  bool scratch_pairs() const { return (fp8p_ && prefill_) || mxp_ || sfma_; }
  int fp8_acc_slot(int m, int v) const { return kFp8AccStack + (m * nv_ + v) * 64; }
  // qgroup tiles of 2 rows at avx2 (qgs2_): the fp32 accumulators live on the stack and the int32
  // group sums in the accumulator registers, so 2 rows x 4 vectors fit the 16 ymm registers.
  static constexpr int kQgAccStack = 16;
  int acc_slot(int m, int v) const {
    return mx_stack_acc() ? kMxAccStack + (m * nv_ + v) * vec_bytes()
           : qgs2_        ? kQgAccStack + (m * nv_ + v) * 64
           : i4w_         ? kI4AccStack + (m * nv_ + v) * vec_bytes()
                          : fp8_acc_slot(m, v);
  }
  // Tiles of up to 4 rows on zmm keep the two scales in zmm28/29 (free there; not in fused tiles,
  // whose decode takes them), others on the stack
  // (strip-scratch kernels too: the bf16 microkernel's odd-k mask is zmm29).
  bool fp8_scale_regs() const { return zmm_isa() && mr_ <= 4 && !sfma_ && !fuse_ && !rounds_; }
  void fp8_mul_scale(const Xmm& w, int half) {
    if (fp8_scale_regs())
      vmulps(w, w, Zmm(28 + half));
    else
      vmulps(w, w, vmem(rsp + kFp8ScaleStack + half * vec_bytes()));
  }
  void fp8_group_scales() {
    const Xmm t = vreg(num_vregs() - 2);  // a decode temporary: free between K steps
    for (int h = 0; h < 2; ++h) {
      if (fp8po_)  // one float per half (formats::StripLayout::gscale_index)
        vbroadcastss(t, dword[reg_gs + h * 4]);
      else
        vmovups(t, vmem(reg_gs + h * vec_bytes()));
      if (!fp8p_ || fp8w())  // the other pair kernels' values are unscaled
        vmulps(t, t, cpool(fp8dw_ ? c_f2p56_ : c_f256_));
      if (fp8_scale_regs())
        vmovaps(Zmm(28 + h), t);
      else
        vmovups(vmem(rsp + kFp8ScaleStack + h * vec_bytes()), t);
    }
    if (fp8dw_) {
      vmovups(fp8dw_mask(), cpool(c_e4m3_dw_));
      vmovups(fp8dw_scale(), cpool(c_f2p64_));
    }
  }
  // One vector of e4m3 bytes at `wm` (lanes_ of them) as fp32 in vreg(i): the byte as fp16 bits
  // (sign-extended to a word, << 7, & 0xbf80: the value * 2^-8), widened exactly by vcvtph2ps.
  Xmm e4m3_widen(int i, const RegExp& wm) {
    if (zmm_isa()) {
      vpmovsxbw(Ymm(i), xword[wm]);
      vpsllw(Ymm(i), Ymm(i), 7);
      vpandd(Ymm(i), Ymm(i), yword[rip + c_f16_mask_]);
      vcvtph2ps(Zmm(i), Ymm(i));
      return Zmm(i);
    }
    vpmovsxbw(Xmm(i), qword[wm]);
    vpsllw(Xmm(i), Xmm(i), 7);
    vpand(Xmm(i), Xmm(i), xword[rip + c_f16_mask_]);
    vcvtph2ps(Ymm(i), Xmm(i));
    return Ymm(i);
  }

  // The top 16 bits of e (low half) and o (high half) as bf16 pairs, in e (stored at `dst`).
  void bf16_pair_pack(const Xmm& e, const Xmm& o) {
    vpsrld(e, e, 16);
    if (zmm_isa())
      vpternlogd(e, o, zword[rip + c_hi16_], 0xf8);  // e | (o & 0xffff0000)
    else
      vpblendw(e, e, o, 0xaa);  // the odd words (high halves) from o
  }
  void bf16_pair_store(const Xmm& e, const Xmm& o, const Address& dst) {
    bf16_pair_pack(e, o);
    vmovups(dst, e);
  }

  // mx strip-scratch kernels: the strip at reg_tmp2 (g_per_strip groups of 32 k: the columns'
  // exponent bytes, then the weights) into the scratch at reg_pf as bf16 k pairs of the top 16
  // bits of value * scale (the fp32 product the fp32 kernels multiply by: exact but for an fp32
  // subnormal product, which keeps its top bits; jit/gemm.hpp strip_scratch_kernel).
  // Scales in vreg(8 + v); mxfp4 takes e2m1 through vpermps (zmm: the 16-entry table in a
  // register; ymm: 3 index bits give the magnitude, the nibble's bit 3 moved to the sign).
  void mx_fma_repack() {
    Label group, pair, done;
    const int cols = strip_cols();
    mov(reg_tmp, arg(offsetof(GemmArgs, g_per_strip)));
    test(reg_tmp, reg_tmp);
    jle(done, T_NEAR);
    if (mx4_ && zmm_isa()) vmovups(Zmm(16), zword[rip + c_e2m1_]);
    L(group);
    {
      for (int v = 0; v < nv_; ++v) mx_scale_widen(vreg(8 + v), reg_tmp2 + v * lanes_);
      add(reg_tmp2, cols);
      if (mx8_) {        // [k][column] bytes: 16 pairs of rows
        mov(reg_k, 16);  // free until the M blocks
        L(pair);
        for (int v = 0; v < nv_; ++v) {
          const Xmm e = e4m3_widen(0, reg_tmp2 + v * lanes_);
          const Xmm o = e4m3_widen(1, reg_tmp2 + cols + v * lanes_);
          vmulps(e, e, vreg(8 + v));
          vmulps(o, o, vreg(8 + v));
          bf16_pair_store(e, o, vmem(reg_pf + v * vec_bytes()));
        }
        add(reg_tmp2, 2 * cols);
        add(reg_pf, nv_ * vec_bytes());
        dec(reg_k);
        jnz(pair, T_NEAR);
      } else {  // [k/8][column][4 bytes]: nibble j of a column's dword is k0 + j
        for (int d = 0; d < 4; ++d)
          for (int v = 0; v < nv_; ++v) {
            const Xmm raw = vreg(12);
            vmovups(raw, vmem(reg_tmp2 + (d * cols + v * lanes_) * 4));
            for (int p = 0; p < 4; ++p) {
              const Xmm e = e2m1_widen(0, raw, 8 * p), o = e2m1_widen(1, raw, 8 * p + 4);
              vmulps(e, e, vreg(8 + v));
              vmulps(o, o, vreg(8 + v));
              bf16_pair_store(e, o, vmem(reg_pf + ((d * 4 + p) * nv_ + v) * vec_bytes()));
            }
          }
        add(reg_tmp2, 16 * cols);
        add(reg_pf, 16 * nv_ * vec_bytes());
      }
      dec(reg_tmp);
      jnz(group, T_NEAR);
    }
    L(done);
  }
  // The columns' exponent bytes at `bytes` (one per lane) as fp32 scales, bits e << 23, in `dst`.
  void mx_scale_widen(const Xmm& dst, const RegExp& bytes) {
    if (zmm_isa())
      vpmovzxbd(dst, xword[bytes]);
    else
      vpmovzxbd(dst, qword[bytes]);
    vpslld(dst, dst, 23);
  }
  // The e2m1 nibble at bit `shift` of each dword of `raw` as fp32 in vreg(i) (vreg(i + 2) a
  // temporary on ymm). On zmm `raw` may be memory and the 16-entry table (`table`, zmm16 unless
  // given) a memory operand.
  Xmm e2m1_widen(int i, const Operand& raw, int shift, const Operand& table = Zmm(16)) {
    const Xmm x = vreg(i);
    if (zmm_isa()) {  // vpermps reads index bits 3..0
      if (shift)
        vpsrld(x, raw, uint8_t(shift));
      else if (raw.isMEM())
        vmovups(x, raw);
      else
        vmovaps(x, raw);
      vpermps(Zmm(i), Zmm(i), table);
      return x;
    }
    if (raw.isMEM()) throw std::logic_error("gemm: e2m1_widen takes a register on ymm");
    const Xmm sgn = vreg(i + 2);
    if (shift < 28)
      vpslld(sgn, raw, uint8_t(28 - shift));  // bit 3 of the nibble to bit 31
    else
      vmovaps(sgn, raw);
    vpand(sgn, sgn, cpool(c_sign_));
    if (shift)
      vpsrld(x, raw, uint8_t(shift));
    else
      vmovaps(x, raw);
    vpermps(Ymm(i), Ymm(i), yword[rip + c_e2m1_]);  // index bits 2..0: the magnitude
    vxorps(x, x, sgn);
    return x;
  }

  // fp8 strip-scratch kernels (strip_scratch_kernel): the strip at reg_tmp2 (reg_tmp k pairs,
  // >= 1) into the scratch at reg_pf as fp16, [k][column]: each e4m3 byte as the fp16 bits of
  // value * 2^-8 (sign-extended to a word, << 7, & 0xbf80: e4m3 subnormals become fp16
  // subnormals, exact), 16 (zmm: 32) columns an instruction. The M blocks widen them with
  // vcvtph2ps (microkernel_f16), exactly the values e4m3_widen gives. Three operations and a
  // store per 16 weights, where bf16 k pairs took 11.
  void fp8_fma_repack() {
    Label loop, done;
    const int cols = strip_cols();
    test(reg_tmp, reg_tmp);
    jz(done, T_NEAR);
    L(loop);
    for (int c = 0; c < 2 * cols;) {  // the pair's two K rows back to back: 2 * cols bytes
      const int n = zmm_isa() && 2 * cols - c >= 32 ? 32 : 2 * cols - c >= 16 ? 16 : 8;
      const Xmm x = n == 32 ? Xmm(Zmm(0)) : n == 16 ? Xmm(Ymm(0)) : Xmm(0);
      vpmovsxbw(x, n == 32   ? yword[reg_tmp2 + c]
                   : n == 16 ? xword[reg_tmp2 + c]
                             : qword[reg_tmp2 + c]);
      vpsllw(x, x, 7);
      if (n == 32)
        vpandd(x, x, zword[rip + c_f16_mask_]);
      else if (n == 16)
        vpand(x, x, yword[rip + c_f16_mask_]);
      else
        vpand(x, x, xword[rip + c_f16_mask_]);
      vmovups(n == 32   ? zword[reg_pf + 2 * c]
              : n == 16 ? yword[reg_pf + 2 * c]
                        : xword[reg_pf + 2 * c],
              x);
      c += n;
    }
    add(reg_tmp2, 2 * cols);
    add(reg_pf, 4 * cols);
    dec(reg_tmp);
    jnz(loop, T_NEAR);
    L(done);
  }
  // One k pair of an fp8 strip-scratch kernel (fp8_fma_repack's fp16 [k][column]): per half of
  // the pair the rows' activations broadcast, each vector widened once (vcvtph2ps from memory)
  // for the tile's rows; the FMAs of microkernel_bf16 in its order.
  void microkernel_f16(int u) {
    const int cols = strip_cols();
    const RegExp w0 = reg_w + u * cols * 4;  // a k pair: 2 * cols fp16
    const Xmm t = zmm_isa() ? Xmm(Zmm(30)) : Xmm(Ymm(15));
    for (int half = 0; half < 2; ++half) {
      if (!zmm_isa())
        for (int m = 0; m < mr_; ++m)
          vbroadcastss(row_bcast(m), dword[a_row(m) + 8 * u + 4 * half]);
      for (int v = 0; v < nv_; ++v) {
        const RegExp wm = w0 + (half * cols + v * lanes_) * 2;
        vcvtph2ps(t, zmm_isa() ? yword[wm] : xword[wm]);
        for (int m = 0; m < mr_; ++m)
          if (zmm_isa())
            vfmadd231ps(acc(m, v), t, ptr_b[a_row(m) + 8 * u + 4 * half]);
          else
            vfmadd231ps(acc(m, v), t, row_bcast(m));
      }
    }
  }
  // One k pair of a strip-scratch kernel: the first block of a strip prefetches the next strip's
  // packed bytes (2 * strip_cols() a pair, one line or less), then the FMA microkernel over the
  // scratch (fp8: microkernel_f16; mx: the bf16 one).
  // Packed bytes of a k pair in the strip (mx: the exponent bytes left out).
  int sfma_pair_bytes() const { return mx4_ ? strip_cols() : 2 * strip_cols(); }
  void microkernel_sfma(int u, bool prefetch_next) {
    if (prefetch_next)
      for (int off = 0; off < sfma_pair_bytes(); off += 64)
        prefetcht1(ptr[reg_pf + u * sfma_pair_bytes() + off]);
    if (fp8_)
      microkernel_f16(u);
    else
      microkernel_bf16(u);
  }
  void advance_sfma(int pairs, bool prefetch_next) {
    if (prefetch_next) add(reg_pf, sfma_pair_bytes() * pairs);
    add(reg_a, 8 * pairs);  // two fp32 activations a pair
    if (mr_ > 3) add(reg_a3, 8 * pairs);
    add(reg_w, strip_cols() * 4 * pairs);
  }

  void microkernel_fp8(int u) {
    for (int m = 0; m < mr_; ++m) vbroadcastss(row_bcast(m), dword[a_row(m) + 4 * u]);
    if (fp8dw_) {  // avx2 1-2 row decode: a * 2^64, then per vector the fp32-domain widen
      for (int m = 0; m < mr_; ++m) vmulps(row_bcast(m), row_bcast(m), fp8dw_scale());
      const Ymm t(num_vregs() - 2);
      for (int v = 0; v < nv_; ++v) {
        vpmovsxbd(t, qword[reg_w + u * step_bytes() + v * lanes_]);
        vpslld(t, t, 20);
        vpand(t, t, fp8dw_mask());
        for (int m = 0; m < mr_; ++m) vfmadd231ps(gacc(m, v), t, row_bcast(m));
      }
      return;
    }
    const int half_vecs = key_.epilogue == Epilogue::siluup ? nv_ / 2 : nv_;
    const int ti = num_vregs() - 2;
    for (int v = 0; v < nv_; ++v) {
      const RegExp wm = reg_w + u * step_bytes() + v * lanes_;
      Xmm w;
      // Tiles of 1-2 rows (conversion-bound) widen one vector at a time with 256-bit ops: on
      // Zen 4 that streams 19 GB/s from L2 (m1) where the two-vector form below (512-bit widen,
      // shift, mask, extract; the 512-bit shuffles are double-pumped there) streamed 16.6.
      // Larger tiles (FMA-bound) keep the two-vector form, 6 % faster in prefill there.
      if (zmm_isa() && mr_ > 2 && v + 1 < nv_ && (v < half_vecs) == (v + 1 < half_vecs)) {
        // Two vectors of one strip half at once: 32 bytes -> 32 words, one shift and mask.
        const Zmm lo(ti), hi(ti + 1);
        vpmovsxbw(lo, yword[wm]);
        vpsllw(lo, lo, 7);
        vpandd(lo, lo, zword[rip + c_f16_mask_]);
        vextracti64x4(Ymm(ti + 1), lo, 1);
        vcvtph2ps(hi, Ymm(ti + 1));
        vcvtph2ps(lo, Ymm(ti));
        if (!gacc_) {
          fp8_mul_scale(lo, v < half_vecs ? 0 : 1);
          fp8_mul_scale(hi, v < half_vecs ? 0 : 1);
        }
        for (int m = 0; m < mr_; ++m) vfmadd231ps(gacc_ ? gacc(m, v) : acc(m, v), lo, row_bcast(m));
        for (int m = 0; m < mr_; ++m)
          vfmadd231ps(gacc_ ? gacc(m, v + 1) : acc(m, v + 1), hi, row_bcast(m));
        ++v;
        continue;
      }
      w = e4m3_widen(ti, wm);
      if (gacc_) {
        for (int m = 0; m < mr_; ++m) vfmadd231ps(gacc(m, v), w, row_bcast(m));
        continue;
      }
      fp8_mul_scale(w, v < half_vecs ? 0 : 1);
      for (int m = 0; m < mr_; ++m) vfmadd231ps(acc(m, v), w, row_bcast(m));
    }
  }

  // fp8 pair kernels (fp8_pair_kernel, avx512_bf16): one step is a k pair, whose two strip rows
  // (2 * cols bytes, contiguous) load into zmm23/24. Full strips in the pair order (kFp8PairOrder)
  // take the word decode in fp8_pair_decode below instead (shifts and a mask, 5 vector
  // instructions per 64 weights where the step holds no zero-exponent code, against 7 here; the
  // one-row loop from L1 4.0 cycles per 64 weights against 4.8 on Zen 4). Narrower strips: per 32
  // columns j, vpermi2b with
  // c_fp8_idx_[j] gathers the bytes as (row k, row k + 1) pairs in the order the byte unpacks below
  // need to give natural column order; two vpermi2b over 128-byte tables map the 7 magnitude bits
  // to the low and high byte of the value's bf16 (exact: e4m3 fits bf16, subnormals included; the
  // NaN codes give +-480 as fp8_value), the sign bit is or-ed into the high byte, and
  // vpunpcklbw / vpunpckhbw interleave them into 16 bf16 pairs each (columns 32j..+15, +16..+31).
  // Decode tiles (<= 4 rows) then issue one vdpbf16ps per row with the row's bf16 activation pair
  // broadcast: 9 vector instructions per 64 weights and row, against 20 for the fp16 route; 40 GB/s
  // against 19 from L2 on Zen 4 (m1). Prefill kernels decode the strip once into the scratch
  // (fp8_pair_repack) and run the bf16 pair microkernel over it, block after block.
  // Registers: luts zmm16-19, gather indices 20-21 (pair order: the word decode's 0x87f0 and
  // 0x3800), 0x80 bytes 22, temporaries 23-27 and 30.
  void fp8_pair_constants() {
    Label& hi = fp8w() ? c_fp8_hi8_ : c_fp8_lut_[1];
    vmovdqu8(Zmm(16), zword[rip + c_fp8_lut_[0]]);
    vmovdqu8(Zmm(17), zword[rip + c_fp8_lut_[0] + 64]);
    vmovdqu8(Zmm(18), zword[rip + hi]);
    vmovdqu8(Zmm(19), zword[rip + hi + 64]);
    if (fp8w()) {  // the shift decode's mask and exponent bits (no gather)
      vmovups(Zmm(20), zword[rip + c_87f0_]);
      vmovups(Zmm(21), zword[rip + c_3800_]);
    } else {
      for (int j = 0; j < (nv_ + 1) / 2; ++j) vmovdqu8(Zmm(20 + j), zword[rip + c_fp8_idx_[j]]);
    }
    vpbroadcastd(Zmm(22), dword[rip + c_80_]);
  }
  // Decodes the k pair at `wm`; `use(v, w)` gets vector v's 16 bf16 pairs in zmm w. Registers:
  // the tiles' (fp8_pair_constants: tables 16-19, gather indices 20-21, sign mask 22; temporaries
  // 23-27 and 30) or, `fused` (a 6-row block's first pass over a full strip, whose group sums
  // take zmm0-23: microkernel_fp8_fused), half of each table and the sign mask in 24-26
  // (fp8_fused_constants), the other halves, the indices and row k + 1 as memory operands, and
  // temporaries 27-31; in the pair order (which has no row k + 1 or indices) the shift decode's
  // constants in 27-28 and temporaries 29-31.
  template <class Use>
  void fp8_pair_decode(const RegExp& wm, Use use, bool fused = false, bool fast = false) {
    fp8_pair_decode(
        wm, use,
        [&](int v, const Zmm& a, const Zmm& b) {
          use(v, a);
          use(v + 1, b);
        },
        fused, fast);
  }
  // The same with the shift decode's two vectors of a 64-byte block handed over together,
  // `use_pair(v, a, b)` (vectors v and v + 1; the table decode calls `use` per vector).
  template <class Use, class UsePair>
  void fp8_pair_decode(const RegExp& wm, Use use, UsePair use_pair, bool fused, bool fast) {
    const int bytes = 2 * strip_cols();  // two strip rows: 32, 64, 96 or 128
    const Zmm sign(fused ? 26 : 22), row0(fused ? 27 : 23), p(fused ? 28 : 25), lo(fused ? 29 : 26),
        hi(fused ? 30 : 27), w(fused ? 31 : 30);
    // the shift decode's constants: 0x87f0 and 0x3800 per word (fused: in row0's and p's
    // registers, which the pair order leaves free)
    const Zmm c87(fused ? 27 : 20), c38(fused ? 28 : 21);
    auto lut = [&](const Zmm& x, int t) {  // the indices in x to byte t of the values' bf16
      if (fused)
        vpermi2b(x, Zmm(24 + t), zword[rip + (t && fp8w() ? c_fp8_hi8_ : c_fp8_lut_[t]) + 64]);
      else
        vpermi2b(x, Zmm(16 + 2 * t), Zmm(17 + 2 * t));
    };
    const bool ordered = fp8po_ && bytes == 128;  // stored in the pair order: no gather
    if (fused && bytes != 128)
      throw std::logic_error("gemm: the fused fp8 decode takes full strips");
    if (ordered) {
      // Per 64 bytes (32 words): word d's low bytes hold the k pair of column 32 j + d, its high
      // bytes that of 32 j + 16 + d. Shift decode (a step with no zero-exponent code): a high
      // byte s.eeee.mmm shifted right by 4 with the sign copied, & 0x87f0 | 0x3800, is the bf16
      // of its value * 2^-8 (exponent 112 + e): exact for e >= 1 (e = 0 would read as
      // 2^-15 (1 + m / 8)); a low byte first shifted up by 8. Else the tables (hi: * 2^-8)
      // give each byte's bf16 bytes, shifted and masked into the words: exact for every code.
      for (int j = 0; 2 * j < nv_; ++j) {
        const Address src = zword[wm + 64 * j];
        if (fast) {
          vpsllw(lo, src, 8);
          vpsraw(lo, lo, 4);
          vpternlogd(lo, c87, c38, 0xea);  // (lo & 0x87f0) | 0x3800
          vpsraw(hi, src, 4);
          vpternlogd(hi, c87, c38, 0xea);
          use_pair(2 * j, lo, hi);
          continue;
        }
        vmovdqu8(lo, src);
        lut(lo, 0);
        vmovdqu8(hi, src);
        lut(hi, 1);
        vpternlogd(hi, sign, src, 0xf8);  // hi | (byte & 0x80): the sign
        vpsllw(w, hi, 8);
        vpternlogd(w, lo, ptr_b[rip + c_00ff_], 0xf8);  // (hi << 8) | (lo & 0x00ff)
        use(2 * j, w);
        vpsrlw(w, lo, 8);
        vpternlogd(w, hi, ptr_b[rip + c_ff00_], 0xf8);  // (lo >> 8) | (hi & 0xff00)
        use(2 * j + 1, w);
      }
      return;
    }
    if (fast) throw std::logic_error("gemm: the fp8 shift decode takes the pair order");
    if (fused) {
      vmovdqu8(row0, zword[wm]);
    } else {
      if (bytes >= 64)
        vmovdqu8(Zmm(23), zword[wm]);
      else
        vmovdqu8(Ymm(23), yword[wm]);
      if (bytes == 128)
        vmovdqu8(Zmm(24), zword[wm + 64]);
      else if (bytes == 96)
        vmovdqu8(Ymm(24), yword[wm + 64]);
    }
    for (int j = 0; 2 * j < nv_; ++j) {
      if (fused) {
        vmovdqu8(p, zword[rip + c_fp8_idx_[j]]);
        vpermi2b(p, row0, zword[wm + 64]);
      } else {
        vmovdqa64(p, Zmm(20 + j));
        vpermi2b(p, Zmm(23), Zmm(24));
      }
      vmovdqa64(lo, p);
      lut(lo, 0);
      vmovdqa64(hi, p);
      lut(hi, 1);
      vpternlogd(hi, p, sign, 0xf8);  // hi | (p & 0x80): the sign
      for (int h = 0; h < 2 && 2 * j + h < nv_; ++h) {
        if (h == 0)
          vpunpcklbw(w, lo, hi);
        else
          vpunpckhbw(w, lo, hi);
        use(2 * j + h, w);
      }
    }
  }
  void microkernel_fp8_pairs(int u) {
    fp8_pair_decode(
        reg_w + u * step_bytes(),
        [&](int v, const Zmm& w) {
          for (int m = 0; m < mr_; ++m) vdpbf16ps(gacc(m, v), w, ptr_b[a_row(m) + 4 * u]);
        },
        false, fp8_fast_);
  }
  // Prefill: the strip at reg_tmp2 (reg_tmp k pairs, >= 1) as bf16 pairs into the scratch at
  // reg_pf, [k/2][vector][16 pairs]: the layout of x86 bf16 strips.
  void fp8_pair_repack() {
    Label loop, done;
    fp8_pair_constants();
    test(reg_tmp, reg_tmp);
    jz(done, T_NEAR);
    L(loop);
    fp8_pair_decode(reg_tmp2, [&](int v, const Zmm& w) { vmovups(zword[reg_pf + v * 64], w); });
    add(reg_tmp2, step_bytes());
    add(reg_pf, nv_ * 64);
    dec(reg_tmp);
    jnz(loop, T_NEAR);
    L(done);
  }
  // fp8 pair prefill of full strips (4 vectors; mx: k_loop_mx_fused below) fuses the decode into
  // the call's first block: it reads the strip, stores each k pair's bf16 pairs to the scratch for
  // the later blocks and the tail, and feeds them to its own vdpbf16ps at once. A separate decode
  // pass before the blocks took about a fifth of the kernel's time at Qwen3-30B-A3B T = 256: 2
  // bytes of scratch written and read back through L2 per weight byte, with no compute to hide
  // behind. The decode takes the fused registers of fp8_pair_decode (its registers 27-31 are
  // free in the K loop; the group-end fold and scale load use 30 / 31, and the constants are loaded
  // per tile and per round). Same values in the same order as the repack: the same bits.
  bool fused_first() const { return (fp8p_ || mxp_) && prefill_ && sv_ == kStripVecs; }
  int fp8p_step_bytes() const { return 2 * strip_cols(); }
  const Reg64 reg_sw = r13;  // the fused block's scratch write pointer (fp8: reg_comp is unused)
  bool fuse_ = false;
  bool fuse_store_ = true;  // (a tail tile alone decodes for itself only: tail_rows)
  // The tiles of a DRAM-bound int8 or BF16-pair call (fewer than prefill_read_ahead_rows() rows):
  // their K steps also prefetch the strip they read prefill_read_ahead_bytes() further on
  // (jit/gemm.hpp). (The BF16 pair tiles read their strip in place; fp8's read decoded pairs.)
  bool ahead_ = false;
  bool ahead_kernel() const {
    const bool bf16_pairs = pairs_ && key_.format == WeightFormat::bf16;
    return (int_tail_prefetch_kernel(key_) || bf16_pairs) && prefill_read_ahead_bytes() > 0;
  }
  // `emit` (the tiles of a pf_var_ call) once, or for ahead_kernel() twice: with ahead_ for calls
  // of fewer than prefill_read_ahead_rows() rows ([rsp + pf_slot_]), and as it is for the others.
  template <class Emit>
  void with_read_ahead(Emit emit) {
    if (!ahead_kernel()) {
      emit();
      return;
    }
    Label whole, end;
    cmp(qword[rsp + pf_slot_], prefill_read_ahead_rows(key_));
    jge(whole, T_NEAR);
    ahead_ = true;
    emit();
    ahead_ = false;
    jmp(end, T_NEAR);
    L(whole);
    emit();
    L(end);
  }
  void fp8_fused_constants() {
    vmovdqu8(Zmm(24), zword[rip + c_fp8_lut_[0]]);
    vmovdqu8(Zmm(25), zword[rip + (fp8w() ? c_fp8_hi8_ : c_fp8_lut_[1])]);
    if (fp8w()) {  // the shift decode's mask and exponent bits
      vmovups(Zmm(27), zword[rip + c_87f0_]);
      vmovups(Zmm(28), zword[rip + c_3800_]);
    }
    vpbroadcastd(Zmm(26), dword[rip + c_80_]);
  }
  // In rounds (strip_rounds) the shift decode's two vectors take each row's pair through zmm31,
  // one vpbroadcastd for both, rather than as a {1to16} operand of each vdpbf16ps: with the codes'
  // loads that was 32 loads for 24 dots a k pair, and the rounds' first pass ran 1.03x faster
  // this way (Qwen3-30B-A3B T = 256, a Zen 5). Block by block, where the first block's scratch
  // writes went to L2, the register form was 1.03x slower; it keeps the embedded broadcasts.
  void microkernel_fp8_fused(int u, bool prefetch_next) {
    if (prefetch_next) {
      prefetcht1(ptr[reg_pf + u * 128]);
      prefetcht1(ptr[reg_pf + u * 128 + 64]);
    }
    auto store = [&](int v, const Zmm& w) {
      if (fuse_store_) vmovups(zword[reg_sw + (u * nv_ + v) * 64], w);
    };
    auto dots = [&](int v, const Zmm& w) {
      for (int m = 0; m < mr_; ++m) vdpbf16ps(gacc(m, v), w, ptr_b[a_row(m) + 4 * u]);
    };
    fp8_pair_decode(
        reg_w + u * fp8p_step_bytes(),
        [&](int v, const Zmm& w) {
          store(v, w);
          dots(v, w);
        },
        [&](int v, const Zmm& a, const Zmm& b) {
          store(v, a);
          store(v + 1, b);
          if (!rounds_) {
            dots(v, a);
            dots(v + 1, b);
            return;
          }
          const Zmm bc(31);  // (the shift decode leaves it free)
          for (int m = 0; m < mr_; ++m) {
            vpbroadcastd(bc, ptr[a_row(m) + 4 * u]);
            vdpbf16ps(gacc(m, v), a, bc);
            vdpbf16ps(gacc(m, v + 1), b, bc);
          }
        },
        /*fused=*/true, fp8_fast_);
  }
  // mxfp8 pair decode tiles (mx8_pair_decode_kernel): per 32-k group the columns' scales times
  // 2^-8 (the stored exponent is e + 8; exact) to the stack, then 16 k pairs of the fp8 pair
  // decode (fp8_pair_decode: the rows' bytes are contiguous as fp8's) into vdpbf16ps group sums,
  // folded once, acc = fma(g, scale, acc) (3-4 rows: acc on the stack, mx_stack_acc).
  void k_loop_mx8_pairs() {
    Label group, done;
    const int cols = strip_cols(), pairs = int(formats::kMxGroup / 2);
    const Zmm t(31);  // free beside the decode's temporaries
    mov(reg_k, arg(offsetof(GemmArgs, g_per_strip)));
    test(reg_k, reg_k);
    jle(done, T_NEAR);
    L(group);
    {
      for (int v = 0; v < nv_; ++v) {
        mx_scale_widen(t, reg_w + v * lanes_);
        vmulps(t, t, cpool(c_f2m8_));
        vmovups(mx_scale(v), t);
      }
      advance_w(cols);
      zero_gacc();
      for (int u = 0; u < pairs; ++u)
        fp8_pair_decode(reg_w + u * 2 * cols, [&](int v, const Zmm& w) {
          for (int m = 0; m < mr_; ++m) vdpbf16ps(gacc(m, v), w, ptr_b[a_row(m) + 4 * u]);
        });
      advance_w(pairs * 2 * cols);
      add(reg_a, 4 * pairs);
      if (mr_ > 3) add(reg_a3, 4 * pairs);
      for (int m = 0; m < mr_; ++m)
        for (int v = 0; v < nv_; ++v) {
          if (mx_stack_acc()) {
            const Address slot = vmem(rsp + acc_slot(m, v));
            vmovups(t, slot);
            vfmadd231ps(t, gacc(m, v), mx_scale(v));
            vmovups(slot, t);
          } else {
            vfmadd231ps(acc(m, v), gacc(m, v), mx_scale(v));
          }
        }
      dec(reg_k);
      jnz(group, T_NEAR);
    }
    L(done);
  }

  // mxfp8's integer decode in the fused first block: per group the columns' exponent steps
  // E = (stored - 135) << 7 as words (both of each column's dword) on the stack; per k pair the
  // fp8 pair decode's gather and table lookups give each weight's bf16 magnitude (exact; zero as
  // 0xc000), E is added, negatives (zero, and results below the bf16 range) become 0 and the sign
  // is or-ed in: the top 16 bits of value * scale but where that is an fp32 subnormal, which
  // vdpbf16ps reads as zero either way. Registers: tables' first halves 24-25, temporaries 26-31.
  void mx8_scale_words(int v) {
    const Zmm t(26);
    exponent_step_words(t, v, c_4380w_);
    vmovups(mx_scale(v), t);
  }
  // The word decodes' exponent steps for vector v's columns: E = (byte << 7) - bias in both words
  // of each column's dword; `nonzero` (where given) gets the words whose byte is not 0.
  void exponent_step_words(const Zmm& t, int v, const Label& bias, const Opmask* nonzero = nullptr) {
    vpmovzxbd(t, xword[reg_w + v * lanes_]);
    vpshufb(t, t, zword[rip + c_dupw_]);
    vpsllw(t, t, 7);
    if (nonzero) vptestmw(*nonzero, t, t);
    vpsubw(t, t, zword[rip + bias]);
  }
  // use(v, a, b, t): vectors v and v + 1 decoded in a and b, t free (full strips: nv_ even).
  template <class Use>
  void mx8_word_decode(const RegExp& wm, Use use) {
    const Zmm sgn(26), row0(27), p(28), lo(29), hi(30), w(31);
    if (nv_ % 2) throw std::logic_error("gemm: mx8_word_decode takes vectors in pairs");
    vmovdqu8(row0, zword[wm]);
    for (int j = 0; 2 * j < nv_; ++j) {
      vmovdqu8(p, zword[rip + c_fp8_idx_[j]]);
      vpermi2b(p, row0, zword[wm + 64]);
      vmovdqa64(lo, p);
      vpermi2b(lo, Zmm(24), zword[rip + c_fp8_lut_[0] + 64]);
      vmovdqa64(hi, p);
      vpermi2b(hi, Zmm(25), zword[rip + c_mx8_hi_ + 64]);
      for (int h = 0; h < 2; ++h) {  // the second vector into lo (free once both are unpacked)
        const Zmm d = h ? lo : w;
        if (h == 0) {
          vpunpcklbw(d, lo, hi);
          vpunpcklbw(sgn, p, p);
        } else {
          vpunpckhbw(d, lo, hi);
          vpunpckhbw(sgn, p, p);
        }
        vpaddw(d, d, mx_scale(2 * j + h));
        vpmaxsw(d, d, zword[rip + c_zero_]);
        vpternlogd(d, sgn, zword[rip + c_8000w_], 0xf8);  // d | (the byte's sign at bit 15)
      }
      use(2 * j, w, lo, hi);
    }
  }

  // The mx pair prefill's first block likewise (fused_first), four k pairs at a time: per 32-k
  // group the columns' scales into zmm24-27, then per k pair two vectors decoded (zmm28, zmm30),
  // stored to the scratch and fed to the block's vdpbf16ps (accumulators zmm0-23), each row's
  // pair broadcast once into zmm29 for both. mxfp8: the integer decode above (mx8_word_decode; its
  // fp16 route's vcvtph2ps and two vmulps a vector took the vdpbf16ps pipes, tools/coissue.cpp).
  // mxfp4: the same idea (mx4_word_decode below) where every scale of the group is at most 252;
  // a group with a larger one (products can overflow, the words would wrap) takes the fp32 route
  // of mx_fma_repack (e2m1 through vpermps, times the scale, the top 16 bits as pairs).
  // Until 2026-11-29 each vector's dots took the pair as a {1to16} operand: with the decode's own
  // loads they shared the two load pipes with nothing to spare (tools/coissue.cpp). With the
  // register broadcasts (a Zen 5, the same bits): Qwen3 MXFP4 layers 0.92-0.93x the time at
  // T = 256, 0.94x at 64, 0.98x at 1024 (in-process A/Bs); MXFP8 0.89-0.94x at 256, 0.91-0.96x
  // at 64, 0.94-0.96x at 1024 (alternating processes). MXFP4's word decode then took 0.90x at 256.
  void k_loop_mx_fused(bool prefetch_next) {
    Label group, fp32_group, next, done;
    const int cols = strip_cols();
    mov(reg_tmp, arg(offsetof(GemmArgs, g_per_strip)));
    test(reg_tmp, reg_tmp);
    jle(done, T_NEAR);
    if (mx8_) {  // the first halves of the low-byte and (zero as 0xc0) high-byte tables
      vmovdqu8(Zmm(24), zword[rip + c_fp8_lut_[0]]);
      vmovdqu8(Zmm(25), zword[rip + c_mx8_hi_]);
    } else {  // k7: the odd words (mx4_word_decode's blend)
      mov(reg_tmp2.cvt32(), 0xaaaaaaaau);
      kmovd(k7, reg_tmp2.cvt32());
    }
    L(group);
    if (mx4_) {  // any of the group's scale bytes above 252: the fp32 route
      if (cols != 64) throw std::logic_error("gemm: the mx fused block takes 4-vector zmm strips");
      vmovdqu8(Zmm(28), zword[reg_w]);
      vpcmpub(k6, Zmm(28), zword[rip + c_fcb_], 6);  // unsigned >
      kortestq(k6, k6);
      jnz(fp32_group, T_NEAR);
      mx_fused_group(prefetch_next, true);
      jmp(next, T_NEAR);
      L(fp32_group);
    }
    mx_fused_group(prefetch_next, false);
    L(next);
    dec(reg_tmp);
    jnz(group, T_NEAR);
    L(done);
  }
  // mxfp4's word decode of vector v's dword of nibbles (raw) for k pair p into e (o a temporary):
  // the nibbles 2p and 2p + 1 (k and k + 1) as the low bits of the dword's two words, each word
  // through vpermw to its e2m1 value's bf16 bits (signed; both zeros as 0, the stray index bit 4
  // ignored: the table twice), then E = (e - 127) << 7 added to the bits where the value is not
  // zero and the scale byte e is not 0 (k(1 + v)), zero elsewhere. For scale bytes 1..252 the
  // exponent field stays in 0..254 (e2m1 magnitudes are 2^-1 ... 1.5 * 2^2), so the sign is
  // untouched and the result is value * 2^(e - 127) exactly, but where that is an fp32
  // subnormal (0.5 at e = 1: zero here, a subnormal's top bits in the reference), which vdpbf16ps
  // reads as zero either way. 6 vector instructions and 2 loads a vector, one of them on the
  // vdpbf16ps pipes (vptestmw); the fp32 route takes 8, two of them there (vmulps), and 5 loads.
  // A vpshufb index (byte p to both words, vpsrlvw) took 1.03-1.05x the layer's time instead of
  // 0.90x: with vpermw two shuffles a vector; the MXFP8 clamp-and-or-the-sign form 1.05x.
  void mx4_word_decode(const Zmm& e, const Zmm& o, const Address& raw, int p, int v) {
    if (p)
      vpsrld(o, raw, uint8_t(8 * p));  // nibble 2p to bits 0..3
    else
      vmovdqu8(o, raw);
    vpslld(e, o, 12);         // nibble 2p + 1 to bits 16..19
    vpblendmw(o | k7, o, e);  // the odd words from e
    vpermw(e, o, zword[rip + c_e2m1_bf_]);
    vptestmw(k5 | Opmask(1 + v), e, e);
    vpaddw(e | k5 | T_z, e, Zmm(24 + v));
  }
  // One 32-k group of the fused first block: `words`, mxfp4's word decode (every scale byte of
  // the group at most 252), else its fp32 route; mxfp8 always its own word decode.
  void mx_fused_group(bool prefetch_next, bool words) {
    Label quad;
    const int cols = strip_cols();
    for (int v = 0; v < nv_; ++v)
      if (mx8_) {
        mx8_scale_words(v);
      } else if (words) {  // E = (e - 127) << 7; k(1 + v): e != 0
        const Opmask nonzero(1 + v);
        exponent_step_words(Zmm(24 + v), v, c_3f80w_, &nonzero);
      } else {
        mx_scale_widen(Zmm(24 + v), reg_w + v * lanes_);
      }
    add(reg_w, cols);
    mov(reg_tmp2, 4);  // quads of k pairs in a group of 16
    L(quad);
    for (int p = 0; p < 4; ++p) {
      if (prefetch_next)
        for (int off = 0; off < pair_pf_bytes(); off += 64)
          prefetcht1(ptr[reg_pf + p * pair_pf_bytes() + off]);
      if (mx8_) {
        mx8_word_decode(reg_w + 2 * p * cols, [&](int v, const Zmm& a, const Zmm& b, const Zmm& t) {
          if (fuse_store_) {
            vmovups(zword[reg_sw + (p * nv_ + v) * 64], a);
            vmovups(zword[reg_sw + (p * nv_ + v + 1) * 64], b);
          }
          for (int m = 0; m < mr_; ++m) {
            vpbroadcastd(t, dword[a_row(m) + 4 * p]);
            vdpbf16ps(acc(m, v), a, t);
            vdpbf16ps(acc(m, v + 1), b, t);
          }
        });
        continue;
      }
      // mxfp4: two vectors at a time (this quad's dword of the column; zmm28-29 and zmm30-31),
      // then each row's pair broadcast once into zmm29 for both (free once decoded)
      for (int v = 0; v < nv_; v += 2) {
        for (int h = 0; h < 2; ++h) {
          const Zmm e(28 + 2 * h), o(29 + 2 * h);
          const Address raw = zword[reg_w + (v + h) * 64];
          if (words) {
            mx4_word_decode(e, o, raw, p, v + h);
          } else {  // nibbles k0 + 2p in e and + 1 in o
            const Address table = zword[rip + c_e2m1_];
            e2m1_widen(e.getIdx(), raw, 8 * p, table);
            e2m1_widen(o.getIdx(), raw, 8 * p + 4, table);
            vmulps(e, e, Zmm(24 + v + h));
            vmulps(o, o, Zmm(24 + v + h));
            bf16_pair_pack(e, o);
          }
          if (fuse_store_) vmovups(zword[reg_sw + (p * nv_ + v + h) * 64], e);
        }
        for (int m = 0; m < mr_; ++m) {
          vpbroadcastd(Zmm(29), dword[a_row(m) + 4 * p]);
          vdpbf16ps(acc(m, v), Zmm(28), Zmm(29));
          vdpbf16ps(acc(m, v + 1), Zmm(30), Zmm(29));
        }
      }
    }
    if (prefetch_next) add(reg_pf, 4 * pair_pf_bytes());
    add(reg_w, mx4_ ? 4 * cols : 8 * cols);
    if (fuse_store_) add(reg_sw, 4 * nv_ * 64);
    add(reg_a, 16);
    if (mr_ > 3) add(reg_a3, 16);
    dec(reg_tmp2);
    jnz(quad, T_NEAR);
  }

  // mx: groups of g_steps (32) K steps; each group starts with the strip's exponent bytes (one
  // per column), widened to fp32 scales (bits e << 23) on the stack at kMxScaleStack, then its
  // weights, 8 steps per iteration (one dword of nibbles per column for mxfp4). K is a multiple
  // of 32 (the loader refuses anything else), so there is no tail.
  static constexpr int kMxUnroll = 8;
  static constexpr int kMxScaleStack = 16;  // [rsp]: strips left; [rsp + 16]: the scales
  // mxfp4 int16 tiles of 2 rows at avx2: the 8 int32 group sums take ymm0-7 and the fp32
  // accumulators wait on the stack after the scales (one load, FMA, store per 32-k group).
  static constexpr int kMxAccStack = kMxScaleStack + kStripVecs * 64;
  // (and mxfp8 pair decode tiles of 3-4 rows: their group sums take zmm0-15)
  bool mx_stack_acc() const { return (i16_ && !zmm_isa() && mr_ == 2) || (mx8d_ && mr_ > 2); }
  Address mx_scale(int v) const { return vmem(rsp + kMxScaleStack + v * vec_bytes()); }
  // Tiles of up to 4 rows on zmm keep the group's scales in zmm20..23 (free there), the others
  // on the stack.
  bool mx_scale_regs() const { return zmm_isa() && mr_ <= 4; }
  void mx_mul_scale(const Xmm& w, int v) {
    if (mx_scale_regs())
      vmulps(w, w, Zmm(20 + v));
    else
      vmulps(w, w, mx_scale(v));
  }
  void mx_group_scales() {
    for (int v = 0; v < nv_; ++v) {
      const Xmm t = mx_scale_regs() ? Xmm(Zmm(20 + v))
                    : zmm_isa()     ? Xmm(Zmm(30))
                                    : Xmm(Ymm(15));  // decode temporaries: free here
      mx_scale_widen(t, reg_w + v * lanes_);
      if (!mx_scale_regs()) vmovups(mx_scale(v), t);
    }
    advance_w(strip_cols());
  }
  void k_loop_mx(bool prefetch_next) {
    Label group, inner, done;
    mov(reg_k, arg(offsetof(GemmArgs, k4)));
    test(reg_k, reg_k);
    jle(done, T_NEAR);
    L(group);
    {
      mx_group_scales();
      if (gacc_) zero_gacc();
      mov(reg_gk, arg(offsetof(GemmArgs, g_steps)));
      L(inner);
      if (i16_) {  // 8 K steps: 4 pairs of int16 activations per row
        for (int s = 0; s < 4; ++s) zmm_isa() ? microkernel_mx_i16(s) : microkernel_mx_i16_avx2(s);
        add(reg_a, 16);
        advance_w(step_bytes() * kMxUnroll);
      } else {
        for (int u = 0; u < kMxUnroll; ++u) microkernel(u, prefetch_next);
        advance(kMxUnroll, prefetch_next);
      }
      sub(reg_gk, kMxUnroll);
      jg(inner, T_NEAR);
      if (i16_ && !zmm_isa()) {  // avx2, 1-2 rows: the same fold, the scales from the stack
        const bool two = mx_stack_acc();
        const Ymm t(two ? 10 : 13), d(two ? 11 : 14), fa(15);  // free after the K steps
        for (int m = 0; m < mr_; ++m) {
          vpbroadcastd(t, dword[a_row(m) + 4]);  // kMxI16CodeOffset * Σq, the codes' offset
          for (int v = 0; v < nv_; ++v) vpsubd(gacc(m, v), gacc(m, v), t);
          vbroadcastss(d, dword[a_row(m)]);
          for (int v = 0; v < nv_; ++v) {
            vcvtdq2ps(gacc(m, v), gacc(m, v));
            vmulps(t, d, mx_scale(v));
            if (two) {  // the fp32 accumulator from its stack slot and back
              vmovups(fa, vmem(rsp + acc_slot(m, v)));
              vfmadd231ps(fa, gacc(m, v), t);
              vmovups(vmem(rsp + acc_slot(m, v)), fa);
            } else {
              vfmadd231ps(acc(m, v), gacc(m, v), t);
            }
          }
        }
        add(reg_a, 8);    // d / 2 and the offset sum
      } else if (i16_) {  // acc += float(sum) * (2^e * d/2): the sum is exact, one rounding
        const Zmm t(30), d(31);
        for (int m = 0; m < mr_; ++m) {
          vbroadcastss(d, dword[a_row(m)]);  // the group's d / 2 follows its 64 code bytes
          for (int v = 0; v < nv_; ++v) {
            vcvtdq2ps(gacc(m, v), gacc(m, v));
            vmulps(t, Zmm(20 + v), d);
            vfmadd231ps(acc(m, v), gacc(m, v), t);
          }
        }
        add(reg_a, 8);     // d / 2 and the offset sum (read by avx2 only)
      } else if (gacc_) {  // acc += g * 2^e (exact scaling, one rounding)
        for (int m = 0; m < mr_; ++m)
          for (int v = 0; v < nv_; ++v)
            if (mx_scale_regs())
              vfmadd231ps(acc(m, v), gacc(m, v), Zmm(20 + v));
            else
              vfmadd231ps(acc(m, v), gacc(m, v), mx_scale(v));
      }
      sub(reg_k, arg(offsetof(GemmArgs, g_steps)));
      jg(group, T_NEAR);
    }
    L(done);
  }

  // mxfp4 with int16 activations (mx_int16_activations): pair step s (0..3) of the current 8-step
  // block. Each word of a column's dword holds 4 nibbles (k0..k0+3 low, k0+4..k0+7 high); after
  // a shift by 4s, vpermw reads nibble s plus one stray bit (index bits 0..4) from a table that
  // holds 2 * e2m1 twice, so every word becomes its weight code, and one dot instruction per row
  // adds code(k0+s) * q[k0+s] + code(k0+s+4) * q[k0+s+4] into the group's int32 sums.
  void microkernel_mx_i16(int s) {
    const Zmm idx(30), val(31), prod(28);
    for (int m = 0; m < mr_; ++m) vpbroadcastd(row_bcast(m), dword[a_row(m) + 4 * s]);
    for (int v = 0; v < nv_; ++v) {
      const Address mem = zword[reg_w + v * vec_bytes()];
      if (s == 0)
        vmovdqu16(idx, mem);
      else
        vpsrlw(idx, mem, uint8_t(4 * s));
      vpermw(val, idx, Zmm(29));
      for (int m = 0; m < mr_; ++m) {
        if (vnni_) {
          vpdpwssd(gacc(m, v), val, row_bcast(m));
        } else {
          vpmaddwd(prod, val, row_bcast(m));
          vpaddd(gacc(m, v), gacc(m, v), prod);
        }
      }
    }
  }

  // The same on AVX2 (1-2 rows; no vpermw or vpdpwssd): each 16-bit word of the nibble dword,
  // shifted by 4s and masked to its nibble, indexes vpshufb's 16-byte table of 2 * e2m1 + 12
  // (unsigned, so no sign step), whose entry 0 (12) the word's high byte reads: every weight word
  // is code + formats::kMxI16CodeOffset, and vpmaddwd + vpaddd add (code + offset) * q into the
  // int32 group sums, which the group end corrects by the offset * Σq stored with the
  // activations (exact modulo 2^32, and the true sum fits). Each decoded vector feeds every row.
  // One row: group sums ymm8..11, ymm4 row pair, 5 word mask 0x000f, 6 table, 7 index. Two rows:
  // group sums ymm0..7 (the fp32 accumulators on the stack), 8 mask, 9 table, 10-11 row pairs,
  // 12 index. Both: 13 product, 14 the nibble words (VEX shifts take no memory operand).
  Ymm mx16_mask() const { return Ymm(mx_stack_acc() ? 8 : 5); }
  Ymm mx16_table() const { return Ymm(mx_stack_acc() ? 9 : 6); }
  void mx_i16_avx2_constants() {
    vbroadcasti128(mx16_table(), ptr[rip + c_e2m1_b_]);
    vmovups(mx16_mask(), yword[rip + c_000f_]);
  }
  void microkernel_mx_i16_avx2(int s) {
    const bool two = mx_stack_acc();
    const Ymm mask = mx16_mask(), table = mx16_table(), idx(two ? 12 : 7), prod(13), word(14);
    auto pair = [&](int m) { return Ymm(two ? 10 + m : 4); };
    for (int m = 0; m < mr_; ++m) vpbroadcastd(pair(m), dword[a_row(m) + 4 * s]);
    for (int v = 0; v < nv_; ++v) {
      const Address mem = yword[reg_w + v * vec_bytes()];
      if (s == 0) {
        vpand(idx, mask, mem);
      } else {
        vmovdqu(word, mem);
        vpsrlw(idx, word, uint8_t(4 * s));
        if (s < 3) vpand(idx, idx, mask);
      }
      vpshufb(idx, table, idx);
      for (int m = 0; m < mr_; ++m) {
        vpmaddwd(prod, idx, pair(m));
        vpaddd(gacc(m, v), gacc(m, v), prod);
      }
    }
  }

  // mx: K step u (0..7) of the current 8-step block. The weights of vector v decode to fp32
  // (w' = value * scale, exact), then one FMA per row of the tile.
  //   mxfp4: the column's dword holds 8 nibbles (step u in bits 4u..4u+3); zmm: vpermps over
  //     the 16-entry e2m1 table reads the low 4 bits of each dword. ymm: vpermps reads 3 bits,
  //     so it gives the magnitude and the sign (nibble bit 3) is moved to bit 31 and xor-ed in.
  //   mxfp8: byte -> word sign-extended, << 7, & 0xbf80 keeps sign and the 7 magnitude bits
  //     as fp16 (the e4m3 value * 2^-8, subnormals included), vcvtph2ps widens it exactly; the
  //     2^8 is folded into the stored exponent (e + 8).
  void microkernel_mx(int u) {
    for (int m = 0; m < mr_; ++m) vbroadcastss(row_bcast(m), dword[a_row(m) + 4 * u]);
    for (int v = 0; v < nv_; ++v) {
      Xmm w;
      if (mx4_ && zmm_isa()) {
        const Zmm idx(30), val(31);
        const Address mem = zword[reg_w + v * vec_bytes()];
        if (u == 0)
          vmovdqu32(idx, mem);
        else
          vpsrld(idx, mem, uint8_t(4 * u));
        // The table in a register when the tile leaves one free, else from memory (L1).
        if (mr_ < 6)
          vpermps(val, idx, Zmm(29));
        else
          vpermps(val, idx, zword[rip + c_e2m1_]);
        w = val;
      } else if (mx4_) {
        const Ymm idx(8), sgn(9), val(10);
        vmovdqu(idx, yword[reg_w + v * vec_bytes()]);
        if (u < 7) {
          vpslld(sgn, idx, uint8_t(28 - 4 * u));
          vpand(sgn, sgn, cpool(c_sign_));
        } else {
          vpand(sgn, idx, cpool(c_sign_));
        }
        if (u > 0) vpsrld(idx, idx, uint8_t(4 * u));
        vpermps(val, idx, yword[rip + c_e2m1_]);
        vxorps(val, val, sgn);
        w = val;
      } else {
        w = e4m3_widen(zmm_isa() ? 30 : 15, reg_w + u * step_bytes() + v * lanes_);
      }
      if (gacc_) {
        for (int m = 0; m < mr_; ++m) vfmadd231ps(gacc(m, v), w, row_bcast(m));
        continue;
      }
      mx_mul_scale(w, v);
      for (int m = 0; m < mr_; ++m) vfmadd231ps(acc(m, v), w, row_bcast(m));
    }
  }

  // Bytes of vector v at K step u. For 4-bit weights, the byte block shared by steps 2p, 2p+1.
  Address weight_mem(int v, int u) const {
    const int woff = nib_ ? (u / 2) * strip_k4_bytes() : u * strip_k4_bytes();
    return vmem(reg_w + woff + sv(v) * vec_bytes());
  }

  // The format's decode step: int8 weights of vector v at K step u into `dst` (4-bit: the nibble
  // shifted to the top, i.e. 16 * q4, exact in int8).
  // int4 at the VNNI levels keeps its 0xF0 nibble mask in aux() (free there: the activations
  // need no sign work), loaded per tile (compute_tile; the epilogue reuses the register). The
  // mask as an embedded broadcast from the constant pool cost a load per weight vector: one-row
  // decode tiles ran 1.36x slower in a loop from L1 on a Zen 4 (3.67 against 2.69 cycles per 64
  // bytes), and a Qwen3 layer's T = 1 forward with its weights in L2 / L3 1.33x slower (61 against
  // 81 GB/s). Streaming from DRAM the decode is bound by the stream either way (A/B within
  // noise).
  bool int4_mask_reg() const { return int4_ && vnni_ && zmm_isa() && !i4w_; }
  void load_weights(const Xmm& dst, int v, int u) {
    const Address mem = weight_mem(v, u);
    if (!int4_) {
      if (zmm_isa())
        vmovdqu8(dst, mem);
      else
        vmovdqu(dst, mem);
      return;
    }
    if (int4_mask_reg()) {  // the 0xF0 bytes in aux(): the high nibbles in one load-and
      if (u % 2 == 0) {
        vpsllw(dst, mem, 4);
        vpandd(dst, dst, aux());
      } else {
        vpandd(dst, aux(), mem);
      }
    } else if (zmm_isa()) {
      if (u % 2 == 0)
        vpsllw(dst, mem, 4);
      else
        vmovdqu8(dst, mem);
      vpandd(dst, dst, ptr_b[rip + c_f0_]);
    } else {
      vmovdqu(dst, mem);
      if (u % 2 == 0) vpsllw(dst, dst, 4);
      vpand(dst, dst, cpool(c_f0_));
    }
  }

  void load_activation(int m, int u) {
    vpbroadcastd(bcast(), dword[a_row(m) + 4 * u]);
    if (vnni_) {
      // Activations arrive as a + 128 (unsigned); Σ 128*w is removed in the epilogue.
    } else if (zmm_isa()) {
      // aux = 0xFF where a < 0; bcast = |a|.
      vpmovb2m(k1, bcast());
      vpmovm2b(aux(), k1);
      vpabsb(bcast(), bcast());
    } else {
      vmovdqa(aux(), bcast());  // sign source for vpsignb
      vpabsb(bcast(), bcast());
    }
  }

  // acc += Σ_{4 k} |a| * (w * sign(a)): every pair sum is at most 2*127*127 < 2^15, so the
  // saturating vpmaddubsw is exact.
  void dot4_signed(const Xmm& accv, int v, int u) {
    const Xmm t = tmp(v);
    if (zmm_isa()) {
      // (w ^ mask) - mask == -w where mask is all ones
      if (int4_) {
        load_weights(t, v, u);
        vpxord(t, aux(), t);
      } else {
        vpxord(t, aux(), weight_mem(v, u));
      }
      vpsubb(t, t, aux());
    } else {
      load_weights(t, v, u);
      vpsignb(t, t, aux());
    }
    vpmaddubsw(t, bcast(), t);
    vpmaddwd(t, t, ones16());
    vpaddd(accv, accv, t);
  }

  // ---- epilogue -----------------------------------------------------------------------------
  void epilogue() {
    mov(reg_tmp, arg(offsetof(GemmArgs, a_scale)));
    lea(reg_tmp, ptr[reg_tmp + reg_row * 4]);
    // y = (a_scale * w_scale) * float(acc)
    const Xmm s = vreg(num_vregs() - 4);
    const Xmm t = vreg(num_vregs() - 3);
    const Xmm asum8 = vreg(num_vregs() - 2);  // int4 (i4w_): 8 * the row's Σ a
    if (i4w_) {
      mov(reg_tmp2, arg(offsetof(GemmArgs, a_gsum)));
      lea(reg_tmp2, ptr[reg_tmp2 + reg_row * 4]);
    }
    for (int m = 0; m < mr_ && !bf16_ && !mx_; ++m) {  // bf16, mx: the accumulators are y
      vbroadcastss(s, dword[reg_tmp + m * 4]);
      if (i4w_) {
        vpbroadcastd(asum8, dword[reg_tmp2 + m * 4]);
        vpslld(asum8, asum8, 3);
      }
      for (int v = 0; v < nv_; ++v) {
        if (qg_) {  // y = a_scale * t
          vmulps(acc(m, v), s, acc(m, v));
          continue;
        }
        if (fp8_) {  // fp32 accumulators, scaled like the integer formats
          vmulps(t, s, vmem(reg_wscale + v * vec_bytes()));
          vmulps(acc(m, v), t, acc(m, v));
          continue;
        }
        if (i4w_) {  // Σ a * (q4 + 8) - 8 * Σ a, times 16: the other levels' sums of a * 16 * q4
          vpsubd(acc(m, v), acc(m, v), asum8);
          vpslld(acc(m, v), acc(m, v), 4);
        }
        if (vnni_) vpsubd(acc(m, v), acc(m, v), vmem(reg_comp + sv(v) * vec_bytes()));
        vcvtdq2ps(acc(m, v), acc(m, v));
        vmulps(t, s, vmem(reg_wscale + sv(v) * vec_bytes()));
        vmulps(acc(m, v), t, acc(m, v));
      }
    }
    switch (key_.epilogue) {
      case Epilogue::store: store_rows(); break;
      case Epilogue::siluup: siluup_rows(); break;
      case Epilogue::accum: accum_rows(); break;
    }
  }

  void out_row_ptr(const Reg64& dst, int m) {
    mov(dst, arg(offsetof(GemmArgs, out_rows)));
    lea(dst, ptr[dst + reg_row * 8]);
    mov(dst, qword[dst + m * 8]);
    add(dst, reg_col);
  }

  void store_rows() {
    for (int m = 0; m < mr_; ++m) {
      out_row_ptr(reg_tmp, m);
      for (int v = 0; v < nv_; ++v) vmovups(vmem(reg_tmp + sv(v) * vec_bytes()), acc(m, v));
    }
  }

  void accum_rows() {
    const Xmm wgt = vreg(num_vregs() - 4);
    const Xmm o = vreg(num_vregs() - 3);
    mov(reg_tmp2, arg(offsetof(GemmArgs, row_weight)));
    lea(reg_tmp2, ptr[reg_tmp2 + reg_row * 4]);
    for (int m = 0; m < mr_; ++m) {
      out_row_ptr(reg_tmp, m);
      vbroadcastss(wgt, dword[reg_tmp2 + m * 4]);
      for (int v = 0; v < nv_; ++v) {
        vmovups(o, vmem(reg_tmp + sv(v) * vec_bytes()));
        vfmadd231ps(o, wgt, acc(m, v));  // o = w * y + o
        vmovups(vmem(reg_tmp + sv(v) * vec_bytes()), o);
      }
    }
  }

  // h = g / (1 + exp(-g)) * u with exp(x) = 2^i * p(f), x*log2e = i + f, i = rne.
  void siluup_rows() {
    const Xmm x = vreg(num_vregs() - 4);
    const Xmm r = vreg(num_vregs() - 3);
    const Xmm p = vreg(num_vregs() - 2);
    const int half = nv_ / 2;
    for (int m = 0; m < mr_; ++m) {
      out_row_ptr(reg_tmp, m);
      for (int v = 0; v < half; ++v) {
        const Xmm g = acc(m, v), u = acc(m, v + half);
        const uint8_t sw = mx_ ? key_.variant : 0;  // SwiGLU variants (swiglu_ref)
        // Clamps with one register: L, then -L, then L again.
        if (sw & kSwigluClamp) {
          const Xmm lim = vreg(num_vregs() - 1);
          vbroadcastss(lim, dword[reg_args + offsetof(GemmArgs, swiglu_limit)]);
          vminps(g, g, lim);
          vxorps(lim, lim, cpool(c_sign_));
          if (sw & kSwigluAlpha) vmaxps(g, g, lim);
          vmaxps(u, u, lim);
          vxorps(lim, lim, cpool(c_sign_));
          vminps(u, u, lim);
        }
        if (sw & kSwigluAlpha) {  // x = -(alpha * g)
          vbroadcastss(x, dword[reg_args + offsetof(GemmArgs, swiglu_alpha)]);
          vmulps(x, x, g);
          vxorps(x, x, cpool(c_sign_));
        } else {
          vxorps(x, g, cpool(c_sign_));
        }
        vminps(x, x, cpool(c_max_));
        vmaxps(x, x, cpool(c_min_));
        vmulps(x, x, cpool(c_log2e_));
        if (zmm_isa())
          vrndscaleps(r, x, 0);
        else
          vroundps(r, x, 0);
        vsubps(x, x, r);  // f
        vmovups(p, cpool(c_poly_[5]));
        for (int c = 4; c >= 0; --c) vfmadd213ps(p, x, cpool(c_poly_[c]));  // p = p*f + c
        vcvtps2dq(r, r);
        vpaddd(r, r, cpool(c_bias_));
        vpslld(r, r, 23);  // 2^i
        vmulps(p, p, r);
        vaddps(p, p, cpool(c_one_));
        vdivps(g, g, p);
        if (sw & kSwigluAlpha) vaddps(u, u, cpool(c_one_));
        vmulps(g, g, u);
        vmovups(vmem(reg_tmp + sv(v) * vec_bytes()), g);
      }
    }
  }

  void emit_constants() {
    align(64);
    emit_const32(c_ones16_, 0x00010001u);
    emit_const32(c_f256_, f32_bits(256.0f));
    emit_const32(c_f2m8_, f32_bits(0x1p-8f));
    emit_const32(c_f2p56_, f32_bits(0x1p56f));
    emit_const32(c_f2p64_, f32_bits(0x1p64f));
    emit_const32(c_e4m3_dw_, 0x87f00000u);
    emit_const32(c_zero_, 0u);
    emit_const32(c_f0_, 0xf0f0f0f0u);
    emit_const32(c_80_, 0x80808080u);
    if (fp8po_) {  // the pair order's word decode (fp8_pair_decode)
      emit_const32(c_87f0_, 0x87f087f0u);
      emit_const32(c_3800_, 0x38003800u);
      emit_const32(c_00ff_, 0x00ff00ffu);
      emit_const32(c_ff00_, 0xff00ff00u);
    }
    emit_const32(c_hi16_, 0xffff0000u);
    emit_const32(c_0f_, 0x0f0f0f0fu);
    L(c_dupw_);  // vpshufb: each dword's low word into both of its words
    for (int i = 0; i < 16; ++i) dd(0x01000100u + 0x04040404u * uint32_t(i % 4));
    emit_const32(c_sign_, 0x80000000u);
    emit_const32(c_max_, f32_bits(88.0f));
    emit_const32(c_min_, f32_bits(-87.0f));
    emit_const32(c_log2e_, f32_bits(1.44269504089f));
    const float poly[6] = {0.9999999995f, 0.6931471805f, 0.2402265069f,
                           0.0555041087f, 0.0096181291f, 0.0013333558f};
    for (int i = 0; i < 6; ++i) emit_const32(c_poly_[i], f32_bits(poly[i]));
    emit_const32(c_bias_, 127u);
    emit_const32(c_one_, f32_bits(1.0f));
    emit_const32(c_f16_mask_, 0xbf80bf80u);  // fp16 sign + e4m3 magnitude bits, per word
    L(c_e2m1_);  // the 16 e2m1 values; the first 8 (magnitudes) are AVX2's 8-entry table
    for (int i = 0; i < 16; ++i) dd(f32_bits(mx_e2m1(uint8_t(i))));
    align(64);
    L(c_e2m1_w_);  // 2 * e2m1 as int16 for every 5-bit index (the stray bit 4 ignored)
    for (int i = 0; i < 32; ++i) dw(uint16_t(int16_t(2.0f * mx_e2m1(uint8_t(i & 15)))));
    // the offset the avx2 words carry: entry 0 (12) in the high byte, 12 in the low one
    static_assert(formats::kMxI16CodeOffset == 12 + 12 * 256);
    L(c_e2m1_b_);  // 2 * e2m1 + 12 as bytes for every nibble (AVX2 vpshufb, unsigned)
    for (int i = 0; i < 16; ++i) db(uint8_t(int(2.0f * mx_e2m1(uint8_t(i))) + 12));
    L(c_000f_);
    for (int i = 0; i < 16; ++i) dw(0x000f);
    if (mxp_ && mx4_) {  // the fused block's word decode (mx4_word_decode)
      align(64);
      emit_const32(c_fcb_, 0xfcfcfcfcu);    // 252 in every byte: the largest scale it takes
      emit_const32(c_3f80w_, 0x3f803f80u);  // 127 << 7 per word: the exponent bias
      L(c_e2m1_bf_);                        // e2m1's bf16 bits for every 5-bit index, zeros as 0
      for (int i = 0; i < 32; ++i)
        dw(i & 7 ? uint16_t(f32_bits(mx_e2m1(uint8_t(i & 15))) >> 16) : 0);
    }
    if (fp8p_ || mx8d_ || (mxp_ && mx8_)) emit_fp8_pair_constants();
    if (mxp_ && mx8_) {                     // mx8_word_decode's
      emit_const32(c_4380w_, 0x43804380u);  // (127 + 8) << 7 per word: mxfp8's exponent bias
      emit_const32(c_8000w_, 0x80008000u);
      align(64);
      L(c_mx8_hi_);  // fp8 pairs' high bytes again, zero as 0xc0
      for (int b = 0; b < 128; ++b) db(b ? uint8_t(f32_bits(fp8_value(uint8_t(b))) >> 24) : 0xc0);
    }
  }

  // fp8 pair kernels: the low and high bytes of bf16(fp8_value(b)) for b = 0..127, and per 32
  // columns j the byte gather that makes byte 16i + 8h + 2p + r of the result the weight of
  // (row k + r, column 32j + 16h + 4i + p): vpunpck{l,h}bw (in 128-bit lanes: bytes 0-7, 8-15)
  // then give column 32j + 16h + d in dword d.
  void emit_fp8_pair_constants() {
    for (int half = 0; half < 2; ++half) {
      align(64);
      L(c_fp8_lut_[half]);
      for (int b = 0; b < 128; ++b) {
        const uint32_t bits = f32_bits(fp8_value(uint8_t(b)));
        if (bits & 0xffffu) throw std::logic_error("gemm: fp8 value not exact in bf16");
        db(uint8_t(bits >> (16 + 8 * half)));
      }
    }
    if (fp8po_) {  // the pair order's high bytes: the bf16 of the value * 2^-8 (exact)
      align(64);
      L(c_fp8_hi8_);
      for (int b = 0; b < 128; ++b) db(uint8_t(f32_bits(fp8_value(uint8_t(b)) * 0x1p-8f) >> 24));
    }
    const int cols = strip_cols();
    for (int j = 0; 2 * j < nv_; ++j) {
      align(64);
      L(c_fp8_idx_[j]);
      for (int pos = 0; pos < 64; ++pos) {
        const int r = pos & 1, p = (pos >> 1) & 3, h = (pos >> 3) & 1, i = pos >> 4;
        const int col = 32 * j + 16 * h + 4 * i + p;
        db(uint8_t(col < cols ? r * cols + col : 0));
      }
    }
  }

  const KernelKey key_;
  const int lanes_;
  int nv_;  // vectors of the register tile: the strip's, or a half-strip pass's (kHalfStrips)
  int mr_;  // rows of the register tile: the key's, or a call's tail (m_tail, tail_rows)
  const bool vnni_, int4_;
  const bool i4w_;  // avx2 / avx512 int4: the code q4 + 8 times a, int16 sums (int4_int16_sums)
  const bool bf16_, pairs_, fp8_, fp8p_, mxp_, sfma_, prefill_;
  const bool mx8d_;   // mxfp8 pair decode tiles (mx8_pair_decode_kernel)
  const bool fp8po_;  // fp8 full strips in the pair order (kFp8PairOrder)
  const bool pf_spread_;  // decode prefetch step by step (decode_prefetch_spread)
  const bool qg_, qg4_, qgb_, qgo_, qgs_;
  const int qgh_;    // 16-bit scales: 1 fp16, 2 bf16
  const bool qgs2_;  // avx2 tiles of 2 rows: fp32 accumulators on the stack (acc_slot)
  const bool qgw_;   // int16 group sums (kQGroupI16)
  const bool qgi_;   // nibbles are the codes (kQGroupIdentity)
  const bool qgf_;   // int32-fold codes (kQGroupIntFold): signed, activations a + 128
  const bool qgf32_;  // and their avx2 kernels' int32 super-block sums (VNNI: fp32 partials)
  const bool qgl_;   // int16-lane super-block folds (kQGroupLaneFold)
  const bool qgp_;   // fp32 super-block partials (kQGroupSuperSums)
  const bool qglb_;  // ... over byte codes: folded every kQGroupByteLaneSteps K steps
  const bool qss_;   // group scale vectors built once per strip (qgroup_scale_scratch_kernel)
  const int qc0_;    // offset codes: c0
  const bool gsum_, nib_;
  const bool mx4_, mx8_, mx_, gacc_, i16_;
  // emitting the first step of a group (qgroup_steps) or of an int4 lane block (k_loop_int4w):
  // it writes the accumulators instead of adding to them
  bool first_step_ = false;
  const bool fp8dw_;  // avx2 one-row fp8 decode in the fp32 domain (jit/gemm.hpp fp8_dword_decode)
  const int sv_;      // vectors of the strip (KernelKey::n_vec)
  const bool half_;   // 4-row tiles over half strips (kHalfStrips, jit/gemm.hpp half_strip_kernel)
  int vstride_ = 1;   // strip vectors from one tile vector to the next (half strips: 2)
  int p_ = 0;         // the half-strip pass: strip vector of tile vector 0
  // its constants, loaded at each group start: one row, ymm 13 and 7 (free beside acc 0-3, group
  // sums 8-11, broadcast 12); two rows, ymm 8 and 9 (group sums 0-7, the fp32 accumulators on
  // the stack, broadcasts 12-13, decode 14, fold 15)
  Xmm fp8dw_mask() const {  // 0x87f00000: sign, 4 exponent, 3 mantissa bits
    return vreg(mr_ == 2 ? 8 : 13);
  }
  Xmm fp8dw_scale() const { return vreg(mr_ == 2 ? 9 : 7); }  // 2^64 for the activation
  // gacc_: the group accumulators of (row m, vector v), zmm8..15 (free with <= 2 rows); fp8 pair
  // kernels of 3-4 rows use the accumulator registers (fp8_stack_acc).
  // (ymm8..11 on AVX2 for one row; its two-row fp8 tiles keep the fp32 accumulators on the stack.)
  Xmm gacc(int m, int v) const {
    return fp8_stack_acc() || mx_stack_acc() ? acc(m, v) : vreg(8 + m * nv_ + v);
  }
  void zero_gacc() {
    for (int m = 0; m < mr_; ++m)
      for (int v = 0; v < nv_; ++v) vpxord_any(gacc(m, v));
  }
  Label c_dupw_, c_0f_, c_e2m1_, c_e2m1_w_, c_e2m1_b_, c_000f_, c_f16_mask_, c_80_, c_hi16_,
      c_fp8_lut_[2], c_fp8_idx_[2], c_fp8_hi8_, c_87f0_, c_3800_, c_00ff_, c_ff00_;
  Label c_f2p56_, c_f2p64_, c_e4m3_dw_, c_4380w_, c_8000w_, c_mx8_hi_;
  Label c_fcb_, c_3f80w_, c_e2m1_bf_;
  Label c_ones16_, c_f256_, c_f2m8_, c_zero_, c_f0_, c_sign_, c_max_, c_min_, c_log2e_, c_poly_[6],
      c_bias_, c_one_;
};

}  // namespace

std::vector<uint8_t> generate_gemm(const KernelKey& key) {
  GemmGenerator g(key);
  return g.bytes();
}

}  // namespace ktjit::x64
