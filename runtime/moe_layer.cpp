#include "runtime/moe_layer.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

namespace ktjit {
namespace {

// Weights a multi-block expert re-reads per chunk of strips: half of a 1 MiB L2.
constexpr int64_t kL2ChunkBytes = 512 * 1024;

int64_t round_up(int64_t x, int64_t m) {
  return (x + m - 1) / m * m;
}

int format_bits(WeightFormat f) {
  return f == WeightFormat::bf16 ? 16 : f == WeightFormat::int4 ? 4 : 8;
}

// Row stride in bytes for scratch matrices: whole cache lines, and never a multiple of 1 KiB, so
// the rows a register tile touches together do not share L1 sets (4K aliasing).
int64_t unaliased_stride(int64_t row_bytes) {
  const int64_t s = round_up(row_bytes, 64);
  return s % 1024 == 0 ? s + 64 : s;
}

float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: renormalise
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while (!(man & 0x400));
      u = sign | uint32_t(127 - 15 - e) << 23 | (man & 0x3ff) << 13;
    }
  } else if (exp == 0x1f) {
    u = sign | 0x7f800000u | man << 13;
  } else {
    u = sign | (exp + 127 - 15) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

void to_f32(const void* src, SourceDType dt, int64_t offset, int64_t n, float* dst) {
  switch (dt) {
    case SourceDType::f32:
      std::memcpy(dst, static_cast<const float*>(src) + offset, size_t(n) * 4);
      break;
    case SourceDType::bf16: {
      const uint16_t* s = static_cast<const uint16_t*>(src) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
      break;
    }
    case SourceDType::f16: {
      const uint16_t* s = static_cast<const uint16_t*>(src) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32(s[i]);
      break;
    }
  }
}

}  // namespace

SourceDType parse_source_dtype(const std::string& s) {
  if (s == "f32" || s == "float32") return SourceDType::f32;
  if (s == "bf16" || s == "bfloat16") return SourceDType::bf16;
  if (s == "f16" || s == "float16") return SourceDType::f16;
  throw std::invalid_argument("dtype: expected f32, bf16 or f16, got '" + s + "'");
}

AlignedBuffer::AlignedBuffer(size_t bytes) : n_(bytes) {
  if (bytes == 0) return;
  // Large buffers (packed weights) are 2 MiB aligned and advised for transparent huge pages.
  constexpr size_t kHuge = size_t(2) << 20;
  const size_t align = bytes >= kHuge ? kHuge : 64;
  const size_t alloc = size_t(round_up(int64_t(bytes), int64_t(align)));
  p_ = std::aligned_alloc(align, alloc);
  if (!p_) throw std::bad_alloc();
  if (align == kHuge) madvise(p_, alloc, MADV_HUGEPAGE);
}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& o) noexcept {
  std::swap(p_, o.p_);
  std::swap(n_, o.n_);
  return *this;
}

AlignedBuffer::~AlignedBuffer() {
  std::free(p_);
}

// Per-forward working memory, grown on demand and reused by every later forward.
struct MoELayer::Scratch {
  std::vector<int64_t> count, offset, fill;
  std::vector<int> active;
  std::vector<int32_t> row_token;
  std::vector<float> row_weight;
  std::vector<int8_t> xq, aq, hq;
  std::vector<float> xs, as, hs, h, partial;
  std::vector<float*> h_rows, out_rows;
  int64_t T = 0, rows = 0, lda_x = 0, h_stride = 0, lda_h = 0, p_stride = 0;
  std::vector<std::pair<int64_t, int64_t>> gu_units;  // (expert index in active, strip)
};

namespace {
// Even split of I on vector boundaries into `shards` parts.
std::vector<int64_t> even_bounds(int64_t I, int lanes, int shards) {
  const int64_t units = (I + lanes - 1) / lanes;
  if (shards < 1) shards = 1;
  if (shards > units) shards = int(units);
  std::vector<int64_t> b;
  for (int s = 0; s <= shards; ++s) b.push_back(std::min(I, units * s / shards * lanes));
  return b;
}
}  // namespace

MoELayer::MoELayer(const MoEShape& shape, const std::string& method, IsaLevel isa, int shards)
    : MoELayer(shape, method, isa,
               even_bounds(shape.intermediate,
                           vec_lanes(isa == IsaLevel::amx ? IsaLevel::avx512_bf16 : isa), shards)) {
}

