// AMX-INT8 prefill GEMM: strips -> M blocks of m_r rows -> K in blocks of 64 (16 k4 steps) ->
// one TDPBUSD per 16-column vector -> C tiles stored to the stack -> the AVX-512 epilogue per row.
//
// Tiles (palette 1), configured once per call at entry, released at exit. The main configuration
// (KT_JIT_AMX_TILES=a,b: a A tiles, b B tiles, a + b <= 4; default 1,1, see below):
//   tmm0..a-1     A, m_r rows x 64 bytes (64 k of the block's activation rows, stride lda); 64-k
//                 blocks take them in turn, so a block's A load need not wait for the last tile
//                 multiply of the block before
//   tmma..a+b-1   B, 16 rows x 64 bytes: 16 k4 rows of one vector of the strip (stride = strip
//                 row bytes), which is exactly the packed layout [k4][column][4 k] (VNNI pairs of
//                 4 bytes); the B loads take them in turn, so a load need not wait for the multiply
//                 that read the tile before
//   tmm4+v        C of vector v (v < n_vec), m_r rows x 16 int32
// On the lent Xeon (2026-11-27, docs/BENCHMARKS.md) 2 A + 2 B tiles, or 1 + 3, 3 + 1, were not
// faster than 1 + 1 (the hot kernel ran at 20-44 % of the tdpbusd peak either way), and 2 + 2
// with the next-strip prefetch below made the BF16 layer slower (T = 1024: 258 and 399 ms against
// 186 and 214 ms), so the defaults stay at one A and one B tile without the prefetch; the knobs
// are for measuring on another host.
// A K tail of t = k4 % 16 steps (rare: every MoE shape's K is a multiple of 64) has no tiles of its
// own: the C tiles are stored, the tiles reconfigured with A m_r x 4t and B t x 64 (tmm0, tmma),
// the C tiles reloaded, the tail multiplied into them, stored again, and the main configuration
// restored (a configuration zeroes every tile; C goes through the stack anyway for the epilogue).
// TDPBUSD multiplies unsigned A bytes by signed B bytes: activations arrive as a + 128 like the
// VNNI levels, and the epilogue subtracts w_comp = 128 * sum(w), so the int32 result is exact.
// int4 (AMX-INT8 too): each strip's nibble pairs ([k4/2][column][4 bytes], low nibble = even k4
// step) are first decoded into GemmArgs::scratch as the int8 strip of the values 16 * q4 the
// kernels multiply (nibble << 4, exact), then every M block runs the int8 nest over it.
//
// AMX-BF16 (TDPBF16PS): the same nest over k pairs. Activations arrive as bf16 rows (the caller
// rounds them, RNE); B tiles are 16 k pairs x one vector, [k/2][column][2] bf16 (64 bytes a pair
// and vector, like the int8 [k4][column][4]), so a "step" is a k pair and the nest is the int8 one
// (K even; blocks of 16 pairs, then a tail of pairs % 16).
//   bf16:  x86 bf16 strips are k pairs already (jit/gemm.hpp bf16_kgroup): B tiles load them in
//          place. The fp32 C tiles are the results.
//   mxfp4, mxfp8 (jit/gemm.hpp amx_decoded_weight): each strip is first decoded into
//          GemmArgs::scratch as bf16 k pairs, the weight times its group's power-of-two scale
//          (one fp32 product, exact unless it underflows), its top 16 bits (exact: the value has
//          <= 4 significant bits; only an fp32 subnormal loses bits, and TDPBF16PS reads every
//          bf16 subnormal as zero). Every M block then runs the bf16 nest over the scratch; the
//          scales are in the weights, so the C tiles are the results.
//   fp8:   the same decode without scales (e4m3 values, exact in bf16); the 128 x 128 block scales
//          are folded per K group: per group the C tiles start at zero, take the group's pairs
//          (its tail, if any, as above), are stored and folded into an fp32 accumulator block on
//          the stack, acc = fma(C, scale, acc); the epilogue then applies a_scale * w_scale like
//          the fp8 FMA kernels.
#include "jit/x64/amx_gemm.hpp"

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "jit/gemm.hpp"
#include "jit/x64/generator.hpp"

