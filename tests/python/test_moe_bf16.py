"""BF16 weights (fp32 activations and accumulation): accuracy against an independent torch
reference over the bf16-rounded weights, and JIT-vs-reference per ISA."""

from __future__ import annotations

import pytest
import torch

E, K, H, I = 16, 4, 576, 352


def bf16_rows(w: torch.Tensor):
    """The BF16 'quantizer': round to bfloat16 (RNE), scale 1."""
    return w.to(torch.bfloat16).to(torch.float32), torch.ones(*w.shape[:-1], 1)


@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("T", [1, 3, 64, 300])
def test_bf16_accuracy_vs_torch(ref, T, src_dtype):
    gate, up, down = ref.make_weights(E, H, I, seed=21)
    pmap = torch.randperm(E, generator=torch.Generator().manual_seed(8))
    mask = torch.zeros(E, dtype=torch.bool)
    mask[5] = True
    wrapper = ref.make_wrapper(E, K, H, I, method="BF16", mask=mask)
    wrapper.load_weights_from_tensors(
        gate.to(src_dtype), up.to(src_dtype), down.to(src_dtype), pmap
    )
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T))
    ids, w = ref.make_routing(T, E, K, seed=T)
    out = wrapper.forward(x, ids, w)
    assert out.dtype == torch.float32
    expect = ref.moe_reference(x, ids, w, gate, up, down, pmap=pmap, mask=mask, wq=bf16_rows)
    err = ref.rel_l1(out, expect)
    # fp32 activations and accumulation: only summation order and the exp polynomial differ.
    # Experts with >= 16 rows at isa amx (AMX-BF16 tiles) and >= 5 rows at avx512_bf16
    # (vdpbf16ps pair kernels) take bf16-rounded activations: the SPEC bar (1e-2) applies there,
    # and the error is printed for docs/FORMATS.md. (Routing ids are logical experts; the masked
    # one is counted too, which can only loosen the bar.)
    isa = wrapper.moe.isa
    longest = int(torch.bincount(ids[ids >= 0].flatten(), minlength=E).max())
    pairs = (isa == "amx" and longest >= 16) or (isa == "avx512_bf16" and longest >= 5)
    bar = 1e-2 if pairs else 1e-5
    print(f"BF16 isa={wrapper.moe.isa} T={T} {src_dtype}: relative L1 {err:.3g}")
    assert err <= bar, f"BF16 T={T}: relative L1 vs torch over bf16 weights {err:.3g} (bar {bar})"
    # and the weights really are bf16: against the unrounded fp32 weights the error is visible
    if src_dtype == torch.float32:
        exact = ref.moe_reference(
            x,
            ids,
            w,
            gate,
            up,
            down,
            pmap=pmap,
            mask=mask,
            wq=lambda t: (t.float(), torch.ones(*t.shape[:-1], 1)),
        )
        assert ref.rel_l1(out, exact) > 1e-4


def test_bf16_output_dtype_follows_input(ref):
    gate, up, down = ref.make_weights(8, 64, 32, seed=3)
    wrapper = ref.make_wrapper(8, 2, 64, 32, method="BF16")
    wrapper.load_weights_from_tensors(gate, up, down, torch.arange(8))
    x = torch.randn(5, 64).to(torch.bfloat16)
    ids, w = ref.make_routing(5, 8, 2, seed=1)
    out = wrapper.forward(x, ids, w)
    assert out.dtype == torch.bfloat16 and out.shape == (5, 64)
