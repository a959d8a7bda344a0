// AMX kernels verified without AMX hardware (docs/ARCHITECTURE.md "AMX"):
//   Encoding: every tile instruction objdump finds in a generated kernel is one the generator
//     logged at that offset with the same text, and the reverse; our decoder reads the same
//     instruction from the bytes.
//   TileModel: the tile model's instructions against direct math and the ISA reference's faults.
//   Execution: the real machine code runs here; each tile instruction raises SIGILL (#UD on a CPU
//     without AMX), the handler decodes it from the bytes, executes it on the tile model with the
//     trapped registers and resumes after it. Loops, addressing, tails and the AVX-512 epilogue
//     run natively. Outputs must equal gemm_ref and the native avx512_vnni kernels bit for bit.
//     On a CPU with usable AMX the same test runs the kernels natively (no traps).
#include <gtest/gtest.h>
#include <signal.h>
#include <ucontext.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>

#include "bf16_case.hpp"
#include "formats/convert.hpp"
#include "formats/int8.hpp"
#include "formats/mx.hpp"
#include "jit/amx_model.hpp"
#include "jit/code_memory.hpp"
#include "jit/gemm.hpp"
#include "jit/kernel.hpp"
#include "jit/x64/amx_gemm.hpp"
#include "kernel_exec.hpp"
#include "runtime/moe_layer.hpp"
#include "runtime/thread_pool.hpp"
#include "test_util.hpp"
#include "x64_emu.hpp"

namespace ktjit {
namespace {

using amx::AmxOp;

KernelKey amx_key(int m_r, int nv, Epilogue epi, WeightFormat fmt = WeightFormat::int8) {
  KernelKey k;
  k.kind = KernelKind::gemm_prefill;
  k.isa = IsaLevel::amx;
  k.format = fmt;
  k.m_r = uint8_t(m_r);
  k.n_vec = uint8_t(nv);
  k.epilogue = epi;
  return k;
}

std::vector<KernelKey> all_amx_keys() {
  std::vector<KernelKey> keys;
  for (Epilogue epi : {Epilogue::store, Epilogue::siluup, Epilogue::accum})
    for (int nv = 1; nv <= kStripVecs; ++nv)
      for (int m : {1, 2, 7, 15, 16}) {
        if (epi == Epilogue::siluup && nv % 2) continue;
        for (WeightFormat f : {WeightFormat::int8, WeightFormat::int4, WeightFormat::bf16,
                               WeightFormat::fp8, WeightFormat::mxfp4, WeightFormat::mxfp8})
          keys.push_back(amx_key(m, nv, epi, f));
        if (epi == Epilogue::siluup) {  // the mx SwiGLU variants
          KernelKey k = amx_key(m, nv, epi, WeightFormat::mxfp4);
          k.variant = kSwigluClamp | kSwigluAlpha;
          keys.push_back(k);
        }
      }
  return keys;
}

// ---- objdump ---------------------------------------------------------------------------------

struct DisLine {
  uint32_t offset;
  std::string bytes, mnemonic, text;  // text: "mnemonic operands" with spaces after ',' removed
};

std::vector<DisLine> objdump(const std::vector<uint8_t>& code) {
  char path[] = "/tmp/ktjit_amx_XXXXXX";
  const int fd = mkstemp(path);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(write(fd, code.data(), code.size()), ssize_t(code.size()));
  close(fd);
  const std::string cmd =
      std::string("objdump -D -b binary -m i386:x86-64 -M intel ") + path + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::vector<DisLine> out;
  char buf[512];
  while (p && std::fgets(buf, sizeof buf, p)) {
    std::string line(buf);
    if (!line.empty() && line.back() == '\n') line.pop_back();
    // "  1c:\tc4 e2 7b 4b 04 10 \ttileloadd tmm0,[rax+rdx*1]"
    const size_t colon = line.find(":\t");
    if (colon == std::string::npos) continue;
    DisLine d;
    try {
      d.offset = uint32_t(std::stoul(line.substr(0, colon), nullptr, 16));
    } catch (...) {
      continue;
    }
    std::string rest = line.substr(colon + 2);
    const size_t tab = rest.find('\t');
    d.bytes = rest.substr(0, tab);
    if (tab == std::string::npos) continue;  // continuation line of a long instruction
    std::string ins = rest.substr(tab + 1);
    const size_t hash = ins.find('#');
    if (hash != std::string::npos) ins = ins.substr(0, hash);
    std::istringstream s(ins);
    std::string mn, ops, w;
    s >> mn;
    while (s >> w) ops += w;
    d.mnemonic = mn;
    d.text = ops.empty() ? mn : mn + " " + ops;
    out.push_back(d);
  }
  if (p) pclose(p);
  unlink(path);
  return out;
}

bool is_amx_mnemonic(const std::string& m) {
  return m.rfind("tile", 0) == 0 || m.rfind("tdp", 0) == 0 || m == "ldtilecfg" || m == "sttilecfg";
}

bool have_objdump() {
  return std::system("objdump --version >/dev/null 2>&1") == 0;
}

TEST(AmxEncoding, GeneratorLogMatchesObjdumpAndDecoder) {
  if (!have_objdump()) GTEST_SKIP() << "objdump (binutils) not installed";
  size_t checked = 0;
  for (const KernelKey& key : all_amx_keys()) {
    std::vector<AmxOp> log;
    const std::vector<uint8_t> code = x64::generate_amx_gemm(key, &log);
    ASSERT_FALSE(log.empty()) << key.name();
    // The code region ends at the first ret after the last tile instruction (then constants).
    const uint32_t last = log.back().offset;
    std::map<uint32_t, std::string> dis_amx;
    bool in_code = true;
    for (const DisLine& d : objdump(code)) {
      if (!in_code) break;
      if (d.offset > last && d.mnemonic == "ret") in_code = false;
      EXPECT_NE(d.mnemonic, "(bad)") << key.name() << " at 0x" << std::hex << d.offset;
      if (is_amx_mnemonic(d.mnemonic)) dis_amx[d.offset] = d.text;
    }
    std::map<uint32_t, const AmxOp*> logged;
    for (const AmxOp& o : log) logged[o.offset] = &o;
    // Every tile instruction objdump sees was logged there, with the same text.
    for (auto& [off, text] : dis_amx) {
      auto it = logged.find(off);
      ASSERT_NE(it, logged.end()) << key.name() << ": objdump shows '" << text << "' at 0x"
                                  << std::hex << off << " that the generator did not log";
      EXPECT_EQ(text, it->second->text()) << key.name() << " at 0x" << std::hex << off;
    }
    // Every logged instruction is in objdump's listing, and decodes to the same operands.
    for (const AmxOp& o : log) {
      EXPECT_EQ(dis_amx.count(o.offset), 1u)
          << key.name() << ": logged '" << o.text() << "' not found by objdump";
      AmxOp d;
      ASSERT_TRUE(amx::decode_amx(code.data() + o.offset, &d)) << o.text();
      d.offset = o.offset;
      EXPECT_TRUE(d.same_instruction(o)) << "decoded '" << d.text() << "' logged '" << o.text()
                                         << "' len " << d.length << "/" << o.length;
      ++checked;
    }
    EXPECT_EQ(dis_amx.size(), log.size()) << key.name();
    // The kernel configures once and releases once.
    EXPECT_EQ(log.front().op, amx::Op::ldtilecfg);
    EXPECT_EQ(log.back().op, amx::Op::tilerelease);
  }
  EXPECT_GT(checked, 500u);
}

TEST(AmxEncoding, DecoderKnowsEveryTileInstruction) {
  // Hand-checked encodings (SDM vol. 2), decoded and printed as objdump prints them.
  struct Case {
    std::vector<uint8_t> bytes;
    const char* text;
  } cases[] = {
      {{0xc4, 0xe2, 0x78, 0x49, 0xc0}, "tilerelease"},
      {{0xc4, 0xe2, 0x7b, 0x49, 0xe0}, "tilezero tmm4"},
      {{0xc4, 0xe2, 0x71, 0x5e, 0xc2}, "tdpbusd tmm0,tmm2,tmm1"},
      {{0xc4, 0xe2, 0x73, 0x5e, 0xc2}, "tdpbssd tmm0,tmm2,tmm1"},
      {{0xc4, 0xe2, 0x72, 0x5c, 0xc2}, "tdpbf16ps tmm0,tmm2,tmm1"},
      {{0xc4, 0x82, 0x7b, 0x4b, 0x04, 0x10}, "tileloadd tmm0,[r8+r10*1]"},
      {{0xc4, 0xe2, 0x7a, 0x4b, 0x64, 0x0c, 0x40}, "tilestored [rsp+rcx*1+0x40],tmm4"},
      {{0xc4, 0xe2, 0x78, 0x49, 0x44, 0x24, 0x40}, "ldtilecfg [rsp+0x40]"},
  };
  for (const Case& c : cases) {
    AmxOp o;
    ASSERT_TRUE(amx::decode_amx(c.bytes.data(), &o)) << c.text;
    EXPECT_EQ(o.text(), c.text);
    EXPECT_EQ(o.length, c.bytes.size()) << c.text;
    if (have_objdump()) {
      auto d = objdump(c.bytes);
      ASSERT_FALSE(d.empty());
      EXPECT_EQ(d[0].text, c.text);
    }
  }
  const uint8_t vpdpbusd[] = {0x62, 0xf2, 0x7d, 0x48, 0x50, 0xc1};
  AmxOp o;
  EXPECT_FALSE(amx::decode_amx(vpdpbusd, &o));
}

// ---- the tile model against direct math --------------------------------------------------------

struct ModelRig {
  amx::TileMachine tm;
  uint64_t gpr[16] = {};
  alignas(64) uint8_t cfg[64] = {};
  void set(int t, int rows, int colsb) {
    cfg[0] = 1;
    std::memcpy(cfg + 16 + 2 * t, &colsb, 2);
    cfg[48 + t] = uint8_t(rows);
  }
  amx::Fault run(amx::Op op, int t0 = -1, int t1 = -1, int t2 = -1, const void* base = nullptr,
                 int64_t stride = 0) {
    AmxOp o;
    o.op = op;
    o.t0 = t0;
    o.t1 = t1;
    o.t2 = t2;
    if (base) {
      o.has_mem = true;
      o.base = 0;
      o.index = 1;
      gpr[0] = reinterpret_cast<uint64_t>(base);
      gpr[1] = uint64_t(stride);
    }
    return tm.execute(o, gpr, 0);
  }
};

TEST(AmxTileModel, TdpbusdAndTdpbssdMatchDirectMath) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 20; ++trial) {
    const int M = 1 + int(rng() % 16), K4 = 1 + int(rng() % 16), N = 1 + int(rng() % 16);
    std::vector<uint8_t> A(size_t(M * 64)), B(size_t(K4 * 64)), C0(size_t(M * 64));
    for (auto& x : A) x = uint8_t(rng());
    for (auto& x : B) x = uint8_t(rng());
    for (auto& x : C0) x = uint8_t(rng());
    for (amx::Op op : {amx::Op::tdpbusd, amx::Op::tdpbssd}) {
      ModelRig r;
      r.set(0, M, 4 * N);   // C
      r.set(1, M, 4 * K4);  // A
      r.set(2, K4, 4 * N);  // B
      ASSERT_EQ(r.run(amx::Op::ldtilecfg, -1, -1, -1, r.cfg), amx::Fault::none);
      ASSERT_EQ(r.run(amx::Op::tileloadd, 0, -1, -1, C0.data(), 64), amx::Fault::none);
      ASSERT_EQ(r.run(amx::Op::tileloadd, 1, -1, -1, A.data(), 64), amx::Fault::none);
      ASSERT_EQ(r.run(amx::Op::tileloadd, 2, -1, -1, B.data(), 64), amx::Fault::none);
      ASSERT_EQ(r.run(op, 0, 1, 2), amx::Fault::none);
      std::vector<int32_t> out(size_t(16 * 16), 12345);
      ASSERT_EQ(r.run(amx::Op::tilestored, 0, -1, -1, out.data(), 64), amx::Fault::none);
      for (int m = 0; m < M; ++m)
        for (int n = 0; n < N; ++n) {
          int64_t want;
          int32_t c;
          std::memcpy(&c, &C0[size_t(m * 64 + 4 * n)], 4);
          want = c;
          for (int k = 0; k < 4 * K4; ++k) {
            const int a = op == amx::Op::tdpbssd ? int(int8_t(A[size_t(m * 64 + k)]))
                                                 : int(A[size_t(m * 64 + k)]);
            want += int64_t(a) * int8_t(B[size_t((k / 4) * 64 + 4 * n + k % 4)]);
          }
          EXPECT_EQ(out[size_t(m * 16 + n)], int32_t(uint32_t(uint64_t(want))));
        }
      // Columns past colsb and rows past `rows` are not written by TILESTORED.
      if (N < 16) EXPECT_EQ(out[size_t(N)], 12345);
      if (M < 16) EXPECT_EQ(out[size_t(M * 16)], 12345);
    }
  }
}

