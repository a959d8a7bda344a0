"""``kt-jit convert``: Hugging Face checkpoints (bf16, fp16 fused, fp8 with 128x128 block scales;
Qwen/DeepSeek- and Mixtral-style keys, ``language_model.`` prefixes) → kt-jit artifact → load on 1
and 2 shards. One shard is bitwise the online quantization of the same weights; two shards match a
float64 per-shard reference; a torch fp32 reference over the dequantized weights is within SPEC §4's
bar. Corrupt artifacts raise errors that name the file and the key. The CLI runs end to end."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

safetensors_torch = pytest.importorskip("safetensors.torch")

from kt_jit import _core
from kt_jit import convert as cv
from kt_jit.loaders import CheckpointError
from kt_jit.loaders import ktjit as art

E, K, H, I = 4, 2, 256, 192  # I = 192: partial 128-blocks for fp8, two shards [0, 128, 192]
PMAP = torch.tensor([2, 0, 3, 1])
BITS = {"AMXINT8": 8, "AMXINT4": 4}

FAMILIES = {
    "qwen": (
        "mlp.experts.{e}.gate_proj.weight",
        "mlp.experts.{e}.up_proj.weight",
        "mlp.experts.{e}.down_proj.weight",
    ),
    "mixtral": (
        "block_sparse_moe.experts.{e}.w1.weight",
        "block_sparse_moe.experts.{e}.w3.weight",
        "block_sparse_moe.experts.{e}.w2.weight",
    ),
}
BASES = {"plain": "model.layers.{L}", "language_model": "language_model.model.layers.{L}"}


# ------------------------------------------------------------------------------------------------
# writing Hugging Face checkpoints


def make_weights(seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    gate = (torch.randn(E, I, H, generator=g) * 0.05).to(dtype)
    up = (torch.randn(E, I, H, generator=g) * 0.05).to(dtype)
    down = (torch.randn(E, H, I, generator=g) * 0.05).to(dtype)
    return gate, up, down


def make_fp8(seed):
    """e4m3 weights with fp32 128x128 block scales; returns (q, s, dequantized fp32), each a
    (gate, up, down) triple of [E, n, k] / [E, n/128, k/128] tensors."""
    g = torch.Generator().manual_seed(seed)
    q, s, deq = [], [], []
    for n, k in ((I, H), (I, H), (H, I)):
        m = torch.randn(E, n, k, generator=g)
        sc = torch.rand(E, (n + 127) // 128, (k + 127) // 128, generator=g) * 0.02 + 0.005
        full = sc.repeat_interleave(128, 1)[:, :n].repeat_interleave(128, 2)[:, :, :k]
        w = (m * 0.05 / full).clamp(-448, 448).to(torch.float8_e4m3fn).contiguous()
        q.append(w)
        s.append(sc.contiguous())
        deq.append(w.to(torch.float32) * full)  # the documented dequantization, in torch
    return q, s, deq


def write_config(d, layers=2, **over):
    cfg = {
        "model_type": "test",
        "num_experts": E,
        "num_experts_per_tok": K,
        "hidden_size": H,
        "moe_intermediate_size": I,
        "num_hidden_layers": layers,
    }
    cfg.update(over)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)


def write_hf(d, layers: dict, family="qwen", base="plain", scales=None, dense=()):
    """layers = {L: (gate, up, down)} per-expert tensors; scales = {L: (sg, su, sd)} adds
    ``.weight_scale_inv``; dense layers get a plain MLP (no experts). Two files."""
    os.makedirs(d, exist_ok=True)
    files = [{}, {}]
    for L in dense:
        b = BASES[base].format(L=L)
        files[0][f"{b}.mlp.gate_proj.weight"] = torch.zeros(8, H, dtype=torch.bfloat16)
    for L, mats in layers.items():
        b = BASES[base].format(L=L)
        files[0][f"{b}.self_attn.q_proj.weight"] = torch.zeros(8, 8, dtype=torch.bfloat16)
        for e in range(E):
            part = 0 if e < E // 2 else 1
            for i, (fmt, t) in enumerate(zip(FAMILIES[family], mats)):
                key = f"{b}.{fmt.format(e=e)}"
                files[part][key] = t[e].contiguous()
                if scales is not None:
                    files[part][key + "_scale_inv"] = scales[L][i][e].contiguous()
    for i, tensors in enumerate(files):
        safetensors_torch.save_file(
            tensors, os.path.join(d, f"model-0000{i + 1}-of-00002.safetensors")
        )
    write_config(d, layers=max(list(layers) + list(dense)) + 1)


# ------------------------------------------------------------------------------------------------
# references


def _slots_by_expert(ids):
    valid = (ids >= 0) & (ids < E)
    tok, slot = torch.nonzero(valid, as_tuple=True)
    phys = ids[tok, slot]
    for p in torch.unique(phys).tolist():
        sel = phys == p
        yield int(p), tok[sel], slot[sel]


def reference_shards(ref, x, ids, w, gate, up, down, bits, bounds, pmap):
    """float64, the engine's semantics on shards with full-row weight quantization: x per token
    over H; per shard, h's slice quantized per (expert, token); down's columns of the shard with
    the full row's scale; shards summed."""
    wq = ref.quantize_rows if bits == 8 else ref.quantize_rows_int4
    (gq, gd), (uq, ud), (dq, dd) = (wq(t.float()) for t in (gate, up, down))
    xq, xd = ref.quantize_rows(x.float())
    xq, xd = xq.double(), xd.double()
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for p, tok, slot in _slots_by_expert(ids):
        e = int(pmap[p])
        y = torch.zeros(len(tok), H, dtype=torch.float64)
        for b0, b1 in itertools.pairwise(bounds):
            sl = slice(b0, b1)
            g = (xq[tok] @ gq[e][sl].double().T) * (xd[tok] * gd[e][sl, 0].double())
            u = (xq[tok] @ uq[e][sl].double().T) * (xd[tok] * ud[e][sl, 0].double())
            h = (g / (1.0 + torch.exp(-g))) * u
            hq, hd = ref.quantize_rows(h.to(torch.float32))
            y += (hq.double() @ dq[e][:, sl].double().T) * (hd.double() * dd[e][:, 0].double())
        out.index_add_(0, tok, w[tok, slot].double().unsqueeze(1) * y)
    return out


