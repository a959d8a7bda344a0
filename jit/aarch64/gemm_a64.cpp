// AArch64 NEON GEMM generator (asmjit a64): the loop nest of jit/x64/gemm.cpp on 128-bit vectors
//   strips -> [prefill: M blocks] -> K steps (unrolled x4) -> microkernel -> epilogue.
// A vector holds 4 int32/fp32 lanes, a strip 4 vectors = 16 columns; the packed layout is the same
// formats::StripLayout ([k4][column][4 k] bytes) with lanes = 4. Accumulator lanes hold one output
// column each, exactly as on x86, so gemm_ref is the oracle bit for bit:
//   neon_dotprod, neon_bf16: sdot v.4s, w.16b, a.4b[0] (signed x signed: activations stay int8,
//                            no +128 offset and no compensation).
//   neon:                    smull/smull2 (int8 x int8 -> int16), addp (pairs, |sum| <= 2*127*128 <
//                            2^15, exact), sadalp into the int32 accumulators.
//   int4:                    the nibble decode to 16*q4 (shl #4 for the low nibble, and 0xf0 for
//                            the high one) in front of either dot product.
//   bf16 strips hold k pairs ([k/2][column][2], jit/gemm.hpp bf16_kgroup; one K step = one pair,
//   args.k4 pairs, an odd K ends with a zero k): a 128-bit load is 4 columns x one pair.
//   fp8 (every level):       e4m3 bytes ([k][column], one k a step, jit/gemm.hpp fp8_value) with
//                            fp32 activations, the fp16 route of x86's group-accumulating decode
//                            kernels: sshll #7 of the byte (sign-extended) and bic of bit 14 give
//                            the fp16 bits of value * 2^-8 (subnormals included, exact), fcvtl
//                            widens them; each K group's products are summed by fmla in their own
//                            accumulators (v8-v15) and folded once, acc = fma(g, scale * 2^8,
//                            acc) (gemm_ref's rule for these kernels). 2 rows at most.
//   bf16 (every level):      fp32 activations: the pair dword widened exactly to the even k
//                            (shl #16) and the odd k (bic of the low half), then fmla by element,
//                            k before k + 1 on each accumulator: one fused multiply-add per k in k
//                            order, the reference's fmaf chain.
//   bf16 kBf16Pairs:         (neon_bf16, prefill; jit/gemm.hpp bf16_pair_kernel) bf16 activation
//                            rows (rounded RNE by the executor): bfdot v.4s, w.8h, a.2h[0] with
//                            the strip's pair vector as it is. bfdot rounds differently from the
//                            fp32 chain (both products, their sum and the accumulation each
//                            rounded to odd, subnormals flushed; gemm_ref's bfdot_lane), and the
//                            activations lose their low 16 bits, so these kernels have their own
//                            twin and cost about 2^-9 relative per activation, as x86's
//                            vdpbf16ps pair kernels do; in exchange they do 8 multiply-adds an
//                            instruction instead of 4, with no widening.
//   qgroup (every level; GGUF, RAWINT4, GPTQ_INT4: formats/grouped.hpp): x86's strip of groups,
//                            codes signed (no +128, no offset), bytes or 4-bit indices looked up
//                            with tbl in the 16-entry table; per group the int32 sums (sdot, or
//                            smull/addp/sadalp) start at zero beside the fp32 accumulators and are
//                            folded, t = fma(scale, float(acc_g), t) then t = fma(bias, float(s_g),
//                            t), the scale fp32, widened from fp16 (fcvtl) or bf16 (shll #16), or
//                            two-level float(sub) * factor: gemm_ref's per-group order, so the
//                            same bits as every x86 level without int32 folds; y = a_scale * t.
//   mxfp4 / mxfp8 (every level; formats/mx.hpp strips): fp32 activations and, per k, each column's
//                            weight w = v * scale in fp32 (scale = 2^(e - 127) from the group's
//                            exponent byte, ushll + shl #23; mxfp8 v = e4m3 * 2^-8 by the fp8
//                            route, mxfp4 v from the nibble: and / ushr, tbl through the int8
//                            table of 2 * e2m1, shl #24, scvtf with 25 fraction bits, exact),
//                            then fmla by element into the accumulators, k in order: gemm_ref_mx's
//                            fp32 chain acc = fma(a[k], w, acc) (no group sums on NEON). 4 rows.
//                            The siluup epilogue takes the SwiGLU clamp (selects with x86's
//                            operand order, NaN included) and alpha variants (swiglu_ref).
// Epilogues as on x86: y = (a_scale*w_scale)*float(acc) (two roundings), then store, siluup (the
// exp_ref polynomial with fmla in the same order) or accum (fmla = fma(routing_weight, y, out)).
#include "jit/aarch64/gemm_a64.hpp"

#include <asmjit/arm/a64assembler.h>
#include <asmjit/core.h>

#include <cstddef>
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>

#include "jit/aarch64/a64_emitter.hpp"
#include "jit/gemm.hpp"

// CMakeLists.txt renames the `stderr` reference of Debian's (PIE-built) libasmjit.a to this
// variable so the archive links into the Python extension; hidden, so it is reached PC-relative.
extern "C" __attribute__((visibility("hidden"))) FILE* ktjit_asmjit_stderr;
FILE* ktjit_asmjit_stderr = stderr;