TEST(AmxTileModel, LoadZeroFillsAndShapesAreChecked) {
  ModelRig r;
  std::vector<uint8_t> src(1024, 0xab);
  EXPECT_EQ(r.run(amx::Op::tileloadd, 0, -1, -1, src.data(), 64), amx::Fault::ud_not_configured);
  r.set(0, 3, 8);
  r.set(1, 3, 8);
  r.set(2, 2, 8);
  ASSERT_EQ(r.run(amx::Op::ldtilecfg, -1, -1, -1, r.cfg), amx::Fault::none);
  ASSERT_EQ(r.run(amx::Op::tileloadd, 0, -1, -1, src.data(), 64), amx::Fault::none);
  EXPECT_EQ(r.tm.tile(0)[7], 0xab);
  EXPECT_EQ(r.tm.tile(0)[8], 0);                                  // past colsb
  EXPECT_EQ(r.tm.tile(0)[3 * 64], 0);                             // past rows
  EXPECT_EQ(r.run(amx::Op::tdpbusd, 0, 1, 2), amx::Fault::none);  // 3x2 += 3x2 * 2x2
  EXPECT_EQ(r.run(amx::Op::tdpbusd, 0, 1, 1), amx::Fault::ud_same_tiles);
  EXPECT_EQ(r.run(amx::Op::tdpbusd, 0, 2, 1), amx::Fault::ud_tile_shape);
  EXPECT_EQ(r.run(amx::Op::tileloadd, 5, -1, -1, src.data(), 64), amx::Fault::ud_tile_shape);
  EXPECT_EQ(r.run(amx::Op::tilerelease), amx::Fault::none);
  EXPECT_FALSE(r.tm.configured());
  // Invalid configurations: palette 2, more than 16 rows, colsb without rows.
  ModelRig bad;
  bad.set(0, 17, 64);
  EXPECT_EQ(bad.run(amx::Op::ldtilecfg, -1, -1, -1, bad.cfg), amx::Fault::gp_bad_config);
  ModelRig bad2;
  bad2.set(0, 0, 64);
  EXPECT_EQ(bad2.run(amx::Op::ldtilecfg, -1, -1, -1, bad2.cfg), amx::Fault::gp_bad_config);
  ModelRig bad3;
  bad3.set(0, 1, 64);
  bad3.cfg[0] = 2;
  EXPECT_EQ(bad3.run(amx::Op::ldtilecfg, -1, -1, -1, bad3.cfg), amx::Fault::gp_bad_config);
}

uint16_t bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return uint16_t(u >> 16);
}