MoELayer::MoELayer(const MoEShape& shape, const std::string& method, IsaLevel isa,
                   const std::vector<int64_t>& shard_bounds)
    : shape_(shape), method_(method), isa_(isa), scratch_(std::make_unique<Scratch>()) {
  if (shape.experts <= 0 || shape.top_k <= 0 || shape.hidden <= 0 || shape.intermediate <= 0)
    throw std::invalid_argument(
        "MoELayer: num_experts, top_k, hidden and intermediate must be > 0");
  format_ = method_format(method);
  fp8_block_ = method == "FP8";
  if (int(isa) > int(selected_isa()))
    throw std::invalid_argument(std::string("MoELayer: isa ") + isa_name(isa) +
                                " is above the selected level " + isa_name(selected_isa()));
  if (isa == IsaLevel::amx) isa_ = IsaLevel::avx512_bf16;  // AMX kernels are not generated yet
  lanes_ = vec_lanes(isa_);
  const auto& b = shard_bounds;
  bool ok = b.size() >= 2 && b.front() == 0 && b.back() == shape.intermediate;
  for (size_t i = 1; ok && i < b.size(); ++i) ok = b[i] > b[i - 1];
  if (!ok)
    throw std::invalid_argument("shard_bounds: expected increasing values from 0 to " +
                                std::to_string(shape.intermediate));
  for (size_t s = 0; s + 1 < b.size(); ++s) {
    Shard sh;
    sh.i_begin = b[s];
    sh.i_end = b[s + 1];
    const int64_t is = sh.i_end - sh.i_begin;
    const int bits = format_bits(format_);
    if (format_ == WeightFormat::fp8) {
      // One K step per element; the scale group is the 128-wide block or the whole row.
      if (fp8_block_ && sh.i_begin % 128 != 0)
        throw std::invalid_argument(
            "shard_bounds: FP8 block scales need shard starts at "
            "multiples of 128, got " +
            std::to_string(sh.i_begin));
      sh.gu = formats::StripLayout::make(is, shape.hidden, lanes_, kStripVecs, 2, 8, 1,
                                         fp8_block_ ? 128 : shape.hidden);
      sh.down = formats::StripLayout::make(shape.hidden, is, lanes_, kStripVecs, 1, 8, 1,
                                           fp8_block_ ? 128 : is);
      sh.expert_gscale = sh.gu.gscale_floats() + sh.down.gscale_floats();
    } else {
      sh.gu = formats::StripLayout::make(is, shape.hidden, lanes_, kStripVecs, 2, bits);
      sh.down = formats::StripLayout::make(shape.hidden, is, lanes_, kStripVecs, 1, bits);
    }
    sh.expert_bytes = sh.gu.total_bytes() + sh.down.total_bytes();
    sh.expert_cols = sh.gu.total_cols() + sh.down.total_cols();
    shards_.push_back(std::move(sh));
  }
  build_kernels();
}

MoELayer::~MoELayer() = default;

WeightFormat method_format(const std::string& method) {
  if (method == "AMXINT8" || method == "MOE_INT8") return WeightFormat::int8;
  if (method == "AMXINT4" || method == "MOE_INT4") return WeightFormat::int4;
  if (method == "BF16") return WeightFormat::bf16;
  if (method == "FP8" || method == "FP8_PERCHANNEL") return WeightFormat::fp8;
  throw std::invalid_argument("method '" + method +
                              "' is not built; built methods: " + built_methods());
}

const char* built_methods() {
  return "AMXINT8, MOE_INT8, AMXINT4, MOE_INT4, BF16, FP8, FP8_PERCHANNEL";
}

GemmKernelSet make_gemm_kernel_set(IsaLevel isa, WeightFormat fmt, Epilogue epi, int tail_vecs) {
  GemmKernelSet ks;
  ks.isa = isa;
  ks.epilogue = epi;
  ks.max_rows = gemm_max_rows(isa, fmt);
  auto key = [&](KernelKind kind, int m_r, int nv) {
    KernelKey k;
    k.kind = kind;
    k.isa = isa;
    k.format = fmt;
    k.m_r = uint8_t(m_r);
    k.n_vec = uint8_t(nv);
    k.epilogue = epi;
    return k;
  };
  const int tail = tail_vecs ? tail_vecs : kStripVecs;
  for (int m = 1; m <= ks.max_rows; ++m) {
    ks.decode_full.push_back(key(KernelKind::gemm_decode, m, kStripVecs));
    ks.decode_tail.push_back(key(KernelKind::gemm_decode, m, tail));
  }
  ks.prefill_full = key(KernelKind::gemm_prefill, ks.max_rows, kStripVecs);
  ks.prefill_tail = key(KernelKind::gemm_prefill, ks.max_rows, tail);
  return ks;
}

std::vector<KernelKey> GemmKernelSet::keys() const {
  std::vector<KernelKey> k = decode_full;
  k.insert(k.end(), decode_tail.begin(), decode_tail.end());
  k.push_back(prefill_full);
  k.push_back(prefill_tail);
  std::vector<KernelKey> unique;
  for (auto& x : k)
    if (std::find(unique.begin(), unique.end(), x) == unique.end()) unique.push_back(x);
  return unique;
}

std::vector<KernelKey> moe_kernel_keys(const MoEShape& shape, WeightFormat fmt, IsaLevel isa) {
  const int bits = format_bits(fmt);
  const int lanes = vec_lanes(isa);
  auto gu =
      formats::StripLayout::make(shape.intermediate, shape.hidden, lanes, kStripVecs, 2, bits);
  auto down =
      formats::StripLayout::make(shape.hidden, shape.intermediate, lanes, kStripVecs, 1, bits);
  std::vector<KernelKey> keys =
      make_gemm_kernel_set(isa, fmt, Epilogue::siluup, gu.tail_vecs).keys();
  for (auto& k : make_gemm_kernel_set(isa, fmt, Epilogue::accum, down.tail_vecs).keys())
    keys.push_back(k);
  return keys;
}

