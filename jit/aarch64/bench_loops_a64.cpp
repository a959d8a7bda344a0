// Generated measurement loops for AArch64 (asmjit a64), the counterpart of jit/x64/bench_loops.cpp.
//
// Peak loop   void fn(int64_t iterations)            x0 = iterations
//   Each iteration runs kRepeat copies of a block of independent accumulator chains of the op
//   the NEON kernels use (jit/aarch64/gemm_a64.cpp): fmla v.4s by element (bf16 via fp32),
//   sdot v.4s, v.16b, v.4b[0] (int8 at neon_dotprod / neon_bf16), bfdot v.4s, v.8h, v.2h[0] (bf16
//   pair prefill at neon_bf16), or the widening int8 step of plain NEON: smull, smull2, addp,
//   sadalp. Only v0-v7 and v16-v31 are used, so no callee-saved register (d8-d15) is touched.
// Read stream void fn(const void* buf, int64_t bytes)  x0 = buf, x1 = bytes (multiple of 1 KiB)
//   ldp q-register pairs, 256 bytes per iteration, folded into 8 accumulators with eor so no load
//   is dead.
#include "jit/aarch64/bench_loops_a64.hpp"

#include <stdexcept>
#include <string>

#include "jit/aarch64/a64_emitter.hpp"

