// kt_jit._core's converter functions (python/kt_jit/convert.py, loaders/ktjit.py): the engine's own
// per-row INT8 / INT4 weight quantizers (formats/int8.cpp) over many rows at once, on the
// process-wide pool, so `kt-jit convert` writes exactly the numbers an online load computes; and
// the nibble unpacker of the artifact's INT4 storage. Buffers arrive as data pointers; the Python
// side checks their sizes.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "formats/convert.hpp"
#include "formats/int8.hpp"
#include "runtime/thread_pool.hpp"

namespace py = pybind11;

namespace ktjit {

namespace {

formats::FloatType dtype_arg(const std::string& s) {
  if (s == "f32") return formats::FloatType::f32;
  if (s == "bf16") return formats::FloatType::bf16;
  if (s == "f16") return formats::FloatType::f16;
  throw std::invalid_argument("dtype: expected 'f32', 'bf16' or 'f16', got '" + s + "'");
}

// Runs fn(row_begin, row_end) over `rows` rows, on the process-wide pool when it exists and the
// work is worth a fork/join (contiguous ranges: the result does not depend on the thread count).
template <class Fn>
void over_rows(int64_t rows, int64_t k, Fn fn) {
  if (!ThreadPool::global_exists() || rows * k < (int64_t(1) << 15) || rows < 2) {
    fn(int64_t(0), rows);
    return;
  }
  ThreadPool::global().run([&](int tid, int nt) {
    int64_t b, e;
    split_range(rows, tid, nt, &b, &e);
    if (b < e) fn(b, e);
  });
}

}  // namespace

void register_convert(py::module_& m) {
  m.def(
      "quantize_rows",
      [](uintptr_t src, const std::string& dtype, int64_t rows, int64_t k, int bits, uintptr_t q,
         uintptr_t d, bool nibbles) {
        const formats::FloatType t = dtype_arg(dtype);
        if (bits != 8 && bits != 4)
          throw std::invalid_argument("bits: expected 8 or 4, got " + std::to_string(bits));
        if (rows < 0 || k <= 0)
          throw std::invalid_argument("quantize_rows: expected rows >= 0 and k > 0, got rows " +
                                      std::to_string(rows) + ", k " + std::to_string(k));
        if (nibbles && (bits != 4 || k % 2 != 0))
          throw std::invalid_argument(
              "quantize_rows: nibbles need bits 4 and an even k, got bits " + std::to_string(bits) +
              ", k " + std::to_string(k));
        if (rows == 0) return;
        if (src == 0 || q == 0 || d == 0)
          throw std::invalid_argument("quantize_rows: null pointer");
        const size_t esz = t == formats::FloatType::f32 ? 4 : 2;
        const auto quantize = bits == 4 ? formats::quantize_row_int4 : formats::quantize_row_int8;
        const auto* in = reinterpret_cast<const char*>(src);
        auto* out = reinterpret_cast<int8_t*>(q);
        auto* scale = reinterpret_cast<float*>(d);
        py::gil_scoped_release release;
        over_rows(rows, k, [&](int64_t r0, int64_t r1) {
          std::vector<float> row(static_cast<size_t>(k));
          std::vector<int8_t> q16(nibbles ? static_cast<size_t>(k) : 0);
          for (int64_t r = r0; r < r1; ++r) {
            formats::to_f32(in + size_t(r * k) * esz, t, k, row.data());
            if (!nibbles) {
              scale[r] = quantize(row.data(), k, out + r * k);
              continue;
            }
            scale[r] = quantize(row.data(), k, q16.data());
            // 16 * q4 -> the signed nibble q4: even k in the low nibble, odd k in the high one.
            uint8_t* o = reinterpret_cast<uint8_t*>(out) + r * (k / 2);
            for (int64_t j = 0; j < k / 2; ++j) {
              const uint8_t lo = uint8_t(q16[size_t(2 * j)]) >> 4;
              const uint8_t hi = uint8_t(q16[size_t(2 * j + 1)]) & 0xF0u;
              o[j] = uint8_t(lo | hi);
            }
          }
        });
      },
      py::arg("src_ptr"), py::arg("dtype"), py::arg("rows"), py::arg("k"), py::arg("bits"),
      py::arg("q_ptr"), py::arg("d_ptr"), py::arg("nibbles") = false,
      "Quantizes `rows` rows of `k` elements (row-major, dtype 'f32' | 'bf16' | 'f16') with the "
      "engine's per-row rule — bits 8: d = amax/127; bits 4: d = amax/112, q = 16*q4 — into "
      "q (int8 [rows, k], the values the kernels multiply; or, with nibbles, [rows, k/2] bytes of "
      "signed q4, even k in the low nibble) and d (fp32 [rows]). Runs on the process-wide pool.");

  m.def(
      "unpack_nibbles",
      [](uintptr_t src, int64_t rows, int64_t k, uintptr_t dst) {
        if (rows < 0 || k <= 0 || k % 2 != 0)
          throw std::invalid_argument(
              "unpack_nibbles: expected rows >= 0 and an even k > 0, got "
              "rows " +
              std::to_string(rows) + ", k " + std::to_string(k));
        if (rows == 0) return;
        if (src == 0 || dst == 0) throw std::invalid_argument("unpack_nibbles: null pointer");
        const auto* in = reinterpret_cast<const uint8_t*>(src);
        auto* out = reinterpret_cast<uint8_t*>(dst);
        py::gil_scoped_release release;
        over_rows(rows, k, [&](int64_t r0, int64_t r1) {
          for (int64_t i = r0 * (k / 2); i < r1 * (k / 2); ++i) {
            out[2 * i] = uint8_t(in[i] << 4);         // 16 * q4 of the low nibble
            out[2 * i + 1] = uint8_t(in[i] & 0xF0u);  // 16 * q4 of the high nibble
          }
        });
      },
      py::arg("src_ptr"), py::arg("rows"), py::arg("k"), py::arg("dst_ptr"),
      "Signed nibbles [rows, k/2] (even k low) -> int8 [rows, k] of 16*q4, the kernels' values.");
}

}  // namespace ktjit