def wrapper(ref, path, method, layer=1, pools=1):
    import kt_jit

    return kt_jit.KTMoEWrapper(
        layer_idx=layer,
        num_experts=E,
        num_experts_per_tok=K,
        hidden_size=H,
        moe_intermediate_size=I,
        gpu_experts_mask=None,
        cpuinfer_threads=ref.THREADS,
        threadpool_count=pools,
        weight_path=str(path),
        chunked_prefill_size=1024,
        method=method,
    )


def inputs(ref, T, seed):
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(seed))
    ids, w = ref.make_routing(T, E, K, seed=seed, invalid=False)
    return x, ids, w


def artifact_bytes(bits):
    """Data bytes of one layer: quantized weights + fp32 row scales."""
    q = 3 * I * H if bits == 8 else 3 * I * H // 2
    return E * (q + 4 * (2 * I + H))


# ------------------------------------------------------------------------------------------------
# the quantizer binding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_rows_is_the_engine_rule(ref, dtype):
    w = (torch.randn(37, 130, generator=torch.Generator().manual_seed(1)) * 0.1).to(dtype)
    w[3] = 0  # an all-zero row: d = 0, q = 0
    dt = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}[dtype]
    q = np.empty((37, 130), np.int8)
    d = np.empty(37, np.float32)
    _core.quantize_rows(w.data_ptr(), dt, 37, 130, 8, q.ctypes.data, d.ctypes.data, False)
    rq, rd = ref.quantize_rows(w.float())
    assert np.array_equal(q, rq.to(torch.int8).numpy()) and np.array_equal(d, rd[:, 0].numpy())
    q4 = np.empty((37, 65), np.uint8)
    _core.quantize_rows(w.data_ptr(), dt, 37, 130, 4, q4.ctypes.data, d.ctypes.data, True)
    rq, rd = ref.quantize_rows_int4(w.float())
    assert np.array_equal(d, rd[:, 0].numpy())
    nib = (rq.to(torch.int64) // 16).numpy()  # q4 in [-7, 7]
    assert np.array_equal(q4 & 0xF, nib[:, 0::2] & 0xF)  # even k: low nibble
    assert np.array_equal(q4 >> 4, nib[:, 1::2] & 0xF)  # odd k: high nibble
    back = np.empty((37, 130), np.int8)
    _core.unpack_nibbles(q4.ctypes.data, 37, 130, back.ctypes.data)
    assert np.array_equal(back, rq.to(torch.int8).numpy())


def test_shard_bounds():
    assert art.shard_bounds(192, 1) == [0, 192]
    assert art.shard_bounds(192, 2) == [0, 128, 192]
    assert art.shard_bounds(768, 4) == [0, 192, 384, 576, 768]
    assert art.shard_bounds(40, 3) == [0, 16, 24, 40]
    assert art.shard_bounds(3, 8) == [0, 1, 2, 3]


def test_parse_layers():
    assert cv.parse_layers("0,3-5,4") == [0, 3, 4, 5]
    assert cv.parse_layers(None) is None
    with pytest.raises(ValueError, match="--layers"):
        cv.parse_layers("1-x")


# ------------------------------------------------------------------------------------------------
# convert → load


SOURCES = ["bf16-qwen", "bf16-mixtral-language_model", "fp8-qwen"]


def make_source(d, source, seed):
    """Writes an HF checkpoint with a dense layer 0 and MoE layer 1; returns the weights the
    online path gets (bf16 tensors, or the fp8 dequantized in fp32)."""
    if source.startswith("fp8"):
        q, s, deq = make_fp8(seed)
        write_hf(d, {1: q}, scales={1: s}, dense=(0,))
        return deq
    gate, up, down = make_weights(seed)
    family, base = ("mixtral", "language_model") if "mixtral" in source else ("qwen", "plain")
    write_hf(d, {1: (gate, up, down)}, family=family, base=base, dense=(0,))
    return gate, up, down


@pytest.mark.parametrize("method", ["AMXINT8", "AMXINT4"])
@pytest.mark.parametrize("source", SOURCES)
def test_convert_and_load(ref, tmp_path, method, source):
    bits = BITS[method]
    src, out = tmp_path / "hf", tmp_path / "art"
    weights = make_source(src, source, seed=len(source) + bits)
    stats = cv.convert(str(src), str(out), method=method, threads=2, progress=False)
    assert stats["layers"] == [1] and stats["gb_per_s"] > 0
    m = art.read_manifest(str(out))
    assert (m["method"], m["scheme"], m["layers"]) == (method, f"int{bits}", [1])
    assert (m["num_experts"], m["hidden_size"], m["moe_intermediate_size"]) == (E, H, I)
    assert m["source"]["dtype"] == ("fp8_e4m3_block128" if source.startswith("fp8") else "bf16")
    # size: the data plus one safetensors header, nothing else
    size = os.path.getsize(out / "layer_1.safetensors")
    assert artifact_bytes(bits) < size < artifact_bytes(bits) + 8192
    assert stats["bytes_written"] == size
    assert sorted(os.listdir(out)) == ["config.json", "kt_jit_artifact.json", "layer_1.safetensors"]

    online = wrapper(ref, "", method)
    online.load_weights_from_tensors(*weights, PMAP)
    one = wrapper(ref, out, method)
    one.load_weights(PMAP)
    assert list(one.moe.shard_bounds) == [0, I] and one.load_stats["shards"] == 1
    two = wrapper(ref, out, method, pools=2)
    two.load_weights(PMAP)
    assert list(two.moe.shard_bounds) == [0, 128, I]
    for T in (1, 5, 33):
        x, ids, w = inputs(ref, T, seed=T)
        o1 = one.forward(x, ids, w)
        assert torch.equal(o1, online.forward(x, ids, w)), "1 shard must equal online quantization"
        o2 = two.forward(x, ids, w)
        wq = ref.WEIGHT_QUANTIZERS[method]
        deq = ref.moe_reference(x, ids, w, *(t.float() for t in weights), PMAP, wq=wq)
        for o, bounds in ((o1, [0, I]), (o2, [0, 128, I])):
            same = reference_shards(ref, x, ids, w, *weights, bits, bounds, PMAP)
            assert ref.rel_l1(o, same) <= 1e-3
            assert ref.rel_l1(o, deq) <= 3e-2


def test_fused_fp16_and_two_moe_layers(ref, tmp_path):
    """Fused gate_up_proj/down_proj stacks (fp16), two MoE layers, layer selection."""
    src, out = tmp_path / "hf", tmp_path / "art"
    os.makedirs(src)
    ws = {L: make_weights(20 + L, torch.float16) for L in (0, 1)}
    t = {}
    for L, (g, u, d) in ws.items():
        t[f"model.layers.{L}.mlp.experts.gate_up_proj"] = torch.cat([g, u], 1).contiguous()
        t[f"model.layers.{L}.mlp.experts.down_proj"] = d
    safetensors_torch.save_file(t, str(src / "model.safetensors"))
    write_config(src, layers=2)
    stats = cv.convert(str(src), str(out), method="AMXINT8", progress=False)
    assert stats["layers"] == [0, 1]
    x, ids, w = inputs(ref, 9, seed=4)
    for L in (0, 1):
        a = wrapper(ref, out, "AMXINT8", layer=L)
        a.load_weights(None)
        b = wrapper(ref, "", "AMXINT8", layer=L)
        b.load_weights_from_tensors(*ws[L])
        assert torch.equal(a.forward(x, ids, w), b.forward(x, ids, w))
    # only layer 1
    out2 = tmp_path / "art2"
    assert cv.convert(str(src), str(out2), layers=[1], progress=False)["layers"] == [1]
    with pytest.raises(ValueError, match="layer 0 is not in the artifact"):
        wrapper(ref, out2, "AMXINT8", layer=0).load_weights(None)


def test_moe_int_methods_load_the_same_artifact(ref, tmp_path):
    src, out = tmp_path / "hf", tmp_path / "art"
    weights = make_source(src, "bf16-qwen", seed=3)
    cv.convert(str(src), str(out), method="AMXINT4", progress=False)
    x, ids, w = inputs(ref, 7, seed=2)
    a = wrapper(ref, out, "AMXINT4")
    a.load_weights(PMAP)
    b = wrapper(ref, out, "MOE_INT4")
    b.load_weights(PMAP)
    c = wrapper(ref, "", "MOE_INT4")
    c.load_weights_from_tensors(*weights, PMAP)
    assert torch.equal(a.forward(x, ids, w), b.forward(x, ids, w))
    assert torch.equal(b.forward(x, ids, w), c.forward(x, ids, w))


def test_cli_end_to_end(ref, tmp_path):
    src, out = tmp_path / "hf", tmp_path / "art"
    weights = make_source(src, "bf16-mixtral-language_model", seed=8)
    env = dict(os.environ)
    env.pop("KT_JIT_ISA", None)
    cmd = [
        sys.executable,
        "-m",
        "kt_jit.cli",
        "convert",
        str(src),
        str(out),
        "--method",
        "AMXINT4",
        "--threads",
        "2",
        "--quiet",
    ]
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "GB/s" in r.stdout and "1 layers" in r.stdout
    a = wrapper(ref, out, "AMXINT4")
    a.load_weights(None)
    b = wrapper(ref, "", "AMXINT4")
    b.load_weights_from_tensors(*weights)
    x, ids, w = inputs(ref, 5, seed=1)
    assert torch.equal(a.forward(x, ids, w), b.forward(x, ids, w))
    # a second run into the same directory needs --force
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 1 and "--force" in r.stderr
    r = subprocess.run(
        cmd + ["--force"], check=False, capture_output=True, text=True, env=env, timeout=300
    )
    assert r.returncode == 0, r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "kt_jit.cli", "convert", "--help"],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0 and "--method" in r.stdout