// Each shard has its own kernel sets: shards of different widths differ in their tail strips
// (the kernels themselves are shared through the cache).
void MoELayer::build_kernels() {
  auto& cache = KernelCache::instance();
  for (Shard& sh : shards_) {
    sh.gu_kernels = make_gemm_kernel_set(isa_, format_, Epilogue::siluup, sh.gu.tail_vecs);
    sh.down_kernels = make_gemm_kernel_set(isa_, format_, Epilogue::accum, sh.down.tail_vecs);
    if (isa_ == IsaLevel::ref) continue;
    for (GemmKernelSet* ks : {&sh.gu_kernels, &sh.down_kernels}) {
      for (auto& k : ks->decode_full) ks->decode_full_k.push_back(cache.get(k));
      for (auto& k : ks->decode_tail) ks->decode_tail_k.push_back(cache.get(k));
      ks->prefill_full_k = cache.get(ks->prefill_full);
      ks->prefill_tail_k = cache.get(ks->prefill_tail);
    }
  }
}

std::vector<std::string> MoELayer::kernel_names() const {
  std::vector<std::string> names;
  for (const Shard& sh : shards_)
    for (const GemmKernelSet* ks : {&sh.gu_kernels, &sh.down_kernels})
      for (auto& k : ks->keys())
        if (std::find(names.begin(), names.end(), k.name()) == names.end())
          names.push_back(k.name());
  return names;
}

size_t MoELayer::packed_bytes() const {
  size_t b = 0;
  for (auto& sh : shards_) b += sh.weights.size() + sh.scales.size() + sh.comps.size();
  return b;
}

void MoELayer::load_from_float(const void* gate, const void* up, const void* down, SourceDType dt,
                               const int64_t* map, ThreadPool& pool) {
  const int64_t E = shape_.experts, H = shape_.hidden, I = shape_.intermediate;
  if (map)
    for (int64_t p = 0; p < E; ++p)
      if (map[p] < 0 || map[p] >= E)
        throw std::invalid_argument("physical_to_logical_map[" + std::to_string(p) +
                                    "]: expected a value in [0, " + std::to_string(E) + "), got " +
                                    std::to_string(map[p]));
  const size_t esz = dt == SourceDType::f32 ? 4 : 2;
  std::vector<ExpertSource> src(static_cast<size_t>(E));
  for (int64_t p = 0; p < E; ++p) {
    const int64_t e = map ? map[p] : p;
    src[size_t(p)] = {p, static_cast<const char*>(gate) + size_t(e * I * H) * esz,
                      static_cast<const char*>(up) + size_t(e * I * H) * esz,
                      static_cast<const char*>(down) + size_t(e * H * I) * esz};
  }
  load_experts(src, dt, pool);
}

void MoELayer::load_experts(const std::vector<ExpertSource>& experts, SourceDType dt,
                            ThreadPool& pool) {
  std::lock_guard<std::mutex> lock(mu_);
  if (format_ == WeightFormat::fp8)
    throw std::invalid_argument("method " + method_ +
                                " loads e4m3 checkpoints (load_experts_fp8 / load_weights), not "
                                "float tensors");
  const int64_t E = shape_.experts, H = shape_.hidden, I = shape_.intermediate;
  for (const ExpertSource& x : experts)
    if (x.slot < 0 || x.slot >= E)
      throw std::invalid_argument("expert slot: expected a value in [0, " + std::to_string(E) +
                                  "), got " + std::to_string(x.slot));
  ensure_allocated();
  const auto quantize_w =
      format_ == WeightFormat::int4 ? formats::quantize_row_int4 : formats::quantize_row_int8;
  const int64_t n = int64_t(experts.size());
  pool.run([&](int tid, int nt) {
    int64_t e0, e1;
    split_range(n, tid, nt, &e0, &e1);
    for (auto& sh : shards_) {
      const int64_t is = sh.i_end - sh.i_begin;
      const bool bf16 = format_ == WeightFormat::bf16;
      std::vector<float> fg(size_t(is * H)), fu(size_t(is * H)), fd(size_t(H * is));
      std::vector<int8_t> qg(bf16 ? 0 : size_t(is * H)), qu(bf16 ? 0 : size_t(is * H)),
          qd(bf16 ? 0 : size_t(H * is));
      std::vector<float> dg(static_cast<size_t>(is)), du(static_cast<size_t>(is)),
          dd(static_cast<size_t>(H));
      for (int64_t j = e0; j < e1; ++j) {
        const ExpertSource& x = experts[size_t(j)];
        const int64_t p = x.slot;
        for (int64_t i = 0; i < is; ++i) {
          to_f32(x.gate, dt, (sh.i_begin + i) * H, H, fg.data() + i * H);
          to_f32(x.up, dt, (sh.i_begin + i) * H, H, fu.data() + i * H);
        }
        for (int64_t h = 0; h < H; ++h)
          to_f32(x.down, dt, h * I + sh.i_begin, is, fd.data() + h * is);
        int8_t* wb = sh.weights.as<int8_t>() + p * sh.expert_bytes;
        float* sb = sh.scales.as<float>() + p * sh.expert_cols;
        int32_t* cb = sh.comps.as<int32_t>() + p * sh.expert_cols;
        int8_t* wd = wb + sh.gu.total_bytes();
        float* sd = sb + sh.gu.total_cols();
        int32_t* cd = cb + sh.gu.total_cols();
        if (bf16) {
          const float* gu_w[2] = {fg.data(), fu.data()};
          const float* d_w[1] = {fd.data()};
          formats::pack_bf16_strips(sh.gu, gu_w, reinterpret_cast<uint16_t*>(wb), sb, cb);
          formats::pack_bf16_strips(sh.down, d_w, reinterpret_cast<uint16_t*>(wd), sd, cd);
          continue;
        }
        for (int64_t i = 0; i < is; ++i) {
          dg[size_t(i)] = quantize_w(fg.data() + i * H, H, qg.data() + i * H);
          du[size_t(i)] = quantize_w(fu.data() + i * H, H, qu.data() + i * H);
        }
        for (int64_t h = 0; h < H; ++h)
          dd[size_t(h)] = quantize_w(fd.data() + h * is, is, qd.data() + h * is);
        const int8_t* gu_q[2] = {qg.data(), qu.data()};
        const float* gu_d[2] = {dg.data(), du.data()};
        formats::pack_int8_strips(sh.gu, gu_q, gu_d, wb, sb, cb);
        const int8_t* d_q[1] = {qd.data()};
        const float* d_d[1] = {dd.data()};
        formats::pack_int8_strips(sh.down, d_q, d_d, wd, sd, cd);
      }
    }
  });
  for (const ExpertSource& x : experts)
    for (int si = 0; si < num_shards(); ++si) mark_loaded(si, x.slot);
}

