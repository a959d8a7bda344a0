// The x86-64 interpreter of x64_emu.hpp. Semantics follow the pseudo-code of Intel's SDM for each
// instruction; the float arithmetic is the host's IEEE single precision (baseline SSE, default
// MXCSR: round to nearest even, no DAZ/FTZ), as the kernels see it natively.
#include "tests/cpp/x64_emu.hpp"

#include <Zydis/Zydis.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <vector>

#include "jit/amx_model.hpp"
#include "jit/bits.hpp"

namespace ktjit::test {

namespace {

template <class T>
T get(const uint8_t* p, int i) {
  T x;
  std::memcpy(&x, p + size_t(i) * sizeof(T), sizeof(T));
  return x;
}
template <class T>
void put(uint8_t* p, int i, T x) {
  std::memcpy(p + size_t(i) * sizeof(T), &x, sizeof(T));
}
uint32_t f2u(float f) {
  return f32_to_bits(f);
}
float u2f(uint32_t u) {
  return f32_from_bits(u);
}

// IEEE half -> single, exact (subnormal halves become normal singles; NaNs are quieted).
float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  const int e = (h >> 10) & 31;
  uint32_t m = h & 0x3ff;
  if (e == 31) return u2f(sign | 0x7f800000u | (m ? 0x400000u | (m << 13) : 0));
  if (e != 0) return u2f(sign | uint32_t(e + 112) << 23 | m << 13);
  if (m == 0) return u2f(sign);
  int ee = 113;  // normalise the subnormal
  while (!(m & 0x400)) {
    m <<= 1;
    --ee;
  }
  return u2f(sign | uint32_t(ee) << 23 | (m & 0x3ff) << 13);
}

bool subnormal(float f) {
  return (f2u(f) & 0x7f800000u) == 0 && (f2u(f) & 0x7fffffu) != 0;
}
float daz(float f) {
  return subnormal(f) ? u2f(f2u(f) & 0x80000000u) : f;
}

// VDPBF16PS, one fp32 lane (SDM: the odd pair element first, then the even one; each product of
// two bf16 values is exact in fp32, each sum rounded once to nearest even; denormal inputs are
// read as zero and denormal results flushed, MXCSR not consulted).
float dpbf16_lane(float acc, uint32_t a, uint32_t b) {
  auto bf = [](uint32_t x) { return daz(u2f(x << 16)); };
  float r = daz(acc);
  r = daz(r + bf(a >> 16) * bf(b >> 16));
  r = daz(r + bf(a & 0xffff) * bf(b & 0xffff));
  return r;
}

int32_t sat16(int32_t x) {
  return x > 32767 ? 32767 : x < -32768 ? -32768 : x;
}

struct Insn {
  bool decoded = false;
  bool amx = false;
  amx::AmxOp amx_op;
  ZydisDecodedInstruction d;
  ZydisDecodedOperand raw[ZYDIS_MAX_OPERAND_COUNT];
  const ZydisDecodedOperand* op[6] = {};  // explicit operands, the EVEX write mask left out
  int nops = 0;
  int mask = 0;  // EVEX.aaa (0: none)
  bool zeroing = false;  // EVEX.z: masked-off elements zeroed rather than kept
};

class Machine {
 public:
  Machine(const uint8_t* code, size_t size, const EmuOptions& opt)
      : code_(code), size_(size), cache_(size), count_(opt.count_mnemonics), opt_(opt) {
    ZydisDecoderInit(&dec_, ZYDIS_MACHINE_MODE_LONG_64, ZYDIS_STACK_WIDTH_64);
    std::memset(gpr_, 0, sizeof(gpr_));
    std::memset(v_, 0, sizeof(v_));
    std::memset(k_, 0, sizeof(k_));
  }

  EmuStats run(const void* arg0, uint64_t max_instructions) {
    stack_.assign(1 << 16, 0);
    uint64_t top = reinterpret_cast<uint64_t>(stack_.data() + stack_.size()) & ~uint64_t(63);
    top -= 64;
    gpr_[4] = top - 8;  // rsp: the return address (0 ends the run), rsp + 8 16-byte aligned
    std::memset(reinterpret_cast<void*>(gpr_[4]), 0, 8);
    gpr_[7] = reinterpret_cast<uint64_t>(arg0);
    uint64_t rip = reinterpret_cast<uint64_t>(code_);
    EmuStats st;
    while (rip != 0) {
      if (st.instructions++ >= max_instructions) fail(rip, "ran past the instruction limit");
      rip = step(rip, st);
    }
    st.amx = tiles_.counters;
    st.tiles_configured_at_exit = tiles_.configured();
    return st;
  }

 private:
  [[noreturn]] void fail(uint64_t rip, const std::string& what) const {
    char buf[64];
    std::snprintf(buf, sizeof buf, " (offset 0x%llx)",
                  static_cast<unsigned long long>(rip - reinterpret_cast<uint64_t>(code_)));
    throw std::runtime_error("x64 emulator: " + what + buf);
  }

  const Insn& decode(uint64_t rip) {
    const uint64_t off = rip - reinterpret_cast<uint64_t>(code_);
    if (off >= size_) fail(rip, "jump outside the code");
    Insn& in = cache_[off];
    if (in.decoded) return in;
    const uint8_t* p = code_ + off;
    if (amx::decode_amx(p, &in.amx_op)) {
      in.amx = true;
      in.amx_op.offset = uint32_t(off);
      in.d.length = uint8_t(in.amx_op.length);
      in.decoded = true;
      return in;
    }
    if (!ZYAN_SUCCESS(ZydisDecoderDecodeFull(&dec_, p, size_ - off, &in.d, in.raw)))
      fail(rip, "undecodable bytes");
    for (int i = 0; i < in.d.operand_count; ++i) {
      const ZydisDecodedOperand& o = in.raw[i];
      if (o.visibility == ZYDIS_OPERAND_VISIBILITY_HIDDEN) continue;  // flags, rsp of push...
      if (o.encoding == ZYDIS_OPERAND_ENCODING_MASK) {
        in.mask = ZydisRegisterGetId(o.reg.value);
        continue;
      }
      if (in.nops == 6) fail(rip, "too many operands");
      in.op[in.nops++] = &o;
    }
    in.zeroing = in.d.avx.mask.mode == ZYDIS_MASK_MODE_ZEROING;
    if (in.d.avx.rounding.mode != ZYDIS_ROUNDING_MODE_INVALID)
      fail(rip, "embedded rounding is not implemented");
    in.decoded = true;
    return in;
  }

  // ---- operands ----------------------------------------------------------------------------
  static bool is_reg(const ZydisDecodedOperand* o) {
    return o->type == ZYDIS_OPERAND_TYPE_REGISTER;
  }
  static bool is_mem(const ZydisDecodedOperand* o) { return o->type == ZYDIS_OPERAND_TYPE_MEMORY; }
  static bool is_imm(const ZydisDecodedOperand* o) {
    return o->type == ZYDIS_OPERAND_TYPE_IMMEDIATE;
  }
  static ZydisRegisterClass rclass(const ZydisDecodedOperand* o) {
    return ZydisRegisterGetClass(o->reg.value);
  }
  static bool is_vreg(const ZydisDecodedOperand* o) {
    if (!is_reg(o)) return false;
    const auto c = rclass(o);
    return c == ZYDIS_REGCLASS_XMM || c == ZYDIS_REGCLASS_YMM || c == ZYDIS_REGCLASS_ZMM;
  }
  static int vid(const ZydisDecodedOperand* o) { return ZydisRegisterGetId(o->reg.value); }
  static int bytes_of(const ZydisDecodedOperand* o) { return o->size / 8; }

