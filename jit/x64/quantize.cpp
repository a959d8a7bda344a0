// Activation quantizer kernels (jit/quantize.hpp): per 16-value block, zmm levels one vector,
// avx2 two ymm.
//
// amax   rax = x, rcx = vectors left; four accumulators (vmaxps of |x| = x AND 0x7fffffff) over
//        four vectors an iteration, then one at a time; combined, stored to amax[0..15] (ymm: the
//        8 lanes twice).
// round  per block: v = x * id, clamped to [-127, 127] in fp32, vcvtps2dq (round to nearest even
//        under the default MXCSR), then the int32 lanes' low bytes gathered into 16 bytes: zmm
//        vpshufb (each 128-bit lane's 4 bytes to its first dword) + vpermd (dwords 0, 4, 8, 12);
//        ymm vpshufb of the two vectors into dwords 0 and 1 of each lane, vpor, vpermd (0, 4, 1,
//        5). Flip: XOR 0x80. One 16-byte store.
// bf16   per block, on the bits u of each lane: rne = (u + 0x7fff + (u >> 16 & 1)) >> 16,
//        nan = u >> 16 | 0x40, chosen where (0x7f800000 - (u & 0x7fffffff)) < 0 (shifted
//        arithmetically into a lane mask: vpternlogd at zmm, vpblendvb at ymm); the dwords' low
//        words gathered into 32 bytes (vpshufb per 128-bit lane + vpermd, as round does).
#include "jit/x64/quantize.hpp"

#include <initializer_list>
#include <stdexcept>
#include <string>

#include "jit/quantize.hpp"
#include "jit/x64/generator.hpp"

namespace ktjit::x64 {
namespace {

using namespace Xbyak;
using namespace Xbyak::util;

class QuantizeGenerator : public JitGenerator {
 public:
  explicit QuantizeGenerator(const KernelKey& key) : JitGenerator(key.isa), variant_(key.variant) {
    if (key.format != WeightFormat::int8 || variant_ > kQuantBf16)
      throw std::invalid_argument(
          "quantize: int8 rows, variant amax / round / round_flip / bf16: " + key.describe());
    if (key.isa == IsaLevel::ref || isa_is_neon(key.isa) || key.isa == IsaLevel::amx)
      throw std::invalid_argument(std::string("quantize: no x86 generator for isa ") +
                                  isa_name(key.isa));
    preamble();
    if (variant_ == kQuantAmax)
      amax();
    else if (variant_ == kQuantBf16)
      to_bf16();
    else
      round();
    postamble();
    constants();
  }

 private:
  Address vmem(const RegExp& e) const { return zmm_isa() ? zword[e] : yword[e]; }
  Address cmem(Label& l) const { return zmm_isa() ? zword[rip + l] : yword[rip + l]; }

  void amax() {
    const Xmm mask = vreg(4);
    Label four, one, combine;
    mov(rax, qword[rdi + offsetof(QuantArgs, x)]);
    mov(rcx, qword[rdi + offsetof(QuantArgs, blocks)]);
    if (!zmm_isa()) shl(rcx, 1);  // two ymm a block
    vmovups(mask, cmem(c_abs_));
    for (int j = 0; j < 4; ++j) vxorps(vreg(j), vreg(j), vreg(j));
    L(four);
    cmp(rcx, 4);
    jl(one, T_NEAR);
    for (int j = 0; j < 4; ++j) {
      vandps(vreg(5), mask, vmem(rax + j * vec_bytes()));
      vmaxps(vreg(j), vreg(j), vreg(5));
    }
    add(rax, 4 * vec_bytes());
    sub(rcx, 4);
    jmp(four, T_NEAR);
    L(one);
    test(rcx, rcx);
    jz(combine, T_NEAR);
    vandps(vreg(5), mask, vmem(rax));
    vmaxps(vreg(0), vreg(0), vreg(5));
    add(rax, vec_bytes());
    dec(rcx);
    jmp(one, T_NEAR);
    L(combine);
    vmaxps(vreg(0), vreg(0), vreg(1));
    vmaxps(vreg(2), vreg(2), vreg(3));
    vmaxps(vreg(0), vreg(0), vreg(2));
    mov(rdx, qword[rdi + offsetof(QuantArgs, amax)]);
    vmovups(vmem(rdx), vreg(0));
    if (!zmm_isa()) vmovups(vmem(rdx + 32), vreg(0));
  }