void MoELayer::ensure_allocated() {
  const int64_t E = shape_.experts;
  if (!slot_loaded_.empty()) return;
  for (auto& sh : shards_) {
    sh.weights = AlignedBuffer(size_t(E * sh.expert_bytes));
    sh.scales = AlignedBuffer(size_t(E * sh.expert_cols) * 4);
    sh.comps = AlignedBuffer(size_t(E * sh.expert_cols) * 4);
    if (sh.expert_gscale) sh.gscales = AlignedBuffer(size_t(E * sh.expert_gscale) * 4);
  }
  slot_loaded_.assign(size_t(E) * shards_.size(), 0);
}

void MoELayer::mark_loaded(int shard, int64_t slot) {
  slot_loaded_[size_t(shard) * size_t(shape_.experts) + size_t(slot)] = 1;
  loaded_ = std::count(slot_loaded_.begin(), slot_loaded_.end(), 1) == int64_t(slot_loaded_.size());
}

void MoELayer::load_experts_quantized(int shard, const std::vector<QuantExpertSource>& experts,
                                      ThreadPool& pool) {
  std::lock_guard<std::mutex> lock(mu_);
  if (format_ != WeightFormat::int8 && format_ != WeightFormat::int4)
    throw std::invalid_argument("load_experts_quantized: method " + method_ +
                                " is not an integer method");
  if (shard < 0 || shard >= num_shards())
    throw std::invalid_argument("shard: expected a value in [0, " + std::to_string(num_shards()) +
                                "), got " + std::to_string(shard));
  for (const QuantExpertSource& x : experts)
    if (x.slot < 0 || x.slot >= shape_.experts)
      throw std::invalid_argument("expert slot: expected a value in [0, " +
                                  std::to_string(shape_.experts) + "), got " +
                                  std::to_string(x.slot));
  ensure_allocated();
  Shard& sh = shards_[size_t(shard)];
  const int64_t n = int64_t(experts.size());
  pool.run([&](int tid, int nt) {
    int64_t j0, j1;
    split_range(n, tid, nt, &j0, &j1);
    for (int64_t j = j0; j < j1; ++j) {
      const QuantExpertSource& x = experts[size_t(j)];
      int8_t* wb = sh.weights.as<int8_t>() + x.slot * sh.expert_bytes;
      float* sb = sh.scales.as<float>() + x.slot * sh.expert_cols;
      int32_t* cb = sh.comps.as<int32_t>() + x.slot * sh.expert_cols;
      const int8_t* gu_q[2] = {x.q_gate, x.q_up};
      const float* gu_d[2] = {x.d_gate, x.d_up};
      formats::pack_int8_strips(sh.gu, gu_q, gu_d, wb, sb, cb);
      const int8_t* d_q[1] = {x.q_down};
      const float* d_d[1] = {x.d_down};
      formats::pack_int8_strips(sh.down, d_q, d_d, wb + sh.gu.total_bytes(),
                                sb + sh.gu.total_cols(), cb + sh.gu.total_cols());
    }
  });
  for (const QuantExpertSource& x : experts) mark_loaded(shard, x.slot);
}