namespace ktjit::aarch64 {
namespace {

namespace aj = asmjit;
namespace a64 = asmjit::a64;
using a64::GpX;
using a64::VecV;

uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

class GemmA64 {
 public:
  explicit GemmA64(const KernelKey& key)
      : key_(key),
        nv_(key.n_vec),
        mr_(key.m_r),
        dot_(key.isa == IsaLevel::neon_dotprod || key.isa == IsaLevel::neon_bf16),
        int4_(key.format == WeightFormat::int4),
        bf16_(key.format == WeightFormat::bf16),
        fp8_(key.format == WeightFormat::fp8),
        pairs_(bf16_ && (key.variant & kBf16Pairs)),
        prefill_(key.kind == KernelKind::gemm_prefill),
        qg_(key.format == WeightFormat::qgroup),
        qg4_(qg_ && (key.variant & kQGroupNibbles)),
        qgb_(qg_ && (key.variant & kQGroupBias)),
        qgs_(qg_ && (key.variant & kQGroupSuper)),
        qgh_(qg_ ? qgroup_half_scales(key) : 0),
        mx4_(key.format == WeightFormat::mxfp4),
        mx_(is_mx_format(key.format)) {
    if (!isa_is_neon(key.isa))
      throw std::invalid_argument("gemm (aarch64): not a NEON level: " + key.describe());
    if (key.format != WeightFormat::int8 && key.format != WeightFormat::int4 &&
        key.format != WeightFormat::bf16 && key.format != WeightFormat::fp8 && !qg_ && !mx_)
      throw std::invalid_argument(
          "gemm (aarch64): weight format not generated for NEON (int8, int4, bf16, fp8, qgroup, "
          "mxfp4 and mxfp8 are): " +
          key.describe());
    if (mx_ && ((key.variant & ~(kSwigluClamp | kSwigluAlpha)) ||
                (key.variant && key.epilogue != Epilogue::siluup)))
      throw std::invalid_argument(
          "gemm (aarch64): mx variants on NEON are the siluup SwiGLU options: " + key.describe());
    // qgroup: x86's offset codes, int16 sums, identity table and int32 folds are avx2 kernels
    if (qg_ && ((key.variant &
                 ~(kQGroupNibbles | kQGroupBias | kQGroupSuper | kQGroupF16 | kQGroupBf16)) ||
                __builtin_popcount(key.variant & (kQGroupSuper | kQGroupF16 | kQGroupBf16)) > 1))
      throw std::invalid_argument(
          "gemm (aarch64): qgroup variants on NEON are nibbles, bias and one scale form "
          "(two-level, "
          "fp16 or bf16): " +
          key.describe());
    if (fp8_ && key.variant)
      throw std::invalid_argument("gemm (aarch64): fp8 has no variants on NEON: " + key.describe());
    if (nv_ < 1 || nv_ > kStripVecs || mr_ < 1 || mr_ > gemm_max_rows(key.isa, key.format))
      throw std::invalid_argument("gemm (aarch64): tile out of range: " + key.describe());
    if (key.epilogue == Epilogue::siluup && nv_ % 2)
      throw std::invalid_argument("gemm (aarch64): siluup needs an even number of vectors");
    if (bf16_ && (key.variant & ~kBf16Pairs))
      throw std::invalid_argument("gemm (aarch64): unknown bf16 variant: " + key.describe());
    if (pairs_ && (key.isa != IsaLevel::neon_bf16 || !prefill_))
      throw std::invalid_argument(
          "gemm (aarch64): bf16 pair (bfdot) kernels are prefill kernels at neon_bf16: " +
          key.describe());
    generate();
  }

  std::vector<uint8_t> bytes() { return emit_.bytes(); }

 private:
  // ---- register roles (AAPCS64: x0-x17 are caller-saved; v8-v15 low halves are saved) --------
  const GpX reg_args = a64::x0;
  const GpX reg_w = a64::x1;                               // weight stream
  GpX a_row(int m) const { return GpX(uint32_t(2 + m)); }  // x2..x7: rows of the block, along K
  const GpX reg_lda = a64::x8;
  const GpX reg_k = a64::x9;        // K-step counter
  const GpX reg_row = a64::x10;     // first row of the current block
  const GpX reg_wscale = a64::x11;  // strip's scales
  const GpX reg_strips = a64::x12;  // strips left
  const GpX reg_col = a64::x13;     // strip's first output column, in bytes
  const GpX reg_mb = a64::x14;      // M-block counter (prefill)
  const GpX reg_strip = a64::x15;   // strip start (prefill re-reads it per block)
  const GpX reg_tmp = a64::x16;
  const GpX reg_tmp2 = a64::x17;
  // fp8 (2 rows: a_row uses x2, x3 only): the strip's group-scale table, the current group's
  // entry, and the K steps of the current group.
  const GpX reg_gs = a64::x4;
  const GpX reg_gcur = a64::x5;
  const GpX reg_gn = a64::x6;
  // qgroup (3 rows at most: a_row uses x2..x4): the block's a_gsum entry of the current group,
  // super blocks left, the current super block's header, its groups left (x11: qgroup scales
  // live in the weight stream, so reg_wscale is free).
  const GpX reg_gsum = a64::x5;
  const GpX reg_gc = a64::x6;
  const GpX reg_sb = a64::x7;
  const GpX reg_sg = a64::x11;

  // v0..v23: accumulators (row-major over the tile); v24..v31: scratch.
  static VecV v(int i) { return VecV(uint32_t(i)); }
  VecV acc(int m, int vv) const { return v(m * nv_ + vv); }
  static VecV wreg(int vv) { return v(24 + vv); }     // weights of vector vv at one K step
  static VecV act(int m) { return v(28 + (m & 1)); }  // sdot / bfdot: one row's activation
  static VecV wide_act() { return v(28); }            // widening path: replicated activation
  static VecV wide_t(int i) { return v(29 + i); }     // widening path: two int16 products
  static VecV nib_mask() { return v(31); }            // int4: 0xf0 bytes
  // fp8: group sums beside the accumulators, decoded weights, their int16 halves, activations
  // (4 k of one row), the fold's scale and 2^8.
  VecV gacc(int m, int vv) const { return v(8 + m * nv_ + vv); }
  static VecV fp8_w(int vv) { return v(16 + vv); }
  static VecV fp8_h(int i) { return v(20 + i); }
  static VecV fp8_act(int m) { return v(28 + m); }
  static VecV fp8_scale() { return v(22); }
  static VecV fp8_c256() { return v(30); }
  // qgroup: fp32 accumulators acc(m, vv) in v0..v11, the int32 group sums beside them in
  // v12..v23; the codes of two K steps (v24, v25), the rows' 16 activation bytes (v26..v28), the
  // table (v29) and the 0x0f mask (v30). The widening path (2 rows: sums in v12..v19) replicates
  // each row's step activations into v20..v23 and takes its two int16 products in v28 and v31.
  // At a group end: scale v24, bias v25, the rows' s_g v26..v28, temporary v31.
  VecV qacc(int m, int vv) const { return v(12 + m * nv_ + vv); }
  static VecV q_codes(int j) { return v(24 + j); }
  static VecV q_act(int m) { return v(26 + m); }
  static VecV q_wide(int m, int j) { return v(20 + 2 * m + j); }
  static VecV q_lut() { return v(29); }
  static VecV q_mask() { return v(30); }
  static VecV q_tmp() { return v(31); }
  // mx (4 rows): accumulators v0..v15, the group's scales v16..v19, the rows' 4 activations
  // v20..v23, the decoded weights of one k v24..v27; mxfp8's fp16 halves v28, v29; mxfp4's table
  // (v28) and low-nibble mask (v29).
  static VecV mx_scale(int vv) { return v(16 + vv); }
  static VecV mx_act(int m) { return v(20 + m); }
  static VecV mx_w(int vv) { return v(24 + vv); }

