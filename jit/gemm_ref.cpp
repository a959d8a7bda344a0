// Plain C++ twin of the generated INT8 kernels. Every rounding point mirrors the generated code:
// fmaf where the kernel uses an FMA, separate multiplies where it multiplies. Built with
// -ffp-contract=off so the compiler does not fuse on its own.
#include <cmath>
#include <cstring>

#include "jit/gemm.hpp"

namespace ktjit {

int gemm_max_rows(IsaLevel isa, WeightFormat fmt) {
  // fp8 decodes need two temporaries per vector: AVX2 16 registers hold 2 rows, not 3.
  if (fmt == WeightFormat::fp8) return isa == IsaLevel::avx2 ? 2 : 6;
  return isa == IsaLevel::avx2 ? 3 : 6;
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

namespace {
// Weight (k4 step, column n, byte j) of a packed strip with `cols` columns, as the kernel sees it.
int32_t packed_weight(const int8_t* strip, int64_t step, int cols, int n, int j, bool int4) {
  const int64_t in_step = int64_t(n) * 4 + j;
  if (!int4) return strip[step * cols * 4 + in_step];
  const uint8_t b = uint8_t(strip[(step / 2) * cols * 4 + in_step]);
  const uint8_t nib = step % 2 ? b >> 4 : b & 0x0f;
  return int32_t(int8_t(uint8_t(nib << 4)));  // 16 * (signed nibble)
}
}  // namespace

void gemm_ref(const KernelKey& key, const GemmArgs& args) {
  const bool int4 = key.format == WeightFormat::int4;
  const bool bf16 = key.format == WeightFormat::bf16;
  const bool fp8 = key.format == WeightFormat::fp8;
  const int lanes = vec_lanes(key.isa);
  const int cols = key.n_vec * lanes;
  const int out_cols = gemm_strip_out_cols(key.isa, key.n_vec, key.epilogue);
  const int64_t blocks = key.kind == KernelKind::gemm_prefill ? args.m_blocks : 1;
  const int rows = key.m_r;
  const int32_t offset = int8_activation_offset(key.isa) ? 128 : 0;
  const int8_t* w = args.w;
  for (int64_t s = 0; s < args.n_strips; ++s) {
    const float* wscale = args.w_scale + s * cols;
    const int64_t col0 = args.out_col + s * out_cols;
    for (int64_t b = 0; b < blocks; ++b) {
      for (int r = 0; r < rows; ++r) {
        const int64_t m = b * rows + r;
        const int8_t* a = args.a + m * args.lda;
        float y[64];
        for (int n = 0; n < cols && bf16; ++n) {
          const float* af = reinterpret_cast<const float*>(a);
          const uint16_t* wb = reinterpret_cast<const uint16_t*>(w);
          float acc = 0.0f;
          for (int64_t k = 0; k < args.k4; ++k) {
            const uint32_t bits = uint32_t(wb[k * cols + n]) << 16;
            float wf;
            std::memcpy(&wf, &bits, 4);
            acc = std::fma(af[k], wf, acc);
          }
          y[n] = acc;
        }
        for (int n = 0; n < cols && fp8; ++n) {
          const float* af = reinterpret_cast<const float*>(a);
          const uint8_t* wb = reinterpret_cast<const uint8_t*>(w);
          const int half = key.epilogue == Epilogue::siluup && n >= cols / 2 ? 1 : 0;
          const float* gs = args.w_gscale + s * args.g_per_strip * 2 * lanes;
          float acc = 0.0f;
          for (int64_t k = 0; k < args.k4; ++k) {
            const float scale = gs[((k / args.g_steps) * 2 + half) * lanes];
            acc = std::fma(af[k], fp8_value(wb[k * cols + n]) * scale, acc);
          }
          y[n] = (args.a_scale[m] * wscale[n]) * acc;
        }
        for (int n = 0; n < cols && !bf16 && !fp8; ++n) {
          int32_t acc = 0;
          for (int64_t k4 = 0; k4 < args.k4; ++k4)
            for (int j = 0; j < 4; ++j)
              acc += (offset ? int32_t(uint8_t(a[k4 * 4 + j])) - offset : int32_t(a[k4 * 4 + j])) *
                     packed_weight(w, k4, cols, n, j, int4);
          const float scale = args.a_scale[m] * wscale[n];
          y[n] = scale * float(acc);
        }
        float* out = args.out_rows[m] + col0;
        switch (key.epilogue) {
          case Epilogue::store:
            for (int n = 0; n < cols; ++n) out[n] = y[n];
            break;
          case Epilogue::siluup:
            for (int n = 0; n < cols / 2; ++n) out[n] = silu_mul_ref(y[n], y[n + cols / 2]);
            break;
          case Epilogue::accum:
            for (int n = 0; n < cols; ++n) out[n] = std::fma(args.row_weight[m], y[n], out[n]);
            break;
        }
      }
    }
    w += args.k4 * cols * (fp8 ? 1 : bf16 ? 2 : int4 ? 2 : 4);
  }
}

}  // namespace ktjit