void MoELayer::load_experts_fp8(const std::vector<Fp8ExpertSource>& experts, ThreadPool& pool) {
  std::lock_guard<std::mutex> lock(mu_);
  if (format_ != WeightFormat::fp8)
    throw std::invalid_argument("load_experts_fp8: method " + method_ + " is not an FP8 method");
  const int64_t E = shape_.experts, H = shape_.hidden, I = shape_.intermediate;
  for (const Fp8ExpertSource& x : experts)
    if (x.slot < 0 || x.slot >= E)
      throw std::invalid_argument("expert slot: expected a value in [0, " + std::to_string(E) +
                                  "), got " + std::to_string(x.slot));
  ensure_allocated();
  const int64_t hb = (H + 127) / 128, ib = (I + 127) / 128;
  const int64_t n = int64_t(experts.size());
  pool.run([&](int tid, int nt) {
    int64_t j0, j1;
    split_range(n, tid, nt, &j0, &j1);
    for (Shard& sh : shards_) {
      const int64_t i0 = sh.i_begin, is = sh.i_end - sh.i_begin, isb = (is + 127) / 128;
      std::vector<uint8_t> down(size_t(H * is));  // the shard's column slice of down
      std::vector<float> down_bs(size_t(hb * isb));
      for (int64_t j = j0; j < j1; ++j) {
        const Fp8ExpertSource& x = experts[size_t(j)];
        for (int64_t h = 0; h < H; ++h)
          std::memcpy(down.data() + h * is, x.down + h * I + i0, size_t(is));
        const float *gate_s = x.gate_scale, *up_s = x.up_scale, *down_s = x.down_scale;
        if (fp8_block_) {  // block rows of gate/up start at i0/128; down keeps its column blocks
          gate_s += (i0 / 128) * hb;
          up_s += (i0 / 128) * hb;
          for (int64_t r = 0; r < hb; ++r)
            for (int64_t c = 0; c < isb; ++c)
              down_bs[size_t(r * isb + c)] = down_s[r * ib + i0 / 128 + c];
          down_s = down_bs.data();
        } else {
          gate_s += i0;
          up_s += i0;
        }
        int8_t* wb = sh.weights.as<int8_t>() + x.slot * sh.expert_bytes;
        float* sb = sh.scales.as<float>() + x.slot * sh.expert_cols;
        int32_t* cb = sh.comps.as<int32_t>() + x.slot * sh.expert_cols;
        float* gb = sh.gscales.as<float>() + x.slot * sh.expert_gscale;
        const uint8_t* gu_w[2] = {x.gate + i0 * H, x.up + i0 * H};
        const float* gu_s[2] = {gate_s, up_s};
        formats::pack_fp8_strips(sh.gu, gu_w, fp8_block_ ? gu_s : nullptr,
                                 fp8_block_ ? nullptr : gu_s, reinterpret_cast<uint8_t*>(wb), sb,
                                 cb, gb);
        const uint8_t* d_w[1] = {down.data()};
        const float* d_s[1] = {down_s};
        formats::pack_fp8_strips(
            sh.down, d_w, fp8_block_ ? d_s : nullptr, fp8_block_ ? nullptr : d_s,
            reinterpret_cast<uint8_t*>(wb + sh.gu.total_bytes()), sb + sh.gu.total_cols(),
            cb + sh.gu.total_cols(), gb + sh.gu.gscale_floats());
      }
    }
  });
  for (const Fp8ExpertSource& x : experts)
    for (int si = 0; si < num_shards(); ++si) mark_loaded(si, x.slot);
}

void MoELayer::run_gemm(const GemmKernelSet& ks, const formats::StripLayout& layout, bool reference,
                        const int8_t* w, const float* scale, const int32_t* comp,
                        int64_t strip_begin, int64_t strip_end, const int8_t* a, int64_t lda,
                        const float* a_scale, int64_t rows, float* const* out_rows,
                        int64_t out_col0, const float* row_weight, const float* gscale) const {
  const int full_cols = layout.strip_cols(layout.strip_vecs);
  const int out_full = gemm_strip_out_cols(isa_, layout.strip_vecs, ks.epilogue);
  auto call = [&](const KernelKey& key, const Kernel* k, int64_t s0, int64_t ns, int64_t row0,
                  int64_t m_blocks) {
    GemmArgs args;
    args.a = a + row0 * lda;
    args.lda = lda;
    args.w = w + layout.strip_offset(s0);
    args.n_strips = ns;
    args.k4 = layout.k4;
    args.a_scale = a_scale + row0;
    args.w_scale = scale + s0 * full_cols;
    args.w_comp = comp + s0 * full_cols;
    args.out_rows = out_rows + row0;
    args.out_col = out_col0 + s0 * out_full;
    args.row_weight = row_weight ? row_weight + row0 : nullptr;
    args.m_blocks = m_blocks;
    args.w_gscale = gscale ? gscale + s0 * layout.gscale_floats_per_strip() : nullptr;
    args.g_steps = layout.g_steps;
    args.g_per_strip = layout.groups();
    if (reference || !k)
      gemm_ref(key, args);
    else
      reinterpret_cast<GemmFn>(const_cast<void*>(k->entry()))(&args);
  };
  const bool ref = reference || isa_ == IsaLevel::ref;
  auto pick = [&](const std::vector<KernelKey>& keys, const std::vector<const Kernel*>& ks_,
                  int m) {
    return std::make_pair(keys[size_t(m - 1)], ref ? nullptr : ks_[size_t(m - 1)]);
  };
  // Full strips first, then the tail strip. When an expert has more rows than one tile, its
  // strips go in chunks small enough to stay in L2: the prefill blocks and the decode remainder
  // of a chunk both read it, and only the first read comes from DRAM.
  const int max_rows = ks.max_rows;
  const int64_t chunk =
      rows > max_rows ? std::max<int64_t>(1, kL2ChunkBytes / layout.strip_bytes(layout.strip_vecs))
                      : layout.full_strips + 1;
  for (int part = 0; part < 2; ++part) {
    const bool tail = part == 1;
    const int64_t s0 = tail ? layout.full_strips : strip_begin;
    const int64_t s1 = tail ? layout.full_strips + 1 : std::min(strip_end, layout.full_strips);
    if (tail && (layout.tail_vecs == 0 || strip_end <= layout.full_strips)) continue;
    for (int64_t c0 = s0, n = 0; c0 < s1; c0 += n) {
      n = std::min(chunk, s1 - c0);
      int64_t row = 0;
      if (rows > max_rows) {
        const int64_t blocks = rows / max_rows;
        call(tail ? ks.prefill_tail : ks.prefill_full,
             ref ? nullptr : (tail ? ks.prefill_tail_k : ks.prefill_full_k), c0, n, 0, blocks);
        row = blocks * max_rows;
      }
      if (rows > row) {
        auto [key, k] = tail ? pick(ks.decode_tail, ks.decode_tail_k, int(rows - row))
                             : pick(ks.decode_full, ks.decode_full_k, int(rows - row));
        call(key, k, c0, n, row, 1);
      }
    }
  }
}

