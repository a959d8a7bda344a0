// One MoE layer on the CPU: packed weights per shard, the kernels chosen for them, and the
// forward executor (route -> quantize once per token -> gate+up with SiLU*up -> quantize ->
// down with routing-weight accumulate -> shards summed in a fixed order).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "formats/grouped.hpp"
#include "formats/int8.hpp"
#include "jit/cpu/cpu.hpp"
#include "jit/gemm.hpp"
#include "jit/kernel.hpp"
#include "runtime/row_quant.hpp"
#include "runtime/thread_pool.hpp"

namespace ktjit {

enum class SourceDType { f32, bf16, f16 };
SourceDType parse_source_dtype(const std::string& s);

struct MoEShape {
  int64_t experts = 0, top_k = 0, hidden = 0, intermediate = 0;
};

// 64-byte aligned, huge-page advised buffer.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(size_t bytes);
  AlignedBuffer(AlignedBuffer&& o) noexcept : p_(o.p_), n_(o.n_) {
    o.p_ = nullptr;
    o.n_ = 0;
  }
  AlignedBuffer& operator=(AlignedBuffer&& o) noexcept;
  ~AlignedBuffer();
  template <class T>
  T* as() const {
    return static_cast<T*>(p_);
  }
  size_t size() const { return n_; }

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
};

// Kernels of one matrix kind (gate/up or down) at one ISA: decode kernels for m_r = 1..max rows,
// a prefill kernel at max rows, each for full and tail strips.
struct GemmKernelSet {
  IsaLevel isa = IsaLevel::ref;
  Epilogue epilogue = Epilogue::store;
  int max_rows = 1;
  std::vector<KernelKey> decode_full, decode_tail;  // index m_r - 1
  KernelKey prefill_full, prefill_tail;
  std::vector<const Kernel*> decode_full_k, decode_tail_k;
  const Kernel* prefill_full_k = nullptr;
  const Kernel* prefill_tail_k = nullptr;
  // A prefill tier before the kernels above for experts with m >= tile_min_rows rows: it takes
  // the first floor(m / tile_rows) * tile_rows rows, or all of them where its kernels run the rows
  // after their blocks too (tile_tier_split); the remaining rows, and experts with fewer rows, take
  // the kernels above. tile_rows 0 = none. At isa amx: AMX-INT8 (int8) / AMX-BF16
  // (bf16) tiles of 16 rows. At avx512_bf16 and up, bf16: the kBf16Pairs (vdpbf16ps) kernels,
  // max_rows rows a block (bf16 activations, jit/gemm.hpp); at neon_bf16 the bfdot ones.
  int tile_rows = 0, tile_min_rows = 0;
  KernelKey tile_full, tile_tail;
  const Kernel* tile_full_k = nullptr;
  const Kernel* tile_tail_k = nullptr;
  std::vector<KernelKey> keys() const;  // distinct keys, decode first
};

// Methods with generated kernels and their weight format; throws std::invalid_argument naming the
// built methods for any other name.
WeightFormat method_format(const std::string& method);
const char* built_methods();

// The kernel keys (not yet generated) an integer layer of this shape uses at `isa`.
// `variant`: the keys' KernelKey::variant (mx gate/up: kSwigluClamp | kSwigluAlpha).
// `k_pairs`: K and the scale group split into k pairs (both even), which fp8 decode at
// avx512_bf16 needs for its kBf16Pairs kernels of 1-4 rows (jit/gemm.hpp fp8_pair_kernel).
GemmKernelSet make_gemm_kernel_set(IsaLevel isa, WeightFormat fmt, Epilogue epi, int tail_vecs,
                                   uint16_t variant = 0, bool k_pairs = false);
std::vector<KernelKey> moe_kernel_keys(const MoEShape& shape, WeightFormat fmt, IsaLevel isa);
// The tile tier's call over an expert's `rows` rows (>= ks.tile_min_rows): its blocks of
// ks.tile_rows and the rows after them that the same call runs (GemmArgs::m_tail). Kernels that
// take those rows (tail_rows_kernel) split as prefill_split does: the BF16 pair tiles run 13-23
// rows after their 12-row blocks as two halves (over 4-vector strips, 6-row blocks: a last row of
// 6 k + 1 with the last block as a 4-row and a 3-row tile). `padded`: the last block padded
// with zero rows (the pair tiers of isa amx and neon_bf16), else the rows after the blocks are
// left to the kernels above.
PrefillSplit tile_tier_split(const GemmKernelSet& ks, int64_t rows, bool padded);

