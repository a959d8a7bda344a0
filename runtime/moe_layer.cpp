#include "runtime/moe_layer.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "formats/convert.hpp"
#include "formats/mx.hpp"

namespace ktjit {
namespace {

// Weights a multi-block expert re-reads per chunk of strips: half of a 1 MiB L2.
constexpr int64_t kL2ChunkBytes = 512 * 1024;
// bf16 and fp8 (K even) experts with at least this many rows run the vdpbf16ps pair kernels at
// avx512_bf16: 6-row blocks, then the rows left as the call's short tile (5 rows: that tile
// alone); fewer rows take the decode tiles (fp8: pair tiles of <= 4 rows). Until 2026-11-27 this
// was 12, from before the pair kernels took their last rows themselves; from 5 rows a Zen 4 ran
// Qwen3-30B-A3B FP8 1.04x (T = 256) and 1.07-1.13x (T = 64) faster, BF16 1.04-1.06x and
// 1.06-1.10x (in-process A/B, docs/BENCHMARKS.md): the 5-11-row experts had run fp32 FMA tiles,
// and for fp8 decoded every weight once per 6-row block.
constexpr int kBf16PairMinRows = 5;
// fp8 layers at avx512_bf16 store their full strips in the pair order (formats::fp8_strip_byte;
// jit/kernel.hpp kFp8PairOrder) when K is even: the pair decode then loads the bytes as they are
// instead of gathering each k pair (one vpermi2b of three): DeepSeek-V3 FP8 T = 1 1.02-1.03x on
// a Zen 4, within noise elsewhere (in-process A/B, docs/BENCHMARKS.md). Since 2026-11-27 (a
// twenty-fifth session) that order is word-shaped, so steps without zero-exponent codes decode
// with shifts: 1.4x the decode tiles' speed with the weights in L2 / L3. isa amx keeps [k][column]:
// its AMX-BF16 tiles decode that layout, and its decode tiles are the same avx512_bf16 kernels
// without the bit.
bool fp8_pair_order_at(IsaLevel isa, bool k_pairs) {
  return isa == IsaLevel::avx512_bf16 && k_pairs;
}

// bf16 experts with at least this many rows run the bfdot pair kernels at neon_bf16: one full
// 6-row block. Below it the executor runs decode tiles, which stream each strip once for all rows
// (memory-bound: bfdot would save little there and would cost the activations' bf16 rounding, so
// decode keeps fp32 activations, as on x86). From 6 rows on, a padded 6-row bfdot block needs
// fewer vector instructions than the fp32 path (per k pair and vector of 4 columns: 6 bfdot
// against 12 fmla + shl + 2 bic), and rows 7..11 would otherwise stream the strip twice (a 6-row
// block plus a decode remainder), so padding the last block is the cheaper way.
constexpr int kNeonBf16PairMinRows = 6;

// KT_JIT_QGROUP_FOLDS=0 keeps the per-group fp32 order at avx2 and the VNNI levels too: no int32
// (kQGroupIntFold) or int16-lane (kQGroupLaneFold) super-block folds at avx2, no fp32 super-block
// partials (kQGroupSuperSums) at the VNNI levels, so every level's kernels give the same result
// bits; read when a layer is built. Unset or 1: the folds where the codes allow them.
bool qgroup_folds_allowed() {
  return env_switch("KT_JIT_QGROUP_FOLDS", true);
}

// KT_JIT_HALF_STRIPS=0 turns the half-strip tiles off (jit/kernel.hpp kHalfStrips, jit/gemm.hpp
// half_strip_format, half_strip_vnni_format): prefill then runs 2-row tiles only at avx2 and
// 3-row ones for the qgroup byte codes at the VNNI levels. The same bits either way; read when a
// kernel set is made.
bool half_strips_allowed() {
  return env_switch("KT_JIT_HALF_STRIPS", true);
}

// qgroup offset codes (jit/kernel.hpp kQGroupOffset): c0, or -1 for the sign-step kernels (avx2,
// avx512) and the + 128 ones (VNNI levels). At avx2 and avx512, for tables that allow them: per
// (row, vector) and K step 3 vector instructions instead of 5 (vpsignb / vpblendmb and vpabsb go;
// at avx512 measured on a Zen 4 capped to that level, 2026-11-27: Q4_K 1.89x, Q4_0 1.95x at
// T = 1024). At the VNNI levels codes that are all >= 0 (c0 = 0: Q4_K, Q5_K, Q4_1, Q5_1, Q2_K) are
// vpdpbusd's unsigned operand as they are, so no group end subtracts 128 * s_g, and nibble tables
// that are the nibble minus c0 (Q4_0, RAWINT4) are stored as the nibble and subtract c0 * s_g
// instead: identity nibbles skip the vpshufb.
int qgroup_offset(IsaLevel isa, const formats::GroupedSpec& g) {
  if (g.int_fold) return -1;
  const int c0 = formats::qgroup_code_offset(g);
  if (isa == IsaLevel::avx2 || isa == IsaLevel::avx512) return c0;
  if (!qgroup_flip_codes(isa) || c0 < 0) return -1;
  return c0 == 0 || formats::qgroup_identity_table(g, c0) ? c0 : -1;
}
// What the packed byte codes and the kernels' table hold beyond each code at `isa`: + c0 for
// offset codes, + 128 for the other VNNI-level codes (the XOR 0x80 of their unsigned operand), else
// nothing.
int qgroup_store_offset(IsaLevel isa, const formats::GroupedSpec& g) {
  const int c0 = qgroup_offset(isa, g);
  if (c0 >= 0) return c0;
  return qgroup_flip_codes(isa) && !g.int_fold ? 128 : 0;
}

int64_t round_up(int64_t x, int64_t m) {
  return (x + m - 1) / m * m;
}

int format_bits(WeightFormat f) {
  return f == WeightFormat::bf16 ? 16 : f == WeightFormat::int4 ? 4 : 8;
}

// Σ of n int8 values (the kernels' activation sums, GemmArgs::a_gsum).
int32_t row_sum_i8(const int8_t* q, int64_t n) {
  int32_t sum = 0;
  for (int64_t k = 0; k < n; ++k) sum += q[k];
  return sum;
}

// Row stride in bytes for scratch matrices: whole cache lines, and never a multiple of 1 KiB, so
// the rows a register tile touches together do not share L1 sets (4K aliasing).
int64_t unaliased_stride(int64_t row_bytes) {
  const int64_t s = round_up(row_bytes, 64);
  return s % 1024 == 0 ? s + 64 : s;
}

// n elements of row data starting `offset` elements into src, widened to fp32.
void to_f32(const void* src, SourceDType dt, int64_t offset, int64_t n, float* dst) {
  const size_t esz = dt == SourceDType::f32 ? 4 : 2;
  const formats::FloatType t = dt == SourceDType::f32    ? formats::FloatType::f32
                               : dt == SourceDType::bf16 ? formats::FloatType::bf16
                                                         : formats::FloatType::f16;
  formats::to_f32(static_cast<const char*>(src) + size_t(offset) * esz, t, n, dst);
}

}  // namespace

SourceDType parse_source_dtype(const std::string& s) {
  if (s == "f32" || s == "float32") return SourceDType::f32;
  if (s == "bf16" || s == "bfloat16") return SourceDType::bf16;
  if (s == "f16" || s == "float16") return SourceDType::f16;
  throw std::invalid_argument("dtype: expected f32, bf16 or f16, got '" + s + "'");
}

namespace {
// `bytes` (> 0) 64-byte aligned or, from 2 MiB on, 2 MiB aligned and advised for transparent huge
// pages (with THP in "madvise" mode, the usual default, nothing else gets them); std::free frees.
void* alloc_maybe_huge(size_t bytes) {
  constexpr size_t kHuge = size_t(2) << 20;
  const size_t align = bytes >= kHuge ? kHuge : 64;
  const size_t alloc = size_t(round_up(int64_t(bytes), int64_t(align)));
  void* p = std::aligned_alloc(align, alloc);
  if (!p) throw std::bad_alloc();
  if (align == kHuge) madvise(p, alloc, MADV_HUGEPAGE);
  return p;
}
}  // namespace

AlignedBuffer::AlignedBuffer(size_t bytes) : n_(bytes) {
  if (bytes == 0) return;
  p_ = alloc_maybe_huge(bytes);  // packed weights: huge pages
}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& o) noexcept {
  std::swap(p_, o.p_);
  std::swap(n_, o.n_);
  return *this;
}

AlignedBuffer::~AlignedBuffer() {
  std::free(p_);
}

namespace {
// The forward's large scratch on huge pages too (alloc_maybe_huge): the partial rows that down's
// tiles read-modify-write, T x H fp32 scattered by token (34 MB at Qwen3 T = 4096, beyond the
// 12 MB a Zen 4's L2 TLB maps with 4 KiB pages), the quantized activation rows and h. Qwen3's down
// kernel alone writing 256 rows scattered over 34 MB (ktjit_kernel_bench ... accum int8 128 4096)
// ran at 83-86 % of the vpdpbusd peak on 4 KiB pages, 90-92 % on 2 MiB ones, 91-94 % into
// contiguous rows; the Qwen3 T = 4096 layer 1.5-3 % faster (docs/BENCHMARKS.md).
template <class T>
struct HugePageAllocator {
  using value_type = T;
  HugePageAllocator() = default;
  template <class U>
  HugePageAllocator(const HugePageAllocator<U>&) {}
  T* allocate(size_t n) {
    return static_cast<T*>(alloc_maybe_huge(std::max<size_t>(1, n) * sizeof(T)));
  }
  void deallocate(T* p, size_t) { std::free(p); }
  template <class U>
  bool operator==(const HugePageAllocator<U>&) const {
    return true;
  }
  template <class U>
  bool operator!=(const HugePageAllocator<U>&) const {
    return false;
  }
};
template <class T>
using HugeVector = std::vector<T, HugePageAllocator<T>>;
}  // namespace

// Per-forward working memory, grown on demand and reused by every later forward of every layer
// (one per process: shared_scratch; 4 Qwen3 layers' first T = 4096 forwards grew the process by
// 928 MB with one per layer, 232 MB with one in all, and DeepSeek-V3 T = 256 over 4 rotated layers
// ran at 90-94 % of the vpdpbusd peak instead of 79-85 %, the scratch staying warm). The routing is
// shared by every pool (read-only inside the pools' job); each pool has its own quantized
// activations (prefill) and each shard its own intermediate, partial output and work split, so
// pools running at once never write the same memory.
struct MoELayer::Scratch {
  std::vector<int64_t> count, offset, fill;
  std::vector<int> active;
  std::vector<int32_t> row_token;
  std::vector<float> row_weight;
  const float* x = nullptr;
  int64_t T = 0, rows = 0, lda_x = 0, p_stride = 0;
  int64_t gsum_g = 0, gsum_groups = 0;  // prefill gate/up: act_sum_groups (0: none)
  bool decode = false;  // every expert fits one decode tile (see forward())
  // Prefill, bf16 / fp8 weights: the rows of the experts whose gate/up runs the whole pair tier
  // (MoELayer::pair_tier_whole) are gathered as bf16, each token rounded once (xb), instead
  // of as fp32 rows that every gate/up call rounds again.
  bool gu_bf16 = false;
  std::vector<uint8_t> row_bf16;  // per row: gathered from xb (else xq)
  struct PerPool {
    HugeVector<int8_t> xq;  // tokens quantized once (prefill), gathered per expert by gate/up
    std::vector<float> xs;
    std::vector<int32_t> xg;  // [T][groups]: each token's activation sums (act_sum_groups)
    HugeVector<uint16_t> xb;  // [T][H] bf16 (gu_bf16)
  };
  struct PerShard {
    HugeVector<float> h, partial;  // partial: [T, p_stride] fp32
    std::vector<float> hs;
    HugeVector<int8_t> hq;
    std::vector<float*> h_rows, out_rows;
    int64_t h_stride = 0, lda_h = 0;
    std::vector<int64_t> gu_cost;  // prefix sums of the gate/up work units' cost
  };
  std::vector<PerPool> pools;
  std::vector<PerShard> shards;
};

