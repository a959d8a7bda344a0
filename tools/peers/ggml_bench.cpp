// llama.cpp's CPU backend (ggml-cpu) running one MoE FFN layer as llama.cpp builds it
// (src/llama-graph.cpp build_moe_ffn: mul_mat_id up and gate, swiglu_split, mul_mat_id down,
// times the routing weights, the top-k slots summed), as a peer of `kt-jit bench --llamacpp-peer`
// (a bench tool, not part of the kt-jit library; it is built against a ggml that
// tools/peers/setup_peers.sh builds from PyPI's llama-cpp-python sdist).
//
// Weights: random N(0, 1) * 0.02 rows quantized with ggml_quantize_chunk into the GGML type of
// gate/up and of down (4 distinct experts' data tiled over all experts, as quantizing a whole
// layer would take minutes), placed where llama.cpp's model loader places them: in the first CPU
// "extra" buffer type (CPU_REPACK: Q4_0, Q4_K, IQ4_NL, ... repacked for the CPU) whose
// supports_op accepts the mul_mat_id, else the plain CPU buffer. `--layers` copies rotate so
// decode streams the weights from DRAM. Inputs: f32 hidden states, `--topk` distinct random
// experts per token, random weights.
//
// Per token count: one graph per layer copy, built and allocated once (ggml_gallocr), then timed
// with ggml_backend_graph_compute: one warm-up pass over the layers, then calls until the budget
// (>= 3), the median reported. Before timing, layer 0's output at the smallest T is checked
// against a float64 MoE over the dequantized weights (ggml's to_float) and the f32 inputs: the
// relative L1 error (ggml quantizes activations to Q8_K / Q8_0 inside, so ~1e-2 is expected).
//
// Build: g++ -O2 -std=c++17 tools/peers/ggml_bench.cpp -I$P/include -L$P/lib -lggml -lggml-base
//        -lggml-cpu -Wl,-rpath,$P/lib          (P = the prefix setup_peers.sh installed ggml into)
// Run:   ggml_bench --experts 128 --topk 8 --hidden 2048 --inter 768 --gu-type Q4_K
//        --down-type Q6_K --tokens 1,4,64,1024 --threads 1 --layers 4 --budget-ms 20000
// Prints one JSON document (one line) starting with {"peer": "ggml", ...}.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

namespace {

struct Args {
  int64_t E = 128, K = 8, H = 2048, I = 768;
  std::string gu_type = "Q4_K", down_type = "Q4_K";
  std::vector<int64_t> tokens = {1, 4, 64, 1024};
  int threads = 1, layers = 4;
  double budget_ms = 20000;
  bool repack = true;
  uint32_t seed = 1;
};

std::vector<int64_t> parse_list(const std::string& s) {
  std::vector<int64_t> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) out.push_back(std::atoll(item.c_str()));
  return out;
}

ggml_type type_by_name(const std::string& name) {
  for (int t = 0; t < GGML_TYPE_COUNT; ++t) {
    const ggml_type_traits* tr = ggml_get_type_traits(ggml_type(t));
    if (tr && tr->type_name && name == tr->type_name) return ggml_type(t);
  }
  // ggml names types in lower case ("q4_K"); accept the GGUF spelling too
  std::string lower = name;
  for (char& c : lower) c = char(std::tolower(c));
  for (int t = 0; t < GGML_TYPE_COUNT; ++t) {
    const ggml_type_traits* tr = ggml_get_type_traits(ggml_type(t));
    if (!tr || !tr->type_name) continue;
    std::string n = tr->type_name;
    for (char& c : n) c = char(std::tolower(c));
    if (n == lower) return ggml_type(t);
  }
  throw std::invalid_argument("unknown GGML type " + name);
}

