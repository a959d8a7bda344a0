"""RAWINT4 (compressed-tensors pack-quantized) and GPTQ_INT4 checkpoints through
``KTMoEWrapper.load_weights`` and ``loaders/int4.py``: files written here in the real on-disk
layouts, MoE output against torch references over weights dequantized independently (torch bit
ops on the packed tensors as stored), shards, key families and prefixes, and a corrupt-file table
whose errors name the file and the key."""

from __future__ import annotations

import itertools
import json
import os

import kt_jit
import pytest
import torch
from kt_jit import _core
from kt_jit.loaders import CheckpointError
from kt_jit.loaders import int4 as int4_loader

safetensors_torch = pytest.importorskip("safetensors.torch")

E, K, H, I = 6, 2, 128, 160  # I = 160: not a multiple of 64
LAYER = 2

STEMS = {
    "qwen": ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.down_proj"),
    "mixtral": ("block_sparse_moe.experts.{e}.w1", "block_sparse_moe.experts.{e}.w3",
                "block_sparse_moe.experts.{e}.w2"),
    "mistral": ("experts.{e}.w1", "experts.{e}.w3", "experts.{e}.w2"),
}  # fmt: skip
BASES = {
    "plain": "model.layers.{L}",
    "language_model": "language_model.model.layers.{L}",
    "model.language_model": "model.language_model.layers.{L}",
}
FILES = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


@pytest.fixture(scope="module", autouse=True)
def pool(ref):
    _core.init_pool(ref.THREADS, ref.POOLS)


# ------------------------------------------------------------------------------------------------
# writing checkpoints (independent of the loader)