TEST(AmxTileModel, Tdpbf16psFollowsTheReferencePseudoCode) {
  // Even and odd products accumulate separately, then their sum is added to the destination.
  const uint16_t a[4] = {bf16(1.0f), bf16(3.0f), bf16(2.0f), bf16(0.5f)};
  const uint16_t b[4] = {bf16(1.0f), bf16(1.0f), bf16(4.0f), bf16(2.0f)};
  // even = 1*1 + 2*4 = 9, odd = 3*1 + 0.5*2 = 4, dest 0.25 + 13
  EXPECT_EQ(amx::tdpbf16ps_element(0.25f, a, b, 2, 2), 13.25f);
  // Order matters: big + small + (-big) in the even lane loses `small`... (RNE at each FMA)
  const uint16_t a2[4] = {bf16(16777216.0f), 0, bf16(1.0f), 0};
  const uint16_t b2[4] = {bf16(1.0f), 0, bf16(1.0f), 0};
  EXPECT_EQ(amx::tdpbf16ps_element(0.0f, a2, b2, 2, 2), 16777216.0f);
  // DAZ: a subnormal input counts as zero; FTZ: a subnormal result is flushed.
  const uint16_t sub = 0x0001;  // smallest bf16 subnormal
  const uint16_t a3[2] = {sub, 0}, b3[2] = {bf16(1e30f), 0};
  EXPECT_EQ(amx::tdpbf16ps_element(0.0f, a3, b3, 2, 1), 0.0f);
  const uint16_t a4[2] = {bf16(1e-20f), 0}, b4[2] = {bf16(1e-20f), 0};
  EXPECT_EQ(amx::tdpbf16ps_element(0.0f, a4, b4, 2, 1), 0.0f);  // 1e-40 is subnormal in fp32
  float denorm;
  const uint32_t dbits = 1;
  std::memcpy(&denorm, &dbits, 4);
  EXPECT_EQ(amx::tdpbf16ps_element(denorm, a, b, 2, 2), 13.0f);  // dest denormal read as zero
}

// ---- executing the generated kernels: SIGILL -> tile model --------------------------------------

struct Trap {
  amx::TileMachine tm;
  uintptr_t lo = 0, hi = 0;
  const std::map<uint32_t, AmxOp>* log = nullptr;
  int faults = 0, mismatches = 0, foreign = 0;
  uint64_t traps = 0;
  std::string first_error;
};
Trap* g_trap = nullptr;

void on_sigill(int, siginfo_t*, void* ctx) {
  ucontext_t* uc = static_cast<ucontext_t*>(ctx);
  greg_t* g = uc->uc_mcontext.gregs;
  const uintptr_t rip = uintptr_t(g[REG_RIP]);
  Trap* t = g_trap;
  AmxOp op;
  if (!t || rip < t->lo || rip >= t->hi || !amx::decode_amx(reinterpret_cast<uint8_t*>(rip), &op)) {
    signal(SIGILL, SIG_DFL);  // not ours: re-execute and die with the default action
    return;
  }
  ++t->traps;
  op.offset = uint32_t(rip - t->lo);
  auto it = t->log->find(op.offset);
  if (it == t->log->end() || !it->second.same_instruction(op)) {
    if (!t->mismatches++) t->first_error = "trapped unlogged instruction " + op.text();
  }
  const uint64_t regs[16] = {
      uint64_t(g[REG_RAX]), uint64_t(g[REG_RCX]), uint64_t(g[REG_RDX]), uint64_t(g[REG_RBX]),
      uint64_t(g[REG_RSP]), uint64_t(g[REG_RBP]), uint64_t(g[REG_RSI]), uint64_t(g[REG_RDI]),
      uint64_t(g[REG_R8]),  uint64_t(g[REG_R9]),  uint64_t(g[REG_R10]), uint64_t(g[REG_R11]),
      uint64_t(g[REG_R12]), uint64_t(g[REG_R13]), uint64_t(g[REG_R14]), uint64_t(g[REG_R15])};
  const amx::Fault f = t->tm.execute(op, regs, rip + op.length);
  if (f != amx::Fault::none && !t->faults++) t->first_error = op.text() + ": " + amx::fault_name(f);
  g[REG_RIP] = greg_t(rip + op.length);
}

// A generated AMX kernel in executable memory plus its log, run under the trap handler.
struct AmxKernel {
  KernelKey key;
  std::vector<uint8_t> code;
  std::map<uint32_t, AmxOp> log;
  ExecutableCode exec;
};

AmxKernel* amx_kernel(const KernelKey& key) {
  static std::map<uint64_t, std::unique_ptr<AmxKernel>> cache;
  auto& slot = cache[key.packed()];
  if (!slot) {
    slot = std::make_unique<AmxKernel>();
    slot->key = key;
    std::vector<AmxOp> log;
    slot->code = x64::generate_amx_gemm(key, &log);
    for (auto& o : log) slot->log[o.offset] = o;
    std::string err;
    slot->exec = ExecutableCode::publish(slot->code.data(), slot->code.size(), &err);
  }
  return slot.get();
}

const bool kNativeAmx = level_usable(IsaLevel::amx, cpu_features());

// Runs the kernel on `args`; returns an error text (empty when clean).
std::string run_amx(AmxKernel* k, const GemmArgs& args, Trap* trap) {
  if (!k->exec) return "executable memory refused";
  const auto fn = reinterpret_cast<GemmFn>(const_cast<void*>(k->exec.entry()));
  if (kNativeAmx) {
    fn(&args);
    return "";
  }
  if (int(detected_isa()) < int(IsaLevel::avx512)) {
    // No AVX-512 for the epilogue either: the whole kernel runs in the x86-64 interpreter, its
    // tile instructions in the same tile model, each checked against the generator's log.
    test::EmuOptions opt;
    opt.on_amx = [&](const AmxOp& op) {
      ++trap->traps;
      const auto it = k->log.find(op.offset);
      if (it == k->log.end() || !it->second.same_instruction(op)) {
        if (!trap->mismatches++) trap->first_error = "decoded " + op.text() + " not in the log";
      }
    };
    try {
      const test::EmuStats st = test::emulate_x64(k->code.data(), k->code.size(), &args, opt);
      trap->tm.counters = st.amx;
      if (st.tiles_configured_at_exit) return "tiles still configured after the kernel returned";
    } catch (const std::exception& e) {
      return e.what();
    }
    return trap->mismatches ? trap->first_error : "";
  }
  trap->lo = reinterpret_cast<uintptr_t>(k->exec.entry());
  trap->hi = trap->lo + k->code.size();
  trap->log = &k->log;
  struct sigaction sa = {}, old = {};
  sa.sa_sigaction = on_sigill;
  sa.sa_flags = SA_SIGINFO;
  sigemptyset(&sa.sa_mask);
  g_trap = trap;
  sigaction(SIGILL, &sa, &old);
  fn(&args);
  sigaction(SIGILL, &old, nullptr);
  g_trap = nullptr;
  if (trap->faults || trap->mismatches) return trap->first_error;
  if (trap->tm.configured()) return "tiles still configured after the kernel returned";
  return "";
}

struct Problem {
  Epilogue epi;
  int64_t M, N, K;
  uint32_t seed;
  std::string repro() const {
    std::ostringstream s;
    s << "epi=" << int(epi) << " M=" << M << " N=" << N << " K=" << K << " seed=" << seed;
    return s.str();
  }
};

