"""Per-expert loading (what checkpoint loaders use): same packed result as the stacked path."""

from __future__ import annotations

import pytest
import torch

from kt_jit import _core

E, K, H, I = 8, 2, 64, 48


@pytest.mark.parametrize("method", ["AMXINT8", "AMXINT4", "BF16"])
def test_load_experts_equals_stacked_load(method):
    g = torch.Generator().manual_seed(1)
    gate, up, down = (
        torch.randn(E, I, H, generator=g),
        torch.randn(E, I, H, generator=g),
        torch.randn(E, H, I, generator=g),
    )
    pmap = torch.randperm(E, generator=g)
    stacked = _core.MoELayer(E, K, H, I, method)
    stacked.load_from_float(gate.data_ptr(), up.data_ptr(), down.data_ptr(), "f32", pmap.data_ptr())
    per = _core.MoELayer(E, K, H, I, method)
    slots = list(range(E))
    for half in (slots[E // 2 :], slots[: E // 2]):  # two calls, out of order
        assert not per.loaded
        per.load_experts(
            half,
            [gate[pmap[p]].data_ptr() for p in half],
            [up[pmap[p]].data_ptr() for p in half],
            [down[pmap[p]].data_ptr() for p in half],
            "f32",
        )
    assert per.loaded
    x = torch.randn(5, H, generator=g)
    ids = torch.tensor([[0, 1], [2, 7], [5, -1], [3, 3], [6, 4]])
    w = torch.rand(5, 2, generator=g)
    a, b = torch.empty(5, H), torch.empty(5, H)
    stacked.forward(5, x.data_ptr(), ids.data_ptr(), w.data_ptr(), 0, a.data_ptr())
    per.forward(5, x.data_ptr(), ids.data_ptr(), w.data_ptr(), 0, b.data_ptr())
    assert torch.equal(a, b)


def test_partially_loaded_layer_refuses_forward():
    layer = _core.MoELayer(E, K, H, I, "AMXINT8")
    t = torch.randn(I, H)
    d = torch.randn(H, I)
    layer.load_experts([0], [t.data_ptr()], [t.data_ptr()], [d.data_ptr()], "f32")
    x, ids, w, out = torch.randn(1, H), torch.tensor([[0, 1]]), torch.rand(1, 2), torch.empty(1, H)
    with pytest.raises(RuntimeError, match="not loaded"):
        layer.forward(1, x.data_ptr(), ids.data_ptr(), w.data_ptr(), 0, out.data_ptr())


def test_load_experts_checks_its_arguments():
    layer = _core.MoELayer(E, K, H, I, "AMXINT8")
    t = torch.randn(I, H)
    with pytest.raises(ValueError, match="slot"):
        layer.load_experts([E], [t.data_ptr()], [t.data_ptr()], [t.data_ptr()], "f32")
    with pytest.raises(ValueError, match="same length"):
        layer.load_experts([0, 1], [t.data_ptr()], [t.data_ptr()], [t.data_ptr()], "f32")
    with pytest.raises(ValueError, match="dtype"):
        layer.load_experts([0], [t.data_ptr()], [t.data_ptr()], [t.data_ptr()], "int8")
