"""LLAMAFILE: GGUF checkpoints written with ``gguf.GGUFWriter`` through
``KTMoEWrapper(method="LLAMAFILE").load_weights()`` against a torch fp32 MoE over the weights as
``gguf.quants.dequantize`` gives them (SPEC §4: integer types ≤ 3e-2 — activations are int8 per
token —, float types ≤ 1e-2): every supported type, I = 1408, a Q4_K_M-style mix, gate and up of
different types, split files, shards, and a corrupt-file table whose errors name file and key."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
import kt_jit
from kt_jit import _core
from kt_jit.loaders import CheckpointError
from kt_jit.loaders import gguf as gguf_loader

QT = gguf.GGMLQuantizationType
E, K, H, I = 8, 2, 256, 256
LAYER = 5
ARCH = "qwen3moe"
INT_TYPES = [
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "IQ4_NL",
    "IQ4_XS",
]
FLOAT_TYPES = ["F32", "F16", "BF16"]
#: (offset of d, offset of the second f16 field or None, its value relative to d) per type:
#: dmin / m set so the weights are roughly centred
F16_FIELDS = {
    "Q4_0": (0, None, 0.0),
    "Q4_1": (0, 2, -7.5),
    "Q5_0": (0, None, 0.0),
    "Q5_1": (0, 2, -15.5),
    "Q8_0": (0, None, 0.0),
    "Q2_K": (80, 82, 1.5),
    "Q3_K": (108, None, 0.0),
    "Q4_K": (0, 2, 7.5),
    "Q5_K": (0, 2, 15.5),
    "Q6_K": (208, None, 0.0),
    "IQ4_NL": (0, None, 0.0),
    "IQ4_XS": (0, None, 0.0),
}

LLAMAFILE_BUILT = "LLAMAFILE" in kt_jit.wrapper.BUILT_METHODS and hasattr(
    _core.MoELayer, "load_experts_grouped"
)
needs_grouped = pytest.mark.skipif(
    not LLAMAFILE_BUILT, reason="the grouped-format MoELayer (LLAMAFILE kernels) is not built"
)


# ------------------------------------------------------------------------------------------------
# making GGUF files


def _set_f16(raw: np.ndarray, off: int, values: np.ndarray) -> None:
    raw[:, off : off + 2] = values.astype(np.float16).view(np.uint8).reshape(-1, 2)


def make_blocks(name: str, rows: int, k: int, rng: np.random.Generator, std=0.05) -> np.ndarray:
    """[rows, row_bytes] of random valid blocks whose weights have about ``std`` spread: random
    bytes, then d (and dmin / m) per block set to a calibrated value times U(0.5, 1.5)."""
    if name in FLOAT_TYPES:
        w = rng.standard_normal((rows, k)).astype(np.float32) * std
        if name == "F32":
            return w.view(np.uint8)
        if name == "F16":
            return w.astype(np.float16).view(np.uint8)
        return torch.from_numpy(w).to(torch.bfloat16).view(torch.uint8).numpy()
    block, tsize = gguf.GGML_QUANT_SIZES[QT[name]]
    nb = rows * (k // block)
    raw = rng.integers(0, 256, size=(nb, tsize), dtype=np.uint8)
    d_off, m_off, ratio = F16_FIELDS[name]
    _set_f16(raw, d_off, np.ones(nb))
    if m_off is not None:
        _set_f16(raw, m_off, np.full(nb, ratio))
    if name in ("Q4_K", "Q5_K"):
        # 6-bit sub-block scales and mins in [32, 63], as llama.cpp's quantizer gives (d is the
        # largest scale / 63): bit 5 of each lives in bits 5 and 7 of the first 8 scale bytes
        raw[:, 4:12] |= 0xA0
    spread = float(gguf.quants.dequantize(raw[:256], QT[name]).std())
    f = rng.uniform(0.5, 1.5, size=nb) * (std / spread)
    _set_f16(raw, d_off, f)
    if m_off is not None:
        _set_f16(raw, m_off, f * ratio)
    return raw.reshape(rows, -1)


def expert_tensor(name: str, n: int, k: int, seed: int, experts: int = E) -> np.ndarray:
    """[experts, n, row bytes] uint8 (float types too, as raw bytes)."""
    rng = np.random.default_rng(seed)
    return make_blocks(name, experts * n, k, rng).reshape(experts, n, -1)


def dequant(name: str, data: np.ndarray, n: int, k: int) -> torch.Tensor:
    e = data.shape[0]
    flat = np.ascontiguousarray(data).reshape(e * n, -1)
    if name == "F32":
        w = flat.view(np.float32)
    elif name == "F16":
        w = flat.view(np.float16).astype(np.float32)
    else:
        w = gguf.quants.dequantize(flat, QT[name])
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).reshape(e, n, k)


def write_gguf(
    path,
    tensors: dict,
    meta: dict | None = None,
    split_max_tensors: int = 0,
    extra: dict | None = None,
):
    """tensors: key -> (type name, uint8 data [E, n, row bytes]); meta: {key suffix: value}."""
    w = gguf.GGUFWriter(str(path), arch=ARCH, split_max_tensors=split_max_tensors)
    for k, v in (meta or {}).items():
        w.add_uint32(f"{ARCH}.{k}", int(v))
    for key, (name, data) in tensors.items():
        w.add_tensor(key, np.ascontiguousarray(data), raw_dtype=QT[name])
    for key, arr in (extra or {}).items():
        w.add_tensor(key, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def key(proj: str, layer: int = LAYER) -> str:
    return f"blk.{layer}.ffn_{proj}_exps.weight"


def make_model(
    tmp_path,
    types=("Q4_K", "Q4_K", "Q4_K"),
    inter=I,
    seed=0,
    fname="model.gguf",
    meta=True,
    split_max_tensors=0,
    experts=E,
):
    """Writes a GGUF file with layer LAYER's experts (plus an unrelated tensor); returns
    (path, reference weights gate, up, down as fp32 tensors from gguf's dequantization)."""
    shapes = {"gate": (inter, H), "up": (inter, H), "down": (H, inter)}
    tensors, ref = {}, {}
    for j, (proj, name) in enumerate(zip(("gate", "up", "down"), types)):
        n, k = shapes[proj]
        data = expert_tensor(name, n, k, seed * 10 + j, experts)
        tensors[key(proj)] = (name, data)
        ref[proj] = dequant(name, data, n, k)
    md = (
        {
            "expert_count": experts,
            "expert_used_count": K,
            "embedding_length": H,
            "expert_feed_forward_length": inter,
        }
        if meta
        else None
    )
    path = tmp_path / fname
    write_gguf(
        path,
        tensors,
        md,
        split_max_tensors,
        extra={"token_embd.weight": np.zeros((4, H), np.float32)},
    )
    return path, ref["gate"], ref["up"], ref["down"]


# ------------------------------------------------------------------------------------------------
# running


def wrapper_for(path, inter=I, method="LLAMAFILE", **kw):
    return kt_jit.KTMoEWrapper(
        layer_idx=LAYER,
        num_experts=E,
        num_experts_per_tok=K,
        hidden_size=H,
        moe_intermediate_size=inter,
        gpu_experts_mask=None,
        cpuinfer_threads=2,
        threadpool_count=1,
        weight_path=str(path),
        chunked_prefill_size=1024,
        method=method,
        **kw,
    )


def check_moe(ref, wr, gate, up, down, bar, T=19, pmap=None, seed=1, actq=None):
    """SPEC §4: rel-L1 against the fp32 MoE over gguf's dequantized weights ≤ bar; with
    ``actq`` (the shard bounds of an integer layer) also ≤ 1e-3 against a float64 MoE with the
    same activation quantization (per token over H, per (expert, token, shard) over I)."""
    x = torch.randn(T, wr.hidden_size, generator=torch.Generator().manual_seed(seed))
    ids, w = ref.make_routing(T, E, K, seed=seed, invalid=False)
    out = wr.forward(x, ids, w)
    expected = ref.moe_reference(x, ids, w, gate, up, down, pmap=pmap, wq=_exact)
    err = ref.rel_l1(out, expected)
    assert err <= bar, f"rel-L1 {err:.3e} > {bar}"
    if actq is not None:
        same = moe_reference_actq(ref, x, ids, w, gate, up, down, pmap, actq)
        err_q = ref.rel_l1(out, same)
        assert err_q <= 1e-3, f"rel-L1 {err_q:.3e} against the same activation quantization"
    return out, err


def moe_reference_actq(ref, x, ids, weights, gate, up, down, pmap, bounds):
    """float64 MoE over the exact weights with int8 activations as the integer layer makes them:
    x per token over H; h per (expert, token) over each shard's slice of I, shards summed."""
    xq, xd = ref.quantize_rows(x.to(torch.float32))
    xs_all = xq.double() * xd.double()
    w = weights.double()
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for p in range(E):
        e = int(pmap[p]) if pmap is not None else p
        tok, slot = torch.nonzero(ids == p, as_tuple=True)
        if tok.numel() == 0:
            continue
        xs = xs_all[tok]
        g, u = xs @ gate[e].double().T, xs @ up[e].double().T
        h = g / (1.0 + torch.exp(-g)) * u
        for b0, b1 in zip(bounds[:-1], bounds[1:]):
            hq, hd = ref.quantize_rows(h[:, b0:b1].to(torch.float32))
            y = (hq.double() * hd.double()) @ down[e][:, b0:b1].double().T
            out.index_add_(0, tok, w[tok, slot].unsqueeze(1) * y)
    return out


def _exact(w):
    return w.to(torch.float32), torch.ones(*w.shape[:-1], 1)


def run_layer_direct(ref, path, inter=I, pools=1, pmap=None):
    """Loads through the loader itself and runs the layer through a wrapper's forward (for the
    float path, which does not need the grouped layer)."""
    layer, stats = gguf_loader.load_gguf_layer(str(path), LAYER, E, K, H, inter, pmap, pools=pools)
    wr = wrapper_for(path, inter, method="BF16")
    wr.moe = layer
    return wr, layer, stats


# ------------------------------------------------------------------------------------------------
# MoE tests


@needs_grouped
@pytest.mark.parametrize("name", INT_TYPES)
def test_moe_per_integer_type(ref, tmp_path, name):
    path, gate, up, down = make_model(tmp_path, (name, name, name), seed=INT_TYPES.index(name))
    wr = wrapper_for(path)
    wr.load_weights()
    check_moe(ref, wr, gate, up, down, 3e-2, actq=wr.moe.shard_bounds)
    assert name in wr.load_stats["types"] and wr.load_stats["bytes"] > 0
    # Q6_K at avx2 runs the int32 super-block folds (jit/kernel.hpp kQGroupIntFold), nothing else
    fold = [n for n in wr.moe.kernel_names() if "_qg8fs_" in n]
    assert bool(fold) == (name == "Q6_K" and wr.moe.isa == "avx2"), wr.moe.kernel_names()
    # Q4_K and Q2_K at avx2 run the int16-lane super-block folds (kQGroupLaneFold), nothing else
    lanes = [n for n in wr.moe.kernel_names() if "iwls_" in n]
    assert bool(lanes) == (name in ("Q4_K", "Q2_K") and wr.moe.isa == "avx2"), wr.moe.kernel_names()
    # two-level scales without a bias at the VNNI levels run the fp32 super-block partials
    # (kQGroupSuperSums), nothing else
    psums = [n for n in wr.moe.kernel_names() if "ps_" in n]
    vnni = wr.moe.isa in ("avx512_vnni", "avx512_bf16", "amx")
    assert bool(psums) == (name in ("Q6_K", "Q3_K", "IQ4_XS") and vnni), wr.moe.kernel_names()


@needs_grouped
@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "IQ4_XS"])
def test_qgroup_folds_can_be_turned_off(ref, tmp_path, monkeypatch, name):
    """KT_JIT_QGROUP_FOLDS=0: the per-group fp32 order at avx2 too (no super-block folds), still
    within the bars; any value but 0 or 1 is refused when the layer is built."""
    path, gate, up, down = make_model(tmp_path, (name, name, name), seed=INT_TYPES.index(name))
    monkeypatch.setenv("KT_JIT_QGROUP_FOLDS", "0")
    wr = wrapper_for(path)
    wr.load_weights()
    check_moe(ref, wr, gate, up, down, 3e-2, actq=wr.moe.shard_bounds)
    names = wr.moe.kernel_names()
    assert names or wr.moe.isa == "ref"
    assert not [n for n in names if "iwls_" in n or "_qg8fs_" in n or "ps_" in n], names
    # a bad value is an error on every level, not only where the folds exist
    monkeypatch.setenv("KT_JIT_QGROUP_FOLDS", "yes")
    with pytest.raises(ValueError, match="KT_JIT_QGROUP_FOLDS must be 0 or 1"):
        wrapper_for(path).load_weights()