namespace ktjit::x64 {
namespace {

using namespace Xbyak;
using namespace Xbyak::util;

constexpr int kTileC = 4;
// Stack: [rsp] strips left; then the slots below; the main and the tail tile configurations; the
// C tiles stored as [vector][row][16 lanes]; fp8: the folded accumulators, same shape.
constexpr int kSteps = 8;        // tile K steps of the whole K (int8: k4; bf16 formats: k pairs)
constexpr int kGroupSteps = 16;  // fp8: k pairs of a group
constexpr int kLastSteps = 24;   // fp8: k pairs of the last group
constexpr int kGroupsLeft = 32;  // fp8: groups left in the block
constexpr int kNextStrip = 40;   // decoded formats: the next strip's weights
constexpr int kCfgOff = 64;      // 64-byte main tile configuration
constexpr int kTailCfgOff = 128;  // 64-byte K-tail configuration, written when a tail runs
constexpr int kCBufOff = 192;
constexpr int kCTileBytes = kAmxTileRows * 64;
constexpr int kAccOff = kCBufOff + kStripVecs * kCTileBytes;

// How many A and B tiles the K loop rotates over (KT_JIT_AMX_TILES=a,b; a, b >= 1, a + b <= 4).
struct AmxTileSplit {
  int a = 1, b = 1;
  bool prefetch = false;  // KT_JIT_AMX_PREFETCH=1 turns it on
};
AmxTileSplit amx_tile_split() {
  static const AmxTileSplit split = [] {
    AmxTileSplit t;
    t.prefetch = env_switch("KT_JIT_AMX_PREFETCH", false);
    const char* env = std::getenv("KT_JIT_AMX_TILES");
    if (!env || !*env) return t;
    int a = 0, b = 0;
    char tail = 0;
    if (std::sscanf(env, "%d,%d%c", &a, &b, &tail) != 2 || a < 1 || b < 1 || a + b > 4)
      throw std::invalid_argument(std::string("KT_JIT_AMX_TILES: expected 'a,b' with a, b >= 1 "
                                              "and a + b <= 4 (A and B tiles), got '") +
                                  env + "'");
    t.a = a;
    t.b = b;
    return t;
  }();
  return split;
}

class AmxGemmGenerator : public JitGenerator {
 public:
  AmxGemmGenerator(const KernelKey& key, std::vector<amx::AmxOp>* log)
      : JitGenerator(IsaLevel::amx),
        key_(key),
        log_(log),
        nv_(key.n_vec),
        mr_(key.m_r),
        int8_(key.format == WeightFormat::int8 || key.format == WeightFormat::int4),
        int4_(key.format == WeightFormat::int4),
        fp8_(key.format == WeightFormat::fp8),
        mx4_(key.format == WeightFormat::mxfp4),
        mx8_(key.format == WeightFormat::mxfp8),
        pairs_(fp8_ || mx4_ || mx8_),
        dec_(pairs_ || int4_) {
    if (!amx_gemm_supported(key))
      throw std::invalid_argument(
          "amx gemm: unsupported key " + key.describe() +
          " (AMX kernels: prefill; int8, int4, bf16, fp8, mxfp4 or mxfp8; m_r "
          "1..16, n_vec 1..4; SwiGLU variants only on mx siluup)");
    generate();
  }

 private:
  const Reg64 reg_args = rdi;
  const Reg64 reg_w = rsi;       // B tile address (K loop); output row (epilogue)
  const Reg64 reg_a = r8;        // A tile address (K loop); rows left (epilogue)
  const Reg64 reg_bstride = r9;  // strip row bytes: n_vec * 64
  const Reg64 reg_lda = r10;
  const Reg64 reg_k = r11;    // K blocks left (K loop); C buffer row (epilogue)
  const Reg64 reg_row = rbx;  // first row of the current block
  const Reg64 reg_wscale = r12;
  const Reg64 reg_comp = r13;   // int8: w_comp; fp8: the strip's group scales (w_gscale)
  const Reg64 reg_col = r14;    // strip's first output column, bytes
  const Reg64 reg_mb = r15;     // M blocks left
  const Reg64 reg_strip = rbp;  // strip start (decoded formats: the scratch)
  // rax, rcx, rdx: scratch.

  int strip_cols() const { return nv_ * 16; }
  int row_bytes() const { return nv_ * 64; }  // one tile K step of the strip (or the scratch)
  int out_cols() const { return gemm_strip_out_cols(IsaLevel::amx, nv_, key_.epilogue); }
  Address arg(size_t off) const { return qword[reg_args + off]; }

