// The spin-wait hint of the host architecture (a scalar instruction of the baseline ISA).
#pragma once

namespace ktjit {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace ktjit