@needs_grouped
@pytest.mark.parametrize("name", ["Q8_0", "Q6_K", "Q5_K"])
def test_half_strip_tiles_same_bits(ref, tmp_path, monkeypatch, name):
    """The VNNI levels' 6-row half-strip tiles of byte codes (KT_JIT_HALF_STRIPS,
    on by default) give the same bits as the 3-row tiles alone: blocks of 6 and the 1-5 rows
    after them, within the bars."""
    path, gate, up, down = make_model(tmp_path, (name, name, name), seed=INT_TYPES.index(name))
    outs, names = [], []
    for halves in ("1", "0"):
        monkeypatch.setenv("KT_JIT_HALF_STRIPS", halves)
        wr = wrapper_for(path)
        wr.load_weights()
        # 61 tokens x 2 of 8 experts: about 15 rows an expert
        out, _ = check_moe(ref, wr, gate, up, down, 3e-2, T=61, actq=wr.moe.shard_bounds)
        outs.append(out)
        names.append([n for n in wr.moe.kernel_names() if n.endswith("_halves")])
    assert torch.equal(outs[0], outs[1])
    if wr.moe.isa in ("avx512_vnni", "avx512_bf16", "amx"):
        assert [n for n in names[0] if "_m6n" in n], names[0]
    assert not names[1], names[1]