def make_nibbles(seed, inter=I):
    """Per expert: (nibbles uint8 [N, K] in 0..15, scales fp32 [N, K/gs]) for gate, up, down —
    random nibbles (all 16 present) and scales; returned per gs on demand by ``scales_for``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(E):
        mats = []
        for n, k in ((inter, H), (inter, H), (H, inter)):
            nib = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int64).to(torch.uint8)
            nib.view(-1)[:16] = torch.arange(16, dtype=torch.uint8)
            mats.append(nib)
        out.append(mats)
    return out, g


def make_scales(g, n, k, gs, dtype):
    s = (torch.rand(n, k // gs, generator=g) + 0.5) * (0.05 / 8)
    s *= torch.where(torch.rand(n, k // gs, generator=g) < 0.1, -1.0, 1.0)
    return s.to(dtype)


def pack_u8(nib):
    """compressed-tensors bytes: element 2j in the low nibble of byte j, 2j+1 in the high."""
    return (nib[:, 0::2] | (nib[:, 1::2] << 4)).contiguous()


def _to_int32(words64):
    return ((words64 + (1 << 31)) % (1 << 32) - (1 << 31)).to(torch.int32)


def pack_i32_rows(nib):
    """compressed-tensors pack_to_int32 (packed_dim 1): word w holds columns 8w..8w+7, column
    8w+j in bits 4j..4j+3."""
    n, k = nib.shape
    w = torch.zeros(n, k // 8, dtype=torch.int64)
    for j in range(8):
        w |= nib[:, j::8].to(torch.int64) << (4 * j)
    return _to_int32(w)


def pack_gptq(nib):
    """AutoGPTQ qweight [K/8, N]: row r word for column c holds input 8r+j in bits 4j..4j+3."""
    n, k = nib.shape
    t = nib.t().to(torch.int64)  # [K, N]
    w = torch.zeros(k // 8, n, dtype=torch.int64)
    for j in range(8):
        w |= t[j::8] << (4 * j)
    return _to_int32(w)


def write_config(d, inter=I, quantization_config=None, **over):
    cfg = {
        "model_type": "test",
        "num_experts": E,
        "num_experts_per_tok": K,
        "hidden_size": H,
        "moe_intermediate_size": inter,
        "intermediate_size": 4 * inter,
    }
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    cfg.update(over)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)


def write_model(
    d,
    method,
    gs=32,
    down_gs=None,
    packing="u8",
    family="qwen",
    base="plain",
    inter=I,
    seed=0,
    scale_dtype=None,
    gptq_format="gptq",
    extra=None,
):
    """Write one layer in ``method``'s on-disk layout over two files (experts split in halves, an
    unrelated tensor in the first). Returns {(e, proj): (file, stem)} and the nibbles/scales."""
    down_gs = down_gs or gs
    nibs, g = make_nibbles(seed, inter)
    b = BASES[base].format(L=LAYER)
    parts = [{f"{b}.self_attn.q_proj.weight": torch.zeros(8, 8, dtype=torch.bfloat16)}, {}]
    keys, truth = {}, {}
    for e in range(E):
        part = 0 if e < E // 2 else 1
        for p, (proj, stem) in enumerate(zip(("gate", "up", "down"), STEMS[family])):
            nib = nibs[e][p]
            n, k = nib.shape
            grp = down_gs if proj == "down" else gs
            full = f"{b}.{stem.format(e=e)}"
            if method == "RAWINT4":
                s = make_scales(g, n, k, grp, scale_dtype or torch.bfloat16)
                parts[part][f"{full}.weight_packed"] = (
                    pack_u8(nib) if packing == "u8" else pack_i32_rows(nib)
                )
                parts[part][f"{full}.weight_scale"] = s
                parts[part][f"{full}.weight_shape"] = torch.tensor([n, k], dtype=torch.int64)
            else:
                s = make_scales(g, n, k, grp, scale_dtype or torch.float16).t().contiguous()
                parts[part][f"{full}.qweight"] = pack_gptq(nib)
                parts[part][f"{full}.scales"] = s
                zero = 7 if gptq_format == "gptq" else 8
                zw = sum(zero << (4 * j) for j in range(8))
                parts[part][f"{full}.qzeros"] = _to_int32(
                    torch.full((k // grp, n // 8), zw, dtype=torch.int64)
                )
                parts[part][f"{full}.g_idx"] = (torch.arange(k) // grp).to(torch.int32)
                parts[part][f"{full}.bias"] = torch.zeros(n, dtype=torch.float16)
            keys[(e, proj)] = (FILES[part], full)
            truth[(e, proj)] = (nib, s)
    if extra:
        extra(parts, keys)
    for name, p in zip(FILES, parts):
        safetensors_torch.save_file(p, os.path.join(d, name))
    if method == "RAWINT4":
        qc = {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                "strategy": "group", "group_size": gs},
                }
            },
        }  # fmt: skip
        write_config(d, inter, qc)
    else:
        qc = {"bits": 4, "group_size": gs, "desc_act": False, "sym": True,
              "quant_method": "gptq", "checkpoint_format": gptq_format}  # fmt: skip
        write_config(d, inter, qc)
        with open(os.path.join(d, "quantize_config.json"), "w") as f:
            json.dump({k: v for k, v in qc.items() if k != "quant_method"}, f)
    return keys, truth


# ------------------------------------------------------------------------------------------------
# independent dequantization (from the packed tensors as stored in the files)


def _read(d, file, key):
    from safetensors import safe_open

    with safe_open(os.path.join(d, file), framework="pt") as f:
        return f.get_tensor(key)


def dequant_rawint4(packed, scale):
    n = packed.shape[0]
    if packed.dtype == torch.int32:
        w = packed.to(torch.int64) & 0xFFFFFFFF
        nib = torch.stack([(w >> (4 * j)) & 15 for j in range(8)], dim=-1).reshape(n, -1)
    else:
        b = packed.to(torch.int64)
        nib = torch.stack([b & 15, b >> 4], dim=-1).reshape(n, -1)
    k = nib.shape[1]
    s = scale.to(torch.float32).repeat_interleave(k // scale.shape[1], dim=1)
    return (nib - 8).to(torch.float32) * s, nib


def dequant_gptq(qweight, scales):
    w = qweight.to(torch.int64) & 0xFFFFFFFF  # [K/8, N]
    nib = torch.stack([(w >> (4 * j)) & 15 for j in range(8)], dim=1)  # [K/8, 8, N]
    nib = nib.reshape(-1, qweight.shape[1])  # [K, N]: input 8r + j
    k = nib.shape[0]
    s = scales.to(torch.float32).repeat_interleave(k // scales.shape[0], dim=0)
    return ((nib - 8).to(torch.float32) * s).t().contiguous(), nib.t()


def dequant_model(d, method, keys, truth):
    """gate/up [E, I, H], down [E, H, I] fp32 from the files; the unpacked nibbles must be the
    ones written (checks this test's packers against its unpackers)."""
    mats = {"gate": [], "up": [], "down": []}
    for e in range(E):
        for proj in ("gate", "up", "down"):
            file, stem = keys[(e, proj)]
            if method == "RAWINT4":
                w, nib = dequant_rawint4(
                    _read(d, file, f"{stem}.weight_packed"), _read(d, file, f"{stem}.weight_scale")
                )
            else:
                w, nib = dequant_gptq(
                    _read(d, file, f"{stem}.qweight"), _read(d, file, f"{stem}.scales")
                )
            assert torch.equal(nib.to(torch.uint8), truth[(e, proj)][0]), (e, proj)
            mats[proj].append(w)
    return [torch.stack(mats[p]) for p in ("gate", "up", "down")]


# ------------------------------------------------------------------------------------------------
# running


def wrapper_for(ref, path, method, inter=I):
    return kt_jit.KTMoEWrapper(
        layer_idx=LAYER, num_experts=E, num_experts_per_tok=K, hidden_size=H,
        moe_intermediate_size=inter, gpu_experts_mask=None, cpuinfer_threads=ref.THREADS,
        threadpool_count=ref.POOLS, weight_path=str(path), chunked_prefill_size=1024,
        method=method,
    )  # fmt: skip


def moe_reference_actq(ref, x, ids, weights, gate, up, down, pmap, bounds):
    """float64 MoE over the dequantized weights with int8 activations as the qgroup layer makes
    them: x per token over H; h per (expert, token) over each shard's slice of I, shards summed."""
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
        for b0, b1 in itertools.pairwise(bounds):
            hq, hd = ref.quantize_rows(h[:, b0:b1].to(torch.float32))
            y = (hq.double() * hd.double()) @ down[e][:, b0:b1].double().T
            out.index_add_(0, tok, w[tok, slot].unsqueeze(1) * y)
    return out


def _exact(w):
    return w.to(torch.float32), torch.ones(*w.shape[:-1], 1)


def check_moe(ref, wr, gate, up, down, T=23, pmap=None, seed=1):
    """SPEC §4: rel-L1 ≤ 3e-2 against the fp32 MoE over the dequantized weights, ≤ 1e-3 against
    the same activation quantization. Returns both errors."""
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(seed))
    ids, w = ref.make_routing(T, E, K, seed=seed, invalid=False)
    out = wr.forward(x, ids, w)
    err = ref.rel_l1(out, ref.moe_reference(x, ids, w, gate, up, down, pmap=pmap, wq=_exact))
    assert err <= 3e-2, f"rel-L1 {err:.3e} against the fp32 reference"
    same = moe_reference_actq(ref, x, ids, w, gate, up, down, pmap, wr.moe.shard_bounds)
    err_q = ref.rel_l1(out, same)
    assert err_q <= 1e-3, f"rel-L1 {err_q:.3e} against the same activation quantization"
    return err, err_q


