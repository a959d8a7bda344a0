// Key -> generator dispatch. The only file that knows every generator family.
#include <stdexcept>

#include "jit/aarch64/bench_loops_a64.hpp"
#include "jit/aarch64/gemm_a64.hpp"
#include "jit/kernel.hpp"
#if defined(__x86_64__)  // the Xbyak generators are built on x86-64 hosts only
#include "jit/x64/amx_gemm.hpp"
#include "jit/x64/bench_loops.hpp"
#include "jit/x64/gemm.hpp"
#include "jit/x64/quantize.hpp"
#endif

namespace ktjit {

std::vector<uint8_t> generate_code(const KernelKey& key) {
  switch (key.kind) {
    case KernelKind::gemm_decode:
    case KernelKind::gemm_prefill:
      // NEON (asmjit a64): built everywhere; on x86-64 for kt-jit-dump --isa neon only.
      if (isa_is_neon(key.isa)) return aarch64::generate_gemm(key);
#if defined(__x86_64__)
      if (key.isa == IsaLevel::amx) {  // AMX: int8 prefill only (decode stays on avx512 levels)
        if (x64::amx_gemm_supported(key)) return x64::generate_amx_gemm(key);
        break;
      }
      if (key.format == WeightFormat::int8 || key.format == WeightFormat::int4 ||
          key.format == WeightFormat::bf16 || key.format == WeightFormat::fp8 ||
          key.format == WeightFormat::qgroup || key.format == WeightFormat::mxfp4 ||
          key.format == WeightFormat::mxfp8)
        return x64::generate_gemm(key);
#endif
      break;
    case KernelKind::peak_loop:
      if (isa_is_neon(key.isa)) return aarch64::generate_peak_loop(key);
#if defined(__x86_64__)
      return x64::generate_peak_loop(key);
#else
      break;
#endif
    case KernelKind::quantize:  // x86 only: elsewhere the C++ quantizer runs
#if defined(__x86_64__)
      return x64::generate_quantize(key);
#else
      break;
#endif
    case KernelKind::read_stream:
      if (isa_is_neon(key.isa)) return aarch64::generate_read_stream(key);
#if defined(__x86_64__)
      return x64::generate_read_stream(key);
#else
      break;
#endif
  }
  throw std::invalid_argument("no generator for kernel " + key.describe());
}

}  // namespace ktjit
