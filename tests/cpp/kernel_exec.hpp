// Running generated GEMM kernels from the tests: natively on the levels this CPU executes, in the
// x86-64 interpreter (x64_emu.hpp) on the x86 levels above them, so an AVX2-only machine still
// checks the AVX-512 kernels against their twins bit for bit.
//
// KT_JIT_TEST_DUAL=1 runs every native call a second time in the interpreter and fails on any
// bit of difference: that is how the interpreter itself is checked against the hardware (ctest
// runs the kernel sweeps once more that way, as `x64_emu_matches_hardware`).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "jit/gemm.hpp"
#include "jit/kernel.hpp"
#include "tests/cpp/test_util.hpp"

#if !defined(__aarch64__)
#include "tests/cpp/x64_emu.hpp"
#endif

namespace ktjit::test {

// KT_JIT_TEST_INTERPRET=0 turns the interpreter off (tests/emu/run_haswell.sh does: under qemu it
// would be emulated twice over, and the same binary already ran it natively).
inline bool interpreter_enabled() {
  const char* e = std::getenv("KT_JIT_TEST_INTERPRET");
  return !(e && std::strcmp(e, "0") == 0);
}

// Whether `isa`'s kernels run in the interpreter here (an x86 level this CPU cannot execute).
inline bool emulated_level(IsaLevel isa) {
#if defined(__aarch64__)
  (void)isa;
  return false;
#else
  return !isa_is_neon(isa) && isa != IsaLevel::ref && int(isa) > int(selected_isa());
#endif
}

inline bool dual_run() {
  const char* e = std::getenv("KT_JIT_TEST_DUAL");
  return e && std::strcmp(e, "0") != 0 && e[0] != '\0';
}

// The levels the kernel sweeps check: the runnable ones natively, then (x86) every AVX-512 level
// above them in the interpreter. AMX has its own tests (test_amx.cpp). A dual run checks the
// interpreter against the hardware, so it keeps to the native levels.
inline std::vector<IsaLevel> kernel_test_levels() {
  std::vector<IsaLevel> v = runnable_levels();
#if !defined(__aarch64__)
  for (int l = int(IsaLevel::avx2); l <= int(IsaLevel::avx512_bf16); ++l)
    if (emulated_level(IsaLevel(l)) && !dual_run() && interpreter_enabled())
      v.push_back(IsaLevel(l));
#endif
  return v;
}

inline const char* level_how(IsaLevel isa) {
  return emulated_level(isa) ? "emulated" : "native";
}

// Output rows a kernel call writes: prefill m_blocks blocks of m_r rows, decode m_r rows.
inline int64_t kernel_rows(const KernelKey& key, const GemmArgs& args) {
  return gemm_call_rows(key, args);
}

// Runs the generated kernel for `key` on `args`. Returns the kernel's name (for coverage
// checks), or "" after a gtest failure.
inline std::string run_generated(const KernelKey& key, const GemmArgs& args) {
  using GemmFn = void (*)(const GemmArgs*);
  const Kernel* k = KernelCache::instance().get(key);
  EXPECT_NE(k, nullptr) << key.name();
  if (!k) return "";
#if defined(__aarch64__)
  reinterpret_cast<GemmFn>(const_cast<void*>(k->entry()))(&args);
#else
  auto emulate = [&] {
    try {
      emulate_x64(k->code.data(), k->code.size(), &args);  // default options
    } catch (const std::exception& e) {
      ADD_FAILURE() << key.name() << ": " << e.what();
    }
  };
  if (emulated_level(key.isa)) {
    emulate();
    return k->name;
  }
  if (!dual_run()) {
    reinterpret_cast<GemmFn>(const_cast<void*>(k->entry()))(&args);
    return k->name;
  }
  // Dual run: the outputs as they were, the native result, then the interpreter's from the same
  // starting point (accumulating epilogues read the outputs).
  const int64_t rows = kernel_rows(key, args);
  const int64_t cols = args.n_strips * gemm_strip_out_cols(key.isa, key.n_vec, key.epilogue);
  std::vector<std::vector<float> > before, native;
  for (int64_t r = 0; r < rows; ++r) {
    const float* p = args.out_rows[r] + args.out_col;
    before.emplace_back(p, p + cols);
  }
  reinterpret_cast<GemmFn>(const_cast<void*>(k->entry()))(&args);
  for (int64_t r = 0; r < rows; ++r) {
    float* p = args.out_rows[r] + args.out_col;
    native.emplace_back(p, p + cols);
    std::memcpy(p, before[size_t(r)].data(), size_t(cols) * 4);
  }
  emulate();
  for (int64_t r = 0; r < rows; ++r) {
    const float* p = args.out_rows[r] + args.out_col;
    if (std::memcmp(p, native[size_t(r)].data(), size_t(cols) * 4) != 0) {
      int64_t c = 0;
      while (std::memcmp(p + c, &native[size_t(r)][size_t(c)], 4) == 0) ++c;
      ADD_FAILURE() << "interpreter differs from the hardware: " << key.name() << " row " << r
                    << " column " << c << ": " << p[c] << " vs " << native[size_t(r)][size_t(c)];
      break;
    }
  }
#endif
  return k->name;
}

#if !defined(__aarch64__)
// The executor (MoELayer) through the interpreter: while an InterpretedExecutor for a level this
// CPU lacks is alive, every generated GEMM kernel the executor calls at such a level runs in the
// interpreter (on the pool's worker threads too); native levels still run directly. Failures are
// collected, since they happen on workers: check errors() after the forwards.
class InterpretedExecutor {
 public:
  explicit InterpretedExecutor(IsaLevel isa) : active_(emulated_level(isa)) {
    if (active_) set_gemm_runner(&run);
  }
  ~InterpretedExecutor() {
    if (active_) set_gemm_runner(nullptr);
  }
  InterpretedExecutor(const InterpretedExecutor&) = delete;
  InterpretedExecutor& operator=(const InterpretedExecutor&) = delete;
  static std::string errors() {
    std::lock_guard<std::mutex> lock(mu());
    return first_error();
  }