# ------------------------------------------------------------------------------------------------
# MoE tests


@pytest.mark.parametrize(
    "method,gs,packing,family,base",
    [
        ("RAWINT4", 32, "u8", "qwen", "plain"),
        ("RAWINT4", 128, "i32", "qwen", "language_model"),
        ("RAWINT4", 32, "i32", "mixtral", "plain"),
        ("RAWINT4", 128, "u8", "mistral", "model.language_model"),
        ("GPTQ_INT4", 32, None, "qwen", "plain"),
        ("GPTQ_INT4", 128, None, "mixtral", "language_model"),  # I = 256 (one group_size)
        ("GPTQ_INT4", 32, None, "mistral", "plain"),
    ],
)
def test_moe_through_wrapper(ref, tmp_path, method, gs, packing, family, base):
    # RAWINT4: down's K is I = 160, which group 128 does not divide, so down takes 32 there (two
    # compressed-tensors config groups); GPTQ has one group_size, so I = 256 with group 128.
    inter = 256 if method == "GPTQ_INT4" and I % gs else I
    dgs = 32 if inter % gs else gs
    keys, truth = write_model(
        tmp_path, method, gs, dgs, packing or "u8", family, base, inter=inter, seed=gs
    )
    gate, up, down = dequant_model(tmp_path, method, keys, truth)
    wr = wrapper_for(ref, tmp_path, method, inter)
    wr.load_weights(torch.arange(E))
    assert wr.moe.loaded and wr.load_stats["group"] == (gs, dgs)
    assert wr.load_stats["bytes"] > 0 and "G" in wr.load_stats["layout"]
    err, err_q = check_moe(ref, wr, gate, up, down)
    if wr.moe.isa != "ref":  # 4-bit codes through the table: the nibble kernels run
        assert any("_qg4" in n for n in wr.moe.kernel_names()), wr.moe.kernel_names()
    print(f"{method} gs={gs} {packing} {family}/{base}: rel-L1 {err:.3e}, same-actq {err_q:.3e}")


