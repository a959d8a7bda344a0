// Key -> generator dispatch. The only file that knows every generator family.
#include <stdexcept>

#include "jit/kernel.hpp"
#include "jit/x64/bench_loops.hpp"
#include "jit/x64/gemm.hpp"

namespace ktjit {

std::vector<uint8_t> generate_code(const KernelKey& key) {
  switch (key.kind) {
    case KernelKind::gemm_decode:
    case KernelKind::gemm_prefill:
      if (key.format == WeightFormat::int8 || key.format == WeightFormat::int4 ||
          key.format == WeightFormat::bf16 || key.format == WeightFormat::fp8)
        return x64::generate_gemm(key);
      break;
    case KernelKind::peak_loop: return x64::generate_peak_loop(key);
    case KernelKind::read_stream: return x64::generate_read_stream(key);
  }
  throw std::invalid_argument("no generator for kernel " + key.describe());
}

}  // namespace ktjit