// Executes one problem three ways: AMX kernels (16-row blocks, then one block of the remaining
// rows through a kernel with fewer tile rows), gemm_ref with the same keys, and (when it runs
// here) the avx512_vnni kernels the way the executor splits rows. All three must agree bitwise.
void check_problem(const Problem& p, uint64_t* traps, uint64_t* dps,
                   WeightFormat fmt = WeightFormat::int8) {
  const int sources = p.epi == Epilogue::siluup ? 2 : 1;
  const bool int4 = fmt == WeightFormat::int4;  // AMX-INT8 over the strip decoded to int8
  const auto l = formats::StripLayout::make(p.N, p.K, 16, kStripVecs, sources, int4 ? 4 : 8);
  std::mt19937 rng(p.seed);
  std::uniform_int_distribution<int> qd(-127, 127);
  std::vector<std::vector<int8_t>> q(size_t(sources), std::vector<int8_t>(size_t(p.N * p.K)));
  std::vector<std::vector<float>> d(size_t(sources), std::vector<float>(size_t(p.N)));
  for (int s = 0; s < sources; ++s) {
    for (auto& x : q[size_t(s)]) x = int8_t(int4 ? 16 * (qd(rng) % 8) : qd(rng));  // 16 * q4
    for (auto& x : d[size_t(s)]) x = 0.001f + 0.02f * float(rng() % 1000) / 1000.0f;
  }
  const int8_t* qs[2] = {q[0].data(), q.back().data()};
  const float* ds[2] = {d[0].data(), d.back().data()};
  std::vector<int8_t> w(size_t(l.total_bytes()));
  std::vector<float> scale(size_t(l.total_cols()));
  std::vector<int32_t> comp(size_t(l.total_cols()));
  formats::pack_int8_strips(l, qs, ds, w.data(), scale.data(), comp.data(), false);

  const int64_t lda = l.padded_k() + 24;
  std::vector<int8_t> a(size_t(p.M * lda));
  for (auto& x : a) x = int8_t(qd(rng));
  formats::flip_sign_bits(a.data(), int64_t(a.size()));  // a + 128, the VNNI/AMX form
  std::vector<float> as = test::random_floats(size_t(p.M), p.seed + 2, 0.01f);
  for (auto& x : as) x = std::fabs(x) + 1e-3f;
  std::vector<float> rw = test::random_floats(size_t(p.M), p.seed + 3, 1.0f);
  const int64_t stride = l.total_cols() + 16;
  const std::vector<float> init = test::random_floats(size_t(p.M * stride), p.seed + 4, 0.5f);
  std::vector<float> out_amx = init, out_ref = init, out_vnni = init;
  auto rows_of = [&](std::vector<float>& buf) {
    std::vector<float*> r;
    for (int64_t m = 0; m < p.M; ++m) r.push_back(buf.data() + ((m * 7) % p.M) * stride);
    return r;
  };
  std::vector<float*> r_amx = rows_of(out_amx), r_ref = rows_of(out_ref),
                      r_vnni = rows_of(out_vnni);
  const int full_cols = l.strip_cols(l.strip_vecs);
  std::vector<int8_t> scratch(size_t(l.k4 * 64 * kStripVecs));  // int4: the decoded strip
  auto args_for = [&](int64_t s0, int64_t ns, int64_t row0, int64_t blocks,
                      std::vector<float*>& rows) {
    GemmArgs g{};
    g.a = a.data() + row0 * lda;
    g.lda = lda;
    g.w = w.data() + l.strip_offset(s0);
    g.n_strips = ns;
    g.k4 = l.k4;
    g.a_scale = as.data() + row0;
    g.w_scale = scale.data() + s0 * full_cols;
    g.w_comp = comp.data() + s0 * full_cols;
    g.out_rows = rows.data() + row0;
    g.out_col = s0 * gemm_strip_out_cols(IsaLevel::amx, l.strip_vecs, p.epi);
    g.row_weight = rw.data() + row0;
    g.m_blocks = blocks;
    g.scratch = int4 ? scratch.data() : nullptr;
    return g;
  };
  for (int part = 0; part < 2; ++part) {
    const int64_t s0 = part ? l.full_strips : 0;
    const int64_t ns = part ? (l.tail_vecs ? 1 : 0) : l.full_strips;
    const int nv = part ? l.tail_vecs : l.strip_vecs;
    if (ns == 0) continue;
    // AMX: 16-row blocks, then the remaining rows as one block of a shorter tile.
    const int64_t blocks = p.M / 16, rem = p.M % 16;
    for (int step = 0; step < 2; ++step) {
      const int m_r = step ? int(rem) : 16;
      const int64_t nb = step ? (rem ? 1 : 0) : blocks, row0 = step ? blocks * 16 : 0;
      if (nb == 0) continue;
      const KernelKey key = amx_key(m_r, nv, p.epi, fmt);
      Trap trap;
      const std::string err = run_amx(amx_kernel(key), args_for(s0, ns, row0, nb, r_amx), &trap);
      ASSERT_EQ(err, "") << key.name() << " " << p.repro();
      *traps += trap.traps;
      *dps += trap.tm.counters.dp;
      if (!kNativeAmx) {
        // once at entry, and per M block twice more (the tail's and back) when K has a tail
        const uint64_t tails = l.k4 % 16 ? uint64_t(nb) * uint64_t(ns) : 0u;
        EXPECT_EQ(trap.tm.counters.ldtilecfg, 1u + 2u * tails);
        EXPECT_EQ(trap.tm.counters.tilerelease, 1u);
        // One TDPBUSD per vector per K block (full and tail) per M block per strip.
        const uint64_t kb = uint64_t(l.k4 / 16 + (l.k4 % 16 ? 1 : 0));
        EXPECT_EQ(trap.tm.counters.dp, kb * uint64_t(nv) * uint64_t(nb) * uint64_t(ns));
      }
      gemm_ref(key, args_for(s0, ns, row0, nb, r_ref));
    }
    // The avx512_vnni kernels, split as the executor splits rows at that level.
    if (int(selected_isa()) >= int(IsaLevel::avx512_vnni)) {
      auto vkey = [&](KernelKind kind, int m_r) {
        KernelKey k = amx_key(m_r, nv, p.epi, fmt);
        k.isa = IsaLevel::avx512_vnni;
        k.kind = kind;
        return k;
      };
      const int mr = gemm_max_rows(IsaLevel::avx512_vnni);
      int64_t row = 0;
      auto run = [&](const KernelKey& k, int64_t row0, int64_t nb) {
        const Kernel* kk = KernelCache::instance().get(k);
        ASSERT_NE(kk, nullptr);
        GemmArgs g = args_for(s0, ns, row0, nb, r_vnni);
        reinterpret_cast<GemmFn>(const_cast<void*>(kk->entry()))(&g);
      };
      if (p.M > mr) {
        run(vkey(KernelKind::gemm_prefill, mr), 0, p.M / mr);
        row = p.M / mr * mr;
      }
      if (p.M > row) run(vkey(KernelKind::gemm_decode, int(p.M - row)), row, 1);
    }
  }
  ASSERT_EQ(0, std::memcmp(out_amx.data(), out_ref.data(), out_amx.size() * 4))
      << "AMX kernels differ from gemm_ref: " << p.repro() << (int4 ? " int4" : "");
  if (int(selected_isa()) >= int(IsaLevel::avx512_vnni))
    ASSERT_EQ(0, std::memcmp(out_amx.data(), out_vnni.data(), out_amx.size() * 4))
        << "AMX kernels differ from the avx512_vnni kernels: " << p.repro();
}

TEST(AmxExecution, TileModelRunMatchesReferenceBitwise) {
  if (int(detected_isa()) < int(IsaLevel::avx512) && !test::interpreter_enabled())
    GTEST_SKIP() << "no AVX-512 for the epilogue here and KT_JIT_TEST_INTERPRET=0";
  // The epilogue is AVX-512F: on a machine without it the whole kernel runs in the x86-64
  // interpreter (AMX itself is modelled either way).
  const int64_t Ms[] = {1, 5, 16, 17, 33, 40};
  const int64_t Ns[] = {16, 40, 64, 100, 130};
  const int64_t Ks[] = {4, 60, 64, 68, 130, 256, 300};
  uint32_t seed = 100;
  uint64_t traps = 0, dps = 0;
  size_t n = 0;
  for (Epilogue epi : {Epilogue::store, Epilogue::siluup, Epilogue::accum})
    for (int64_t M : Ms)
      for (int64_t N : Ns)
        for (int64_t K : Ks) {
          check_problem({epi, M, N, K, seed++}, &traps, &dps);
          if (HasFatalFailure()) return;
          ++n;
          if (M == 1 || M == 33 || N == 40) continue;  // int4 (decoded to int8): a subset
          check_problem({epi, M, N, K, seed++}, &traps, &dps, WeightFormat::int4);
          if (HasFatalFailure()) return;
          ++n;
        }
  EXPECT_EQ(n, 3u * 6 * 5 * 7 + 3u * 4 * 4 * 7);
  if (!kNativeAmx) EXPECT_GT(dps, 1000u);
  std::printf(
      "[ AMX      ] %zu problems (int8, int4), %llu tile instructions trapped and modelled "
      "(%llu TDPBUSD)\n",
      n, static_cast<unsigned long long>(traps), static_cast<unsigned long long>(dps));
}