  // Vector v of fp32 in `t` scaled, clamped and converted to int32 in place.
  void scale_round(const Xmm& t, const Address& src) {
    vmulps(t, vreg(4), src);
    vminps(t, t, vreg(5));
    vmaxps(t, t, vreg(6));
    vcvtps2dq(t, t);
  }

  void round() {
    Label loop, done;
    const Xmm id = vreg(4), hi = vreg(5), lo = vreg(6), perm = vreg(7), shuf = vreg(8);
    mov(rax, qword[rdi + offsetof(QuantArgs, x)]);
    mov(rcx, qword[rdi + offsetof(QuantArgs, blocks)]);
    mov(rdx, qword[rdi + offsetof(QuantArgs, q)]);
    vbroadcastss(id, dword[rdi + offsetof(QuantArgs, id)]);
    vmovups(hi, cmem(c_hi_));
    vmovups(lo, cmem(c_lo_));
    vmovups(perm, cmem(c_perm_));
    vmovups(shuf, cmem(c_shuf_));
    const bool flip = variant_ == kQuantRoundFlip;
    if (flip) vmovups(vreg(9), cmem(c_flip_));
    if (!zmm_isa()) vmovups(vreg(10), cmem(c_shuf_b_));
    test(rcx, rcx);
    jle(done, T_NEAR);
    L(loop);
    const Xmm t = vreg(0), u = vreg(1);
    const Xmm out(t.getIdx());  // the block's 16 bytes: the low 128 bits of t
    if (zmm_isa()) {
      scale_round(t, vmem(rax));
      vpshufb(t, t, shuf);
      vpermd(Zmm(t.getIdx()), Zmm(perm.getIdx()), Zmm(t.getIdx()));
    } else {
      scale_round(t, vmem(rax));
      scale_round(u, vmem(rax + 32));
      vpshufb(t, t, shuf);
      vpshufb(u, u, vreg(10));
      vpor(t, t, u);
      vpermd(Ymm(t.getIdx()), Ymm(perm.getIdx()), Ymm(t.getIdx()));
    }
    if (flip) vpxor(out, out, Xmm(9));
    vmovdqu(xword[rdx], out);
    add(rax, 64);
    add(rdx, 16);
    dec(rcx);
    jnz(loop, T_NEAR);
    L(done);
  }

  // One vector of fp32 bits `x` (already loaded) to its bf16 bits in the low word of each dword
  // of `out`; t is a temporary.
  // Bitwise and / or at either width: EVEX vpandd / vpord on zmm, VEX vpand / vpor on ymm.
  void vand(const Xmm& d, const Xmm& a, const Xmm& b) {
    if (zmm_isa())
      vpandd(d, a, b);
    else
      vpand(d, a, b);
  }
  void vor(const Xmm& d, const Xmm& a, const Xmm& b) {
    if (zmm_isa())
      vpord(d, a, b);
    else
      vpor(d, a, b);
  }
  void bf16_lanes(const Xmm& out, const Xmm& x, const Xmm& t) {
    const Xmm one = vreg(4), round = vreg(5), abs = vreg(6), inf = vreg(7), qbit = vreg(8);
    // rne = (u + 0x7fff + lsb) >> 16
    vpsrld(t, x, 16);
    vand(out, t, one);
    vpaddd(out, out, x);
    vpaddd(out, out, round);
    vpsrld(out, out, 16);
    vor(t, t, qbit);  // nan = u >> 16 | 0x40
    // mask = (0x7f800000 - |u|) >> 31 (arithmetic): all ones on NaN
    const Xmm m = x;  // x is not needed any more
    vand(m, x, abs);
    vpsubd(m, inf, m);
    vpsrad(m, m, 31);
    if (zmm_isa()) {
      vpternlogd(m, t, out, 0xca);  // m ? nan : rne
      vmovdqa32(out, m);
    } else {
      vpblendvb(out, out, t, m);
    }
  }

