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


def _q8(w):
    d = w.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    return torch.clamp(torch.round(w * inv), -127, 127).to(torch.int8).contiguous(), d[:, 0]


def test_quantized_load_keeps_the_numbers():
    """Pre-quantized rows (as a converted checkpoint holds them) pack without re-quantization:
    the result is bitwise the layer that quantized the same fp32 weights itself."""
    g = torch.Generator().manual_seed(4)
    gate, up, down = (
        torch.randn(E, I, H, generator=g),
        torch.randn(E, I, H, generator=g),
        torch.randn(E, H, I, generator=g),
    )
    online = _core.MoELayer(E, K, H, I, "AMXINT8")
    online.load_from_float(gate.data_ptr(), up.data_ptr(), down.data_ptr(), "f32", 0)
    pre = _core.MoELayer(E, K, H, I, "AMXINT8")
    parts = [(*_q8(gate[e]), *_q8(up[e]), *_q8(down[e])) for e in range(E)]
    ptrs = [[p[i].data_ptr() for p in parts] for i in range(6)]
    pre.load_experts_quantized(0, list(range(E)), *ptrs)
    assert pre.loaded
    x, ids, w = (
        torch.randn(4, H, generator=g),
        torch.tensor([[0, 1], [2, 7], [5, -1], [3, 4]]),
        torch.rand(4, 2),
    )
    a, b = torch.empty(4, H), torch.empty(4, H)
    online.forward(4, x.data_ptr(), ids.data_ptr(), w.data_ptr(), 0, a.data_ptr())
    pre.forward(4, x.data_ptr(), ids.data_ptr(), w.data_ptr(), 0, b.data_ptr())
    assert torch.equal(a, b)


def test_shards_split_the_intermediate_dimension():
    """BF16 with 1, 2 and 3 shards (uneven) agrees within fp32 summation order; every shard is
    loaded before the layer counts as loaded."""
    g = torch.Generator().manual_seed(6)
    gate, up, down = (
        torch.randn(E, I, H, generator=g),
        torch.randn(E, I, H, generator=g),
        torch.randn(E, H, I, generator=g),
    )
    x, ids, w = (
        torch.randn(3, H, generator=g),
        torch.tensor([[0, 1], [2, 7], [5, 6]]),
        torch.rand(3, 2),
    )
    outs = []
    for bounds in ([], [0, 32, 48], [0, 16, 32, 48]):
        layer = _core.MoELayer(E, K, H, I, "BF16", "", shard_bounds=bounds)
        assert layer.shard_bounds == (bounds or [0, I])
        layer.load_from_float(gate.data_ptr(), up.data_ptr(), down.data_ptr(), "f32", 0)
        out = torch.empty(3, H)
        layer.forward(3, x.data_ptr(), ids.data_ptr(), w.data_ptr(), 0, out.data_ptr())
        outs.append(out)
    for o in outs[1:]:
        assert torch.allclose(o, outs[0], rtol=1e-5, atol=1e-5 * outs[0].abs().max().item())
    with pytest.raises(ValueError, match="shard_bounds"):
        _core.MoELayer(E, K, H, I, "BF16", "", shard_bounds=[0, 50, 40, 48])
    with pytest.raises(ValueError, match="not an integer method"):
        layer.load_experts_quantized(0, [], [], [], [], [], [], [])


def test_quantized_int4_load_refuses_values_off_the_grid():
    layer = _core.MoELayer(E, K, H, I, "AMXINT4")
    q = torch.full((I, H), 16, dtype=torch.int8)
    q[3, 5] = 7  # not 16 * q4
    qd = torch.full((H, I), 16, dtype=torch.int8)
    d = torch.ones(I)
    dd = torch.ones(H)
    with pytest.raises(ValueError, match="multiples of 16"):
        layer.load_experts_quantized(
            0,
            [0],
            [q.data_ptr()],
            [d.data_ptr()],
            [q.data_ptr()],
            [d.data_ptr()],
            [qd.data_ptr()],
            [dd.data_ptr()],
        )
