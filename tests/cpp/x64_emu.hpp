// x86-64 in software, for the generated kernels of ISA levels this CPU cannot execute.
//
// A test machine without AVX-512 (or AMX) still has to show that the AVX-512 kernels compute
// what their C++ twins compute. This interpreter runs a generated kernel's machine code
// instruction by instruction: Zydis decodes each instruction, and the interpreter applies the
// semantics of Intel's SDM to a software register file (16 general registers, 32 vector
// registers of 512 bits, 8 mask registers, the arithmetic flags), reading and writing the
// process's memory directly, so the kernel works on the test's own buffers. AMX tile
// instructions go to the software tile model (jit/amx_model.hpp). Only the instructions and
// operand forms the generators emit are implemented; anything else throws, naming the
// instruction and its offset, so a gap never passes silently.
//
// The interpreter is itself checked against the hardware: tests/cpp/test_x64_emu.cpp runs every
// kernel of every level this CPU can execute both natively and here and requires equal bits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include "jit/amx_model.hpp"

namespace ktjit::test {

struct EmuStats {
  uint64_t instructions = 0;
  std::map<std::string, uint64_t> mnemonics;  // executed count per mnemonic (when asked for)
  amx::Counters amx;                          // the tile model's counters
  uint64_t amx_instructions = 0;
  bool tiles_configured_at_exit = false;
};

struct EmuOptions {
  bool count_mnemonics = false;
  uint64_t max_instructions = 4000000000ull;
  // Called with each AMX instruction before the tile model executes it (offset from the entry).
  std::function<void(const amx::AmxOp&)> on_amx;
  // Called with the address of each software prefetch (prefetcht0/t1/t2/nta), which otherwise
  // does nothing here.
  std::function<void(uint64_t)> on_prefetch;
  // The same with the prefetch's hint: 0 prefetcht0, 1 prefetcht1, 2 prefetcht2, 3 prefetchnta.
  std::function<void(uint64_t, int)> on_prefetch_hint;
  // Called with the address and size of each vector register stored to memory (after the store).
  std::function<void(uint64_t, int)> on_vector_store;
};

// Runs `code` (entry at offset 0, System V ABI) with `arg0` in rdi until its outermost `ret`.
// Throws std::runtime_error on an instruction or operand form it does not implement, on an AMX
// fault, or after `max_instructions`.
EmuStats emulate_x64(const uint8_t* code, size_t size, const void* arg0,
                     const EmuOptions& options = {});

}  // namespace ktjit::test