// AMX-BF16: the same split (16-row blocks, then one shorter block) against gemm_ref's TDPBF16PS
// twin bit for bit, and the twin against a float64 dot product of the same bf16 values within
// the bound of its fp32 roundings (store epilogue).
void check_problem_bf16(const Problem& p, uint64_t* traps, uint64_t* dps) {
  test::Bf16Case c = test::make_bf16_case(p.epi, p.M, p.N, p.K, p.seed);
  std::vector<float> out_amx = c.out, out_ref = c.out;
  auto rows_of = [&](std::vector<float>& buf) {
    std::vector<float*> r;
    for (int64_t m = 0; m < p.M; ++m) r.push_back(buf.data() + ((m * 7) % p.M) * c.stride);
    return r;
  };
  std::vector<float*> r_amx = rows_of(out_amx), r_ref = rows_of(out_ref);
  const int full_cols = c.l.strip_cols(c.l.strip_vecs);
  auto args_for = [&](int64_t s0, int64_t ns, int64_t row0, int64_t blocks,
                      std::vector<float*>& rows) {
    GemmArgs g{};
    g.a = reinterpret_cast<const int8_t*>(c.a.data()) + row0 * c.lda;
    g.lda = c.lda;
    g.w = reinterpret_cast<const int8_t*>(c.w.data()) + c.l.strip_offset(s0);
    g.n_strips = ns;
    g.k4 = c.l.k4;
    g.a_scale = c.ones.data() + row0;
    g.w_scale = c.scale.data() + s0 * full_cols;
    g.w_comp = c.comp.data() + s0 * full_cols;
    g.out_rows = rows.data() + row0;
    g.out_col = s0 * gemm_strip_out_cols(IsaLevel::amx, c.l.strip_vecs, p.epi);
    g.row_weight = c.rw.data() + row0;
    g.m_blocks = blocks;
    g.scratch = nullptr;  // bf16 strips are k pairs already: B tiles load them in place
    return g;
  };
  for (int part = 0; part < 2; ++part) {
    const int64_t s0 = part ? c.l.full_strips : 0;
    const int64_t ns = part ? (c.l.tail_vecs ? 1 : 0) : c.l.full_strips;
    const int nv = part ? c.l.tail_vecs : c.l.strip_vecs;
    if (ns == 0) continue;
    const int64_t blocks = p.M / 16, rem = p.M % 16;
    for (int step = 0; step < 2; ++step) {
      const int m_r = step ? int(rem) : 16;
      const int64_t nb = step ? (rem ? 1 : 0) : blocks, row0 = step ? blocks * 16 : 0;
      if (nb == 0) continue;
      const KernelKey key = amx_key(m_r, nv, p.epi, WeightFormat::bf16);
      Trap trap;
      const std::string err = run_amx(amx_kernel(key), args_for(s0, ns, row0, nb, r_amx), &trap);
      ASSERT_EQ(err, "") << key.name() << " " << p.repro();
      *traps += trap.traps;
      *dps += trap.tm.counters.dp;
      if (!kNativeAmx) {
        const uint64_t pairs = uint64_t(p.K / 2), kb = pairs / 16 + (pairs % 16 ? 1 : 0);
        EXPECT_EQ(trap.tm.counters.dp, kb * uint64_t(nv) * uint64_t(nb) * uint64_t(ns));
      }
      gemm_ref(key, args_for(s0, ns, row0, nb, r_ref));
    }
  }
  ASSERT_EQ(0, std::memcmp(out_amx.data(), out_ref.data(), out_amx.size() * 4))
      << "AMX-BF16 kernels differ from gemm_ref" << (kNativeAmx ? " (native AMX)" : "") << ": "
      << p.repro();
  if (p.epi != Epilogue::store) return;
  // The twin against float64 over the same bf16 values: per element at most ~K/16 + 17 fp32
  // roundings of partial sums bounded by sum |a w| (no subnormals in this data).
  for (int64_t m = 0; m < p.M; ++m)
    for (int64_t n = 0; n < p.N; ++n) {
      double mag;
      const double dot = test::bf16_dot64(c, m, n, p.K, &mag);
      const float got = r_ref[size_t(m)][n];
      const double bound = (double(p.K) / 16 + 18) * std::ldexp(1.0, -24) * mag + 1e-30;
      ASSERT_LE(std::fabs(double(got) - dot), bound) << p.repro() << " m=" << m << " n=" << n;
    }
}

TEST(AmxExecution, Bf16TileRunMatchesReferenceBitwise) {
  if (int(detected_isa()) < int(IsaLevel::avx512) && !test::interpreter_enabled())
    GTEST_SKIP() << "no AVX-512 for the epilogue here and KT_JIT_TEST_INTERPRET=0";
  const int64_t Ms[] = {1, 16, 17, 40};
  const int64_t Ns[] = {16, 64, 100};
  const int64_t Ks[] = {2, 30, 32, 34, 96, 130};
  uint32_t seed = 500;
  uint64_t traps = 0, dps = 0;
  size_t n = 0;
  for (Epilogue epi : {Epilogue::store, Epilogue::siluup, Epilogue::accum})
    for (int64_t M : Ms)
      for (int64_t N : Ns)
        for (int64_t K : Ks) {
          check_problem_bf16({epi, M, N, K, seed++}, &traps, &dps);
          if (HasFatalFailure()) return;
          ++n;
        }
  if (!kNativeAmx) EXPECT_GT(dps, 100u);
  std::printf(
      "[ AMX-BF16 ] %zu problems, %llu tile instructions trapped and modelled "
      "(%llu TDPBF16PS)\n",
      n, static_cast<unsigned long long>(traps), static_cast<unsigned long long>(dps));
}

// ---- AMX-BF16 over decoded strips: fp8 (per-group fold), mxfp4, mxfp8 ----------------------

// e4m3fn from its definition (independent of the kernels' bit tricks); NaN codes -> 480 (the
// project's documented choice, jit/gemm.hpp fp8_value).
double e4m3_def(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  const double mag = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
  return b & 0x80 ? -mag : mag;
}

struct DecProblem {
  WeightFormat fmt;
  Epilogue epi;
  uint8_t variant;
  int64_t M, N, K;
  bool fp8_block;  // fp8: 128 x 128 block scales, else one scale per row (one group over K)
  uint32_t seed;
  std::string repro() const {
    std::ostringstream s;
    s << "fmt=" << int(fmt) << " epi=" << int(epi) << " variant=" << int(variant) << " M=" << M
      << " N=" << N << " K=" << K << " block=" << fp8_block << " seed=" << seed;
    return s.str();
  }
};