  int lanes() const { return 4; }
  int strip_cols() const { return nv_ * lanes(); }
  int strip_k4_bytes() const { return strip_cols() * 4; }
  // Weight bytes per K step (bf16: a k pair, [k/2][column][2]).
  int step_bytes() const {
    if (fp8_ || (mx_ && !mx4_)) return strip_cols();  // one k: a byte per column
    if (mx4_) return strip_cols() / 2;
    return bf16_ ? strip_cols() * 4 : int4_ || qg4_ ? strip_k4_bytes() / 2 : strip_k4_bytes();
  }
  // qgroup: bytes after each group's codes (its scales, then biases: one per column, fp32, 16-bit
  // or with two-level scales int8 subs) and of a super block's header (fp32 factors).
  int qg_elem_bytes() const { return qgs_ ? 1 : qgh_ ? 2 : 4; }
  int qg_extra_bytes() const { return strip_cols() * qg_elem_bytes() * (qgb_ ? 2 : 1); }
  int qg_header_bytes() const { return qgs_ ? strip_cols() * 4 * (qgb_ ? 2 : 1) : 0; }
  // Activation bytes per K step: 4 int8, a pair of fp32 (bf16) or of bf16 (bfdot).
  int act_step_bytes() const { return bf16_ && !pairs_ ? 8 : 4; }  // fp8: one fp32
  int out_cols() const { return gemm_strip_out_cols(key_.isa, nv_, key_.epilogue); }
  static aj::arm::Mem arg(size_t off) { return a64::ptr(a64::x0, int32_t(off)); }

  a64::Assembler& as() { return emit_.as(); }

  // ---- loop nest --------------------------------------------------------------------------
  void generate() {
    auto& a = as();
    // Save d8-d15 (callee-saved low halves of v8-v15).
    a.stp(a64::d8, a64::d9, a64::ptr_pre(a64::sp, -64));
    a.stp(a64::d10, a64::d11, a64::ptr(a64::sp, 16));
    a.stp(a64::d12, a64::d13, a64::ptr(a64::sp, 32));
    a.stp(a64::d14, a64::d15, a64::ptr(a64::sp, 48));
    pool_ = a.newLabel();
    aj::Label strip_loop = a.newLabel(), done = a.newLabel();
    a.ldr(reg_strips, arg(offsetof(GemmArgs, n_strips)));
    a.cmp(reg_strips, 0);
    a.b_le(done);
    a.ldr(reg_w, arg(offsetof(GemmArgs, w)));
    a.ldr(reg_lda, arg(offsetof(GemmArgs, lda)));
    if (!qg_) a.ldr(reg_wscale, arg(offsetof(GemmArgs, w_scale)));
    a.ldr(reg_col, arg(offsetof(GemmArgs, out_col)));
    a.lsl(reg_col, reg_col, 2);
    if (fp8_) a.ldr(reg_gs, arg(offsetof(GemmArgs, w_gscale)));
    a.bind(strip_loop);
    {
      a.mov(reg_strip, reg_w);
      a.mov(reg_row, 0);
      if (prefill_) {
        aj::Label mb_loop = a.newLabel(), mb_done = a.newLabel();
        a.ldr(reg_mb, arg(offsetof(GemmArgs, m_blocks)));
        a.cmp(reg_mb, 0);
        a.b_le(mb_done);
        a.bind(mb_loop);
        a.mov(reg_w, reg_strip);
        compute_block();
        a.add(reg_row, reg_row, mr_);
        a.subs(reg_mb, reg_mb, 1);
        a.b_ne(mb_loop);
        a.bind(mb_done);
        // Leave reg_w at the next strip whether or not any block ran.
        if (qg_ || mx_) {
          grouped_strip_bytes_to(reg_tmp);
          a.add(reg_w, reg_strip, reg_tmp);
        } else {
          a.ldr(reg_tmp, arg(offsetof(GemmArgs, k4)));
          a.mov(reg_tmp2, step_bytes());
          a.madd(reg_w, reg_tmp, reg_tmp2, reg_strip);
        }
      } else {
        compute_block();  // leaves reg_w at the next strip
      }
      if (!qg_) a.add(reg_wscale, reg_wscale, strip_cols() * 4);
      a.add(reg_col, reg_col, out_cols() * 4);
      if (fp8_) {  // next strip's table: g_per_strip groups x 2 halves x 4 lanes of fp32
        a.ldr(reg_tmp, arg(offsetof(GemmArgs, g_per_strip)));
        a.add(reg_gs, reg_gs, reg_tmp, aj::arm::lsl(5));
      }
      a.subs(reg_strips, reg_strips, 1);
      a.b_ne(strip_loop);
    }
    a.bind(done);
    a.ldp(a64::d14, a64::d15, a64::ptr(a64::sp, 48));
    a.ldp(a64::d12, a64::d13, a64::ptr(a64::sp, 32));
    a.ldp(a64::d10, a64::d11, a64::ptr(a64::sp, 16));
    a.ldp(a64::d8, a64::d9, a64::ptr_post(a64::sp, 64));
    a.ret(a64::x30);
    emit_constants();
  }

  // One register tile: rows [reg_row, reg_row + mr) x the current strip, over all of K.
  void compute_block() {
    auto& a = as();
    a.ldr(reg_tmp, arg(offsetof(GemmArgs, a)));
    a.madd(a_row(0), reg_row, reg_lda, reg_tmp);
    for (int m = 1; m < mr_; ++m) a.add(a_row(m), a_row(m - 1), reg_lda);
    for (int m = 0; m < mr_; ++m)
      for (int vv = 0; vv < nv_; ++vv) a.movi(acc(m, vv).b16(), 0);
    if (int4_) a.movi(nib_mask().b16(), 0xf0);  // per block: the siluup epilogue reuses v31
    if (fp8_)
      k_loop_fp8();
    else if (qg_)
      k_loop_qgroup();
    else if (mx_)
      k_loop_mx();
    else
      k_loop();
    epilogue();
  }