void MoELayer::forward(int64_t T, const float* x, const int64_t* ids, const float* w,
                       const bool* mask, float* out, ThreadPool& pool, bool reference) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!loaded_) throw std::runtime_error("MoELayer.forward: weights are not loaded");
  if (T <= 0) return;
  const int64_t E = shape_.experts, K = shape_.top_k, H = shape_.hidden;
  Scratch& s = *scratch_;
  // Route: tokens per expert, rows grouped by expert in token order.
  s.count.assign(size_t(E), 0);
  for (int64_t i = 0; i < T * K; ++i) {
    const int64_t e = ids[i];
    if (e >= 0 && e < E && !(mask && mask[e])) ++s.count[size_t(e)];
  }
  s.active.clear();
  s.offset.assign(size_t(E), 0);
  int64_t rows = 0;
  for (int64_t e = 0; e < E; ++e) {
    s.offset[size_t(e)] = rows;
    if (s.count[size_t(e)]) s.active.push_back(int(e));
    rows += s.count[size_t(e)];
  }
  s.fill = s.offset;
  s.row_token.resize(size_t(rows));
  s.row_weight.resize(size_t(rows));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < K; ++j) {
      const int64_t e = ids[t * K + j];
      if (e < 0 || e >= E || (mask && mask[e])) continue;
      const int64_t r = s.fill[size_t(e)]++;
      s.row_token[size_t(r)] = int32_t(t);
      s.row_weight[size_t(r)] = w[t * K + j];
    }
  s.T = T;
  s.rows = rows;
  // Activations: int8 rows for the integer formats, fp32 rows for bf16 weights.
  const bool float_act = format_ == WeightFormat::bf16 || format_ == WeightFormat::fp8;
  const int64_t act_bytes = float_act ? 4 : 1;
  s.lda_x = unaliased_stride(H * act_bytes);
  s.p_stride = unaliased_stride(H * 4) / 4;
  s.xq.resize(size_t(T * s.lda_x));
  s.xs.resize(size_t(T));
  s.aq.resize(size_t(std::max<int64_t>(rows, 1) * s.lda_x));
  s.as.resize(size_t(std::max<int64_t>(rows, 1)));
  s.partial.resize(size_t(T * s.p_stride * int64_t(shards_.size())));
  s.out_rows.resize(size_t(std::max<int64_t>(rows, 1)));

  const bool flip = int8_activation_offset(isa_);
  // Phase 1: quantize each token once; clear the shard partials.
  pool.run([&](int tid, int nt) {
    int64_t t0, t1;
    split_range(T, tid, nt, &t0, &t1);
    for (int64_t t = t0; t < t1; ++t) {
      int8_t* q = s.xq.data() + t * s.lda_x;
      if (float_act) {
        std::memcpy(q, x + t * H, size_t(H) * 4);
        s.xs[size_t(t)] = 1.0f;
      } else {
        s.xs[size_t(t)] = formats::quantize_row_int8(x + t * H, H, q);
        if (flip) formats::flip_sign_bits(q, H);
      }
      // Padding must read as zero: int8 zero is byte 0x80 in the VNNI (a + 128) form.
      std::memset(q + H * act_bytes, flip && !float_act ? 0x80 : 0,
                  size_t(s.lda_x - H * act_bytes));
      std::memset(s.partial.data() + t * s.p_stride * int64_t(shards_.size()), 0,
                  size_t(s.p_stride * int64_t(shards_.size())) * 4);
    }
  });
  if (rows == 0) {
    std::memset(out, 0, size_t(T * H) * 4);
    return;
  }
  // Phase 2: gather each expert's rows so its tile reads them at a fixed stride.
  pool.run([&](int tid, int nt) {
    int64_t r0, r1;
    split_range(rows, tid, nt, &r0, &r1);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t t = s.row_token[size_t(r)];
      std::memcpy(s.aq.data() + r * s.lda_x, s.xq.data() + t * s.lda_x, size_t(s.lda_x));
      s.as[size_t(r)] = s.xs[size_t(t)];
    }
  });
  for (size_t si = 0; si < shards_.size(); ++si) {
    for (int64_t r = 0; r < rows; ++r)
      s.out_rows[size_t(r)] =
          s.partial.data() +
          (int64_t(s.row_token[size_t(r)]) * int64_t(shards_.size()) + int64_t(si)) * s.p_stride;
    forward_shard(shards_[si], s, reference, pool);
  }
  // Last phase: sum the shard partials in shard order into the output.
  const int64_t S = int64_t(shards_.size());
  pool.run([&](int tid, int nt) {
    int64_t t0, t1;
    split_range(T, tid, nt, &t0, &t1);
    for (int64_t t = t0; t < t1; ++t) {
      const float* p = s.partial.data() + t * S * s.p_stride;
      float* o = out + t * H;
      std::memcpy(o, p, size_t(H) * 4);
      for (int64_t si = 1; si < S; ++si)
        for (int64_t h = 0; h < H; ++h) o[h] += p[si * s.p_stride + h];
    }
  });
}