namespace {
// The format's block along I: a shard boundary never splits one (FP8's 128x128 scale blocks;
// otherwise one vector of columns). Uneven splits are fine: I need not divide by the shard count.
int shard_unit(const std::string& method, IsaLevel isa) {
  if (method == "FP8") return 128;
  if (method == "MXFP4" || method == "MXFP8") return 32;  // the scale group along down's K
  return vec_lanes(isa == IsaLevel::amx ? IsaLevel::avx512_bf16 : isa);
}

// Even split of I on `lanes` (block) boundaries into `shards` parts.
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
               even_bounds(shape.intermediate, shard_unit(method, isa), shards)) {}

MoELayer::MoELayer(const MoEShape& shape, const std::string& method, IsaLevel isa,
                   const std::vector<int64_t>& shard_bounds)
    : MoELayer(shape, method, isa, shard_bounds, nullptr, nullptr) {}

MoELayer::MoELayer(const MoEShape& shape, const std::string& method, IsaLevel isa,
                   const std::vector<int64_t>& shard_bounds, const formats::GroupedSpec& gu,
                   const formats::GroupedSpec& down)
    : MoELayer(shape, method, isa,
               shard_bounds.empty() ? std::vector<int64_t>{0, shape.intermediate} : shard_bounds,
               &gu, &down) {}

std::vector<int64_t> MoELayer::grouped_shard_bounds(int64_t intermediate, int64_t down_unit,
                                                    int shards) {
  return formats::qgroup_shard_bounds(intermediate, down_unit, shards);
}

MoELayer::MoELayer(const MoEShape& shape, const std::string& method, IsaLevel isa,
                   const std::vector<int64_t>& shard_bounds, const formats::GroupedSpec* gu,
                   const formats::GroupedSpec* down)
    : shape_(shape), method_(method), isa_(isa) {
  if (shape.experts <= 0 || shape.top_k <= 0 || shape.hidden <= 0 || shape.intermediate <= 0)
    throw std::invalid_argument(
        "MoELayer: num_experts, top_k, hidden and intermediate must be > 0");
  format_ = method_format(method);
  if (format_ == WeightFormat::qgroup) {  // k-group scaled codes (formats/grouped.hpp)
    if (!gu || !down)
      throw std::invalid_argument("method " + method +
                                  " needs the grouped storage of gate/up and down (gu_group, "
                                  "down_group, biases and 4-bit tables)");
    formats::check_grouped_spec(*gu, method + " gate/up");
    formats::check_grouped_spec(*down, method + " down");
    const int64_t gu_unit = formats::qgroup_unit(*gu), dn_unit = formats::qgroup_unit(*down);
    if (shape.hidden % gu_unit != 0 || shape.intermediate % dn_unit != 0)
      throw std::invalid_argument(
          method + ": hidden size " + std::to_string(shape.hidden) + " must be a multiple of " +
          "gate/up's " + (gu->super_group ? "super block " : "group ") + std::to_string(gu_unit) +
          " and intermediate size " + std::to_string(shape.intermediate) + " of down's " +
          (down->super_group ? "super block " : "group ") + std::to_string(dn_unit));
    qg_gu_ = *gu;
    qg_down_ = *down;
    // int32 super-block folds at avx2 (jit/kernel.hpp kQGroupIntFold) where the codes allow them
    // (the setting is checked on every level: a typo is an error everywhere)
    const bool folds_allowed = qgroup_folds_allowed();
    qg_folds_ = isa == IsaLevel::avx2 && folds_allowed;
    // and fp32 super-block partials at the VNNI levels (kQGroupSuperSums)
    qg_psums_ = int8_activation_offset(isa) && folds_allowed;
    // Where the codes allow int32 folds (Q6_K, Q3_K) the VNNI partials take them signed too: the
    // activations come as a + 128 and the super block's header corrects for it, so no group end
    // subtracts 128 * s_g and no call sums the rows' groups (kQGroupIntFold | kQGroupSuperSums).
    for (formats::GroupedSpec* g : {&qg_gu_, &qg_down_})
      g->int_fold = (qg_folds_ || qg_psums_) && formats::qgroup_int_fold(*g);
    qg_store_offset_[0] = qgroup_store_offset(isa, qg_gu_);
    qg_store_offset_[1] = qgroup_store_offset(isa, qg_down_);
    formats::qgroup_kernel_lut(qg_gu_, qg_store_offset_[0], qg_lut_[0]);
    formats::qgroup_kernel_lut(qg_down_, qg_store_offset_[1], qg_lut_[1]);
  } else if (gu || down) {
    throw std::invalid_argument(
        "grouped storage (gu_group, down_group, ...) applies to "
        "LLAMAFILE, RAWINT4 and GPTQ_INT4 only, not to method " +
        method);
  }
  fp8_block_ = method == "FP8";
  // (A test that routes kernel calls through the x86-64 interpreter may build any level.)
  if (int(isa) > int(selected_isa()) && !gemm_runner_installed())
    throw std::invalid_argument(std::string("MoELayer: isa ") + isa_name(isa) +
                                " is above the selected level " + isa_name(selected_isa()));
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
    if (format_ == WeightFormat::qgroup) {
      const int64_t unit = formats::qgroup_unit(qg_down_);
      if (sh.i_begin % unit != 0 || sh.i_end % unit != 0)
        throw std::invalid_argument("shard_bounds: " + method +
                                    " shards split down's K (I) and must lie on multiples "
                                    "of down's " +
                                    (qg_down_.super_group ? "super block " : "group ") +
                                    std::to_string(unit) + ", got [" + std::to_string(sh.i_begin) +
                                    ", " + std::to_string(sh.i_end) + ")");
      sh.gu = formats::qgroup_layout(is, shape.hidden, lanes_, kStripVecs, 2, qg_gu_);
      sh.down = formats::qgroup_layout(shape.hidden, is, lanes_, kStripVecs, 1, qg_down_);
    } else if (is_mx_format(format_)) {  // formats/mx.hpp: K in groups of 32 with per-column scales
      if (shape.hidden % 32 != 0 || sh.i_begin % 32 != 0 || sh.i_end % 32 != 0)
        throw std::invalid_argument(
            method +
            ": hidden size and shard bounds must be multiples of 32 (the MX scale "
            "group), got hidden " +
            std::to_string(shape.hidden) + ", shard [" + std::to_string(sh.i_begin) + ", " +
            std::to_string(sh.i_end) + ")");
      const bool fp4 = format_ == WeightFormat::mxfp4;
      sh.gu = formats::mx_layout(is, shape.hidden, lanes_, kStripVecs, 2, fp4);
      sh.down = formats::mx_layout(shape.hidden, is, lanes_, kStripVecs, 1, fp4);
    } else if (format_ == WeightFormat::fp8) {
      // One K step per element; the scale group is the 128-wide block or the whole row.
      if (fp8_block_ && sh.i_begin % 128 != 0)
        throw std::invalid_argument(
            "shard_bounds: FP8 block scales need shard starts at "
            "multiples of 128, got " +
            std::to_string(sh.i_begin));
      // The pair order (K even) keeps per-row scales in 128-k groups of scale 1 too: its step
      // flags cover a group of at most 128 k (formats::kFp8FlagMaxPairs). So does isa amx,
      // whose decode tiles are avx512_bf16's and give the same bits.
      const bool po_gu = fp8_pair_order_at(isa_, shape.hidden % 2 == 0);
      const bool po_down = fp8_pair_order_at(isa_, is % 2 == 0);
      const IsaLevel tiles = isa_ == IsaLevel::amx ? IsaLevel::avx512_bf16 : isa_;
      const bool g_gu = fp8_block_ || fp8_pair_order_at(tiles, shape.hidden % 2 == 0);
      const bool g_down = fp8_block_ || fp8_pair_order_at(tiles, is % 2 == 0);
      sh.gu = formats::StripLayout::make(is, shape.hidden, lanes_, kStripVecs, 2, 8, 1,
                                         g_gu ? 128 : shape.hidden);
      sh.down = formats::StripLayout::make(shape.hidden, is, lanes_, kStripVecs, 1, 8, 1,
                                           g_down ? 128 : is);
      // K even gives even scale groups (128 or K): the kernels' k_pairs (build_kernels)
      sh.gu.fp8_pair_order = po_gu;
      sh.down.fp8_pair_order = po_down;
      sh.expert_gscale = sh.gu.gscale_floats() + sh.down.gscale_floats();
    } else {
      const int kg = bits == 16 ? bf16_kgroup(isa_) : 0;  // bf16: k pairs (not at ref)
      const int sv = strip_vecs_for(isa_, format_);
      sh.gu = formats::StripLayout::make(is, shape.hidden, lanes_, sv, 2, bits, kg);
      sh.down = formats::StripLayout::make(shape.hidden, is, lanes_, sv, 1, bits, kg);
    }
    sh.expert_bytes = sh.gu.total_bytes() + sh.down.total_bytes();
    sh.expert_cols = sh.gu.total_cols() + sh.down.total_cols();
    shards_.push_back(std::move(sh));
  }
  build_kernels();
}

MoELayer::~MoELayer() = default;

// Never destroyed (the process's exit frees it): a serving thread still in a forward while static
// objects are torn down at exit must not find them gone.
MoELayer::Scratch& MoELayer::shared_scratch() {
  static Scratch* s = new Scratch();
  return *s;
}

std::mutex& MoELayer::shared_scratch_mutex() {
  static std::mutex* m = new std::mutex();
  return *m;
}

WeightFormat method_format(const std::string& method) {
  if (method == "AMXINT8" || method == "MOE_INT8") return WeightFormat::int8;
  if (method == "AMXINT4" || method == "MOE_INT4") return WeightFormat::int4;
  if (method == "BF16") return WeightFormat::bf16;
  if (method == "FP8" || method == "FP8_PERCHANNEL") return WeightFormat::fp8;
  if (method == "MXFP4") return WeightFormat::mxfp4;
  if (method == "MXFP8") return WeightFormat::mxfp8;
  if (method == "LLAMAFILE" || method == "RAWINT4" || method == "GPTQ_INT4")
    return WeightFormat::qgroup;
  throw std::invalid_argument("method '" + method +
                              "' is not built; built methods: " + built_methods());
}