  // ---- mx -------------------------------------------------------------------------------------
  // Per group: the scales from the exponent bytes, then the group's k (a multiple of 8) eight at
  // a time, each row's activations four at a time.
  void k_loop_mx() {
    auto& a = as();
    if (mx4_) {  // per block: the siluup epilogue reuses v28 / v29
      a.adr(reg_tmp2, pool_);
      a.ldr(v(28), a64::ptr(reg_tmp2, 16 * kE2m1));
      a.movi(v(29).s4(), 15);
    }
    aj::Label group = a.newLabel(), eight = a.newLabel();
    a.ldr(reg_sg, arg(offsetof(GemmArgs, g_per_strip)));
    a.bind(group);
    for (int vv = 0; vv < nv_; ++vv) {  // 2^(e - 127): the exponent byte as fp32 bits
      const VecV t = mx_scale(vv);
      a.ldr(a64::VecS(t.id()), a64::ptr(reg_w, 4 * vv));
      a.ushll(t.h8(), t.b8(), 0);
      a.ushll(t.s4(), t.h4(), 0);
      a.shl(t.s4(), t.s4(), 23);
    }
    a.add(reg_w, reg_w, strip_cols());
    a.ldr(reg_k, arg(offsetof(GemmArgs, g_steps)));
    a.bind(eight);
    for (int h = 0; h < 2; ++h) {
      for (int m = 0; m < mr_; ++m) a.ldr(mx_act(m), a64::ptr(a_row(m), 16 * h));
      for (int j = 0; j < 4; ++j) {
        mx_decode(4 * h + j);
        for (int m = 0; m < mr_; ++m)
          for (int vv = 0; vv < nv_; ++vv)
            a.fmla(acc(m, vv).s4(), mx_w(vv).s4(), mx_act(m).s(uint32_t(j)));
      }
    }
    for (int m = 0; m < mr_; ++m) a.add(a_row(m), a_row(m), 32);
    a.add(reg_w, reg_w, 8 * step_bytes());
    a.subs(reg_k, reg_k, 8);
    a.b_gt(eight);
    a.subs(reg_sg, reg_sg, 1);
    a.b_ne(group);
  }

  // The weights of k (0..7 past reg_w) for every vector: w = v * scale in mx_w(vv).
  void mx_decode(int k) {
    auto& a = as();
    if (mx4_) {  // [8 k][column][4 bytes]: nibble k of each column's dword
      for (int vv = 0; vv < nv_; ++vv) {
        const VecV w = mx_w(vv);
        a.ldr(w, a64::ptr(reg_w, vv * 16));
        if (k) a.ushr(w.s4(), w.s4(), uint32_t(4 * k));
        a.and_(w.b16(), w.b16(), v(29).b16());
        a.tbl(w.b16(), v(28).b16(), w.b16());  // 2 * e2m1 in byte 0, the other bytes 0
        a.shl(w.s4(), w.s4(), 24);
        a.scvtf(w.s4(), w.s4(), 25);  // (2 * v) * 2^24 / 2^25 = v, exact
        a.fmul(w.s4(), w.s4(), mx_scale(vv).s4());
      }
      return;
    }
    // [k][column] e4m3 bytes: the fp8 route to v = e4m3 * 2^-8, exactly
    decode_e4m3(k * strip_cols(), v(28), v(29), mx_w(0).id());
    for (int vv = 0; vv < nv_; ++vv) a.fmul(mx_w(vv).s4(), mx_w(vv).s4(), mx_scale(vv).s4());
  }

  // ---- qgroup ---------------------------------------------------------------------------------
  // Bytes of one strip of a grouped format into `r`: per group its g_steps K steps and its other
  // bytes (mx: the columns' exponent bytes before them; qgroup: the scales after them); with
  // two-level scales per super block its header and g_per_super groups.
  void grouped_strip_bytes_to(const GpX& r) {
    auto& a = as();
    a.ldr(r, arg(offsetof(GemmArgs, g_steps)));
    a.mov(reg_tmp2, step_bytes());
    a.mul(r, r, reg_tmp2);
    a.add(r, r, mx_ ? strip_cols() : qg_extra_bytes());
    if (qgs_) {
      a.ldr(reg_tmp2, arg(offsetof(GemmArgs, g_per_super)));
      a.mul(r, r, reg_tmp2);
      a.add(r, r, qg_header_bytes());
      a.ldr(reg_tmp2, arg(offsetof(GemmArgs, s_per_strip)));
    } else {
      a.ldr(reg_tmp2, arg(offsetof(GemmArgs, g_per_strip)));
    }
    a.mul(r, r, reg_tmp2);
  }

  // Per super block (one over the whole strip without two-level scales): its header, then per
  // group the int32 sums from zero over the group's K steps (a multiple of 4: whole unrolled
  // iterations, nibble pairs never split) and the fold into the fp32 accumulators.
  void k_loop_qgroup() {
    auto& a = as();
    if (qg4_) {  // per block: the siluup epilogue reuses v29 / v30
      a.ldr(reg_tmp, arg(offsetof(GemmArgs, lut)));
      a.ldr(q_lut(), a64::ptr(reg_tmp));
      a.movi(q_mask().b16(), 0x0f);
    }
    if (qgb_) {
      a.ldr(reg_gsum, arg(offsetof(GemmArgs, a_gsum)));
      a.add(reg_gsum, reg_gsum, reg_row, aj::arm::lsl(2));
    }
    aj::Label super = a.newLabel(), group = a.newLabel(), steps = a.newLabel();
    if (qgs_)
      a.ldr(reg_gc, arg(offsetof(GemmArgs, s_per_strip)));
    else
      a.mov(reg_gc, 1);
    a.bind(super);
    if (qgs_) {
      a.mov(reg_sb, reg_w);
      a.add(reg_w, reg_w, qg_header_bytes());
    }
    a.ldr(reg_sg, arg(qgs_ ? offsetof(GemmArgs, g_per_super) : offsetof(GemmArgs, g_per_strip)));
    a.bind(group);
    for (int m = 0; m < mr_; ++m)
      for (int vv = 0; vv < nv_; ++vv) a.movi(qacc(m, vv).b16(), 0);
    a.ldr(reg_k, arg(offsetof(GemmArgs, g_steps)));
    a.bind(steps);
    static_assert(kUnroll == 4, "one quad of K steps per iteration");
    microkernel_qgroup_quad();
    advance(kUnroll);
    a.subs(reg_k, reg_k, kUnroll);
    a.b_gt(steps);
    qgroup_group_end();
    a.subs(reg_sg, reg_sg, 1);
    a.b_ne(group);
    a.subs(reg_gc, reg_gc, 1);
    a.b_ne(super);
  }