// The AMX kernels (16-row blocks, then one shorter block) against gemm_ref bit for bit, and
// gemm_ref against a float64 dot product of the bf16 activations and the weights decoded from
// their definitions (store epilogue) within the bound of its fp32 roundings.
void check_problem_decoded(const DecProblem& p, uint64_t* dps, uint64_t* cfgs) {
  const bool fp8 = p.fmt == WeightFormat::fp8, fp4 = p.fmt == WeightFormat::mxfp4;
  const int sources = p.epi == Epilogue::siluup ? 2 : 1;
  std::mt19937 rng(p.seed);
  formats::StripLayout l;
  std::vector<uint8_t> w;
  std::vector<float> scale, gscale;
  std::vector<int32_t> comp;
  std::vector<std::vector<uint8_t>> src, scl;  // per source: weight bytes, mx exponents
  std::vector<std::vector<float>> fs;          // per source: fp8 block or row scales
  const int64_t nb = (p.N + 127) / 128, kb = (p.K + 127) / 128;
  const int64_t row_bytes = fp4 ? p.K / 2 : p.K;
  for (int s = 0; s < sources; ++s) {
    src.emplace_back(size_t(p.N * row_bytes));
    for (auto& b : src.back()) b = uint8_t(rng() & 0xff);  // every code, NaN codes included
    if (fp8) {
      fs.push_back(test::random_floats(size_t(p.fp8_block ? nb * kb : p.N), p.seed + 7 + s));
      for (auto& v : fs.back()) v = std::fabs(v) * 0.01f + 1e-4f;
    } else {
      scl.emplace_back(size_t(p.N * p.K / 32));
      for (auto& e : scl.back()) {  // ordinary magnitudes, now and then tiny (subnormal) ones
        const uint32_t r = rng() % 64;
        e = uint8_t(r == 0 ? 0 : r == 1 ? 1 : r == 2 ? 9 : (fp4 ? 121 : 116) + int(r % 8));
      }
    }
  }
  const uint8_t* ws[2] = {src[0].data(), src.back().data()};
  if (fp8) {
    l = formats::StripLayout::make(p.N, p.K, 16, kStripVecs, sources, 8, 1,
                                   p.fp8_block ? 128 : p.K);
    w.resize(size_t(l.total_bytes()));
    scale.resize(size_t(l.total_cols()));
    comp.resize(size_t(l.total_cols()));
    gscale.resize(size_t(std::max<int64_t>(l.gscale_floats(), 1)));
    const float* ss[2] = {fs[0].data(), fs.back().data()};
    formats::pack_fp8_strips(l, ws, p.fp8_block ? ss : nullptr, p.fp8_block ? nullptr : ss,
                             w.data(), scale.data(), comp.data(), gscale.data());
  } else {
    l = formats::mx_layout(p.N, p.K, 16, kStripVecs, sources, fp4);
    w.resize(size_t(l.total_bytes()));
    scale.assign(size_t(l.total_cols()), 1.0f);
    comp.assign(size_t(l.total_cols()), 0);
    const uint8_t* es[2] = {scl[0].data(), scl.back().data()};
    formats::pack_mx_strips(l, fp4, ws, row_bytes, es, p.K / 32, w.data());
  }
  const int64_t lda = p.K * 2 + 64;  // bf16 rows
  std::vector<uint16_t> a(size_t(p.M * lda / 2));
  const std::vector<float> af = test::random_floats(a.size(), p.seed + 1, 2.0f);
  for (size_t i = 0; i < a.size(); ++i) a[i] = formats::f32_to_bf16(af[i]);
  std::vector<float> ones(size_t(p.M), 1.0f);
  const std::vector<float> rw = test::random_floats(size_t(p.M), p.seed + 3, 1.0f);
  const int64_t stride = l.total_cols() + 16;
  const std::vector<float> init = test::random_floats(size_t(p.M * stride), p.seed + 4, 0.5f);
  std::vector<float> out_amx = init, out_ref = init;
  auto rows_of = [&](std::vector<float>& buf) {
    std::vector<float*> r;
    for (int64_t m = 0; m < p.M; ++m) r.push_back(buf.data() + ((m * 7) % p.M) * stride);
    return r;
  };
  std::vector<float*> r_amx = rows_of(out_amx), r_ref = rows_of(out_ref);
  std::vector<uint8_t> scratch(size_t(l.k4 * 32 * kStripVecs));
  const int full_cols = l.strip_cols(l.strip_vecs);
  auto args_for = [&](int64_t s0, int64_t ns, int64_t row0, int64_t blocks,
                      std::vector<float*>& rows) {
    GemmArgs g{};
    g.a = reinterpret_cast<const int8_t*>(a.data()) + row0 * lda;
    g.lda = lda;
    g.w = reinterpret_cast<const int8_t*>(w.data()) + l.strip_offset(s0);
    g.n_strips = ns;
    g.k4 = l.k4;
    g.a_scale = ones.data() + row0;
    g.w_scale = scale.data() + s0 * full_cols;
    g.w_comp = comp.data() + s0 * full_cols;
    g.out_rows = rows.data() + row0;
    g.out_col = s0 * gemm_strip_out_cols(IsaLevel::amx, l.strip_vecs, p.epi);
    g.row_weight = rw.data() + row0;
    g.m_blocks = blocks;
    g.w_gscale = fp8 ? gscale.data() + s0 * l.gscale_floats_per_strip() : nullptr;
    g.g_steps = l.g_steps;
    g.g_per_strip = l.groups();
    g.swiglu_limit = 3.0f;
    g.swiglu_alpha = 1.702f;
    g.scratch = scratch.data();
    return g;
  };
  // fp8 tile K blocks per M block: per group ceil(pairs / 16); mx: K / 32.
  // Each group with a tail of pairs reconfigures the tiles twice (the tail's and back).
  uint64_t kblocks = 0, tails = 0;
  {
    const int64_t pairs = p.K / 2, gp = fp8 ? std::min(l.g_steps, p.K) / 2 : pairs;
    for (int64_t g0 = 0; g0 < pairs; g0 += gp) {
      const int64_t gl = std::min(gp, pairs - g0);
      kblocks += uint64_t((gl + 15) / 16);
      tails += gl % 16 ? 1u : 0u;
    }
  }
  for (int part = 0; part < 2; ++part) {
    const int64_t s0 = part ? l.full_strips : 0;
    const int64_t ns = part ? (l.tail_vecs ? 1 : 0) : l.full_strips;
    const int nv = part ? l.tail_vecs : l.strip_vecs;
    if (ns == 0) continue;
    const int64_t blocks = p.M / 16, rem = p.M % 16;
    for (int step = 0; step < 2; ++step) {
      const int m_r = step ? int(rem) : 16;
      const int64_t nblk = step ? (rem ? 1 : 0) : blocks, row0 = step ? blocks * 16 : 0;
      if (nblk == 0) continue;
      KernelKey key = amx_key(m_r, nv, p.epi, p.fmt);
      key.variant = p.variant;
      Trap trap;
      const std::string err = run_amx(amx_kernel(key), args_for(s0, ns, row0, nblk, r_amx), &trap);
      ASSERT_EQ(err, "") << key.name() << " " << p.repro();
      *dps += trap.tm.counters.dp;
      *cfgs += trap.tm.counters.ldtilecfg;
      if (!kNativeAmx) {
        EXPECT_EQ(trap.tm.counters.dp, kblocks * uint64_t(nv) * uint64_t(nblk) * uint64_t(ns))
            << p.repro();
        // once at entry, and per M block twice per tail
        EXPECT_EQ(trap.tm.counters.ldtilecfg, 1u + 2u * tails * uint64_t(nblk) * uint64_t(ns))
            << p.repro();
      }
      gemm_ref(key, args_for(s0, ns, row0, nblk, r_ref));
    }
  }
  ASSERT_EQ(0, std::memcmp(out_amx.data(), out_ref.data(), out_amx.size() * 4))
      << "AMX-BF16 kernels of a decoded format differ from gemm_ref"
      << (kNativeAmx ? " (native AMX)" : "") << ": " << p.repro();
  if (p.epi != Epilogue::store) return;
  // gemm_ref against float64 over the definitions: activations as bf16, weights decoded from the
  // checkpoint bytes and scales. Bound: per element ~K/16 + 3 * groups + 20 fp32 roundings of
  // partial sums bounded by sum |a w|, plus what flushing bf16-subnormal weights (tiny mx scales)
  // drops, below 2^-126 * sum |a| each.
  std::vector<float> deq(size_t(p.K));
  for (int64_t m = 0; m < p.M; ++m)
    for (int64_t n = 0; n < p.N; ++n) {
      if (fp8) {
        for (int64_t k = 0; k < p.K; ++k)
          deq[size_t(k)] = float(e4m3_def(src[0][size_t(n * p.K + k)]));  // scale applied below
      } else {
        formats::mx_dequantize_row(fp4, src[0].data() + n * row_bytes,
                                   scl[0].data() + n * (p.K / 32), p.K, deq.data());
      }
      double dot = 0, mag = 0, asum = 0;
      for (int64_t k = 0; k < p.K; ++k) {
        const double x = formats::bf16_to_f32(a[size_t(m * lda / 2 + k)]);
        double y = deq[size_t(k)];
        if (fp8) y *= p.fp8_block ? fs[0][size_t((n / 128) * kb + k / 128)] : fs[0][size_t(n)];
        dot += x * y;
        mag += std::fabs(x * y);
        asum += std::fabs(x);
      }
      const float got = r_ref[size_t(m)][n];
      const double bound = (double(p.K) / 16 + 3.0 * double(kb) + 20) * std::ldexp(1.0, -24) * mag +
                           std::ldexp(asum, -126) + 1e-37;
      ASSERT_LE(std::fabs(double(got) - dot), bound) << p.repro() << " m=" << m << " n=" << n;
    }
}