@pytest.mark.parametrize("name", FLOAT_TYPES)
def test_moe_float_types(ref, tmp_path, name):
    path, gate, up, down = make_model(tmp_path, (name, name, name), seed=20)
    if LLAMAFILE_BUILT:
        wr = wrapper_for(path)
        wr.load_weights()
    else:
        wr, _, _ = run_layer_direct(ref, path)
    check_moe(ref, wr, gate, up, down, 1e-2)
    assert wr.load_stats["layout"] == f"float ({name.lower()})" if LLAMAFILE_BUILT else True


@needs_grouped
@pytest.mark.parametrize(
    "types", [("Q4_K", "Q4_K", "Q8_0"), ("Q4_0", "Q4_0", "Q4_0"), ("IQ4_NL", "IQ4_NL", "Q5_1")]
)
def test_moe_intermediate_1408(ref, tmp_path, types):
    """DeepSeek-V2-Lite's I = 1408: 5.5 K-quant blocks, so down (K = I) takes a 32-block type,
    as llama.cpp's Q4_K_M does (Q8_0 fallback)."""
    path, gate, up, down = make_model(tmp_path, types, inter=1408, seed=3)
    wr = wrapper_for(path, inter=1408)
    wr.load_weights()
    check_moe(ref, wr, gate, up, down, 3e-2, actq=wr.moe.shard_bounds)


