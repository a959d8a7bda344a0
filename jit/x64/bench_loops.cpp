// Generated measurement loops: instruction throughput (peak loops) and streaming read bandwidth.
//
// Peak loop   void fn(int64_t iterations)            rdi = iterations
//   Each iteration runs kRepeat copies of a block of independent accumulator chains, so the only
//   dependency is one chain per accumulator (enough chains to cover the latency of every op).
//   AMX ops: 4 accumulator tiles (tmm0-3) fed by 2 A tiles x 2 B tiles loaded once (tmm4-7), all
//   16 rows x 64 bytes, so every tile multiply is the full 16x16 block; tiles released at the end.
// Read stream void fn(const void* buf, int64_t bytes)  rdi = buf, rsi = bytes (multiple of 1 KiB)
//   ymm loads at every ISA level (fastest on Zen 4 even where zmm is available), folded into
//   8 accumulators with vpaddd so no load is dead.
#include "jit/x64/bench_loops.hpp"

#include <stdexcept>
#include <string>

#include "jit/x64/generator.hpp"

namespace ktjit::x64 {
namespace {

using namespace Xbyak;
using namespace Xbyak::util;

constexpr int kRepeat = 4;  // copies of the chain block per loop iteration

// Validates (key.isa, variant); throws std::invalid_argument for combinations the ISA lacks.
PeakOp checked_op(const KernelKey& key) {
  if (key.variant >= kNumPeakOps)
    throw std::invalid_argument("peak_loop: unknown variant " + std::to_string(key.variant));
  const PeakOp op = PeakOp(key.variant);
  const int lvl = int(key.isa);
  int need = int(IsaLevel::avx2);
  if (op == PeakOp::vpdpbusd) need = int(IsaLevel::avx512_vnni);
  if (op == PeakOp::dpbf16) need = int(IsaLevel::avx512_bf16);
  const bool amx_op = op == PeakOp::tdpbusd || op == PeakOp::tdpbf16ps;
  if (amx_op) need = int(IsaLevel::amx);
  const bool a64_op = op == PeakOp::sdot || op == PeakOp::smull_sadalp || op == PeakOp::bfdot;
  if (key.isa == IsaLevel::ref || lvl < need || isa_is_neon(key.isa) || a64_op ||
      (amx_op && lvl != need))
    throw std::invalid_argument(std::string("peak_loop: ") + peak_op_name(op) +
                                " is not available at isa " + isa_name(key.isa));
  return op;
}

bool is_zmm(IsaLevel isa) {
  return int(isa) >= int(IsaLevel::avx512);
}

// Independent accumulator chains per block.
int chains(PeakOp op, IsaLevel isa) {
  if (op == PeakOp::maddubsw || op == PeakOp::maddubsw_w)  // acc + temp per chain, 3 sources
    return is_zmm(isa) ? 12 : 6;
  return is_zmm(isa) ? 24 : 12;
}

class PeakLoopGenerator : public JitGenerator {
 public:
  explicit PeakLoopGenerator(const KernelKey& key) : JitGenerator(key.isa), op_(checked_op(key)) {
    generate();
  }

 private:
  void zero(int i) {
    if (zmm_isa())
      vpxord(Zmm(i), Zmm(i), Zmm(i));
    else
      vpxor(Ymm(i), Ymm(i), Ymm(i));
  }
  void load_const(int i, const Label& l) {
    if (zmm_isa())
      vmovdqu32(Zmm(i), ptr[rip + l]);
    else
      vmovdqu(Ymm(i), ptr[rip + l]);
  }

  bool amx_op() const { return op_ == PeakOp::tdpbusd || op_ == PeakOp::tdpbf16ps; }