TEST(AmxExecution, DecodedFormatTileRunsMatchReferenceBitwise) {
  if (int(detected_isa()) < int(IsaLevel::avx512) && !test::interpreter_enabled())
    GTEST_SKIP() << "no AVX-512 for the decode and epilogue here and KT_JIT_TEST_INTERPRET=0";
  const int64_t Ms[] = {1, 16, 17, 33};
  const int64_t Ns[] = {16, 100};
  uint32_t seed = 900;
  uint64_t dps = 0, cfgs = 0;
  size_t n = 0;
  auto run = [&](const DecProblem& p) {
    check_problem_decoded(p, &dps, &cfgs);
    ++n;
  };
  for (Epilogue epi : {Epilogue::store, Epilogue::siluup, Epilogue::accum})
    for (int64_t M : Ms)
      for (int64_t N : Ns) {
        // fp8, 128-wide groups: whole groups, a short last group with another tail (300: 22
        // pairs after two of 64), one with the same (tail 0: 128 + 96... 224: 48 pairs), and
        // one scale per row (one group: K = 2, 34, 130).
        for (int64_t K : {128, 224, 300}) {
          run({WeightFormat::fp8, epi, 0, M, N, K, true, seed++});
          if (HasFatalFailure()) return;
        }
        for (int64_t K : {2, 34, 130}) {
          run({WeightFormat::fp8, epi, 0, M, N, K, false, seed++});
          if (HasFatalFailure()) return;
        }
        for (WeightFormat f : {WeightFormat::mxfp4, WeightFormat::mxfp8})
          for (int64_t K : {32, 96}) {
            const uint8_t variant = epi != Epilogue::siluup ? 0
                                    : K == 32               ? kSwigluClamp
                                                            : uint8_t(kSwigluClamp | kSwigluAlpha);
            run({f, epi, variant, M, N, K, false, seed++});
            if (HasFatalFailure()) return;
          }
      }
  if (!kNativeAmx) {
    EXPECT_GT(dps, 1000u);
    EXPECT_GT(cfgs, n);  // the short-last-group reconfiguration ran
  }
  std::printf("[ AMX-BF16 ] %zu decoded-format problems (fp8, mxfp4, mxfp8), %llu TDPBF16PS\n", n,
              static_cast<unsigned long long>(dps));
}

// A whole layer at isa amx through the x86-64 interpreter (AMX in the tile model): FP8, its
// per-channel form, MXFP4 and MXFP8 (with SwiGLU variants) equal their twins bit for bit with 1
// and 2 threads, and differ from the avx512_bf16 layer where experts reach 16 rows (the AMX tier
// ran), while staying close to it.
TEST(AmxSelection, DecodedFormatLayersRunTheAmxTierAndMatchTheirTwin) {
  if (!kNativeAmx && !(test::emulated_level(IsaLevel::amx) && test::interpreter_enabled()))
    GTEST_SKIP() << "no AMX here and the x86-64 interpreter is off (KT_JIT_TEST_INTERPRET=0)";
  test::InterpretedExecutor interpret(IsaLevel::amx);
  ThreadPool p1(1, 1), p2(2, 1);
  uint32_t seed = 1300;
  for (const char* method : {"FP8", "FP8_PERCHANNEL", "MXFP4", "MXFP8"}) {
    const bool fp8 = std::string(method).rfind("FP8", 0) == 0;
    const bool fp4 = std::string(method) == "MXFP4", block = std::string(method) == "FP8";
    // fp8: I = 200 leaves down a last 128-group of 72 k (another tail shape); mx: K % 32 == 0
    const MoEShape shape{4, 2, 256, fp8 ? 200 : 160};
    const int64_t E = shape.experts, H = shape.hidden, I = shape.intermediate;
    std::mt19937 rng(seed++);
    auto bytes = [&](int64_t n) {
      std::vector<uint8_t> v(static_cast<size_t>(n));
      for (auto& b : v) {
        b = uint8_t(rng() & 0xff);
        if (fp8 && (b & 0x7f) == 0x7f) b ^= 1;  // finite codes only: the outputs stay finite
      }
      return v;
    };
    auto exps = [&](int64_t n) {  // ue8m0 around 2^-6 (mxfp8: the stored e + 8 is implied)
      std::vector<uint8_t> v(static_cast<size_t>(n));
      for (auto& e : v) e = uint8_t(118 + rng() % 6);
      return v;
    };
    auto fscales = [&](int64_t n) {
      std::vector<float> v = test::random_floats(size_t(n), uint32_t(rng()), 1.0f);
      for (auto& x : v) x = std::fabs(x) * 0.02f + 1e-3f;
      return v;
    };
    const int64_t wb = fp4 ? 2 : 1;  // weights per byte
    std::vector<std::vector<uint8_t>> g, u, d, gs, us, ds;
    std::vector<std::vector<float>> gf, uf, df;
    for (int64_t e = 0; e < E; ++e) {
      g.push_back(bytes(I * H / wb));
      u.push_back(bytes(I * H / wb));
      d.push_back(bytes(H * I / wb));
      if (fp8) {
        gf.push_back(fscales(block ? ((I + 127) / 128) * ((H + 127) / 128) : I));
        uf.push_back(fscales(block ? ((I + 127) / 128) * ((H + 127) / 128) : I));
        df.push_back(fscales(block ? ((H + 127) / 128) * ((I + 127) / 128) : H));
      } else {
        gs.push_back(exps(I * H / 32));
        us.push_back(exps(I * H / 32));
        ds.push_back(exps(H * I / 32));
      }
    }
    auto load = [&](MoELayer& l) {
      if (fp8) {
        std::vector<MoELayer::Fp8ExpertSource> src;
        for (int64_t e = 0; e < E; ++e)
          src.push_back({e, g[size_t(e)].data(), u[size_t(e)].data(), d[size_t(e)].data(),
                         gf[size_t(e)].data(), uf[size_t(e)].data(), df[size_t(e)].data()});
        l.load_experts_fp8(src, p2);
      } else {
        std::vector<MoELayer::MxExpertSource> src;
        for (int64_t e = 0; e < E; ++e)
          src.push_back({e, g[size_t(e)].data(), u[size_t(e)].data(), d[size_t(e)].data(),
                         gs[size_t(e)].data(), us[size_t(e)].data(), ds[size_t(e)].data()});
        l.load_experts_mx(src, p2);
        l.set_swiglu(fp4 ? 6.0f : 0.0f, fp4 ? 1.702f : 0.0f);
      }
    };
    MoELayer amx(shape, method, IsaLevel::amx), avx(shape, method, IsaLevel::avx512_bf16);
    load(amx);
    load(avx);
    for (int64_t T : {3, 40}) {  // ~1.5 rows an expert (no tiles), ~20 (16-row AMX tiles)
      const std::vector<float> x = test::random_floats(size_t(T * H), seed++, 1.0f);
      std::vector<int64_t> ids(size_t(T * 2));
      std::vector<float> w = test::random_floats(size_t(T * 2), seed++, 1.0f);
      for (int64_t t = 0; t < T; ++t) {
        ids[size_t(2 * t)] = int64_t(rng() % 4);
        ids[size_t(2 * t + 1)] = (ids[size_t(2 * t)] + 1 + int64_t(rng() % 3)) % 4;
      }
      auto fwd = [&](MoELayer& l, ThreadPool& p, bool ref) {
        std::vector<float> out(size_t(T * H));
        l.forward(T, x.data(), ids.data(), w.data(), nullptr, out.data(), p, ref);
        return out;
      };
      const auto ref = fwd(amx, p1, true), a = fwd(amx, p1, false), b = fwd(amx, p2, false);
      const auto v = fwd(avx, p1, false);
      const std::string where = std::string(method) + " T=" + std::to_string(T);
      ASSERT_EQ(test::InterpretedExecutor::errors(), "") << where;
      ASSERT_EQ(0, std::memcmp(a.data(), ref.data(), a.size() * 4)) << where;
      ASSERT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4)) << "1 vs 2 threads " << where;
      EXPECT_EQ(T == 40, std::memcmp(a.data(), v.data(), a.size() * 4) != 0) << where;
      double num = 0, den = 0;
      for (size_t i = 0; i < a.size(); ++i) {
        ASSERT_TRUE(std::isfinite(a[i])) << where << " i=" << i;
        num += std::fabs(double(a[i]) - v[i]);
        den += std::fabs(double(v[i]));
      }
      EXPECT_LT(num, 1e-2 * den) << where << " (relative L1 against avx512_bf16)";
      if (T == 40) {  // what bf16 activations cost (docs/FORMATS.md), against avx512_bf16
        int64_t rows[4] = {};
        for (int64_t id : ids) ++rows[id];
        std::printf(
            "[ AMX-BF16 ] %s layer, T = 40, rows per expert %lld %lld %lld %lld: relative "
            "L1 against the avx512_bf16 layer %.2e\n",
            method, (long long)rows[0], (long long)rows[1], (long long)rows[2], (long long)rows[3],
            num / den);
      }
    }
  }
}