  // Four K steps (16 k) of a qgroup tile, two at a time: the rows' 16 activation bytes loaded
  // once; per vector the codes of both steps (nibbles: one load, the low nibbles for the even step
  // and the high ones for the odd, each looked up in the table; bytes: two loads), decoded once
  // for all rows, then sdot (4 k per column, signed x signed; activation element = step) or the
  // widening path into the int32 group sums (exact either way, so the order is free).
  void microkernel_qgroup_quad() {
    auto& a = as();
    const VecV c[2] = {q_codes(0), q_codes(1)};
    for (int m = 0; m < mr_; ++m) a.ldr(q_act(m), a64::ptr(a_row(m)));
    for (int p = 0; p < 2; ++p) {
      for (int m = 0; !dot_ && m < mr_; ++m)
        for (int j = 0; j < 2; ++j) a.dup(q_wide(m, j).s4(), q_act(m).s(2 * p + j));
      for (int vv = 0; vv < nv_; ++vv) {
        if (qg4_) {
          a.ldr(c[1], a64::ptr(reg_w, p * strip_k4_bytes() + vv * 16));
          a.and_(c[0].b16(), c[1].b16(), q_mask().b16());
          a.ushr(c[1].b16(), c[1].b16(), 4);
          for (const VecV& x : c) a.tbl(x.b16(), q_lut().b16(), x.b16());
        } else {
          for (int j = 0; j < 2; ++j)
            a.ldr(c[j], a64::ptr(reg_w, (2 * p + j) * strip_k4_bytes() + vv * 16));
        }
        for (int m = 0; m < mr_; ++m)
          for (int j = 0; j < 2; ++j) {
            if (dot_) {
              a.sdot(qacc(m, vv).s4(), c[j].b16(), q_act(m).b4(2 * p + j));
              continue;
            }
            const VecV t0 = v(28), t1 = q_tmp(), x = q_wide(m, j);
            a.smull(t0.h8(), c[j].b8(), x.b8());     // columns 0,1 x 4 k
            a.smull2(t1.h8(), c[j].b16(), x.b16());  // columns 2,3 x 4 k
            a.addp(t0.h8(), t0.h8(), t1.h8());       // pair sums, |.| <= 2*128*127: exact int16
            a.sadalp(qacc(m, vv).s4(), t0.h8());
          }
      }
    }
  }

  // The group's scale (b = 0) or bias (b = 1) of vector vv as fp32 into `t`, reg_w at the group's
  // extras: fp32 as stored, fp16 / bf16 widened exactly, or float(sub) * factor (exact: the
  // one-level fp32 value).
  void qgroup_scale_vector(const VecV& t, int vv, int b) {
    auto& a = as();
    const int col = b * strip_cols() + vv * lanes();
    if (qgh_) {
      a.ldr(a64::VecD(t.id()), a64::ptr(reg_w, col * 2));
      if (qgh_ == 1)
        a.fcvtl(t.s4(), t.h4());
      else
        a.shll(t.s4(), t.h4(), 16);
      return;
    }
    if (!qgs_) {
      a.ldr(t, a64::ptr(reg_w, col * 4));
      return;
    }
    a.ldr(a64::VecS(t.id()), a64::ptr(reg_w, col));
    a.sxtl(t.h8(), t.b8());
    a.sxtl(t.s4(), t.h4());
    a.scvtf(t.s4(), t.s4());
    a.ldr(q_tmp(), a64::ptr(reg_sb, col * 4));
    a.fmul(t.s4(), t.s4(), q_tmp().s4());
  }

  // t = fma(scale_g, float(acc_g), t); t = fma(bias_g, float(s_g), t), each scale (bias) vector
  // built once for the tile's rows; then past the extras to the next group's codes.
  void qgroup_group_end() {
    auto& a = as();
    for (int m = 0; qgb_ && m < mr_; ++m) {
      a.ldr(a64::VecS(q_act(m).id()), a64::ptr(reg_gsum, 4 * m));
      a.scvtf(q_act(m).s4(), q_act(m).s4());
    }
    for (int m = 0; m < mr_; ++m)
      for (int vv = 0; vv < nv_; ++vv) a.scvtf(qacc(m, vv).s4(), qacc(m, vv).s4());
    const VecV sc = v(24), bi = v(25);
    for (int vv = 0; vv < nv_; ++vv) {
      qgroup_scale_vector(sc, vv, 0);
      if (qgb_) qgroup_scale_vector(bi, vv, 1);
      for (int m = 0; m < mr_; ++m) {
        a.fmla(acc(m, vv).s4(), qacc(m, vv).s4(), sc.s4());
        if (qgb_) a.fmla(acc(m, vv).s4(), bi.s4(), q_act(m).s(0));
      }
    }
    a.add(reg_w, reg_w, qg_extra_bytes());
    if (qgb_) {
      a.ldr(reg_tmp, arg(offsetof(GemmArgs, a_gsum_ld)));
      a.add(reg_gsum, reg_gsum, reg_tmp);
    }
  }

  static constexpr int kUnroll = 4;

  void k_loop() {
    auto& a = as();
    aj::Label loop = a.newLabel(), tail = a.newLabel(), tail_loop = a.newLabel(),
              done = a.newLabel();
    a.ldr(reg_k, arg(offsetof(GemmArgs, k4)));
    a.cmp(reg_k, kUnroll);
    a.b_lt(tail);
    a.bind(loop);
    for (int u = 0; u < kUnroll; ++u) microkernel(u);
    advance(kUnroll);
    a.sub(reg_k, reg_k, kUnroll);
    a.cmp(reg_k, kUnroll);
    a.b_ge(loop);
    a.bind(tail);
    a.cmp(reg_k, 0);
    a.b_le(done);
    a.bind(tail_loop);
    {
      // 4-bit strips pack two K steps per byte block (k4 is even), so their tail goes by pairs.
      const int g = int4_ ? 2 : 1;
      for (int u = 0; u < g; ++u) microkernel(u);
      advance(g);
      a.subs(reg_k, reg_k, g);
      a.b_ne(tail_loop);
    }
    a.bind(done);
  }

