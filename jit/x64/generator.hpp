// Base of every x86-64 generator: an Xbyak CodeGenerator that writes into plain (non-executable)
// memory, an ABI prologue/epilogue for the System V calling convention, vector registers sized
// to the ISA level, and a constant pool addressed RIP-relative so the code can be copied anywhere.
#pragma once

#include <xbyak/xbyak.h>

#include <cstdint>
#include <vector>

#include "jit/cpu/cpu.hpp"

namespace ktjit::x64 {

class JitGenerator : public Xbyak::CodeGenerator {
 public:
  explicit JitGenerator(IsaLevel isa, size_t max_bytes = 64 * 1024)
      : Xbyak::CodeGenerator(max_bytes, Xbyak::DontSetProtectRWE), isa_(isa) {}

  std::vector<uint8_t> bytes() const { return {getCode(), getCode() + getSize()}; }

 protected:
  IsaLevel isa() const { return isa_; }
  bool zmm_isa() const { return int(isa_) >= int(IsaLevel::avx512); }
  int num_vregs() const { return zmm_isa() ? 32 : 16; }
  int vec_bytes() const { return zmm_isa() ? 64 : 32; }
  // Vector register i at the ISA's width (zmm for AVX-512 levels, ymm for AVX2).
  Xbyak::Xmm vreg(int i) const {
    if (zmm_isa()) return Xbyak::Zmm(i);
    return Xbyak::Ymm(i);
  }

  // Saves the callee-saved GP registers (rbx, rbp, r12-r15) and reserves `stack_bytes` of
  // 16-byte aligned scratch at [rsp].
  void preamble(int stack_bytes = 0) {
    for (const auto& r : callee_saved()) push(r);
    stack_ = (stack_bytes + 15) / 16 * 16 + 8;  // 6 pushes + return address leave rsp 8 off
    sub(rsp, stack_);
  }
  void postamble() {
    add(rsp, stack_);
    const auto regs = callee_saved();
    for (auto it = regs.rbegin(); it != regs.rend(); ++it) pop(*it);
    vzeroupper();  // avoid AVX-SSE transition penalties in the caller
    ret();
  }

  // bf16 pair kernels (AMX-BF16, kBf16Pairs): rewrites `pairs` k pairs of a bf16 strip
  // ([k][column], `step_bytes` per k, n_vec vectors of 16 columns) from `src` to `dst` as
  // [k/2][column][2]: the dword of column c in pair p is w[2p][c] | w[2p + 1][c] << 16, 64 bytes
  // per vector and pair. Advances src, dst and counts `pairs` down to 0; clobbers zmm t0, t1.
  void emit_bf16_pair_repack(const Xbyak::Reg64& dst, const Xbyak::Reg64& src,
                             const Xbyak::Reg64& pairs, int n_vec, int step_bytes,
                             const Xbyak::Zmm& t0, const Xbyak::Zmm& t1) {
    Xbyak::Label loop, done;
    test(pairs, pairs);
    jz(done, T_NEAR);
    L(loop);
    for (int v = 0; v < n_vec; ++v) {
      vpmovzxwd(t0, yword[src + v * 32]);
      vpmovzxwd(t1, yword[src + step_bytes + v * 32]);
      vpslld(t1, t1, 16);
      vpord(t0, t0, t1);
      vmovups(zword[dst + v * 64], t0);
    }
    add(src, 2 * step_bytes);
    add(dst, n_vec * 64);
    dec(pairs);
    jnz(loop, T_NEAR);
    L(done);
  }

  // A 64-byte constant: the 32-bit pattern repeated, so it serves as a full ymm or zmm operand.
  void emit_const32(Xbyak::Label& label, uint32_t bits) {
    L(label);
    for (int i = 0; i < 16; ++i) dd(bits);
  }
  static uint32_t f32_bits(float f) {
    uint32_t u;
    static_assert(sizeof(u) == sizeof(f));
    __builtin_memcpy(&u, &f, 4);
    return u;
  }

 private:
  std::vector<Xbyak::Reg64> callee_saved() const { return {rbx, rbp, r12, r13, r14, r15}; }
  IsaLevel isa_;
  int stack_ = 0;
};

}  // namespace ktjit::x64
