"""The staged fast path of submit_forward (inputs whose signature already passed validation are
copied and converted natively): it must give the same bits as the full path, and must never let
an input through that the full path would refuse.

The full path is forced with non-contiguous views of the same values (the fast path only takes
contiguous tensors), so both see identical numbers.
"""

from __future__ import annotations

import pytest
import torch

from conftest import make_routing, make_weights, make_wrapper, moe_reference_actq, rel_l1

E, K, H, I = 8, 2, 128, 64


@pytest.fixture(scope="module")
def wr():
    w = make_weights(E, H, I, seed=11)
    wr = make_wrapper(E, K, H, I)
    wr.load_weights_from_tensors(*w, torch.arange(E))
    wr._weights = w
    return wr


def _strided(t):
    """Same values, non-contiguous storage (forces the validated slow path)."""
    big = torch.empty(t.shape[0], 2 * t.shape[1], dtype=t.dtype)
    big[:, ::2] = t
    v = big[:, ::2]
    assert not v.is_contiguous()
    return v


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_fast_path_equals_full_path(wr, x_dtype, ids_dtype, w_dtype):
    T = 3
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(5)).to(x_dtype)
    ids, w = make_routing(T, E, K, seed=7, invalid=True)
    ids, w = ids.to(ids_dtype), w.to(w_dtype)
    wr._fast_sig = None
    fast = wr.forward(x, ids, w)
    assert wr._fast_sig is not None, "contiguous inputs should have taken the fast path"
    slow = wr.forward(_strided(x), _strided(ids), _strided(w))
    assert fast.dtype == x_dtype
    assert torch.equal(fast.view(torch.int8), slow.view(torch.int8)), "fast path changed bits"
    # and both are the MoE: the independent reference with the same activation quantization
    ref = moe_reference_actq(x.float(), ids.long(), w.float(), *wr._weights)
    assert rel_l1(fast.float(), ref) < (1e-3 if x_dtype == torch.float32 else 1e-2)


def test_signature_change_is_revalidated(wr):
    x = torch.randn(2, H)
    ids, w = make_routing(2, E, K, seed=1, invalid=False)
    wr.forward(x, ids, w)  # caches the signature
    with pytest.raises(ValueError, match="topk_ids"):
        wr.forward(x, ids[:, :1].contiguous(), w)
    with pytest.raises(ValueError, match="hidden_states"):
        wr.forward(torch.randn(2, H + 1), ids, w)
    with pytest.raises(TypeError, match="topk_ids"):
        wr.forward(x, ids.float(), w)
    out = wr.forward(x, ids, w)  # the good signature still works afterwards
    assert out.shape == (2, H)


def test_mask_edits_and_replacement_are_seen(wr):
    T = 4
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(9))
    ids, w = make_routing(T, E, K, seed=9, invalid=False)
    try:
        wr.gpu_experts_mask = torch.zeros(E, dtype=torch.bool)
        base = wr.forward(x, ids, w)
        wr.gpu_experts_mask[int(ids[0, 0])] = True  # in place, as SGLang does
        edited = wr.forward(x, ids, w)
        ref_mask = torch.zeros(E, dtype=torch.bool)
        ref_mask[int(ids[0, 0])] = True
        ref = moe_reference_actq(x, ids, w, *wr._weights, mask=ref_mask)
        assert not torch.equal(base, edited)
        assert rel_l1(edited, ref) < 1e-3
        wr.gpu_experts_mask = torch.zeros(E + 1, dtype=torch.bool)  # replaced, wrong shape
        with pytest.raises(ValueError, match="gpu_experts_mask"):
            wr.forward(x, ids, w)
    finally:
        wr.gpu_experts_mask = torch.zeros(E, dtype=torch.bool)