  // fp8: the K steps in groups of args.g_steps (the last one may be shorter); per group the sums
  // start at zero, run 4 k at a time (one activation load per row) and then one k at a time, and
  // are folded into the accumulators with the group's scale * 2^8.
  void k_loop_fp8() {
    auto& a = as();
    aj::Label group = a.newLabel(), quad = a.newLabel(), single = a.newLabel(), fold = a.newLabel(),
              done = a.newLabel();
    a.adr(reg_tmp2, pool_);
    a.ldr(fp8_c256(), a64::ptr(reg_tmp2, 16 * kC256));  // per block: the epilogue reuses v30
    a.mov(reg_gcur, reg_gs);
    a.ldr(reg_k, arg(offsetof(GemmArgs, k4)));
    a.cmp(reg_k, 0);
    a.b_le(done);
    a.bind(group);
    a.ldr(reg_gn, arg(offsetof(GemmArgs, g_steps)));
    a.cmp(reg_gn, reg_k);
    a.csel(reg_gn, reg_gn, reg_k, aj::arm::CondCode::kLT);  // this group's K steps
    a.sub(reg_k, reg_k, reg_gn);
    for (int m = 0; m < mr_; ++m)
      for (int vv = 0; vv < nv_; ++vv) a.movi(gacc(m, vv).b16(), 0);
    a.cmp(reg_gn, kUnroll);
    a.b_lt(single);
    a.bind(quad);
    for (int m = 0; m < mr_; ++m) a.ldr(fp8_act(m), a64::ptr(a_row(m)));  // 4 k of row m
    for (int u = 0; u < kUnroll; ++u) microkernel_fp8(u, u);
    advance(kUnroll);
    a.sub(reg_gn, reg_gn, kUnroll);
    a.cmp(reg_gn, kUnroll);
    a.b_ge(quad);
    a.bind(single);
    a.cbz(reg_gn, fold);
    for (int m = 0; m < mr_; ++m) a.ldr(a64::VecS(fp8_act(m).id()), a64::ptr(a_row(m)));
    microkernel_fp8(0, 0);
    advance(1);
    a.sub(reg_gn, reg_gn, 1);
    a.b(single);
    a.bind(fold);
    // acc = fma(g, scale * 2^8, acc); the strip's gate half (siluup vectors < nv/2) reads entry
    // 0 of the group, the up half entry 1 (jit/gemm.hpp: per group, 2 halves x lanes).
    for (int vv = 0; vv < nv_; ++vv) {
      const int half = key_.epilogue == Epilogue::siluup && vv >= nv_ / 2 ? 1 : 0;
      if (vv == 0 || (half && vv == nv_ / 2)) {
        a.ldr(fp8_scale(), a64::ptr(reg_gcur, 16 * half));
        a.fmul(fp8_scale().s4(), fp8_scale().s4(), fp8_c256().s4());
      }
      for (int m = 0; m < mr_; ++m) a.fmla(acc(m, vv).s4(), gacc(m, vv).s4(), fp8_scale().s4());
    }
    a.add(reg_gcur, reg_gcur, 2 * 16);
    a.cmp(reg_k, 0);
    a.b_gt(group);
    a.bind(done);
  }

  // One fp8 K step (u steps past the pointers; the rows' activation at element `j` of fp8_act):
  // the strip's bytes of this k decoded to fp32 (value * 2^-8), then g += a * w per row.
  void microkernel_fp8(int u, int j) {
    auto& a = as();
    decode_e4m3(u * strip_cols(), fp8_h(0), fp8_h(1), fp8_w(0).id());
    for (int m = 0; m < mr_; ++m)
      for (int vv = 0; vv < nv_; ++vv) a.fmla(gacc(m, vv).s4(), fp8_w(vv).s4(), fp8_act(m).s(j));
  }

  // The strip's e4m3 bytes of one k (at reg_w + off) as fp32 value * 2^-8 in v(dst0 + vv), through
  // the fp16 bits in h0 (columns 0-7) and h1 (8-15).
  void decode_e4m3(int off, const VecV& h0, const VecV& h1, uint32_t dst0) {
    auto& a = as();
    switch (nv_) {  // nv_ * 4 bytes: columns 0-7 into h0, 8-15 into h1 (sign-extended, << 7)
      case 4:
        a.ldr(h0, a64::ptr(reg_w, off));
        a.sshll2(h1.h8(), h0.b16(), 7);
        a.sshll(h0.h8(), h0.b8(), 7);
        break;
      case 3:
        a.ldr(a64::VecD(h0.id()), a64::ptr(reg_w, off));
        a.ldr(a64::VecS(h1.id()), a64::ptr(reg_w, off + 8));
        a.sshll(h0.h8(), h0.b8(), 7);
        a.sshll(h1.h8(), h1.b8(), 7);
        break;
      case 2:
        a.ldr(a64::VecD(h0.id()), a64::ptr(reg_w, off));
        a.sshll(h0.h8(), h0.b8(), 7);
        break;
      default:
        a.ldr(a64::VecS(h0.id()), a64::ptr(reg_w, off));
        a.sshll(h0.h8(), h0.b8(), 7);
        break;
    }
    // The sign's copy at bit 14 cleared: fp16 bits s.eeee.mmm0000000 = e4m3 value * 2^-8.
    a.bic(h0.h8(), aj::Imm(0x40), aj::Imm(8));
    if (nv_ > 2) a.bic(h1.h8(), aj::Imm(0x40), aj::Imm(8));
    for (int vv = 0; vv < nv_; ++vv) {
      const VecV h = vv < 2 ? h0 : h1, d = v(int(dst0) + vv);
      if (vv % 2 == 0)
        a.fcvtl(d.s4(), h.h4());
      else
        a.fcvtl2(d.s4(), h.h8());
    }
  }

  void advance(int steps) {
    auto& a = as();
    for (int m = 0; m < mr_; ++m) a.add(a_row(m), a_row(m), act_step_bytes() * steps);
    a.add(reg_w, reg_w, step_bytes() * steps);
  }

  // Weights of vector vv at K step u (u steps past reg_w) into wreg(vv), decoded to int8 (bfdot:
  // the k pair of 4 columns as it is, bfdot's .8h operand).
  void load_weights(int vv, int u) {
    auto& a = as();
    const VecV w = wreg(vv);
    if (bf16_) {
      a.ldr(w, a64::ptr(reg_w, u * step_bytes() + vv * 16));
      return;
    }
    const int off = int4_ ? (u / 2) * strip_k4_bytes() + vv * 16 : u * strip_k4_bytes() + vv * 16;
    a.ldr(w, a64::ptr(reg_w, off));
    if (int4_) {
      if (u % 2 == 0)
        a.shl(w.b16(), w.b16(), 4);  // low nibble -> 16 * q4
      else
        a.and_(w.b16(), w.b16(), nib_mask().b16());  // high nibble -> 16 * q4
    }
  }