@needs_grouped
@pytest.mark.parametrize(
    "types",
    [
        ("Q4_K", "Q4_K", "Q6_K"),
        ("Q4_K", "Q6_K", "Q4_K"),
        ("Q4_0", "Q3_K", "IQ4_XS"),
        ("Q2_K", "Q5_K", "Q3_K"),
    ],
)
def test_moe_mixed_types(ref, tmp_path, types):
    """Q4_K_M mixes Q4_K and Q6_K; gate and up of different types share one spec."""
    path, gate, up, down = make_model(tmp_path, types, seed=4)
    wr = wrapper_for(path)
    wr.load_weights()
    check_moe(ref, wr, gate, up, down, 3e-2, actq=wr.moe.shard_bounds)
    assert wr.load_stats["types"] == "/".join(types)


def test_gate_up_common_spec():
    t = {x["name"]: x for x in _core.gguf_types()}
    assert gguf_loader.gate_up_spec(t["Q4_K"], t["Q4_K"]) == {
        "group": 32,
        "bias": True,
        "lut": list(range(16)),
        "code_range": [0, 15],
        "super_group": 256,  # two-level scales: int8 sub-scales x fp32 per block
        "scale_dtype": "",
    }
    assert gguf_loader.gate_up_spec(t["Q4_K"], t["Q6_K"]) == {
        "group": 16,
        "bias": True,
        "lut": [],
        "code_range": [-32, 31],  # bytes spanning both types' codes
        "super_group": 256,
        "scale_dtype": "",
    }
    assert gguf_loader.gate_up_spec(t["Q4_0"], t["Q3_K"]) == {
        "group": 16,
        "bias": False,
        "lut": list(range(-8, 8)),
        "code_range": [-8, 7],
        "super_group": 0,  # Q4_0's one scale per 32 has no super block
        "scale_dtype": "",  # Q3_K's are not f16 values; both Q4_0 and IQ4_NL's would be
    }
    assert gguf_loader.gate_up_spec(t["Q4_0"], t["IQ4_NL"])["scale_dtype"] == "f16"
    assert gguf_loader.gate_up_spec(t["Q2_K"], t["Q4_K"])["lut"] == list(range(16))
    assert gguf_loader.gate_up_spec(t["IQ4_XS"], t["Q4_0"])["lut"] == []


