// kt_jit._core's GGUF functions (formats/gguf): the supported GGML block types, decoding rows of
// blocks into grouped codes/scales/biases and the reference dequantizer. Buffers arrive as data
// pointers; python/kt_jit/loaders/gguf.py checks their sizes.
#include "python/bindings_gguf.hpp"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>

#include "formats/gguf.hpp"
#include "runtime/thread_pool.hpp"

namespace py = pybind11;

namespace ktjit {

namespace {

namespace gg = formats::gguf;

const gg::TypeInfo& type_arg(int type) {
  const gg::TypeInfo* t = gg::type_info(type);
  if (t == nullptr)
    throw std::invalid_argument("gguf: unsupported ggml type id " + std::to_string(type) +
                                "; supported: " + gg::supported_types());
  return *t;
}

// Runs fn(row_begin, row_end) over `rows` rows, on the process-wide pool when it exists and the
// work is worth a fork/join.
template <class Fn>
void over_rows(int64_t rows, int64_t k, Fn fn) {
  if (!ThreadPool::global_exists() || rows * k < (int64_t(1) << 16) || rows < 2) {
    fn(int64_t(0), rows);
    return;
  }
  ThreadPool::global().run([&](int tid, int nt) {
    int64_t b, e;
    split_range(rows, tid, nt, &b, &e);
    if (b < e) fn(b, e);
  });
}

py::dict info_dict(const gg::TypeInfo& t) {
  py::dict d;
  d["id"] = int(t.type);
  d["name"] = t.name;
  d["block"] = t.block;
  d["block_bytes"] = t.block_bytes;
  d["is_float"] = t.is_float;
  d["group"] = t.group;
  d["bias"] = t.bias;
  std::vector<int> lut;
  if (t.lut4)
    for (int8_t v : t.lut) lut.push_back(v);
  d["lut"] = lut;  // [] when codes need bytes
  d["code_range"] = std::vector<int>{t.code_lo, t.code_hi};
  d["super_group"] = gg::super_group(t);  // two-level scales: the block (K-quants, IQ4_XS) or 0
  // the legacy integer types' d (and m) are f16: the layer keeps them so, exactly
  d["scale_dtype"] = !t.is_float && !gg::super_group(t) ? "f16" : "";
  return d;
}

}  // namespace

void register_gguf(py::module_& m) {
  m.def(
      "gguf_types",
      [] {
        py::list out;
        for (const char* name : {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                                 "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"}) {
          for (int id = 0; id < 64; ++id) {
            const gg::TypeInfo* t = gg::type_info(id);
            if (t && std::string(t->name) == name) out.append(info_dict(*t));
          }
        }
        return out;
      },
      "The GGML types LLAMAFILE reads: dicts {id, name, block, block_bytes, is_float, group, "
      "bias, lut} (lut: the 16 codes a nibble stands for, [] for byte codes).");
  m.def(
      "gguf_decode",
      [](int type, uintptr_t src, int64_t rows, int64_t k, int64_t group, uintptr_t codes,
         uintptr_t scales, uintptr_t biases) {
        const gg::TypeInfo& t = type_arg(type);
        const int64_t rb = gg::row_bytes(t, k);
        if (t.is_float)
          throw std::invalid_argument(std::string("gguf_decode: ") + t.name +
                                      " is a float type (use gguf_dequantize)");
        if (group <= 0 || t.group % group != 0)
          throw std::invalid_argument("gguf_decode: group " + std::to_string(group) +
                                      " does not divide " + t.name + "'s " +
                                      std::to_string(t.group));
        if (t.bias && biases == 0)
          throw std::invalid_argument(std::string("gguf_decode: ") + t.name +
                                      " has biases: biases pointer is null");
        const int64_t ng = k / group;
        py::gil_scoped_release release;
        over_rows(rows, k, [&](int64_t b, int64_t e) {
          gg::decode_rows(t, reinterpret_cast<const uint8_t*>(src) + b * rb, e - b, k, group,
                          reinterpret_cast<int8_t*>(codes) + b * k,
                          reinterpret_cast<float*>(scales) + b * ng,
                          biases ? reinterpret_cast<float*>(biases) + b * ng : nullptr);
        });
      },
      py::arg("type"), py::arg("src_ptr"), py::arg("rows"), py::arg("k"), py::arg("group"),
      py::arg("codes_ptr"), py::arg("scales_ptr"), py::arg("biases_ptr") = 0,
      "Decodes rows x k elements of GGML blocks into int8 codes [rows, k] and fp32 scales (and "
      "biases) [rows, k / group]; group = the type's group or a divisor of it.");
  m.def(
      "gguf_dequantize",
      [](int type, uintptr_t src, int64_t rows, int64_t k, uintptr_t out) {
        const gg::TypeInfo& t = type_arg(type);
        const int64_t rb = gg::row_bytes(t, k);
        py::gil_scoped_release release;
        over_rows(rows, k, [&](int64_t b, int64_t e) {
          gg::dequantize_rows(t, reinterpret_cast<const uint8_t*>(src) + b * rb, e - b, k,
                              reinterpret_cast<float*>(out) + b * k);
        });
      },
      py::arg("type"), py::arg("src_ptr"), py::arg("rows"), py::arg("k"), py::arg("out_ptr"),
      "Reference dequantizer: rows x k elements of a GGML type into fp32 [rows, k].");
  m.def(
      "gguf_row_bytes", [](int type, int64_t k) { return gg::row_bytes(type_arg(type), k); },
      py::arg("type"), py::arg("k"));
}

}  // namespace ktjit