namespace ktjit::aarch64 {
namespace {

namespace aj = asmjit;
namespace a64 = asmjit::a64;
using a64::VecV;

constexpr int kRepeat = 4;  // copies of the chain block per loop iteration

// The 24 vector registers the loops may use: v0-v7, v16-v31.
VecV free_reg(int i) {
  return VecV(uint32_t(i < 8 ? i : i + 8));
}

// Validates (key.isa, variant); throws std::invalid_argument for combinations the level lacks.
PeakOp checked_op(const KernelKey& key) {
  if (key.variant >= kNumPeakOps)
    throw std::invalid_argument("peak_loop: unknown variant " + std::to_string(key.variant));
  const PeakOp op = PeakOp(key.variant);
  bool ok = isa_is_neon(key.isa);
  switch (op) {
    case PeakOp::fma_f32:
    case PeakOp::smull_sadalp: break;  // every NEON level
    case PeakOp::sdot: ok = ok && key.isa != IsaLevel::neon; break;
    case PeakOp::bfdot: ok = ok && key.isa == IsaLevel::neon_bf16; break;
    default: ok = false;  // x86-64 ops
  }
  if (!ok)
    throw std::invalid_argument(std::string("peak_loop: ") + peak_op_name(op) +
                                " is not available at isa " + isa_name(key.isa));
  return op;
}

// Independent chains per block: 22 single-register chains (2 sources), or 7 widening chains of
// an accumulator and two int16 temporaries.
int chains(PeakOp op) {
  return op == PeakOp::smull_sadalp ? 7 : 22;
}

std::vector<uint8_t> peak_loop(PeakOp op) {
  A64Emitter e;
  auto& a = e.as();
  const int n = chains(op);
  const VecV src_a = free_reg(22), src_b = free_reg(23);
  aj::Label loop = a.newLabel(), done = a.newLabel();
  a.cmp(a64::x0, 0);
  a.b_le(done);
  // Sources: fp32 0.5 (fmla), bf16 0.5 (bfdot) or small int8 bytes, so no lane goes denormal or
  // saturates. (movi with a shifted byte: asmjit's fmov vector-immediate form encodes v31.)
  switch (op) {
    case PeakOp::fma_f32: a.movi(src_a.s4(), 0x3f, aj::arm::lsl(24)); break;  // 0x3f000000
    case PeakOp::bfdot: a.movi(src_a.h8(), 0x3f, aj::arm::lsl(8)); break;     // 0x3f00
    default: a.movi(src_a.b16(), 3); break;
  }
  a.mov(src_b.b16(), src_a.b16());
  const int regs = op == PeakOp::smull_sadalp ? 3 * n : n;
  for (int i = 0; i < regs; ++i) a.movi(free_reg(i).b16(), 0);
  a.bind(loop);
  for (int r = 0; r < kRepeat; ++r) {
    for (int i = 0; i < n; ++i) {
      const VecV acc = free_reg(i);
      switch (op) {
        case PeakOp::fma_f32: a.fmla(acc.s4(), src_a.s4(), src_b.s(0)); break;
        case PeakOp::sdot: a.sdot(acc.s4(), src_a.b16(), src_b.b4(0)); break;
        case PeakOp::bfdot: a.bfdot(acc.s4(), src_a.h8(), src_b.h2(0)); break;
        case PeakOp::smull_sadalp: {
          const VecV t0 = free_reg(n + 2 * i), t1 = free_reg(n + 2 * i + 1);
          a.smull(t0.h8(), src_a.b8(), src_b.b8());
          a.smull2(t1.h8(), src_a.b16(), src_b.b16());
          a.addp(t0.h8(), t0.h8(), t1.h8());
          a.sadalp(acc.s4(), t0.h8());
          break;
        }
        default: break;  // refused by checked_op()
      }
    }
  }
  a.subs(a64::x0, a64::x0, 1);
  a.b_gt(loop);
  a.bind(done);
  a.ret(a64::x30);
  return e.bytes();
}

}  // namespace

std::vector<uint8_t> generate_peak_loop(const KernelKey& key) {
  return peak_loop(checked_op(key));
}

double peak_ops_per_iteration_a64(const KernelKey& key) {
  const PeakOp op = checked_op(key);
  double per_chain = 0;  // ops (2 per multiply-accumulate) per chain step
  switch (op) {
    case PeakOp::fma_f32: per_chain = 2.0 * 4; break;        // 4 fp32 lanes
    case PeakOp::sdot: per_chain = 2.0 * 16; break;          // 16 byte products
    case PeakOp::bfdot: per_chain = 2.0 * 8; break;          // 8 bf16 products
    case PeakOp::smull_sadalp: per_chain = 2.0 * 16; break;  // 16 byte products in 4 instructions
    default: break;
  }
  return per_chain * chains(op) * kRepeat;
}

std::vector<uint8_t> generate_read_stream(const KernelKey& key) {
  if (!isa_is_neon(key.isa))
    throw std::invalid_argument("read_stream (aarch64): not a NEON level: " + key.describe());
  constexpr int kAcc = 8, kPairs = 8;  // 8 ldp of two q registers: 256 bytes per iteration
  A64Emitter e;
  auto& a = e.as();
  aj::Label loop = a.newLabel(), done = a.newLabel();
  for (int i = 0; i < kAcc; ++i) a.movi(free_reg(i).b16(), 0);
  a.add(a64::x1, a64::x0, a64::x1);  // end
  a.cmp(a64::x0, a64::x1);
  a.b_hs(done);
  a.bind(loop);
  for (int p = 0; p < kPairs; ++p) {
    const VecV l0 = free_reg(kAcc + 2 * (p % 4)), l1 = free_reg(kAcc + 2 * (p % 4) + 1);
    a.ldp(l0, l1, a64::ptr(a64::x0, 32 * p));  // q registers
    a.eor(free_reg((2 * p) % kAcc).b16(), free_reg((2 * p) % kAcc).b16(), l0.b16());
    a.eor(free_reg((2 * p + 1) % kAcc).b16(), free_reg((2 * p + 1) % kAcc).b16(), l1.b16());
  }
  a.add(a64::x0, a64::x0, 32 * kPairs);
  a.cmp(a64::x0, a64::x1);
  a.b_lo(loop);
  a.bind(done);
  // Fold the accumulators so the loads feed a live result (returned in w0, ignored).
  for (int s = kAcc / 2; s >= 1; s /= 2)
    for (int i = 0; i < s; ++i) a.orr(free_reg(i).b16(), free_reg(i).b16(), free_reg(i + s).b16());
  a.umov(a64::w0, free_reg(0).s(0));
  a.ret(a64::x30);
  return e.bytes();
}

}  // namespace ktjit::aarch64
