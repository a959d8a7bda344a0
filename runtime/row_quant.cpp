#include "runtime/row_quant.hpp"

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
  const Kernel* b = get(kQuantBf16);
  if (!a || !r || !f || !b) return;  // no executable memory: the C++ quantizer
  amax_ = a;
  round_[0] = r;
  round_[1] = f;
  bf16_ = b;
}

void RowQuantizer::to_bf16(const float* x, int64_t n, uint16_t* out) const {
  const int64_t blocks = bf16_ ? n / 16 : 0, body = blocks * 16;
  if (blocks) {
    QuantArgs args{x, blocks, reinterpret_cast<int8_t*>(out), nullptr, 0.0f};
    reinterpret_cast<QuantFn>(const_cast<void*>(bf16_->entry()))(&args);
  }
  formats::f32_to_bf16_row(x + body, n - body, out + body);
}

float RowQuantizer::quantize(const float* x, int64_t n, int8_t* q, bool flip) const {
  const int64_t blocks = n / 16, body = blocks * 16;
  if (!amax_ || blocks == 0) {
    const float d = formats::quantize_row_int8(x, n, q);
    if (flip) formats::flip_sign_bits(q, n);
    return d;
  }
  // the row's max |x|: the kernel's 16 lanes and the tail's, compared as formats::row_amax does
  float parts[17];
  QuantArgs args{x, blocks, q, parts, 0.0f};
  reinterpret_cast<QuantFn>(const_cast<void*>(amax_->entry()))(&args);
  parts[16] = formats::row_amax(x + body, n - body);
  const float d = formats::row_amax(parts, 17) / 127.0f;
  args.id = formats::inverse_scale(d);
  reinterpret_cast<QuantFn>(const_cast<void*>(round_[flip ? 1 : 0]->entry()))(&args);
  formats::quantize_int8_with(x + body, n - body, args.id, q + body);
  if (flip) formats::flip_sign_bits(q + body, n - body);
  return d;
}

}  // namespace ktjit
