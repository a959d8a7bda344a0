"""BF16 from a Hugging Face checkpoint directory: every key family and prefix, the fused layout,
config.json checks, and a corrupt-file table whose errors name the file and the key."""

from __future__ import annotations

import json
import os

import pytest
import torch

safetensors_torch = pytest.importorskip("safetensors.torch")

E, K, H, I = 4, 2, 64, 32
LAYER = 3

FAMILIES = {
    "deepseek": (
        "mlp.experts.{e}.gate_proj.weight",
        "mlp.experts.{e}.up_proj.weight",
        "mlp.experts.{e}.down_proj.weight",
    ),
    "mixtral": (
        "block_sparse_moe.experts.{e}.w1.weight",
        "block_sparse_moe.experts.{e}.w3.weight",
        "block_sparse_moe.experts.{e}.w2.weight",
    ),
    "mistral": ("experts.{e}.w1.weight", "experts.{e}.w3.weight", "experts.{e}.w2.weight"),
}
BASES = {
    "plain": "model.layers.{L}",
    "language_model": "language_model.model.layers.{L}",
    "model.language_model": "model.language_model.layers.{L}",
}


def make_weights(seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    gate = (torch.randn(E, I, H, generator=g) * 0.1).to(dtype)
    up = (torch.randn(E, I, H, generator=g) * 0.1).to(dtype)
    down = (torch.randn(E, H, I, generator=g) * 0.1).to(dtype)
    return gate, up, down


def write_config(d, **over):
    cfg = {
        "model_type": "test",
        "n_routed_experts": E,
        "num_experts_per_tok": K,
        "hidden_size": H,
        "moe_intermediate_size": I,
        "intermediate_size": 4 * I,
    }
    cfg.update(over)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)


def write_per_expert(d, gate, up, down, family="deepseek", base="plain"):
    """Two files: experts 0..E/2-1 (plus an unrelated tensor) in the first, the rest in the second.
    Returns {(e, 'gate'|'up'|'down'): (file, key)}."""
    b = BASES[base].format(L=LAYER)
    keys = {}
    parts = [{}, {}]
    parts[0][f"{b}.self_attn.q_proj.weight"] = torch.zeros(8, 8, dtype=torch.bfloat16)
    for e in range(E):
        part = 0 if e < E // 2 else 1
        for name, fmt, t in zip(("gate", "up", "down"), FAMILIES[family], (gate, up, down)):
            key = f"{b}.{fmt.format(e=e)}"
            parts[part][key] = t[e].contiguous()
            keys[(e, name)] = (f"model-0000{part + 1}-of-00002.safetensors", key)
    for i, p in enumerate(parts):
        safetensors_torch.save_file(p, os.path.join(d, f"model-0000{i + 1}-of-00002.safetensors"))
    write_config(d)
    return keys


def make_wrapper(ref, path, method="BF16"):
    import kt_jit

    return kt_jit.KTMoEWrapper(
        layer_idx=LAYER,
        num_experts=E,
        num_experts_per_tok=K,
        hidden_size=H,
        moe_intermediate_size=I,
        gpu_experts_mask=None,
        cpuinfer_threads=ref.THREADS,
        threadpool_count=ref.POOLS,
        weight_path=str(path),
        chunked_prefill_size=1024,
        method=method,
    )


def check_same_as_tensors(ref, path, gate, up, down, seed=5):
    pmap = torch.randperm(E, generator=torch.Generator().manual_seed(seed))
    disk = make_wrapper(ref, path)
    disk.load_weights(pmap)
    assert disk.moe is not None and disk.moe.loaded
    mem = make_wrapper(ref, "")
    mem.load_weights_from_tensors(gate, up, down, pmap)
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(seed))
    ids, w = ref.make_routing(6, E, K, seed=seed)
    assert torch.equal(disk.forward(x, ids, w), mem.forward(x, ids, w))
    return disk