void MoELayer::forward_shard(const Shard& sh, Scratch& s, bool reference, ThreadPool& pool) {
  const int64_t is = sh.i_end - sh.i_begin;
  const int64_t rows = s.rows;
  const bool flip = int8_activation_offset(isa_);
  const bool float_act = format_ == WeightFormat::bf16 || format_ == WeightFormat::fp8;
  s.h_stride = unaliased_stride(std::max<int64_t>(is, 1) * 4) / 4;
  s.lda_h = unaliased_stride(std::max<int64_t>(is, 1));
  s.h.resize(size_t(rows * s.h_stride));
  s.hq.resize(size_t(rows * s.lda_h));
  s.hs.resize(size_t(rows));
  s.h_rows.resize(size_t(rows));
  for (int64_t r = 0; r < rows; ++r) s.h_rows[size_t(r)] = s.h.data() + r * s.h_stride;

  const int64_t gu_strips = sh.gu.full_strips + (sh.gu.tail_vecs ? 1 : 0);
  const int64_t down_strips = sh.down.full_strips + (sh.down.tail_vecs ? 1 : 0);
  // Gate/up work units (expert, strip), split into contiguous runs of about equal cost so each
  // thread streams one region of weights. Cost ~ bytes read + multiply work.
  const int64_t na = int64_t(s.active.size());
  std::vector<int64_t> cost_prefix(size_t(na * gu_strips + 1), 0);
  for (int64_t ai = 0; ai < na; ++ai) {
    const int64_t m = s.count[size_t(s.active[size_t(ai)])];
    for (int64_t st = 0; st < gu_strips; ++st) {
      const int64_t c = (st < sh.gu.full_strips ? sh.gu.strip_vecs : sh.gu.tail_vecs) * (m + 4);
      cost_prefix[size_t(ai * gu_strips + st + 1)] = cost_prefix[size_t(ai * gu_strips + st)] + c;
    }
  }
  const int64_t total_cost = cost_prefix.back();

  // Phase 3: gate+up with the SiLU*up epilogue into h.
  pool.run([&](int tid, int nt) {
    const int64_t c0 = total_cost * tid / nt, c1 = total_cost * (tid + 1) / nt;
    const int64_t u0 =
        std::lower_bound(cost_prefix.begin(), cost_prefix.end(), c0) - cost_prefix.begin();
    const int64_t u1 =
        std::lower_bound(cost_prefix.begin(), cost_prefix.end(), c1) - cost_prefix.begin();
    int64_t u = u0;
    while (u < u1) {
      const int64_t ai = u / gu_strips, st0 = u % gu_strips;
      const int64_t st1 = std::min(gu_strips, st0 + (u1 - u));
      const int64_t e = s.active[size_t(ai)];
      const int64_t row0 = s.offset[size_t(e)], m = s.count[size_t(e)];
      const int64_t p = e;
      run_gemm(sh.gu_kernels, sh.gu, reference, sh.weights.as<int8_t>() + p * sh.expert_bytes,
               sh.scales.as<float>() + p * sh.expert_cols,
               sh.comps.as<int32_t>() + p * sh.expert_cols, st0, st1, s.aq.data() + row0 * s.lda_x,
               s.lda_x, s.as.data() + row0, m, s.h_rows.data() + row0, 0, nullptr,
               sh.expert_gscale ? sh.gscales.as<float>() + p * sh.expert_gscale : nullptr);
      u += st1 - st0;
    }
  });
  // Phase 4: quantize the intermediate of every (expert, token) row over this shard's slice
  // (bf16 weights take the fp32 intermediate as it is).
  if (!float_act)
    pool.run([&](int tid, int nt) {
      int64_t r0, r1;
      split_range(rows, tid, nt, &r0, &r1);
      for (int64_t r = r0; r < r1; ++r) {
        int8_t* q = s.hq.data() + r * s.lda_h;
        s.hs[size_t(r)] = formats::quantize_row_int8(s.h.data() + r * s.h_stride, is, q);
        if (flip) formats::flip_sign_bits(q, is);
        std::memset(q + is, flip ? 0x80 : 0, size_t(s.lda_h - is));
      }
    });
  const int8_t* down_a = float_act ? reinterpret_cast<const int8_t*>(s.h.data()) : s.hq.data();
  const int64_t down_lda = float_act ? s.h_stride * 4 : s.lda_h;
  if (float_act) s.hs.assign(size_t(rows), 1.0f);
  // Phase 5: down projection; each thread owns a run of output strips and adds the experts
  // into them in ascending expert order, so the sum order never depends on the thread count.
  pool.run([&](int tid, int nt) {
    int64_t st0, st1;
    split_range(down_strips, tid, nt, &st0, &st1);
    if (st0 >= st1) return;
    for (int e : s.active) {
      const int64_t row0 = s.offset[size_t(e)], m = s.count[size_t(e)];
      run_gemm(sh.down_kernels, sh.down, reference,
               sh.weights.as<int8_t>() + int64_t(e) * sh.expert_bytes + sh.gu.total_bytes(),
               sh.scales.as<float>() + int64_t(e) * sh.expert_cols + sh.gu.total_cols(),
               sh.comps.as<int32_t>() + int64_t(e) * sh.expert_cols + sh.gu.total_cols(), st0, st1,
               down_a + row0 * down_lda, down_lda, s.hs.data() + row0, m, s.out_rows.data() + row0,
               0, s.row_weight.data() + row0,
               sh.expert_gscale
                   ? sh.gscales.as<float>() + int64_t(e) * sh.expert_gscale + sh.gu.gscale_floats()
                   : nullptr);
    }
  });
}