const char* built_methods() {
  return "AMXINT8, MOE_INT8, AMXINT4, MOE_INT4, BF16, FP8, FP8_PERCHANNEL, MXFP4, MXFP8, "
         "LLAMAFILE, RAWINT4, GPTQ_INT4";
}

// fp8 decode of 1-2 rows at avx2 widens e4m3 in the fp32 domain (jit/kernel.hpp kFp8Fp32Widen) on
// AMD CPUs (and Hygon's Zen), whose FMAs take the subnormal codes' fp32 subnormals at full speed;
// Intel's take a microcode assist per such instruction, so they keep the fp16 route.
static bool fp8_fp32_widen_here() {
  const std::string& v = cpu_features().vendor;
  return v == "AuthenticAMD" || v == "HygonGenuine";
}

GemmKernelSet make_gemm_kernel_set(IsaLevel isa, WeightFormat fmt, Epilogue epi, int tail_vecs,
                                   uint16_t variant, bool k_pairs) {
  // amx: AMX-INT8 (int8) and AMX-BF16 (bf16, fp8, mxfp4, mxfp8) prefill tiles for experts with
  // >= 16 rows (docs/ARCHITECTURE.md "AMX"); decode, short experts, remainders and the other
  // formats run the avx512_bf16 kernels. avx512_bf16 (native): bf16 experts with >=
  // kBf16PairMinRows rows run vdpbf16ps pair kernels (the strip re-laid as k pairs once per strip
  // pays off from ~2 blocks). fp8 at avx512_bf16 (and amx): decode of 1-4 rows through vdpbf16ps
  // (fp8_pair_kernel), when K and the scale group are even (k_pairs); wider tiles keep the fp32
  // kernels. fp8 prefill pair tiles: vdpbf16ps at avx512_bf16, AMX-BF16 at amx.
  const bool amx = isa == IsaLevel::amx;
  const int sv = strip_vecs_for(isa, fmt);  // (before amx's decode level below)
  if (amx) isa = IsaLevel::avx512_bf16;
  const bool half_strips = half_strips_allowed();  // checked on every level and format
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
    k.variant = variant;
    return k;
  };
  const int tail = tail_vecs ? tail_vecs : sv;
  for (int m = 1; m <= ks.max_rows; ++m) {
    ks.decode_full.push_back(key(KernelKind::gemm_decode, m, sv));
    ks.decode_tail.push_back(key(KernelKind::gemm_decode, m, tail));
    if (fmt == WeightFormat::fp8 && isa == IsaLevel::avx512_bf16 && k_pairs && m <= 4)
      ks.decode_full.back().variant = ks.decode_tail.back().variant = uint16_t(
          kBf16Pairs | (fp8_pair_order_at(amx ? IsaLevel::amx : isa, k_pairs) ? kFp8PairOrder : 0));
    // mxfp8 decode of 1-4 rows through the same vdpbf16ps pair decode (jit/gemm.hpp
    // mx8_pair_decode_kernel), since 2026-11-27; SwiGLU bits kept
    if (fmt == WeightFormat::mxfp8 && isa == IsaLevel::avx512_bf16 && m <= 4)
      ks.decode_full.back().variant = ks.decode_tail.back().variant = uint16_t(variant | kMxPairs);
    if (fmt == WeightFormat::fp8 && isa == IsaLevel::avx2 && m <= 2 && fp8_fp32_widen_here())
      ks.decode_full.back().variant = ks.decode_tail.back().variant = kFp8Fp32Widen;
  }
  const int prefill_rows = gemm_prefill_rows(isa, fmt, sv);
  ks.prefill_full = key(KernelKind::gemm_prefill, prefill_rows, sv);
  ks.prefill_tail = key(KernelKind::gemm_prefill, prefill_rows, tail);
  // AMX-BF16 for fp8 and mx decodes each strip to bf16 pairs first (jit/gemm.hpp
  // amx_decoded_weight), so those take the AMX tiles from 16 rows too (fp8: K and group even).
  // int4 decodes its strip to int8 first (jit/gemm.hpp amx_int4_kernel).
  if (amx && (fmt == WeightFormat::int8 || fmt == WeightFormat::int4 || fmt == WeightFormat::bf16 ||
              is_mx_format(fmt) || (fmt == WeightFormat::fp8 && k_pairs))) {
    ks.tile_rows = ks.tile_min_rows = 16;
    ks.tile_full = key(KernelKind::gemm_prefill, ks.tile_rows, sv);
    ks.tile_tail = key(KernelKind::gemm_prefill, ks.tile_rows, tail);
    ks.tile_full.isa = ks.tile_tail.isa = IsaLevel::amx;
  } else if (isa == IsaLevel::avx512_bf16 &&
             (fmt == WeightFormat::bf16 || (fmt == WeightFormat::fp8 && k_pairs) ||
              is_mx_format(fmt))) {
    // mx since 2026-11-27 (jit/gemm.hpp mx_pair_kernel; before, 6-row fp32 tiles that decode every
    // weight once per block): the strip decoded once to bf16 pairs, then vdpbf16ps blocks.
    ks.tile_rows = sv == 2 && fmt == WeightFormat::bf16 ? kBf16PairRows2v : ks.max_rows;
    ks.tile_min_rows = kBf16PairMinRows;
    ks.tile_full = key(KernelKind::gemm_prefill, ks.tile_rows, sv);
    ks.tile_tail = key(KernelKind::gemm_prefill, ks.tile_rows, tail);
    ks.tile_full.variant = ks.tile_tail.variant =
        is_mx_format(fmt) ? uint16_t(variant | kMxPairs)  // + SwiGLU bits
        : fmt == WeightFormat::fp8 && fp8_pair_order_at(isa, k_pairs)
            ? uint16_t(kBf16Pairs | kFp8PairOrder)
            : uint16_t(kBf16Pairs);
  } else if ((isa == IsaLevel::avx2 || isa == IsaLevel::avx512 || isa == IsaLevel::avx512_vnni) &&
             ((fmt == WeightFormat::fp8 && k_pairs) || is_mx_format(fmt))) {
    // Strip-scratch tiles (jit/gemm.hpp strip_scratch_kernel): the strip decoded once (fp8 to
    // fp16, mx to bf16 k pairs), then blocks of FMAs over it (3 rows at avx2, 6 on zmm), from one
    // full block on. The fp32 prefill tiles decode every weight again for each block (FP8 held
    // about 30 % of the FMA peak at Qwen3 T = 1024 on Zen 3); the remainder runs in the same call
    // over the same scratch (GemmArgs::m_tail). At avx512 and avx512_vnni since 2026-11-27 (a Zen 4
    // capped to those levels, Qwen3 T = 1024: FP8 1.29-1.33x, MXFP8 1.28x, MXFP4 1.20x).
    // avx512_bf16 runs FP8 and MX on its vdpbf16ps pair tiles above. (MX K is a multiple of 32:
    // always k pairs.)
    ks.tile_rows = ks.tile_min_rows = gemm_max_rows(isa, WeightFormat::bf16);
    ks.tile_full = key(KernelKind::gemm_prefill, ks.tile_rows, sv);
    ks.tile_tail = key(KernelKind::gemm_prefill, ks.tile_rows, tail);
    ks.tile_full.variant = ks.tile_tail.variant =
        uint16_t(variant | kStripScratch);  // + SwiGLU bits
  } else if (half_strips && half_strip_tiles(isa, fmt, variant)) {
    // Half-strip tiles (jit/gemm.hpp half_strip_format, half_strip_vnni_format): two passes of 2
    // vectors per strip. avx2: 4 rows, so each code vector is decoded (masked, looked up, |code|)
    // once for 4 rows (an L1-resident loop of int4's K steps ran 1.07-1.08x the 2-row tile's on
    // Zen 3, the layers 1.02-1.11x; docs/BENCHMARKS.md); the remainder of 1-3 rows takes the
    // 2-row prefill and the decode tiles. VNNI levels, byte codes: 6 rows, each K step's code
    // vectors read for 6 rows instead of 3, the 1-5 rows after the blocks in the same call
    // (GemmArgs::m_tail).
    ks.tile_rows = ks.tile_min_rows = half_strip_rows(isa);
    ks.tile_full = key(KernelKind::gemm_prefill, ks.tile_rows, sv);
    ks.tile_tail = key(KernelKind::gemm_prefill, ks.tile_rows, tail);
    ks.tile_full.variant = ks.tile_tail.variant = uint16_t(variant | kHalfStrips);
  } else if (isa == IsaLevel::neon_bf16 && fmt == WeightFormat::bf16) {
    // bfdot pair kernels (jit/aarch64/gemm_a64.cpp): 6-row blocks reading the k-pair strips in
    // place, from kNeonBf16PairMinRows rows (see there).
    ks.tile_rows = ks.max_rows;
    ks.tile_min_rows = kNeonBf16PairMinRows;
    ks.tile_full = key(KernelKind::gemm_prefill, ks.tile_rows, sv);
    ks.tile_tail = key(KernelKind::gemm_prefill, ks.tile_rows, tail);
    ks.tile_full.variant = ks.tile_tail.variant = kBf16Pairs;
  }
  return ks;
}

std::vector<KernelKey> GemmKernelSet::keys() const {
  std::vector<KernelKey> k = decode_full;
  k.insert(k.end(), decode_tail.begin(), decode_tail.end());
  k.push_back(prefill_full);
  k.push_back(prefill_tail);
  if (tile_rows) {
    k.push_back(tile_full);
    k.push_back(tile_tail);
  }
  std::vector<KernelKey> unique;
  for (auto& x : k)
    if (std::find(unique.begin(), unique.end(), x) == unique.end()) unique.push_back(x);
  return unique;
}

std::vector<KernelKey> moe_kernel_keys(const MoEShape& shape, WeightFormat fmt, IsaLevel isa) {
  const int bits = format_bits(fmt);
  const int lanes = vec_lanes(isa);
  const int sv = strip_vecs_for(isa, fmt);
  auto gu = formats::StripLayout::make(shape.intermediate, shape.hidden, lanes, sv, 2, bits);
  auto down = formats::StripLayout::make(shape.hidden, shape.intermediate, lanes, sv, 1, bits);
  // fp8 scale groups are 128 or all of K, so an even K gives even groups.
  std::vector<KernelKey> keys =
      make_gemm_kernel_set(isa, fmt, Epilogue::siluup, gu.tail_vecs, 0, shape.hidden % 2 == 0)
          .keys();
  for (auto& k : make_gemm_kernel_set(isa, fmt, Epilogue::accum, down.tail_vecs, 0,
                                      shape.intermediate % 2 == 0)
                     .keys())
    keys.push_back(k);
  return keys;
}