  // ---- tile instructions, recorded as emitted ------------------------------------------------
  void record(amx::Op op, size_t start, int t0 = -1, int t1 = -1, int t2 = -1,
              const Reg64* base = nullptr, const Reg64* index = nullptr, int disp = 0) {
    if (!log_) return;
    amx::AmxOp o;
    o.op = op;
    o.offset = uint32_t(start);
    o.length = uint32_t(getSize() - start);
    o.t0 = t0;
    o.t1 = t1;
    o.t2 = t2;
    o.has_mem = base != nullptr;
    if (base) {
      o.base = base->getIdx();
      o.index = index ? index->getIdx() : amx::kNoReg;
      o.scale = 1;
      o.disp = disp;
    }
    log_->push_back(o);
  }
  void t_cfg(const Reg64& base, int disp) {
    const size_t s = getSize();
    ldtilecfg(ptr[base + disp]);
    record(amx::Op::ldtilecfg, s, -1, -1, -1, &base, nullptr, disp);
  }
  void t_release() {
    const size_t s = getSize();
    tilerelease();
    record(amx::Op::tilerelease, s);
  }
  void t_zero(int t) {
    const size_t s = getSize();
    tilezero(Tmm(t));
    record(amx::Op::tilezero, s, t);
  }
  void t_load(int t, const Reg64& base, const Reg64& stride, int disp) {
    const size_t s = getSize();
    tileloadd(Tmm(t), ptr[base + stride + disp]);
    record(amx::Op::tileloadd, s, t, -1, -1, &base, &stride, disp);
  }
  void t_store(int t, const Reg64& base, const Reg64& stride, int disp) {
    const size_t s = getSize();
    tilestored(ptr[base + stride + disp], Tmm(t));
    record(amx::Op::tilestored, s, t, -1, -1, &base, &stride, disp);
  }
  void t_dp(int c, int a, int b) {
    const size_t s = getSize();
    if (!int8_) {
      tdpbf16ps(Tmm(c), Tmm(a), Tmm(b));
      record(amx::Op::tdpbf16ps, s, c, a, b);
      return;
    }
    tdpbusd(Tmm(c), Tmm(a), Tmm(b));
    record(amx::Op::tdpbusd, s, c, a, b);
  }

  // ---- loop nest ---------------------------------------------------------------------------
  void generate() {
    preamble(kAccOff + (fp8_ ? kStripVecs * kCTileBytes : 0));
    mov(reg_w, arg(offsetof(GemmArgs, w)));
    mov(reg_lda, arg(offsetof(GemmArgs, lda)));
    mov(reg_wscale, arg(offsetof(GemmArgs, w_scale)));
    mov(reg_comp, arg(fp8_ ? offsetof(GemmArgs, w_gscale) : offsetof(GemmArgs, w_comp)));
    mov(reg_col, arg(offsetof(GemmArgs, out_col)));
    shl(reg_col, 2);
    mov(reg_bstride, row_bytes());
    mov(rax, arg(offsetof(GemmArgs, k4)));
    if (pairs_) shr(rax, 1);  // k pairs
    mov(qword[rsp + kSteps], rax);
    if (fp8_) group_steps();
    configure_tiles();

    Label strip_loop, done;
    mov(rax, arg(offsetof(GemmArgs, n_strips)));
    test(rax, rax);
    jle(done, T_NEAR);
    mov(qword[rsp], rax);
    L(strip_loop);
    {
      if (dec_) {
        decode_strip();  // reg_w: this strip -> the next one
        mov(qword[rsp + kNextStrip], reg_w);
        mov(reg_strip, arg(offsetof(GemmArgs, scratch)));
      } else {
        mov(reg_strip, reg_w);
      }
      Label mb_loop, mb_done;
      xor_(reg_row.cvt32(), reg_row.cvt32());
      mov(reg_mb, arg(offsetof(GemmArgs, m_blocks)));
      test(reg_mb, reg_mb);
      jle(mb_done, T_NEAR);
      if (pf_) {  // the first block prefetches the next strip into L2 (top of the file)
        compute_block(true);
        add(reg_row, mr_);
        dec(reg_mb);
        jz(mb_done, T_NEAR);
      }
      L(mb_loop);
      {
        compute_block();
        add(reg_row, mr_);
        dec(reg_mb);
        jnz(mb_loop, T_NEAR);
      }
      L(mb_done);
      if (dec_) {
        mov(reg_w, qword[rsp + kNextStrip]);
      } else {
        mov(rax, qword[rsp + kSteps]);
        imul(rax, rax, row_bytes());
        lea(reg_w, ptr[reg_strip + rax]);  // next strip
      }
      add(reg_wscale, strip_cols() * 4);
      if (fp8_) {  // per strip: g_per_strip groups x 2 halves x 16 floats
        mov(rax, arg(offsetof(GemmArgs, g_per_strip)));
        shl(rax, 7);
        add(reg_comp, rax);
      } else {
        add(reg_comp, strip_cols() * 4);
      }
      add(reg_col, out_cols() * 4);
      dec(qword[rsp]);
      jnz(strip_loop, T_NEAR);
    }
    L(done);
    t_release();
    postamble();
    emit_constants();
  }