def test_mixed_float_and_block_types(ref, tmp_path):
    """F16 gate/up with a Q8_0 down: dequantized to fp32 and run as BF16 (documented)."""
    path, gate, up, down = make_model(tmp_path, ("F16", "F16", "Q8_0"), seed=5)
    wr, _layer, stats = run_layer_direct(ref, path)
    assert stats["layout"] == "float (f32)"
    check_moe(ref, wr, gate, up, down, 1e-2)


class _RecordingLayer:
    """Stands in for the native grouped MoELayer: records the constructor's specs and rebuilds
    every matrix the loader hands over as scale * code + bias (fp32)."""

    def __init__(self, E_, K_, H_, I_, method, isa="", **kw):
        assert method == "LLAMAFILE"
        self.shape, self.kw, self.weights = (E_, K_, H_, I_), kw, {}

    def load_experts_grouped(self, slots, *ptrs):
        import ctypes

        _, _, H_, I_ = self.shape
        dims = {"gate": (I_, H_), "up": (I_, H_), "down": (H_, I_)}
        for j, proj in enumerate(("gate", "up", "down")):
            n, k = dims[proj]
            g = self.kw["down_group" if proj == "down" else "gu_group"]
            has_bias = self.kw["down_bias" if proj == "down" else "gu_bias"]
            lut = self.kw["down_lut" if proj == "down" else "gu_lut"]
            codes_p, scales_p, biases_p = ptrs[3 * j : 3 * j + 3]
            assert len(codes_p) == len(slots)
            for i, slot in enumerate(slots):

                def arr(p, ctype, count):
                    return np.ctypeslib.as_array((ctype * count).from_address(p)).copy()

                c = arr(codes_p[i], ctypes.c_int8, n * k).reshape(n, k)
                sc = arr(scales_p[i], ctypes.c_float, n * k // g).reshape(n, k // g)
                w = np.repeat(sc, g, axis=1) * c.astype(np.float32)
                assert (biases_p[i] != 0) == has_bias
                if has_bias:
                    b = arr(biases_p[i], ctypes.c_float, n * k // g).reshape(n, k // g)
                    w = w + np.repeat(b, g, axis=1)
                if lut:
                    assert set(np.unique(c).tolist()) <= set(lut)
                self.weights[(proj, slot)] = w


@pytest.mark.parametrize(
    "types",
    [
        ("Q4_K", "Q4_K", "Q6_K"),
        ("Q4_K", "Q6_K", "Q2_K"),
        ("Q4_0", "Q3_K", "IQ4_XS"),
        ("Q5_1", "IQ4_NL", "Q5_K"),
        ("Q8_0", "Q4_1", "Q3_K"),
    ],
)
def test_grouped_calls_reproduce_weights(tmp_path, monkeypatch, types):
    """What the loader hands load_experts_grouped (specs, pointer lists, slot order under a map)
    rebuilds gguf's dequantized weights exactly; runs without the grouped kernels."""
    import types as pytypes

    path, gate, up, down = make_model(tmp_path, types, seed=9)
    fake = pytypes.SimpleNamespace(
        gguf_types=_core.gguf_types,
        gguf_decode=_core.gguf_decode,
        gguf_dequantize=_core.gguf_dequantize,
        MoELayer=_RecordingLayer,
    )
    monkeypatch.setattr(gguf_loader, "_core", fake)
    pmap = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0])
    layer, _stats = gguf_loader.load_gguf_layer(str(path), LAYER, E, K, H, I, pmap, pools=2)
    t = {x["name"]: x for x in _core.gguf_types()}
    spec = gguf_loader.gate_up_spec(t[types[0]], t[types[1]])
    assert layer.kw["gu_group"] == spec["group"] and layer.kw["gu_lut"] == spec["lut"]
    assert layer.kw["down_group"] == t[types[2]]["group"]
    assert layer.kw["gu_super_group"] == spec["super_group"]
    # I = 256 over 2 pools: one K-quant block, so down keeps fp32 group scales to split evenly
    assert layer.kw["down_super_group"] == 0
    assert layer.kw["shard_bounds"] == [0, I // 2, I]
    for slot in range(E):
        e = int(pmap[slot])
        for proj, ref_w in (("gate", gate), ("up", up), ("down", down)):
            assert np.array_equal(layer.weights[(proj, slot)], ref_w[e].numpy()), (proj, slot)


def test_even_bounds():
    assert gguf_loader._even_bounds(1408, 32, 3) == [0, 448, 928, 1408]
    assert gguf_loader._even_bounds(256, 16, 1) == [0, 256]
    assert gguf_loader._even_bounds(64, 32, 4) == [0, 32, 64]


@needs_grouped
def test_shards_and_map(ref, tmp_path):
    """Three shards on the down type's block boundaries (uneven) and a physical->logical map."""
    path, gate, up, down = make_model(tmp_path, ("Q4_K", "Q4_K", "Q8_0"), inter=1408, seed=6)
    pmap = torch.tensor([3, 1, 0, 2, 7, 5, 6, 4], dtype=torch.int64)
    layer, _ = gguf_loader.load_gguf_layer(str(path), LAYER, E, K, H, 1408, pmap, pools=3)
    assert layer.shard_bounds == [0, 448, 928, 1408]
    wr = wrapper_for(path, 1408)
    wr.moe = layer
    check_moe(ref, wr, gate, up, down, 3e-2, pmap=pmap, actq=layer.shard_bounds)


@needs_grouped
def test_two_level_scales_across_pools(ref, tmp_path):
    """A K-quant down split on whole blocks keeps two-level scales on both pools (I = 512)."""
    path, gate, up, down = make_model(tmp_path, ("Q4_K", "Q4_K", "Q6_K"), inter=512, seed=8)
    layer, stats = gguf_loader.load_gguf_layer(str(path), LAYER, E, K, H, 512, None, pools=2)
    assert layer.shard_bounds == [0, 256, 512]
    assert stats["layout"].count("int8 scales x fp32 per 256") == 2, stats["layout"]
    wr = wrapper_for(path, 512)
    wr.moe = layer
    check_moe(ref, wr, gate, up, down, 3e-2, actq=layer.shard_bounds)


@pytest.mark.parametrize("how", ["first_part", "other_part", "directory"])
def test_split_files(ref, tmp_path, how):
    """GGUFWriter's split set (one tensor per file) loads from any part or the directory."""
    _path, gate, up, down = make_model(
        tmp_path, ("BF16", "BF16", "BF16"), seed=7, split_max_tensors=1
    )
    parts = sorted(os.listdir(tmp_path))
    assert parts == [f"model-{i:05d}-of-00004.gguf" for i in range(1, 5)]
    target = {
        "first_part": tmp_path / parts[0],
        "other_part": tmp_path / parts[2],
        "directory": tmp_path,
    }[how]
    wr, _, _stats = run_layer_direct(ref, target)
    check_moe(ref, wr, gate, up, down, 1e-2)


@needs_grouped
def test_split_files_quantized(ref, tmp_path):
    _path, gate, up, down = make_model(
        tmp_path, ("Q4_K", "Q4_K", "Q6_K"), seed=8, split_max_tensors=2
    )
    wr = wrapper_for(tmp_path / "model-00001-of-00002.gguf")
    wr.load_weights()
    check_moe(ref, wr, gate, up, down, 3e-2, actq=wr.moe.shard_bounds)


# ------------------------------------------------------------------------------------------------
# errors: each names the file and the key


def _load(path, inter=I):
    return gguf_loader.load_gguf_layer(str(path), LAYER, E, K, H, inter)


def test_error_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        _load(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError, match=r"no \*\.gguf files"):
        _load(tmp_path)


def test_error_missing_key(tmp_path):
    path, *_ = make_model(tmp_path, ("Q8_0",) * 3)
    with pytest.raises(ValueError) as ei:
        gguf_loader.load_gguf_layer(str(path), LAYER + 1, E, K, H, I)
    msg = str(ei.value)
    assert f"blk.{LAYER + 1}.ffn_gate_exps.weight" in msg and "model.gguf" in msg


def test_error_missing_up(tmp_path):
    data = expert_tensor("Q8_0", I, H, 0)
    path = tmp_path / "noup.gguf"
    write_gguf(path, {key("gate"): ("Q8_0", data), key("down"): ("Q8_0", data)})
    with pytest.raises(ValueError, match=r"blk\.5\.ffn_up_exps\.weight.*noup\.gguf"):
        _load(path)


def test_error_unsupported_type(tmp_path):
    good = expert_tensor("Q8_0", I, H, 0)
    bad = np.random.default_rng(0).integers(0, 256, size=(E, I, H // 256 * 66), dtype=np.uint8)
    path = tmp_path / "iq2.gguf"
    write_gguf(
        path,
        {key("gate"): ("Q8_0", good), key("up"): ("IQ2_XXS", bad), key("down"): ("Q8_0", good)},
    )
    with pytest.raises(ValueError) as ei:
        _load(path)
    msg = str(ei.value)
    assert "iq2.gguf" in msg and key("up") in msg and "IQ2_XXS" in msg
    assert "Q4_0" in msg and "IQ4_XS" in msg and "BF16" in msg  # the supported list


def test_error_wrong_shape(tmp_path):
    path, *_ = make_model(tmp_path, ("Q8_0",) * 3, inter=2 * I, meta=False)
    with pytest.raises(ValueError) as ei:
        _load(path, inter=I)
    msg = str(ei.value)
    assert "model.gguf" in msg and key("gate") in msg
    assert f"[{E}, {I}, {H}]" in msg and f"[{E}, {2 * I}, {H}]" in msg


def test_error_metadata_mismatch(tmp_path):
    path, *_ = make_model(tmp_path, ("Q8_0",) * 3, experts=E)
    with pytest.raises(ValueError, match=r"hidden_size.*model\.gguf.*embedding_length = 256"):
        gguf_loader.load_gguf_layer(str(path), LAYER, E, K, 512, I)


@pytest.mark.parametrize("cut", [0.5, 0.999, 0.1])
def test_error_truncated(tmp_path, cut):
    path, *_ = make_model(tmp_path, ("Q4_K",) * 3)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(int(size * cut))
    with pytest.raises(CheckpointError) as ei:
        _load(path)
    assert "model.gguf" in str(ei.value)


def test_error_garbage_file(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(CheckpointError, match=r"junk\.gguf"):
        _load(path)


def test_error_missing_split_part(tmp_path):
    make_model(tmp_path, ("BF16",) * 3, split_max_tensors=1)
    os.remove(tmp_path / "model-00003-of-00004.gguf")
    with pytest.raises(FileNotFoundError, match=r"part 3 of 4.*model-00003-of-00004\.gguf"):
        _load(tmp_path / "model-00001-of-00004.gguf")


@needs_grouped
def test_error_through_wrapper(tmp_path):
    path, *_ = make_model(tmp_path, ("Q8_0",) * 3, inter=2 * I, meta=False)
    wr = wrapper_for(path)
    with pytest.raises(ValueError, match=r"ffn_gate_exps"):
        wr.load_weights()
    assert wr.moe is None


@needs_grouped
def test_no_online_quantization(tmp_path):
    wr = wrapper_for(tmp_path / "absent.gguf")
    z = torch.zeros(E, I, H)
    with pytest.raises(NotImplementedError, match="GGUF files with load_weights"):
        wr.load_weights_from_tensors(z, z, z.transpose(1, 2).contiguous())
    with pytest.raises(FileNotFoundError, match="absent.gguf"):
        wr.load_weights()