  int gpr_index(uint64_t rip, ZydisRegister r) const {
    const ZydisRegister big = ZydisRegisterGetLargestEnclosing(ZYDIS_MACHINE_MODE_LONG_64, r);
    if (ZydisRegisterGetClass(big) != ZYDIS_REGCLASS_GPR64) fail(rip, "not a general register");
    if (r == ZYDIS_REGISTER_AH || r == ZYDIS_REGISTER_BH || r == ZYDIS_REGISTER_CH ||
        r == ZYDIS_REGISTER_DH)
      fail(rip, "high byte registers are not implemented");
    return ZydisRegisterGetId(big);
  }

  uint64_t address(uint64_t rip, const Insn& in, const ZydisDecodedOperand* o) const {
    const auto& m = o->mem;
    if (m.segment != ZYDIS_REGISTER_NONE && m.segment != ZYDIS_REGISTER_DS &&
        m.segment != ZYDIS_REGISTER_SS && m.segment != ZYDIS_REGISTER_ES &&
        m.segment != ZYDIS_REGISTER_CS)
      fail(rip, "segment overrides are not implemented");
    uint64_t a = uint64_t(m.disp.value);
    if (m.base == ZYDIS_REGISTER_RIP)
      a += rip + in.d.length;
    else if (m.base != ZYDIS_REGISTER_NONE)
      a += gpr_[gpr_index(rip, m.base)];
    if (m.index != ZYDIS_REGISTER_NONE) a += gpr_[gpr_index(rip, m.index)] * m.scale;
    return a;
  }

  // Integer value of a general register, memory or immediate operand, zero-extended.
  uint64_t read_int(uint64_t rip, const Insn& in, const ZydisDecodedOperand* o) const {
    const int bits = o->size;
    const uint64_t mask = bits == 64 ? ~0ull : (1ull << bits) - 1;
    if (is_imm(o)) return o->imm.value.u;  // sign-extended by Zydis; users mask to their width
    if (is_mem(o)) {
      uint64_t x = 0;
      std::memcpy(&x, reinterpret_cast<const void*>(address(rip, in, o)), size_t(bits / 8));
      return x;
    }
    if (!is_reg(o)) fail(rip, "operand kind");
    return gpr_[gpr_index(rip, o->reg.value)] & mask;
  }
  void write_int(uint64_t rip, const Insn& in, const ZydisDecodedOperand* o, uint64_t x) {
    const int bits = o->size;
    if (is_mem(o)) {
      std::memcpy(reinterpret_cast<void*>(address(rip, in, o)), &x, size_t(bits / 8));
      return;
    }
    if (!is_reg(o)) fail(rip, "operand kind");
    uint64_t& r = gpr_[gpr_index(rip, o->reg.value)];
    if (bits == 64)
      r = x;
    else if (bits == 32)
      r = x & 0xffffffffull;  // 32-bit writes zero the upper half
    else {
      const uint64_t mask = (1ull << bits) - 1;
      r = (r & ~mask) | (x & mask);
    }
  }

  // A vector source as `bytes` bytes (zero-filled to 64): a register, memory (an embedded
  // broadcast repeats its element) or, for xmm/ymm destinations of broadcasts, the low element.
  void read_vec(uint64_t rip, const Insn& in, const ZydisDecodedOperand* o, uint8_t* out,
                int bytes) const {
    std::memset(out, 0, 64);
    if (is_vreg(o)) {
      std::memcpy(out, v_[vid(o)], size_t(bytes));
      return;
    }
    if (!is_mem(o)) fail(rip, "vector operand kind");
    const uint8_t* p = reinterpret_cast<const uint8_t*>(address(rip, in, o));
    if (in.d.avx.broadcast.mode != ZYDIS_BROADCAST_MODE_INVALID &&
        !in.d.avx.broadcast.is_static) {  // an embedded {1toN}: one element repeated
      const int es = o->element_size / 8;
      for (int i = 0; i < bytes; i += es) std::memcpy(out + i, p, size_t(es));
      return;
    }
    std::memcpy(out, p, size_t(std::min(bytes, bytes_of(o))));
  }
  // Writes a VEX/EVEX destination: `bytes` bytes of the register, the rest up to 512 bits zeroed.
  void write_vreg(int id, const uint8_t* src, int bytes) {
    std::memcpy(v_[id], src, size_t(bytes));
    std::memset(v_[id] + bytes, 0, size_t(64 - bytes));
  }
  void write_vdst(uint64_t rip, const Insn& in, const ZydisDecodedOperand* o, const uint8_t* src,
                  int bytes) {
    if (in.mask) {  // EVEX masking of a register destination, element by element
      const int es = o->element_size / 8;
      if (!is_vreg(o) || (es != 1 && es != 2 && es != 4 && es != 8))
        fail(rip, "write masking is implemented for vector registers only");
      alignas(64) uint8_t m[64];
      std::memcpy(m, v_[vid(o)], 64);
      const uint64_t k = k_[in.mask];
      for (int i = 0; i < bytes / es; ++i) {
        if ((k >> i) & 1)
          std::memcpy(m + i * es, src + i * es, size_t(es));
        else if (in.zeroing)
          std::memset(m + i * es, 0, size_t(es));
      }
      write_vreg(vid(o), m, bytes);
      return;
    }
    if (in.zeroing) fail(rip, "zero-masking without a mask");
    if (is_vreg(o)) {
      write_vreg(vid(o), src, bytes);
      return;
    }
    if (!is_mem(o)) fail(rip, "vector destination kind");
    const uint64_t at = address(rip, in, o);
    std::memcpy(reinterpret_cast<void*>(at), src, size_t(bytes));
    if (opt_.on_vector_store) opt_.on_vector_store(at, bytes);
  }