  // Tile multiplies: tmm0-3 += {tmm4, tmm5} x {tmm6, tmm7}, kRepeat blocks per iteration.
  void generate_amx() {
    Label cfg, data, loop, done;
    test(rdi, rdi);
    jle(done, T_NEAR);
    ldtilecfg(ptr[rip + cfg]);
    lea(rax, ptr[rip + data]);
    mov(rcx, 64);
    for (int t = 4; t < 8; ++t) tileloadd(Tmm(t), ptr[rax + rcx]);
    for (int t = 0; t < 4; ++t) tilezero(Tmm(t));
    align(32);
    L(loop);
    for (int r = 0; r < kRepeat; ++r) {
      for (int c = 0; c < 4; ++c) {
        const Tmm acc(c), a(4 + c / 2), b(6 + c % 2);
        if (op_ == PeakOp::tdpbusd)
          tdpbusd(acc, a, b);
        else
          tdpbf16ps(acc, a, b);
      }
    }
    dec(rdi);
    jnz(loop, T_NEAR);
    tilerelease();
    L(done);
    ret();

    // Palette 1, every tile 16 rows x 64 bytes.
    align(64);
    L(cfg);
    db(1);
    for (int i = 1; i < 16; ++i) db(0);
    for (int t = 0; t < 8; ++t) dw(64);
    for (int i = 0; i < 16; ++i) db(0);
    for (int t = 0; t < 8; ++t) db(16);
    for (int i = 0; i < 8; ++i) db(0);
    // One 16 x 64-byte tile of sources (small int8 bytes / bf16 pairs of 1.0; no denormals).
    align(64);
    L(data);
    for (int i = 0; i < 256; ++i) dd(op_ == PeakOp::tdpbusd ? 0x01020304u : 0x3f803f80u);
  }

  void generate() {
    if (amx_op()) return generate_amx();
    Label lconst_a, lconst_b, loop, done;
    const int n = chains(op_, isa());
    const int srcA = num_vregs() - 1, srcB = num_vregs() - 2, srcC = num_vregs() - 3;

    test(rdi, rdi);
    jle(done, T_NEAR);
    // Source operands: values are irrelevant to throughput but chosen so no lane goes denormal
    // (fp32 1.0 / bf16 pairs of 1.0 / small int8 bytes).
    load_const(srcA, lconst_a);
    load_const(srcB, lconst_b);
    if (op_ == PeakOp::maddubsw) load_const(srcC, lconst_b);
    for (int i = 0; i < n; ++i) zero(i);
    if (op_ == PeakOp::maddubsw || op_ == PeakOp::maddubsw_w)
      for (int i = 0; i < n; ++i) zero(n + i);

    align(32);
    L(loop);
    for (int r = 0; r < kRepeat; ++r) {
      for (int i = 0; i < n; ++i) {
        const Xmm acc = vreg(i), a = vreg(srcA), b = vreg(srcB);
        switch (op_) {
          case PeakOp::vpdpbusd: vpdpbusd(acc, a, b, EvexEncoding); break;
          case PeakOp::fma_f32: vfmadd231ps(acc, a, b); break;
          case PeakOp::dpbf16: vdpbf16ps(acc, a, b); break;
          case PeakOp::tdpbusd:
          case PeakOp::tdpbf16ps: break;  // generate_amx()
          default: break;                 // AArch64 ops: refused by checked_op()
          case PeakOp::maddubsw: {
            const Xmm t = vreg(n + i);
            vpmaddubsw(t, a, b);
            vpmaddwd(t, t, vreg(srcC));
            vpaddd(acc, acc, t);
            break;
          }
          case PeakOp::maddubsw_w: {
            const Xmm t = vreg(n + i);
            vpmaddubsw(t, a, b);
            vpaddw(acc, acc, t);
            break;
          }
        }
      }
    }
    dec(rdi);
    jnz(loop, T_NEAR);
    L(done);
    vzeroupper();
    ret();

    align(64);
    uint32_t a_bits = 0, b_bits = 0;
    switch (op_) {
      case PeakOp::vpdpbusd:
      case PeakOp::maddubsw:
      case PeakOp::maddubsw_w:
        a_bits = 0x01020304u;
        b_bits = 0x01010101u;
        break;
      case PeakOp::fma_f32:
        a_bits = f32_bits(1.0f);
        b_bits = f32_bits(1.0f);
        break;
      case PeakOp::dpbf16:
        a_bits = 0x3f803f80u;
        b_bits = 0x3f803f80u;
        break;
      case PeakOp::tdpbusd:
      case PeakOp::tdpbf16ps: break;  // generate_amx()
      default: break;                 // AArch64 ops: refused by checked_op()
    }
    emit_const32(lconst_a, a_bits);
    emit_const32(lconst_b, b_bits);
  }