// Each shard has its own kernel sets: shards of different widths differ in their tail strips
// (the kernels themselves are shared through the cache).
void MoELayer::build_kernels() {
  auto& cache = KernelCache::instance();
  rowq_ = RowQuantizer(isa_);
  for (Shard& sh : shards_) {
    auto qg_variant = [&](const formats::GroupedSpec& g) {
      const int c0 = qgroup_offset(isa_, g);
      // lane folds sum in int16 lanes (byte codes: folded into int32 every 4 K steps): avx2;
      // int16 group sums are for the vpmaddubsw levels (VNNI: vpdpbusd sums in int32)
      const bool lanes =
          qg_folds_ && isa_ == IsaLevel::avx2 && c0 == 0 && formats::qgroup_lane_fold(g);
      const bool words = !qgroup_flip_codes(isa_) && formats::qgroup_int16_sums(g, c0);
      return uint16_t((g.code_bits == 4 ? kQGroupNibbles : 0) | (g.bias ? kQGroupBias : 0) |
                      (g.super_group ? kQGroupSuper : 0) |
                      (g.scale_dtype == formats::FloatType::f16    ? kQGroupF16
                       : g.scale_dtype == formats::FloatType::bf16 ? kQGroupBf16
                                                                   : 0) |
                      (c0 >= 0 ? qgroup_offset_variant(c0) : 0) |
                      (words || lanes ? kQGroupI16 : 0) |
                      (c0 >= 0 && formats::qgroup_identity_table(g, c0) ? kQGroupIdentity : 0) |
                      (g.int_fold ? kQGroupIntFold : 0) | (lanes ? kQGroupLaneFold : 0) |
                      (qg_psums_ && g.super_group && !g.bias ? kQGroupSuperSums : 0));
    };
    const bool qg = format_ == WeightFormat::qgroup;
    auto k_pairs = [](const formats::StripLayout& l) { return l.k % 2 == 0 && l.g_steps % 2 == 0; };
    sh.gu_kernels =
        make_gemm_kernel_set(isa_, format_, Epilogue::siluup, sh.gu.tail_vecs,
                             qg ? qg_variant(qg_gu_) : swiglu_variant(), k_pairs(sh.gu));
    sh.down_kernels = make_gemm_kernel_set(isa_, format_, Epilogue::accum, sh.down.tail_vecs,
                                           qg ? qg_variant(qg_down_) : 0, k_pairs(sh.down));
    if (isa_ == IsaLevel::ref) continue;
    for (GemmKernelSet* ks : {&sh.gu_kernels, &sh.down_kernels}) {
      for (auto& k : ks->decode_full) ks->decode_full_k.push_back(cache.get(k));
      for (auto& k : ks->decode_tail) ks->decode_tail_k.push_back(cache.get(k));
      ks->prefill_full_k = cache.get(ks->prefill_full);
      ks->prefill_tail_k = cache.get(ks->prefill_tail);
      if (ks->tile_rows) {
        ks->tile_full_k = cache.get(ks->tile_full);
        ks->tile_tail_k = cache.get(ks->tile_tail);
      }
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
  for (auto& sh : shards_)
    b += sh.weights.size() + sh.scales.size() + sh.comps.size() + sh.gscales.size();
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
  if (format_ == WeightFormat::fp8 || is_mx_format(format_))
    throw std::invalid_argument("method " + method_ +
                                " loads e4m3 checkpoints (load_experts_fp8 / load_weights), not "
                                "float tensors");
  if (format_ == WeightFormat::qgroup)
    throw std::invalid_argument("method " + method_ +
                                " loads k-group quantized experts (load_experts_grouped), not "
                                "float tensors");
  const int64_t E = shape_.experts, H = shape_.hidden, I = shape_.intermediate;
  for (const ExpertSource& x : experts)
    if (x.slot < 0 || x.slot >= E)
      throw std::invalid_argument("expert slot: expected a value in [0, " + std::to_string(E) +
                                  "), got " + std::to_string(x.slot));
  ensure_allocated(&pool);
  const auto quantize_w =
      format_ == WeightFormat::int4 ? formats::quantize_row_int4 : formats::quantize_row_int8;
  const bool nib_offset = int4_offset_nibbles(isa_, format_);  // the avx2 / avx512 int4 codes
  const int64_t n = int64_t(experts.size());
  // Shard s is packed by pool s % pools, so its pages are first touched on that pool's node.
  pool.run_pools([&](const PoolWork& wk) {
    int64_t e0, e1;
    split_range(n, wk.tid, wk.nt, &e0, &e1);
    for (int si = wk.pool; si < num_shards(); si += wk.pools) {
      Shard& sh = shards_[size_t(si)];
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
        formats::pack_int8_strips(sh.gu, gu_q, gu_d, wb, sb, cb, nib_offset);
        const int8_t* d_q[1] = {qd.data()};
        const float* d_d[1] = {dd.data()};
        formats::pack_int8_strips(sh.down, d_q, d_d, wd, sd, cd, nib_offset);
      }
    }
  });
  for (const ExpertSource& x : experts)
    for (int si = 0; si < num_shards(); ++si) mark_loaded(si, x.slot);
}

void MoELayer::ensure_allocated(ThreadPool* pool) {
  const int64_t E = shape_.experts;
  if (!slot_loaded_.empty()) return;
  for (size_t si = 0; si < shards_.size(); ++si) {
    Shard& sh = shards_[si];
    sh.weights = AlignedBuffer(size_t(E * sh.expert_bytes));
    sh.scales = AlignedBuffer(size_t(E * sh.expert_cols) * 4);
    sh.comps = AlignedBuffer(size_t(E * sh.expert_cols) * 4);
    if (sh.expert_gscale) sh.gscales = AlignedBuffer(size_t(E * sh.expert_gscale) * 4);
    // Real multi-node pools: the weights (the one big buffer) go to the owning pool's node
    // before anything touches them. Never a second copy: each shard lives on one node only.
    if (pool) pool->bind_memory(sh.weights.as<void>(), sh.weights.size(), int(si) % pool->pools());
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
  ensure_allocated(&pool);
  Shard& sh = shards_[size_t(shard)];
  const int64_t n = int64_t(experts.size());
  const bool nib_offset = int4_offset_nibbles(isa_, format_);  // the avx2 / avx512 int4 codes
  pool.run_pools([&](const PoolWork& wk) {  // on the pool that owns the shard (first touch)
    if (shard % wk.pools != wk.pool) return;
    int64_t j0, j1;
    split_range(n, wk.tid, wk.nt, &j0, &j1);
    for (int64_t j = j0; j < j1; ++j) {
      const QuantExpertSource& x = experts[size_t(j)];
      int8_t* wb = sh.weights.as<int8_t>() + x.slot * sh.expert_bytes;
      float* sb = sh.scales.as<float>() + x.slot * sh.expert_cols;
      int32_t* cb = sh.comps.as<int32_t>() + x.slot * sh.expert_cols;
      const int8_t* gu_q[2] = {x.q_gate, x.q_up};
      const float* gu_d[2] = {x.d_gate, x.d_up};
      formats::pack_int8_strips(sh.gu, gu_q, gu_d, wb, sb, cb, nib_offset);
      const int8_t* d_q[1] = {x.q_down};
      const float* d_d[1] = {x.d_down};
      formats::pack_int8_strips(sh.down, d_q, d_d, wb + sh.gu.total_bytes(),
                                sb + sh.gu.total_cols(), cb + sh.gu.total_cols(), nib_offset);
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
  ensure_allocated(&pool);
  const int64_t hb = (H + 127) / 128, ib = (I + 127) / 128;
  const int64_t n = int64_t(experts.size());
  pool.run_pools([&](const PoolWork& wk) {  // shard s packed by pool s % pools (first touch)
    int64_t j0, j1;
    split_range(n, wk.tid, wk.nt, &j0, &j1);
    for (int si = wk.pool; si < num_shards(); si += wk.pools) {
      Shard& sh = shards_[size_t(si)];
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

void MoELayer::load_experts_grouped(const std::vector<GroupedExpertSource>& experts,
                                    ThreadPool& pool) {
  std::lock_guard<std::mutex> lock(mu_);
  if (format_ != WeightFormat::qgroup)
    throw std::invalid_argument("load_experts_grouped: method " + method_ +
                                " is not a grouped method (LLAMAFILE, RAWINT4, GPTQ_INT4)");
  const int64_t E = shape_.experts, H = shape_.hidden, I = shape_.intermediate;
  for (const GroupedExpertSource& x : experts) {
    if (x.slot < 0 || x.slot >= E)
      throw std::invalid_argument("expert slot: expected a value in [0, " + std::to_string(E) +
                                  "), got " + std::to_string(x.slot));
    const std::pair<const formats::GroupedMatrix*, const char*> ms[3] = {
        {&x.gate, "gate"}, {&x.up, "up"}, {&x.down, "down"}};
    for (const auto& [m, name] : ms) {
      const formats::GroupedSpec& sp = m == &x.down ? qg_down_ : qg_gu_;
      const std::string what = "expert " + std::to_string(x.slot) + " " + name;
      if (!m->codes || !m->scales)
        throw std::invalid_argument(what + ": codes and scales are required");
      if (m->group != sp.group)
        throw std::invalid_argument(what + ": group " + std::to_string(m->group) +
                                    " does not match the layer's " + std::to_string(sp.group));
      if (m->biases && !sp.bias)
        throw std::invalid_argument(what +
                                    ": has biases but the layer was built without a bias term");
    }
  }
  ensure_allocated(&pool);
  const int64_t n = int64_t(experts.size());
  pool.run_pools([&](const PoolWork& wk) {  // shard s packed by pool s % pools (first touch)
    int64_t j0, j1;
    split_range(n, wk.tid, wk.nt, &j0, &j1);
    for (int si = wk.pool; si < num_shards(); si += wk.pools) {
      Shard& sh = shards_[size_t(si)];
      for (int64_t j = j0; j < j1; ++j) {
        const GroupedExpertSource& x = experts[size_t(j)];
        const std::string ex = "expert " + std::to_string(x.slot) + " ";
        int8_t* wb = sh.weights.as<int8_t>() + x.slot * sh.expert_bytes;
        // gate/up: rows [i_begin, i_end) of [I, H]; down: columns [i_begin, i_end) of [H, I].
        const formats::GroupedSlice gu[2] = {{&x.gate, H, sh.i_begin, 0, ex + "gate"},
                                             {&x.up, H, sh.i_begin, 0, ex + "up"}};
        formats::pack_qgroup_strips(sh.gu, qg_gu_, gu, qg_store_offset_[0], wb);
        const formats::GroupedSlice d{&x.down, I, 0, sh.i_begin, ex + "down"};
        formats::pack_qgroup_strips(sh.down, qg_down_, &d, qg_store_offset_[1],
                                    wb + sh.gu.total_bytes());
      }
    }
  });
  for (const GroupedExpertSource& x : experts)
    for (int si = 0; si < num_shards(); ++si) mark_loaded(si, x.slot);
}

void MoELayer::set_swiglu(float limit, float alpha) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!(limit >= 0.0f) || !(alpha >= 0.0f) || std::isinf(limit) || std::isinf(alpha))
    throw std::invalid_argument("swiglu_limit / swiglu_alpha: expected finite values >= 0, got " +
                                std::to_string(limit) + " / " + std::to_string(alpha));
  if ((limit != 0.0f || alpha != 0.0f) && !is_mx_format(format_))
    throw std::invalid_argument(
        "swiglu_limit / swiglu_alpha: only methods MXFP4 and MXFP8 take them, got method " +
        method_);
  swiglu_limit_ = limit;
  swiglu_alpha_ = alpha;
  build_kernels();
}

void MoELayer::load_experts_mx(const std::vector<MxExpertSource>& experts, ThreadPool& pool) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!is_mx_format(format_))
    throw std::invalid_argument("load_experts_mx: method " + method_ + " is not MXFP4 / MXFP8");
  const int64_t E = shape_.experts, H = shape_.hidden, I = shape_.intermediate;
  for (const MxExpertSource& x : experts)
    if (x.slot < 0 || x.slot >= E)
      throw std::invalid_argument("expert slot: expected a value in [0, " + std::to_string(E) +
                                  "), got " + std::to_string(x.slot));
  ensure_allocated(&pool);
  const bool fp4 = format_ == WeightFormat::mxfp4;
  const int64_t h_bytes = fp4 ? H / 2 : H, i_bytes = fp4 ? I / 2 : I;  // row bytes
  const int64_t n = int64_t(experts.size());
  pool.run_pools([&](const PoolWork& wk) {  // shard s packed by pool s % pools (first touch)
    int64_t j0, j1;
    split_range(n, wk.tid, wk.nt, &j0, &j1);
    for (int si = wk.pool; si < num_shards(); si += wk.pools) {
      Shard& sh = shards_[size_t(si)];
      const int64_t i0 = sh.i_begin;  // a multiple of 32: whole bytes and whole scale groups
      for (int64_t j = j0; j < j1; ++j) {
        const MxExpertSource& x = experts[size_t(j)];
        uint8_t* wb = sh.weights.as<uint8_t>() + x.slot * sh.expert_bytes;
        const uint8_t* gu_w[2] = {x.gate + i0 * h_bytes, x.up + i0 * h_bytes};
        const uint8_t* gu_e[2] = {x.gate_scale + i0 * (H / 32), x.up_scale + i0 * (H / 32)};
        formats::pack_mx_strips(sh.gu, fp4, gu_w, h_bytes, gu_e, H / 32, wb);
        const uint8_t* d_w[1] = {x.down + (fp4 ? i0 / 2 : i0)};
        const uint8_t* d_e[1] = {x.down_scale + i0 / 32};
        formats::pack_mx_strips(sh.down, fp4, d_w, i_bytes, d_e, I / 32, wb + sh.gu.total_bytes());
      }
    }
  });
  for (const MxExpertSource& x : experts)
    for (int si = 0; si < num_shards(); ++si) mark_loaded(si, x.slot);
}

// Until 2026-11-28 (a thirty-seventh session) the tier took rows / tile_rows blocks and the rest
// as one tile, so the BF16 pair tiles' 4 + 3 split (a thirty-fourth session) never reached a layer:
// Qwen3 BF16 layers, in-process A/Bs on a Zen 5, ran T = 128 1.01x and T = 256 1.00-1.01x faster
// with it, T = 1024 the same.
PrefillSplit tile_tier_split(const GemmKernelSet& ks, int64_t rows, bool padded) {
  if (tail_rows_kernel(ks.tile_full)) return prefill_split(ks.tile_full, rows);
  return {(padded ? round_up(rows, ks.tile_rows) : rows) / ks.tile_rows, 0};
}

std::pair<int64_t, int64_t> MoELayer::act_sum_groups(const GemmKernelSet& ks,
                                                     const formats::StripLayout& layout) const {
  if (format_ == WeightFormat::qgroup && qgroup_needs_gsum(ks.prefill_full))
    return {layout.g_steps * 4, layout.groups()};
  if (int4_int16_sums(isa_, format_)) return {layout.k, 1};
  return {0, 0};
}

bool MoELayer::pair_tier(const GemmKernelSet& ks, int64_t k, int64_t rows) {
  return ks.tile_rows && block_pair_kernel(ks.tile_full) && rows >= ks.tile_min_rows && k % 2 == 0;
}

void MoELayer::run_gemm(const GemmKernelSet& ks, const formats::StripLayout& layout, bool reference,
                        const int8_t* w, const float* scale, const int32_t* comp,
                        int64_t strip_begin, int64_t strip_end, const int8_t* a, int64_t lda,
                        const float* a_scale, int64_t rows, float* const* out_rows,
                        int64_t out_col0, const float* row_weight, const float* gscale,
                        const int8_t* pf_last, const uint16_t* a_bf16,
                        const int32_t* a_gsum) const {
  if (a_bf16 && !pair_tier_whole(ks, layout.k, rows))
    throw std::logic_error("run_gemm: bf16 rows given to a call outside the whole pair tier");
  const int full_cols = layout.strip_cols(layout.strip_vecs);
  const int out_full = gemm_strip_out_cols(isa_, layout.strip_vecs, ks.epilogue);
  // The rows' activation sums of GemmArgs::a_gsum ([g][row]): qgroup's per-group s_g (the VNNI
  // offset, the bias term), and for avx2 / avx512 int4 (int4_int16_sums) one group over K, which
  // those kernels take off their sums of the codes q4 + 8. Given by the caller (`a_gsum`: prefill
  // gate/up sums each token once) or computed here from the int8 rows the kernels read.
  const int32_t* gsum = a_gsum;
  if (const auto [G, groups] = act_sum_groups(ks, layout); groups > 0 && !gsum) {
    static thread_local std::vector<int32_t> gs;
    gs.resize(size_t(groups * rows));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t g = 0; g < groups; ++g)
        gs[size_t(g * rows + r)] = row_sum_i8(a + r * lda + g * G, G);
    gsum = gs.data();
  }
  // pair tier (bf16: AMX-BF16 at isa amx, vdpbf16ps at avx512_bf16; fp8: vdpbf16ps at
  // avx512_bf16, AMX-BF16 at amx; mx: AMX-BF16 at amx; >= tile_min_rows rows, K even): the
  // kernels take bf16 activations, rounded here (RNE) once per call, and fp8 / mx a per-thread
  // scratch for the strip decoded to bf16 pairs (bf16 strips are k pairs already). All rows go
  // there: at avx512_bf16 the rows after the whole blocks run as one short tile in the same call
  // (GemmArgs::m_tail); at amx and neon_bf16 (bfdot, jit/aarch64/gemm_a64.cpp) the last block is
  // padded with zero rows whose outputs land in a per-thread dummy row (routing weight 0), which
  // costs less than streaming the strip through the fp32 kernels again for the remainder.
  // fp32 rows to bf16: the generated converter (RowQuantizer::to_bf16), the C++ loop for the
  // reference forward; the same bits
  auto to_bf16 = [&](const float* x, int64_t n, uint16_t* out) {
    if (reference)
      formats::f32_to_bf16_row(x, n, out);
    else
      rowq_.to_bf16(x, n, out);
  };
  const bool bf16_pairs = pair_tier(ks, layout.k, rows);
  static thread_local std::vector<uint16_t> a16;
  static thread_local std::vector<uint8_t> pair_scratch;
  static thread_local std::vector<float*> pair_out;
  static thread_local std::vector<float> pair_weight, pair_dummy;
  // Pair kernels that run the last rows themselves (tail_rows_kernel, avx512_bf16) need no padding.
  const int64_t pair_rows = !bf16_pairs                      ? 0
                            : tail_rows_kernel(ks.tile_full) ? rows
                                                             : round_up(rows, ks.tile_rows);
  const uint16_t* a16_rows = a_bf16;  // (K a row; else a16, converted here)
  if (bf16_pairs) {
    const int64_t K = layout.k;
    if (!a_bf16) {
      // rows past `rows` (AMX's padding) read as zeros; the rest is written right below
      a16.resize(size_t(pair_rows * K));
      std::fill(a16.begin() + rows * K, a16.end(), uint16_t(0));
      for (int64_t r = 0; r < rows; ++r)
        to_bf16(reinterpret_cast<const float*>(a + r * lda), K, &a16[size_t(r * K)]);
      a16_rows = a16.data();
    }
    // The dummy row is as wide as the widest column this call writes.
    pair_dummy.resize(size_t(out_col0 + (layout.full_strips + 1) * out_full));
    pair_out.assign(out_rows, out_rows + rows);
    pair_out.resize(size_t(pair_rows), pair_dummy.data());
    pair_weight.assign(size_t(pair_rows), 0.0f);
    if (row_weight) std::copy(row_weight, row_weight + rows, pair_weight.begin());
  }
  // The tile kernels' per-thread scratch (a strip decoded once for all of its M blocks), and the
  // prefill kernels' (qgroup group scales built once a strip: qgroup_scale_scratch_kernel).
  if (ks.tile_rows && rows >= ks.tile_min_rows)
    if (const int64_t bytes = gemm_scratch_bytes(ks.tile_full, layout.k4))
      if (pair_scratch.size() < size_t(bytes) + 64) pair_scratch.resize(size_t(bytes) + 64);
  if (const int64_t bytes = gemm_scratch_bytes(ks.prefill_full, layout.k4))
    if (pair_scratch.size() < size_t(bytes) + 64) pair_scratch.resize(size_t(bytes) + 64);
  // 64-byte aligned: the tiles store and load whole zmm lines there (a vector's data is 16-byte
  // aligned, and with the fp8 rounds' group in L1 a split line cost Qwen3 FP8 T = 256 2-3 %).
  uint8_t* const scratch64 = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(pair_scratch.data()) + 63) & ~uintptr_t(63));
  const int64_t strips_end = std::min(strip_end, layout.full_strips + (layout.tail_vecs ? 1 : 0));
  int64_t i16_row0 = -1;   // first row of the int16 codes converted in this call (mxfp4 decode)
  int64_t bf16_row0 = -1;  // likewise for the bf16 rows of the fp8 pair kernels
  auto call = [&](const KernelKey& key, const Kernel* k, int64_t s0, int64_t ns, int64_t row0,
                  int64_t m_blocks, int64_t m_tail = 0) {
    GemmArgs args;
    args.m_tail = m_tail;
    // The range's last strip prefetches the caller's next matrix (pf_last) instead of the bytes
    // after it.
    args.pf_last = s0 + ns == strips_end ? pf_last : nullptr;
    args.a = a + row0 * lda;
    args.lda = lda;
    args.scratch = nullptr;
    if (block_pair_kernel(key)) {
      args.a = reinterpret_cast<const int8_t*>(a16_rows + row0 * layout.k);
      args.lda = layout.k * 2;
    }
    if (gemm_scratch_bytes(key, 1)) args.scratch = scratch64;
    float* const* rows_out = block_pair_kernel(key) ? pair_out.data() : out_rows;
    const float* rows_weight = block_pair_kernel(key) ? pair_weight.data() : row_weight;
    if ((fp8_pair_kernel(key) || mx8_pair_decode_kernel(key)) && !block_pair_kernel(key)) {
      // fp8 / mxfp8 pair decode: the rows as bf16 (RNE), once per run_gemm like the int16 codes.
      static thread_local std::vector<uint16_t> a_bf16;
      if (bf16_row0 != row0) {
        a_bf16.resize(size_t(layout.k * key.m_r));
        for (int r = 0; r < key.m_r; ++r)
          to_bf16(reinterpret_cast<const float*>(a + (row0 + r) * lda), layout.k,
                  &a_bf16[size_t(r * layout.k)]);
        bf16_row0 = row0;
      }
      args.a = reinterpret_cast<const int8_t*>(a_bf16.data());
      args.lda = layout.k * 2;
    }
    if (mx_int16_activations(key)) {  // the rows as int16 group codes (jit/gemm.hpp)
      // Once per run_gemm: the full and tail strips and every chunk reuse the same rows.
      static thread_local std::vector<uint8_t> a_i16;
      const int64_t bytes = formats::mx_act_i16_bytes(layout.k);
      if (i16_row0 != row0) {
        a_i16.resize(size_t(bytes * key.m_r));
        for (int r = 0; r < key.m_r; ++r)
          formats::quantize_mx_act_i16(reinterpret_cast<const float*>(a + (row0 + r) * lda),
                                       layout.k, a_i16.data() + r * bytes);
        i16_row0 = row0;
      }
      args.a = reinterpret_cast<const int8_t*>(a_i16.data());
      args.lda = bytes;
    }
    args.w = w + layout.strip_offset(s0);
    args.n_strips = ns;
    args.k4 = layout.k4;
    args.a_scale = a_scale + row0;
    args.w_scale = scale + s0 * full_cols;
    args.w_comp = comp + s0 * full_cols;
    args.out_rows = rows_out + row0;
    args.out_col = out_col0 + s0 * out_full;
    args.row_weight = rows_weight ? rows_weight + row0 : nullptr;
    args.m_blocks = m_blocks;
    args.w_gscale = gscale ? gscale + s0 * layout.gscale_floats_per_strip() : nullptr;
    args.g_steps = layout.g_steps;
    args.g_per_strip = layout.groups();
    args.g_per_super = layout.super_groups;
    args.s_per_strip = layout.supers();
    args.swiglu_limit = swiglu_limit_;
    args.swiglu_alpha = swiglu_alpha_;
    args.lut = qg_lut_[ks.epilogue == Epilogue::siluup ? 0 : 1];
    args.a_gsum = gsum ? gsum + row0 : nullptr;
    args.a_gsum_ld = rows * 4;
    if (reference || !k)
      gemm_ref(key, args);
    else
      run_gemm_kernel(*k, args);
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
      if (ks.tile_rows && rows >= ks.tile_min_rows &&
          (!block_pair_kernel(ks.tile_full) || bf16_pairs)) {  // the tile tier, then the rest
        // strip-scratch and avx512_bf16 pair tiles take the rows left over the same strip
        // (GemmArgs::m_tail), split as prefill_split splits them
        const PrefillSplit sp = tile_tier_split(ks, rows, bf16_pairs);
        call(tail ? ks.tile_tail : ks.tile_full,
             ref ? nullptr : (tail ? ks.tile_tail_k : ks.tile_full_k), c0, n, 0, sp.blocks,
             sp.tail);
        row = std::min(rows, sp.blocks * ks.tile_rows + sp.tail);
      }
      if (rows - row > max_rows) {
        const KernelKey& pkey = tail ? ks.prefill_tail : ks.prefill_full;
        // int8 at the VNNI levels and qgroup at the AVX-512 ones take the rows left too
        // (jit/gemm.hpp tail_rows_kernel, prefill_split)
        const PrefillSplit sp = prefill_split(pkey, rows - row);
        call(pkey, ref ? nullptr : (tail ? ks.prefill_tail_k : ks.prefill_full_k), c0, n, row,
             sp.blocks, sp.tail);
        row += sp.blocks * pkey.m_r + sp.tail;
      }
      if (rows > row) {
        auto [key, k] = tail ? pick(ks.decode_tail, ks.decode_tail_k, int(rows - row))
                             : pick(ks.decode_full, ks.decode_full_k, int(rows - row));
        call(key, k, c0, n, row, 1);
      }
    }
  }
}

namespace {
// One activation row in the form the kernels read it: per-row int8 (in the VNNI `a + 128` form
// when the ISA wants it) with its scale, or the fp32 row as it is (bf16/fp8 weights); the padding
// up to `lda` bytes reads as zero. Every quantize path (prefill per token, decode per row inside
// gate/up) goes through here, so the numbers never depend on the path.
// The C++ quantizer, which the reference forward runs (the generated ones give the same bits).
const RowQuantizer& cxx_row_quantizer() {
  static const RowQuantizer q;
  return q;
}

void quantize_act_row(const RowQuantizer& rq, const float* x, int64_t n, bool float_act, bool flip,
                      int64_t lda, int8_t* q, float* scale) {
  const int64_t bytes = n * (float_act ? 4 : 1);
  if (float_act) {
    std::memcpy(q, x, size_t(n) * 4);
    *scale = 1.0f;
  } else {
    *scale = rq.quantize(x, n, q, flip);
  }
  // int8 zero is byte 0x80 in the VNNI (a + 128) form.
  std::memset(q + bytes, flip && !float_act ? 0x80 : 0, size_t(lda - bytes));
}
}  // namespace

// Phase plan (docs/ARCHITECTURE.md "One forward"): the caller routes, then ONE fork/join over all
// pools; pool p runs shards p, p + P, ... with barriers that synchronise its own threads only;
// after the join the shard partials are summed in shard order.
//   decode (every expert <= one register tile of rows): [gate/up, each thread quantizing the
//     rows it reads] | [quantize h] | [down]                          -> 2 barriers (1 for float)
//   prefill: [quantize tokens] | [gate/up, gathering each expert's rows before its call] |
//     [quantize h] | [down]                                           -> 3 barriers (2 for float)
void MoELayer::forward(int64_t T, const float* x, const int64_t* ids, const float* w,
                       const bool* mask, float* out, ThreadPool& pool, bool reference) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!loaded_) throw std::runtime_error("MoELayer.forward: weights are not loaded");
  if (T <= 0) return;
  const int64_t E = shape_.experts, K = shape_.top_k, H = shape_.hidden;
  // Every layer's forward takes the one scratch in turn (after its own lock; nothing takes them
  // the other way round), and lays out all of it anew, so a layer never sees another's sizes.
  std::lock_guard<std::mutex> scratch_lock(shared_scratch_mutex());
  Scratch& s = shared_scratch();
  // Route: tokens per expert, rows grouped by expert in token order.
  s.count.assign(size_t(E), 0);
  for (int64_t i = 0; i < T * K; ++i) {
    const int64_t e = ids[i];
    if (e >= 0 && e < E && !(mask && mask[e])) ++s.count[size_t(e)];
  }
  s.active.clear();
  s.offset.assign(size_t(E), 0);
  int64_t rows = 0, max_count = 0;
  for (int64_t e = 0; e < E; ++e) {
    s.offset[size_t(e)] = rows;
    if (s.count[size_t(e)]) s.active.push_back(int(e));
    rows += s.count[size_t(e)];
    max_count = std::max(max_count, s.count[size_t(e)]);
  }
  if (rows == 0) {
    std::memset(out, 0, size_t(T * H) * 4);
    return;
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
  s.x = x;
  // Activations: int8 rows for the integer formats, fp32 rows for bf16/fp8 weights.
  const bool float_act =
      format_ == WeightFormat::bf16 || format_ == WeightFormat::fp8 || is_mx_format(format_);
  s.lda_x = unaliased_stride(H * (float_act ? 4 : 1));
  s.p_stride = unaliased_stride(H * 4) / 4;
  // Kernel choice is by tokens per expert: when every expert fits one decode tile, gate/up
  // threads quantize the few rows they read themselves and the shared quantize phases go.
  s.decode = max_count <= shards_[0].gu_kernels.max_rows;
  const int P = pool.pools(), S = num_shards();
  s.pools.resize(size_t(P));
  const GemmKernelSet& gu0 = shards_[0].gu_kernels;  // (every shard's gate/up: the same K, tiers)
  s.gu_bf16 = !s.decode && float_act && pair_tier_whole(gu0, H, gu0.tile_min_rows);
  if (s.gu_bf16) {
    s.row_bf16.assign(size_t(rows), 0);
    for (int e : s.active)
      if (pair_tier_whole(gu0, H, s.count[size_t(e)]))
        std::fill_n(s.row_bf16.begin() + s.offset[size_t(e)], s.count[size_t(e)], uint8_t(1));
  }
  s.gsum_g = s.gsum_groups = 0;
  if (!s.decode) std::tie(s.gsum_g, s.gsum_groups) = act_sum_groups(gu0, shards_[0].gu);
  if (!s.decode)
    for (int p = 0; p < std::min(P, S); ++p) {
      auto& ps = s.pools[size_t(p)];
      ps.xq.resize(size_t(T * s.lda_x));
      ps.xs.resize(size_t(T));
      ps.xg.resize(size_t(T * s.gsum_groups));
      if (s.gu_bf16) ps.xb.resize(size_t(T * H));
    }
  s.shards.resize(size_t(S));
  for (int si = 0; si < S; ++si) prepare_shard(si, s);

  const RowQuantizer& rq = reference ? cxx_row_quantizer() : rowq_;
  pool.run_pools([&](const PoolWork& wk) {
    if (wk.pool >= S) return;  // fewer shards than pools
    if (!s.decode) {
      auto& ps = s.pools[size_t(wk.pool)];
      const bool flip = activations_unsigned(false);
      int64_t t0, t1;
      split_range(T, wk.tid, wk.nt, &t0, &t1);
      for (int64_t t = t0; t < t1; ++t) {
        quantize_act_row(rq, x + t * H, H, float_act, flip, s.lda_x, ps.xq.data() + t * s.lda_x,
                         &ps.xs[size_t(t)]);
        if (s.gu_bf16) rq.to_bf16(x + t * H, H, ps.xb.data() + t * H);
        for (int64_t g = 0; g < s.gsum_groups; ++g)  // (each token once, not once per expert)
          ps.xg[size_t(t * s.gsum_groups + g)] =
              row_sum_i8(ps.xq.data() + t * s.lda_x + g * s.gsum_g, s.gsum_g);
      }
      wk.barrier();  // forward_shard's gate/up gathers each expert's rows from these
    }
    for (int si = wk.pool; si < S; si += wk.pools) forward_shard(si, s, reference, wk);
  });

  // Sum the shard partials in shard order into the output: a fixed order, so the result never
  // depends on the pool or thread count.
  auto merge = [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* o = out + t * H;
      std::memcpy(o, s.shards[0].partial.data() + t * s.p_stride, size_t(H) * 4);
      for (int si = 1; si < S; ++si) {
        const float* p = s.shards[size_t(si)].partial.data() + t * s.p_stride;
        for (int64_t h = 0; h < H; ++h) o[h] += p[h];
      }
    }
  };
  if (T * H * S <= (int64_t(1) << 16)) {
    merge(0, T);  // decode: cheaper than waking the pools again
  } else {
    pool.run([&](int tid, int nt) {
      int64_t t0, t1;
      split_range(T, tid, nt, &t0, &t1);
      merge(t0, t1);
    });
  }
}