  // ---- flags -------------------------------------------------------------------------------
  void logic_flags(uint64_t r, int bits) {
    const uint64_t mask = bits == 64 ? ~0ull : (1ull << bits) - 1;
    zf_ = (r & mask) == 0;
    sf_ = (r >> (bits - 1)) & 1;
    cf_ = of_ = false;
  }
  uint64_t add_flags(uint64_t a, uint64_t b, int bits, bool sub, bool keep_cf = false) {
    const uint64_t mask = bits == 64 ? ~0ull : (1ull << bits) - 1;
    a &= mask;
    b &= mask;
    const uint64_t r = (sub ? a - b : a + b) & mask;
    const int s = bits - 1;
    const bool sa = (a >> s) & 1, sb = (b >> s) & 1, sr = (r >> s) & 1;
    if (!keep_cf) cf_ = sub ? a < b : r < a;
    of_ = sub ? (sa != sb && sr != sa) : (sa == sb && sr != sa);
    zf_ = r == 0;
    sf_ = sr;
    return r;
  }
  bool cond(uint64_t rip, ZydisMnemonic m) const {
    switch (m) {
      case ZYDIS_MNEMONIC_JZ:
      case ZYDIS_MNEMONIC_CMOVZ: return zf_;
      case ZYDIS_MNEMONIC_JNZ:
      case ZYDIS_MNEMONIC_CMOVNZ: return !zf_;
      case ZYDIS_MNEMONIC_JL:
      case ZYDIS_MNEMONIC_CMOVL: return sf_ != of_;
      case ZYDIS_MNEMONIC_JNL:
      case ZYDIS_MNEMONIC_CMOVNL: return sf_ == of_;
      case ZYDIS_MNEMONIC_JLE:
      case ZYDIS_MNEMONIC_CMOVLE: return zf_ || sf_ != of_;
      case ZYDIS_MNEMONIC_JNLE:
      case ZYDIS_MNEMONIC_CMOVNLE: return !zf_ && sf_ == of_;
      case ZYDIS_MNEMONIC_JB:
      case ZYDIS_MNEMONIC_CMOVB: return cf_;
      case ZYDIS_MNEMONIC_JNB:
      case ZYDIS_MNEMONIC_CMOVNB: return !cf_;
      case ZYDIS_MNEMONIC_JBE:
      case ZYDIS_MNEMONIC_CMOVBE: return cf_ || zf_;
      case ZYDIS_MNEMONIC_JNBE:
      case ZYDIS_MNEMONIC_CMOVNBE: return !cf_ && !zf_;
      case ZYDIS_MNEMONIC_JS:
      case ZYDIS_MNEMONIC_CMOVS: return sf_;
      case ZYDIS_MNEMONIC_JNS:
      case ZYDIS_MNEMONIC_CMOVNS: return !sf_;
      case ZYDIS_MNEMONIC_JO: return of_;
      case ZYDIS_MNEMONIC_JNO: return !of_;
      default: fail(rip, "condition not implemented");
    }
  }

  // ---- one instruction ----------------------------------------------------------------------
  uint64_t step(uint64_t rip, EmuStats& st) {
    const Insn& in = decode(rip);
    const uint64_t next = rip + in.d.length;
    if (in.amx) {
      if (count_) ++st.mnemonics[amx::op_name(in.amx_op.op)];
      ++st.amx_instructions;
      if (opt_.on_amx) opt_.on_amx(in.amx_op);
      const amx::Fault f = tiles_.execute(in.amx_op, gpr_, next);
      if (f != amx::Fault::none) fail(rip, std::string("AMX fault ") + amx::fault_name(f));
      return next;
    }
    if (count_) ++st.mnemonics[ZydisMnemonicGetString(in.d.mnemonic)];
    if (trace_)
      std::fprintf(stderr, "emu %6llx %s\n",
                   static_cast<unsigned long long>(rip - reinterpret_cast<uint64_t>(code_)),
                   ZydisMnemonicGetString(in.d.mnemonic));
    if (in.d.mnemonic == ZYDIS_MNEMONIC_RET) {
      uint64_t target;
      std::memcpy(&target, reinterpret_cast<const void*>(gpr_[4]), 8);
      gpr_[4] += 8;
      return target;
    }
    if (in.d.meta.category == ZYDIS_CATEGORY_COND_BR)
      return cond(rip, in.d.mnemonic) ? next + uint64_t(in.op[0]->imm.value.s) : next;
    if (in.d.mnemonic == ZYDIS_MNEMONIC_JMP) {
      if (!is_imm(in.op[0])) return read_int(rip, in, in.op[0]);  // (a register or memory)
      return next + uint64_t(in.op[0]->imm.value.s);
    }
    if ((in.nops > 0 && is_vreg(in.op[0])) ||
        (in.nops > 1 && is_mem(in.op[0]) && is_vreg(in.op[1])) ||
        in.d.mnemonic == ZYDIS_MNEMONIC_VZEROUPPER ||
        (in.nops > 0 && is_reg(in.op[0]) && rclass(in.op[0]) == ZYDIS_REGCLASS_MASK)) {
      vector_op(rip, in);
      return next;
    }
    scalar_op(rip, in);
    return next;
  }

