"""MXFP4 / MXFP8 Hugging Face checkpoints (OCP microscaling; DeepSeek-V4-Flash, MiniMax-M3).

Per expert and matrix: ``.weight`` — MXFP4: uint8/int8 ``[N, K/2]`` e2m1 nibbles (low nibble =
even k, bit 3 = sign), MXFP8: F8_E4M3 ``[N, K]`` — and a ue8m0 scale (F8_E8M0 or uint8)
``[N, K/32]``, ``.scale`` (MXFP4's key) or ``.weight_scale_inv`` (MXFP8's). Bytes go to the native
``MoELayer.load_experts_mx`` as they are (memory-mapped, nothing dequantized); see
docs/FORMATS.md "MXFP4 / MXFP8".

Every error names the file and the tensor key (ValueError for a missing key, wrong dtype or
shape, ``CheckpointError`` for a file that cannot be read).
"""

from __future__ import annotations

import logging
import time

import torch

from .._progress import load_stats, progress_bar
from .hf import _LAYER_BASES, SafetensorsIndex, _check_tensor, _Layout

logger = logging.getLogger("kt_jit")

#: Expert key families, most specific first: DeepSeek-V4 (``ffn.experts``, MXFP4),
#: MiniMax-M3 / Mixtral (``block_sparse_moe``, MXFP8), then the other HF families.
_MX_FAMILIES = (
    ("ffn", "ffn.experts.{e}.w1.weight", "ffn.experts.{e}.w3.weight", "ffn.experts.{e}.w2.weight"),
    (
        "mixtral",
        "block_sparse_moe.experts.{e}.w1.weight",
        "block_sparse_moe.experts.{e}.w3.weight",
        "block_sparse_moe.experts.{e}.w2.weight",
    ),
    (
        "deepseek",
        "mlp.experts.{e}.gate_proj.weight",
        "mlp.experts.{e}.up_proj.weight",
        "mlp.experts.{e}.down_proj.weight",
    ),
    ("mistral", "experts.{e}.w1.weight", "experts.{e}.w3.weight", "experts.{e}.w2.weight"),
)

#: Scale key suffixes (replacing ``.weight``) per method, preferred first.
_SCALE_SUFFIXES = {
    "MXFP4": (".scale", ".weight_scale_inv"),
    "MXFP8": (".weight_scale_inv", ".scale"),
}
_WEIGHT_DTYPES = {"MXFP4": ("U8", "I8"), "MXFP8": ("F8_E4M3", "U8", "I8")}
_SCALE_DTYPES = ("F8_E8M0", "U8", "I8")


def _detect(index: SafetensorsIndex, layer_idx: int, num_experts: int) -> _Layout:
    best, best_hits = None, 0
    for b in _LAYER_BASES:
        base = b.format(L=layer_idx)
        for name, g, u, d in _MX_FAMILIES:
            lay = _Layout(base, name, keys=(g, u, d))
            hits = sum(k in index for e in range(num_experts) for k in lay.expert_keys(e))
            if hits > best_hits:
                best, best_hits = lay, hits
    if best is None:
        tried = [
            f"{b.format(L=layer_idx)}.{f[1].format(e=0)}"
            for b in _LAYER_BASES
            for f in _MX_FAMILIES
        ]
        raise index.missing(
            tried[0],
            hint=f"; no expert weights of layer {layer_idx} under any known key family "
            f"(tried e.g. {', '.join(repr(t) for t in tried[1:])})",
        )
    return best


def _scale_key(index: SafetensorsIndex, wkey: str, method: str, where: str) -> str:
    stem = wkey[: -len(".weight")]
    for suf in _SCALE_SUFFIXES[method]:
        if stem + suf in index:
            return stem + suf
    raise index.missing(
        stem + _SCALE_SUFFIXES[method][0],
        hint=f" ({where} scale; also tried {stem + _SCALE_SUFFIXES[method][1]!r})",
    )


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def load_mx_layer(
    layer,
    weight_path: str,
    layer_idx: int,
    num_experts: int,
    hidden: int,
    intermediate: int,
    pmap: torch.Tensor | None = None,
    method: str = "MXFP4",
    batch: int = 16,
) -> dict:
    """Load layer ``layer_idx``'s MXFP4 / MXFP8 experts into ``layer`` (a native MoELayer of that
    method). Every key, dtype and shape is checked before any data is read; physical slot p
    receives logical expert ``pmap[p]`` (identity when None)."""
    if method not in _SCALE_SUFFIXES:
        raise ValueError(f"method: expected MXFP4 or MXFP8, got {method!r}")
    E, H, I = int(num_experts), int(hidden), int(intermediate)
    for name, v in (("hidden_size", H), ("moe_intermediate_size", I)):
        if v % 32:
            raise ValueError(f"{name}: {method} needs a multiple of 32 (the scale group), got {v}")
    fp4 = method == "MXFP4"
    t0 = time.perf_counter()
    index = SafetensorsIndex(weight_path)
    try:
        lay = _detect(index, layer_idx, E)
        logical = list(range(E)) if pmap is None else [int(v) for v in pmap.tolist()]
        shapes = ((I, H), (I, H), (H, I))
        scale_keys: dict[str, str] = {}
        for e in sorted(set(logical)):
            for k, what, (n, kk) in zip(lay.expert_keys(e), ("gate", "up", "down"), shapes):
                where = f"layer {layer_idx}, expert {e} {what}"
                if k not in index:
                    raise index.missing(k, hint=f" ({where})")
                _check_tensor(
                    index, k, [(n, kk // 2 if fp4 else kk)], _WEIGHT_DTYPES[method], where
                )
                sk = _scale_key(index, k, method, where)
                _check_tensor(index, sk, [(n, kk // 32)], _SCALE_DTYPES, where + " scale")
                scale_keys[k] = sk

        def read(e: int):
            keys = lay.expert_keys(e)
            w = [_bytes(index.get_tensor(k)) for k in keys]
            s = [_bytes(index.get_tensor(scale_keys[k])) for k in keys]
            for k, t in zip(keys, s):  # refused by the packer too; named here
                top = int(t.max()) if t.numel() else 0
                if top == 255 or (not fp4 and top >= 247):
                    sk = scale_keys[k]
                    why = (
                        "255 (NaN in ue8m0)"
                        if top == 255
                        else f"{top} (2^{top - 127}): MXFP8 scales above 2^119 are not supported"
                    )
                    raise ValueError(f"{index.info(sk)[0]}: tensor {sk!r}: ue8m0 exponent {why}")
            return w, s

        nbytes = 0
        bar = progress_bar(E, f"layer {layer_idx} experts", E >= 2 * batch)
        for b0 in range(0, E, batch):
            slots = list(range(b0, min(E, b0 + batch)))
            items = [read(logical[p]) for p in slots]
            nbytes += sum(t.numel() for w, s in items for t in (*w, *s))
            layer.load_experts_mx(
                slots,
                *[[it[0][i].data_ptr() for it in items] for i in range(3)],
                *[[it[1][i].data_ptr() for it in items] for i in range(3)],
            )
            if bar is not None:
                bar.update(len(slots))
        if bar is not None:
            bar.close()
    finally:
        index.close()
    stats = load_stats(nbytes, t0)
    logger.info(
        "layer %d: loaded %d %s experts from %s (%s): %.1f MB in %.2f s, %.2f GB/s",
        layer_idx,
        E,
        method,
        weight_path,
        lay.family,
        nbytes / 1e6,
        stats["seconds"],
        stats["gb_per_s"],
    )
    return {**stats, "layout": f"{lay.base}:{lay.family}"}