  void to_bf16() {
    Label loop, done;
    mov(rax, qword[rdi + offsetof(QuantArgs, x)]);
    mov(rcx, qword[rdi + offsetof(QuantArgs, blocks)]);
    mov(rdx, qword[rdi + offsetof(QuantArgs, q)]);
    vmovups(vreg(4), cmem(c_one_));
    vmovups(vreg(5), cmem(c_7fff_));
    vmovups(vreg(6), cmem(c_abs_));
    vmovups(vreg(7), cmem(c_inf_));
    vmovups(vreg(8), cmem(c_qbit_));
    vmovups(vreg(9), cmem(c_w_shuf_));
    if (!zmm_isa()) vmovups(vreg(10), cmem(c_w_shuf_b_));
    vmovups(vreg(11), cmem(c_w_perm_));
    test(rcx, rcx);
    jle(done, T_NEAR);
    L(loop);
    if (zmm_isa()) {
      vmovdqu32(vreg(0), vmem(rax));
      bf16_lanes(vreg(1), vreg(0), vreg(2));
      vpshufb(vreg(1), vreg(1), vreg(9));
      vpermd(Zmm(1), Zmm(11), Zmm(1));
      vmovdqu(yword[rdx], Ymm(1));
    } else {
      vmovdqu(vreg(0), vmem(rax));
      vmovdqu(vreg(12), vmem(rax + 32));
      bf16_lanes(vreg(1), vreg(0), vreg(2));
      bf16_lanes(vreg(13), vreg(12), vreg(2));
      vpshufb(vreg(1), vreg(1), vreg(9));
      vpshufb(vreg(13), vreg(13), vreg(10));
      vpor(vreg(1), vreg(1), vreg(13));
      vpermd(Ymm(1), Ymm(11), Ymm(1));
      vmovdqu(yword[rdx], Ymm(1));
    }
    add(rax, 64);
    add(rdx, 32);
    dec(rcx);
    jnz(loop, T_NEAR);
    L(done);
  }

  // A vpshufb table at `l`: in each 128-bit lane, the low `width` bytes of its 4 dwords packed
  // into bytes at .. at + 4 * width - 1, zero elsewhere (round: the int8 bytes; bf16: the words).
  void shuffle_low_bytes(Label& l, int width, int at) {
    L(l);
    for (int lane = 0; lane < 4; ++lane)
      for (int b = 0; b < 16; ++b)
        db(b >= at && b < at + 4 * width ? uint8_t(4 * ((b - at) / width) + (b - at) % width)
                                         : 0x80);
  }

  void constants() {
    align(64);
    emit_const32(c_abs_, 0x7fffffffu);
    emit_const32(c_hi_, f32_bits(127.0f));
    emit_const32(c_lo_, f32_bits(-127.0f));
    // vpshufb per 128-bit lane: the low bytes of its 4 dwords into bytes 0-3 (ymm's second
    // vector: 4-7), zero elsewhere
    shuffle_low_bytes(c_shuf_, 1, 0);
    shuffle_low_bytes(c_shuf_b_, 1, 4);
    // vpermd: zmm dwords 0, 4, 8, 12 first; ymm 0, 4, 1, 5
    permute_table(c_perm_, {0, 4, 8, 12}, {0, 4, 1, 5});
    emit_const32(c_flip_, 0x80808080u);
    emit_const32(c_one_, 1);
    emit_const32(c_7fff_, 0x7fff);
    emit_const32(c_inf_, 0x7f800000u);
    emit_const32(c_qbit_, 0x40);
    // bf16: vpshufb per 128-bit lane, the low words of its 4 dwords into bytes 0-7 (ymm's second
    // vector: 8-15), zero elsewhere; vpermd: zmm dwords 0, 1, 4, 5, 8, 9, 12, 13 first; ymm
    // (quad words lo0-3, hi0-3, lo4-7, hi4-7) 0, 1, 4, 5, 2, 3, 6, 7
    shuffle_low_bytes(c_w_shuf_, 2, 0);
    shuffle_low_bytes(c_w_shuf_b_, 2, 8);
    permute_table(c_w_perm_, {0, 1, 4, 5, 8, 9, 12, 13}, {0, 1, 4, 5, 2, 3, 6, 7});
  }
  // A vpermd index table at `l`: the zmm or the ymm order for this level, zero-filled to 16 dwords.
  void permute_table(Label& l, std::initializer_list<uint32_t> zmm,
                     std::initializer_list<uint32_t> ymm) {
    L(l);
    const std::initializer_list<uint32_t>& idx = zmm_isa() ? zmm : ymm;
    for (uint32_t v : idx) dd(v);
    for (size_t i = idx.size(); i < 16; ++i) dd(0);
  }

  const uint16_t variant_;
  Label c_abs_, c_hi_, c_lo_, c_shuf_, c_shuf_b_, c_perm_, c_flip_;
  Label c_one_, c_7fff_, c_inf_, c_qbit_, c_w_shuf_, c_w_shuf_b_, c_w_perm_;
};

}  // namespace

std::vector<uint8_t> generate_quantize(const KernelKey& key) {
  QuantizeGenerator g(key);
  return g.bytes();
}

}  // namespace ktjit::x64