  // fp8: k pairs of a group (min(g_steps, K) / 2) and of the last one (K - (groups - 1) *
  // g_steps) / 2, groups = g_per_strip = ceil(K / g_steps).
  void group_steps() {
    mov(rax, arg(offsetof(GemmArgs, g_steps)));
    mov(rcx, arg(offsetof(GemmArgs, k4)));
    cmp(rax, rcx);
    cmovg(rax, rcx);
    shr(rax, 1);
    mov(qword[rsp + kGroupSteps], rax);
    mov(rax, arg(offsetof(GemmArgs, g_per_strip)));
    dec(rax);
    imul(rax, arg(offsetof(GemmArgs, g_steps)));
    sub(rcx, rax);
    shr(rcx, 1);
    mov(qword[rsp + kLastSteps], rcx);
  }

  // The main configuration is static: copied from the constant pool to the stack and loaded.
  void configure_tiles() {
    vmovups(zmm0, zword[rip + c_cfg_]);
    vmovups(zword[rsp + kCfgOff], zmm0);
    t_cfg(rsp, kCfgOff);
  }

  int tile_a(int i) const { return i % na_; }
  int tile_b(int i) const { return na_ + i % nb_; }
  // Blocks per turn of the K loop: a whole number of A rotations and of B rotations (the B loads
  // of a block are its n_vec vectors), so every turn starts with tmm0 and tmma.
  int unroll() const {
    for (int u = 1;; ++u)
      if (u % na_ == 0 && (u * nv_) % nb_ == 0) return u;
  }
  // The 64-k block `i` of a turn: A into its tile, then per vector a B load and a tile multiply.
  // With `pf` (rcx = the strip's bytes) it also prefetches into L2 the same block of the next
  // strip, 16 lines per vector.
  void k_block(int i, bool pf) {
    const int a = tile_a(i);
    t_load(a, reg_a, reg_lda, 0);
    for (int v = 0; v < nv_; ++v) {
      const int b = tile_b(i * nv_ + v);
      t_load(b, reg_w, reg_bstride, v * 64);
      t_dp(kTileC + v, a, b);
      if (pf)
        for (int j = 0; j < 16; ++j) prefetcht1(ptr[reg_w + rcx + (v * 16 + j) * 64]);
    }
    add(reg_a, 64);
    add(reg_w, 16 * row_bytes());
  }

  // rax tile K steps from reg_a / reg_w into the C tiles, which end stored in the C buffer:
  // blocks of 16 steps, then the tail of rax % 16 (see the top of the file). With `advance_tail`
  // the pointers end past the tail too. `pf`: the blocks prefetch the next strip's (k_block).
  // rax is kept; rcx, zmm0 are clobbered.
  void steps_into_cbuf(bool advance_tail, bool pf = false) {
    const int u = unroll();
    Label turn, rest, tail, done;
    if (pf) {
      mov(rcx, rax);
      imul(rcx, rcx, row_bytes());
    }
    mov(reg_k, rax);
    shr(reg_k, 4);  // whole blocks
    L(turn);
    cmp(reg_k, u);
    jb(rest, T_NEAR);
    for (int i = 0; i < u; ++i) k_block(i, pf);
    sub(reg_k, u);
    jmp(turn, T_NEAR);
    L(rest);
    for (int i = 0; i + 1 < u; ++i) {  // fewer blocks than a turn: its first ones
      cmp(reg_k, i + 1);
      jb(tail, T_NEAR);
      k_block(i, pf);
    }
    L(tail);
    store_c();
    test(al, 15);
    jz(done, T_NEAR);
    // The tail configuration: the main one with tmm0 = A (m_r x 4t), tmma = B (t x 64), the
    // other A and B tiles unconfigured.
    vmovups(zmm0, zword[rip + c_cfg_]);
    vmovups(zword[rsp + kTailCfgOff], zmm0);
    for (int t = 1; t < na_ + nb_; ++t) {
      if (t == na_) continue;
      mov(byte[rsp + kTailCfgOff + 48 + t], 0);
      mov(word[rsp + kTailCfgOff + 16 + 2 * t], 0);
    }
    mov(ecx, eax);
    and_(ecx, 15);
    mov(byte[rsp + kTailCfgOff + 48 + na_], cl);
    shl(ecx, 2);
    mov(word[rsp + kTailCfgOff + 16], cx);
    t_cfg(rsp, kTailCfgOff);
    mov(ecx, 64);
    for (int v = 0; v < nv_; ++v) t_load(kTileC + v, rsp, rcx, kCBufOff + v * kCTileBytes);
    t_load(0, reg_a, reg_lda, 0);
    for (int v = 0; v < nv_; ++v) {
      t_load(na_, reg_w, reg_bstride, v * 64);
      t_dp(kTileC + v, 0, na_);
    }
    if (advance_tail) {
      mov(ecx, eax);
      and_(ecx, 15);
      lea(reg_a, ptr[reg_a + rcx * 4]);
      imul(rcx, rcx, row_bytes());
      add(reg_w, rcx);
    }
    store_c();
    t_cfg(rsp, kCfgOff);
    L(done);
  }

