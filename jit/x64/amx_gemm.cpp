// AMX-INT8 prefill GEMM: strips -> M blocks of m_r rows -> K in blocks of 64 (16 k4 steps) ->
// one TDPBUSD per 16-column vector -> C tiles stored to the stack -> the AVX-512 epilogue per row.
//
// Tiles (palette 1), configured once per call at entry, released at exit:
//   tmm0  A, m_r rows x 64 bytes (64 k of the block's activation rows, stride lda)
//   tmm1  B, 16 rows x 64 bytes: 16 k4 rows of one vector of the strip (stride = strip row bytes),
//         which is exactly the packed layout [k4][column][4 k] (VNNI pairs of 4 bytes)
//   tmm2  A tail, m_r rows x 4t bytes    } t = k4 % 16; written into the configuration at run time
//   tmm3  B tail, t rows x 64 bytes       } (both unconfigured when t == 0)
//   tmm4+v C of vector v (v < n_vec), m_r rows x 16 int32
// TDPBUSD multiplies unsigned A bytes by signed B bytes: activations arrive as a + 128 like the
// VNNI levels, and the epilogue subtracts w_comp = 128 * sum(w), so the int32 result is exact.
//
// AMX-BF16 (WeightFormat::bf16, TDPBF16PS): the same nest over k pairs. Activations arrive as
// bf16 rows (the caller rounds them, RNE); x86 bf16 strips are k pairs, [k/2][column][2]
// (jit/gemm.hpp bf16_kgroup), 64 bytes per pair and vector: exactly a B tile, like the int8
// [k4][column][4], so k4 counts pairs and the nest is the int8 one (K even; blocks of 16 pairs,
// then a tail of k4 % 16 pairs). The fp32 C tiles are the results: no scales, the epilogue as the
// bf16 FMA kernels'.
#include "jit/x64/amx_gemm.hpp"

#include <cstddef>
#include <stdexcept>

#include "jit/gemm.hpp"
#include "jit/x64/generator.hpp"

namespace ktjit::x64 {
namespace {

using namespace Xbyak;
using namespace Xbyak::util;

constexpr int kTileA = 0, kTileB = 1, kTileATail = 2, kTileBTail = 3, kTileC = 4;
constexpr int kCfgOff = 64;    // 64-byte tile configuration on the stack
constexpr int kCBufOff = 128;  // C tiles stored here: [vector][row][16 int32]
constexpr int kCTileBytes = kAmxTileRows * 64;

class AmxGemmGenerator : public JitGenerator {
 public:
  AmxGemmGenerator(const KernelKey& key, std::vector<amx::AmxOp>* log)
      : JitGenerator(IsaLevel::amx),
        key_(key),
        log_(log),
        nv_(key.n_vec),
        mr_(key.m_r),
        bf16_(key.format == WeightFormat::bf16) {
    if (!amx_gemm_supported(key))
      throw std::invalid_argument("amx gemm: unsupported key " + key.describe() +
                                  " (AMX kernels: prefill, int8 or bf16, m_r 1..16, n_vec 1..4)");
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
  const Reg64 reg_comp = r13;
  const Reg64 reg_col = r14;    // strip's first output column, bytes
  const Reg64 reg_mb = r15;     // M blocks left
  const Reg64 reg_strip = rbp;  // strip start
  // rax, rcx, rdx: scratch.

  int strip_cols() const { return nv_ * 16; }
  int row_bytes() const { return nv_ * 64; }  // one k4 step of the strip
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
    if (bf16_) {
      tdpbf16ps(Tmm(c), Tmm(a), Tmm(b));
      record(amx::Op::tdpbf16ps, s, c, a, b);
      return;
    }
    tdpbusd(Tmm(c), Tmm(a), Tmm(b));
    record(amx::Op::tdpbusd, s, c, a, b);
  }

  // ---- loop nest ---------------------------------------------------------------------------
  void generate() {
    preamble(kCBufOff + kStripVecs * kCTileBytes);
    mov(reg_w, arg(offsetof(GemmArgs, w)));
    mov(reg_lda, arg(offsetof(GemmArgs, lda)));
    mov(reg_wscale, arg(offsetof(GemmArgs, w_scale)));
    mov(reg_comp, arg(offsetof(GemmArgs, w_comp)));
    mov(reg_col, arg(offsetof(GemmArgs, out_col)));
    shl(reg_col, 2);
    mov(reg_bstride, row_bytes());
    configure_tiles();

    Label strip_loop, done;
    mov(rax, arg(offsetof(GemmArgs, n_strips)));
    test(rax, rax);
    jle(done, T_NEAR);
    mov(qword[rsp], rax);
    L(strip_loop);
    {
      mov(reg_strip, reg_w);
      Label mb_loop, mb_done;
      xor_(reg_row.cvt32(), reg_row.cvt32());
      mov(reg_mb, arg(offsetof(GemmArgs, m_blocks)));
      test(reg_mb, reg_mb);
      jle(mb_done, T_NEAR);
      L(mb_loop);
      {
        compute_block();
        add(reg_row, mr_);
        dec(reg_mb);
        jnz(mb_loop, T_NEAR);
      }
      L(mb_done);
      mov(rax, arg(offsetof(GemmArgs, k4)));
      imul(rax, rax, row_bytes());
      lea(reg_w, ptr[reg_strip + rax]);  // next strip
      add(reg_wscale, strip_cols() * 4);
      add(reg_comp, strip_cols() * 4);
      add(reg_col, out_cols() * 4);
      dec(qword[rsp]);
      jnz(strip_loop, T_NEAR);
    }
    L(done);
    t_release();
    postamble();
    emit_constants();
  }