@pytest.mark.parametrize("base", list(BASES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_per_expert_families(ref, tmp_path, family, base):
    gate, up, down = make_weights(seed=1)
    write_per_expert(tmp_path, gate, up, down, family=family, base=base)
    disk = check_same_as_tensors(ref, tmp_path, gate, up, down)
    assert disk.load_stats["bytes"] == 2 * (2 * E * I * H + E * H * I)


@pytest.mark.parametrize("base", ["plain", "model.language_model"])
def test_fused_layout(ref, tmp_path, base):
    gate, up, down = make_weights(seed=2)
    b = BASES[base].format(L=LAYER)
    safetensors_torch.save_file(
        {f"{b}.mlp.experts.gate_up_proj": torch.cat([gate, up], dim=1).contiguous()},
        str(tmp_path / "model-00001-of-00002.safetensors"),
    )
    safetensors_torch.save_file(
        {f"{b}.mlp.experts.down_proj": down}, str(tmp_path / "model-00002-of-00002.safetensors")
    )
    write_config(tmp_path, text_config={"num_experts": E, "moe_intermediate_size": I})
    check_same_as_tensors(ref, tmp_path, gate, up, down)


def test_fp32_and_fp16_sources(ref, tmp_path):
    gate, up, down = make_weights(seed=3, dtype=torch.float32)
    # expert 0 fully fp16, expert 1 mixed (fp16 gate), the rest fp32
    b = BASES["plain"].format(L=LAYER)
    tensors = {}
    for e in range(E):
        for fmt, t in zip(FAMILIES["deepseek"], (gate, up, down)):
            tensors[f"{b}.{fmt.format(e=e)}"] = t[e].clone()
    for fmt in FAMILIES["deepseek"]:
        tensors[f"{b}.{fmt.format(e=0)}"] = tensors[f"{b}.{fmt.format(e=0)}"].half()
    tensors[f"{b}.{FAMILIES['deepseek'][0].format(e=1)}"] = gate[1].half()
    safetensors_torch.save_file(tensors, str(tmp_path / "model.safetensors"))
    g2, u2, d2 = gate.clone(), up.clone(), down.clone()
    g2[0], u2[0], d2[0] = g2[0].half().float(), u2[0].half().float(), d2[0].half().float()
    g2[1] = g2[1].half().float()
    check_same_as_tensors(ref, tmp_path, g2, u2, d2)


# ------------------------------------------------------------------------------------------------
# errors: each names the file and the key


def _expect_error(ref, path, exc, *needles):
    wr = make_wrapper(ref, path)
    with pytest.raises(exc) as ei:
        wr.load_weights(torch.arange(E))
    msg = str(ei.value)
    for n in needles:
        assert n in msg, f"{n!r} not in error message: {msg}"
    assert wr.moe is None


def test_truncated_file(ref, tmp_path):
    keys = write_per_expert(tmp_path, *make_weights(seed=4))
    fname, key = keys[(E // 2, "gate")]  # the first key the loader wants from the second file
    p = tmp_path / fname
    size = p.stat().st_size
    with open(p, "r+b") as f:
        f.truncate(size // 2)
    _expect_error(ref, tmp_path, RuntimeError, fname, key)


def test_garbage_file(ref, tmp_path):
    keys = write_per_expert(tmp_path, *make_weights(seed=4))
    fname, key = keys[(0, "gate")]
    p = tmp_path / fname
    p.write_bytes(os.urandom(p.stat().st_size))
    # the header is garbage too, so the key is "not found": the message says which file may hold it
    _expect_error(ref, tmp_path, RuntimeError, fname, key, "unreadable (truncated or corrupt)")


def test_wrong_dtype(ref, tmp_path):
    keys = write_per_expert(tmp_path, *make_weights(seed=5))
    fname, key = keys[(1, "up")]
    tensors = safetensors_torch.load_file(str(tmp_path / fname))
    tensors[key] = torch.zeros(I, H, dtype=torch.int8)
    safetensors_torch.save_file(tensors, str(tmp_path / fname))
    _expect_error(ref, tmp_path, ValueError, fname, key, "I8")


def test_missing_key(ref, tmp_path):
    keys = write_per_expert(tmp_path, *make_weights(seed=6))
    fname, key = keys[(2, "up")]
    tensors = safetensors_torch.load_file(str(tmp_path / fname))
    del tensors[key]
    safetensors_torch.save_file(tensors, str(tmp_path / fname))
    _expect_error(ref, tmp_path, ValueError, fname, key)


def test_wrong_shape(ref, tmp_path):
    keys = write_per_expert(tmp_path, *make_weights(seed=7))
    fname, key = keys[(0, "gate")]
    tensors = safetensors_torch.load_file(str(tmp_path / fname))
    tensors[key] = torch.zeros(I, H + 1, dtype=torch.bfloat16)
    safetensors_torch.save_file(tensors, str(tmp_path / fname))
    _expect_error(ref, tmp_path, ValueError, fname, key, f"[{I}, {H + 1}]")


def test_config_shape_mismatch(ref, tmp_path):
    write_per_expert(tmp_path, *make_weights(seed=8))
    write_config(tmp_path, moe_intermediate_size=I * 2)
    _expect_error(
        ref, tmp_path, ValueError, "config.json", "moe_intermediate_size", str(I), str(2 * I)
    )


def test_missing_directory_and_no_files(ref, tmp_path):
    _expect_error(ref, tmp_path / "nope", FileNotFoundError, "nope")
    write_config(tmp_path)
    _expect_error(ref, tmp_path, FileNotFoundError, "safetensors", str(tmp_path))


def test_no_expert_keys_for_layer(ref, tmp_path):
    write_per_expert(tmp_path, *make_weights(seed=9))
    wr = make_wrapper(ref, tmp_path)
    wr.layer_idx = LAYER + 1
    with pytest.raises(ValueError, match=f"layer {LAYER + 1}"):
        wr.load_weights(torch.arange(E))


def test_moe_int8_on_a_hf_checkpoint_names_the_missing_kt_kernel_key(ref, tmp_path):
    # MOE_INT8 reads kt-kernel's converted files (test_loader_ktkernel.py), not HF checkpoints
    write_per_expert(tmp_path, *make_weights(seed=9))
    wr = make_wrapper(ref, tmp_path, method="MOE_INT8")
    with pytest.raises(ValueError, match=rf"blk\.{LAYER}\.ffn_up_exps\.0\.numa\.0\.weight"):
        wr.load_weights(torch.arange(E))