  void store_c() {
    mov(ecx, 64);
    for (int v = 0; v < nv_; ++v) t_store(kTileC + v, rsp, rcx, kCBufOff + v * kCTileBytes);
  }

  // Rows [reg_row, reg_row + m_r) x the strip at reg_strip, over all of K. `pf`: prefetch the next
  // strip (k_block).
  void compute_block(bool pf = false) {
    mov(reg_a, reg_row);
    imul(reg_a, reg_lda);
    add(reg_a, arg(offsetof(GemmArgs, a)));
    mov(reg_w, reg_strip);
    if (fp8_) {
      compute_block_groups();
      epilogue(kAccOff);
      return;
    }
    for (int v = 0; v < nv_; ++v) t_zero(kTileC + v);
    mov(rax, qword[rsp + kSteps]);
    steps_into_cbuf(false, pf);
    epilogue(kCBufOff);
  }

  // fp8: per group, the C tiles from zero over the group's pairs, then acc = fma(C, scale, acc)
  // with the group's scale of each vector's half (gate / up). rdx walks the strip's scales.
  void compute_block_groups() {
    vpxord(zmm0, zmm0, zmm0);
    for (int v = 0; v < nv_; ++v)
      for (int r = 0; r < mr_; ++r) vmovups(zword[rsp + kAccOff + v * kCTileBytes + r * 64], zmm0);
    mov(rdx, reg_comp);
    mov(rax, arg(offsetof(GemmArgs, g_per_strip)));
    mov(qword[rsp + kGroupsLeft], rax);
    Label group_loop, regular;
    L(group_loop);
    {
      mov(rax, qword[rsp + kGroupSteps]);
      cmp(qword[rsp + kGroupsLeft], 1);
      jne(regular, T_NEAR);
      mov(rax, qword[rsp + kLastSteps]);  // the last group's own length
      L(regular);
      for (int v = 0; v < nv_; ++v) t_zero(kTileC + v);
      steps_into_cbuf(true);
      const int half = key_.epilogue == Epilogue::siluup ? nv_ / 2 : nv_;
      vmovups(zmm30, zword[rdx]);       // the gate half's (or the matrix's) scale
      vmovups(zmm31, zword[rdx + 64]);  // the up half's
      for (int v = 0; v < nv_; ++v)
        for (int r = 0; r < mr_; ++r) {
          const int c = kCBufOff + v * kCTileBytes + r * 64, s = kAccOff + v * kCTileBytes + r * 64;
          vmovups(zmm0, zword[rsp + c]);
          vfmadd213ps(zmm0, v < half ? zmm30 : zmm31, zword[rsp + s]);  // C * scale + acc
          vmovups(zword[rsp + s], zmm0);
        }
      add(rdx, 128);
      dec(qword[rsp + kGroupsLeft]);
      jnz(group_loop, T_NEAR);
    }
  }