 private:
  static std::mutex& mu() {
    static std::mutex m;
    return m;
  }
  static std::string& first_error() {
    static std::string e;
    return e;
  }
  static void run(const Kernel& k, const GemmArgs& args) {
    if (!emulated_level(k.key.isa)) {
      reinterpret_cast<void (*)(const GemmArgs*)>(const_cast<void*>(k.entry()))(&args);
      return;
    }
    try {
      emulate_x64(k.code.data(), k.code.size(), &args);
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lock(mu());
      if (first_error().empty()) first_error() = k.name + ": " + e.what();
    }
  }
  bool active_;
};
#else
class InterpretedExecutor {  // AArch64: no x86 level to interpret
 public:
  explicit InterpretedExecutor(IsaLevel) {}
  static std::string errors() { return ""; }
};
#endif

#if !defined(__aarch64__)
// The prefill prefetch tests (Gemm. and QGroup.PrefillPrefetchCoversTheNextStrip): `key`'s kernel
// run on `args`, a call over strips 0-1 of the weights at args.w (`w_bytes` of them, with room
// past the strips), in the interpreter, which logs each prefetch; `missed`: lines of strips 1-2
// never asked for (of each strip its first `prefix_bytes`, if given: a DRAM-bound call asks for
// that much, jit/gemm.hpp prefill_site_bytes), `outside`: lines of the weights asked for outside
// strips 1-2 and the last sites' `reach` lines past them.
struct PrefetchCover {
  int64_t missed = 0, outside = 0;
};
// The lines (address / 64) `key`'s kernel prefetches, in order, run on `args` in the interpreter.
inline std::vector<uint64_t> prefetch_lines(const KernelKey& key, const GemmArgs& args) {
  std::vector<uint64_t> lines;
  EmuOptions opt;
  opt.on_prefetch = [&](uint64_t addr) { lines.push_back(addr / 64); };
  const Kernel* k = KernelCache::instance().get(key);
  if (!k) throw std::runtime_error("no kernel for " + key.name());
  emulate_x64(k->code.data(), k->code.size(), &args, opt);
  return lines;
}
inline PrefetchCover prefetch_cover(const KernelKey& key, const GemmArgs& args, int64_t strip_bytes,
                                    size_t w_bytes, uint64_t reach, int64_t prefix_bytes = -1) {
  const std::vector<uint64_t> lines = prefetch_lines(key, args);
  const uint64_t w0 = reinterpret_cast<uint64_t>(args.w) / 64, w_end = w0 + w_bytes / 64;
  const uint64_t first = w0 + uint64_t(strip_bytes / 64),
                 end = first + uint64_t(2 * strip_bytes / 64);
  std::vector<bool> seen(size_t(end - first), false);
  PrefetchCover c;
  for (uint64_t line : lines) {
    if (line >= first && line < end)
      seen[size_t(line - first)] = true;
    else if (line >= w0 && line < w_end && (line < first || line >= end + reach))
      ++c.outside;
  }
  const uint64_t per_strip = uint64_t(strip_bytes / 64);
  const uint64_t wanted =
      prefix_bytes < 0 ? per_strip : std::min(per_strip, uint64_t((prefix_bytes + 63) / 64));
  for (size_t i = 0; i < seen.size(); ++i)
    if (!seen[i] && i % per_strip < wanted) ++c.missed;
  return c;
}
#endif

}  // namespace ktjit::test
