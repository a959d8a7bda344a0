// The machine's own limits, measured in the calling process with generated loops: streaming read
// bandwidth (1 and N threads) and the peak throughput of the instructions the kernels rely on.
// Benchmarks report their speed as a fraction of these numbers taken in the same run.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "jit/cpu/cpu.hpp"

namespace ktjit {

class ThreadPool;

// Median GB/s (1 GB = 1e9 B) of a streaming read over a `bytes` buffer (mmap + MADV_HUGEPAGE,
// first-touched before timing) on the calling thread, over `reps` timed passes.
double measure_read_bandwidth_gbs(size_t bytes = size_t(1) << 30, int reps = 5);

// One streaming-read buffer kept between passes, for probes taken right beside other timings
// (`kt-jit bench` pairs each decode forward with one): the buffer is mapped and first-touched
// once, then every pass() is one timed read of it on the calling thread. With a `pool`, on the
// threads a forward runs on instead: the buffer in pool->size() equal parts (whole KiB each),
// thread t of ThreadPool::run first-touching and reading part t, and a pass's GB/s all the bytes
// over the seconds from the first thread's start to the last one's end (not the fork or the
// join). The pool must outlive the probe.
class ReadProbe {
 public:
  explicit ReadProbe(size_t bytes = size_t(256) << 20, ThreadPool* pool = nullptr);
  ~ReadProbe();
  ReadProbe(const ReadProbe&) = delete;
  ReadProbe& operator=(const ReadProbe&) = delete;
  double pass_gbs();  // GB/s of one timed pass
  size_t bytes() const { return bytes_; }
  int threads() const;  // 1, or the pool's threads

 private:
  struct Buffer;  // the mapping (machine_limits.cpp)
  size_t bytes_ = 0;
  size_t part_ = 0;  // bytes a thread reads (the pool's case; else bytes_)
  ThreadPool* pool_ = nullptr;
  std::unique_ptr<Buffer> buf_;
  void (*fn_)(const void*, int64_t) = nullptr;
};

// The buffer split over `threads` std::threads, thread i pinned to the i-th CPU of the process's
// affinity mask and first-touching its own part; median of the aggregate GB/s
// (total bytes / (last end - first start)) over `reps` passes.
double measure_read_bandwidth_gbs_threads(int threads, size_t bytes = size_t(1) << 30,
                                          int reps = 5);

// The best Gop/s (2 ops per multiply-accumulate) of `reps` runs of the peak loop for `op`
// (PeakOp) at `isa` on the calling thread, each sized to ~30 ms. The best, not the median: a
// neighbour on a shared VM can only slow a run down, and a peak read low inflates every roof%
// divided by it (a bench round on 2026-11-29 printed a prefill roof of 123 %). Throws
// std::invalid_argument when the ISA lacks the op or this CPU cannot run `isa`; returns 0 when
// executable memory is refused.
double measure_peak_gops(IsaLevel isa, uint8_t op, int reps = 7);

// The same loop on `threads` std::threads at once, thread i pinned to the i-th CPU of the
// process's affinity mask (as measure_read_bandwidth_gbs_threads), every thread running the
// iterations the caller calibrated: the best of `reps` passes of the aggregate Gop/s (all
// threads' ops / (last end - first start)). Whether two threads double one core's peak depends
// on the CPUs they land on (SMT siblings share the vector units; a VM's vCPUs may share a core).
double measure_peak_gops_threads(IsaLevel isa, uint8_t op, int threads, int reps = 5);

struct MachineLimits {
  double read_gbs_1t = 0, read_gbs_2t = 0;
  double peak_vnni_gops = 0;        // vpdpbusd
  double peak_maddubsw_gops = 0;    // vpmaddubsw + vpmaddwd + vpaddd
  double peak_maddubsw_w_gops = 0;  // vpmaddubsw + vpaddw (qgroup int16 group sums, kQGroupI16)
  double peak_fma_gflops = 0;       // vfmadd231ps (fmla on AArch64)
  double peak_bf16_gflops = 0;      // vdpbf16ps
  double peak_amx_int8_gops = 0;    // tdpbusd (isa amx only)
  double peak_amx_bf16_gflops = 0;  // tdpbf16ps (isa amx only)
  // AArch64 (NEON levels; peak_fma_gflops is fmla there):
  double peak_sdot_gops = 0;     // sdot (neon_dotprod, neon_bf16)
  double peak_smull_gops = 0;    // smull + smull2 + addp + sadalp (plain NEON int8)
  double peak_bfdot_gflops = 0;  // bfdot (neon_bf16)
};

// All of the above at `isa` (ops the ISA lacks are 0; read_gbs_2t is 0 on a 1-CPU machine).
MachineLimits measure_machine_limits(IsaLevel isa);

}  // namespace ktjit