  // ---- the strip decode of fp8 / mx into bf16 k pairs ----------------------------------------
  // Scratch layout: [k/2][vector][16 columns][2], the B tiles' (and x86 bf16 strips') layout.
  // e4m3 rows k, k + 1 of vector v (16 bytes each at `even`, `odd`): each byte to fp16 bits
  // (sign << 15 | magnitude << 7: value * 2^-8, exact), widened by vcvtph2ps, times `scale`
  // (fp8: 256, exact; mxfp8: the group scale of the stored e + 8), then the pair's top halves.
  void e4m3_pair(const Address& even, const Address& odd, const Zmm& scale, const Address& dst) {
    const Zmm e(4), o(5);
    vpmovsxbw(Ymm(4), even);
    vpmovsxbw(Ymm(5), odd);
    vpsllw(Ymm(4), Ymm(4), 7);
    vpsllw(Ymm(5), Ymm(5), 7);
    vpand(Ymm(4), Ymm(4), yword[rip + c_f16_mask_]);
    vpand(Ymm(5), Ymm(5), yword[rip + c_f16_mask_]);
    vcvtph2ps(e, Ymm(4));
    vcvtph2ps(o, Ymm(5));
    pair_out(e, o, scale, dst);
  }
  // dst = the bf16 pairs (top 16 bits) of e * scale (low half) and o * scale (high half).
  void pair_out(const Zmm& e, const Zmm& o, const Zmm& scale, const Address& dst) {
    vmulps(e, e, scale);
    vmulps(o, o, scale);
    vpsrld(e, e, 16);
    vpandd(o, o, zword[rip + c_hi16_]);
    vpord(e, e, o);
    vmovups(dst, e);
  }
  // The group's exponent bytes (16 per vector at reg_w) to fp32 scales (bits e << 23) in
  // zmm8 + v; reg_w past them.
  void mx_scales() {
    for (int v = 0; v < nv_; ++v) {
      vpmovzxbd(Zmm(8 + v), xword[reg_w + v * 16]);
      vpslld(Zmm(8 + v), Zmm(8 + v), 23);
    }
    add(reg_w, strip_cols());
  }
  // reg_w: this strip's weights -> the next strip's; rdx: the scratch. rax, rcx: counters.
  void decode_strip() {
    mov(rdx, arg(offsetof(GemmArgs, scratch)));
    const int cols = strip_cols();
    if (int4_) {  // per k4 step pair, 4 bytes per column: low nibbles step 2s, high ones 2s + 1
      Label loop, done;
      mov(rax, qword[rsp + kSteps]);
      shr(rax, 1);  // k4 is even for 4-bit strips
      jz(done, T_NEAR);
      vpbroadcastd(zmm9, dword[rip + c_f0_]);
      L(loop);
      for (int v = 0; v < nv_; ++v) {
        vmovups(zmm4, zword[reg_w + v * 64]);
        vpsllw(zmm5, zmm4, 4);  // each byte's low nibble to its bits 4..7 (the rest masked)
        vpandd(zmm5, zmm5, zmm9);
        vpandd(zmm4, zmm4, zmm9);
        vmovups(zword[rdx + v * 64], zmm5);
        vmovups(zword[rdx + row_bytes() + v * 64], zmm4);
      }
      add(reg_w, row_bytes());
      add(rdx, 2 * row_bytes());
      dec(rax);
      jnz(loop, T_NEAR);
      L(done);
      return;
    }
    if (fp8_) {  // [k][column] bytes, K even
      Label loop, done;
      mov(rax, qword[rsp + kSteps]);
      test(rax, rax);
      jz(done, T_NEAR);
      vbroadcastss(zmm8, dword[rip + c_f256_]);
      L(loop);
      for (int v = 0; v < nv_; ++v)
        e4m3_pair(xword[reg_w + v * 16], xword[reg_w + cols + v * 16], zmm8, zword[rdx + v * 64]);
      add(reg_w, 2 * cols);
      add(rdx, row_bytes());
      dec(rax);
      jnz(loop, T_NEAR);
      L(done);
      return;
    }
    // mx: g_per_strip groups of 32 k (16 pairs): the exponent bytes, then the weights.
    Label group, done;
    mov(rax, arg(offsetof(GemmArgs, g_per_strip)));
    test(rax, rax);
    jle(done, T_NEAR);
    if (mx4_) vmovups(zmm16, zword[rip + c_e2m1_]);
    L(group);
    {
      mx_scales();
      if (mx8_) {  // [k][column] bytes
        Label pair;
        mov(ecx, 16);
        L(pair);
        for (int v = 0; v < nv_; ++v)
          e4m3_pair(xword[reg_w + v * 16], xword[reg_w + cols + v * 16], Zmm(8 + v),
                    zword[rdx + v * 64]);
        add(reg_w, 2 * cols);
        add(rdx, row_bytes());
        dec(ecx);
        jnz(pair, T_NEAR);
      } else {  // [k/8][column][4 bytes]: nibble j of a column's dword is k0 + j
        for (int d = 0; d < 4; ++d)
          for (int v = 0; v < nv_; ++v) {
            const Zmm raw(12), e(4), o(5);
            vmovups(raw, zword[reg_w + (d * cols + v * 16) * 4]);
            for (int p = 0; p < 4; ++p) {
              if (p == 0) {
                vpermps(e, raw, zmm16);  // index bits 3..0: the low nibble
              } else {
                vpsrld(e, raw, 8 * p);
                vpermps(e, e, zmm16);
              }
              vpsrld(o, raw, 8 * p + 4);
              vpermps(o, o, zmm16);
              pair_out(e, o, Zmm(8 + v), zword[rdx + ((d * 4 + p) * nv_ + v) * 64]);
            }
          }
        add(reg_w, 16 * cols);
        add(rdx, 16 * row_bytes());
      }
      dec(rax);
      jnz(group, T_NEAR);
    }
    L(done);
  }