def test_uint8_and_int32_packing_load_the_same_layer(ref, tmp_path):
    outs = []
    for packing in ("u8", "i32"):
        d = tmp_path / packing
        d.mkdir()
        write_model(d, "RAWINT4", 32, packing=packing, seed=5)
        wr = wrapper_for(ref, d, "RAWINT4")
        wr.load_weights()
        x = torch.randn(7, H, generator=torch.Generator().manual_seed(3))
        ids, w = ref.make_routing(7, E, K, seed=3)
        outs.append(wr.forward(x, ids, w))
    assert torch.equal(outs[0], outs[1])


def test_gptq_v1_and_v2_zero_formats(ref, tmp_path):
    """v2 (GPTQModel) stores the zero point 8 itself; v1 (AutoGPTQ) stores 7 (= zero - 1)."""
    keys, truth = write_model(tmp_path, "GPTQ_INT4", 32, gptq_format="gptq_v2", seed=4)
    wr = wrapper_for(ref, tmp_path, "GPTQ_INT4")
    wr.load_weights()
    check_moe(ref, wr, *dequant_model(tmp_path, "GPTQ_INT4", keys, truth))


@pytest.mark.parametrize("method", ["RAWINT4", "GPTQ_INT4"])
def test_shards_map_and_fp32_scales(ref, tmp_path, method):
    """Three shards (uneven, on down's group boundaries), a permuted physical->logical map, and
    fp32 scales in the file."""
    keys, truth = write_model(tmp_path, method, 32, scale_dtype=torch.float32, seed=9)
    gate, up, down = dequant_model(tmp_path, method, keys, truth)
    pmap = torch.tensor([3, 1, 0, 5, 2, 4], dtype=torch.int64)
    layer, _stats = int4_loader.load_int4_layer(
        str(tmp_path), LAYER, E, K, H, I, pmap, method, pools=3, progress=False
    )
    assert layer.shard_bounds == [int(b) for b in _core.grouped_shard_bounds(I, 32, 3)]
    assert len(layer.shard_bounds) == 4 and all(b % 32 == 0 for b in layer.shard_bounds)
    wr = wrapper_for(ref, tmp_path, method)
    wr.moe = layer
    check_moe(ref, wr, gate, up, down, pmap=pmap, T=9)


def test_gate_up_groups_differ(ref, tmp_path):
    """gate G32, up G128 (an unusual mix): one gate/up group of 32, up's scales repeated."""

    def coarser_up(parts, keys):
        g = torch.Generator().manual_seed(77)
        for e in range(E):
            file, stem = keys[(e, "up")]
            part = parts[FILES.index(file)]
            part[f"{stem}.weight_scale"] = make_scales(g, I, H, 128, torch.bfloat16)

    keys, truth = write_model(tmp_path, "RAWINT4", 32, extra=coarser_up, seed=12)
    gate, up, down = dequant_model(tmp_path, "RAWINT4", keys, truth)
    wr = wrapper_for(ref, tmp_path, "RAWINT4")
    wr.load_weights()
    assert wr.load_stats["group"] == (32, 32)
    check_moe(ref, wr, gate, up, down)


