"""write_weight_scale_to_buffer for RAWINT4 and GPTQ_INT4: the expert written back for GPU
tensor-parallel ranks must equal the checkpoint's own packed tensors, sliced as SGLang expects
(w13 = [gate; up] output features of rank r's I/tp slice, w2 = down's input slice), whatever the
layer's shard split. The checkpoints are written by test_loader_int4's writers in the real
on-disk layouts; the expected buffers are cut from the nibbles and scales those writers stored,
and packed with the same independent torch packers; nothing reads kt-jit's strips except through
the API under test."""

from __future__ import annotations

import pytest
import torch
from kt_jit import _core
from kt_jit.loaders import int4 as int4_loader
from test_loader_int4 import E, H, I, K, LAYER, pack_gptq, pack_u8, wrapper_for, write_model

pytest.importorskip("safetensors.torch")


@pytest.fixture(scope="module", autouse=True)
def pool(ref):
    _core.init_pool(ref.THREADS, ref.POOLS)


def _expected(method, truth, e, tp, r, gs):
    ir = I // tp
    rows = slice(r * ir, (r + 1) * ir)
    (ng, sg), (nu, su), (nd, sd) = (truth[(e, p)] for p in ("gate", "up", "down"))
    if method == "RAWINT4":  # [N, K/2] bytes, bf16 scales [N, K/gs]
        w13 = torch.cat([pack_u8(ng[rows]), pack_u8(nu[rows])])
        s13 = torch.cat([sg[rows], su[rows]])
        return w13, s13, pack_u8(nd[:, rows].contiguous()), sd[:, r * ir // gs : (r + 1) * ir // gs]
    # GPTQ: qweight int32 [K/8, N], fp16 scales [K/gs, N] (stored transposed in the file)
    w13 = pack_gptq(torch.cat([ng[rows], nu[rows]]))
    s13 = torch.cat([sg[:, rows], su[:, rows]], dim=1)
    return w13, s13, pack_gptq(nd[:, rows].contiguous()), sd[r * ir // gs : (r + 1) * ir // gs]


@pytest.mark.parametrize("method", ["RAWINT4", "GPTQ_INT4"])
@pytest.mark.parametrize("pools", [1, 3])
@pytest.mark.parametrize("tp", [1, 5])
def test_int4_write_back_is_the_checkpoint(ref, tmp_path, method, pools, tp):
    gs = 32
    keys, truth = write_model(tmp_path, method, gs, seed=11 + tp)
    pmap = torch.tensor([3, 1, 0, 5, 2, 4], dtype=torch.int64)
    layer, _ = int4_loader.load_int4_layer(
        str(tmp_path), LAYER, E, K, H, I, pmap, method, pools=pools, progress=False
    )
    assert len(layer.shard_bounds) == pools + 1
    wr = wrapper_for(ref, tmp_path, method)
    wr.moe = layer
    for slot in range(E):
        e = int(pmap[slot])
        like = [_expected(method, truth, e, tp, r, gs) for r in range(tp)]
        outs = [
            [torch.full_like(t, 0x55 if t.dtype in (torch.uint8, torch.int32) else -1) for t in x]
            for x in like
        ]
        wr.submit_write_weight_scale_to_buffer(
            tp, slot, *[[o[j].data_ptr() for o in outs] for j in range(4)]
        )
        wr.sync_write_weight_scale_to_buffer()
        for r in range(tp):
            for j, name in enumerate(("w13", "w13 scale", "w2", "w2 scale")):
                got, want = outs[r][j], like[r][j]
                if want.dtype in (torch.bfloat16, torch.float16):
                    got, want = got.view(torch.int16), want.view(torch.int16)
                assert torch.equal(got, want), f"{name} slot={slot} rank={r}"
    sizes = layer.write_expert_bytes(tp)
    assert sizes == tuple(t.numel() * t.element_size() for t in like[0])


def test_int4_write_back_errors(ref, tmp_path):
    write_model(tmp_path, "RAWINT4", 32, seed=3)
    wr = wrapper_for(ref, tmp_path, "RAWINT4")
    wr.load_weights(torch.arange(E))
    buf = torch.empty(4096, dtype=torch.uint8)
    p = buf.data_ptr()
    # I = 160: 2 ranks give 80 inputs of down per rank, not whole groups of 32
    wr.submit_write_weight_scale_to_buffer(2, 0, [p, p], [p, p], [p, p], [p, p])
    with pytest.raises(RuntimeError, match="gpu_tp_count"):
        wr.sync_write_weight_scale_to_buffer()
    wr.submit_write_weight_scale_to_buffer(1, 0, [p], [0], [p], [0])
    with pytest.raises(RuntimeError, match="scale pointers"):
        wr.sync_write_weight_scale_to_buffer()


def test_f32_to_f16_rounding_matches_torch():
    """The fp16 scales GPTQ write-back produces: C++ f32 -> f16 (RNE) against torch's cast, over
    every fp16 value, the midpoints between neighbours, and random floats across the range."""
    f16 = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    vals = f16.float()
    vals = vals[torch.isfinite(vals)]
    mids = (vals[:-1].double() + vals[1:].double()) / 2
    g = torch.Generator().manual_seed(0)
    rnd = torch.randn(100_000, generator=g) * torch.exp2(
        torch.randint(-30, 20, (100_000,), generator=g)
    )
    x = torch.cat([vals, mids.float(), rnd, torch.tensor([70000.0, -1e30, 3e-8, 2.9e-8])])
    got = torch.tensor(_core.f32_to_f16_bits(x.tolist()), dtype=torch.int32).to(torch.int16)
    want = x.to(torch.float16).view(torch.int16)
    bad = (got != want).nonzero()
    assert bad.numel() == 0, f"{bad.numel()} mismatches, e.g. {x[bad[0]].item()!r}"