# ------------------------------------------------------------------------------------------------
# errors


@pytest.fixture(scope="module")
def good_artifact(tmp_path_factory):
    d = tmp_path_factory.mktemp("good")
    make_source(d / "hf", "bf16-qwen", seed=5)
    cv.convert(str(d / "hf"), str(d / "art"), method="AMXINT8", progress=False)
    return d / "art"


def _copy(good, dst):
    import shutil

    shutil.copytree(good, dst)
    return dst


def _mutate(path, fn):
    from safetensors.torch import load_file, save_file

    t = load_file(str(path))
    fn(t)
    save_file(t, str(path))


def _expect(ref, path, method, exc, *needles, pools=1):
    with pytest.raises(exc) as ei:
        wrapper(ref, path, method, pools=pools).load_weights(PMAP)
    msg = str(ei.value)
    for s in needles:
        assert str(s) in msg, f"{s!r} not in {msg!r}"


def test_corrupt_artifacts(ref, tmp_path, good_artifact):
    lf = "layer_1.safetensors"
    # truncated layer file
    d = _copy(good_artifact, tmp_path / "trunc")
    data = (d / lf).read_bytes()
    (d / lf).write_bytes(data[: len(data) - 100])
    _expect(ref, d, "AMXINT8", CheckpointError, str(d / lf), "experts.0.gate.qweight")
    # missing key
    d = _copy(good_artifact, tmp_path / "missing")
    _mutate(d / lf, lambda t: t.pop("experts.2.down.scale"))
    _expect(ref, d, "AMXINT8", ValueError, str(d / lf), "experts.2.down.scale")
    # wrong dtype
    d = _copy(good_artifact, tmp_path / "dtype")
    _mutate(d / lf, lambda t: t.update({"experts.1.up.scale": t["experts.1.up.scale"].half()}))
    _expect(ref, d, "AMXINT8", ValueError, str(d / lf), "experts.1.up.scale", "F32", "F16")
    # wrong shape
    d = _copy(good_artifact, tmp_path / "shape")
    _mutate(
        d / lf,
        lambda t: t.update(
            {"experts.3.gate.qweight": t["experts.3.gate.qweight"][:-1].contiguous()}
        ),
    )
    _expect(
        ref, d, "AMXINT8", ValueError, "experts.3.gate.qweight", f"[{I}, {H}]", f"[{I - 1}, {H}]"
    )
    # missing layer file
    d = _copy(good_artifact, tmp_path / "nofile")
    os.remove(d / lf)
    _expect(ref, d, "AMXINT8", FileNotFoundError, str(d / lf))
    # manifest for another method, for another shape, of another version, not JSON
    d = _copy(good_artifact, tmp_path / "int4")
    _expect(ref, d, "AMXINT4", ValueError, art.MANIFEST, "AMXINT8", "int8", "--method AMXINT4")
    _expect(ref, d, "BF16", ValueError, "kt-jit artifact", "AMXINT8")
    mf = d / art.MANIFEST
    m = json.loads(mf.read_text())
    mf.write_text(json.dumps({**m, "moe_intermediate_size": I * 2}))
    _expect(ref, d, "AMXINT8", ValueError, str(mf), "moe_intermediate_size")
    mf.write_text(json.dumps({**m, "format_version": 99}))
    _expect(ref, d, "AMXINT8", ValueError, str(mf), "format_version 99")
    mf.write_text("{not json")
    _expect(ref, d, "AMXINT8", ValueError, str(mf), "cannot read")