  // The static part of the configuration comes from the constant pool; the K-tail tiles get
  // their shape from k4 % 16 at run time (unconfigured when it is 0).
  void configure_tiles() {
    vmovups(zmm0, zword[rip + c_cfg_]);
    vmovups(zword[rsp + kCfgOff], zmm0);
    Label no_tail;
    mov(rax, arg(offsetof(GemmArgs, k4)));
    and_(eax, 15);
    jz(no_tail, T_NEAR);
    mov(byte[rsp + kCfgOff + 48 + kTileATail], mr_);
    mov(ecx, eax);
    shl(ecx, 2);
    mov(word[rsp + kCfgOff + 16 + 2 * kTileATail], cx);
    mov(byte[rsp + kCfgOff + 48 + kTileBTail], al);
    mov(word[rsp + kCfgOff + 16 + 2 * kTileBTail], 64);
    L(no_tail);
    t_cfg(rsp, kCfgOff);
  }

  // Rows [reg_row, reg_row + m_r) x the strip at reg_strip, over all of K.
  void compute_block() {
    mov(reg_a, reg_row);
    imul(reg_a, reg_lda);
    add(reg_a, arg(offsetof(GemmArgs, a)));
    mov(reg_w, reg_strip);
    for (int v = 0; v < nv_; ++v) t_zero(kTileC + v);
    Label kb_loop, kb_done, no_tail;
    mov(reg_k, arg(offsetof(GemmArgs, k4)));
    shr(reg_k, 4);  // blocks of 16 k4 steps (bf16: 16 k pairs)
    jz(kb_done, T_NEAR);
    L(kb_loop);
    {
      t_load(kTileA, reg_a, reg_lda, 0);
      for (int v = 0; v < nv_; ++v) {
        t_load(kTileB, reg_w, reg_bstride, v * 64);
        t_dp(kTileC + v, kTileA, kTileB);
      }
      add(reg_a, 64);
      add(reg_w, 16 * row_bytes());
      dec(reg_k);
      jnz(kb_loop, T_NEAR);
    }
    L(kb_done);
    test(byte[reg_args + offsetof(GemmArgs, k4)], 15);
    jz(no_tail, T_NEAR);
    t_load(kTileATail, reg_a, reg_lda, 0);
    for (int v = 0; v < nv_; ++v) {
      t_load(kTileBTail, reg_w, reg_bstride, v * 64);
      t_dp(kTileC + v, kTileATail, kTileBTail);
    }
    L(no_tail);
    mov(ecx, 64);
    for (int v = 0; v < nv_; ++v) t_store(kTileC + v, rsp, rcx, kCBufOff + v * kCTileBytes);
    epilogue();
  }

  // ---- epilogue: per row, the C rows of the strip's vectors in zmm0..3 -----------------------
  // Same instruction sequence (and so the same rounding) as the avx512_vnni kernels' epilogue.
  Zmm acc(int v) const { return Zmm(v); }

  void epilogue() {
    mov(rax, arg(offsetof(GemmArgs, a_scale)));
    lea(rax, ptr[rax + reg_row * 4]);
    mov(rdx, arg(offsetof(GemmArgs, out_rows)));
    lea(rdx, ptr[rdx + reg_row * 8]);
    if (key_.epilogue == Epilogue::accum) {
      mov(rcx, arg(offsetof(GemmArgs, row_weight)));
      lea(rcx, ptr[rcx + reg_row * 4]);
    }
    lea(reg_k, ptr[rsp + kCBufOff]);
    mov(reg_a, mr_);
    Label row_loop;
    L(row_loop);
    {
      const Zmm s = zmm28, t = zmm29;
      if (!bf16_) vbroadcastss(s, dword[rax]);
      for (int v = 0; v < nv_; ++v) {
        vmovups(acc(v), zword[reg_k + v * kCTileBytes]);
        if (bf16_) continue;  // fp32 results as they are (bf16 weights carry no scales)
        vpsubd(acc(v), acc(v), zword[reg_comp + v * 64]);
        vcvtdq2ps(acc(v), acc(v));
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

  // h = g / (1 + exp(-g)) * u, exp as kt-kernel's degree-5 exp2 polynomial (see gemm_ref).
  void siluup_row() {
    const Zmm x = zmm28, r = zmm29, p = zmm30;
    const int half = nv_ / 2;
    for (int v = 0; v < half; ++v) {
      const Zmm g = acc(v), u = acc(v + half);
      vxorps(x, g, zword[rip + c_sign_]);
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
    set(kTileA, mr_, 64);
    set(kTileB, 16, 64);
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
  }

  const KernelKey key_;
  std::vector<amx::AmxOp>* log_;
  const int nv_, mr_;
  const bool bf16_;
  Label c_cfg_, c_sign_, c_max_, c_min_, c_log2e_, c_poly_[6], c_bias_, c_one_;
};

}  // namespace

bool amx_gemm_supported(const KernelKey& key) {
  return key.isa == IsaLevel::amx && key.kind == KernelKind::gemm_prefill &&
         (key.format == WeightFormat::int8 || key.format == WeightFormat::bf16) && key.m_r >= 1 &&
         key.m_r <= kAmxTileRows && key.n_vec >= 1 && key.n_vec <= kStripVecs &&
         !(key.epilogue == Epilogue::siluup && key.n_vec % 2);
}

std::vector<uint8_t> generate_amx_gemm(const KernelKey& key, std::vector<amx::AmxOp>* log) {
  if (log) log->clear();
  AmxGemmGenerator g(key, log);
  return g.bytes();
}

}  // namespace ktjit::x64