def test_decode_helpers_match_independent_unpack():
    g = torch.Generator().manual_seed(0)
    nib = torch.randint(0, 16, (48, 256), generator=g, dtype=torch.int64).to(torch.uint8)
    s = make_scales(g, 48, 256, 32, torch.bfloat16)
    want = (nib.to(torch.int16) - 8).to(torch.int8)
    st = make_scales(g, 48, 256, 64, torch.float16).t().contiguous()
    for native in (None, False):  # the C++ helper (when built) and the torch path
        for packed in (pack_u8(nib), pack_i32_rows(nib)):
            codes, sc = int4_loader.decode_rawint4(packed, s, 48, 256, 32, native=native)
            assert torch.equal(codes, want)
            assert torch.equal(sc, s.to(torch.float32))
        codes, sc = int4_loader.decode_gptq(pack_gptq(nib), st, 48, 256, 32, native=native)
        assert torch.equal(codes, want)  # G64 scales → G32
        assert torch.equal(sc, st.t().to(torch.float32).repeat_interleave(2, dim=1))
    # odd column counts (tail tiles of the transposing decode)
    nib = torch.randint(0, 16, (21, 64), generator=g, dtype=torch.int64).to(torch.uint8)
    st = make_scales(g, 21, 64, 32, torch.float16).t().contiguous()
    codes, _ = int4_loader.decode_gptq(pack_gptq(nib), st, 21, 64, 32)
    assert torch.equal(codes, (nib.to(torch.int16) - 8).to(torch.int8))


def test_no_online_quantization(ref, tmp_path):
    for method in ("RAWINT4", "GPTQ_INT4"):
        wr = wrapper_for(ref, tmp_path, method)
        z = torch.zeros(E, I, H)
        with pytest.raises(NotImplementedError, match="load_weights"):
            wr.load_weights_from_tensors(z, z, torch.zeros(E, H, I))


# ------------------------------------------------------------------------------------------------
# errors: each names the file and the key


def _expect(ref, d, method, exc, *needles):
    wr = wrapper_for(ref, d, method)
    with pytest.raises(exc) as ei:
        wr.load_weights()
    msg = str(ei.value)
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    return msg


def _replace(key_of, fn):
    """An ``extra`` hook for write_model: parts[file][key] = fn(old) for one (e, proj) key."""

    def hook(parts, keys):
        (e, proj), suffix = key_of
        file, stem = keys[(e, proj)]
        part = parts[FILES.index(file)]
        k = f"{stem}.{suffix}"
        new = fn(part.get(k))
        if new is None:
            del part[k]
        else:
            part[k] = new

    return hook