// Sizes shard si's scratch for this forward and lays out its pointers and gate/up work split
// (on the caller, before the fork).
void MoELayer::prepare_shard(int si, Scratch& s) const {
  const Shard& sh = shards_[size_t(si)];
  auto& ss = s.shards[size_t(si)];
  const int64_t is = sh.i_end - sh.i_begin, rows = s.rows;
  const bool float_act =
      format_ == WeightFormat::bf16 || format_ == WeightFormat::fp8 || is_mx_format(format_);
  ss.h_stride = unaliased_stride(std::max<int64_t>(is, 1) * 4) / 4;
  ss.lda_h = unaliased_stride(std::max<int64_t>(is, 1));
  ss.h.resize(size_t(rows * ss.h_stride));
  if (!float_act) ss.hq.resize(size_t(rows * ss.lda_h));
  if (float_act)
    ss.hs.assign(size_t(rows), 1.0f);
  else
    ss.hs.resize(size_t(rows));
  ss.h_rows.resize(size_t(rows));
  ss.out_rows.resize(size_t(rows));
  ss.partial.resize(size_t(s.T * s.p_stride));
  for (int64_t r = 0; r < rows; ++r) {
    ss.h_rows[size_t(r)] = ss.h.data() + r * ss.h_stride;
    ss.out_rows[size_t(r)] = ss.partial.data() + int64_t(s.row_token[size_t(r)]) * s.p_stride;
  }
  // Gate/up work units (expert, strip), split into contiguous runs of about equal cost so each
  // thread streams one region of weights. Cost ~ bytes read + multiply work.
  const int64_t gu_strips = sh.gu.full_strips + (sh.gu.tail_vecs ? 1 : 0);
  const int64_t na = int64_t(s.active.size());
  ss.gu_cost.assign(size_t(na * gu_strips + 1), 0);
  for (int64_t ai = 0; ai < na; ++ai) {
    const int64_t m = s.count[size_t(s.active[size_t(ai)])];
    for (int64_t st = 0; st < gu_strips; ++st) {
      const int64_t c = (st < sh.gu.full_strips ? sh.gu.strip_vecs : sh.gu.tail_vecs) * (m + 4);
      ss.gu_cost[size_t(ai * gu_strips + st + 1)] = ss.gu_cost[size_t(ai * gu_strips + st)] + c;
    }
  }
}

