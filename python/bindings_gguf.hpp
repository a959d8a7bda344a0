// Registers kt_jit._core's GGUF functions (python/bindings_gguf.cpp).
#pragma once

#include <pybind11/pybind11.h>

namespace ktjit {

void register_gguf(pybind11::module_& m);

}  // namespace ktjit