  void scalar_op(uint64_t rip, const Insn& in) {
    const auto* o = in.op;
    const int bits = in.nops ? o[0]->size : 64;
    switch (in.d.mnemonic) {
      case ZYDIS_MNEMONIC_NOP: return;
      case ZYDIS_MNEMONIC_PREFETCHT0:
      case ZYDIS_MNEMONIC_PREFETCHT1:
      case ZYDIS_MNEMONIC_PREFETCHT2:
      case ZYDIS_MNEMONIC_PREFETCHNTA:
        if (opt_.on_prefetch) opt_.on_prefetch(address(rip, in, o[0]));
        if (opt_.on_prefetch_hint)
          opt_.on_prefetch_hint(address(rip, in, o[0]),
                                in.d.mnemonic == ZYDIS_MNEMONIC_PREFETCHT0   ? 0
                                : in.d.mnemonic == ZYDIS_MNEMONIC_PREFETCHT1 ? 1
                                : in.d.mnemonic == ZYDIS_MNEMONIC_PREFETCHT2 ? 2
                                                                             : 3);
        return;
      case ZYDIS_MNEMONIC_MOV: write_int(rip, in, o[0], read_int(rip, in, o[1])); return;
      case ZYDIS_MNEMONIC_MOVSXD:
      case ZYDIS_MNEMONIC_MOVSX: {
        const int sb = o[1]->size;
        const uint64_t x = read_int(rip, in, o[1]);
        const uint64_t sx = (x ^ (1ull << (sb - 1))) - (1ull << (sb - 1));
        write_int(rip, in, o[0], sx);
        return;
      }
      case ZYDIS_MNEMONIC_MOVZX: write_int(rip, in, o[0], read_int(rip, in, o[1])); return;
      case ZYDIS_MNEMONIC_LEA: write_int(rip, in, o[0], address(rip, in, o[1])); return;
      case ZYDIS_MNEMONIC_ADD:
      case ZYDIS_MNEMONIC_SUB:
      case ZYDIS_MNEMONIC_CMP: {
        const bool sub = in.d.mnemonic != ZYDIS_MNEMONIC_ADD;
        const uint64_t r = add_flags(read_int(rip, in, o[0]), read_int(rip, in, o[1]), bits, sub);
        if (in.d.mnemonic != ZYDIS_MNEMONIC_CMP) write_int(rip, in, o[0], r);
        return;
      }
      case ZYDIS_MNEMONIC_INC:
      case ZYDIS_MNEMONIC_DEC:
        write_int(
            rip, in, o[0],
            add_flags(read_int(rip, in, o[0]), 1, bits, in.d.mnemonic == ZYDIS_MNEMONIC_DEC, true));
        return;
      case ZYDIS_MNEMONIC_NEG: {
        const uint64_t a = read_int(rip, in, o[0]);
        write_int(rip, in, o[0], add_flags(0, a, bits, true));
        return;
      }
      case ZYDIS_MNEMONIC_AND:
      case ZYDIS_MNEMONIC_OR:
      case ZYDIS_MNEMONIC_XOR:
      case ZYDIS_MNEMONIC_TEST: {
        const uint64_t a = read_int(rip, in, o[0]), b = read_int(rip, in, o[1]);
        const uint64_t r = in.d.mnemonic == ZYDIS_MNEMONIC_OR    ? a | b
                           : in.d.mnemonic == ZYDIS_MNEMONIC_XOR ? a ^ b
                                                                 : a & b;
        logic_flags(r, bits);
        if (in.d.mnemonic != ZYDIS_MNEMONIC_TEST) write_int(rip, in, o[0], r);
        return;
      }
      case ZYDIS_MNEMONIC_SHL:
      case ZYDIS_MNEMONIC_SHR:
      case ZYDIS_MNEMONIC_SAR: {
        const unsigned c = unsigned(read_int(rip, in, o[1])) & (bits == 64 ? 63 : 31);
        if (c == 0) return;  // flags unchanged
        const uint64_t mask = bits == 64 ? ~0ull : (1ull << bits) - 1;
        const uint64_t a = read_int(rip, in, o[0]);
        uint64_t r;
        if (in.d.mnemonic == ZYDIS_MNEMONIC_SHL) {
          r = (a << c) & mask;
          cf_ = c <= unsigned(bits) && ((a >> (bits - c)) & 1);
        } else if (in.d.mnemonic == ZYDIS_MNEMONIC_SHR) {
          r = a >> c;
          cf_ = (a >> (c - 1)) & 1;
        } else {
          const int64_t sa = int64_t(a << (64 - bits)) >> (64 - bits);
          r = uint64_t(sa >> c) & mask;
          cf_ = (uint64_t(sa) >> (c - 1)) & 1;
        }
        zf_ = r == 0;
        sf_ = (r >> (bits - 1)) & 1;
        of_ = false;
        write_int(rip, in, o[0], r);
        return;
      }
      case ZYDIS_MNEMONIC_IMUL: {
        if (in.nops < 2) fail(rip, "one-operand imul is not implemented");
        const ZydisDecodedOperand* s1 = in.nops == 3 ? o[1] : o[0];
        const ZydisDecodedOperand* s2 = in.nops == 3 ? o[2] : o[1];
        auto sx = [&](uint64_t x, int b) {
          return b == 64 ? int64_t(x) : int64_t(x << (64 - b)) >> (64 - b);
        };
        const __int128 p = __int128(sx(read_int(rip, in, s1), s1->size)) *
                           __int128(sx(read_int(rip, in, s2), s2->size));
        const int64_t r = sx(uint64_t(p), bits);
        cf_ = of_ = __int128(r) != p;
        write_int(rip, in, o[0], uint64_t(r));
        return;
      }
      case ZYDIS_MNEMONIC_DIV: {  // unsigned rdx:rax (edx:eax) / src -> rax quotient, rdx rest
        const ZydisDecodedOperand* src = o[0];
        const uint64_t d = read_int(rip, in, src);
        if (d == 0) fail(rip, "div by zero (#DE)");
        unsigned __int128 n;
        if (src->size == 64)
          n = (static_cast<unsigned __int128>(gpr_[2]) << 64) | gpr_[0];
        else if (src->size == 32)
          n = (uint64_t(uint32_t(gpr_[2])) << 32) | uint32_t(gpr_[0]);
        else
          fail(rip, "div of this width is not implemented");
        const unsigned __int128 q = n / d;
        if (q >> src->size) fail(rip, "div quotient overflow (#DE)");
        gpr_[0] = uint64_t(q);  // (a 32-bit result zeroes the upper halves)
        gpr_[2] = uint64_t(n % d);
        return;  // (the flags are undefined after div: left as they were)
      }
      case ZYDIS_MNEMONIC_PUSH:
        gpr_[4] -= 8;
        {
          const uint64_t x = read_int(rip, in, o[0]);
          std::memcpy(reinterpret_cast<void*>(gpr_[4]), &x, 8);
        }
        return;
      case ZYDIS_MNEMONIC_POP: {
        uint64_t x;
        std::memcpy(&x, reinterpret_cast<const void*>(gpr_[4]), 8);
        gpr_[4] += 8;
        write_int(rip, in, o[0], x);
        return;
      }
      default: break;
    }
    if (in.d.meta.category == ZYDIS_CATEGORY_CMOV) {
      if (cond(rip, in.d.mnemonic))
        write_int(rip, in, o[0], read_int(rip, in, o[1]));
      else
        write_int(rip, in, o[0], read_int(rip, in, o[0]));  // 32-bit cmov zeroes the upper half
      return;
    }
    fail(rip, std::string("instruction not implemented: ") + ZydisMnemonicGetString(in.d.mnemonic));
  }

