// The pybind11 module kt_jit._core: translates between Python objects and the core's types.
// Tensors arrive as data pointers (the Python layer validates shapes, dtypes and contiguity).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>

#include "jit/cpu/cpu.hpp"
#include "jit/gemm.hpp"
#include "jit/kernel.hpp"
#include "python/py_moe_layer.hpp"
#include "runtime/machine_limits.hpp"
#include "runtime/moe_layer.hpp"
#include "runtime/thread_pool.hpp"

#ifndef KT_JIT_VERSION
#define KT_JIT_VERSION "0.0.0+dev"
#endif

namespace py = pybind11;
using namespace ktjit;

namespace {

template <class T>
T* ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

IsaLevel level_arg(const std::string& isa) {
  return isa.empty() ? selected_isa() : parse_isa(isa);
}

py::dict features_dict() {
  const CpuFeatures& f = cpu_features();
  py::dict d;
  d["vendor"] = f.vendor;
  d["brand"] = f.brand;
  d["family"] = f.family;
  d["model"] = f.model;
  d["sse4_2"] = f.sse42;
  d["avx"] = f.avx;
  d["avx2"] = f.avx2;
  d["fma"] = f.fma;
  d["f16c"] = f.f16c;
  d["avx512f"] = f.avx512f;
  d["avx512bw"] = f.avx512bw;
  d["avx512vl"] = f.avx512vl;
  d["avx512dq"] = f.avx512dq;
  d["avx512_vnni"] = f.avx512_vnni;
  d["avx512_bf16"] = f.avx512_bf16;
  d["avx512_vbmi"] = f.avx512_vbmi;
  d["amx_tile"] = f.amx_tile;
  d["amx_int8"] = f.amx_int8;
  d["amx_bf16"] = f.amx_bf16;
  d["xcr0"] = f.xcr0;
  d["os_avx"] = f.os_avx;
  d["os_avx512"] = f.os_avx512;
  d["os_amx"] = f.os_amx;
  d["amx_permission"] = f.amx_permission;
  d["amx_permission_error"] = f.amx_permission_error;
  d["detected_isa"] = isa_name(detected_isa());
  py::dict refused;
  for (int l = int(detected_isa()) + 1; l < kNumIsaLevels; ++l)
    refused[isa_name(IsaLevel(l))] = missing_for(IsaLevel(l), f);
  d["refused"] = refused;
  try {
    d["isa"] = isa_name(selected_isa());
  } catch (const std::exception& e) {
    d["isa"] = py::none();
    d["isa_error"] = e.what();
  }
  return d;
}

}  // namespace

void register_serving(pybind11::module_& m);  // python/bindings_serving.cpp