  // bf16 with fp32 activations, one k pair per K step: the rows' activation pairs (8 bytes each)
  // in v(32 - mr) .. v31 for the whole step; per vector the pair dword widened to the even k
  // (shl #16) and the odd k (the low half cleared by two bic), then per accumulator fmla k and
  // fmla k + 1, so each column's fused chain stays in k order. The 8 - mr registers left hold the
  // weight vectors, (raw/odd, even) pairs rotating when there is room for more than one.
  void microkernel_bf16_f32(int u) {
    auto& a = as();
    auto x = [&](int m) { return v(32 - mr_ + m); };
    const int bufs = (8 - mr_) / 2;
    for (int m = 0; m < mr_; ++m)
      a.ldr(a64::VecD(x(m).id()), a64::ptr(a_row(m), act_step_bytes() * u));
    for (int vv = 0; vv < nv_; ++vv) {
      const VecV w = v(24 + 2 * (vv % bufs)), e = v(25 + 2 * (vv % bufs));
      a.ldr(w, a64::ptr(reg_w, u * step_bytes() + vv * 16));
      a.shl(e.s4(), w.s4(), 16);                 // even k: low half -> fp32, exact
      a.bic(w.s4(), aj::Imm(0xff), aj::Imm(8));  // odd k: the high half, low half cleared
      a.bic(w.s4(), aj::Imm(0xff), aj::Imm(0));
      for (int m = 0; m < mr_; ++m) a.fmla(acc(m, vv).s4(), e.s4(), x(m).s(0));
      for (int m = 0; m < mr_; ++m) a.fmla(acc(m, vv).s4(), w.s4(), x(m).s(1));
    }
  }

  // One K step: 4 k (integer) or one k pair (bf16) for every (row, vector) of the tile.
  void microkernel(int u) {
    auto& a = as();
    if (bf16_ && !pairs_) {
      microkernel_bf16_f32(u);
      return;
    }
    for (int vv = 0; vv < nv_; ++vv) load_weights(vv, u);
    for (int m = 0; m < mr_; ++m) {
      if (pairs_ || dot_) {
        const VecV x = act(m);
        a.ldr(a64::VecS(x.id()), a64::ptr(a_row(m), act_step_bytes() * u));
        for (int vv = 0; vv < nv_; ++vv) {
          if (pairs_)  // acc += a[2p] * w[2p] + a[2p+1] * w[2p+1], rounded to odd (bfdot_lane)
            a.bfdot(acc(m, vv).s4(), wreg(vv).h8(), x.h2(0));
          else
            a.sdot(acc(m, vv).s4(), wreg(vv).b16(), x.b4(0));
        }
        continue;
      }
      // Widening path: the row's 4 activation bytes repeated over the vector, so bytes 4c..4c+3 of
      // the weights (column c, 4 k) meet a[0..3].
      const VecV x = wide_act();
      a.ldr(a64::VecS(x.id()), a64::ptr(a_row(m), 4 * u));
      a.dup(x.s4(), x.s(0));
      for (int vv = 0; vv < nv_; ++vv) {
        const VecV t0 = wide_t(0), t1 = wide_t(1);
        a.smull(t0.h8(), wreg(vv).b8(), x.b8());     // columns 0,1 x 4 k
        a.smull2(t1.h8(), wreg(vv).b16(), x.b16());  // columns 2,3 x 4 k
        a.addp(t0.h8(), t0.h8(), t1.h8());           // pair sums, |.| <= 2*127*128: exact int16
        a.sadalp(acc(m, vv).s4(), t0.h8());          // acc[c] += both pairs of column c
      }
    }
  }

  // ---- epilogue -----------------------------------------------------------------------------
  void epilogue() {
    auto& a = as();
    if (qg_) {  // y = a_scale * t
      const VecV s = v(24);
      a.ldr(reg_tmp, arg(offsetof(GemmArgs, a_scale)));
      a.add(reg_tmp, reg_tmp, reg_row, aj::arm::lsl(2));
      for (int m = 0; m < mr_; ++m) {
        a.ldr(a64::VecS(s.id()), a64::ptr(reg_tmp, 4 * m));
        for (int vv = 0; vv < nv_; ++vv) a.fmul(acc(m, vv).s4(), acc(m, vv).s4(), s.s(0));
      }
    } else if (!bf16_ && !mx_) {  // bf16, mx: the fp32 accumulators are the result
      // y = (a_scale * w_scale) * float(acc)  (fp8: acc is fp32 already)
      const VecV s = v(24), t = v(25);
      a.ldr(reg_tmp, arg(offsetof(GemmArgs, a_scale)));
      a.add(reg_tmp, reg_tmp, reg_row, aj::arm::lsl(2));
      for (int m = 0; m < mr_; ++m) {
        a.ldr(a64::VecS(s.id()), a64::ptr(reg_tmp, 4 * m));
        for (int vv = 0; vv < nv_; ++vv) {
          a.ldr(t, a64::ptr(reg_wscale, 16 * vv));
          a.fmul(t.s4(), t.s4(), s.s(0));  // a_scale * w_scale (commutative: one rounding)
          if (!fp8_) a.scvtf(acc(m, vv).s4(), acc(m, vv).s4());
          a.fmul(acc(m, vv).s4(), t.s4(), acc(m, vv).s4());
        }
      }
    }
    switch (key_.epilogue) {
      case Epilogue::store: store_rows(); break;
      case Epilogue::siluup: siluup_rows(); break;
      case Epilogue::accum: accum_rows(); break;
    }
  }

  // dst = out_rows[row + m] + col
  void out_row_ptr(const GpX& dst, int m) {
    auto& a = as();
    a.ldr(dst, arg(offsetof(GemmArgs, out_rows)));
    a.add(dst, dst, reg_row, aj::arm::lsl(3));
    a.ldr(dst, a64::ptr(dst, 8 * m));
    a.add(dst, dst, reg_col);
  }

  void store_rows() {
    auto& a = as();
    for (int m = 0; m < mr_; ++m) {
      out_row_ptr(reg_tmp, m);
      for (int vv = 0; vv < nv_; ++vv) a.str(acc(m, vv), a64::ptr(reg_tmp, 16 * vv));
    }
  }

  void accum_rows() {
    auto& a = as();
    const VecV wgt = v(24), o = v(25);
    a.ldr(reg_tmp2, arg(offsetof(GemmArgs, row_weight)));
    a.add(reg_tmp2, reg_tmp2, reg_row, aj::arm::lsl(2));
    for (int m = 0; m < mr_; ++m) {
      out_row_ptr(reg_tmp, m);
      a.ldr(a64::VecS(wgt.id()), a64::ptr(reg_tmp2, 4 * m));
      for (int vv = 0; vv < nv_; ++vv) {
        a.ldr(o, a64::ptr(reg_tmp, 16 * vv));
        a.fmla(o.s4(), acc(m, vv).s4(), wgt.s(0));  // o = fma(w, y, o)
        a.str(o, a64::ptr(reg_tmp, 16 * vv));
      }
    }
  }