  // ---- vector instructions ------------------------------------------------------------------
  void vector_op(uint64_t rip, const Insn& in) {
    const auto* o = in.op;
    const ZydisMnemonic mn = in.d.mnemonic;
    if (mn == ZYDIS_MNEMONIC_VZEROUPPER) {
      for (int i = 0; i < 16; ++i) std::memset(v_[i] + 16, 0, 48);
      return;
    }
    alignas(64) uint8_t a[64], b[64], c[64], r[64];
    std::memset(r, 0, 64);
    const int L = std::min(bytes_of(o[0]), 64);  // destination bytes (register or memory)
    // Two- and three-source forms read their sources at the destination's width.
    auto src = [&](int i, uint8_t* out) { read_vec(rip, in, o[i], out, L); };
    auto lanes32 = [&](auto f) {
      src(1, a);
      src(2, b);
      for (int i = 0; i < L / 4; ++i) f(i);
      write_vdst(rip, in, o[0], r, L);
    };
    switch (mn) {
      // moves and broadcasts
      case ZYDIS_MNEMONIC_VMOVUPS:
      case ZYDIS_MNEMONIC_VMOVAPS:
      case ZYDIS_MNEMONIC_VMOVDQU:
      case ZYDIS_MNEMONIC_VMOVDQA:
      case ZYDIS_MNEMONIC_VMOVDQU8:
      case ZYDIS_MNEMONIC_VMOVDQU16:
      case ZYDIS_MNEMONIC_VMOVDQU32:
      case ZYDIS_MNEMONIC_VMOVDQU64:
      case ZYDIS_MNEMONIC_VMOVDQA32:
      case ZYDIS_MNEMONIC_VMOVDQA64:
        src(1, r);
        write_vdst(rip, in, o[0], r, L);
        return;
      case ZYDIS_MNEMONIC_VMOVQ:    // the low qword (dword) to memory, or into a register whose
      case ZYDIS_MNEMONIC_VMOVD: {  // other bits it zeroes; not the general-register forms
        const int es = mn == ZYDIS_MNEMONIC_VMOVQ ? 8 : 4;
        if ((is_reg(o[0]) && !is_vreg(o[0])) || (is_reg(o[1]) && !is_vreg(o[1])))
          fail(rip, "vmovq / vmovd with a general register");
        read_vec(rip, in, o[1], a, es);
        if (in.mask) fail(rip, "write masking is not implemented for this instruction");
        if (is_vreg(o[0]))
          write_vreg(vid(o[0]), a, es);
        else
          std::memcpy(reinterpret_cast<void*>(address(rip, in, o[0])), a, size_t(es));
        return;
      }
      case ZYDIS_MNEMONIC_VPINSRB:  // xmm = src1 with element imm replaced (a general register
      case ZYDIS_MNEMONIC_VPINSRW:  // or memory), the bits above 128 zeroed
      case ZYDIS_MNEMONIC_VPINSRD:
      case ZYDIS_MNEMONIC_VPINSRQ: {
        const int es = mn == ZYDIS_MNEMONIC_VPINSRB   ? 1
                       : mn == ZYDIS_MNEMONIC_VPINSRW ? 2
                       : mn == ZYDIS_MNEMONIC_VPINSRD ? 4
                                                      : 8;
        read_vec(rip, in, o[1], a, 16);
        const uint64_t x = read_int(rip, in, o[2]);
        const int idx = int(o[3]->imm.value.u) & (16 / es - 1);
        std::memcpy(a + idx * es, &x, size_t(es));
        if (in.mask) fail(rip, "write masking is not implemented for this instruction");
        write_vreg(vid(o[0]), a, 16);
        return;
      }
      case ZYDIS_MNEMONIC_VBROADCASTSS:
      case ZYDIS_MNEMONIC_VPBROADCASTD:
      case ZYDIS_MNEMONIC_VPBROADCASTW:
      case ZYDIS_MNEMONIC_VPBROADCASTB:
      case ZYDIS_MNEMONIC_VPBROADCASTQ: {
        const int es = mn == ZYDIS_MNEMONIC_VPBROADCASTB   ? 1
                       : mn == ZYDIS_MNEMONIC_VPBROADCASTW ? 2
                       : mn == ZYDIS_MNEMONIC_VPBROADCASTQ ? 8
                                                           : 4;
        if (is_reg(o[1]) && !is_vreg(o[1])) fail(rip, "broadcast from a general register");
        read_vec(rip, in, o[1], a, is_vreg(o[1]) ? 16 : es);
        for (int i = 0; i < L; i += es) std::memcpy(r + i, a, size_t(es));
        write_vdst(rip, in, o[0], r, L);
        return;
      }
      case ZYDIS_MNEMONIC_VBROADCASTI32X4:  // a 128-bit block repeated
      case ZYDIS_MNEMONIC_VBROADCASTI128:
      case ZYDIS_MNEMONIC_VBROADCASTI64X4: {
        const int part = bytes_of(o[1]);
        read_vec(rip, in, o[1], a, part);
        for (int i = 0; i < L; i += part) std::memcpy(r + i, a, size_t(part));
        write_vdst(rip, in, o[0], r, L);
        return;
      }
      case ZYDIS_MNEMONIC_VEXTRACTI64X4:
      case ZYDIS_MNEMONIC_VEXTRACTI128:
      case ZYDIS_MNEMONIC_VEXTRACTF128:
      case ZYDIS_MNEMONIC_VEXTRACTF64X4: {
        const int src_bytes = bytes_of(o[1]);
        read_vec(rip, in, o[1], a, src_bytes);
        const int imm = int(o[2]->imm.value.u) & (src_bytes / L - 1);
        std::memcpy(r, a + imm * L, size_t(L));
        write_vdst(rip, in, o[0], r, L);
        return;
      }
      case ZYDIS_MNEMONIC_VINSERTI128:
      case ZYDIS_MNEMONIC_VINSERTF128:
      case ZYDIS_MNEMONIC_VINSERTI64X4:
      case ZYDIS_MNEMONIC_VINSERTF64X4: {
        src(1, r);
        const int part = bytes_of(o[2]);
        read_vec(rip, in, o[2], b, part);
        const int imm = int(o[3]->imm.value.u) & (L / part - 1);
        std::memcpy(r + imm * part, b, size_t(part));
        write_vdst(rip, in, o[0], r, L);
        return;
      }
      // widening moves (the source is a fraction of the destination)
      case ZYDIS_MNEMONIC_VPMOVSXBW:
      case ZYDIS_MNEMONIC_VPMOVZXBW:
        read_vec(rip, in, o[1], a, L / 2);
        for (int i = 0; i < L / 2 && i < 32; ++i)
          put<int16_t>(r, i,
                       mn == ZYDIS_MNEMONIC_VPMOVSXBW ? int16_t(int8_t(a[i])) : int16_t(a[i]));
        write_vdst(rip, in, o[0], r, L);
        return;
      case ZYDIS_MNEMONIC_VPMOVSXBD:
      case ZYDIS_MNEMONIC_VPMOVZXBD:
        read_vec(rip, in, o[1], a, L / 4);
        for (int i = 0; i < L / 4; ++i)
          put<int32_t>(r, i,
                       mn == ZYDIS_MNEMONIC_VPMOVSXBD ? int32_t(int8_t(a[i])) : int32_t(a[i]));
        write_vdst(rip, in, o[0], r, L);
        return;
      case ZYDIS_MNEMONIC_VPMOVSXWD:
      case ZYDIS_MNEMONIC_VPMOVZXWD:
        read_vec(rip, in, o[1], a, L / 2);
        for (int i = 0; i < L / 4; ++i)
          put<int32_t>(r, i,
                       mn == ZYDIS_MNEMONIC_VPMOVSXWD ? int32_t(get<int16_t>(a, i))
                                                      : int32_t(get<uint16_t>(a, i)));
        write_vdst(rip, in, o[0], r, L);
        return;
      case ZYDIS_MNEMONIC_VCVTPH2PS:
        read_vec(rip, in, o[1], a, L / 2);
        for (int i = 0; i < L / 4; ++i) put<float>(r, i, half_to_float(get<uint16_t>(a, i)));
        write_vdst(rip, in, o[0], r, L);
        return;
      // mask registers
      case ZYDIS_MNEMONIC_VPMOVB2M: {
        const int n = bytes_of(o[1]);
        read_vec(rip, in, o[1], a, n);
        uint64_t k = 0;
        for (int i = 0; i < n; ++i) k |= uint64_t(a[i] >> 7) << i;
        k_[vid(o[0])] = k;
        return;
      }
      case ZYDIS_MNEMONIC_VPMOVM2B: {
        const uint64_t k = k_[vid(o[1])];
        for (int i = 0; i < L; ++i) r[i] = (k >> i) & 1 ? 0xff : 0;
        write_vreg(vid(o[0]), r, L);
        return;
      }
      case ZYDIS_MNEMONIC_VPBLENDMB: {  // the mask selects: k[i] ? src2 : src1
        src(1, a);
        src(2, b);
        const uint64_t k = in.mask ? k_[in.mask] : ~0ull;
        for (int i = 0; i < L; ++i) r[i] = (k >> i) & 1 ? b[i] : a[i];
        write_vreg(vid(o[0]), r, L);
        return;
      }
      case ZYDIS_MNEMONIC_VPBLENDMW: {  // the mask selects word by word: k[i] ? src2 : src1
        src(1, a);
        src(2, b);
        const uint64_t k = in.mask ? k_[in.mask] : ~0ull;
        for (int i = 0; i < L / 2; ++i)
          put<uint16_t>(r, i, (k >> i) & 1 ? get<uint16_t>(b, i) : get<uint16_t>(a, i));
        write_vreg(vid(o[0]), r, L);
        return;
      }
      case ZYDIS_MNEMONIC_KMOVW:  // k = a general register's (or another mask's) low bits
      case ZYDIS_MNEMONIC_KMOVD:
      case ZYDIS_MNEMONIC_KMOVQ: {
        if (!is_reg(o[1]) || rclass(o[0]) != ZYDIS_REGCLASS_MASK)
          fail(rip, "kmov from or to memory, or to a general register");
        const int bits = mn == ZYDIS_MNEMONIC_KMOVW ? 16 : mn == ZYDIS_MNEMONIC_KMOVD ? 32 : 64;
        const uint64_t x =
            rclass(o[1]) == ZYDIS_REGCLASS_MASK ? k_[vid(o[1])] : read_int(rip, in, o[1]);
        k_[vid(o[0])] = bits == 64 ? x : x & ((1ull << bits) - 1);
        return;
      }
      case ZYDIS_MNEMONIC_KORTESTW:  // ZF: the or of the two masks is 0; CF: it is all ones
      case ZYDIS_MNEMONIC_KORTESTD:
      case ZYDIS_MNEMONIC_KORTESTQ: {
        const int bits = mn == ZYDIS_MNEMONIC_KORTESTW   ? 16
                         : mn == ZYDIS_MNEMONIC_KORTESTD ? 32
                                                         : 64;
        const uint64_t all = bits == 64 ? ~0ull : (1ull << bits) - 1;
        const uint64_t x = (k_[vid(o[0])] | k_[vid(o[1])]) & all;
        zf_ = x == 0;
        cf_ = x == all;
        sf_ = of_ = false;
        return;
      }
      case ZYDIS_MNEMONIC_VPTESTMB:  // k[i] = (a[i] & b[i]) != 0 (NM: == 0), under the write mask
      case ZYDIS_MNEMONIC_VPTESTMW:
      case ZYDIS_MNEMONIC_VPTESTNMB:
      case ZYDIS_MNEMONIC_VPTESTNMW: {
        const int n = bytes_of(o[1]);
        const int es = mn == ZYDIS_MNEMONIC_VPTESTMB || mn == ZYDIS_MNEMONIC_VPTESTNMB ? 1 : 2;
        const bool nm = mn == ZYDIS_MNEMONIC_VPTESTNMB || mn == ZYDIS_MNEMONIC_VPTESTNMW;
        read_vec(rip, in, o[1], a, n);
        read_vec(rip, in, o[2], b, n);
        uint64_t k = 0;
        for (int i = 0; i < n / es; ++i) {
          bool any = false;
          for (int j = 0; j < es; ++j) any |= (a[i * es + j] & b[i * es + j]) != 0;
          if (any != nm) k |= 1ull << i;
        }
        k_[vid(o[0])] = in.mask ? k & k_[in.mask] : k;
        return;
      }
      case ZYDIS_MNEMONIC_VPCMPUB: {  // k[i] = a[i] (predicate imm) b[i], unsigned bytes
        const int n = bytes_of(o[1]);
        read_vec(rip, in, o[1], a, n);
        read_vec(rip, in, o[2], b, n);
        const int pred = int(o[3]->imm.value.u) & 7;
        uint64_t k = 0;
        for (int i = 0; i < n; ++i) {
          const bool lt = a[i] < b[i], eq = a[i] == b[i];
          const bool t = pred == 0   ? eq
                         : pred == 1 ? lt
                         : pred == 2 ? lt || eq
                         : pred == 3 ? false
                         : pred == 4 ? !eq
                         : pred == 5 ? !lt
                         : pred == 6 ? !lt && !eq
                                     : true;
          if (t) k |= 1ull << i;
        }
        k_[vid(o[0])] = in.mask ? k & k_[in.mask] : k;
        return;
      }
      case ZYDIS_MNEMONIC_VPBLENDW: {  // VEX: word i of each 128-bit lane from src2 where imm bit i
        src(1, a);
        src(2, b);
        const unsigned imm = unsigned(o[3]->imm.value.u) & 0xff;
        for (int i = 0; i < L / 2; ++i) {
          const bool take = (imm >> (i % 8)) & 1;
          r[2 * i] = take ? b[2 * i] : a[2 * i];
          r[2 * i + 1] = take ? b[2 * i + 1] : a[2 * i + 1];
        }
        write_vdst(rip, in, o[0], r, L);
        return;
      }
      case ZYDIS_MNEMONIC_VPBLENDVB:  // AVX2: the sign of each byte of the fourth operand selects
        src(1, a);
        src(2, b);
        src(3, c);
        for (int i = 0; i < L; ++i) r[i] = (c[i] & 0x80) ? b[i] : a[i];
        write_vdst(rip, in, o[0], r, L);
        return;
      // bitwise
      case ZYDIS_MNEMONIC_VPXOR:
      case ZYDIS_MNEMONIC_VPXORD:
      case ZYDIS_MNEMONIC_VPXORQ:
      case ZYDIS_MNEMONIC_VXORPS:
        src(1, a);
        src(2, b);
        for (int i = 0; i < L; ++i) r[i] = a[i] ^ b[i];
        write_vdst(rip, in, o[0], r, L);
        return;
      case ZYDIS_MNEMONIC_VPAND:
      case ZYDIS_MNEMONIC_VPANDD:
      case ZYDIS_MNEMONIC_VPANDQ:
      case ZYDIS_MNEMONIC_VANDPS:
        src(1, a);
        src(2, b);
        for (int i = 0; i < L; ++i) r[i] = a[i] & b[i];
        write_vdst(rip, in, o[0], r, L);
        return;
      case ZYDIS_MNEMONIC_VPANDN:
      case ZYDIS_MNEMONIC_VPANDND:
      case ZYDIS_MNEMONIC_VANDNPS:
        src(1, a);
        src(2, b);
        for (int i = 0; i < L; ++i) r[i] = uint8_t(~a[i] & b[i]);
        write_vdst(rip, in, o[0], r, L);
        return;
      case ZYDIS_MNEMONIC_VPOR:
      case ZYDIS_MNEMONIC_VPORD:
      case ZYDIS_MNEMONIC_VPORQ:
      case ZYDIS_MNEMONIC_VORPS:
        src(1, a);
        src(2, b);
        for (int i = 0; i < L; ++i) r[i] = a[i] | b[i];
        write_vdst(rip, in, o[0], r, L);
        return;
      case ZYDIS_MNEMONIC_VPTERNLOGD: {  // bit i of each result: imm[(dst << 2) | (src1 << 1) |
                                         // src2]
        src(0, c);
        src(1, a);
        src(2, b);
        const unsigned imm = unsigned(o[3]->imm.value.u);
        for (int i = 0; i < L; ++i) {
          uint8_t x = 0;
          for (int bit = 0; bit < 8; ++bit) {
            const unsigned idx =
                ((c[i] >> bit) & 1) << 2 | ((a[i] >> bit) & 1) << 1 | ((b[i] >> bit) & 1);
            x |= uint8_t(((imm >> idx) & 1) << bit);
          }
          r[i] = x;
        }
        write_vdst(rip, in, o[0], r, L);
        return;
      }
      // integer arithmetic
      case ZYDIS_MNEMONIC_VPADDB:
      case ZYDIS_MNEMONIC_VPSUBB:
        src(1, a);
        src(2, b);
        for (int i = 0; i < L; ++i)
          r[i] = uint8_t(mn == ZYDIS_MNEMONIC_VPADDB ? a[i] + b[i] : a[i] - b[i]);
        write_vdst(rip, in, o[0], r, L);
        return;
      case ZYDIS_MNEMONIC_VPADDW:
      case ZYDIS_MNEMONIC_VPSUBW:
        src(1, a);
        src(2, b);
        for (int i = 0; i < L / 2; ++i)
          put<uint16_t>(
              r, i,
              uint16_t(mn == ZYDIS_MNEMONIC_VPADDW ? get<uint16_t>(a, i) + get<uint16_t>(b, i)
                                                   : get<uint16_t>(a, i) - get<uint16_t>(b, i)));
        write_vdst(rip, in, o[0], r, L);
        return;
      case ZYDIS_MNEMONIC_VPMAXSW:
      case ZYDIS_MNEMONIC_VPMINSW:
        src(1, a);
        src(2, b);
        for (int i = 0; i < L / 2; ++i) {
          const int16_t x = int16_t(get<uint16_t>(a, i)), y = int16_t(get<uint16_t>(b, i));
          const bool take_x = mn == ZYDIS_MNEMONIC_VPMAXSW ? x > y : x < y;
          put<uint16_t>(r, i, uint16_t(take_x ? x : y));
        }
        write_vdst(rip, in, o[0], r, L);
        return;
      case ZYDIS_MNEMONIC_VPADDD:
      case ZYDIS_MNEMONIC_VPSUBD:
        lanes32([&](int i) {
          const uint32_t x = get<uint32_t>(a, i), y = get<uint32_t>(b, i);
          put<uint32_t>(r, i, mn == ZYDIS_MNEMONIC_VPADDD ? x + y : x - y);
        });
        return;
      case ZYDIS_MNEMONIC_VPMULLD:
        lanes32([&](int i) { put<uint32_t>(r, i, get<uint32_t>(a, i) * get<uint32_t>(b, i)); });
        return;
      case ZYDIS_MNEMONIC_VPABSB:
        src(1, a);
        for (int i = 0; i < L; ++i) r[i] = uint8_t(std::abs(int(int8_t(a[i]))));
        write_vdst(rip, in, o[0], r, L);
        return;
      case ZYDIS_MNEMONIC_VPSIGNB:
        src(1, a);
        src(2, b);
        for (int i = 0; i < L; ++i) {
          const int8_t s = int8_t(b[i]);
          r[i] = s < 0 ? uint8_t(-int(int8_t(a[i]))) : s == 0 ? 0 : a[i];
        }
        write_vdst(rip, in, o[0], r, L);
        return;
      case ZYDIS_MNEMONIC_VPSIGNW:  // src1 negated where src2 < 0, zeroed where src2 == 0
        src(1, a);
        src(2, b);
        for (int i = 0; i < L / 2; ++i) {
          const int16_t sg = get<int16_t>(b, i), x = get<int16_t>(a, i);
          put<int16_t>(r, i, sg < 0 ? int16_t(-int32_t(x)) : sg == 0 ? int16_t(0) : x);
        }
        write_vdst(rip, in, o[0], r, L);
        return;
      case ZYDIS_MNEMONIC_VPSIGND:
        lanes32([&](int i) {
          const int32_t sg = get<int32_t>(b, i), x = get<int32_t>(a, i);
          put<int32_t>(r, i, sg < 0 ? int32_t(0u - uint32_t(x)) : sg == 0 ? 0 : x);
        });
        return;
      case ZYDIS_MNEMONIC_VPMADDUBSW:  // u8 (src1) x s8 (src2), adjacent pairs, saturated to s16
        src(1, a);
        src(2, b);
        for (int i = 0; i < L / 2; ++i)
          put<int16_t>(r, i,
                       int16_t(sat16(int(a[2 * i]) * int8_t(b[2 * i]) +
                                     int(a[2 * i + 1]) * int8_t(b[2 * i + 1]))));
        write_vdst(rip, in, o[0], r, L);
        return;
      case ZYDIS_MNEMONIC_VPMADDWD:
        lanes32([&](int i) {
          const int64_t s = int64_t(get<int16_t>(a, 2 * i)) * get<int16_t>(b, 2 * i) +
                            int64_t(get<int16_t>(a, 2 * i + 1)) * get<int16_t>(b, 2 * i + 1);
          put<uint32_t>(r, i, uint32_t(s));
        });
        return;
      case ZYDIS_MNEMONIC_VPDPBUSD:  // acc += sum of 4 u8 (src1) x s8 (src2), wrapping
        src(0, c);
        lanes32([&](int i) {
          int32_t s = 0;
          for (int j = 0; j < 4; ++j) s += int32_t(a[4 * i + j]) * int8_t(b[4 * i + j]);
          put<uint32_t>(r, i, get<uint32_t>(c, i) + uint32_t(s));
        });
        return;
      case ZYDIS_MNEMONIC_VPDPWSSD:  // acc += sum of 2 s16 x s16, wrapping
        src(0, c);
        lanes32([&](int i) {
          const int64_t s = int64_t(get<int16_t>(a, 2 * i)) * get<int16_t>(b, 2 * i) +
                            int64_t(get<int16_t>(a, 2 * i + 1)) * get<int16_t>(b, 2 * i + 1);
          put<uint32_t>(r, i, get<uint32_t>(c, i) + uint32_t(s));
        });
        return;
      // shifts by an immediate (or by xmm count for the AVX2 forms)
      case ZYDIS_MNEMONIC_VPSLLW:
      case ZYDIS_MNEMONIC_VPSRLW:
      case ZYDIS_MNEMONIC_VPSRAW:
      case ZYDIS_MNEMONIC_VPSLLD:
      case ZYDIS_MNEMONIC_VPSRLD:
      case ZYDIS_MNEMONIC_VPSRAD:
      case ZYDIS_MNEMONIC_VPSLLQ:
      case ZYDIS_MNEMONIC_VPSRLQ: {
        src(1, a);
        uint64_t cnt;
        if (is_imm(o[2])) {
          cnt = o[2]->imm.value.u & 0xff;
        } else {
          read_vec(rip, in, o[2], b, 16);
          cnt = get<uint64_t>(b, 0);
        }
        const bool w = mn == ZYDIS_MNEMONIC_VPSLLW || mn == ZYDIS_MNEMONIC_VPSRLW ||
                       mn == ZYDIS_MNEMONIC_VPSRAW;
        const bool q = mn == ZYDIS_MNEMONIC_VPSLLQ || mn == ZYDIS_MNEMONIC_VPSRLQ;
        const bool left = mn == ZYDIS_MNEMONIC_VPSLLW || mn == ZYDIS_MNEMONIC_VPSLLD ||
                          mn == ZYDIS_MNEMONIC_VPSLLQ;
        const bool arith = mn == ZYDIS_MNEMONIC_VPSRAW || mn == ZYDIS_MNEMONIC_VPSRAD;
        const int eb = w ? 16 : q ? 64 : 32;
        for (int i = 0; i < L * 8 / eb; ++i) {
          uint64_t x = w ? get<uint16_t>(a, i) : q ? get<uint64_t>(a, i) : get<uint32_t>(a, i);
          if (arith) {
            const int64_t sx = int64_t(x << (64 - eb)) >> (64 - eb);
            x = uint64_t(sx >> (cnt >= uint64_t(eb) ? eb - 1 : cnt));
          } else if (cnt >= uint64_t(eb)) {
            x = 0;
          } else {
            x = left ? x << cnt : x >> cnt;
          }
          if (w)
            put<uint16_t>(r, i, uint16_t(x));
          else if (q)
            put<uint64_t>(r, i, x);
          else
            put<uint32_t>(r, i, uint32_t(x));
        }
        write_vdst(rip, in, o[0], r, L);
        return;
      }
      // permutes and unpacks
      case ZYDIS_MNEMONIC_VPERMPS:
      case ZYDIS_MNEMONIC_VPERMD:  // dst[i] = table (src2)[index (src1)[i] mod n]
        lanes32([&](int i) {
          put<uint32_t>(r, i, get<uint32_t>(b, int(get<uint32_t>(a, i) % uint32_t(L / 4))));
        });
        return;
      case ZYDIS_MNEMONIC_VPERMW:
        src(1, a);
        src(2, b);
        for (int i = 0; i < L / 2; ++i)
          put<uint16_t>(r, i, get<uint16_t>(b, int(get<uint16_t>(a, i) % uint16_t(L / 2))));
        write_vdst(rip, in, o[0], r, L);
        return;
      case ZYDIS_MNEMONIC_VPERMI2B:  // dst is the index: byte id selects src1 (table 0) or src2
        src(0, c);
        src(1, a);
        src(2, b);
        for (int i = 0; i < L; ++i) {
          const int id = c[i] & (L - 1);
          r[i] = (c[i] & L) ? b[id] : a[id];
        }
        write_vdst(rip, in, o[0], r, L);
        return;
      case ZYDIS_MNEMONIC_VPSHUFB:  // within each 128-bit lane
        src(1, a);
        src(2, b);
        for (int i = 0; i < L; ++i) r[i] = (b[i] & 0x80) ? 0 : a[(i & ~15) + (b[i] & 15)];
        write_vdst(rip, in, o[0], r, L);
        return;
      case ZYDIS_MNEMONIC_VPUNPCKLBW:
      case ZYDIS_MNEMONIC_VPUNPCKHBW: {
        src(1, a);
        src(2, b);
        const int h = mn == ZYDIS_MNEMONIC_VPUNPCKHBW ? 8 : 0;
        for (int lane = 0; lane < L; lane += 16)
          for (int i = 0; i < 8; ++i) {
            r[lane + 2 * i] = a[lane + h + i];
            r[lane + 2 * i + 1] = b[lane + h + i];
          }
        write_vdst(rip, in, o[0], r, L);
        return;
      }
      // float arithmetic
      case ZYDIS_MNEMONIC_VADDPS:
      case ZYDIS_MNEMONIC_VSUBPS:
      case ZYDIS_MNEMONIC_VMULPS:
      case ZYDIS_MNEMONIC_VDIVPS:
      case ZYDIS_MNEMONIC_VMINPS:
      case ZYDIS_MNEMONIC_VMAXPS:
        lanes32([&](int i) {
          const float x = get<float>(a, i), y = get<float>(b, i);
          float z;
          switch (mn) {
            case ZYDIS_MNEMONIC_VADDPS: z = x + y; break;
            case ZYDIS_MNEMONIC_VSUBPS: z = x - y; break;
            case ZYDIS_MNEMONIC_VMULPS: z = x * y; break;
            case ZYDIS_MNEMONIC_VDIVPS: z = x / y; break;
            case ZYDIS_MNEMONIC_VMINPS:  // SDM: the second source unless src1 < src2 (NaN, +-0)
              z = x < y ? x : y;
              break;
            default: z = x > y ? x : y; break;
          }
          put<float>(r, i, z);
        });
        return;
      case ZYDIS_MNEMONIC_VFMADD231PS:  // dst = src1 * src2 + dst, one rounding
      case ZYDIS_MNEMONIC_VFMADD213PS:  // dst = src1 * dst + src2
      case ZYDIS_MNEMONIC_VFMADD132PS:  // dst = dst * src2 + src1
      case ZYDIS_MNEMONIC_VFNMADD231PS:
        src(0, c);
        lanes32([&](int i) {
          const float d = get<float>(c, i), x = get<float>(a, i), y = get<float>(b, i);
          float z;
          if (mn == ZYDIS_MNEMONIC_VFMADD231PS)
            z = std::fma(x, y, d);
          else if (mn == ZYDIS_MNEMONIC_VFMADD213PS)
            z = std::fma(x, d, y);
          else if (mn == ZYDIS_MNEMONIC_VFMADD132PS)
            z = std::fma(d, y, x);
          else
            z = std::fma(-x, y, d);
          put<float>(r, i, z);
        });
        return;
      case ZYDIS_MNEMONIC_VDPBF16PS:
        src(0, c);
        lanes32([&](int i) {
          put<float>(r, i, dpbf16_lane(get<float>(c, i), get<uint32_t>(a, i), get<uint32_t>(b, i)));
        });
        return;
      case ZYDIS_MNEMONIC_VCVTDQ2PS:
        src(1, a);
        for (int i = 0; i < L / 4; ++i) put<float>(r, i, float(get<int32_t>(a, i)));
        write_vdst(rip, in, o[0], r, L);
        return;
      case ZYDIS_MNEMONIC_VCVTPS2DQ:
      case ZYDIS_MNEMONIC_VCVTTPS2DQ:
        src(1, a);
        for (int i = 0; i < L / 4; ++i) {
          const float x = get<float>(a, i);
          const float t = mn == ZYDIS_MNEMONIC_VCVTPS2DQ ? std::nearbyint(x) : std::trunc(x);
          // out of range or NaN: the integer indefinite 0x80000000
          const int32_t v = (t >= -2147483648.0f && t < 2147483648.0f) ? int32_t(t) : INT32_MIN;
          put<int32_t>(r, i, v);
        }
        write_vdst(rip, in, o[0], r, L);
        return;
      case ZYDIS_MNEMONIC_VRNDSCALEPS:
      case ZYDIS_MNEMONIC_VROUNDPS: {
        src(1, a);
        const unsigned imm = unsigned(o[2]->imm.value.u);
        if (imm >> 4) fail(rip, "vrndscaleps with a scale is not implemented");
        const unsigned mode = (imm & 4) ? 0 : imm & 3;  // imm[2]: MXCSR.RC (nearest here)
        for (int i = 0; i < L / 4; ++i) {
          const float x = get<float>(a, i);
          float z = mode == 0   ? std::nearbyint(x)
                    : mode == 1 ? std::floor(x)
                    : mode == 2 ? std::ceil(x)
                                : std::trunc(x);
          if (std::isnan(x)) z = u2f(f2u(x) | 0x400000u);
          put<float>(r, i, z);
        }
        write_vdst(rip, in, o[0], r, L);
        return;
      }
      default: break;
    }
    fail(rip, std::string("vector instruction not implemented: ") + ZydisMnemonicGetString(mn));
  }

  const uint8_t* code_;
  size_t size_;
  std::vector<Insn> cache_;
  bool count_;
  const EmuOptions& opt_;
  bool trace_ = std::getenv("KT_JIT_EMU_TRACE") != nullptr;  // each instruction to stderr
  ZydisDecoder dec_;
  uint64_t gpr_[16];
  alignas(64) uint8_t v_[32][64];
  uint64_t k_[8];
  bool zf_ = false, sf_ = false, cf_ = false, of_ = false;
  amx::TileMachine tiles_;
  std::vector<uint8_t> stack_;
};

}  // namespace

EmuStats emulate_x64(const uint8_t* code, size_t size, const void* arg0,
                     const EmuOptions& options) {
  auto m = std::make_unique<Machine>(code, size, options);
  return m->run(arg0, options.max_instructions);
}

}  // namespace ktjit::test