PYBIND11_MODULE(_core, m) {
  m.doc() = "kt-jit core: CPU probe, generated kernels and the MoE executor";
  m.attr("__version__") = KT_JIT_VERSION;

  // C++ exceptions become Python ones: invalid_argument -> ValueError, runtime_error ->
  // RuntimeError (pybind11's defaults).
  m.def(
      "fp8_decode", [](int code) { return double(fp8_value(uint8_t(code))); }, py::arg("code"),
      "The value the FP8 kernels give an e4m3 byte (before scaling).");
  m.def("built_methods", [] { return std::string(built_methods()); });
  m.def(
      "isa", [] { return std::string(isa_name(selected_isa())); },
      "The selected ISA level (detected, capped by KT_JIT_ISA).");
  m.def("detected_isa", [] { return std::string(isa_name(detected_isa())); });
  m.def("cpu_features", &features_dict, "What the CPU probe found.");
  m.def("runnable_isas", [] {
    std::vector<std::string> v;
    for (int l = int(selected_isa()); l >= 0; --l)
      if (IsaLevel(l) != IsaLevel::amx) v.push_back(isa_name(IsaLevel(l)));
    return v;
  });
  m.def(
      "init_pool",
      [](int threads, int pools) {
        ThreadPool& p = ThreadPool::global(threads, pools);
        return py::make_tuple(p.size(), p.pools());
      },
      py::arg("threads"), py::arg("pools") = 1,
      "Creates the process-wide worker pool; the first call wins.");
  m.def("pool_size", [] { return ThreadPool::global_exists() ? ThreadPool::global().size() : 0; });

  py::class_<PyMoELayer>(m, "MoELayer")
      .def(py::init([](int64_t E, int64_t K, int64_t H, int64_t I, const std::string& method,
                       const std::string& isa, const std::vector<int64_t>& shard_bounds) {
             auto l = std::make_unique<PyMoELayer>();
             const MoEShape shape{E, K, H, I};
             l->layer =
                 shard_bounds.empty()
                     ? std::make_unique<MoELayer>(shape, method, level_arg(isa))
                     : std::make_unique<MoELayer>(shape, method, level_arg(isa), shard_bounds);
             return l;
           }),
           py::arg("num_experts"), py::arg("top_k"), py::arg("hidden"), py::arg("intermediate"),
           py::arg("method") = "AMXINT8", py::arg("isa") = "",
           py::arg("shard_bounds") = std::vector<int64_t>{},
           "shard_bounds: [0, b1, ..., I] splits I into shards (e.g. a checkpoint's NUMA parts); "
           "each shard quantizes the down projection's input over its own slice.")
      .def_property_readonly("shard_bounds",
                             [](const PyMoELayer& s) {
                               std::vector<int64_t> b{0};
                               for (int i = 0; i < s.layer->num_shards(); ++i)
                                 b.push_back(s.layer->shard_range(i).second);
                               return b;
                             })
      .def(
          "load_experts_fp8",
          [](PyMoELayer& self, const std::vector<int64_t>& slots,
             const std::vector<uintptr_t>& gate, const std::vector<uintptr_t>& up,
             const std::vector<uintptr_t>& down, const std::vector<uintptr_t>& gate_scale,
             const std::vector<uintptr_t>& up_scale, const std::vector<uintptr_t>& down_scale) {
            const size_t n = slots.size();
            for (size_t len : {gate.size(), up.size(), down.size(), gate_scale.size(),
                               up_scale.size(), down_scale.size()})
              if (len != n)
                throw std::invalid_argument(
                    "load_experts_fp8: every pointer list must have len(slots) entries");
            std::vector<MoELayer::Fp8ExpertSource> src;
            for (size_t i = 0; i < n; ++i)
              src.push_back({slots[i], ptr<const uint8_t>(gate[i]), ptr<const uint8_t>(up[i]),
                             ptr<const uint8_t>(down[i]), ptr<const float>(gate_scale[i]),
                             ptr<const float>(up_scale[i]), ptr<const float>(down_scale[i])});
            py::gil_scoped_release release;
            self.layer->load_experts_fp8(src, ThreadPool::global());
          },
          py::arg("slots"), py::arg("gate"), py::arg("up"), py::arg("down"), py::arg("gate_scale"),
          py::arg("up_scale"), py::arg("down_scale"),
          "Packs e4m3 experts (gate/up [I, H], down [H, I] bytes) with FP8's 128x128 block scales "
          "(fp32 [ceil(N/128), ceil(K/128)]) or FP8_PERCHANNEL's row scales (fp32 [N]).")
      .def(
          "load_experts_quantized",
          [](PyMoELayer& self, int shard, const std::vector<int64_t>& slots,
             const std::vector<uintptr_t>& q_gate, const std::vector<uintptr_t>& d_gate,
             const std::vector<uintptr_t>& q_up, const std::vector<uintptr_t>& d_up,
             const std::vector<uintptr_t>& q_down, const std::vector<uintptr_t>& d_down) {
            const size_t n = slots.size();
            for (size_t len : {q_gate.size(), d_gate.size(), q_up.size(), d_up.size(),
                               q_down.size(), d_down.size()})
              if (len != n)
                throw std::invalid_argument(
                    "load_experts_quantized: every pointer list must have len(slots) entries");
            std::vector<MoELayer::QuantExpertSource> src;
            for (size_t i = 0; i < n; ++i)
              src.push_back({slots[i], ptr<const int8_t>(q_gate[i]), ptr<const int8_t>(q_up[i]),
                             ptr<const int8_t>(q_down[i]), ptr<const float>(d_gate[i]),
                             ptr<const float>(d_up[i]), ptr<const float>(d_down[i])});
            py::gil_scoped_release release;
            self.layer->load_experts_quantized(shard, src, ThreadPool::global());
          },
          py::arg("shard"), py::arg("slots"), py::arg("q_gate"), py::arg("d_gate"), py::arg("q_up"),
          py::arg("d_up"), py::arg("q_down"), py::arg("d_down"),
          "Packs already-quantized experts of one shard without re-quantizing: int8 values the "
          "kernels multiply (INT4: 16*q4) row-major — gate/up [is, H], down [H, is] — and fp32 "
          "row scales [is], [is], [H].")
      .def(
          "write_expert",
          [](const PyMoELayer& self, int64_t slot, int tp, int rank, uintptr_t w13,
             uintptr_t w13_scale, uintptr_t w2, uintptr_t w2_scale) {
            py::gil_scoped_release release;
            self.layer->write_expert(slot, tp, rank, ptr<void>(w13), ptr<float>(w13_scale),
                                     ptr<void>(w2), ptr<float>(w2_scale));
          },
          py::arg("slot"), py::arg("tp"), py::arg("rank"), py::arg("w13_ptr"),
          py::arg("w13_scale_ptr"), py::arg("w2_ptr"), py::arg("w2_scale_ptr"),
          "Writes one expert in its checkpoint encoding for GPU rank `rank` of `tp` (BF16, FP8, "
          "FP8_PERCHANNEL): w13 = [gate; up] rows of the rank's I slice, w2 = down's column "
          "slice, scales alike.")
      .def(
          "load_from_float",
          [](PyMoELayer& self, uintptr_t gate, uintptr_t up, uintptr_t down,
             const std::string& dtype, uintptr_t map) {
            SourceDType dt = parse_source_dtype(dtype);
            py::gil_scoped_release release;
            self.layer->load_from_float(ptr<const void>(gate), ptr<const void>(up),
                                        ptr<const void>(down), dt, ptr<const int64_t>(map),
                                        ThreadPool::global());
          },
          py::arg("gate_ptr"), py::arg("up_ptr"), py::arg("down_ptr"), py::arg("dtype"),
          py::arg("map_ptr") = 0)
      .def(
          "load_experts",
          [](PyMoELayer& self, const std::vector<int64_t>& slots,
             const std::vector<uintptr_t>& gate, const std::vector<uintptr_t>& up,
             const std::vector<uintptr_t>& down, const std::string& dtype) {
            if (gate.size() != slots.size() || up.size() != slots.size() ||
                down.size() != slots.size())
              throw std::invalid_argument(
                  "load_experts: slots, gate_ptrs, up_ptrs and down_ptrs "
                  "must have the same length");
            SourceDType dt = parse_source_dtype(dtype);
            std::vector<MoELayer::ExpertSource> src;
            for (size_t i = 0; i < slots.size(); ++i)
              src.push_back({slots[i], ptr<const void>(gate[i]), ptr<const void>(up[i]),
                             ptr<const void>(down[i])});
            py::gil_scoped_release release;
            self.layer->load_experts(src, dt, ThreadPool::global());
          },
          py::arg("slots"), py::arg("gate_ptrs"), py::arg("up_ptrs"), py::arg("down_ptrs"),
          py::arg("dtype"),
          "Packs experts from per-expert row-major sources (gate/up [I,H], down [H,I]) into "
          "their physical slots; the layer is loaded once every slot has been.")
      .def(
          "forward",
          [](PyMoELayer& self, int64_t T, uintptr_t x, uintptr_t ids, uintptr_t w, uintptr_t mask,
             uintptr_t out) { self.forward(T, x, ids, w, mask, out, false); },
          py::arg("T"), py::arg("x_ptr"), py::arg("ids_ptr"), py::arg("w_ptr"), py::arg("mask_ptr"),
          py::arg("out_ptr"))
      .def(
          "forward_reference",
          [](PyMoELayer& self, int64_t T, uintptr_t x, uintptr_t ids, uintptr_t w, uintptr_t mask,
             uintptr_t out) { self.forward(T, x, ids, w, mask, out, true); },
          py::arg("T"), py::arg("x_ptr"), py::arg("ids_ptr"), py::arg("w_ptr"), py::arg("mask_ptr"),
          py::arg("out_ptr"))
      .def_property_readonly(
          "isa", [](const PyMoELayer& s) { return std::string(isa_name(s.layer->isa())); })
      .def_property_readonly("loaded", [](const PyMoELayer& s) { return s.layer->loaded(); })
      .def_property_readonly("packed_bytes",
                             [](const PyMoELayer& s) { return s.layer->packed_bytes(); })
      .def("kernel_names", [](const PyMoELayer& s) { return s.layer->kernel_names(); });

  m.def(
      "dump_kernels",
      [](const std::string& method, int64_t E, int64_t K, int64_t H, int64_t I,
         const std::string& isa) {
        const WeightFormat fmt = method_format(method);
        IsaLevel level = isa.empty() ? selected_isa() : parse_isa(isa);
        if (level == IsaLevel::ref)
          throw std::invalid_argument(
              "dump: the ref level runs C++ reference kernels, nothing is generated");
        if (level == IsaLevel::amx)
          throw std::invalid_argument(
              "dump: AMX kernels are not generated yet (issue: AMX and AArch64 code generation)");
        py::list out;
        for (const KernelKey& key : moe_kernel_keys(MoEShape{E, K, H, I}, fmt, level)) {
          auto k = KernelCache::generate_only(key);
          py::dict d;
          d["name"] = k->name;
          d["key"] = key.describe();
          d["size"] = k->code.size();
          d["gen_us"] = k->gen_us;
          d["code"] = py::bytes(reinterpret_cast<const char*>(k->code.data()), k->code.size());
          out.append(d);
        }
        return out;
      },
      py::arg("method"), py::arg("num_experts"), py::arg("top_k"), py::arg("hidden"),
      py::arg("intermediate"), py::arg("isa") = "");

  m.def("cache_stats", [] {
    CacheStats s = KernelCache::instance().stats();
    py::dict d;
    d["hits"] = s.hits;
    d["misses"] = s.misses;
    d["bytes"] = s.bytes;
    d["gen_us"] = s.gen_us;
    return d;
  });

  m.def(
      "machine_limits",
      [] {
        MachineLimits l;
        {
          py::gil_scoped_release release;
          l = measure_machine_limits(selected_isa());
        }
        py::dict d;
        d["read_gbs_1t"] = l.read_gbs_1t;
        d["read_gbs_2t"] = l.read_gbs_2t;
        d["peak_vnni_gops"] = l.peak_vnni_gops;
        d["peak_maddubsw_gops"] = l.peak_maddubsw_gops;
        d["peak_fma_gflops"] = l.peak_fma_gflops;
        d["peak_bf16_gflops"] = l.peak_bf16_gflops;
        return d;
      },
      "Measures the machine's read bandwidth and instruction peaks (takes a few seconds).");

  register_serving(m);
}