double now_ms() {
  return std::chrono::duration<double, std::milli>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// One layer's three expert tensors ([K_in, N_out, E] in ggml order), in their own buffers.
struct Layer {
  ggml_context* ctx = nullptr;
  ggml_tensor *gate = nullptr, *up = nullptr, *down = nullptr;
  std::vector<ggml_backend_buffer_t> bufs;
};

// The buffer type llama.cpp's loader would put a mul_mat_id weight of this type in: the first CPU
// extra buffer type whose supports_op takes the op, else the CPU buffer type.
ggml_backend_buffer_type_t weight_buft(ggml_backend_dev_t dev, ggml_type type, int64_t k, int64_t n,
                                       int64_t e, int64_t topk, bool repack, std::string* name) {
  ggml_backend_buffer_type_t cpu = ggml_backend_cpu_buffer_type();
  *name = ggml_backend_buft_name(cpu);
  if (!repack) return cpu;
  ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
  auto get_extra = reinterpret_cast<ggml_backend_dev_get_extra_bufts_t>(
      ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts"));
  if (!get_extra) return cpu;
  for (ggml_backend_buffer_type_t* b = get_extra(dev); b && *b; ++b) {
    ggml_init_params p{ggml_tensor_overhead() * 8, nullptr, true};
    ggml_context* ctx = ggml_init(p);
    ggml_tensor* w = ggml_new_tensor_3d(ctx, type, k, n, e);
    ggml_tensor* x = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, k, 1, 1);
    ggml_tensor* ids = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, topk, 1);
    ggml_tensor* op = ggml_mul_mat_id(ctx, w, x, ids);
    // a dummy buffer of this type so supports_op sees where the weight would live
    ggml_backend_buffer_t dummy = ggml_backend_buft_alloc_buffer(*b, 0);
    w->buffer = dummy;
    const bool ok = ggml_backend_dev_supports_op(dev, op);
    w->buffer = nullptr;
    ggml_backend_buffer_free(dummy);
    ggml_free(ctx);
    if (ok) {
      *name = ggml_backend_buft_name(*b);
      return *b;
    }
  }
  return cpu;
}

// `rows` rows of `k` from N(0, 1) * 0.02, quantized to `type` (4 distinct experts tiled).
std::vector<uint8_t> make_weights(ggml_type type, int64_t k, int64_t n, int64_t e,
                                  std::mt19937& rng) {
  const size_t row_bytes = ggml_row_size(type, k);
  const int64_t distinct = std::min<int64_t>(e, 4);
  std::vector<uint8_t> q(size_t(e * n) * row_bytes);
  std::normal_distribution<float> nd(0.0f, 0.02f);
  std::vector<float> src(size_t(n * k));
  for (int64_t x = 0; x < distinct; ++x) {
    for (float& v : src) v = nd(rng);
    ggml_quantize_chunk(type, src.data(), q.data() + size_t(x * n) * row_bytes, 0, n, k, nullptr);
  }
  for (int64_t x = distinct; x < e; ++x)
    std::memcpy(q.data() + size_t(x * n) * row_bytes,
                q.data() + size_t((x % distinct) * n) * row_bytes, size_t(n) * row_bytes);
  return q;
}

void set_weight(ggml_tensor* t, const std::vector<uint8_t>& data) {
  ggml_backend_tensor_set(t, data.data(), 0, data.size());
}

// The float value of expert `x`, row `r` of a weight (ggml's own dequantization).
std::vector<float> dequant_row(ggml_type type, const std::vector<uint8_t>& q, int64_t k, int64_t n,
                               int64_t x, int64_t r) {
  std::vector<float> out(static_cast<size_t>(k));
  const size_t row_bytes = ggml_row_size(type, k);
  const uint8_t* p = q.data() + size_t(x * n + r) * row_bytes;
  if (type == GGML_TYPE_F32)
    std::memcpy(out.data(), p, size_t(k) * 4);
  else
    ggml_get_type_traits(type)->to_float(p, out.data(), k);
  return out;
}

struct Graph {
  ggml_context* ctx = nullptr;
  ggml_cgraph* gf = nullptr;
  ggml_gallocr_t alloc = nullptr;
  ggml_tensor *x = nullptr, *ids = nullptr, *w = nullptr, *out = nullptr;
};