  PeakOp op_;
};

class ReadStreamGenerator : public JitGenerator {
 public:
  explicit ReadStreamGenerator(const KernelKey& key) : JitGenerator(key.isa) {
    if (key.isa == IsaLevel::ref)
      throw std::invalid_argument("read_stream: no vector generator for isa ref");
    generate();
  }

 private:
  static constexpr int kAcc = 8;
  static constexpr int kLoadsPerIter = 16;  // 16 x 32 B = 512 B per iteration
  static constexpr int kStep = kLoadsPerIter * 32;

  void generate() {
    Label loop, done;
    // ymm0-7 only (VEX encodable at every level; no upper-16 registers needed).
    for (int i = 0; i < kAcc; ++i) vpxor(Ymm(i), Ymm(i), Ymm(i));
    lea(rax, ptr[rdi + rsi]);  // end
    cmp(rdi, rax);
    jae(done, T_NEAR);
    align(32);
    L(loop);
    for (int j = 0; j < kLoadsPerIter; ++j) {
      const Ymm acc(j % kAcc);
      vpaddd(acc, acc, ptr[rdi + j * 32]);
    }
    add(rdi, kStep);
    cmp(rdi, rax);
    jb(loop, T_NEAR);
    L(done);
    // Fold the accumulators so the loads feed a live result (returned in eax, ignored).
    for (int s = kAcc / 2; s >= 1; s /= 2)
      for (int i = 0; i < s; ++i) vpor(Ymm(i), Ymm(i), Ymm(i + s));
    vmovd(eax, Xmm(0));
    vzeroupper();
    ret();
  }
};

}  // namespace

std::vector<uint8_t> generate_peak_loop(const KernelKey& key) {
  return PeakLoopGenerator(key).bytes();
}

double peak_ops_per_iteration_x64(const KernelKey& key) {
  const PeakOp op = checked_op(key);
  const int vbytes = is_zmm(key.isa) ? 64 : 32;
  double per_instr = 0;  // ops (2 per multiply-accumulate) per chain step
  switch (op) {
    case PeakOp::vpdpbusd: per_instr = 2.0 * vbytes; break;         // one MAC per byte
    case PeakOp::maddubsw: per_instr = 2.0 * vbytes; break;         // same work in 3 instructions
    case PeakOp::maddubsw_w: per_instr = 2.0 * vbytes; break;       // in 2 (int16 sums)
    case PeakOp::fma_f32: per_instr = 2.0 * (vbytes / 4); break;    // one MAC per fp32 lane
    case PeakOp::dpbf16: per_instr = 2.0 * (vbytes / 2); break;     // one MAC per bf16 element
    case PeakOp::tdpbusd: return 2.0 * 16 * 16 * 64 * 4 * kRepeat;  // 4 tile multiplies a block
    case PeakOp::tdpbf16ps: return 2.0 * 16 * 16 * 32 * 4 * kRepeat;
    default: break;  // AArch64 ops: refused by checked_op()
  }
  return per_instr * chains(op, key.isa) * kRepeat;
}

std::vector<uint8_t> generate_read_stream(const KernelKey& key) {
  return ReadStreamGenerator(key).bytes();
}

}  // namespace ktjit::x64
