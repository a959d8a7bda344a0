// The x86-64 interpreter (x64_emu.hpp) on single instructions with answers worked out by hand
// from the SDM's definitions. Where this CPU runs the instruction, the snippet also runs natively
// and must give the same bits. (The kernel sweeps check the interpreter against the hardware on
// whole kernels: ctest's x64_emu_matches_hardware.)
#include <gtest/gtest.h>
#include <xbyak/xbyak.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

#include "jit/bits.hpp"
#include "jit/code_memory.hpp"
#include "jit/cpu/cpu.hpp"
#include "x64_emu.hpp"

namespace ktjit {
namespace {

// zmm1, zmm2, zmm3 (and k1) loaded from the buffer at rdi, one instruction writing zmm0 (which
// starts as the buffer's fourth vector), zmm0 stored back over the fourth vector.
struct Snippet : Xbyak::CodeGenerator {
  explicit Snippet(const std::function<void(Snippet&)>& body)
      : Xbyak::CodeGenerator(4096, Xbyak::DontSetProtectRWE) {
    vmovups(zmm1, ptr[rdi]);
    vmovups(zmm2, ptr[rdi + 64]);
    vmovups(zmm3, ptr[rdi + 128]);
    vmovups(zmm0, ptr[rdi + 192]);
    body(*this);
    vmovups(ptr[rdi + 192], zmm0);
    vzeroupper();
    ret();
  }
};

struct Regs {
  alignas(64) uint8_t b[4][64];
  template <class T>
  T* as(int v) {
    return reinterpret_cast<T*>(b[v]);
  }
  template <class T>
  const T* as(int v) const {
    return reinterpret_cast<const T*>(b[v]);
  }
};

// Runs the snippet in the interpreter (and natively when `native_level` is usable) on `in`.
Regs run(const std::function<void(Snippet&)>& body, const Regs& in, IsaLevel native_level) {
  Snippet s(body);
  Regs emu = in;
  test::emulate_x64(s.getCode(), s.getSize(), &emu);
  if (level_usable(native_level, cpu_features())) {
    Regs hw = in;
    std::string err;
    ExecutableCode code = ExecutableCode::publish(s.getCode(), s.getSize(), &err);
    reinterpret_cast<void (*)(Regs*)>(const_cast<void*>(code.entry()))(&hw);
    EXPECT_EQ(0, std::memcmp(hw.b[3], emu.b[3], 64)) << "the interpreter differs from this CPU";
  }
  return emu;
}

float f(uint32_t bits) {
  return f32_from_bits(bits);
}
uint32_t u(float x) {
  return f32_to_bits(x);
}

TEST(X64Emu, Vpdpbusd) {  // acc += sum over 4 bytes of u8(src1) * s8(src2), wrapping
  Regs r{};
  for (int i = 0; i < 64; ++i) {
    r.b[0][i] = uint8_t(255 - i);           // unsigned 255, 254, ...
    r.b[1][i] = uint8_t(i % 2 ? 0x80 : 3);  // -128 and 3
  }
  for (int i = 0; i < 16; ++i) r.as<int32_t>(3)[i] = i == 5 ? INT32_MAX : 1000;
  const Regs o =
      run([](Snippet& s) { s.vpdpbusd(s.zmm0, s.zmm1, s.zmm2); }, r, IsaLevel::avx512_vnni);
  for (int i = 0; i < 16; ++i) {
    int64_t want = i == 5 ? INT32_MAX : 1000;
    for (int j = 0; j < 4; ++j) want += int64_t(255 - (4 * i + j)) * (j % 2 ? -128 : 3);
    EXPECT_EQ(o.as<int32_t>(3)[i], int32_t(uint32_t(int64_t(want)))) << i;
  }
}

TEST(X64Emu, VpmaddubswSaturates) {
  Regs r{};
  for (int i = 0; i < 64; ++i) {
    r.b[0][i] = 255;
    r.b[1][i] = i < 32 ? 127 : 0x80;
  }
  const Regs o = run([](Snippet& s) { s.vpmaddubsw(s.zmm0, s.zmm1, s.zmm2); }, r, IsaLevel::avx512);
  for (int i = 0; i < 32; ++i) EXPECT_EQ(o.as<int16_t>(3)[i], i < 16 ? 32767 : -32768) << i;
}

TEST(X64Emu, Vdpbf16psAddsTheOddProductFirst) {
  // acc = 1, odd product 2^24 then even product 1: (1 + 2^24) rounds to 2^24 (tie to even),
  // then + 1 rounds to 2^24 again; the other order would give 2^24 + 2.
  Regs r{};
  for (int i = 0; i < 16; ++i) {
    r.as<float>(3)[i] = 1.0f;
    r.as<uint32_t>(0)[i] = (u(16777216.0f) & 0xffff0000u) | (u(1.0f) >> 16);  // odd 2^24, even 1
    r.as<uint32_t>(1)[i] = (u(1.0f) & 0xffff0000u) | (u(1.0f) >> 16);
  }
  r.as<float>(3)[1] = f(0x00000001u);  // a subnormal accumulator reads as zero
  r.as<uint32_t>(0)[2] = 0x00010001u;  // subnormal bf16 inputs read as zero
  const Regs o =
      run([](Snippet& s) { s.vdpbf16ps(s.zmm0, s.zmm1, s.zmm2); }, r, IsaLevel::avx512_bf16);
  EXPECT_EQ(o.as<float>(3)[0], 16777216.0f);
  EXPECT_EQ(o.as<float>(3)[1], 16777216.0f + 0.0f);  // 0 + 2^24 + 1 -> 2^24
  EXPECT_EQ(o.as<float>(3)[2], 1.0f);
}

TEST(X64Emu, Vpermi2bPicksTheTableByBit6) {
  Regs r{};
  for (int i = 0; i < 64; ++i) {
    r.b[3][i] = uint8_t(((i * 5) & 63) | (i % 3 == 0 ? 0x40 : 0) | 0x80);  // bit 7 ignored
    r.b[1][i] = uint8_t(i);                                                // table 0
    r.b[2][i] = uint8_t(100 + i);                                          // table 1
  }
  const Regs o =
      run([](Snippet& s) { s.vpermi2b(s.zmm0, s.zmm2, s.zmm3); }, r, IsaLevel::avx512_bf16);
  for (int i = 0; i < 64; ++i) {
    const int id = (i * 5) & 63;
    EXPECT_EQ(o.b[3][i], i % 3 == 0 ? 100 + id : id) << i;
  }
}

TEST(X64Emu, MinMaxAndConversionEdgeCases) {
  Regs r{};
  const float nan = f(0x7fc00001u);
  const float a[16] = {1,    nan, 0.0f,   -0.0f, 3e9f, -3e9f, 2.5f,  -2.5f,
                       3.5f, nan, 1e-45f, -7,    0.5f, 1.5f,  -0.5f, 8};
  const float b[16] = {2, 1, -0.0f, 0.0f, 1, 1, 1, 1, 1, nan, 0, -8, 1, 1, 1, 1};
  std::memcpy(r.b[0], a, 64);
  std::memcpy(r.b[1], b, 64);
  const Regs mn = run([](Snippet& s) { s.vminps(s.zmm0, s.zmm1, s.zmm2); }, r, IsaLevel::avx512);
  const Regs mx = run([](Snippet& s) { s.vmaxps(s.zmm0, s.zmm1, s.zmm2); }, r, IsaLevel::avx512);
  const Regs cv = run([](Snippet& s) { s.vcvtps2dq(s.zmm0, s.zmm1); }, r, IsaLevel::avx512);
  for (int i = 0; i < 16; ++i) {
    // SDM: the second source unless src1 < src2 (min) / src1 > src2 (max): NaNs and +-0 -> src2
    EXPECT_EQ(u(mn.as<float>(3)[i]), u(a[i] < b[i] ? a[i] : b[i])) << i;
    EXPECT_EQ(u(mx.as<float>(3)[i]), u(a[i] > b[i] ? a[i] : b[i])) << i;
  }
  const int32_t want[16] = {
      1, INT32_MIN, 0, 0,  INT32_MIN, INT32_MIN, 2, -2,
      4, INT32_MIN, 0, -7, 0,         2,         0, 8};  // nearest even, indefinite
  for (int i = 0; i < 16; ++i) EXPECT_EQ(cv.as<int32_t>(3)[i], want[i]) << i;
}

TEST(X64Emu, TernlogBlendAndMasks) {
  Regs r{};
  for (int i = 0; i < 64; ++i) {
    r.b[0][i] = uint8_t(i * 37);
    r.b[1][i] = uint8_t(i * 11 + 1);
    r.b[2][i] = uint8_t(i + 7);
    r.b[3][i] = uint8_t(i * 3);
  }
  // imm 0xca: (dst & src1) | (~dst & src2), the bitwise select
  const Regs t =
      run([](Snippet& s) { s.vpternlogd(s.zmm0, s.zmm1, s.zmm2, 0xca); }, r, IsaLevel::avx512);
  const Regs bl = run(
      [](Snippet& s) {
        s.vpmovb2m(s.k1, s.zmm1);
        s.vpblendmb(s.zmm0 | s.k1, s.zmm2, s.zmm3);
      },
      r, IsaLevel::avx512);
  for (int i = 0; i < 64; ++i) {
    const uint8_t d = r.b[3][i], a = r.b[0][i], b = r.b[1][i];
    EXPECT_EQ(t.b[3][i], uint8_t((d & a) | (~d & b))) << i;
    EXPECT_EQ(bl.b[3][i], (a & 0x80) ? r.b[2][i] : b) << i;  // k1 from src1's sign bits
  }
}

// VEX vpblendw: word i of each 128-bit lane from src2 where imm bit i is set, else from src1; a
// VEX write zeroes the register above bit 255. (The snippet loads zmm, so it runs natively only
// on AVX-512; on AVX2 machines the dual run of the fp8 strip-scratch kernels covers it.)
TEST(X64Emu, VpblendwPicksWordsPerLane) {
  Regs r{};
  for (int i = 0; i < 64; ++i) {
    r.b[0][i] = uint8_t(i);
    r.b[1][i] = uint8_t(100 + i);
    r.b[3][i] = 0xee;
  }
  const Regs o =
      run([](Snippet& s) { s.vpblendw(s.ymm0, s.ymm1, s.ymm2, 0xa6); }, r, IsaLevel::avx512);
  for (int w = 0; w < 16; ++w) {
    const bool take = (0xa6 >> (w % 8)) & 1;  // the same 8 bits in both lanes
    for (int j = 0; j < 2; ++j)
      EXPECT_EQ(o.b[3][2 * w + j], take ? r.b[1][2 * w + j] : r.b[0][2 * w + j]) << w;
  }
  for (int i = 32; i < 64; ++i) EXPECT_EQ(o.b[3][i], 0) << i;
}

// Unsigned div (the prefill kernels' prefetch strides, jit/x64/gemm.cpp pf_var_stride): 32-bit
// from edx:eax by a memory operand, and 64-bit from rdx:rax by a register; the quotient and the
// remainder stored into zmm0's first dwords and its second and third qwords.
TEST(X64Emu, DivIsUnsigned) {
  Regs in{};
  in.as<uint32_t>(1)[0] = 7;            // the 32-bit divisor, in memory
  in.as<uint64_t>(2)[0] = 0x100000000;  // the 64-bit divisor
  Regs out = run(
      [](Snippet& g) {
        g.mov(g.eax, 0xfffffff0u);  // edx:eax = 2^32 + 0xfffffff0: the quotient fits 32 bits
        g.mov(g.edx, 1);
        g.div(g.dword[g.rdi + 64]);
        g.mov(g.dword[g.rdi + 192], g.eax);
        g.mov(g.dword[g.rdi + 196], g.edx);
        g.mov(g.rax, 0x123456789abcdefull);
        g.mov(g.edx, 5);  // rdx:rax = 5 * 2^64 + rax
        g.mov(g.rcx, g.ptr[g.rdi + 128]);
        g.div(g.rcx);
        g.mov(g.qword[g.rdi + 208], g.rax);
        g.mov(g.qword[g.rdi + 216], g.rdx);
        g.vmovups(g.zmm0, g.ptr[g.rdi + 192]);
      },
      in, IsaLevel::avx512);
  const uint64_t n32 = (uint64_t(1) << 32) | 0xfffffff0u;
  EXPECT_EQ(out.as<uint32_t>(3)[0], uint32_t(n32 / 7));
  EXPECT_EQ(out.as<uint32_t>(3)[1], uint32_t(n32 % 7));
  const unsigned __int128 n64 = (static_cast<unsigned __int128>(5) << 64) | 0x123456789abcdefull;
  EXPECT_EQ(out.as<uint64_t>(3)[2], uint64_t(n64 / 0x100000000ull));
  EXPECT_EQ(out.as<uint64_t>(3)[3], uint64_t(n64 % 0x100000000ull));
}

// vmovq / vmovd (the avx2 lane folds store sub-biases with vmovq): to memory the low qword
// (dword) alone, into a register the low qword (dword) with every other bit zeroed.
TEST(X64Emu, VmovqVmovdMoveTheLowElement) {
  Regs in{};
  for (int v = 0; v < 4; ++v)
    for (int i = 0; i < 64; ++i) in.b[v][i] = uint8_t(16 * v + i + 1);
  const Regs out = run(
      [](Snippet& g) {
        g.vmovq(g.ptr[g.rdi + 192 + 8], g.xmm1);   // bytes 8-15 of zmm0's memory
        g.vmovd(g.ptr[g.rdi + 192 + 20], g.xmm2);  // bytes 20-23
        g.vmovd(g.xmm3, g.ptr[g.rdi + 64 + 8]);    // zmm3 = bytes 8-11 of zmm2's memory
        g.vmovq(g.xmm1, g.xmm3);                   // zmm1 = the low qword of zmm3
        g.vmovups(g.zmm0, g.ptr[g.rdi + 192]);
        g.vpaddb(g.zmm0, g.zmm0, g.zmm1);  // zmm1's zeroed bytes leave zmm0 as stored
      },
      in, IsaLevel::avx512);
  for (int i = 0; i < 64; ++i) {
    uint8_t want = in.b[3][i];
    if (i >= 8 && i < 16) want = in.b[0][i - 8];    // zmm1's
    if (i >= 20 && i < 24) want = in.b[1][i - 20];  // zmm2's
    if (i < 4) want = uint8_t(want + in.b[1][8 + i]);
    EXPECT_EQ(out.b[3][i], want) << i;
  }
}

// vpinsrw / vpinsrb (the avx2 lane folds): src1 with one element replaced from a general
// register or memory, the bits above 128 zeroed.
TEST(X64Emu, VpinsrReplacesOneElement) {
  Regs in{};
  for (int v = 0; v < 4; ++v)
    for (int i = 0; i < 64; ++i) in.b[v][i] = uint8_t(16 * v + i + 1);
  const Regs out = run(
      [](Snippet& g) {
        g.mov(g.eax, 0xabcd1234u);
        g.vpinsrw(g.xmm0, g.xmm1, g.eax, 5);                   // word 5 = 0x1234
        g.vpinsrb(g.xmm0, g.xmm0, g.ptr[g.rdi + 64 + 3], 15);  // byte 15 = zmm2's byte 3
      },
      in, IsaLevel::avx512);
  for (int i = 0; i < 64; ++i) {
    uint8_t want = i < 16 ? in.b[0][i] : 0;
    if (i == 10) want = 0x34;
    if (i == 11) want = 0x12;
    if (i == 15) want = in.b[1][3];
    EXPECT_EQ(out.b[3][i], want) << i;
  }
}

// The mask instructions of the MXFP4 fused block (jit/x64/gemm.cpp mx4_word_decode): kmovd from
// a general register, vpblendmw under it, vptestmw under a write mask, a zero-masked vpaddw, and
// vpcmpub (unsigned >) with kortestq's zero flag.
TEST(X64Emu, MaskedWordOpsAndMaskTests) {
  Regs in{};
  for (int i = 0; i < 32; ++i) {
    in.as<uint16_t>(0)[i] = uint16_t(i % 3 == 0 ? 0 : 0x0101 * i);  // zmm1: some zero words
    in.as<uint16_t>(1)[i] = uint16_t(0x00ff + 7 * i);               // zmm2
    in.as<uint16_t>(3)[i] = 0xeeee;                                 // zmm0
  }
  const Regs bl = run(
      [](Snippet& g) {
        g.mov(g.eax, 0xaaaaaaaau);
        g.kmovd(g.k2, g.eax);
        g.vpblendmw(g.zmm0 | g.k2, g.zmm1, g.zmm2);
      },
      in, IsaLevel::avx512);
  const Regs add = run(
      [](Snippet& g) {
        g.mov(g.eax, 0x0f0f0f0fu);
        g.kmovd(g.k2, g.eax);
        g.vptestmw(g.k3 | g.k2, g.zmm1, g.zmm1);  // non-zero words of zmm1, under k2
        g.vpaddw(g.zmm0 | g.k3 | g.T_z, g.zmm1, g.zmm2);
      },
      in, IsaLevel::avx512);
  for (int i = 0; i < 32; ++i) {
    const uint16_t x = in.as<uint16_t>(0)[i], y = in.as<uint16_t>(1)[i];
    EXPECT_EQ(bl.as<uint16_t>(3)[i], i % 2 ? y : x) << i;
    const bool k = ((0x0f0f0f0fu >> i) & 1) && x != 0;
    EXPECT_EQ(add.as<uint16_t>(3)[i], k ? uint16_t(x + y) : 0) << i;
  }
  // vpcmpub k4, zmm1, zmm2, 6 (unsigned >); where no byte is greater, kortestq sets ZF and the
  // snippet zeroes zmm0
  for (int greater = 0; greater < 2; ++greater) {
    Regs c = in;
    for (int i = 0; i < 64; ++i) {
      c.b[0][i] = uint8_t(200 + i % 50);
      c.b[1][i] = uint8_t(greater && i == 41 ? 100 : 250);
    }
    const Regs out = run(
        [](Snippet& g) {
          Xbyak::Label skip;
          g.vpcmpub(g.k4, g.zmm1, g.zmm2, 6);
          g.kortestq(g.k4, g.k4);
          g.jnz(skip);
          g.vpxord(g.zmm0, g.zmm0, g.zmm0);
          g.L(skip);
        },
        c, IsaLevel::avx512);
    for (int i = 0; i < 64; ++i) EXPECT_EQ(out.b[3][i], greater ? 0xee : 0) << greater << " " << i;
  }
}

TEST(X64Emu, RefusesWhatItDoesNotImplement) {
  Snippet s([](Snippet& g) { g.vpconflictd(g.zmm0, g.zmm1); });
  Regs r{};
  try {
    test::emulate_x64(s.getCode(), s.getSize(), &r);
    ADD_FAILURE() << "no exception";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("vpconflictd"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace ktjit
