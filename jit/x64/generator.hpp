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
