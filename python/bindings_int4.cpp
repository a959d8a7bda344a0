// kt_jit._core's 4-bit decode helpers for python/kt_jit/loaders/int4.py (RAWINT4 / GPTQ_INT4):
// packed nibbles (stored as q + 8) -> int8 codes q = nibble - 8 for the qgroup layers, one pass,
// single-threaded (the loader runs them in its prefetch thread while the pool packs the previous
// batch). Buffers arrive as data pointers; the loader checks shapes and dtypes.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "formats/convert.hpp"

namespace py = pybind11;

namespace ktjit {

namespace {

void check_dims(const char* fn, int64_t n, int64_t k, int64_t k_multiple) {
  if (n <= 0 || k <= 0 || k % k_multiple != 0)
    throw std::invalid_argument(std::string(fn) + ": expected rows > 0 and K > 0 a multiple of " +
                                std::to_string(k_multiple) + ", got rows " + std::to_string(n) +
                                " K " + std::to_string(k));
}

// Row-major packed nibbles [n, k/2] (compressed-tensors: byte j holds k = 2j in the low nibble and
// 2j+1 in the high one; int32 [n, k/8] words are the same bytes on a little-endian host).
void decode_rows(const uint8_t* src, int64_t n, int64_t k, int8_t* codes) {
  const int64_t total = n * k / 2;
  for (int64_t j = 0; j < total; ++j) {
    const uint8_t b = src[j];
    codes[2 * j] = int8_t(int(b & 15) - 8);
    codes[2 * j + 1] = int8_t(int(b >> 4) - 8);
  }
}

// GPTQ qweight int32 [k/8, n] (word (r, c) holds input 8r + j of column c in bits 4j..4j+3) ->
// codes [n, k] row-major (transposed), in tiles of 16 columns so reads stay contiguous.
void decode_gptq(const uint32_t* src, int64_t n, int64_t k, int8_t* codes) {
  const int64_t words = k / 8;
  constexpr int64_t kTile = 16;
  for (int64_t c0 = 0; c0 < n; c0 += kTile) {
    const int64_t c1 = c0 + kTile < n ? c0 + kTile : n;
    for (int64_t r = 0; r < words; ++r) {
      const uint32_t* row = src + r * n;
      for (int64_t c = c0; c < c1; ++c) {
        const uint32_t w = row[c];
        int8_t* out = codes + c * k + 8 * r;
        for (int j = 0; j < 8; ++j) out[j] = int8_t(int((w >> (4 * j)) & 15u) - 8);
      }
    }
  }
}

}  // namespace

void register_int4(py::module_& m) {
  m.def(
      "f32_to_f16_bits",
      [](const std::vector<float>& x) {
        std::vector<uint16_t> out(x.size());
        for (size_t i = 0; i < x.size(); ++i) out[i] = formats::f32_to_f16(x[i]);
        return out;
      },
      py::arg("values"),
      "fp16 bit patterns (RNE) of fp32 values: the conversion GPTQ_INT4 write-back uses.");
  m.def(
      "int4_decode_rows",
      [](uintptr_t src, int64_t n, int64_t k, uintptr_t codes) {
        check_dims("int4_decode_rows", n, k, 2);
        py::gil_scoped_release release;
        decode_rows(reinterpret_cast<const uint8_t*>(src), n, k, reinterpret_cast<int8_t*>(codes));
      },
      py::arg("src"), py::arg("rows"), py::arg("k"), py::arg("codes"),
      "RAWINT4: packed nibbles [rows, k/2] (low nibble = even k) -> int8 codes nibble - 8 "
      "[rows, k] (data pointers).");
  m.def(
      "int4_decode_gptq",
      [](uintptr_t src, int64_t n, int64_t k, uintptr_t codes) {
        check_dims("int4_decode_gptq", n, k, 8);
        py::gil_scoped_release release;
        decode_gptq(reinterpret_cast<const uint32_t*>(src), n, k, reinterpret_cast<int8_t*>(codes));
      },
      py::arg("src"), py::arg("rows"), py::arg("k"), py::arg("codes"),
      "GPTQ_INT4: qweight int32 [k/8, rows] (nibble j of word r = input 8r + j) -> int8 codes "
      "nibble - 8 [rows, k], transposed (data pointers).");
}

}  // namespace ktjit