// A slice [i_begin, i_end) of the intermediate dimension of every expert (the unit a NUMA pool
// owns). Gate/up of one expert are packed together, down follows; experts are back to back.
struct Shard {
  int64_t i_begin = 0, i_end = 0;
  formats::StripLayout gu, down;
  AlignedBuffer weights;  // per expert: gu bytes then down bytes
  AlignedBuffer scales;   // per expert: gu cols then down cols (float)
  AlignedBuffer comps;    // per expert: gu cols then down cols (int32)
  int64_t expert_bytes = 0, expert_cols = 0;
  AlignedBuffer gscales;      // fp8: per expert, gu then down group-scale tables
  int64_t expert_gscale = 0;  // floats per expert in gscales
  GemmKernelSet gu_kernels, down_kernels;
};

class MoELayer {
 public:
  // method: one of built_methods(). isa: a level to run at (<= selected_isa()).
  MoELayer(const MoEShape& shape, const std::string& method, IsaLevel isa, int shards = 1);
  // Shards with explicit bounds [b0 = 0, b1, ..., bn = I) of the intermediate dimension (e.g. the
  // parts of a checkpoint quantized per NUMA part).
  MoELayer(const MoEShape& shape, const std::string& method, IsaLevel isa,
           const std::vector<int64_t>& shard_bounds);
  // k-group scaled integer methods (LLAMAFILE, RAWINT4, GPTQ_INT4: WeightFormat::qgroup): how
  // gate/up and down are stored (formats/grouped.hpp). shard_bounds empty = one shard; bounds
  // must be multiples of down.group (down's K is I); H must be a multiple of gu.group and I of
  // down.group. Throws std::invalid_argument otherwise.
  MoELayer(const MoEShape& shape, const std::string& method, IsaLevel isa,
           const std::vector<int64_t>& shard_bounds, const formats::GroupedSpec& gu,
           const formats::GroupedSpec& down);
  // Even shard bounds on multiples of down's unit (formats::qgroup_unit: its super block or
  // group; formats::qgroup_shard_bounds).
  static std::vector<int64_t> grouped_shard_bounds(int64_t intermediate, int64_t down_unit,
                                                   int shards);
  ~MoELayer();

  // gate/up [E, I, H], down [E, H, I] in `dtype`; map[p] = logical expert held by slot p (or null).
  void load_from_float(const void* gate, const void* up, const void* down, SourceDType dtype,
                       const int64_t* map, ThreadPool& pool);
  // One expert's source rows: gate and up [I, H], down [H, I], row-major in the load's dtype.
  struct ExpertSource {
    int64_t slot;
    const void* gate;
    const void* up;
    const void* down;
  };
  // Packs the given experts (in parallel) into their physical slots; the layer is loaded once
  // every slot has been. Loaders hand memory-mapped checkpoint data here without stacking it.
  void load_experts(const std::vector<ExpertSource>& experts, SourceDType dtype, ThreadPool& pool);

