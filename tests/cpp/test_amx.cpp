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
#include "jit/amx_model.hpp"
#include "jit/code_memory.hpp"
#include "jit/gemm.hpp"
#include "jit/kernel.hpp"
#include "jit/x64/amx_gemm.hpp"
#include "kernel_exec.hpp"
#include "runtime/moe_layer.hpp"
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
        keys.push_back(amx_key(m, nv, epi));
        keys.push_back(amx_key(m, nv, epi, WeightFormat::bf16));
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
void check_problem(const Problem& p, uint64_t* traps, uint64_t* dps) {
  const int sources = p.epi == Epilogue::siluup ? 2 : 1;
  const auto l = formats::StripLayout::make(p.N, p.K, 16, kStripVecs, sources, 8);
  std::mt19937 rng(p.seed);
  std::uniform_int_distribution<int> qd(-127, 127);
  std::vector<std::vector<int8_t>> q(size_t(sources), std::vector<int8_t>(size_t(p.N * p.K)));
  std::vector<std::vector<float>> d(size_t(sources), std::vector<float>(size_t(p.N)));
  for (int s = 0; s < sources; ++s) {
    for (auto& x : q[size_t(s)]) x = int8_t(qd(rng));
    for (auto& x : d[size_t(s)]) x = 0.001f + 0.02f * float(rng() % 1000) / 1000.0f;
  }
  const int8_t* qs[2] = {q[0].data(), q.back().data()};
  const float* ds[2] = {d[0].data(), d.back().data()};
  std::vector<int8_t> w(size_t(l.total_bytes()));
  std::vector<float> scale(size_t(l.total_cols()));
  std::vector<int32_t> comp(size_t(l.total_cols()));
  formats::pack_int8_strips(l, qs, ds, w.data(), scale.data(), comp.data());

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
      const KernelKey key = amx_key(m_r, nv, p.epi);
      Trap trap;
      const std::string err = run_amx(amx_kernel(key), args_for(s0, ns, row0, nb, r_amx), &trap);
      ASSERT_EQ(err, "") << key.name() << " " << p.repro();
      *traps += trap.traps;
      *dps += trap.tm.counters.dp;
      if (!kNativeAmx) {
        EXPECT_EQ(trap.tm.counters.ldtilecfg, 1u);
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
        KernelKey k = amx_key(m_r, nv, p.epi);
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
      << "AMX kernels differ from gemm_ref: " << p.repro();
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
        }
  EXPECT_EQ(n, 3u * 6 * 5 * 7);
  if (!kNativeAmx) EXPECT_GT(dps, 1000u);
  std::printf(
      "[ AMX      ] %zu problems, %llu tile instructions trapped and modelled (%llu TDPBUSD)\n", n,
      static_cast<unsigned long long>(traps), static_cast<unsigned long long>(dps));
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

// ---- selection: which kernels an amx layer uses ------------------------------------------------

TEST(AmxSelection, AmxLayerUsesAmxPrefillForInt8AndBf16AndAvx512Otherwise) {
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
  // other formats at amx: no AMX kernels (yet), the avx512_bf16 ones
  for (WeightFormat f : {WeightFormat::int4, WeightFormat::fp8}) {
    const GemmKernelSet o = make_gemm_kernel_set(IsaLevel::amx, f, Epilogue::accum, 0);
    EXPECT_EQ(o.tile_rows, 0);
    for (const KernelKey& k : o.keys()) EXPECT_NE(k.isa, IsaLevel::amx);
  }
  // AMX generates int8 and bf16 prefill only; anything else is refused
  KernelKey bad = amx_key(16, 4, Epilogue::store, WeightFormat::fp8);
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
