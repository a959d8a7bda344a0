"""AMXINT4 / MOE_INT4 (online quantization from float tensors): accuracy against an independent
torch reference, the int4 rounding rule, and JIT-vs-reference per ISA."""

from __future__ import annotations

import pytest
import torch

E, K, H, I = 16, 4, 576, 352


def test_int4_rounding_rule(ref):
    # amax 112 -> d = 1: values map to q8 = rne(w), then |q8| to the nearest multiple of 16,
    # halves away from zero (kt-kernel's round_4bit_s8).
    w = torch.tensor([[112.0, 7.4, 8.0, -8.0, 23.0, 23.5, -24.0, 0.4, -0.6, 104.0]])
    q16, d = ref.quantize_rows_int4(w)
    assert d.item() == 1.0
    # 7.4 -> 7 -> 0; 8 -> 16; 23 -> 16; 23.5 -> rne 24 -> 32; 104 -> 112
    assert q16.tolist() == [[112, 0, 16, -16, 16, 32, -32, 0, 0, 112]]


@pytest.mark.parametrize("method", ["AMXINT4", "MOE_INT4"])
@pytest.mark.parametrize("T", [1, 3, 64, 300])
def test_int4_accuracy_vs_torch(ref, method, T):
    gate, up, down = ref.make_weights(E, H, I, seed=11)
    pmap = torch.randperm(E, generator=torch.Generator().manual_seed(5))
    mask = torch.zeros(E, dtype=torch.bool)
    mask[2] = True
    wrapper = ref.make_wrapper(E, K, H, I, method=method, mask=mask)
    wrapper.load_weights_from_tensors(
        gate.to(torch.bfloat16), up.to(torch.bfloat16), down.to(torch.bfloat16), pmap
    )
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids, w = ref.make_routing(T, E, K, seed=T)
    out = wrapper.forward(x, ids, w)
    wq = ref.WEIGHT_QUANTIZERS[method]
    # the reference quantizes the same bf16 weights the wrapper received
    gb, ub, db = (t.to(torch.bfloat16).float() for t in (gate, up, down))
    ref1 = ref.moe_reference(x, ids, w, gb, ub, db, pmap=pmap, mask=mask, wq=wq)
    err1 = ref.rel_l1(out, ref1)
    assert err1 <= 3e-2, f"{method} T={T}: relative L1 vs dequantized fp32 reference {err1:.4g}"
    ref2 = ref.moe_reference_actq(x, ids, w, gb, ub, db, pmap=pmap, mask=mask, wq=wq)
    err2 = ref.rel_l1(out, ref2.to(torch.float32).to(torch.bfloat16))
    assert err2 <= 1e-3, f"{method} T={T}: vs same-activation-quantization reference {err2:.4g}"
    # int4 really is coarser than int8 on the same weights: the test would notice an int8 path
    ref8 = ref.moe_reference(x, ids, w, gb, ub, db, pmap=pmap, mask=mask)
    assert ref.rel_l1(ref8, ref1) > 1e-2


def test_int4_half_strip_tiles_same_bits(ref, monkeypatch):
    """avx2's 4-row half-strip prefill tiles (KT_JIT_HALF_STRIPS, on by default) give the same
    bits as the 2-row tiles alone; any value but 0 or 1 is refused when the layer is built, on
    every level."""
    gate, up, down = ref.make_weights(E, H, I, seed=12)
    pmap = torch.arange(E)
    g = torch.Generator().manual_seed(3)
    T = 45  # 180 rows over 16 experts: blocks of 4 and remainders of 1-3 rows
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids, w = ref.make_routing(T, E, K, seed=3)
    outs, names, isas = [], [], []
    for halves in ("1", "0"):
        monkeypatch.setenv("KT_JIT_HALF_STRIPS", halves)
        wrapper = ref.make_wrapper(E, K, H, I, method="AMXINT4")
        wrapper.load_weights_from_tensors(gate, up, down, pmap)
        outs.append(wrapper.forward(x, ids, w))
        names.append(wrapper.moe.kernel_names())
        isas.append(wrapper.moe.isa)
    assert torch.equal(outs[0], outs[1])
    if isas[0] == "avx2":
        assert [n for n in names[0] if n.endswith("_halves")], names[0]
    assert not [n for n in names[1] if n.endswith("_halves")], names[1]
    monkeypatch.setenv("KT_JIT_HALF_STRIPS", "yes")
    with pytest.raises(ValueError, match="KT_JIT_HALF_STRIPS must be 0 or 1"):
        ref.make_wrapper(E, K, H, I, method="AMXINT4").load_weights_from_tensors(
            gate, up, down, pmap
        )