  // ---- epilogue: per row, the results of the strip's vectors in zmm0..3 ----------------------
  // Same instruction sequence (and so the same rounding) as the avx512 kernels' epilogues.
  Zmm acc(int v) const { return Zmm(v); }

  void epilogue(int buf) {
    mov(rax, arg(offsetof(GemmArgs, a_scale)));
    lea(rax, ptr[rax + reg_row * 4]);
    mov(rdx, arg(offsetof(GemmArgs, out_rows)));
    lea(rdx, ptr[rdx + reg_row * 8]);
    if (key_.epilogue == Epilogue::accum) {
      mov(rcx, arg(offsetof(GemmArgs, row_weight)));
      lea(rcx, ptr[rcx + reg_row * 4]);
    }
    lea(reg_k, ptr[rsp + buf]);
    mov(reg_a, mr_);
    const bool scaled = int8_ || fp8_;  // bf16 and mx: the fp32 sums are the results
    Label row_loop;
    L(row_loop);
    {
      const Zmm s = zmm28, t = zmm29;
      if (scaled) vbroadcastss(s, dword[rax]);
      for (int v = 0; v < nv_; ++v) {
        vmovups(acc(v), zword[reg_k + v * kCTileBytes]);
        if (!scaled) continue;
        if (int8_) {
          vpsubd(acc(v), acc(v), zword[reg_comp + v * 64]);
          vcvtdq2ps(acc(v), acc(v));
        }
        vmulps(t, s, zword[reg_wscale + v * 64]);
        vmulps(acc(v), t, acc(v));
      }
      mov(reg_w, qword[rdx]);
      add(reg_w, reg_col);
      switch (key_.epilogue) {
        case Epilogue::store:
          for (int v = 0; v < nv_; ++v) vmovups(zword[reg_w + v * 64], acc(v));
          break;
        case Epilogue::accum: accum_row(); break;
        case Epilogue::siluup: siluup_row(); break;
      }
      add(rax, 4);
      add(rdx, 8);
      if (key_.epilogue == Epilogue::accum) add(rcx, 4);
      add(reg_k, 64);
      dec(reg_a);
      jnz(row_loop, T_NEAR);
    }
  }

  void accum_row() {
    const Zmm wgt = zmm28, o = zmm29;
    vbroadcastss(wgt, dword[rcx]);
    for (int v = 0; v < nv_; ++v) {
      vmovups(o, zword[reg_w + v * 64]);
      vfmadd231ps(o, wgt, acc(v));  // o = w * y + o
      vmovups(zword[reg_w + v * 64], o);
    }
  }

  // h = g / (1 + exp(-g)) * u, exp as kt-kernel's degree-5 exp2 polynomial (see gemm_ref); the
  // mx SwiGLU variants (swiglu_ref) as the avx512 kernels emit them.
  void siluup_row() {
    const Zmm x = zmm28, r = zmm29, p = zmm30, lim = zmm31;
    const int half = nv_ / 2;
    const uint8_t sw = (mx4_ || mx8_) ? key_.variant : 0;
    for (int v = 0; v < half; ++v) {
      const Zmm g = acc(v), u = acc(v + half);
      if (sw & kSwigluClamp) {  // L, then -L, then L again
        vbroadcastss(lim, dword[reg_args + offsetof(GemmArgs, swiglu_limit)]);
        vminps(g, g, lim);
        vxorps(lim, lim, zword[rip + c_sign_]);
        if (sw & kSwigluAlpha) vmaxps(g, g, lim);
        vmaxps(u, u, lim);
        vxorps(lim, lim, zword[rip + c_sign_]);
        vminps(u, u, lim);
      }
      if (sw & kSwigluAlpha) {  // x = -(alpha * g)
        vbroadcastss(x, dword[reg_args + offsetof(GemmArgs, swiglu_alpha)]);
        vmulps(x, x, g);
        vxorps(x, x, zword[rip + c_sign_]);
      } else {
        vxorps(x, g, zword[rip + c_sign_]);
      }
      vminps(x, x, zword[rip + c_max_]);
      vmaxps(x, x, zword[rip + c_min_]);
      vmulps(x, x, zword[rip + c_log2e_]);
      vrndscaleps(r, x, 0);
      vsubps(x, x, r);
      vmovups(p, zword[rip + c_poly_[5]]);
      for (int c = 4; c >= 0; --c) vfmadd213ps(p, x, zword[rip + c_poly_[c]]);
      vcvtps2dq(r, r);
      vpaddd(r, r, zword[rip + c_bias_]);
      vpslld(r, r, 23);
      vmulps(p, p, r);
      vaddps(p, p, zword[rip + c_one_]);
      vdivps(g, g, p);
      if (sw & kSwigluAlpha) vaddps(u, u, zword[rip + c_one_]);
      vmulps(g, g, u);
      vmovups(zword[reg_w + v * 64], g);
    }
  }