  // Already quantized experts of one shard (integer methods): the int8 values the kernels
  // multiply (for INT4 the values 16 * q4) and the per-row fp32 scales — gate and up [is, H] with
  // [is] scales, down [H, is] with [H] scales, is = the shard's slice of I. Packed as they are:
  // no re-quantization, so a converted checkpoint keeps its exact numbers.
  struct QuantExpertSource {
    int64_t slot;
    const int8_t *q_gate, *q_up, *q_down;
    const float *d_gate, *d_up, *d_down;
  };
  void load_experts_quantized(int shard, const std::vector<QuantExpertSource>& experts,
                              ThreadPool& pool);
  // fp8 experts (FP8: 128x128 block scales [ceil(N/128), ceil(K/128)] per matrix;
  // FP8_PERCHANNEL: row scales [N]): e4m3 bytes gate/up [I, H], down [H, I], row-major.
  struct Fp8ExpertSource {
    int64_t slot;
    const uint8_t *gate, *up, *down;
    const float *gate_scale, *up_scale, *down_scale;
  };
  void load_experts_fp8(const std::vector<Fp8ExpertSource>& experts, ThreadPool& pool);
  // qgroup experts: full matrices gate/up [I, H], down [H, I] (the layer slices them per shard:
  // rows of gate/up, group-aligned columns of down) packed in parallel. Groups must match the
  // layer's specs; 4-bit layers need every code in the table (else std::invalid_argument naming
  // the expert, matrix, row and column). A null `biases` under a bias spec counts as zeros.
  struct GroupedExpertSource {
    int64_t slot;
    formats::GroupedMatrix gate, up, down;
  };
  void load_experts_grouped(const std::vector<GroupedExpertSource>& experts, ThreadPool& pool);
  const formats::GroupedSpec& grouped_spec(bool down) const { return down ? qg_down_ : qg_gu_; }
  // Whether the int8 activations of gate/up (down: of down) are stored as a + 128 (XOR 0x80):
  // at VNNI levels (their unsigned operand) and for qgroup int32 super-block folds.
  bool activations_unsigned(bool down) const {
    return gemm_activation_offset(isa_, format_) ||
           (format_ == WeightFormat::qgroup && (down ? qg_down_ : qg_gu_).int_fold);
  }
  // MXFP4 / MXFP8 experts (formats/mx.hpp), row-major checkpoint bytes: gate/up [I, H/2] (MXFP4)
  // or [I, H] (MXFP8), down [H, I/2] or [H, I]; ue8m0 scales gate/up [I, H/32], down [H, I/32].
  // An exponent of 255 (NaN), or >= 247 for MXFP8, is refused (std::invalid_argument).
  struct MxExpertSource {
    int64_t slot;
    const uint8_t *gate, *up, *down;
    const uint8_t *gate_scale, *up_scale, *down_scale;
  };
  void load_experts_mx(const std::vector<MxExpertSource>& experts, ThreadPool& pool);
  // MXFP4 / MXFP8 only (SPEC §4): limit L > 0 clamps g = min(g, L), u = clamp(u, -L, L) before
  // SiLU; alpha > 0 computes g * sigmoid(alpha * g) * (u + 1) (g clamped to [-L, L] too when
  // L > 0). 0 turns either off. Other methods accept only zeros. Rebuilds the gate/up kernels.
  void set_swiglu(float limit, float alpha);
  float swiglu_limit() const { return swiglu_limit_; }
  float swiglu_alpha() const { return swiglu_alpha_; }
  // Writes expert `slot` back in its checkpoint encoding for GPU rank `rank` of `tp` (SGLang's
  // write_weight_scale_to_buffer): w13 = [gate rows; up rows] of the rank's I/tp slice ([2*I/tp,
  // H]), w2 = the rank's column slice of down ([H, I/tp]). BF16: bf16 bytes, no scales. FP8: e4m3
  // bytes and fp32 block scales [2*I/tp/128, ceil(H/128)] and [ceil(H/128), I/tp/128];
  // FP8_PERCHANNEL: fp32 row scales [2*I/tp] and [H]. MXFP4 / MXFP8: the checkpoint bytes
  // ([2*I/tp, H/2 or H], [H, I/tp/2 or I/tp]) and ue8m0 scale bytes ([2*I/tp, H/32],
  // [H, I/tp/32]) through the same pointers. Read from the packed weights (no copy of
  // the checkpoint is kept). RAWINT4: compressed-tensors bytes (byte k/2, low nibble = even k,
  // nibble = code + 8) [2*I/tp, H/2] and [H, I/tp/2], bf16 group scales [2*I/tp, H/g] and
  // [H, I/tp/g]. GPTQ_INT4: AutoGPTQ qweight int32 (nibble j of word r = input 8r + j, nibble =
  // code + 8) [H/8, 2*I/tp] and [I/tp/8, H], fp16 scales [H/g, 2*I/tp] and [I/tp/g, H] (the
  // symmetric zero point is implied). LLAMAFILE keeps GGUF blocks and is refused.
  void write_expert(int64_t slot, int tp, int rank, void* w13, float* w13_scale, void* w2,
                    float* w2_scale) const;
  // Bytes write_expert writes through each pointer (w13, w13_scale, w2, w2_scale) for `tp` ranks;
  // throws like write_expert for a method or tp it refuses.
  std::array<int64_t, 4> write_expert_bytes(int tp) const;
  int num_shards() const { return int(shards_.size()); }
  std::pair<int64_t, int64_t> shard_range(int s) const {
    return {shards_[size_t(s)].i_begin, shards_[size_t(s)].i_end};
  }
  bool loaded() const { return loaded_; }

  // x fp32 [T, H]; ids int64 [T, K]; w fp32 [T, K]; mask bool [E] or null; out fp32 [T, H].
  void forward(int64_t T, const float* x, const int64_t* ids, const float* w, const bool* mask,
               float* out, ThreadPool& pool, bool reference = false);

  IsaLevel isa() const { return isa_; }
  const MoEShape& shape() const { return shape_; }
  std::vector<std::string> kernel_names() const;
  // bytes the layer stores for its experts: packed weights, column scales and compensations, and
  // the fp8 group-scale tables (all of which a forward streams)
  size_t packed_bytes() const;