// Shard si on the threads of the pool that owns it (see forward() for the phase plan).
void MoELayer::forward_shard(int si, Scratch& s, bool reference, const PoolWork& wk) {
  const Shard& sh = shards_[size_t(si)];
  auto& ss = s.shards[size_t(si)];
  const int64_t is = sh.i_end - sh.i_begin, rows = s.rows, H = shape_.hidden;
  const bool flip = activations_unsigned(false), flip_h = activations_unsigned(true);
  const bool float_act =
      format_ == WeightFormat::bf16 || format_ == WeightFormat::fp8 || is_mx_format(format_);
  const int tid = wk.tid, nt = wk.nt;
  const RowQuantizer& rq = reference ? cxx_row_quantizer() : rowq_;
  {  // this shard's partial starts at zero; down accumulates into it after a barrier
    int64_t t0, t1;
    split_range(s.T, tid, nt, &t0, &t1);
    if (t1 > t0)
      std::memset(ss.partial.data() + t0 * s.p_stride, 0, size_t((t1 - t0) * s.p_stride) * 4);
  }
  // An expert's packed gate/up and down matrices (down follows gate/up).
  auto gu_w = [&](int64_t e) { return sh.weights.as<int8_t>() + e * sh.expert_bytes; };
  auto down_w = [&](int64_t e) { return gu_w(e) + sh.gu.total_bytes(); };
  // This thread's run of down strips (the down phase below).
  const int64_t down_strips = sh.down.full_strips + (sh.down.tail_vecs ? 1 : 0);
  int64_t down_st0, down_st1;
  split_range(down_strips, tid, nt, &down_st0, &down_st1);
  // Phase: gate+up with the SiLU*up epilogue into h.
  const int64_t gu_strips = sh.gu.full_strips + (sh.gu.tail_vecs ? 1 : 0);
  const int64_t total_cost = ss.gu_cost.back();
  const int64_t c0 = total_cost * tid / nt, c1 = total_cost * (tid + 1) / nt;
  const int64_t u0 =
      std::lower_bound(ss.gu_cost.begin(), ss.gu_cost.end(), c0) - ss.gu_cost.begin();
  const int64_t u1 =
      std::lower_bound(ss.gu_cost.begin(), ss.gu_cost.end(), c1) - ss.gu_cost.begin();
  // Decode: the rows of the experts this thread reads, quantized here (a thread-local buffer, so
  // it lands on the thread's node).
  static thread_local std::vector<int8_t> own_q;
  static thread_local std::vector<float> own_s;
  static thread_local HugeVector<int8_t> own_rows;  // (prefill, below: 64-byte aligned)
  static thread_local std::vector<int32_t> own_g;
  const auto* pool_s = s.decode ? nullptr : &s.pools[size_t(wk.pool)];
  for (int64_t u = u0; u < u1;) {
    const int64_t ai = u / gu_strips, st0 = u % gu_strips;
    const int64_t st1 = std::min(gu_strips, st0 + (u1 - u));
    const int64_t e = s.active[size_t(ai)];
    const int64_t row0 = s.offset[size_t(e)], m = s.count[size_t(e)];
    const int8_t* a;
    const float* a_scale;
    const uint16_t* a_bf16 = nullptr;
    const int32_t* a_gsum = nullptr;
    if (pool_s) {
      // Prefill: this expert's rows, gathered from the pool's tokens (quantized, or rounded to
      // bf16, once each) into a thread-local buffer right before its gate/up call, so its tiles
      // find them in L1/L2. A gather phase into a T*K-row buffer left them to the weight stream,
      // which evicted them before their expert ran (Qwen3 INT8 at T = 256 1.2-1.5 % slower).
      const bool bf = s.gu_bf16 && s.row_bf16[size_t(row0)];
      own_rows.resize(size_t(m * std::max(s.lda_x, 2 * H)));
      own_s.resize(size_t(m));
      auto* ob = reinterpret_cast<uint16_t*>(own_rows.data());
      for (int64_t i = 0; i < m; ++i) {
        const int64_t t = s.row_token[size_t(row0 + i)];
        if (bf)
          std::memcpy(ob + i * H, pool_s->xb.data() + t * H, size_t(H) * 2);
        else
          std::memcpy(own_rows.data() + i * s.lda_x, pool_s->xq.data() + t * s.lda_x,
                      size_t(s.lda_x));
        own_s[size_t(i)] = pool_s->xs[size_t(t)];
      }
      a = own_rows.data();
      a_scale = own_s.data();
      if (bf) a_bf16 = ob;
      if (s.gsum_groups) {  // the tokens' sums, [g][row] as GemmArgs::a_gsum
        own_g.resize(size_t(m * s.gsum_groups));
        for (int64_t i = 0; i < m; ++i) {
          const int32_t* tg = pool_s->xg.data() + s.row_token[size_t(row0 + i)] * s.gsum_groups;
          for (int64_t g = 0; g < s.gsum_groups; ++g) own_g[size_t(g * m + i)] = tg[g];
        }
        a_gsum = own_g.data();
      }
    } else {
      own_q.resize(size_t(m * s.lda_x));
      own_s.resize(size_t(m));
      for (int64_t i = 0; i < m; ++i)
        quantize_act_row(rq, s.x + int64_t(s.row_token[size_t(row0 + i)]) * H, H, float_act, flip,
                         s.lda_x, own_q.data() + i * s.lda_x, &own_s[size_t(i)]);
      a = own_q.data();
      a_scale = own_s.data();
    }
    // What this thread reads next: the next expert's first gate/up strip, or after its last one
    // its first down strip (the down phase follows the barrier).
    const int8_t* next = nullptr;
    if (const int64_t nu = u + (st1 - st0); nu < u1)
      next = gu_w(s.active[size_t(nu / gu_strips)]) + sh.gu.strip_offset(nu % gu_strips);
    else if (down_st1 > down_st0 && !s.active.empty())
      next = down_w(s.active[0]) + sh.down.strip_offset(down_st0);
    run_gemm(sh.gu_kernels, sh.gu, reference, gu_w(e), sh.scales.as<float>() + e * sh.expert_cols,
             sh.comps.as<int32_t>() + e * sh.expert_cols, st0, st1, a, s.lda_x, a_scale, m,
             ss.h_rows.data() + row0, 0, nullptr,
             sh.expert_gscale ? sh.gscales.as<float>() + e * sh.expert_gscale : nullptr, next,
             a_bf16, a_gsum);
    u += st1 - st0;
  }
  wk.barrier();
  // Phase (integer formats): quantize the intermediate of every (expert, token) row over this
  // shard's slice of I. bf16/fp8 weights take the fp32 intermediate as it is.
  if (!float_act) {
    int64_t r0, r1;
    split_range(rows, tid, nt, &r0, &r1);
    for (int64_t r = r0; r < r1; ++r)
      quantize_act_row(rq, ss.h.data() + r * ss.h_stride, is, false, flip_h, ss.lda_h,
                       ss.hq.data() + r * ss.lda_h, &ss.hs[size_t(r)]);
    wk.barrier();
  }
  const int8_t* down_a = float_act ? reinterpret_cast<const int8_t*>(ss.h.data()) : ss.hq.data();
  const int64_t down_lda = float_act ? ss.h_stride * 4 : ss.lda_h;
  // Phase: down projection; each thread owns a run of output strips and adds the experts into
  // them in ascending expert order, so the sum order never depends on the thread count.
  const int64_t st0 = down_st0, st1 = down_st1;
  if (st0 >= st1) return;
  for (size_t ai = 0; ai < s.active.size(); ++ai) {
    const int e = s.active[ai];
    const int64_t row0 = s.offset[size_t(e)], m = s.count[size_t(e)];
    const int8_t* next =
        ai + 1 < s.active.size() ? down_w(s.active[ai + 1]) + sh.down.strip_offset(st0) : nullptr;
    run_gemm(sh.down_kernels, sh.down, reference, down_w(e),
             sh.scales.as<float>() + int64_t(e) * sh.expert_cols + sh.gu.total_cols(),
             sh.comps.as<int32_t>() + int64_t(e) * sh.expert_cols + sh.gu.total_cols(), st0, st1,
             down_a + row0 * down_lda, down_lda, ss.hs.data() + row0, m, ss.out_rows.data() + row0,
             0, s.row_weight.data() + row0,
             sh.expert_gscale
                 ? sh.gscales.as<float>() + int64_t(e) * sh.expert_gscale + sh.gu.gscale_floats()
                 : nullptr,
             next);
  }
}

