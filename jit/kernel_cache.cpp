#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>

#include "jit/kernel.hpp"

namespace ktjit {

bool env_switch(const char* name, bool unset) {
  const char* e = std::getenv(name);
  if (!e) return unset;
  if (!std::strcmp(e, "1")) return true;
  if (!std::strcmp(e, "0")) return false;
  throw std::invalid_argument(std::string(name) + " must be 0 or 1, got '" + e + "'");
}
namespace {

const char* kind_name(KernelKind k) {
  switch (k) {
    case KernelKind::gemm_decode: return "gemm_decode";
    case KernelKind::gemm_prefill: return "gemm_prefill";
    case KernelKind::peak_loop: return "peak";
    case KernelKind::read_stream: return "read_stream";
    case KernelKind::quantize: return "quantize";
  }
  return "?";
}

const char* format_name(WeightFormat f) {
  switch (f) {
    case WeightFormat::none: return "none";
    case WeightFormat::int8: return "int8";
    case WeightFormat::int4: return "int4";
    case WeightFormat::bf16: return "bf16";
    case WeightFormat::fp8: return "fp8";
    case WeightFormat::qgroup: return "qgroup";
    case WeightFormat::mxfp4: return "mxfp4";
    case WeightFormat::mxfp8: return "mxfp8";
  }
  return "?";
}

const char* epilogue_name(Epilogue e) {
  switch (e) {
    case Epilogue::store: return "store";
    case Epilogue::siluup: return "siluup";
    case Epilogue::accum: return "accum";
  }
  return "?";
}

}  // namespace

int vec_lanes(IsaLevel isa) {
  if (isa_is_neon(isa)) return 4;  // 128-bit NEON vectors
  return int(isa) >= int(IsaLevel::avx512) ? 16 : 8;
}

std::string KernelKey::name() const {
  std::ostringstream s;
  s << kind_name(kind);
  if (kind == KernelKind::gemm_decode || kind == KernelKind::gemm_prefill) {
    s << '_';
    if (format == WeightFormat::qgroup)  // qg8, qg4, qg8b, qg4b: code storage and bias term,
      // then u<c0> (offset codes), i (identity table), w (int16 group sums), f (int32
      // super-block folds), l (int16-lane super-block folds), p (fp32 super-block partials),
      // s (two-level scales), h16 / hbf (fp16 / bf16 scales)
      s << "qg" << (variant & kQGroupNibbles ? 4 : 8) << (variant & kQGroupBias ? "b" : "")
        << (variant & kQGroupOffset
                ? "u" + std::to_string((variant & 0xf0) ? 1 << (((variant >> 4) & 0xf) - 1) : 0)
                : "")
        << (variant & kQGroupIdentity ? "i" : "") << (variant & kQGroupI16 ? "w" : "")
        << (variant & kQGroupIntFold ? "f" : "") << (variant & kQGroupLaneFold ? "l" : "")
        << (variant & kQGroupSuperSums ? "p" : "") << (variant & kQGroupSuper ? "s" : "")
        << (variant & kQGroupF16 ? "h16" : "") << (variant & kQGroupBf16 ? "hbf" : "");
    else
      s << format_name(format);
    s << '_' << isa_tag(isa) << "_m" << int(m_r) << 'n' << int(n_vec) * vec_lanes(isa) << '_'
      << epilogue_name(epilogue);
    if (format == WeightFormat::mxfp4 || format == WeightFormat::mxfp8)  // SwiGLU variants
      s << (variant & kSwigluAlpha ? "_alpha" : "") << (variant & kSwigluClamp ? "_clamp" : "");
    if ((format == WeightFormat::bf16 || format == WeightFormat::fp8) && (variant & kBf16Pairs))
      s << "_dpbf16";
    if ((format == WeightFormat::mxfp4 || format == WeightFormat::mxfp8) && (variant & kMxPairs))
      s << "_dpbf16";
    if (format == WeightFormat::fp8 && (variant & kFp8Fp32Widen)) s << "_f32w";
    if (format == WeightFormat::fp8 && (variant & kFp8PairOrder)) s << "_perm";
    if (format != WeightFormat::qgroup && (variant & kStripScratch)) s << "_scratch";
    if ((format == WeightFormat::int4 || format == WeightFormat::qgroup) && (variant & kHalfStrips))
      s << "_halves";
  } else if (kind == KernelKind::quantize) {  // quantize_int8_<tag>_amax / _round / ... / _bf16
    s << '_' << format_name(format) << '_' << isa_tag(isa) << '_'
      << (variant == 0   ? "amax"
          : variant == 1 ? "round"
          : variant == 2 ? "round_flip"
                         : "bf16");
  } else {
    s << '_' << isa_tag(isa) << "_v" << int(variant);
  }
  return s.str();
}

std::string KernelKey::describe() const {
  std::ostringstream s;
  s << "kind=" << kind_name(kind) << " isa=" << isa_name(isa) << " fmt=" << format_name(format)
    << " m_r=" << int(m_r) << " n_vec=" << int(n_vec) << " epi=" << epilogue_name(epilogue)
    << " variant=" << int(variant);
  return s.str();
}

KernelCache& KernelCache::instance() {
  static KernelCache* c = new KernelCache();  // never destroyed: kernels outlive static teardown
  return *c;
}

KernelCache::KernelCache() {
  if (const char* d = std::getenv("KT_JIT_DUMP")) dump_dir_ = d;
  if (const char* p = std::getenv("KT_JIT_PERF_MAP")) perf_map_ = *p && std::string(p) != "0";
}

std::unique_ptr<Kernel> KernelCache::generate_only(const KernelKey& key) {
  auto k = std::make_unique<Kernel>();
  k->key = key;
  k->name = key.name();
  auto t0 = std::chrono::steady_clock::now();
  k->code = generate_code(key);
  auto t1 = std::chrono::steady_clock::now();
  k->gen_us = std::chrono::duration<double, std::micro>(t1 - t0).count();
  return k;
}

const Kernel* KernelCache::get(const KernelKey& key) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = map_.find(key);
  if (it != map_.end()) {
    hits_.fetch_add(1, std::memory_order_relaxed);
    return it->second->entry() ? it->second.get() : nullptr;
  }
  std::unique_ptr<Kernel> k = generate_only(key);
  std::string err;
  k->exec = ExecutableCode::publish(k->code.data(), k->code.size(), &err);
  ++misses_;
  bytes_ += k->code.size();
  gen_us_ += k->gen_us;
  if (!k->exec) {
    if (!exec_refused_.exchange(true))
      std::fprintf(stderr,
                   "[kt-jit] warning: executable memory refused (%s); using the portable C++ "
                   "reference kernels\n",
                   err.c_str());
  } else {
    on_published(*k);
  }
  const Kernel* out = k->entry() ? k.get() : nullptr;
  map_.emplace(key, std::move(k));
  return out;
}

