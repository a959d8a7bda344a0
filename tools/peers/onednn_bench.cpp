// oneDNN matmul on MoE expert matrices, as a peer of `kt-jit bench` (a bench tool, not part of the
// kt-jit library). dst[M,N] = src[M,K] · W[K,N] with W stored as the model stores it ([N][K], tag
// ba), prepacked once into the layout oneDNN picks (format_tag::any; reorder not timed), then
// copied into enough buffers that rotating over them streams the weights from DRAM (>=
// --rotate-mib, by default 4x the L3), as in MoE decode.
//   bf16: bf16 src x bf16 W -> f32 dst
//   int8: u8 src x s8 W -> f32 dst with per-N output scales (no zero points; activation
//         quantization not timed)
// Build (bench.py does it on demand):  g++ -O2 -fopenmp tools/peers/onednn_bench.cpp -ldnnl
// Run:   onednn_bench [--threads 1] [--dtypes bf16,int8] [--ms 1,4,16,64,256,1024]
//                     [--shapes 768x2048,2048x768,2048x7168,7168x2048] [--budget-ms 4000]
//                     [--rotate-mib 0] [--wei-tag any|ab|ba]
// Prints one JSON document: per (dtype, N×K, M) the median µs, weight GB/s (N·K·bytes / time),
// Gop/s (2·M·N·K / time), and the implementation oneDNN dispatched (pd.impl_info_str()).
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "oneapi/dnnl/dnnl.hpp"

using namespace dnnl;
using dt = memory::data_type;
using tag = memory::format_tag;

namespace {

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, sep))
    if (!item.empty()) out.push_back(item);
  return out;
}

int64_t l3_bytes() {
  for (int i = 0; i < 8; ++i) {
    std::string base = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/";
    std::ifstream lv(base + "level");
    int level = 0;
    if (!(lv >> level)) break;
    if (level != 3) continue;
    std::ifstream sz(base + "size");
    std::string s;
    sz >> s;
    int64_t v = std::atoll(s.c_str());
    char u = s.empty() ? 0 : s.back();
    return u == 'K' ? v << 10 : u == 'M' ? v << 20 : u == 'G' ? v << 30 : v;
  }
  return int64_t(32) << 20;
}

const char* isa_name(cpu_isa isa) {
  switch (isa) {
    case cpu_isa::sse41: return "sse41";
    case cpu_isa::avx: return "avx";
    case cpu_isa::avx2: return "avx2";
    case cpu_isa::avx512_core: return "avx512_core";
    case cpu_isa::avx512_core_vnni: return "avx512_core_vnni";
    case cpu_isa::avx512_core_bf16: return "avx512_core_bf16";
    case cpu_isa::avx512_core_amx: return "avx512_core_amx";
    default: return "other";
  }
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Args {
  int threads = 1;
  std::vector<std::string> dtypes{"bf16", "int8"};
  std::vector<int64_t> ms{1, 4, 16, 64, 256, 1024};
  std::vector<std::pair<int64_t, int64_t>> shapes{
      {768, 2048}, {2048, 768}, {2048, 7168}, {7168, 2048}};
  double budget_ms = 4000;
  int64_t rotate_bytes = 0;
  int reps = 0;
  std::string wei_tag = "any";  // any (prepacked as oneDNN picks), ab or ba (plain)
};

// The weights' layout as oneDNN's verbose writes it (e.g. "ab", "BA16a64b4a").
std::string format_tag_of(const memory::desc& md) {
  const dnnl_memory_desc_t& d = md.data;
  if (d.format_kind != dnnl_blocked) return "non-blocked";
  const auto& b = d.format_desc.blocking;
  std::vector<int> order(size_t(d.ndims));
  bool blocked[DNNL_MAX_NDIMS] = {};
  for (int i = 0; i < b.inner_nblks; ++i) blocked[b.inner_idxs[i]] = true;
  for (int i = 0; i < d.ndims; ++i) order[size_t(i)] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](int x, int y) { return b.strides[x] > b.strides[y]; });
  std::string out;
  for (int i : order) out += char((blocked[i] ? 'A' : 'a') + i);
  for (int i = 0; i < b.inner_nblks; ++i)
    out += std::to_string(b.inner_blks[i]) + char('a' + b.inner_idxs[i]);
  return out;
}