// MXFP4 / MXFP8: the checkpoint bytes are in the strips as they were (MXFP4: 4-byte chunks of
// 8 nibbles per column, MXFP8: one byte per k), and so are the exponents (MXFP8: stored + 8).
void MoELayer::write_expert_mx(int64_t slot, int tp, int rank, uint8_t* w13, uint8_t* w13_scale,
                               uint8_t* w2, uint8_t* w2_scale) const {
  const int64_t H = shape_.hidden, I = shape_.intermediate;
  check_write_args(slot, tp, rank, 32);  // whole scale groups per rank
  if (!w13_scale || !w2_scale)
    throw std::invalid_argument("write_weight_scale_to_buffer: " + method_ +
                                " needs scale pointers");
  const bool fp4 = format_ == WeightFormat::mxfp4;
  const int64_t ir = I / tp, i0 = int64_t(rank) * ir, i1 = i0 + ir;
  // Row r (source src) of layout l: k in [k0, k1) (whole groups) into out (bytes) and its
  // exponents into es. Per group: `cols` exponent bytes, then the group's weights.
  auto row = [&](const formats::StripLayout& l, const uint8_t* wb, int src, int64_t r, int64_t k0,
                 int64_t k1, uint8_t* out, uint8_t* es) {
    int64_t strip;
    int col, cols;
    formats::packed_column_of(l, src, r, &strip, &col, &cols);
    const int64_t group_bytes = cols + 32 * cols / (fp4 ? 2 : 1);
    for (int64_t g = k0 / 32; g < k1 / 32; ++g) {
      const uint8_t* gb = wb + l.strip_offset(strip) + g * group_bytes;
      es[g - k0 / 32] = uint8_t(gb[col] - (fp4 ? 0 : 8));
      uint8_t* o = out + (g * 32 - k0) / (fp4 ? 2 : 1);
      if (fp4)
        for (int64_t b = 0; b < 4; ++b) std::memcpy(o + b * 4, gb + cols + (b * cols + col) * 4, 4);
      else
        for (int64_t k = 0; k < 32; ++k) o[k] = gb[cols + k * cols + col];
    }
  };
  const int64_t hb = fp4 ? H / 2 : H, irb = fp4 ? ir / 2 : ir;  // row bytes of w13 and w2
  for (const Shard& sh : shards_) {
    const int64_t a = std::max(i0, sh.i_begin), b = std::min(i1, sh.i_end);
    if (a >= b) continue;
    const uint8_t* wb = sh.weights.as<uint8_t>() + slot * sh.expert_bytes;
    for (int src = 0; src < 2; ++src)  // gate rows, then up rows
      for (int64_t r = a; r < b; ++r) {
        const int64_t o = src * ir + r - i0;
        row(sh.gu, wb, src, r - sh.i_begin, 0, H, w13 + o * hb, w13_scale + o * (H / 32));
      }
    for (int64_t h = 0; h < H; ++h)
      row(sh.down, wb + sh.gu.total_bytes(), 0, h, a - sh.i_begin, b - sh.i_begin,
          w2 + h * irb + (fp4 ? (a - i0) / 2 : a - i0), w2_scale + h * (ir / 32) + (a - i0) / 32);
  }
}

