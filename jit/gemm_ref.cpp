// Plain C++ twin of the generated INT8 kernels. Every rounding point mirrors the generated code:
// fmaf where the kernel uses an FMA, separate multiplies where it multiplies. Built with
// -ffp-contract=off so the compiler does not fuse on its own.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "formats/convert.hpp"
#include "formats/grouped.hpp"
#include "formats/int8.hpp"
#include "formats/mx.hpp"
#include "jit/amx_model.hpp"
#include "jit/bits.hpp"
#include "jit/gemm.hpp"

namespace ktjit {

float vdpbf16ps_lane(float acc, uint32_t a, uint32_t b) {
  auto daz = [](float x) { return std::fabs(x) < 0x1p-126f ? std::copysign(0.0f, x) : x; };
  auto bf = [&](uint32_t h) {
    const uint32_t bits = (h & 0xffffu) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return daz(f);
  };
  acc = daz(std::fma(bf(a >> 16), bf(b >> 16), daz(acc)));
  return daz(std::fma(bf(a), bf(b), acc));
}

namespace {
// BFDOT's rounding (jit/gemm.hpp bfdot_lane) from a double `d` that is the exact value, or the
// exact value rounded to odd at 53 bits (which rounds to odd at 24 bits the same way, the sticky
// bit being kept): flush below 2^-126, overflow to infinity, truncate and jam the last bit.
float bf_round_odd(double d) {
  if (std::isnan(d)) return f32_from_bits(0x7fc00000u);  // the default NaN
  if (std::isinf(d) || d == 0.0) return float(d);
  uint64_t u;
  std::memcpy(&u, &d, 8);
  const uint32_t sign = uint32_t(u >> 63) << 31;
  const int e = int((u >> 52) & 0x7ff) - 1023;
  if (e < -126) return f32_from_bits(sign);
  if (e > 127) return f32_from_bits(sign | 0x7f800000u);
  const uint64_t frac = u & ((uint64_t(1) << 52) - 1);
  const uint32_t jam = (frac & ((uint64_t(1) << 29) - 1)) ? 1 : 0;
  return f32_from_bits(sign | uint32_t(e + 127) << 23 | uint32_t(frac >> 29) | jam);
}
// x + y (fp32 values as doubles) rounded to odd at 53 bits: the RNE sum and its exact error
// (TwoSum), then truncated and jammed when inexact.
double add_round_odd53(double x, double y) {
  const double s = x + y;
  if (!std::isfinite(s) || s == 0.0) return s;  // a zero sum of fp32 values is exact
  const double bb = s - x;
  const double err = (x - (s - bb)) + (y - bb);
  if (err == 0.0) return s;
  double t = (err < 0) != (s < 0) ? std::nextafter(s, 0.0) : s;  // the truncation
  uint64_t u;
  std::memcpy(&u, &t, 8);
  u |= 1;
  std::memcpy(&t, &u, 8);
  return t;
}
}  // namespace

float bfdot_lane(float acc, uint32_t a, uint32_t b) {
  auto ftz = [](float x) { return std::fabs(x) < 0x1p-126f ? std::copysign(0.0f, x) : x; };
  auto bf = [&](uint32_t h) { return double(ftz(f32_from_bits((h & 0xffffu) << 16))); };
  // bf16 products are exact in double (16 significant bits, no double under/overflow).
  const float p0 = bf_round_odd(bf(a) * bf(b));
  const float p1 = bf_round_odd(bf(a >> 16) * bf(b >> 16));
  const float prod = bf_round_odd(add_round_odd53(p0, p1));
  return bf_round_odd(add_round_odd53(ftz(acc), prod));
}

int gemm_max_rows(IsaLevel isa, WeightFormat fmt) {
  // NEON (32 registers, 24 accumulators at most): 6 rows x 4 vectors; the widening int8/int4
  // path of plain neon needs 3 more temporaries, so 4 rows there.
  // fp8 keeps a group sum beside each accumulator (jit/aarch64/gemm_a64.cpp): 2 rows. qgroup
  // keeps an int32 group sum beside each fp32 accumulator: 3 rows with sdot, 2 on the widening
  // path (its two temporaries). mx keeps the group's scales, the rows' activations and a k's
  // decoded weights in registers: 4 rows.
  if (isa_is_neon(isa))
    return fmt == WeightFormat::qgroup                          ? (isa == IsaLevel::neon ? 2 : 3)
           : is_mx_format(fmt)                                  ? 4
           : fmt == WeightFormat::fp8                           ? 2
           : isa == IsaLevel::neon && fmt != WeightFormat::bf16 ? 4
                                                                : 6;
  // qgroup keeps an int32 group accumulator beside each fp32 accumulator: 3 rows x 4 vectors x 2
  // at VNNI levels (8 registers of scratch), 2 rows at avx512 (sign masks and |code| vectors),
  // 2 rows on AVX2's 16 registers with the fp32 accumulators on the stack.
  if (fmt == WeightFormat::qgroup)
    return isa == IsaLevel::avx2 ? 2 : int8_activation_offset(isa) ? 3 : 2;
  // mx: AVX2 keeps 2 (mxfp4: index, sign and value temporaries) or 3 (mxfp8: one temporary)
  // rows of 4 accumulators with their row broadcasts; zmm levels 6 (mxfp4's table then comes
  // from memory).
  if (fmt == WeightFormat::mxfp4) return isa == IsaLevel::avx2 ? 2 : 6;
  if (fmt == WeightFormat::mxfp8) return isa == IsaLevel::avx2 ? 3 : 6;
  // fp8 decodes need two temporaries per vector: AVX2 16 registers hold 2 rows, not 3.
  if (fmt == WeightFormat::fp8) return isa == IsaLevel::avx2 ? 2 : 6;
  // avx2 int4 (int4_int16_sums): 2 rows keep their broadcasts in registers; 3 rows (12 int16
  // sums) reload them per vector, and those loads bound the 3-row tile (about 130 against 185
  // Gop/s in L2 on Zen 3).
  if (fmt == WeightFormat::int4 && isa == IsaLevel::avx2) return 2;
  return isa == IsaLevel::avx2 ? 3 : 6;
}

int qgroup_lane_steps(const KernelKey& key) {
  return (key.variant & kQGroupLaneFold) && !(key.variant & kQGroupNibbles)
             ? formats::kQGroupByteLaneSteps
             : formats::kQGroupI16Steps;
}

namespace {
constexpr float kLog2e = 1.44269504089f;
constexpr float kC1 = 0.9999999995f, kC2 = 0.6931471805f, kC3 = 0.2402265069f, kC4 = 0.0555041087f,
                kC5 = 0.0096181291f, kC6 = 0.0013333558f;
}  // namespace

float exp_ref(float x) {
  x = x < 88.0f ? x : 88.0f;
  x = x > -87.0f ? x : -87.0f;
  const float y = x * kLog2e;
  const float i = std::nearbyint(y);
  const float f = y - i;
  float p = std::fma(kC6, f, kC5);
  p = std::fma(p, f, kC4);
  p = std::fma(p, f, kC3);
  p = std::fma(p, f, kC2);
  p = std::fma(p, f, kC1);
  const uint32_t bits = uint32_t(int32_t(i) + 127) << 23;
  float two_i;
  std::memcpy(&two_i, &bits, 4);
  return p * two_i;
}

float silu_mul_ref(float g, float u) {
  const float e = exp_ref(-g);
  const float d = e + 1.0f;
  return g / d * u;
}

float swiglu_ref(float g, float u, uint8_t v, float limit, float alpha) {
  if (v & kSwigluClamp) {  // the kernels' vminps / vmaxps: (a < b ? a : b), (a > b ? a : b)
    g = g < limit ? g : limit;
    if (v & kSwigluAlpha) g = g > -limit ? g : -limit;
    u = u > -limit ? u : -limit;
    u = u < limit ? u : limit;
  }
  if (!(v & kSwigluAlpha)) return silu_mul_ref(g, u);
  const float e = exp_ref(-(alpha * g));
  const float d = e + 1.0f;
  return g / d * (u + 1.0f);
}

namespace {

// The fp8 scale table's group records (formats::fp8_gscale_group_floats) of a kernel's layout.
int64_t gscale_group_floats(const KernelKey& key, int lanes) {
  return formats::fp8_gscale_group_floats(key.variant & kFp8PairOrder, lanes);
}
int64_t gscale_at(const KernelKey& key, int lanes, int64_t g, int half) {
  return formats::fp8_gscale_index(key.variant & kFp8PairOrder, lanes, g, half);
}
// Weight (k4 step, column n, byte j) of a packed strip with `cols` columns, as the kernel sees it:
// int8, or for int4 16 * q4 (nibbles: q4 in two's complement, or the code q4 + 8 with
// `offset_nibbles`).
int32_t packed_weight(const int8_t* strip, int64_t step, int cols, int n, int j, bool int4,
                      bool offset_nibbles) {
  const int64_t in_step = int64_t(n) * 4 + j;
  if (!int4) return strip[step * cols * 4 + in_step];
  const uint8_t b = uint8_t(strip[(step / 2) * cols * 4 + in_step]);
  const uint8_t nib = step % 2 ? b >> 4 : b & 0x0f;
  if (offset_nibbles) return 16 * (int32_t(nib) - 8);
  return int32_t(int8_t(uint8_t(nib << 4)));  // 16 * (signed nibble)
}

// The epilogue on one row's `cols` results y.
void write_out(const KernelKey& key, const GemmArgs& args, int64_t m, int64_t col0, const float* y,
               int cols) {
  float* out = args.out_rows[m] + col0;
  switch (key.epilogue) {
    case Epilogue::store:
      for (int n = 0; n < cols; ++n) out[n] = y[n];
      break;
    case Epilogue::siluup:
      if (is_mx_format(key.format) && (key.variant & (kSwigluClamp | kSwigluAlpha))) {
        for (int n = 0; n < cols / 2; ++n)
          out[n] =
              swiglu_ref(y[n], y[n + cols / 2], key.variant, args.swiglu_limit, args.swiglu_alpha);
        break;
      }
      for (int n = 0; n < cols / 2; ++n) out[n] = silu_mul_ref(y[n], y[n + cols / 2]);
      break;
    case Epilogue::accum:
      for (int n = 0; n < cols; ++n) out[n] = std::fma(args.row_weight[m], y[n], out[n]);
      break;
  }
}

// qgroup: per strip and group, the codes of g_steps K steps (bytes, or nibble pairs) then the
// columns' fp32 scales (and biases). The code a level multiplies is signed; the stored byte or
// LUT entry is XOR 0x80 on VNNI levels.
void gemm_ref_qgroup(const KernelKey& key, const GemmArgs& args) {
  const bool nib = key.variant & kQGroupNibbles, bias = key.variant & kQGroupBias;
  const int cols = key.n_vec * vec_lanes(key.isa);
  const int out_cols = gemm_strip_out_cols(key.isa, key.n_vec, key.epilogue);
  const int64_t call_rows = gemm_call_rows(key, args);
  // offset codes (kQGroupOffset): the table holds code + c0, read unsigned; c0 * s_g comes off
  // (at the VNNI levels too, instead of the + 128 there: c0 = 0 or an identity nibble table)
  const bool offset = key.variant & kQGroupOffset;
  const uint8_t flip =
      qgroup_flip_codes(key.isa) && !(key.variant & kQGroupIntFold) && !offset ? 0x80 : 0;
  const int32_t c0 = qgroup_code_offset(key);
  // two-level scales (kQGroupSuper): per super block of g_per_super groups a header of fp32
  // factors (scale, then bias, per column), each group's codes followed by int8 subs
  // 16-bit scales (kQGroupF16 / kQGroupBf16): per group fp16 / bf16 instead of fp32
  const bool super = key.variant & kQGroupSuper;
  const int half = qgroup_half_scales(key);
  // int16 group sums (kQGroupI16): per column two int16 lanes (k pairs j = 0,1 and 2,3 of each
  // step), each step's pair sum saturated to int16 (vpmaddubsw) and added with wrap-around
  // (vpaddw), the lanes widened into the group's int32 sum every qgroup_lane_steps K steps and at
  // its end
  const bool words = key.variant & kQGroupI16;
  // identity table (kQGroupIdentity): the nibble is the stored code, GemmArgs::lut unread
  const bool ident = key.variant & kQGroupIdentity;
  const int64_t code_bytes = args.g_steps * cols * 4 / (nib ? 2 : 1);
  const int64_t group_bytes = code_bytes + int64_t(cols) *
                                               (super  ? 1
                                                : half ? 2
                                                       : 4) *
                                               (bias ? 2 : 1);
  // int32 super-block folds (kQGroupIntFold): the activations are a + 128 (unsigned), the codes
  // signed; per column two int16 lanes sum two K steps' pair sums (saturated as vpmaddubsw, added
  // with wrap-around as vpaddw), vpmaddwd multiplies them by the group's sub-scale into the super
  // block's int32 sum (wrapping as vpaddd); the header's int32 correction comes off at the end and
  // t = fma(factor, float(sum), t) once per super block
  const bool fold = key.variant & kQGroupIntFold;
  const int64_t header_bytes =
      super ? int64_t(cols) * 4 * (bias ? 2 : 1) + (fold ? int64_t(cols) * 4 : 0) : 0;
  // int16-lane super-block folds (kQGroupLaneFold): per super block X = sum of sub * (the group's
  // two int16 lanes, as vpmaddwd adds their products, at the group's end and, byte codes, every
  // qgroup_lane_steps K steps) and, with a bias, Y = sum of sub-bias *
  // int16(s_g), both wrapping as vpaddd; then t = fma(scale factor, float(X), t) and
  // t = fma(bias factor, float(Y), t) once per super block
  const bool lanes = key.variant & kQGroupLaneFold;
  // fp32 super-block partials (kQGroupSuperSums): S = fma(float(acc), float(sub), S) per group,
  // t = fma(S, factor, t) at the super block's end
  const bool psums = key.variant & kQGroupSuperSums;
  // with int32-fold codes (kQGroupIntFold, VNNI levels): the activations are a + 128 (unsigned),
  // the codes signed, acc their exact int32 sum per group, and at the super block's end
  // t = fma(S - float(header's int32 correction), factor, t)
  const bool signed_psums = psums && fold;
  const bool fold32 = fold && !psums;  // the avx2 int32 folds
  if (psums && (!super || bias || lanes))
    throw std::invalid_argument(
        "gemm_ref: fp32 super-block partials take two-level scales without a bias");
  const int lane_steps = qgroup_lane_steps(key);
  if (lanes && (args.g_steps > formats::kQGroupI16Steps || !(key.variant & kQGroupI16) ||
                !(key.variant & kQGroupSuper) || args.g_per_super % 2))
    throw std::invalid_argument("gemm_ref: int16-lane folds take groups of <= " +
                                std::to_string(4 * formats::kQGroupI16Steps) +
                                " k with int16 sums, two-level scales and an even number of "
                                "groups per super block");
  const int64_t gps = super ? args.g_per_super : args.g_per_strip;
  const int64_t strip_bytes = (group_bytes * gps + header_bytes) * (args.g_per_strip / gps);
  // The fp32 scale (b = 0) or bias (b = 1) of group g, column n, as the kernels compute it.
  auto factor = [&](const int8_t* w, int64_t g, int n, int b) {
    const int8_t* gw = w + (g / gps) * (group_bytes * gps + header_bytes) + header_bytes +
                       (g % gps) * group_bytes + code_bytes;
    float f;
    if (half) {
      uint16_t h;
      std::memcpy(&h, gw + (b * cols + n) * 2, 2);
      return half == 1 ? formats::f16_to_f32(h) : formats::bf16_to_f32(h);
    }
    if (!super) {
      std::memcpy(&f, gw + (b * cols + n) * 4, 4);
      return f;
    }
    std::memcpy(&f, w + (g / gps) * (group_bytes * gps + header_bytes) + (b * cols + n) * 4, 4);
    return float(gw[b * cols + n]) * f;
  };
  const int8_t* w = args.w;
  for (int64_t s = 0; s < args.n_strips; ++s, w += strip_bytes) {
    const int64_t col0 = args.out_col + s * out_cols;
    for (int64_t m = 0; m < call_rows; ++m) {
      const int8_t* a = args.a + m * args.lda;
      float y[64];
      for (int n = 0; fold32 && n < cols; ++n) {
        float t = 0.0f;
        for (int64_t sb = 0; sb < args.g_per_strip / gps; ++sb) {
          const int8_t* hw = w + sb * (group_bytes * gps + header_bytes);
          uint32_t acc = 0;
          for (int64_t gi = 0; gi < gps; ++gi) {
            const int64_t g = sb * gps + gi;
            const int8_t* gw = hw + header_bytes + gi * group_bytes;
            const int32_t sub = gw[code_bytes + n];
            for (int64_t st = 0; st < args.g_steps; st += 2) {
              int16_t lane[2] = {0, 0};
              for (int64_t s2 = st; s2 < st + 2; ++s2)
                for (int j = 0; j < 4; j += 2) {
                  int32_t pair = 0;
                  for (int i = j; i < j + 2; ++i)
                    pair += int32_t(uint8_t(a[(g * args.g_steps + s2) * 4 + i])) *
                            int32_t(gw[s2 * cols * 4 + n * 4 + i]);
                  lane[j / 2] =
                      int16_t(uint16_t(lane[j / 2]) + uint16_t(std::clamp(pair, -32768, 32767)));
                }
              acc += uint32_t(int32_t(lane[0]) * sub + int32_t(lane[1]) * sub);
            }
          }
          int32_t corr;
          float f;
          std::memcpy(&f, hw + n * 4, 4);
          std::memcpy(&corr, hw + (cols + n) * 4, 4);
          t = std::fma(f, float(int32_t(acc - uint32_t(corr))), t);
        }
        y[n] = args.a_scale[m] * t;
      }
      for (int n = 0; !fold32 && n < cols; ++n) {
        float t = 0.0f, ps = 0.0f;  // ps: the super block's fp32 partial (psums)
        uint32_t lx = 0, ly = 0;    // the lane folds' X and Y
        for (int64_t g = 0; g < args.g_per_strip; ++g) {
          const int8_t* gw = w + (g / gps) * (group_bytes * gps + header_bytes) + header_bytes +
                             (g % gps) * group_bytes;
          // As the kernel sees them: VNNI levels multiply a by the stored byte as unsigned
          // (code + 128) and remove 128 * s_g (read from a_gsum), or with signed codes
          // (signed_psums) a + 128 by the code; the others a by the signed code.
          const int32_t gs =
              args.a_gsum && qgroup_needs_gsum(key) ? args.a_gsum[g * (args.a_gsum_ld / 4) + m] : 0;
          int32_t acc = 0;
          int16_t lane[2] = {0, 0};
          // the lanes widened into acc (vpmaddwd with ones), or with lane folds multiplied by the
          // sub-scale (vpmaddwd: both words, exact) into X (vpaddd)
          const int32_t sub = lanes ? int32_t(gw[code_bytes + n]) : 0;
          auto lanes_out = [&] {
            if (lanes)
              lx += uint32_t(int32_t(lane[0]) * sub + int32_t(lane[1]) * sub);
            else
              acc += int32_t(lane[0]) + lane[1];
            lane[0] = lane[1] = 0;
          };
          for (int64_t st = 0; st < args.g_steps; ++st)
            for (int j = 0; j < 4; j += 2) {
              int32_t pair = 0;
              for (int i = j; i < j + 2; ++i) {
                const int8_t ab = a[(g * args.g_steps + st) * 4 + i];
                const int32_t av = signed_psums ? int32_t(uint8_t(ab)) : int32_t(ab);
                uint8_t b;
                if (nib) {
                  const uint8_t pr = uint8_t(gw[(st / 2) * cols * 4 + n * 4 + i]);
                  const uint8_t q = st % 2 ? pr >> 4 : pr & 0x0f;
                  b = ident ? q : uint8_t(args.lut[q]);
                } else {
                  b = uint8_t(gw[st * cols * 4 + n * 4 + i]);
                }
                pair += av * (flip || offset ? int32_t(b) : int32_t(int8_t(b)));
              }
              if (words)
                lane[j / 2] =
                    int16_t(uint16_t(lane[j / 2]) + uint16_t(std::clamp(pair, -32768, 32767)));
              else
                acc += pair;
              if (words && j == 2 && (st + 1) % lane_steps == 0) lanes_out();
            }
          if (lanes) {  // the lanes' last fold (none left where the steps ended on one)
            lanes_out();
            if (bias) ly += uint32_t(int32_t(gw[code_bytes + cols + n]) * int32_t(int16_t(gs)));
            if (g % gps == gps - 1) {
              const int8_t* hw = w + (g / gps) * (group_bytes * gps + header_bytes);
              float fs, fb;
              std::memcpy(&fs, hw + n * 4, 4);
              t = std::fma(fs, float(int32_t(lx)), t);
              if (bias) {
                std::memcpy(&fb, hw + (cols + n) * 4, 4);
                t = std::fma(fb, float(int32_t(ly)), t);
              }
              lx = ly = 0;
            }
            continue;
          }
          if (words) acc += int32_t(lane[0]) + lane[1];
          if (flip) acc -= 128 * gs;
          if (offset) acc -= c0 * gs;
          if (psums) {
            ps = std::fma(float(acc), float(gw[code_bytes + n]), ps);
            if (g % gps == gps - 1) {
              const int8_t* hw = w + (g / gps) * (group_bytes * gps + header_bytes);
              float f;
              std::memcpy(&f, hw + n * 4, 4);
              if (signed_psums) {
                int32_t corr;
                std::memcpy(&corr, hw + (cols + n) * 4, 4);
                ps -= float(corr);
              }
              t = std::fma(ps, f, t);
              ps = 0.0f;
            }
            continue;
          }
          t = std::fma(factor(w, g, n, 0), float(acc), t);
          if (bias) t = std::fma(factor(w, g, n, 1), float(gs), t);
        }
        y[n] = args.a_scale[m] * t;
      }
      write_out(key, args, m, col0, y, cols);
    }
  }
}

// mxfp4 / mxfp8: per strip and 32-wide K group, the columns' exponent bytes (scale = bits
// byte << 23) then the group's weights; w' = value * scale (exact), acc = fma(a, w', acc) in k
// order; y = acc. Pair kernels (mx_pair_kernel): bf16 activation pairs, w' as its top 16 bits,
// acc = vdpbf16ps_lane(acc, a_pair, w'_pair) over the k pairs. mxfp8 pair decode tiles
// (mx8_pair_decode_kernel): per group the vdpbf16ps chain of the unscaled values, then one fold.
void gemm_ref_mx(const KernelKey& key, const GemmArgs& args) {
  const bool fp4 = key.format == WeightFormat::mxfp4;
  const bool gacc = decode_group_accumulate(key);
  const bool scratch = strip_scratch_kernel(key);  // w' as the bf16 pairs of the scratch
  const int lanes = vec_lanes(key.isa);
  const int cols = key.n_vec * lanes;
  const int out_cols = gemm_strip_out_cols(key.isa, key.n_vec, key.epilogue);
  const int64_t K = args.k4, G = args.g_steps;
  const int64_t group_bytes = cols + (fp4 ? G / 2 : G) * cols;
  const uint8_t* w = reinterpret_cast<const uint8_t*>(args.w);
  const bool i16 = mx_int16_activations(key);
  const bool pairs = mx_pair_kernel(key);
  const bool dpairs = mx8_pair_decode_kernel(key);
  const int64_t call_rows = gemm_call_rows(key, args);
  for (int64_t s = 0; s < args.n_strips; ++s, w += group_bytes * args.g_per_strip) {
    const int64_t col0 = args.out_col + s * out_cols;
    // the top 16 bits of value * scale of (k, column n)
    auto top16 = [&](int64_t k, int n) {
      const uint8_t* gb = w + (k / G) * group_bytes;
      const float scale = f32_from_bits(uint32_t(gb[n]) << 23);
      const uint8_t* gw = gb + cols;
      const int64_t kl = k % G;
      float v;
      if (fp4) {
        const uint8_t b = gw[((kl / 8) * cols + n) * 4 + (kl % 8) / 2];
        v = mx_e2m1(kl % 2 ? b >> 4 : b & 0x0f);
      } else {
        v = mx_e4m3_scaled(gw[kl * cols + n]);
      }
      return f32_to_bits(v * scale) >> 16;
    };
    for (int64_t m = 0; m < call_rows && pairs; ++m) {
      const uint32_t* a32 = reinterpret_cast<const uint32_t*>(args.a + m * args.lda);
      float y[64];
      for (int n = 0; n < cols; ++n) {
        float acc = 0.0f;
        for (int64_t p = 0; p < K / 2; ++p)
          acc = vdpbf16ps_lane(acc, a32[p], top16(2 * p, n) | top16(2 * p + 1, n) << 16);
        y[n] = acc;
      }
      write_out(key, args, m, col0, y, cols);
    }
    for (int64_t m = 0; m < call_rows && dpairs; ++m) {
      const uint32_t* a32 = reinterpret_cast<const uint32_t*>(args.a + m * args.lda);
      auto bf16_of = [](uint8_t b) { return f32_to_bits(fp8_value(b)) >> 16; };  // exact
      float y[64];
      for (int n = 0; n < cols; ++n) {
        float acc = 0.0f;
        for (int64_t g = 0; g < K / G; ++g) {
          const uint8_t* gb = w + g * group_bytes;
          float sum = 0.0f;
          for (int64_t p = 0; p < G / 2; ++p) {
            const uint8_t* row = gb + cols + 2 * p * cols;
            sum = vdpbf16ps_lane(sum, a32[g * G / 2 + p],
                                 bf16_of(row[n]) | bf16_of(row[cols + n]) << 16);
          }
          acc = std::fma(sum, f32_from_bits(uint32_t(gb[n]) << 23) * 0x1p-8f, acc);
        }
        y[n] = acc;
      }
      write_out(key, args, m, col0, y, cols);
    }
    if (pairs || dpairs) continue;
    for (int64_t m = 0; m < call_rows && i16; ++m) {  // exact int32 per group
      const uint8_t* a = reinterpret_cast<const uint8_t*>(args.a + m * args.lda);
      float y[64];
      for (int n = 0; n < cols; ++n) {
        float acc = 0.0f;
        for (int64_t g = 0; g < K / G; ++g) {
          const uint8_t* gb = w + g * group_bytes;
          const uint32_t bits = uint32_t(gb[n]) << 23;
          float scale;
          std::memcpy(&scale, &bits, 4);
          int32_t sum = 0;
          for (int64_t kl = 0; kl < G; ++kl) {
            const uint8_t b = gb[cols + ((kl / 8) * cols + n) * 4 + (kl % 8) / 2];
            const int32_t code = int32_t(2.0f * mx_e2m1(kl % 2 ? b >> 4 : b & 0x0f));
            sum += code * formats::mx_act_i16_code(a, g * G + kl);
          }
          acc = std::fma(float(sum), scale * formats::mx_act_i16_half_scale(a, g), acc);
        }
        y[n] = acc;
      }
      write_out(key, args, m, col0, y, cols);
    }
    for (int64_t m = 0; m < call_rows && !i16; ++m) {
      const float* a = reinterpret_cast<const float*>(args.a + m * args.lda);
      float y[64];
      for (int n = 0; n < cols; ++n) {
        float acc = 0.0f, g = 0.0f;
        for (int64_t k = 0; k < K; ++k) {
          const uint8_t* gb = w + (k / G) * group_bytes;
          const uint32_t bits = uint32_t(gb[n]) << 23;
          float scale;
          std::memcpy(&scale, &bits, 4);
          const uint8_t* gw = gb + cols;
          const int64_t kl = k % G;
          float v;
          if (fp4) {  // [k/8][column][4 bytes]: nibble k % 8 of the column's dword
            const uint8_t b = gw[((kl / 8) * cols + n) * 4 + (kl % 8) / 2];
            v = mx_e2m1(kl % 2 ? b >> 4 : b & 0x0f);
          } else {
            v = mx_e4m3_scaled(gw[kl * cols + n]);
          }
          if (!gacc) {
            // scratch: the bf16 pair (top 16 bits). Written as one mask: GCC 12.2 at -O1/-O2
            // drops `if (scratch) w = f32_from_bits(f32_to_bits(w) & 0xffff0000u)` altogether
            // (reproduced in a 20-line program; the kernel sweep caught it here).
            const uint32_t wb = f32_to_bits(v * scale) & (scratch ? 0xffff0000u : ~0u);
            const float w = f32_from_bits(wb);
            acc = std::fma(a[k], w, acc);
            continue;
          }
          g = std::fma(a[k], v, g);  // the group's products unscaled, then one fold per group
          if (kl == G - 1) {
            acc = std::fma(g, scale, acc);
            g = 0.0f;
          }
        }
        y[n] = acc;
      }
      write_out(key, args, m, col0, y, cols);
    }
  }
}

// AMX-BF16 (isa amx: bf16, and fp8 / mx decoded as jit/gemm.hpp amx_decoded_weight says): per
// strip, the bf16 k pairs [k/2][column][2], then per element the TDPBF16PS chains (blocks of 16
// pairs from each group's start; one group unless fp8) and, for fp8, the per-group fold.
void gemm_ref_amx(const KernelKey& key, const GemmArgs& args) {
  const WeightFormat f = key.format;
  const bool fp8 = f == WeightFormat::fp8, fp4 = f == WeightFormat::mxfp4;
  const int lanes = vec_lanes(key.isa);
  const int cols = key.n_vec * lanes;
  const int out_cols = gemm_strip_out_cols(key.isa, key.n_vec, key.epilogue);
  const int64_t K = f == WeightFormat::bf16 ? 2 * args.k4 : args.k4, pairs = K / 2;
  // fp8: k pairs of a group; the others one chain over all of K
  const int64_t gp = fp8 ? std::min(args.g_steps, K) / 2 : pairs;
  auto top16 = [](float x) { return uint16_t(f32_to_bits(x) >> 16); };
  std::vector<uint16_t> wd(size_t(pairs * cols * 2));  // the strip as bf16 k pairs
  const uint8_t* w = reinterpret_cast<const uint8_t*>(args.w);
  for (int64_t s = 0; s < args.n_strips; ++s) {
    if (f == WeightFormat::bf16) {  // x86 bf16 strips are k pairs already
      std::memcpy(wd.data(), w, wd.size() * 2);
      w += wd.size() * 2;
    } else if (fp8) {  // [k][column] bytes
      for (int64_t k = 0; k < K; ++k)
        for (int n = 0; n < cols; ++n)
          wd[size_t(((k / 2) * cols + n) * 2 + k % 2)] = top16(fp8_value(w[k * cols + n]));
      w += K * cols;
    } else {  // mx: per 32-k group the exponent bytes, then the weights (gemm_ref_mx)
      for (int64_t g = 0; g < K / 32; ++g) {
        for (int64_t kl = 0; kl < 32; ++kl)
          for (int n = 0; n < cols; ++n) {
            const float scale = f32_from_bits(uint32_t(w[n]) << 23);
            float v;
            if (fp4) {
              const uint8_t b = w[cols + ((kl / 8) * cols + n) * 4 + (kl % 8) / 2];
              v = mx_e2m1(kl % 2 ? b >> 4 : b & 0x0f);
            } else {
              v = mx_e4m3_scaled(w[cols + kl * cols + n]);
            }
            const int64_t k = g * 32 + kl;
            wd[size_t(((k / 2) * cols + n) * 2 + k % 2)] = top16(v * scale);
          }
        w += cols + (fp4 ? 16 : 32) * cols;
      }
    }
    const float* wscale = args.w_scale + s * cols;
    const float* gs =
        fp8 ? args.w_gscale + s * args.g_per_strip * gscale_group_floats(key, lanes) : nullptr;
    const int64_t col0 = args.out_col + s * out_cols;
    for (int64_t m = 0; m < gemm_call_rows(key, args); ++m) {
      const uint16_t* a16 = reinterpret_cast<const uint16_t*>(args.a + m * args.lda);
      float y[64];
      for (int n = 0; n < cols; ++n) {
        const int half = key.epilogue == Epilogue::siluup && n >= cols / 2 ? 1 : 0;
        float acc = 0.0f;
        for (int64_t g0 = 0; g0 < pairs; g0 += gp) {
          const int64_t gl = std::min(gp, pairs - g0);
          float g = fp8 ? 0.0f : acc;  // fp8: the C tile starts at zero per group
          for (int64_t p0 = 0; p0 < gl; p0 += 16) {
            const int kk = int(std::min<int64_t>(16, gl - p0));
            uint16_t b[32];
            for (int i = 0; i < kk; ++i) {
              b[2 * i] = wd[size_t(((g0 + p0 + i) * cols + n) * 2)];
              b[2 * i + 1] = wd[size_t(((g0 + p0 + i) * cols + n) * 2 + 1)];
            }
            g = amx::tdpbf16ps_element(g, a16 + 2 * (g0 + p0), b, 2, kk);
          }
          acc = fp8 ? std::fma(g, gs[gscale_at(key, lanes, g0 / gp, half)], acc) : g;
        }
        y[n] = fp8 ? (args.a_scale[m] * wscale[n]) * acc : acc;
      }
      write_out(key, args, m, col0, y, cols);
    }
  }
}
}  // namespace

void gemm_ref(const KernelKey& key, const GemmArgs& args) {
  if (key.isa == IsaLevel::amx && key.format != WeightFormat::int8 &&
      key.format != WeightFormat::int4) {  // int8 / int4 AMX: the VNNI numbers below
    gemm_ref_amx(key, args);
    return;
  }
  if (key.format == WeightFormat::qgroup) {
    gemm_ref_qgroup(key, args);
    return;
  }
  if (is_mx_format(key.format)) {
    gemm_ref_mx(key, args);
    return;
  }
  const bool int4 = key.format == WeightFormat::int4;
  const bool bf16 = key.format == WeightFormat::bf16;
  const bool fp8 = key.format == WeightFormat::fp8;
  const int lanes = vec_lanes(key.isa);
  const int cols = key.n_vec * lanes;
  const int out_cols = gemm_strip_out_cols(key.isa, key.n_vec, key.epilogue);
  // whole blocks, the last one short by a strip-scratch call's m_tail rows
  const int64_t call_rows = gemm_call_rows(key, args);
  const int64_t blocks = (call_rows + key.m_r - 1) / key.m_r;
  const int rows = key.m_r;
  const int32_t offset = gemm_activation_offset(key.isa, key.format) ? 128 : 0;
  const bool nib_offset = int4_offset_nibbles(key.isa, key.format);
  // Group sums folded once per K group: x86's group-accumulating decode tiles and strip-scratch
  // tiles, and every fp8 kernel on NEON (the fp16 route, jit/aarch64/gemm_a64.cpp).
  const bool gacc =
      decode_group_accumulate(key) || strip_scratch_kernel(key) || (fp8 && isa_is_neon(key.isa));
  const bool dword = fp8_dword_decode(key);
  // bf16: args.k4 steps of kg k each ([k / kg][column][kg], jit/gemm.hpp bf16_kgroup); the padded
  // last k of an odd K has weight 0 and activation 0, which the kernels add and so does this.
  const int kg = bf16 ? bf16_kgroup(key.isa) : 1;
  const int64_t bf16_k = args.k4 * kg;
  auto wi = [&](int64_t k, int n) { return (k / kg * cols + n) * kg + k % kg; };
  const int8_t* w = args.w;
  for (int64_t s = 0; s < args.n_strips; ++s) {
    const float* wscale = args.w_scale + s * cols;
    const int64_t col0 = args.out_col + s * out_cols;
    for (int64_t b = 0; b < blocks; ++b) {
      for (int r = 0; r < rows; ++r) {
        const int64_t m = b * rows + r;
        if (m >= call_rows) break;
        const int8_t* a = args.a + m * args.lda;
        float y[64];
        for (int n = 0; n < cols && bf16 && (key.variant & kBf16Pairs); ++n) {
          // vdpbf16ps (x86) or bfdot (neon_bf16): bf16 activation pairs, one lane's chain over
          // the k pairs.
          const uint32_t* a32 = reinterpret_cast<const uint32_t*>(a);
          const uint16_t* wb = reinterpret_cast<const uint16_t*>(w);
          const bool neon = isa_is_neon(key.isa);
          float acc = 0.0f;
          for (int64_t p = 0; p < bf16_k / 2; ++p) {
            const uint32_t b = uint32_t(wb[wi(2 * p, n)]) | uint32_t(wb[wi(2 * p + 1, n)]) << 16;
            acc = neon ? bfdot_lane(acc, a32[p], b) : vdpbf16ps_lane(acc, a32[p], b);
          }
          y[n] = acc;
        }
        for (int n = 0; n < cols && bf16 && !bf16_pair_kernel(key); ++n) {
          const float* af = reinterpret_cast<const float*>(a);
          const uint16_t* wb = reinterpret_cast<const uint16_t*>(w);
          float acc = 0.0f;
          for (int64_t k = 0; k < bf16_k; ++k) {
            const uint32_t bits = uint32_t(wb[wi(k, n)]) << 16;
            float wf;
            std::memcpy(&wf, &bits, 4);
            acc = std::fma(af[k], wf, acc);
          }
          y[n] = acc;
        }
        for (int n = 0; n < cols && fp8 && fp8_pair_kernel(key); ++n) {
          // vdpbf16ps over bf16 activation pairs and the pair's e4m3 values as bf16 (exact),
          // summed per scale group and folded with the group's scale.
          const uint32_t* a32 = reinterpret_cast<const uint32_t*>(a);
          const uint8_t* wb = reinterpret_cast<const uint8_t*>(w);
          const int half = key.epilogue == Epilogue::siluup && n >= cols / 2 ? 1 : 0;
          const float* gs = args.w_gscale + s * args.g_per_strip * gscale_group_floats(key, lanes);
          auto bf16 = [](uint8_t b) {
            uint32_t bits;
            const float f = fp8_value(b);
            std::memcpy(&bits, &f, 4);
            return bits >> 16;
          };
          float acc = 0.0f, g = 0.0f;
          const bool po = key.variant & kFp8PairOrder;  // full strips in the pair order
          auto byte = [&](int64_t k) { return wb[formats::fp8_strip_byte(po, cols, k, n)]; };
          for (int64_t k = 0; k < args.k4; k += 2) {
            const uint32_t b = bf16(byte(k)) | bf16(byte(k + 1)) << 16;
            g = vdpbf16ps_lane(g, a32[k / 2], b);
            if ((k + 2) % args.g_steps == 0 || k + 2 >= args.k4) {
              acc = std::fma(g, gs[gscale_at(key, lanes, k / args.g_steps, half)], acc);
              g = 0.0f;
            }
          }
          y[n] = (args.a_scale[m] * wscale[n]) * acc;
        }
        for (int n = 0; n < cols && fp8 && !fp8_pair_kernel(key); ++n) {
          const float* af = reinterpret_cast<const float*>(a);
          const uint8_t* wb = reinterpret_cast<const uint8_t*>(w);
          const int half = key.epilogue == Epilogue::siluup && n >= cols / 2 ? 1 : 0;
          const float* gs = args.w_gscale + s * args.g_per_strip * gscale_group_floats(key, lanes);
          float acc = 0.0f, g = 0.0f;
          for (int64_t k = 0; k < args.k4; ++k) {
            const float scale = gs[gscale_at(key, lanes, k / args.g_steps, half)];
            if (!gacc) {
              acc = std::fma(af[k], fp8_value(wb[k * cols + n]) * scale, acc);
              continue;
            }
            // decode_group_accumulate: value * 2^-8 (the kernels' fp16 route, exact) summed per
            // group, then folded with scale * 2^8 (exact) once per group; avx2's fp32-domain
            // widen (fp8_dword_decode): a * 2^64 times value * 2^-120, folded with scale * 2^56.
            if (dword)
              g = std::fma(af[k] * 0x1p64f, fp8_value(wb[k * cols + n]) * 0x1p-120f, g);
            else
              g = std::fma(af[k], fp8_value(wb[k * cols + n]) * 0x1p-8f, g);
            if (k % args.g_steps == args.g_steps - 1 || k == args.k4 - 1) {
              acc = std::fma(g, scale * (dword ? 0x1p56f : 256.0f), acc);
              g = 0.0f;
            }
          }
          y[n] = (args.a_scale[m] * wscale[n]) * acc;
        }
        for (int n = 0; n < cols && !bf16 && !fp8; ++n) {
          int32_t acc = 0;
          for (int64_t k4 = 0; k4 < args.k4; ++k4)
            for (int j = 0; j < 4; ++j)
              acc += (offset ? int32_t(uint8_t(a[k4 * 4 + j])) - offset : int32_t(a[k4 * 4 + j])) *
                     packed_weight(w, k4, cols, n, j, int4, nib_offset);
          const float scale = args.a_scale[m] * wscale[n];
          y[n] = scale * float(acc);
        }
        write_out(key, args, m, col0, y, cols);
      }
    }
    w += args.k4 * cols * (fp8 ? 1 : bf16 ? 2 * kg : int4 ? 2 : 4);
  }
}

namespace {
std::atomic<GemmRunner> g_gemm_runner{nullptr};
}  // namespace

void set_gemm_runner(GemmRunner runner) {
  g_gemm_runner.store(runner);
}
bool gemm_runner_installed() {
  return g_gemm_runner.load() != nullptr;
}

void run_gemm_kernel(const Kernel& kernel, const GemmArgs& args) {
  if (const GemmRunner r = g_gemm_runner.load(std::memory_order_relaxed))
    r(kernel, args);
  else
    reinterpret_cast<GemmFn>(const_cast<void*>(kernel.entry()))(&args);
}

}  // namespace ktjit