int default_reps(int64_t m) {
  return m <= 16 ? 30 : m <= 64 ? 15 : m <= 256 ? 7 : 5;
}

// One weight matrix N×K of one dtype, prepacked and copied `copies` times.
struct Rotation {
  memory::desc packed;
  std::vector<memory> bufs;
};

void fill_plain(memory& m, dt type, std::mt19937& rng) {
  size_t bytes = m.get_desc().get_size();
  auto* p = static_cast<uint8_t*>(m.get_data_handle());
  if (type == dt::s8 || type == dt::u8) {
    for (size_t i = 0; i < bytes; ++i) p[i] = uint8_t(rng() % 255);
    if (type == dt::s8)
      for (size_t i = 0; i < bytes; ++i) p[i] = uint8_t(int8_t(int(p[i]) - 127));
  } else {  // bf16: small normal-ish values (bf16 = upper half of an f32)
    auto* q = reinterpret_cast<uint16_t*>(p);
    std::normal_distribution<float> nd(0.f, 0.02f);
    for (size_t i = 0; i < bytes / 2; ++i) {
      float f = nd(rng);
      uint32_t u;
      std::memcpy(&u, &f, 4);
      q[i] = uint16_t(u >> 16);
    }
  }
}

// (Re)pack the plain weights into `want` and make enough copies.
void ensure_rotation(Rotation& rot, const memory::desc& want, memory& plain, engine& eng,
                     stream& st, int64_t copies) {
  if (!rot.bufs.empty() && rot.packed == want) return;
  rot.bufs.clear();
  rot.packed = want;
  memory first(want, eng);
  reorder(plain, first).execute(st, plain, first);
  st.wait();
  rot.bufs.push_back(first);
  const size_t bytes = want.get_size();
  for (int64_t c = 1; c < copies; ++c) {
    memory m(want, eng);
    std::memcpy(m.get_data_handle(), first.get_data_handle(), bytes);
    rot.bufs.push_back(m);
  }
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "missing value for %s\n", k.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (k == "--threads")
      a.threads = std::max(1, std::atoi(val().c_str()));
    else if (k == "--dtypes")
      a.dtypes = split(val(), ',');
    else if (k == "--ms") {
      a.ms.clear();
      for (auto& s : split(val(), ',')) a.ms.push_back(std::atoll(s.c_str()));
    } else if (k == "--shapes") {
      a.shapes.clear();
      for (auto& s : split(val(), ',')) {
        auto nk = split(s, 'x');
        if (nk.size() != 2) {
          std::fprintf(stderr, "bad shape %s (want NxK)\n", s.c_str());
          return 2;
        }
        a.shapes.push_back({std::atoll(nk[0].c_str()), std::atoll(nk[1].c_str())});
      }
    } else if (k == "--budget-ms")
      a.budget_ms = std::atof(val().c_str());
    else if (k == "--rotate-mib")
      a.rotate_bytes = int64_t(std::atof(val().c_str()) * (1 << 20));
    else if (k == "--reps")
      a.reps = std::atoi(val().c_str());
    else if (k == "--wei-tag")
      a.wei_tag = val();
    else {
      std::fprintf(stderr, "unknown argument %s\n", k.c_str());
      return 2;
    }
  }
  omp_set_num_threads(a.threads);
  const int64_t l3 = l3_bytes();
  const int64_t rotate = a.rotate_bytes > 0 ? a.rotate_bytes : 4 * l3;

  engine eng(engine::kind::cpu, 0);
  stream st(eng);
  const auto ver = dnnl::version();
  std::mt19937 rng(1);

  std::string rows;
  for (const auto& dts : a.dtypes) {
    const bool int8 = dts == "int8";
    if (!int8 && dts != "bf16") {
      std::fprintf(stderr, "unknown dtype %s (bf16|int8)\n", dts.c_str());
      return 2;
    }
    const dt wdt = int8 ? dt::s8 : dt::bf16;
    const dt sdt = int8 ? dt::u8 : dt::bf16;
    const double bpw = int8 ? 1.0 : 2.0;
    for (auto [N, K] : a.shapes) {
      const int64_t wbytes = int64_t(N * K * bpw);
      const int64_t copies = std::max<int64_t>(2, (rotate + wbytes - 1) / wbytes);
      memory plain({{K, N}, wdt, tag::ba}, eng);
      fill_plain(plain, wdt, rng);
      Rotation rot;
      std::vector<float> scales(size_t(N), 0.01f);
      for (int64_t M : a.ms) {
        memory::desc src_md({M, K}, sdt, tag::ab);
        const tag wt = a.wei_tag == "ab" ? tag::ab : a.wei_tag == "ba" ? tag::ba : tag::any;
        memory::desc w_any({K, N}, wdt, wt);
        memory::desc dst_md({M, N}, dt::f32, tag::ab);
        primitive_attr attr;
        if (int8) attr.set_output_scales(1 << 1, scales);
        double t0 = now_s();
        matmul::primitive_desc pd(matmul::desc(src_md, w_any, dst_md), attr, eng);
        matmul prim(pd);
        const double create_ms = (now_s() - t0) * 1e3;
        ensure_rotation(rot, pd.weights_desc(), plain, eng, st, copies);
        memory src(src_md, eng), dst(dst_md, eng);
        fill_plain(src, sdt, rng);
        auto run = [&](int64_t i) {
          prim.execute(st, {{DNNL_ARG_SRC, src},
                            {DNNL_ARG_WEIGHTS, rot.bufs[size_t(i % copies)]},
                            {DNNL_ARG_DST, dst}});
          st.wait();
        };
        // Warm-up: one call per copy at small M (pages every copy in), one at large M.
        const int64_t warm = M <= 16 ? copies : 1;
        for (int64_t i = 0; i < warm; ++i) run(i);
        std::vector<double> times;
        const int reps = a.reps > 0 ? a.reps : default_reps(M);
        const double start = now_s();
        for (int i = 0; i < reps; ++i) {
          const double t = now_s();
          run(warm + i);
          times.push_back(now_s() - t);
          if (times.size() >= 3 && (now_s() - start) * 1e3 > a.budget_ms) break;
        }
        std::vector<double> s = times;
        std::sort(s.begin(), s.end());
        const size_t n = s.size();
        const double med = n % 2 ? s[n / 2] : 0.5 * (s[n / 2 - 1] + s[n / 2]);
        const std::string fmt = format_tag_of(pd.weights_desc());
        char buf[1024];
        std::snprintf(buf, sizeof buf,
                      "%s  {\"dtype\": \"%s\", \"n\": %lld, \"k\": %lld, \"m\": %lld, "
                      "\"us\": %.2f, \"us_min\": %.2f, \"us_max\": %.2f, \"reps\": %zu, "
                      "\"weight_bytes\": %lld, \"weight_gbs\": %.3f, \"gops\": %.3f, "
                      "\"copies\": %lld, \"create_ms\": %.3f, \"impl\": \"%s\", "
                      "\"weights_format\": \"%s\"}",
                      rows.empty() ? "" : ",\n", dts.c_str(), (long long)N, (long long)K,
                      (long long)M, med * 1e6, s.front() * 1e6, s.back() * 1e6, n,
                      (long long)wbytes, wbytes / med / 1e9, 2.0 * M * N * K / med / 1e9,
                      (long long)copies, create_ms, pd.impl_info_str(), fmt.c_str());
        rows += buf;
        std::fprintf(stderr,
                     "oneDNN %-4s %5lldx%-5lld M=%-5lld %10.1f us %7.2f GB/s %8.1f Gop/s %s\n",
                     dts.c_str(), (long long)N, (long long)K, (long long)M, med * 1e6,
                     wbytes / med / 1e9, 2.0 * M * N * K / med / 1e9, pd.impl_info_str());
      }
    }
  }
  std::printf(
      "{\"peer\": \"oneDNN\", \"version\": \"%d.%d.%d\", \"effective_isa\": \"%s\", "
      "\"threads\": %d, \"l3_bytes\": %lld, \"rotate_bytes\": %lld,\n \"results\": [\n%s\n]}\n",
      ver->major, ver->minor, ver->patch, isa_name(get_effective_cpu_isa()), a.threads,
      (long long)l3, (long long)rotate, rows.c_str());
  return 0;
}