  void emit_constants() {
    align(64);
    // Tile configuration, palette 1 (bytes: 0 palette, 16 + 2t colsb[t], 48 + t rows[t]).
    uint8_t cfg[64] = {};
    cfg[0] = 1;
    auto set = [&](int t, int rows, int colsb) {
      cfg[16 + 2 * t] = uint8_t(colsb & 0xff);
      cfg[17 + 2 * t] = uint8_t(colsb >> 8);
      cfg[48 + t] = uint8_t(rows);
    };
    for (int t = 0; t < na_; ++t) set(t, mr_, 64);
    for (int t = na_; t < na_ + nb_; ++t) set(t, 16, 64);
    for (int v = 0; v < nv_; ++v) set(kTileC + v, mr_, 64);
    L(c_cfg_);
    for (uint8_t b : cfg) db(b);
    emit_const32(c_sign_, 0x80000000u);
    emit_const32(c_max_, f32_bits(88.0f));
    emit_const32(c_min_, f32_bits(-87.0f));
    emit_const32(c_log2e_, f32_bits(1.44269504089f));
    const float poly[6] = {0.9999999995f, 0.6931471805f, 0.2402265069f,
                           0.0555041087f, 0.0096181291f, 0.0013333558f};
    for (int i = 0; i < 6; ++i) emit_const32(c_poly_[i], f32_bits(poly[i]));
    emit_const32(c_bias_, 127u);
    emit_const32(c_one_, f32_bits(1.0f));
    if (int4_) emit_const32(c_f0_, 0xf0f0f0f0u);
    if (!pairs_) return;
    emit_const32(c_f16_mask_, 0xbf80bf80u);  // fp16 sign + e4m3 magnitude bits, per word
    emit_const32(c_hi16_, 0xffff0000u);
    emit_const32(c_f256_, f32_bits(256.0f));
    L(c_e2m1_);  // the 16 e2m1 values
    for (int i = 0; i < 16; ++i) dd(f32_bits(mx_e2m1(uint8_t(i))));
  }

  const KernelKey key_;
  std::vector<amx::AmxOp>* log_;
  const int nv_, mr_;
  const int na_ = amx_tile_split().a, nb_ = amx_tile_split().b;  // A and B tiles (top of file)
  // the weights' next strip prefetched into L2 while an M block runs over this one (int8, bf16:
  // the formats whose B tiles load the weights in place; KT_JIT_AMX_PREFETCH=1, off by default)
  const bool pf_ = !dec_ && !fp8_ && amx_tile_split().prefetch;
  // int8_: the AMX-INT8 nest (int8, int4); pairs_: bf16 pairs decoded (fp8, mx); dec_: a strip
  // decode into the scratch first (int4 and the pair formats)
  const bool int8_, int4_, fp8_, mx4_, mx8_, pairs_, dec_;
  Label c_cfg_, c_sign_, c_max_, c_min_, c_log2e_, c_poly_[6], c_bias_, c_one_;
  Label c_f16_mask_, c_hi16_, c_f256_, c_e2m1_, c_f0_;
};

}  // namespace

bool amx_gemm_supported(const KernelKey& key) {
  const WeightFormat f = key.format;
  const bool mx = f == WeightFormat::mxfp4 || f == WeightFormat::mxfp8;
  const bool fmt = f == WeightFormat::int8 || f == WeightFormat::int4 || f == WeightFormat::bf16 ||
                   f == WeightFormat::fp8 || mx;
  const uint8_t variants =
      mx && key.epilogue == Epilogue::siluup ? uint8_t(kSwigluClamp | kSwigluAlpha) : uint8_t(0);
  return key.isa == IsaLevel::amx && key.kind == KernelKind::gemm_prefill && fmt &&
         (key.variant & ~variants) == 0 && key.m_r >= 1 && key.m_r <= kAmxTileRows &&
         key.n_vec >= 1 && key.n_vec <= kStripVecs &&
         !(key.epilogue == Epilogue::siluup && key.n_vec % 2);
}

std::vector<uint8_t> generate_amx_gemm(const KernelKey& key, std::vector<amx::AmxOp>* log) {
  if (log) log->clear();
  AmxGemmGenerator g(key, log);
  return g.bytes();
}

}  // namespace ktjit::x64
