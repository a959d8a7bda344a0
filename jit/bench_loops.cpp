// Arch-neutral entry points of the measurement loops (jit/bench_loops.hpp).
#include "jit/bench_loops.hpp"

#include "jit/aarch64/bench_loops_a64.hpp"
#if defined(__x86_64__)  // the Xbyak generators are built on x86-64 hosts only
#include "jit/x64/bench_loops.hpp"
#endif

#include <stdexcept>
#include <string>

namespace ktjit {

const char* peak_op_name(PeakOp op) {
  switch (op) {
    case PeakOp::vpdpbusd: return "vpdpbusd";
    case PeakOp::maddubsw: return "maddubsw";
    case PeakOp::fma_f32: return "fma_f32";
    case PeakOp::dpbf16: return "dpbf16";
    case PeakOp::tdpbusd: return "tdpbusd";
    case PeakOp::tdpbf16ps: return "tdpbf16ps";
    case PeakOp::maddubsw_w: return "maddubsw_w";
    case PeakOp::sdot: return "sdot";
    case PeakOp::smull_sadalp: return "smull_sadalp";
    case PeakOp::bfdot: return "bfdot";
  }
  return "?";
}

double peak_ops_per_iteration(const KernelKey& key) {
  if (key.kind != KernelKind::peak_loop)
    throw std::invalid_argument("peak_ops_per_iteration: not a peak loop: " + key.describe());
  if (isa_is_neon(key.isa)) return aarch64::peak_ops_per_iteration_a64(key);
#if defined(__x86_64__)
  return x64::peak_ops_per_iteration_x64(key);
#else
  throw std::invalid_argument("peak_ops_per_iteration: x86-64 loops are not built here: " +
                              key.describe());
#endif
}

}  // namespace ktjit
