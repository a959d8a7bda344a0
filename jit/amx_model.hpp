// AMX without AMX hardware: the tile instructions kt-jit emits, described three ways that tests
// compare with each other and with objdump:
//   - AmxOp: one tile instruction as the generator recorded it while emitting (offset, length,
//     tiles, memory operand), with its text in objdump's Intel syntax;
//   - decode_amx(): the same facts decoded from the machine code bytes (VEX C4 map 0F38);
//   - TileMachine: a software model of the palette-1 tile state (TILECFG, TILELOADD, TILESTORED,
//     TILEZERO, TDPBUSD, TDPBSSD, TDPBF16PS, TILERELEASE) following the pseudo-code of Intel's
//     ISA reference, which executes a decoded instruction given the general-register values.
// The model allocates nothing and throws nothing while executing (faults are reported through
// the return value), so a SIGILL handler can run it on the real kernel's trapping instructions.
#pragma once

#include <cstdint>
#include <string>

namespace ktjit::amx {

enum class Op : uint8_t {
  ldtilecfg,
  sttilecfg,
  tilerelease,
  tilezero,
  tileloadd,
  tileloaddt1,
  tilestored,
  tdpbssd,
  tdpbsud,
  tdpbusd,
  tdpbuud,
  tdpbf16ps,
};
const char* op_name(Op op);

// GPR numbers are the x86 encoding numbers (0 = rax ... 15 = r15); kRip marks RIP-relative.
constexpr int kNoReg = -1;
constexpr int kRip = 16;
const char* gpr_name(int r);

struct AmxOp {
  Op op = Op::tilerelease;
  uint32_t offset = 0;            // bytes from the kernel's entry
  uint32_t length = 0;            // instruction bytes
  int t0 = -1, t1 = -1, t2 = -1;  // tiles: dest/src (tilestored: source in t0), tdp*: t0 += t1 * t2
  bool has_mem = false;
  int base = kNoReg, index = kNoReg, scale = 1;
  int32_t disp = 0;

  // objdump -M intel text, operands joined by ',' with no spaces, e.g.
  // "tdpbusd tmm4,tmm0,tmm1", "tileloadd tmm0,[r8+r10*1]", "tilestored [rsp+rcx*1+0x80],tmm4".
  std::string text() const;
  bool same_instruction(const AmxOp& o) const;  // every field but the text
};

// Decodes one AMX instruction at `p` (VEX C4, map 0F38, opcodes 49/4B/5C/5E). Returns false for
// anything else (the caller then treats the instruction as not AMX).
bool decode_amx(const uint8_t* p, AmxOp* out);

// Palette 1: 8 tiles of up to 16 rows x 64 bytes.
constexpr int kTiles = 8;
constexpr int kMaxRows = 16;
constexpr int kMaxColsb = 64;

struct TileConfig {
  uint8_t palette = 0, start_row = 0;
  uint16_t colsb[kTiles] = {};
  uint8_t rows[kTiles] = {};
};

enum class Fault : uint8_t {
  none = 0,
  gp_bad_config,      // LDTILECFG: #GP (bad palette, reserved bytes, rows/colsb out of range)
  ud_not_configured,  // tile instruction while no palette is loaded (#UD)
  ud_tile_shape,      // a tile operand that is unconfigured or shapes that do not match (#UD)
  ud_same_tiles,      // TDP* with two equal tile operands (#UD)
  not_amx,            // not an instruction this model knows
};
const char* fault_name(Fault f);

struct Counters {
  uint64_t ldtilecfg = 0, tilerelease = 0, tilezero = 0, loads = 0, stores = 0, dp = 0;
};

class TileMachine {
 public:
  // Executes `op`; `gpr[16]` are the general registers, `next_rip` the address of the following
  // instruction (for RIP-relative operands). Memory is read and written directly.
  Fault execute(const AmxOp& op, const uint64_t gpr[16], uint64_t next_rip);

  bool configured() const { return cfg_.palette != 0; }
  const TileConfig& config() const { return cfg_; }
  const uint8_t* tile(int t) const { return data_[t]; }
  Counters counters;

  // Effective address of row `r` of a memory operand (SIB: base + disp + r * index * scale).
  static uint64_t address(const AmxOp& op, const uint64_t gpr[16], uint64_t next_rip, int row);

 private:
  Fault load_config(const uint8_t* mem);
  void zero_all();
  TileConfig cfg_;
  uint8_t data_[kTiles][kMaxRows * kMaxColsb] = {};
};

// TDPBF16PS on one row element, as the current SDM pseudo-code writes it: even and odd bf16
// products accumulate separately from zero over k (FP32 FMA, DAZ on inputs, FTZ on results, RNE),
// then their sum is added to the destination (DAZ/FTZ/RNE). `a`/`b` hold k pairs (2k bf16 each).
float tdpbf16ps_element(float dest, const uint16_t* a, const uint16_t* b, int b_stride, int k);

}  // namespace ktjit::amx