// build_moe_ffn's graph for T tokens over one layer.
Graph build(const Args& a, const Layer& l, int64_t T) {
  Graph g;
  ggml_init_params p{ggml_tensor_overhead() * 64 + ggml_graph_overhead(), nullptr, true};
  g.ctx = ggml_init(p);
  g.x = ggml_new_tensor_3d(g.ctx, GGML_TYPE_F32, a.H, 1, T);
  g.ids = ggml_new_tensor_2d(g.ctx, GGML_TYPE_I32, a.K, T);
  g.w = ggml_new_tensor_3d(g.ctx, GGML_TYPE_F32, 1, a.K, T);
  // inputs, kept as outputs too so the allocator never reuses their memory: they are set once and
  // the graph is computed many times
  for (ggml_tensor* t : {g.x, g.ids, g.w}) {
    ggml_set_input(t);
    ggml_set_output(t);
  }
  ggml_tensor* up = ggml_mul_mat_id(g.ctx, l.up, g.x, g.ids);       // [I, K, T]
  ggml_tensor* gate = ggml_mul_mat_id(g.ctx, l.gate, g.x, g.ids);   // [I, K, T]
  ggml_tensor* h = ggml_swiglu_split(g.ctx, gate, up);              // silu(gate) * up
  ggml_tensor* experts = ggml_mul_mat_id(g.ctx, l.down, h, g.ids);  // [H, K, T]
  experts = ggml_mul(g.ctx, experts, g.w);
  g.gf = ggml_new_graph(g.ctx);
  ggml_build_forward_expand(g.gf, experts);
  ggml_tensor* sum = nullptr;
  for (int64_t j = 0; j < a.K; ++j) {
    ggml_tensor* v =
        ggml_view_2d(g.ctx, experts, a.H, T, experts->nb[2], size_t(j) * experts->nb[1]);
    ggml_build_forward_expand(g.gf, v);
    sum = sum ? ggml_add(g.ctx, sum, v) : v;
    ggml_build_forward_expand(g.gf, sum);
  }
  g.out = ggml_cont(g.ctx, sum);
  ggml_set_output(g.out);
  ggml_build_forward_expand(g.gf, g.out);
  g.alloc = ggml_gallocr_new(ggml_backend_cpu_buffer_type());
  if (!ggml_gallocr_alloc_graph(g.alloc, g.gf)) throw std::runtime_error("gallocr failed");
  return g;
}