  // Constant pool offsets (16 bytes each: one value repeated over a vector).
  enum Const { kMax = 0, kMin, kLog2e, kPoly0, kOne = kPoly0 + 6, kC256, kNumConsts };
  // After the constants: mxfp4's table, the int8 2 * e2m1 of each nibble (16 bytes).
  static constexpr int kE2m1 = kNumConsts;

  // h = g / (1 + exp(-g)) * u with exp(x) = 2^i * p(f), x*log2e = i + f, i = rne (exp_ref).
  void siluup_rows() {
    auto& a = as();
    const VecV x = v(24), r = v(25), cmax = v(28), cmin = v(29), clog = v(30), bias = v(31);
    VecV p = v(26), t = v(27);
    a.adr(reg_tmp2, pool_);
    a.ldr(cmax, a64::ptr(reg_tmp2, 16 * kMax));
    a.ldr(cmin, a64::ptr(reg_tmp2, 16 * kMin));
    a.ldr(clog, a64::ptr(reg_tmp2, 16 * kLog2e));
    a.movi(bias.s4(), 127);
    const int half = nv_ / 2;
    // mx SwiGLU variants (4-row tiles: v16..v20 are free here): L, -L, alpha, 1, a mask
    const bool clamp = mx_ && (key_.variant & kSwigluClamp),
               alpha = mx_ && (key_.variant & kSwigluAlpha);
    const VecV lim = v(16), nlim = v(17), alp = v(18), one = v(19), mask = v(20);
    if (clamp) {
      a.add(reg_tmp, reg_args, offsetof(GemmArgs, swiglu_limit));
      a.ld1r(lim.s4(), a64::ptr(reg_tmp));
      a.fneg(nlim.s4(), lim.s4());
    }
    if (alpha) {
      a.add(reg_tmp, reg_args, offsetof(GemmArgs, swiglu_alpha));
      a.ld1r(alp.s4(), a64::ptr(reg_tmp));
      a.ldr(one, a64::ptr(reg_tmp2, 16 * kOne));
    }
    // x = (x < lim ? x : lim) as x86's vminps (lim when x is NaN); x = (x > lim ? x : lim) as
    // vmaxps (swiglu_ref's order)
    auto select = [&](const VecV& x, const VecV& l, bool below) {
      if (below)
        a.fcmgt(mask.s4(), l.s4(), x.s4());
      else
        a.fcmgt(mask.s4(), x.s4(), l.s4());
      a.bsl(mask.b16(), x.b16(), l.b16());
      a.mov(x.b16(), mask.b16());
    };
    for (int m = 0; m < mr_; ++m) {
      out_row_ptr(reg_tmp, m);
      for (int vv = 0; vv < half; ++vv) {
        const VecV g = acc(m, vv), u = acc(m, vv + half);
        if (clamp) {
          select(g, lim, true);
          if (alpha) select(g, nlim, false);
          select(u, nlim, false);
          select(u, lim, true);
        }
        if (alpha) {  // exp_ref(-(alpha * g)), then g / (e + 1) * (u + 1)
          a.fmul(x.s4(), alp.s4(), g.s4());
          a.fneg(x.s4(), x.s4());
          a.fadd(u.s4(), u.s4(), one.s4());
        } else {
          a.fneg(x.s4(), g.s4());
        }
        a.fmin(x.s4(), x.s4(), cmax.s4());
        a.fmax(x.s4(), x.s4(), cmin.s4());
        a.fmul(x.s4(), x.s4(), clog.s4());
        a.frintn(r.s4(), x.s4());
        a.fsub(x.s4(), x.s4(), r.s4());  // f
        a.ldr(p, a64::ptr(reg_tmp2, 16 * (kPoly0 + 5)));
        for (int c = 4; c >= 0; --c) {  // p = fma(p, f, c)
          a.ldr(t, a64::ptr(reg_tmp2, 16 * (kPoly0 + c)));
          a.fmla(t.s4(), p.s4(), x.s4());
          std::swap(p, t);
        }
        a.fcvtzs(r.s4(), r.s4());  // integral already: exact
        a.add(r.s4(), r.s4(), bias.s4());
        a.shl(r.s4(), r.s4(), 23);  // 2^i
        a.fmul(p.s4(), p.s4(), r.s4());
        a.ldr(t, a64::ptr(reg_tmp2, 16 * kOne));
        a.fadd(p.s4(), p.s4(), t.s4());
        a.fdiv(g.s4(), g.s4(), p.s4());
        a.fmul(g.s4(), g.s4(), u.s4());
        a.str(g, a64::ptr(reg_tmp, 16 * vv));
      }
    }
  }

  void emit_constants() {
    auto& a = as();
    a.align(aj::AlignMode::kData, 16);
    a.bind(pool_);
    const float poly[6] = {0.9999999995f, 0.6931471805f, 0.2402265069f,
                           0.0555041087f, 0.0096181291f, 0.0013333558f};
    uint32_t c[kNumConsts];
    c[kMax] = f32_bits(88.0f);
    c[kMin] = f32_bits(-87.0f);
    c[kLog2e] = f32_bits(1.44269504089f);
    for (int i = 0; i < 6; ++i) c[kPoly0 + i] = f32_bits(poly[i]);
    c[kOne] = f32_bits(1.0f);
    c[kC256] = f32_bits(256.0f);
    for (uint32_t x : c) a.embedUInt32(x, 4);  // each constant repeated over a vector
    for (int i = 0; i < 16; ++i) a.embedInt8(int8_t(2.0f * mx_e2m1(uint8_t(i))));
  }

  const KernelKey key_;
  const int nv_, mr_;
  const bool dot_, int4_, bf16_, fp8_, pairs_, prefill_;
  const bool qg_, qg4_, qgb_, qgs_;
  const int qgh_;  // 16-bit scales: 1 fp16, 2 bf16
  const bool mx4_, mx_;
  A64Emitter emit_;
  aj::Label pool_;
};

}  // namespace

std::vector<uint8_t> generate_gemm(const KernelKey& key) {
  GemmA64 g(key);
  return g.bytes();
}

}  // namespace ktjit::aarch64
