// The pybind11 module kt_jit._core: translates between Python objects and the core's types.
// Tensors arrive as data pointers (the Python layer validates shapes, dtypes and contiguity).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>

#include "jit/bench_loops.hpp"
#include "jit/cpu/cpu.hpp"
#include "jit/gemm.hpp"
#include "jit/kernel.hpp"
#include "python/bindings_gguf.hpp"
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
  d["aarch64"] = f.aarch64;  // AArch64 HWCAP bits (false on x86-64)
  d["asimd"] = f.asimd;
  d["asimd_dp"] = f.asimd_dp;
  d["arm_bf16"] = f.arm_bf16;
  d["detected_isa"] = isa_name(detected_isa());
  py::dict refused;
  for (int l = int(detected_isa()) + 1; l < kNumIsaLevels; ++l)
    if (isa_is_neon(IsaLevel(l)) == f.aarch64)  // this architecture's levels only
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
namespace ktjit {
void register_convert(pybind11::module_& m);  // python/bindings_convert.cpp
void register_int4(pybind11::module_& m);     // python/bindings_int4.cpp
}  // namespace ktjit

PYBIND11_MODULE(_core, m) {
  m.doc() = "kt-jit core: CPU probe, generated kernels and the MoE executor";
  m.attr("__version__") = KT_JIT_VERSION;

  // C++ exceptions become Python ones: invalid_argument -> ValueError, runtime_error ->
  // RuntimeError (pybind11's defaults).
  m.def(
      "fp8_decode", [](int code) { return double(fp8_value(uint8_t(code))); }, py::arg("code"),
      "The value the FP8 kernels give an e4m3 byte (before scaling).");
  m.def("built_methods", [] { return std::string(built_methods()); });
  m.def("grouped_shard_bounds", &MoELayer::grouped_shard_bounds, py::arg("intermediate"),
        py::arg("down_group"), py::arg("shards"),
        "Even shard bounds [0, ..., I] of a grouped (LLAMAFILE/RAWINT4/GPTQ_INT4) layer on "
        "multiples of down_group (pass down's super block for two-level scales).");
  m.def(
      "isa", [] { return std::string(isa_name(selected_isa())); },
      "The selected ISA level (detected, capped by KT_JIT_ISA).");
  m.def("detected_isa", [] { return std::string(isa_name(detected_isa())); });
  m.def("cpu_features", &features_dict, "What the CPU probe found.");
  m.def("runnable_isas", [] {
    std::vector<std::string> v;
    for (int l = int(selected_isa()); l >= 0; --l)
      if (l == 0 || level_usable(IsaLevel(l), cpu_features())) v.push_back(isa_name(IsaLevel(l)));
    return v;
  });
  m.def(
      "init_pool",
      [](int threads, int pools, const std::vector<int>& numa_nodes) {
        ThreadPool& p = ThreadPool::global(threads, pools, numa_nodes);
        return py::make_tuple(p.size(), p.pools());
      },
      py::arg("threads"), py::arg("pools") = 1, py::arg("numa_nodes") = std::vector<int>{},
      "Creates the process-wide worker pools (pool i on NUMA node numa_nodes[i], default i; "
      "KT_JIT_TOPOLOGY simulates a topology); the first call wins.");
  m.def("pool_size", [] { return ThreadPool::global_exists() ? ThreadPool::global().size() : 0; });
  m.def(
      "pool_info",
      [] {
        py::dict d;
        if (!ThreadPool::global_exists()) return d;
        ThreadPool& p = ThreadPool::global();
        std::vector<int> threads, nodes;
        for (int i = 0; i < p.pools(); ++i) {
          threads.push_back(p.pool_size(i));
          nodes.push_back(p.pool_node(i));
        }
        d["threads"] = p.size();
        d["pools"] = p.pools();
        d["pool_threads"] = threads;
        d["numa_nodes"] = nodes;
        d["bound"] = p.bound();
        d["topology"] = p.topology().describe();
        return d;
      },
      "The worker pools in effect (empty before init_pool): threads per pool, their NUMA nodes, "
      "whether threads and memory are bound, and the topology they were planned on.");

  py::class_<PyMoELayer>(m, "MoELayer")
      .def(py::init([](int64_t E, int64_t K, int64_t H, int64_t I, const std::string& method,
                       const std::string& isa, const std::vector<int64_t>& shard_bounds, int shards,
                       float swiglu_limit, float swiglu_alpha, int64_t gu_group, int64_t down_group,
                       bool gu_bias, bool down_bias, const std::vector<int>& gu_lut,
                       const std::vector<int>& down_lut, const std::vector<int>& gu_code_range,
                       const std::vector<int>& down_code_range, int64_t gu_super_group,
                       int64_t down_super_group, const std::string& gu_scale_dtype,
                       const std::string& down_scale_dtype) {
             auto l = std::make_unique<PyMoELayer>();
             const MoEShape shape{E, K, H, I};
             if (shards <= 0)  // one shard per worker pool (pool s % pools runs shard s)
               shards = ThreadPool::global_exists() ? ThreadPool::global().pools() : 1;
             const bool grouped = method_format(method) == WeightFormat::qgroup;
             if (grouped || gu_group || down_group || gu_bias || down_bias || !gu_lut.empty() ||
                 !down_lut.empty() || !gu_code_range.empty() || !down_code_range.empty() ||
                 gu_super_group || down_super_group || !gu_scale_dtype.empty() ||
                 !down_scale_dtype.empty()) {
               if (!grouped)
                 throw std::invalid_argument(
                     "gu_group / down_group / *_bias / *_lut apply to LLAMAFILE, RAWINT4 and "
                     "GPTQ_INT4 only, not to method " +
                     method);
               if (gu_group <= 0 || down_group <= 0)
                 throw std::invalid_argument("method " + method +
                                             " needs gu_group and down_group (the k-group sizes of "
                                             "gate/up and down, multiples of 16), got " +
                                             std::to_string(gu_group) + " and " +
                                             std::to_string(down_group));
               auto spec = [](int64_t group, bool bias, const std::vector<int>& lut,
                              const std::vector<int>& range, int64_t super_group,
                              const std::string& scale_dtype, const char* what) {
                 formats::GroupedSpec sp;
                 sp.group = group;
                 sp.super_group = super_group;  // checked by check_grouped_spec
                 if (scale_dtype == "f16")
                   sp.scale_dtype = formats::FloatType::f16;
                 else if (scale_dtype == "bf16")
                   sp.scale_dtype = formats::FloatType::bf16;
                 else if (!scale_dtype.empty() && scale_dtype != "f32")
                   throw std::invalid_argument(std::string(what) +
                                               "_scale_dtype: expected 'f32', 'f16' or 'bf16', "
                                               "got '" +
                                               scale_dtype + "'");
                 sp.bias = bias;
                 sp.code_bits = lut.empty() ? 8 : 4;
                 if (!range.empty()) {  // byte codes' range (checked by check_grouped_spec)
                   if (range.size() != 2)
                     throw std::invalid_argument(std::string(what) +
                                                 "_code_range: expected [lo, hi], got " +
                                                 std::to_string(range.size()) + " values");
                   sp.code_lo = range[0];
                   sp.code_hi = range[1];
                 }
                 if (!lut.empty() && lut.size() != 16)
                   throw std::invalid_argument(std::string(what) +
                                               "_lut: expected 16 codes (or none for 8-bit "
                                               "codes), got " +
                                               std::to_string(lut.size()));
                 for (size_t i = 0; i < lut.size(); ++i) {
                   if (lut[i] < -128 || lut[i] > 127)
                     throw std::invalid_argument(std::string(what) + "_lut[" + std::to_string(i) +
                                                 "]: expected a code in "
                                                 "[-128, 127], got " +
                                                 std::to_string(lut[i]));
                   sp.lut[i] = int8_t(lut[i]);
                 }
                 return sp;
               };
               const formats::GroupedSpec gu = spec(gu_group, gu_bias, gu_lut, gu_code_range,
                                                    gu_super_group, gu_scale_dtype, "gu");
               const formats::GroupedSpec dn =
                   spec(down_group, down_bias, down_lut, down_code_range, down_super_group,
                        down_scale_dtype, "down");
               const int64_t unit = formats::qgroup_unit(dn);
               std::vector<int64_t> bounds = shard_bounds;
               if (bounds.empty() && I > 0 && I % unit == 0)
                 bounds = MoELayer::grouped_shard_bounds(I, unit, shards);
               l->layer = std::make_unique<MoELayer>(shape, method, level_arg(isa), bounds, gu, dn);
               return l;
             }
             l->layer =
                 shard_bounds.empty()
                     ? std::make_unique<MoELayer>(shape, method, level_arg(isa), shards)
                     : std::make_unique<MoELayer>(shape, method, level_arg(isa), shard_bounds);
             if (swiglu_limit != 0.0f || swiglu_alpha != 0.0f)
               l->layer->set_swiglu(swiglu_limit, swiglu_alpha);
             return l;
           }),
           py::arg("num_experts"), py::arg("top_k"), py::arg("hidden"), py::arg("intermediate"),
           py::arg("method") = "AMXINT8", py::arg("isa") = "",
           py::arg("shard_bounds") = std::vector<int64_t>{}, py::arg("shards") = 0,
           py::arg("swiglu_limit") = 0.0f, py::arg("swiglu_alpha") = 0.0f, py::arg("gu_group") = 0,
           py::arg("down_group") = 0, py::arg("gu_bias") = false, py::arg("down_bias") = false,
           py::arg("gu_lut") = std::vector<int>{}, py::arg("down_lut") = std::vector<int>{},
           py::arg("gu_code_range") = std::vector<int>{},
           py::arg("down_code_range") = std::vector<int>{}, py::arg("gu_super_group") = 0,
           py::arg("down_super_group") = 0, py::arg("gu_scale_dtype") = "",
           py::arg("down_scale_dtype") = "",
           "shard_bounds: [0, b1, ..., I] splits I into shards (e.g. a checkpoint's NUMA parts); "
           "*_super_group: K elements per super block of two-level scales (GGUF K-quants: 256; "
           "each group's scale is then kept as an int8 sub-scale times an fp32 factor per super "
           "block, exactly; 0: fp32 scales); *_scale_dtype: 'f16' or 'bf16' keeps one-level "
           "scales (and biases) in that type, exactly (values it does not hold are refused at "
           "load), '' or 'f32' as fp32; "
           "*_code_range: [lo, hi] of byte codes (default the whole byte; a narrow range lets "
           "avx2 take offset-code kernels, codes outside it are refused at load); "
           "otherwise `shards` even parts on the format's block boundaries (0: one per worker "
           "pool). Shard s runs on pool s % pools; each shard quantizes the down projection's "
           "input over its own slice.")
      .def_property_readonly("shard_bounds",
                             [](const PyMoELayer& s) {
                               std::vector<int64_t> b{0};
                               for (int i = 0; i < s.layer->num_shards(); ++i)
                                 b.push_back(s.layer->shard_range(i).second);
                               return b;
                             })
      .def(
          "load_experts_grouped",
          [](PyMoELayer& self, const std::vector<int64_t>& slots,
             const std::vector<uintptr_t>& gate_codes, const std::vector<uintptr_t>& gate_scales,
             const std::vector<uintptr_t>& gate_biases, const std::vector<uintptr_t>& up_codes,
             const std::vector<uintptr_t>& up_scales, const std::vector<uintptr_t>& up_biases,
             const std::vector<uintptr_t>& down_codes, const std::vector<uintptr_t>& down_scales,
             const std::vector<uintptr_t>& down_biases) {
            const size_t n = slots.size();
            for (size_t len : {gate_codes.size(), gate_scales.size(), gate_biases.size(),
                               up_codes.size(), up_scales.size(), up_biases.size(),
                               down_codes.size(), down_scales.size(), down_biases.size()})
              if (len != n)
                throw std::invalid_argument(
                    "load_experts_grouped: every pointer list must have len(slots) entries");
            const int64_t gg = self.layer->grouped_spec(false).group;
            const int64_t dg = self.layer->grouped_spec(true).group;
            std::vector<MoELayer::GroupedExpertSource> src;
            for (size_t i = 0; i < n; ++i)
              src.push_back({slots[i],
                             {ptr<const int8_t>(gate_codes[i]), ptr<const float>(gate_scales[i]),
                              ptr<const float>(gate_biases[i]), gg},
                             {ptr<const int8_t>(up_codes[i]), ptr<const float>(up_scales[i]),
                              ptr<const float>(up_biases[i]), gg},
                             {ptr<const int8_t>(down_codes[i]), ptr<const float>(down_scales[i]),
                              ptr<const float>(down_biases[i]), dg}});
            py::gil_scoped_release release;
            self.layer->load_experts_grouped(src, ThreadPool::global());
          },
          py::arg("slots"), py::arg("gate_codes"), py::arg("gate_scales"), py::arg("gate_biases"),
          py::arg("up_codes"), py::arg("up_scales"), py::arg("up_biases"), py::arg("down_codes"),
          py::arg("down_scales"), py::arg("down_biases"),
          "Packs k-group quantized experts (LLAMAFILE, RAWINT4, GPTQ_INT4): per expert int8 codes "
          "gate/up [I, H], down [H, I] and fp32 scales (and biases; 0 = none) [rows, K / group], "
          "row-major, as data pointers; w = scale * code + bias per group.")
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
      .def_property_readonly("swiglu_limit",
                             [](const PyMoELayer& s) { return s.layer->swiglu_limit(); })
      .def_property_readonly("swiglu_alpha",
                             [](const PyMoELayer& s) { return s.layer->swiglu_alpha(); })
      .def(
          "load_experts_mx",
          [](PyMoELayer& self, const std::vector<int64_t>& slots,
             const std::vector<uintptr_t>& gate, const std::vector<uintptr_t>& up,
             const std::vector<uintptr_t>& down, const std::vector<uintptr_t>& gate_scale,
             const std::vector<uintptr_t>& up_scale, const std::vector<uintptr_t>& down_scale) {
            const size_t n = slots.size();
            for (size_t len : {gate.size(), up.size(), down.size(), gate_scale.size(),
                               up_scale.size(), down_scale.size()})
              if (len != n)
                throw std::invalid_argument(
                    "load_experts_mx: every pointer list must have len(slots) entries");
            std::vector<MoELayer::MxExpertSource> src;
            for (size_t i = 0; i < n; ++i)
              src.push_back({slots[i], ptr<const uint8_t>(gate[i]), ptr<const uint8_t>(up[i]),
                             ptr<const uint8_t>(down[i]), ptr<const uint8_t>(gate_scale[i]),
                             ptr<const uint8_t>(up_scale[i]), ptr<const uint8_t>(down_scale[i])});
            py::gil_scoped_release release;
            self.layer->load_experts_mx(src, ThreadPool::global());
          },
          py::arg("slots"), py::arg("gate"), py::arg("up"), py::arg("down"), py::arg("gate_scale"),
          py::arg("up_scale"), py::arg("down_scale"),
          "Packs MXFP4 / MXFP8 experts: gate/up [I, H/2] (MXFP4 nibbles, low = even k) or [I, H] "
          "(e4m3) bytes, down [H, I/2] or [H, I]; ue8m0 scales [N, K/32] (uint8) per matrix.")
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
          "FP8_PERCHANNEL, MXFP4, MXFP8, RAWINT4, GPTQ_INT4) into host memory: w13 = [gate; up] "
          "rows of the rank's I slice, w2 = down's column slice, scales alike.")
      .def(
          "write_expert_bytes",
          [](const PyMoELayer& self, int tp) {
            const auto b = self.layer->write_expert_bytes(tp);
            return py::make_tuple(b[0], b[1], b[2], b[3]);
          },
          py::arg("tp"), "Bytes write_expert writes through (w13, w13_scale, w2, w2_scale).")
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
      "retire_kernels", [] { return KernelCache::instance().retire_all(); },
      "Forget the generated kernels (they stay alive for the layers holding them), so the next "
      "layer built generates its own: in-process A/Bs of settings the generators read "
      "(tools/ab_layer.py --fresh-kernels). Returns how many were forgotten.");

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
        d["peak_maddubsw_w_gops"] = l.peak_maddubsw_w_gops;
        d["peak_fma_gflops"] = l.peak_fma_gflops;
        d["peak_bf16_gflops"] = l.peak_bf16_gflops;
        d["peak_amx_int8_gops"] = l.peak_amx_int8_gops;
        d["peak_amx_bf16_gflops"] = l.peak_amx_bf16_gflops;
        d["peak_sdot_gops"] = l.peak_sdot_gops;  // AArch64 levels (fmla is peak_fma_gflops)
        d["peak_smull_gops"] = l.peak_smull_gops;
        d["peak_bfdot_gflops"] = l.peak_bfdot_gflops;
        return d;
      },
      "Measures the machine's read bandwidth and instruction peaks (takes a few seconds).");
  m.def(
      "measure_peak_threads",
      [](const std::string& limit_key, int threads) {
        static const std::pair<const char*, PeakOp> ops[] = {
            {"peak_vnni_gops", PeakOp::vpdpbusd},         {"peak_maddubsw_gops", PeakOp::maddubsw},
            {"peak_maddubsw_w_gops", PeakOp::maddubsw_w}, {"peak_fma_gflops", PeakOp::fma_f32},
            {"peak_bf16_gflops", PeakOp::dpbf16},         {"peak_amx_int8_gops", PeakOp::tdpbusd},
            {"peak_amx_bf16_gflops", PeakOp::tdpbf16ps},  {"peak_sdot_gops", PeakOp::sdot},
            {"peak_smull_gops", PeakOp::smull_sadalp},    {"peak_bfdot_gflops", PeakOp::bfdot},
        };
        for (const auto& [name, op] : ops)
          if (limit_key == name) {
            py::gil_scoped_release release;
            return measure_peak_gops_threads(selected_isa(), uint8_t(op), threads);
          }
        throw std::invalid_argument("measure_peak_threads: unknown peak '" + limit_key +
                                    "' (a machine_limits() peak key)");
      },
      py::arg("limit_key"), py::arg("threads"),
      "The aggregate Gop/s of machine_limits()' peak `limit_key` with `threads` threads running "
      "its loop at once, each pinned to its own CPU (whether that doubles one core's peak "
      "depends on the CPUs).");

  py::class_<ReadProbe>(m, "ReadProbe",
                        "A streaming-read buffer (mapped and first-touched once); pass_gbs() "
                        "times one read of it on the calling thread, or with on_pool=True on "
                        "every thread of the init_pool() pools (the buffer split in equal parts, "
                        "each first-touched and read by its thread).")
      .def(py::init([](int64_t bytes, bool on_pool) {
             if (bytes < 1024) throw std::invalid_argument("ReadProbe: bytes must be >= 1024");
             if (!on_pool) return std::make_unique<ReadProbe>(size_t(bytes));
             if (!ThreadPool::global_exists())
               throw std::invalid_argument("ReadProbe: on_pool=True needs init_pool() first");
             ThreadPool& pool = ThreadPool::global();
             if (bytes < int64_t(pool.size()) * 1024)
               throw std::invalid_argument("ReadProbe: bytes must be >= 1024 per pool thread (" +
                                           std::to_string(pool.size()) + " threads), got " +
                                           std::to_string(bytes));
             py::gil_scoped_release release;  // (the first touch runs on the pool)
             return std::make_unique<ReadProbe>(size_t(bytes), &pool);
           }),
           py::arg("bytes") = int64_t(256) << 20, py::arg("on_pool") = false)
      .def("pass_gbs",
           [](ReadProbe& p) {
             py::gil_scoped_release release;
             return p.pass_gbs();
           })
      .def_property_readonly("bytes", [](const ReadProbe& p) { return int64_t(p.bytes()); })
      .def_property_readonly("threads", &ReadProbe::threads);

  register_serving(m);
  register_gguf(m);     // python/bindings_gguf.cpp
  register_convert(m);  // python/bindings_convert.cpp
  register_int4(m);     // python/bindings_int4.cpp
}