 private:
  struct Scratch;
  void build_kernels();
  void run_gemm(const GemmKernelSet& ks, const formats::StripLayout& layout, bool reference,
                const int8_t* w, const float* scale, const int32_t* comp, int64_t strip_begin,
                int64_t strip_end, const int8_t* a, int64_t lda, const float* a_scale, int64_t rows,
                float* const* out_rows, int64_t out_col0, const float* row_weight,
                const float* gscale, const int8_t* pf_last = nullptr,
                const uint16_t* a_bf16 = nullptr, const int32_t* a_gsum = nullptr) const;
  // The activation sums run_gemm's kernels take (GemmArgs::a_gsum: qgroup's per-group sums, the
  // int16-sum int4 levels' one group over K): their group length and count for `layout` (0: the
  // kernels take none).
  std::pair<int64_t, int64_t> act_sum_groups(const GemmKernelSet& ks,
                                             const formats::StripLayout& layout) const;
  // Whether calls of `rows` rows of this kernel set run the vdpbf16ps / AMX-BF16 pair tier (bf16
  // activations, K even), and whether they run it with all their rows and no padding: the calls
  // that can take their rows already in bf16 (run_gemm's a_bf16).
  static bool pair_tier(const GemmKernelSet& ks, int64_t k, int64_t rows);
  static bool pair_tier_whole(const GemmKernelSet& ks, int64_t k, int64_t rows) {
    return pair_tier(ks, k, rows) && tail_rows_kernel(ks.tile_full);
  }
  MoELayer(const MoEShape& shape, const std::string& method, IsaLevel isa,
           const std::vector<int64_t>& shard_bounds, const formats::GroupedSpec* gu,
           const formats::GroupedSpec* down);
  void prepare_shard(int si, Scratch& s) const;
  void write_expert_mx(int64_t slot, int tp, int rank, uint8_t* w13, uint8_t* w13_scale,
                       uint8_t* w2, uint8_t* w2_scale) const;
  void write_expert_qgroup(int64_t slot, int tp, int rank, uint8_t* w13, uint16_t* w13_scale,
                           uint8_t* w2, uint16_t* w2_scale) const;
  void check_write_args(int64_t slot, int tp, int rank, int64_t multiple) const;
  void forward_shard(int si, Scratch& s, bool reference, const PoolWork& wk);

  MoEShape shape_;
  std::string method_;
  WeightFormat format_;
  bool fp8_block_ = false;  // FP8 (128x128 blocks) vs FP8_PERCHANNEL (row scales)
  float swiglu_limit_ = 0.0f, swiglu_alpha_ = 0.0f;  // MXFP4 / MXFP8 (set_swiglu)
  uint8_t swiglu_variant() const {
    return uint8_t((swiglu_limit_ > 0.0f ? kSwigluClamp : 0) |
                   (swiglu_alpha_ > 0.0f ? kSwigluAlpha : 0));
  }
  formats::GroupedSpec qg_gu_, qg_down_;   // qgroup: gate/up and down storage
  alignas(16) int8_t qg_lut_[2][16] = {};  // qgroup: the kernels' tables (gate/up, down)
  // qgroup: what the packed byte codes and the tables hold beyond the code (gate/up, down): 128
  // at VNNI levels, c0 for offset codes (qgroup_store_offset in moe_layer.cpp), else 0
  int qg_store_offset_[2] = {0, 0};
  // qgroup at avx2: super-block folds (int32 or int16-lane) where the codes allow them, unless
  // KT_JIT_QGROUP_FOLDS=0
  bool qg_folds_ = false;
  bool qg_psums_ = false;  // fp32 super-block partials (VNNI levels, jit/kernel.hpp)
  RowQuantizer rowq_;      // activation rows to int8 (build_kernels)
  IsaLevel isa_;
  int lanes_;
  std::vector<Shard> shards_;
  bool loaded_ = false;
  std::vector<uint8_t> slot_loaded_;  // [shard][slot]
  // Allocates every shard's packed buffers once; with `pool`, binds shard s's pages to the node of
  // pool s % pools (they are placed at first touch, by that pool's packing threads).
  void ensure_allocated(ThreadPool* pool = nullptr);
  void mark_loaded(int shard, int64_t slot);
  // The forward's working memory is one per process, not one per layer (moe_layer.cpp
  // shared_scratch): a model's layers run one after another, and per-layer buffers sized by the
  // largest batch each had seen held hundreds of MB a layer at long prefill chunks.
  static Scratch& shared_scratch();
  static std::mutex& shared_scratch_mutex();
  std::mutex mu_;
};

using GroupedExpertSource = MoELayer::GroupedExpertSource;

}  // namespace ktjit
