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
#include "jit/x64/quantize.hpp"

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
    if (key.format != WeightFormat::int8 || variant_ > kQuantRoundFlip)
      throw std::invalid_argument("quantize: int8 rows, variant amax / round / round_flip: " +
                                  key.describe());
    if (key.isa == IsaLevel::ref || isa_is_neon(key.isa) || key.isa == IsaLevel::amx)
      throw std::invalid_argument(std::string("quantize: no x86 generator for isa ") +
                                  isa_name(key.isa));
    preamble();
    if (variant_ == kQuantAmax)
      amax();
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

  void constants() {
    align(64);
    emit_const32(c_abs_, 0x7fffffffu);
    emit_const32(c_hi_, f32_bits(127.0f));
    emit_const32(c_lo_, f32_bits(-127.0f));
    // vpshufb per 128-bit lane: the low bytes of its 4 dwords into bytes 0-3 (ymm's second
    // vector: 4-7), zero elsewhere
    auto shuffle = [&](Label& l, int at) {
      L(l);
      for (int lane = 0; lane < 4; ++lane)
        for (int b = 0; b < 16; ++b) db(b >= at && b < at + 4 ? uint8_t(4 * (b - at)) : 0x80);
    };
    shuffle(c_shuf_, 0);
    shuffle(c_shuf_b_, 4);
    // vpermd: zmm dwords 0, 4, 8, 12 first; ymm 0, 4, 1, 5
    L(c_perm_);
    const uint32_t pz[16] = {0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    const uint32_t py[16] = {0, 4, 1, 5, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    for (int i = 0; i < 16; ++i) dd(zmm_isa() ? pz[i] : py[i]);
    emit_const32(c_flip_, 0x80808080u);
  }

  const uint16_t variant_;
  Label c_abs_, c_hi_, c_lo_, c_shuf_, c_shuf_b_, c_perm_, c_flip_;
};

}  // namespace

std::vector<uint8_t> generate_quantize(const KernelKey& key) {
  QuantizeGenerator g(key);
  return g.bytes();
}

}  // namespace ktjit::x64