CORRUPT = [
    # (id, method, (expert, proj), suffix, replacement, exception, extra needle)
    ("raw_missing_packed", "RAWINT4", (4, "down"), "weight_packed", lambda t: None,
     ValueError, "not found"),
    ("raw_missing_scale", "RAWINT4", (1, "up"), "weight_scale", lambda t: None,
     ValueError, "not found"),
    ("raw_wrong_dtype", "RAWINT4", (0, "gate"), "weight_packed", lambda t: t.to(torch.int16),
     ValueError, "expected dtype"),
    ("raw_wrong_scale_dtype", "RAWINT4", (2, "down"), "weight_scale", lambda t: t.to(torch.int32),
     ValueError, "expected dtype"),
    ("raw_wrong_shape", "RAWINT4", (3, "up"), "weight_packed", lambda t: t[:, :-1].contiguous(),
     ValueError, "expected shape"),
    ("raw_group_not_dividing", "RAWINT4", (1, "gate"), "weight_scale",
     lambda t: torch.ones(t.shape[0], 3, dtype=t.dtype), ValueError, "do not divide"),
    ("raw_group_not_16", "RAWINT4", (1, "gate"), "weight_scale",
     lambda t: torch.ones(t.shape[0], 16, dtype=t.dtype), ValueError, "multiple of 16"),
    ("raw_group_differs", "RAWINT4", (5, "down"), "weight_scale",
     lambda t: torch.ones(t.shape[0], 1, dtype=t.dtype), ValueError, "share one group size"),
    ("raw_weight_shape", "RAWINT4", (2, "gate"), "weight_shape",
     lambda t: torch.tensor([I, H * 2]), ValueError, "weight shape"),
    ("raw_zero_point", "RAWINT4", (0, "up"), "weight_zero_point",
     lambda t: torch.zeros(I // 8, H // 32, dtype=torch.int32), ValueError, "asymmetric"),
    ("gptq_missing_qweight", "GPTQ_INT4", (3, "gate"), "qweight", lambda t: None,
     ValueError, "not found"),
    ("gptq_wrong_dtype", "GPTQ_INT4", (0, "down"), "qweight", lambda t: t.to(torch.int64),
     ValueError, "expected dtype"),
    ("gptq_wrong_shape", "GPTQ_INT4", (4, "up"), "qweight", lambda t: t.t().contiguous(),
     ValueError, "expected shape"),
    ("gptq_scales_shape", "GPTQ_INT4", (4, "down"), "scales", lambda t: t[:, :-8].contiguous(),
     ValueError, "expected shape"),
    ("gptq_group_not_dividing", "GPTQ_INT4", (1, "gate"), "scales",
     lambda t: torch.ones(3, t.shape[1], dtype=t.dtype), ValueError, "do not divide"),
    ("gptq_asym_qzeros", "GPTQ_INT4", (2, "up"), "qzeros",
     lambda t: torch.full_like(t, 0x76777777), ValueError, "asymmetric"),
    ("gptq_act_order", "GPTQ_INT4", (1, "down"), "g_idx",
     lambda t: t.flip(0).contiguous(), ValueError, "desc_act"),
]  # fmt: skip


@pytest.mark.parametrize("case", CORRUPT, ids=[c[0] for c in CORRUPT])
def test_corrupt_tensor(ref, tmp_path, case):
    _id, method, ek, suffix, fn, exc, needle = case
    keys, _ = write_model(tmp_path, method, 32, extra=_replace((ek, suffix), fn), seed=2)
    file, stem = keys[ek]
    # Every message names the file and the key it is about (a missing one: the directory).
    where = str(tmp_path) if needle == "not found" else file
    _expect(ref, tmp_path, method, exc, where, f"{stem}.{suffix}", needle)


@pytest.mark.parametrize("method", ["RAWINT4", "GPTQ_INT4"])
@pytest.mark.parametrize("cut", [0.5, 0.97])
def test_truncated_file(ref, tmp_path, method, cut):
    _keys, _ = write_model(tmp_path, method, 32, seed=3)
    path = tmp_path / FILES[1]
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(int(size * cut))
    msg = _expect(ref, tmp_path, method, CheckpointError, FILES[1])
    assert "truncated" in msg or "unreadable" in msg


@pytest.mark.parametrize(
    "qc,needle",
    [
        ({"desc_act": True}, "desc_act"),
        ({"sym": False}, "sym = false"),
        ({"bits": 8}, "bits = 8"),
        ({"group_size": 64}, "group_size = 64"),
        ({"quant_method": "awq"}, "quant_method"),
    ],
)
@pytest.mark.parametrize("where", ["quantize_config.json", "config.json"])
def test_gptq_variants_refused(ref, tmp_path, qc, needle, where):
    write_model(tmp_path, "GPTQ_INT4", 32, seed=6)
    if where == "quantize_config.json":
        p = tmp_path / "quantize_config.json"
        cfg = json.loads(p.read_text())
        cfg.update(qc)
        p.write_text(json.dumps(cfg))
    else:
        os.remove(tmp_path / "quantize_config.json")
        p = tmp_path / "config.json"
        cfg = json.loads(p.read_text())
        cfg["quantization_config"].update(qc)
        p.write_text(json.dumps(cfg))
    _expect(ref, tmp_path, "GPTQ_INT4", ValueError, where, needle)


def test_wrong_method_for_the_files(ref, tmp_path):
    write_model(tmp_path, "GPTQ_INT4", 32, seed=6)
    _expect(ref, tmp_path, "RAWINT4", ValueError, "weight_packed", "qweight (GPTQ_INT4)")
    d = tmp_path / "raw"
    d.mkdir()
    write_model(d, "RAWINT4", 32, seed=6)
    _expect(ref, d, "GPTQ_INT4", ValueError, "compressed-tensors", "RAWINT4")


def test_config_shape_mismatch(ref, tmp_path):
    write_model(tmp_path, "RAWINT4", 32, seed=6)
    wr = kt_jit.KTMoEWrapper(
        layer_idx=LAYER, num_experts=E, num_experts_per_tok=K, hidden_size=H,
        moe_intermediate_size=2 * I, gpu_experts_mask=None, cpuinfer_threads=ref.THREADS,
        threadpool_count=ref.POOLS, weight_path=str(tmp_path), chunked_prefill_size=1024,
        method="RAWINT4",
    )  # fmt: skip
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        wr.load_weights()