size_t KernelCache::retire_all() {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t n = map_.size();
  for (auto& [key, k] : map_) retired_.push_back(std::move(k));
  map_.clear();
  return n;
}

void KernelCache::on_published(const Kernel& k) {
  debug_log("kernel " + k.name + " [" + k.key.describe() + "] " + std::to_string(k.code.size()) +
            " B in " + std::to_string(k.gen_us) + " us");
  if (!dump_dir_.empty()) {
    // The directory is made if it is missing; a dump that cannot be written is said once (it
    // had failed silently: tools/kernel_profile.py then found no kernels to read).
    std::error_code ec;
    std::filesystem::create_directories(dump_dir_, ec);
    std::ofstream bin(dump_dir_ + "/" + k.name + ".bin", std::ios::binary);
    bin.write(reinterpret_cast<const char*>(k.code.data()), std::streamsize(k.code.size()));
    std::ofstream js(dump_dir_ + "/" + k.name + ".json");
    js << "{\"name\": \"" << k.name << "\", \"key\": \"" << k.key.describe()
       << "\", \"bytes\": " << k.code.size() << ", \"gen_us\": " << k.gen_us << "}\n";
    bin.flush();
    js.flush();
    if ((!bin || !js) && !dump_refused_.exchange(true))
      std::fprintf(stderr, "[kt-jit] warning: KT_JIT_DUMP=%s: cannot write the kernels there%s%s\n",
                   dump_dir_.c_str(), ec ? " (" : "", ec ? (ec.message() + ")").c_str() : "");
  }
  if (perf_map_) {
    std::string path = "/tmp/perf-" + std::to_string(getpid()) + ".map";
    if (FILE* f = std::fopen(path.c_str(), "a")) {
      std::fprintf(f, "%lx %zx %s\n", reinterpret_cast<unsigned long>(k.entry()), k.code.size(),
                   k.name.c_str());
      std::fclose(f);
    }
  }
}

CacheStats KernelCache::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  CacheStats s;
  s.hits = hits_.load();
  s.misses = misses_;
  s.bytes = bytes_;
  s.gen_us = gen_us_;
  return s;
}

}  // namespace ktjit