// AMXINT4 at isa amx (through the interpreter where AMX is missing): experts with >= 16 rows run
// AMX-INT8 over the strip decoded to int8, whose int32 sums are exact, so the layer equals the
// avx512_bf16 (VNNI) layer and its own twin bit for bit, 1 and 2 threads.
TEST(AmxSelection, Int4LayerAtAmxEqualsTheVnniLayer) {
  if (!kNativeAmx && !(test::emulated_level(IsaLevel::amx) && test::interpreter_enabled()))
    GTEST_SKIP() << "no AMX here and the x86-64 interpreter is off (KT_JIT_TEST_INTERPRET=0)";
  test::InterpretedExecutor interpret(IsaLevel::amx);
  ThreadPool p1(1, 1), p2(2, 1);
  const MoEShape shape{4, 2, 192, 136};
  const int64_t E = 4, H = shape.hidden, I = shape.intermediate, T = 40;
  const auto gate = test::random_floats(size_t(E * I * H), 11, 0.1f);
  const auto up = test::random_floats(size_t(E * I * H), 12, 0.1f);
  const auto down = test::random_floats(size_t(E * H * I), 13, 0.1f);
  MoELayer amx(shape, "AMXINT4", IsaLevel::amx), vnni(shape, "AMXINT4", IsaLevel::avx512_bf16);
  for (MoELayer* l : {&amx, &vnni})
    l->load_from_float(gate.data(), up.data(), down.data(), SourceDType::f32, nullptr, p2);
  const auto x = test::random_floats(size_t(T * H), 14, 1.0f);
  const auto w = test::random_floats(size_t(T * 2), 15, 1.0f);
  std::vector<int64_t> ids(size_t(T * 2));
  for (int64_t t = 0; t < T; ++t) {
    ids[size_t(2 * t)] = t % 4;
    ids[size_t(2 * t + 1)] = (t + 1 + t / 4 % 3) % 4;
  }
  auto fwd = [&](MoELayer& l, ThreadPool& p, bool ref) {
    std::vector<float> out(size_t(T * H));
    l.forward(T, x.data(), ids.data(), w.data(), nullptr, out.data(), p, ref);
    return out;
  };
  const auto a = fwd(amx, p1, false), b = fwd(amx, p2, false), r = fwd(amx, p1, true);
  const auto v = fwd(vnni, p1, false);
  ASSERT_EQ(test::InterpretedExecutor::errors(), "");
  EXPECT_EQ(0, std::memcmp(a.data(), r.data(), a.size() * 4)) << "twin";
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4)) << "1 vs 2 threads";
  EXPECT_EQ(0, std::memcmp(a.data(), v.data(), a.size() * 4)) << "avx512_bf16 layer";
  bool amx_kernel = false;
  for (const std::string& n : amx.kernel_names()) amx_kernel |= n.find("int4_amx") != n.npos;
  EXPECT_TRUE(amx_kernel);
}

// ---- selection: which kernels an amx layer uses ------------------------------------------------

TEST(AmxSelection, AmxLayerUsesAmxPrefillWhereAGeneratorExistsAndAvx512Otherwise) {
  const GemmKernelSet ks =
      make_gemm_kernel_set(IsaLevel::amx, WeightFormat::int8, Epilogue::siluup, 2);
  EXPECT_EQ(ks.tile_rows, 16);
  EXPECT_EQ(ks.tile_min_rows, 16);
  EXPECT_EQ(ks.tile_full.isa, IsaLevel::amx);
  EXPECT_EQ(ks.tile_full.kind, KernelKind::gemm_prefill);
  EXPECT_EQ(ks.tile_full.m_r, 16);
  EXPECT_EQ(ks.tile_full.n_vec, kStripVecs);
  EXPECT_EQ(ks.tile_tail.n_vec, 2);
  // decode and the remainder rows: the avx512_bf16 (VNNI) kernels, 6-row tiles
  EXPECT_EQ(ks.isa, IsaLevel::avx512_bf16);
  EXPECT_EQ(ks.max_rows, 6);
  for (const KernelKey& k : ks.decode_full) EXPECT_EQ(k.isa, IsaLevel::avx512_bf16);
  EXPECT_EQ(ks.prefill_full.isa, IsaLevel::avx512_bf16);
  // every key of an amx layer generates (AMX ones included)
  const auto keys = moe_kernel_keys(MoEShape{8, 2, 128, 80}, WeightFormat::int8, IsaLevel::amx);
  int amx_keys = 0;
  for (const KernelKey& k : keys) {
    amx_keys += k.isa == IsaLevel::amx;
    EXPECT_GT(KernelCache::generate_only(k)->code.size(), 100u) << k.name();
  }
  EXPECT_EQ(amx_keys, 3);  // gate/up full + tail strip (I = 80), down (H = 128: no tail)
  // bf16 at amx: AMX-BF16 prefill tiles the same way
  const GemmKernelSet b =
      make_gemm_kernel_set(IsaLevel::amx, WeightFormat::bf16, Epilogue::accum, 0);
  EXPECT_EQ(b.tile_rows, 16);
  EXPECT_EQ(b.tile_full.isa, IsaLevel::amx);
  EXPECT_EQ(b.tile_full.format, WeightFormat::bf16);
  // fp8 (K and group even) and mx at amx: AMX-BF16 tiles over the decoded strip, which take bf16
  // rows and a scratch; fp8 with an odd K and the formats without an AMX generator: none
  for (WeightFormat f : {WeightFormat::fp8, WeightFormat::mxfp4, WeightFormat::mxfp8}) {
    const GemmKernelSet o = make_gemm_kernel_set(IsaLevel::amx, f, Epilogue::siluup, 0,
                                                 f == WeightFormat::fp8 ? 0 : kSwigluClamp, true);
    EXPECT_EQ(o.tile_rows, 16);
    EXPECT_EQ(o.tile_full.isa, IsaLevel::amx);
    EXPECT_TRUE(amx_decoded_weight(o.tile_full));
    EXPECT_TRUE(block_pair_kernel(o.tile_full));
    EXPECT_TRUE(scratch_pair_kernel(o.tile_full));
    EXPECT_GT(KernelCache::generate_only(o.tile_full)->code.size(), 100u);
  }
  EXPECT_EQ(
      make_gemm_kernel_set(IsaLevel::amx, WeightFormat::int4, Epilogue::accum, 0).tile_full.isa,
      IsaLevel::amx);  // int4: AMX-INT8 over the strip decoded to int8
  EXPECT_TRUE(amx_int4_kernel(
      make_gemm_kernel_set(IsaLevel::amx, WeightFormat::int4, Epilogue::accum, 0).tile_full));
  for (WeightFormat f : {WeightFormat::fp8, WeightFormat::qgroup}) {
    const GemmKernelSet o = make_gemm_kernel_set(IsaLevel::amx, f, Epilogue::accum, 0);
    // (qgroup byte codes without a bias: the avx512_bf16 half-strip tier)
    if (f == WeightFormat::qgroup) {
      EXPECT_EQ(o.tile_rows, kHalfStripRowsVnni);
      EXPECT_TRUE(half_strip_kernel(o.tile_full));
    } else {
      EXPECT_EQ(o.tile_rows, 0);
    }
    for (const KernelKey& k : o.keys()) EXPECT_NE(k.isa, IsaLevel::amx);
  }
  // AMX generates int8, bf16, fp8 and mx prefill only; anything else is refused
  KernelKey bad = amx_key(16, 4, Epilogue::store, WeightFormat::qgroup);
  EXPECT_THROW(KernelCache::generate_only(bad), std::invalid_argument);
  bad = amx_key(16, 4, Epilogue::store, WeightFormat::mxfp4);
  bad.variant = kSwigluClamp;  // SwiGLU variants only on siluup
  EXPECT_THROW(KernelCache::generate_only(bad), std::invalid_argument);
  bad = amx_key(16, 4, Epilogue::store);
  bad.kind = KernelKind::gemm_decode;
  EXPECT_THROW(KernelCache::generate_only(bad), std::invalid_argument);
  bad = amx_key(17, 4, Epilogue::store);
  EXPECT_THROW(KernelCache::generate_only(bad), std::invalid_argument);
  bad = amx_key(16, 3, Epilogue::siluup);
  EXPECT_THROW(KernelCache::generate_only(bad), std::invalid_argument);
}

}  // namespace
}  // namespace ktjit