void free_graph(Graph& g) {
  ggml_gallocr_free(g.alloc);
  ggml_free(g.ctx);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--experts")
      a.E = std::atoll(v.c_str());
    else if (k == "--topk")
      a.K = std::atoll(v.c_str());
    else if (k == "--hidden")
      a.H = std::atoll(v.c_str());
    else if (k == "--inter")
      a.I = std::atoll(v.c_str());
    else if (k == "--gu-type")
      a.gu_type = v;
    else if (k == "--down-type")
      a.down_type = v;
    else if (k == "--tokens")
      a.tokens = parse_list(v);
    else if (k == "--threads")
      a.threads = std::atoi(v.c_str());
    else if (k == "--layers")
      a.layers = std::max(1, std::atoi(v.c_str()));
    else if (k == "--budget-ms")
      a.budget_ms = std::atof(v.c_str());
    else if (k == "--repack")
      a.repack = std::atoi(v.c_str()) != 0;
    else if (k == "--seed")
      a.seed = uint32_t(std::atoi(v.c_str()));
    else {
      std::fprintf(stderr, "unknown argument %s\n", k.c_str());
      return 2;
    }
  }
  try {
    ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (!dev) throw std::runtime_error("no CPU backend device");
    ggml_backend_t backend = ggml_backend_dev_init(dev, nullptr);
    ggml_backend_cpu_set_n_threads(backend, a.threads);
    const ggml_type gu_t = type_by_name(a.gu_type), dn_t = type_by_name(a.down_type);
    std::string gu_buft, dn_buft;
    ggml_backend_buffer_type_t gb = weight_buft(dev, gu_t, a.H, a.I, a.E, a.K, a.repack, &gu_buft);
    ggml_backend_buffer_type_t db = weight_buft(dev, dn_t, a.I, a.H, a.E, a.K, a.repack, &dn_buft);
    std::mt19937 rng(a.seed);
    const std::vector<uint8_t> wg = make_weights(gu_t, a.H, a.I, a.E, rng);
    const std::vector<uint8_t> wu = make_weights(gu_t, a.H, a.I, a.E, rng);
    const std::vector<uint8_t> wd = make_weights(dn_t, a.I, a.H, a.E, rng);
    const double layer_bytes = double(wg.size() + wu.size() + wd.size());
    std::vector<Layer> layers(size_t(a.layers));
    for (Layer& l : layers) {
      ggml_init_params p{ggml_tensor_overhead() * 4, nullptr, true};
      l.ctx = ggml_init(p);
      l.gate = ggml_new_tensor_3d(l.ctx, gu_t, a.H, a.I, a.E);
      l.up = ggml_new_tensor_3d(l.ctx, gu_t, a.H, a.I, a.E);
      l.down = ggml_new_tensor_3d(l.ctx, dn_t, a.I, a.H, a.E);
      // each weight in its own buffer of its type (gate/up and down may differ)
      for (ggml_tensor* t : {l.gate, l.up, l.down}) {
        ggml_backend_buffer_type_t bt = t == l.down ? db : gb;
        ggml_backend_buffer_t buf =
            ggml_backend_buft_alloc_buffer(bt, ggml_backend_buft_get_alloc_size(bt, t));
        if (!buf) throw std::runtime_error("weight buffer allocation failed");
        ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        if (ggml_backend_tensor_alloc(buf, t, ggml_backend_buffer_get_base(buf)) !=
            GGML_STATUS_SUCCESS)
          throw std::runtime_error("weight tensor allocation failed");
        l.bufs.push_back(buf);
      }
      set_weight(l.gate, wg);
      set_weight(l.up, wu);
      set_weight(l.down, wd);
    }

    std::string results;
    double rel_l1 = -1;
    int64_t checked_t = 0;
    for (size_t ti = 0; ti < a.tokens.size(); ++ti) {
      const int64_t T = a.tokens[ti];
      std::vector<float> x(size_t(T * a.H)), w(size_t(T * a.K));
      std::vector<int32_t> ids(size_t(T * a.K));
      std::uniform_real_distribution<float> ud(-1.0f, 1.0f), wdist(0.05f, 0.25f);
      for (float& v : x) v = ud(rng);
      for (float& v : w) v = wdist(rng);
      std::vector<int32_t> perm(size_t(a.E));
      std::vector<char> touched(size_t(a.E), 0);
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t e = 0; e < a.E; ++e) perm[size_t(e)] = int32_t(e);
        std::shuffle(perm.begin(), perm.end(), rng);
        for (int64_t j = 0; j < a.K; ++j) {
          ids[size_t(t * a.K + j)] = perm[size_t(j)];
          touched[size_t(perm[size_t(j)])] = 1;
        }
      }
      const int64_t n_touched = std::count(touched.begin(), touched.end(), 1);
      std::vector<Graph> graphs;
      for (const Layer& l : layers) {
        graphs.push_back(build(a, l, T));
        Graph& g = graphs.back();
        ggml_backend_tensor_set(g.x, x.data(), 0, x.size() * 4);
        ggml_backend_tensor_set(g.ids, ids.data(), 0, ids.size() * 4);
        ggml_backend_tensor_set(g.w, w.data(), 0, w.size() * 4);
      }
      if (ti == 0) {  // the check: layer 0 against float64 over the dequantized weights
        if (ggml_backend_graph_compute(backend, graphs[0].gf) != GGML_STATUS_SUCCESS)
          throw std::runtime_error("graph compute failed");
        std::vector<float> out(size_t(T * a.H));
        ggml_backend_tensor_get(graphs[0].out, out.data(), 0, out.size() * 4);
        double num = 0, den = 0;
        for (int64_t t = 0; t < std::min<int64_t>(T, 2); ++t) {
          std::vector<double> y(size_t(a.H), 0.0);
          for (int64_t j = 0; j < a.K; ++j) {
            const int64_t e = ids[size_t(t * a.K + j)];
            std::vector<double> h(size_t(a.I));
            for (int64_t i = 0; i < a.I; ++i) {
              const std::vector<float> gr = dequant_row(gu_t, wg, a.H, a.I, e, i);
              const std::vector<float> ur = dequant_row(gu_t, wu, a.H, a.I, e, i);
              double gs = 0, us = 0;
              for (int64_t k = 0; k < a.H; ++k) {
                gs += double(gr[size_t(k)]) * x[size_t(t * a.H + k)];
                us += double(ur[size_t(k)]) * x[size_t(t * a.H + k)];
              }
              h[size_t(i)] = gs / (1.0 + std::exp(-gs)) * us;
            }
            for (int64_t c = 0; c < a.H; ++c) {
              const std::vector<float> dr = dequant_row(dn_t, wd, a.I, a.H, e, c);
              double s = 0;
              for (int64_t i = 0; i < a.I; ++i) s += double(dr[size_t(i)]) * h[size_t(i)];
              y[size_t(c)] += double(w[size_t(t * a.K + j)]) * s;
            }
          }
          for (int64_t c = 0; c < a.H; ++c) {
            num += std::fabs(double(out[size_t(t * a.H + c)]) - y[size_t(c)]);
            den += std::fabs(y[size_t(c)]);
          }
        }
        rel_l1 = den > 0 ? num / den : 0.0;
        checked_t = T;
      }
      for (Graph& g : graphs)  // warm-up: one call per layer
        if (ggml_backend_graph_compute(backend, g.gf) != GGML_STATUS_SUCCESS)
          throw std::runtime_error("graph compute failed");
      std::vector<double> times;
      const double start = now_ms();
      for (size_t rep = 0;; ++rep) {
        Graph& g = graphs[rep % graphs.size()];
        const double t0 = now_ms();
        ggml_backend_graph_compute(backend, g.gf);
        times.push_back(now_ms() - t0);
        if (times.size() >= 3 && now_ms() - start > a.budget_ms) break;
        if (times.size() >= 200) break;
      }
      const double med = median(times);
      char line[512];
      std::snprintf(line, sizeof line,
                    "%s{\"tokens\": %lld, \"us\": %.1f, \"us_min\": %.1f, \"reps\": %zu, "
                    "\"experts_touched\": %lld}",
                    results.empty() ? "" : ", ", static_cast<long long>(T), med * 1e3,
                    *std::min_element(times.begin(), times.end()) * 1e3, times.size(),
                    static_cast<long long>(n_touched));
      results += line;
      for (Graph& g : graphs) free_graph(g);
    }
    std::printf(
        "{\"peer\": \"ggml\", \"ggml_version\": \"%s\", \"ggml_commit\": \"%s\", \"gu_type\": "
        "\"%s\", \"down_type\": \"%s\", \"gu_buffer\": \"%s\", \"down_buffer\": \"%s\", "
        "\"threads\": %d, \"layers\": %d, \"layer_bytes\": %.0f, \"check_tokens\": %lld, "
        "\"rel_l1_vs_f64\": %.4g, \"results\": [%s]}\n",
        ggml_version(), ggml_commit(), a.gu_type.c_str(), a.down_type.c_str(), gu_buft.c_str(),
        dn_buft.c_str(), a.threads, a.layers, layer_bytes, static_cast<long long>(checked_t),
        rel_l1, results.c_str());
    for (Layer& l : layers) {
      for (ggml_backend_buffer_t b : l.bufs) ggml_backend_buffer_free(b);
      ggml_free(l.ctx);
    }
    ggml_backend_free(backend);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ggml_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
