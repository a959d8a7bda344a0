#include "runtime/row_quant.hpp"

#include <cstring>

#include "formats/int8.hpp"
#include "jit/quantize.hpp"

namespace ktjit {

RowQuantizer::RowQuantizer(IsaLevel isa) {
  if (isa == IsaLevel::amx) isa = IsaLevel::avx512_bf16;  // the AVX-512 kernels serve AMX
  if (isa == IsaLevel::ref || isa_is_neon(isa) || int(isa) > int(selected_isa())) return;
  KernelKey k;
  k.kind = KernelKind::quantize;
  k.isa = isa;
  k.format = WeightFormat::int8;
  auto get = [&](uint16_t variant) {
    k.variant = variant;
    return KernelCache::instance().get(k);
  };
  const Kernel* a = get(kQuantAmax);
  const Kernel* r = get(kQuantRound);
  const Kernel* f = get(kQuantRoundFlip);
  if (!a || !r || !f) return;  // no executable memory: the C++ quantizer
  amax_ = a;
  round_[0] = r;
  round_[1] = f;
}

float RowQuantizer::quantize(const float* x, int64_t n, int8_t* q, bool flip) const {
  const int64_t blocks = n / 16, body = blocks * 16;
  if (!amax_ || blocks == 0) {
    const float d = formats::quantize_row_int8(x, n, q);
    if (flip) formats::flip_sign_bits(q, n);
    return d;
  }
  float lanes[16];
  QuantArgs args{x, blocks, q, lanes, 0.0f};
  reinterpret_cast<QuantFn>(const_cast<void*>(amax_->entry()))(&args);
  // formats' row_amax: the max of |x| as bit patterns (the lanes hold |x| already)
  uint32_t amax_bits = 0;
  auto take = [&](float v) {
    uint32_t b;
    std::memcpy(&b, &v, 4);
    b &= 0x7fffffffu;
    amax_bits = b > amax_bits ? b : amax_bits;
  };
  for (float v : lanes) take(v);
  for (int64_t i = body; i < n; ++i) take(x[i]);
  float amax;
  std::memcpy(&amax, &amax_bits, 4);
  const float d = amax / 127.0f;
  const float id = formats::inverse_scale(d);
  args.id = id;
  reinterpret_cast<QuantFn>(const_cast<void*>(round_[flip ? 1 : 0]->entry()))(&args);
  for (int64_t i = body; i < n; ++i) {
    const int8_t v = int8_t(formats::rne_clamp(x[i] * id, 127.0f));
    q[i] = flip ? int8_t(uint8_t(v) ^ 0x80u) : v;
  }
  return d;
}

}  // namespace ktjit
