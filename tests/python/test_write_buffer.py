"""write_weight_scale_to_buffer: an expert written back for GPU tensor-parallel ranks must equal
the checkpoint's own bytes, sliced as SGLang expects (w13 = [gate rows; up rows] of rank r's
I/tp slice, w2 = down's column slice, scales alike), whatever the layer's shard split.

The expected slices are cut from the source tensors with torch; nothing here reads the packed
layout except through the API under test."""

from __future__ import annotations

import pytest
import torch

from conftest import make_wrapper
from kt_jit import _core

E, K, H, I = 4, 2, 256, 256


def _fp8(seed, block):
    g = torch.Generator().manual_seed(seed)
    q, s = [], []
    for n, k in ((I, H), (I, H), (H, I)):
        w = torch.randn(E, n, k, generator=g)
        q.append((w * 40).clamp(-448, 448).to(torch.float8_e4m3fn).contiguous())
        shape = (E, n // 128, k // 128) if block else (E, n)
        s.append((torch.rand(*shape, generator=g) * 0.02 + 0.005).contiguous())
    return q, s


def _bf16(seed):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(E, n, k, generator=g).to(torch.bfloat16) for n, k in ((I, H), (I, H), (H, I))
    ]


def _expected(q, s, e, tp, r, block):
    ir = I // tp
    rows = slice(r * ir, (r + 1) * ir)
    w13 = torch.cat([q[0][e][rows], q[1][e][rows]])
    w2 = q[2][e][:, rows]
    if s is None:
        return w13, None, w2, None
    if block:
        b = slice(r * ir // 128, (r + 1) * ir // 128)
        return w13, torch.cat([s[0][e][b], s[1][e][b]]), w2, s[2][e][:, b]
    return w13, torch.cat([s[0][e][rows], s[1][e][rows]]), w2, s[2][e]


def _write(layer_or_wrapper, e, tp, like_w13, like_w2, s13_shape, s2_shape):
    outs = [
        (
            (
                torch.full_like(like_w13, 0x55)
                if like_w13.dtype != torch.bfloat16
                else torch.full_like(like_w13, 7.0)
            ),
            torch.full(s13_shape, -1.0) if s13_shape else None,
            (
                torch.full_like(like_w2, 0x55)
                if like_w2.dtype != torch.bfloat16
                else torch.full_like(like_w2, 7.0)
            ),
            torch.full(s2_shape, -1.0) if s2_shape else None,
        )
        for _ in range(tp)
    ]
    ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
    if isinstance(layer_or_wrapper, _core.MoELayer):
        for r, (a, b, c, d) in enumerate(outs):
            layer_or_wrapper.write_expert(e, tp, r, ptr(a), ptr(b), ptr(c), ptr(d))
    else:
        layer_or_wrapper.submit_write_weight_scale_to_buffer(
            tp, e, *[[ptr(o[i]) for o in outs] for i in range(4)]
        )
        layer_or_wrapper.sync_write_weight_scale_to_buffer()
    return outs


def _same(a, b):
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    elif a.dtype == torch.bfloat16:
        a, b = a.view(torch.int16), b.view(torch.int16)
    return torch.equal(a, b)


@pytest.mark.parametrize("method", ["FP8", "FP8_PERCHANNEL"])
@pytest.mark.parametrize("bounds", [[], [0, 128, 256]])
@pytest.mark.parametrize("tp", [1, 2])
def test_fp8_write_back_is_the_checkpoint(method, bounds, tp):
    block = method == "FP8"
    q, s = _fp8(1, block)
    layer = _core.MoELayer(E, K, H, I, method, "", shard_bounds=bounds)
    layer.load_experts_fp8(list(range(E)), *[[t[e].data_ptr() for e in range(E)] for t in (*q, *s)])
    ir = I // tp
    for e in range(E):
        w13, s13, w2, s2 = _expected(q, s, e, tp, 0, block)
        outs = _write(layer, e, tp, w13, w2, tuple(s13.shape), tuple(s2.shape))
        for r in range(tp):
            w13, s13, w2, s2 = _expected(q, s, e, tp, r, block)
            a, b, c, d = outs[r]
            assert _same(a, w13), f"w13 e={e} r={r}"
            assert torch.equal(b, s13), f"w13 scale e={e} r={r}"
            assert _same(c, w2), f"w2 e={e} r={r}"
            assert torch.equal(d, s2), f"w2 scale e={e} r={r}"
        assert a.shape == (2 * ir, H) and c.shape == (H, ir)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_bf16_write_back_through_the_wrapper(tp):
    q = _bf16(2)
    wr = make_wrapper(E, K, H, I, method="BF16")
    pmap = torch.tensor([2, 0, 3, 1])
    wr.load_weights_from_tensors(*q, pmap)
    for slot in range(E):
        w13, _, w2, _ = _expected(q, None, int(pmap[slot]), tp, 0, False)
        outs = _write(wr, slot, tp, w13, w2, None, None)
        for r in range(tp):
            w13, _, w2, _ = _expected(q, None, int(pmap[slot]), tp, r, False)
            assert _same(outs[r][0], w13) and _same(outs[r][2], w2), f"slot={slot} r={r}"


def test_write_buffer_errors():
    q = _bf16(3)
    wr = make_wrapper(E, K, H, I, method="BF16")
    with pytest.raises(RuntimeError, match="not loaded"):
        wr.submit_write_weight_scale_to_buffer(1, 0, [1], [], [1], [])
    wr.load_weights_from_tensors(*q, torch.arange(E))
    buf = torch.empty(2 * I, H, dtype=torch.bfloat16), torch.empty(H, I, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="w13_weight_ptrs"):
        wr.submit_write_weight_scale_to_buffer(
            2, 0, [buf[0].data_ptr()], [], [buf[1].data_ptr()] * 2, []
        )
    wr.submit_write_weight_scale_to_buffer(
        3, 0, [buf[0].data_ptr()] * 3, [], [buf[1].data_ptr()] * 3, []
    )
    with pytest.raises(RuntimeError, match="gpu_tp_count"):  # 256 % 3: raised at sync
        wr.sync_write_weight_scale_to_buffer()
    wr.submit_write_weight_scale_to_buffer(1, E, [buf[0].data_ptr()], [], [buf[1].data_ptr()], [])
    with pytest.raises(RuntimeError, match="expert_id"):
        wr.sync_write_weight_scale_to_buffer()
    i8 = make_wrapper(E, K, H, I, method="AMXINT8")
    with pytest.raises(NotImplementedError, match="AMXINT8"):
        i8.submit_write_weight_scale_to_buffer(1, 0, [1], [1], [1], [1])
