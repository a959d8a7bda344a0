// Software model of the AMX tile state (palette 1) and a decoder for the AMX instructions, after
// Intel's ISA reference (SDM vol. 2, "LDTILECFG", "TILELOADD", "TDPBUSD/TDPBSSD/...",
// "TDPBF16PS"). Used by the tests to execute generated AMX kernels on machines without AMX.
#include "jit/amx_model.hpp"

#include <cmath>
#include <cstdio>
#include <cstring>

#include "jit/bits.hpp"

namespace ktjit::amx {

const char* op_name(Op op) {
  switch (op) {
    case Op::ldtilecfg: return "ldtilecfg";
    case Op::sttilecfg: return "sttilecfg";
    case Op::tilerelease: return "tilerelease";
    case Op::tilezero: return "tilezero";
    case Op::tileloadd: return "tileloadd";
    case Op::tileloaddt1: return "tileloaddt1";
    case Op::tilestored: return "tilestored";
    case Op::tdpbssd: return "tdpbssd";
    case Op::tdpbsud: return "tdpbsud";
    case Op::tdpbusd: return "tdpbusd";
    case Op::tdpbuud: return "tdpbuud";
    case Op::tdpbf16ps: return "tdpbf16ps";
  }
  return "?";
}

const char* gpr_name(int r) {
  static const char* const names[17] = {"rax", "rcx", "rdx", "rbx", "rsp", "rbp",
                                        "rsi", "rdi", "r8",  "r9",  "r10", "r11",
                                        "r12", "r13", "r14", "r15", "rip"};
  return r >= 0 && r <= 16 ? names[r] : "?";
}

const char* fault_name(Fault f) {
  switch (f) {
    case Fault::none: return "none";
    case Fault::gp_bad_config: return "#GP: invalid tile configuration";
    case Fault::ud_not_configured: return "#UD: tiles not configured";
    case Fault::ud_tile_shape: return "#UD: tile shapes do not match";
    case Fault::ud_same_tiles: return "#UD: repeated tile operand";
    case Fault::not_amx: return "not an AMX instruction";
  }
  return "?";
}

namespace {
std::string tmm(int t) {
  return "tmm" + std::to_string(t);
}

std::string mem_text(const AmxOp& o) {
  std::string s = "[";
  bool any = false;
  if (o.base != kNoReg) {
    s += gpr_name(o.base);
    any = true;
  }
  if (o.index != kNoReg) {
    s += std::string(any ? "+" : "") + gpr_name(o.index) + "*" + std::to_string(o.scale);
    any = true;
  }
  if (o.disp != 0 || !any) {
    char b[32];
    const int64_t d = o.disp;
    std::snprintf(b, sizeof b, "%s0x%llx", d < 0 ? "-" : (any ? "+" : ""),
                  static_cast<unsigned long long>(d < 0 ? -d : d));
    s += b;
  }
  return s + "]";
}
}  // namespace

std::string AmxOp::text() const {
  std::string s = op_name(op);
  switch (op) {
    case Op::tilerelease: return s;
    case Op::ldtilecfg:
    case Op::sttilecfg: return s + " " + mem_text(*this);
    case Op::tilezero: return s + " " + tmm(t0);
    case Op::tileloadd:
    case Op::tileloaddt1: return s + " " + tmm(t0) + "," + mem_text(*this);
    case Op::tilestored: return s + " " + mem_text(*this) + "," + tmm(t0);
    default: return s + " " + tmm(t0) + "," + tmm(t1) + "," + tmm(t2);
  }
}

bool AmxOp::same_instruction(const AmxOp& o) const {
  return op == o.op && offset == o.offset && length == o.length && t0 == o.t0 && t1 == o.t1 &&
         t2 == o.t2 && has_mem == o.has_mem && base == o.base && index == o.index &&
         scale == o.scale && disp == o.disp;
}

bool decode_amx(const uint8_t* p, AmxOp* out) {
  if (p[0] != 0xc4) return false;
  const uint8_t b1 = p[1], b2 = p[2];
  if ((b1 & 0x1f) != 2) return false;  // map 0F38
  const int R = (~b1 >> 7) & 1, X = (~b1 >> 6) & 1, B = (~b1 >> 5) & 1;
  const int W = b2 >> 7, vvvv = (~b2 >> 3) & 15, L = (b2 >> 2) & 1, pp = b2 & 3;
  if (W || L) return false;
  const uint8_t opc = p[3], modrm = p[4];
  const int mod = modrm >> 6, reg = ((modrm >> 3) & 7) | (R << 3), rm = (modrm & 7) | (B << 3);
  AmxOp o;
  size_t len = 5;
  if (mod != 3) {
    o.has_mem = true;
    if ((modrm & 7) == 4) {
      const uint8_t sib = p[len++];
      o.scale = 1 << (sib >> 6);
      const int idx = ((sib >> 3) & 7) | (X << 3);
      o.index = idx == 4 ? kNoReg : idx;
      const int base = (sib & 7) | (B << 3);
      o.base = ((sib & 7) == 5 && mod == 0) ? kNoReg : base;
      if ((sib & 7) == 5 && mod == 0) {
        int32_t d;
        std::memcpy(&d, p + len, 4);
        o.disp = d;
        len += 4;
      }
    } else if (mod == 0 && (modrm & 7) == 5) {
      o.base = kRip;
      int32_t d;
      std::memcpy(&d, p + len, 4);
      o.disp = d;
      len += 4;
    } else {
      o.base = rm;
    }
    if (mod == 1) {
      o.disp = int8_t(p[len]);
      len += 1;
    } else if (mod == 2) {
      int32_t d;
      std::memcpy(&d, p + len, 4);
      o.disp = d;
      len += 4;
    }
  }
  const bool sib_mem = o.has_mem && (modrm & 7) == 4;
  switch (opc) {
    case 0x49:
      if (pp == 0 && mod == 3 && modrm == 0xc0 && vvvv == 0 && !R && !B) {
        o.op = Op::tilerelease;
      } else if ((pp == 0 || pp == 1) && mod != 3 && (modrm & 0x38) == 0 && !R && vvvv == 0) {
        o.op = pp == 0 ? Op::ldtilecfg : Op::sttilecfg;
      } else if (pp == 3 && mod == 3 && (modrm & 7) == 0 && reg < 8 && vvvv == 0 && !B) {
        o.op = Op::tilezero;
        o.t0 = reg;
      } else {
        return false;
      }
      break;
    case 0x4b:
      if (mod == 3 || !sib_mem || reg >= 8 || vvvv != 0 || pp == 0) return false;
      o.op = pp == 3 ? Op::tileloadd : pp == 1 ? Op::tileloaddt1 : Op::tilestored;
      o.t0 = reg;
      break;
    case 0x5e:
    case 0x5c: {
      if (mod != 3 || reg >= 8 || rm >= 8 || vvvv >= 8) return false;
      static const Op int_ops[4] = {Op::tdpbuud, Op::tdpbusd, Op::tdpbsud, Op::tdpbssd};
      if (opc == 0x5e)
        o.op = int_ops[pp];
      else if (pp == 2)
        o.op = Op::tdpbf16ps;
      else
        return false;
      o.t0 = reg;
      o.t1 = rm;
      o.t2 = vvvv;
      break;
    }
    default: return false;
  }
  o.length = uint32_t(len);
  *out = o;
  return true;
}

uint64_t TileMachine::address(const AmxOp& op, const uint64_t gpr[16], uint64_t next_rip, int row) {
  uint64_t a = op.base == kRip ? next_rip : op.base == kNoReg ? 0 : gpr[op.base];
  a += uint64_t(int64_t(op.disp));
  if (op.index != kNoReg) a += uint64_t(row) * gpr[op.index] * uint64_t(op.scale);
  return a;
}

void TileMachine::zero_all() {
  std::memset(data_, 0, sizeof data_);
}

Fault TileMachine::load_config(const uint8_t* m) {
  TileConfig c;
  c.palette = m[0];
  c.start_row = m[1];
  if (c.palette == 0) {  // palette 0: the init state
    cfg_ = TileConfig{};
    zero_all();
    return Fault::none;
  }
  if (c.palette != 1) return Fault::gp_bad_config;
  for (int i = 2; i < 16; ++i)
    if (m[i]) return Fault::gp_bad_config;
  for (int t = 0; t < 16; ++t) {
    uint16_t colsb;
    std::memcpy(&colsb, m + 16 + 2 * t, 2);
    const uint8_t rows = m[48 + t];
    if (t >= kTiles) {
      if (colsb || rows) return Fault::gp_bad_config;
      continue;
    }
    if (colsb > kMaxColsb || rows > kMaxRows) return Fault::gp_bad_config;
    if ((colsb == 0) != (rows == 0)) return Fault::gp_bad_config;
    c.colsb[t] = colsb;
    c.rows[t] = rows;
  }
  cfg_ = c;
  cfg_.start_row = 0;
  zero_all();
  return Fault::none;
}

namespace {
float f32_of(uint32_t u) {
  return f32_from_bits(u);
}
uint32_t bits_of(float f) {
  return f32_to_bits(f);
}
// DAZ / FTZ: a subnormal becomes a zero of the same sign.
float flush(float x) {
  const uint32_t u = bits_of(x);
  return (u & 0x7f800000u) == 0 ? f32_of(u & 0x80000000u) : x;
}
float bf16_to_f32(uint16_t h) {
  return f32_of(uint32_t(h) << 16);
}
}  // namespace

float tdpbf16ps_element(float dest, const uint16_t* a, const uint16_t* b, int b_stride, int k) {
  float even = 0.0f, odd = 0.0f;
  for (int i = 0; i < k; ++i) {
    even = flush(
        std::fma(flush(bf16_to_f32(a[2 * i])), flush(bf16_to_f32(b[i * b_stride])), flush(even)));
    odd = flush(std::fma(flush(bf16_to_f32(a[2 * i + 1])), flush(bf16_to_f32(b[i * b_stride + 1])),
                         flush(odd)));
  }
  const float sum = flush(flush(even) + flush(odd));
  return flush(flush(dest) + sum);
}

Fault TileMachine::execute(const AmxOp& op, const uint64_t gpr[16], uint64_t next_rip) {
  auto mem = [&](int row) { return reinterpret_cast<uint8_t*>(address(op, gpr, next_rip, row)); };
  switch (op.op) {
    case Op::ldtilecfg: {
      ++counters.ldtilecfg;
      return load_config(mem(0));
    }
    case Op::tilerelease:
      ++counters.tilerelease;
      cfg_ = TileConfig{};
      zero_all();
      return Fault::none;
    case Op::sttilecfg: {
      uint8_t out[64] = {};
      out[0] = cfg_.palette;
      out[1] = cfg_.start_row;
      for (int t = 0; t < kTiles; ++t) {
        std::memcpy(out + 16 + 2 * t, &cfg_.colsb[t], 2);
        out[48 + t] = cfg_.rows[t];
      }
      std::memcpy(mem(0), out, 64);
      return Fault::none;
    }
    default: break;
  }
  if (!configured()) return Fault::ud_not_configured;
  const int t0 = op.t0;
  if (t0 < 0 || t0 >= kTiles || cfg_.rows[t0] == 0) return Fault::ud_tile_shape;
  const int rows = cfg_.rows[t0], colsb = cfg_.colsb[t0];
  uint8_t* T = data_[t0];
  switch (op.op) {
    case Op::tilezero:
      ++counters.tilezero;
      std::memset(T, 0, sizeof data_[0]);
      return Fault::none;
    case Op::tileloadd:
    case Op::tileloaddt1:
      ++counters.loads;
      std::memset(T, 0, sizeof data_[0]);
      for (int r = 0; r < rows; ++r) std::memcpy(T + r * kMaxColsb, mem(r), size_t(colsb));
      return Fault::none;
    case Op::tilestored:
      ++counters.stores;
      for (int r = 0; r < rows; ++r) std::memcpy(mem(r), T + r * kMaxColsb, size_t(colsb));
      return Fault::none;
    default: break;
  }
  // TDP*: t0 (m x n) += t1 (m x k pairs) * t2 (k x n pairs)
  const int t1 = op.t1, t2 = op.t2;
  if (t1 < 0 || t1 >= kTiles || t2 < 0 || t2 >= kTiles) return Fault::ud_tile_shape;
  if (t0 == t1 || t0 == t2 || t1 == t2) return Fault::ud_same_tiles;
  if (cfg_.rows[t1] == 0 || cfg_.rows[t2] == 0) return Fault::ud_tile_shape;
  if (cfg_.colsb[t1] != 4 * cfg_.rows[t2] || colsb != cfg_.colsb[t2] || rows != cfg_.rows[t1])
    return Fault::ud_tile_shape;
  ++counters.dp;
  const int K = cfg_.colsb[t1] / 4, N = colsb / 4;
  const uint8_t* A = data_[t1];
  const uint8_t* Bt = data_[t2];
  uint8_t out[kMaxRows * kMaxColsb] = {};
  for (int m = 0; m < rows; ++m)
    for (int n = 0; n < N; ++n) {
      const uint8_t* c = T + m * kMaxColsb + 4 * n;
      if (op.op == Op::tdpbf16ps) {
        float d;
        std::memcpy(&d, c, 4);
        uint16_t a[2 * kMaxColsb / 4], b[2 * kMaxRows];
        std::memcpy(a, A + m * kMaxColsb, size_t(4 * K));
        for (int k = 0; k < K; ++k) std::memcpy(b + 2 * k, Bt + k * kMaxColsb + 4 * n, 4);
        d = tdpbf16ps_element(d, a, b, 2, K);
        std::memcpy(out + m * kMaxColsb + 4 * n, &d, 4);
        continue;
      }
      const bool a_signed = op.op == Op::tdpbssd || op.op == Op::tdpbsud;
      const bool b_signed = op.op == Op::tdpbssd || op.op == Op::tdpbusd;
      uint32_t acc;
      std::memcpy(&acc, c, 4);
      for (int k = 0; k < K; ++k)
        for (int j = 0; j < 4; ++j) {
          const uint8_t ab = A[m * kMaxColsb + 4 * k + j], bb = Bt[k * kMaxColsb + 4 * n + j];
          const int32_t av = a_signed ? int32_t(int8_t(ab)) : int32_t(ab);
          const int32_t bv = b_signed ? int32_t(int8_t(bb)) : int32_t(bb);
          acc += uint32_t(av * bv);  // int32 wrap-around, as the hardware
        }
      std::memcpy(out + m * kMaxColsb + 4 * n, &acc, 4);
    }
  std::memcpy(T, out, sizeof out);  // rows past `rows` and bytes past colsb become zero
  return Fault::none;
}

}  // namespace ktjit::amx