void MoELayer::write_expert(int64_t slot, int tp, int rank, void* w13, float* w13_scale, void* w2,
                            float* w2_scale) const {
  const int64_t E = shape_.experts, H = shape_.hidden, I = shape_.intermediate;
  if (format_ != WeightFormat::bf16 && format_ != WeightFormat::fp8)
    throw std::invalid_argument("write_weight_scale_to_buffer: method " + method_ +
                                " is not a native checkpoint format (BF16, FP8, FP8_PERCHANNEL)");
  if (!loaded_) throw std::runtime_error("write_weight_scale_to_buffer: weights are not loaded");
  if (slot < 0 || slot >= E)
    throw std::invalid_argument("expert_id: expected a value in [0, " + std::to_string(E) +
                                "), got " + std::to_string(slot));
  if (tp < 1 || I % tp != 0)
    throw std::invalid_argument("gpu_tp_count: expected a divisor of the intermediate size " +
                                std::to_string(I) + ", got " + std::to_string(tp));
  if (rank < 0 || rank >= tp)
    throw std::invalid_argument("rank: expected a value in [0, " + std::to_string(tp) + ")");
  const int64_t ir = I / tp, i0 = int64_t(rank) * ir, i1 = i0 + ir;
  const bool fp8 = format_ == WeightFormat::fp8;
  if (fp8 && fp8_block_ && ir % 128 != 0)
    throw std::invalid_argument(
        "gpu_tp_count: FP8 block scales need I / gpu_tp_count to be a multiple of 128, got " +
        std::to_string(ir));
  if (fp8 && (!w13_scale || !w2_scale))
    throw std::invalid_argument("write_weight_scale_to_buffer: " + method_ +
                                " needs scale pointers");
  const size_t es = fp8 ? 1 : 2;
  const int64_t hb = (H + 127) / 128;
  char* gu_out = static_cast<char*>(w13);
  char* d_out = static_cast<char*>(w2);
  for (const Shard& sh : shards_) {
    const int64_t a = std::max(i0, sh.i_begin), b = std::min(i1, sh.i_end);
    if (a >= b) continue;
    const char* wb = sh.weights.as<char>() + slot * sh.expert_bytes;
    const char* wd = wb + sh.gu.total_bytes();
    const float* sb = sh.scales.as<float>() + slot * sh.expert_cols;
    const float* gb = sh.expert_gscale ? sh.gscales.as<float>() + slot * sh.expert_gscale : nullptr;
    const int64_t la = a - sh.i_begin, lb = b - sh.i_begin;  // local rows of gate/up
    for (int src = 0; src < 2; ++src)                        // gate rows, then up rows
      formats::unpack_rows(sh.gu, wb, src, la, lb, 0, H,
                           gu_out + size_t((src * ir + a - i0) * H) * es, H);
    formats::unpack_rows(sh.down, wd, 0, 0, H, la, lb, d_out + size_t(a - i0) * es, ir);
    if (!fp8) continue;
    if (!fp8_block_) {  // row scales: per packed column of gate/up, per row of down
      for (int src = 0; src < 2; ++src)
        for (int64_t r = la; r < lb; ++r) {
          int64_t strip;
          int col, cols;
          formats::packed_column_of(sh.gu, src, r, &strip, &col, &cols);
          w13_scale[src * ir + sh.i_begin + r - i0] =
              sb[strip * sh.gu.strip_cols(sh.gu.strip_vecs) + col];
        }
      for (int64_t h = 0; h < H; ++h) {
        int64_t strip;
        int col, cols;
        formats::packed_column_of(sh.down, 0, h, &strip, &col, &cols);
        w2_scale[h] = sb[sh.gu.total_cols() + strip * sh.down.strip_cols(sh.down.strip_vecs) + col];
      }
      continue;
    }
    // 128x128 block scales live in the group-scale table: per strip, group, half.
    auto gscale = [](const formats::StripLayout& l, const float* table, int half, int64_t r,
                     int64_t g) {
      const int64_t strip = r / l.rows_per_strip();
      return table[strip * l.gscale_floats_per_strip() + (g * 2 + half) * l.lanes];
    };
    for (int src = 0; src < 2; ++src)
      for (int64_t rb = la / 128; rb < (lb + 127) / 128; ++rb)
        for (int64_t g = 0; g < hb; ++g)
          w13_scale[(src * ir / 128 + (sh.i_begin / 128 + rb - i0 / 128)) * hb + g] =
              gscale(sh.gu, gb, src, rb * 128, g);
    const float* gd = gb + sh.gu.gscale_floats();
    for (int64_t rb = 0; rb < hb; ++rb)
      for (int64_t g = la / 128; g < (lb + 127) / 128; ++g)
        w2_scale[rb * (ir / 128) + (sh.i_begin / 128 + g - i0 / 128)] =
            gscale(sh.down, gd, 0, rb * 128, g);
  }
}

}  // namespace ktjit
