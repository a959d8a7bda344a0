// The asmjit a64 scaffolding every AArch64 generator shares: a code holder whose errors throw,
// an assembler on it, and the flattened bytes at the end.
#pragma once

#include <asmjit/arm/a64assembler.h>
#include <asmjit/core.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace ktjit::aarch64 {

class A64Emitter {
 public:
  A64Emitter() {
    code_.init(asmjit::Environment(asmjit::Arch::kAArch64));
    code_.setErrorHandler(&eh_);
    a_ = std::make_unique<asmjit::a64::Assembler>(&code_);
  }
  A64Emitter(const A64Emitter&) = delete;
  A64Emitter& operator=(const A64Emitter&) = delete;

  asmjit::a64::Assembler& as() { return *a_; }

  // The machine code, links resolved (call once, after generating).
  std::vector<uint8_t> bytes() {
    code_.flatten();
    code_.resolveUnresolvedLinks();
    std::vector<uint8_t> out(code_.codeSize());
    code_.copyFlattenedData(out.data(), out.size(), asmjit::CopySectionFlags::kPadSectionBuffer);
    return out;
  }

 private:
  class ThrowingErrorHandler : public asmjit::ErrorHandler {
   public:
    void handleError(asmjit::Error err, const char* message, asmjit::BaseEmitter*) override {
      throw std::runtime_error("asmjit a64: " + std::string(message) + " (error " +
                               std::to_string(err) + ")");
    }
  };
  ThrowingErrorHandler eh_;
  asmjit::CodeHolder code_;
  std::unique_ptr<asmjit::a64::Assembler> a_;
};

}  // namespace ktjit::aarch64