def test_convert_errors(ref, tmp_path):
    gate, up, down = make_weights(9)
    src = tmp_path / "hf"
    write_hf(src, {0: (gate, up, down)})
    # a missing expert key: names the key (and the file of its siblings)
    t = safetensors_torch.load_file(str(src / "model-00002-of-00002.safetensors"))
    t.pop("model.layers.0.mlp.experts.3.up_proj.weight")
    safetensors_torch.save_file(t, str(src / "model-00002-of-00002.safetensors"))
    with pytest.raises(ValueError, match=r"experts\.3\.up_proj\.weight"):
        cv.convert(str(src), str(tmp_path / "a"), progress=False)
    assert not os.path.exists(tmp_path / "a" / art.MANIFEST)
    # a wrong dtype
    t["model.layers.0.mlp.experts.3.up_proj.weight"] = up[3].to(torch.int8)
    safetensors_torch.save_file(t, str(src / "model-00002-of-00002.safetensors"))
    with pytest.raises(ValueError, match=r"model-00002-of-00002.safetensors.*experts\.3\.up_proj"):
        cv.convert(str(src), str(tmp_path / "b"), progress=False)
    # fp8 without its scale
    q, _, _ = make_fp8(3)
    src2 = tmp_path / "fp8"
    write_hf(src2, {0: q})
    with pytest.raises(ValueError, match=r"gate_proj\.weight_scale_inv"):
        cv.convert(str(src2), str(tmp_path / "c"), progress=False)
    # no config.json, an unknown method, a non-empty output directory
    os.remove(src2 / "config.json")
    with pytest.raises(FileNotFoundError, match="config.json"):
        cv.convert(str(src2), str(tmp_path / "d"), progress=False)
    with pytest.raises(ValueError, match="BF16"):
        cv.convert(str(src), str(tmp_path / "e"), method="BF16")
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "x").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        cv.convert(str(src), str(tmp_path / "f"), progress=False)