void MoELayer::check_write_args(int64_t slot, int tp, int rank, int64_t multiple) const {
  const int64_t E = shape_.experts, I = shape_.intermediate;
  if (!loaded_) throw std::runtime_error("write_weight_scale_to_buffer: weights are not loaded");
  if (slot < 0 || slot >= E)
    throw std::invalid_argument("expert_id: expected a value in [0, " + std::to_string(E) +
                                "), got " + std::to_string(slot));
  if (tp < 1 || I % tp != 0 || (I / tp) % multiple != 0)
    throw std::invalid_argument(
        "gpu_tp_count: " + method_ +
        (multiple > 1 ? " needs I / gpu_tp_count to be a multiple of " + std::to_string(multiple)
                      : std::string(" needs a divisor of the intermediate size")) +
        " (I = " + std::to_string(I) + "), got " + std::to_string(tp));
  if (rank < 0 || rank >= tp)
    throw std::invalid_argument("rank: expected a value in [0, " + std::to_string(tp) + ")");
}

// RAWINT4 / GPTQ_INT4: the codes and fp32 group scales come back out of the qgroup strips
// (formats::unpack_qgroup_row) and are re-encoded as the checkpoint stored them.
void MoELayer::write_expert_qgroup(int64_t slot, int tp, int rank, uint8_t* w13,
                                   uint16_t* w13_scale, uint8_t* w2, uint16_t* w2_scale) const {
  const bool gptq = method_ == "GPTQ_INT4";
  if (!gptq && method_ != "RAWINT4")
    throw std::invalid_argument("write_weight_scale_to_buffer: method " + method_ +
                                " keeps GGUF blocks, which have no GPU buffer encoding in "
                                "kt-kernel's contract (supported: RAWINT4, GPTQ_INT4 among the "
                                "k-group methods)");
  const int64_t gd = qg_down_.group, gg = qg_gu_.group;
  check_write_args(slot, tp, rank, gptq ? std::max<int64_t>(gd, 8) : gd);
  if (!w13_scale || !w2_scale)
    throw std::invalid_argument("write_weight_scale_to_buffer: " + method_ +
                                " needs scale pointers");
  const int64_t H = shape_.hidden, I = shape_.intermediate;
  const int64_t ir = I / tp, i0 = int64_t(rank) * ir, i1 = i0 + ir;
  auto scale_bits = [&](float f) {
    return gptq ? formats::f32_to_f16(f) : formats::f32_to_bf16(f);
  };
  std::vector<int8_t> codes(size_t(std::max(H, I)));
  std::vector<float> sc(size_t(std::max(H, I)));
  // One matrix row (n = output feature `o` of `n_out`) of codes [k0, k1) whose first element
  // lands at input index `kout` of the written matrix (K_out inputs per row).
  auto put = [&](uint8_t* wout, uint16_t* sout, int64_t o, int64_t n_out, int64_t kout,
                 int64_t k_out, int64_t len, int64_t group) {
    for (int64_t k = 0; k < len; ++k) {
      const uint8_t nib = uint8_t(codes[size_t(k)] + 8);
      const int64_t kk = kout + k;
      // RAWINT4: row-major [n, K/2] bytes; GPTQ: int32 [K/8, n], nibble kk % 8 of word kk / 8.
      const int64_t byte =
          gptq ? ((kk / 8) * n_out + o) * 4 + (kk % 8) / 2 : o * (k_out / 2) + kk / 2;
      const int shift = (kk % 2) * 4;
      wout[byte] = uint8_t((wout[byte] & ~(0xF << shift)) | (nib << shift));
    }
    for (int64_t g = 0; g < len / group; ++g) {
      const int64_t gg_out = kout / group + g;
      sout[gptq ? gg_out * n_out + o : o * (k_out / group) + gg_out] = scale_bits(sc[size_t(g)]);
    }
  };
  for (const Shard& sh : shards_) {
    const int64_t a = std::max(i0, sh.i_begin), b = std::min(i1, sh.i_end);
    if (a >= b) continue;
    const uint8_t* wb = sh.weights.as<uint8_t>() + slot * sh.expert_bytes;
    for (int src = 0; src < 2; ++src)  // gate rows, then up rows
      for (int64_t r = a; r < b; ++r) {
        formats::unpack_qgroup_row(sh.gu, qg_gu_, wb, qg_store_offset_[0], src, r - sh.i_begin, 0,
                                   H, codes.data(), sc.data(), nullptr);
        put(w13, w13_scale, src * ir + r - i0, 2 * ir, 0, H, H, gg);
      }
    for (int64_t h = 0; h < H; ++h) {
      formats::unpack_qgroup_row(sh.down, qg_down_, wb + sh.gu.total_bytes(), qg_store_offset_[1],
                                 0, h, a - sh.i_begin, b - sh.i_begin, codes.data(), sc.data(),
                                 nullptr);
      put(w2, w2_scale, h, H, a - i0, ir, b - a, gd);
    }
  }
}

std::array<int64_t, 4> MoELayer::write_expert_bytes(int tp) const {
  const int64_t H = shape_.hidden, I = shape_.intermediate;
  if (tp < 1 || I % tp != 0)
    throw std::invalid_argument("gpu_tp_count: expected a divisor of the intermediate size " +
                                std::to_string(I) + ", got " + std::to_string(tp));
  const int64_t ir = I / tp;
  switch (format_) {
    case WeightFormat::bf16: return {2 * ir * H * 2, 0, H * ir * 2, 0};
    case WeightFormat::fp8:
      if (fp8_block_)
        return {2 * ir * H, (2 * ir / 128) * ((H + 127) / 128) * 4, H * ir,
                ((H + 127) / 128) * (ir / 128) * 4};
      return {2 * ir * H, 2 * ir * 4, H * ir, H * 4};
    case WeightFormat::mxfp4: return {2 * ir * H / 2, 2 * ir * H / 32, H * ir / 2, H * ir / 32};
    case WeightFormat::mxfp8: return {2 * ir * H, 2 * ir * H / 32, H * ir, H * ir / 32};
    case WeightFormat::qgroup:
      if (method_ == "RAWINT4" || method_ == "GPTQ_INT4")
        return {2 * ir * H / 2, 2 * ir * (H / qg_gu_.group) * 2, H * ir / 2,
                H * (ir / qg_down_.group) * 2};
      break;
    default: break;
  }
  throw std::invalid_argument("write_weight_scale_to_buffer: method " + method_ +
                              " has no checkpoint encoding to write back");
}

void MoELayer::write_expert(int64_t slot, int tp, int rank, void* w13, float* w13_scale, void* w2,
                            float* w2_scale) const {
  const int64_t H = shape_.hidden, I = shape_.intermediate;
  if (format_ == WeightFormat::qgroup) {
    write_expert_qgroup(slot, tp, rank, static_cast<uint8_t*>(w13),
                        reinterpret_cast<uint16_t*>(w13_scale), static_cast<uint8_t*>(w2),
                        reinterpret_cast<uint16_t*>(w2_scale));
    return;
  }
  if (is_mx_format(format_)) {
    write_expert_mx(slot, tp, rank, static_cast<uint8_t*>(w13),
                    reinterpret_cast<uint8_t*>(w13_scale), static_cast<uint8_t*>(w2),
                    reinterpret_cast<uint8_t*>(w2_scale));
    return;
  }
  if (format_ != WeightFormat::bf16 && format_ != WeightFormat::fp8)
    throw std::invalid_argument("write_weight_scale_to_buffer: method " + method_ +
                                " is not a native checkpoint format (BF16, FP8, FP8_PERCHANNEL)");
  check_write_args(slot, tp, rank, 1);
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
      return table[strip * l.gscale_floats_per_strip() + l.gscale_index(g, half)];
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
