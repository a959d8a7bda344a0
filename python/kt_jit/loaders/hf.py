"""Hugging Face checkpoints: ``config.json`` shape discovery, an index over ``*.safetensors``, the
expert key families (SPEC §5), and the BF16 loader that feeds ``MoELayer.load_experts``.

Every error names the file and the tensor key it is about (FileNotFoundError for a missing
directory or no safetensors files, ValueError for a missing key, wrong dtype or shape,
``CheckpointError`` — a RuntimeError — for a file that cannot be read).
"""

from __future__ import annotations

import json
import logging
import os
import struct
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

logger = logging.getLogger("kt_jit")

from .._progress import load_stats, progress_bar

#: safetensors dtype names → load_experts dtype strings.
_SOURCE_DTYPES = {"BF16": "bf16", "F16": "f16", "F32": "f32"}
_ELEM_BYTES = {"bf16": 2, "f16": 2, "f32": 4}

#: config.json keys, first present wins.
_CONFIG_KEYS = {
    "num_experts": ("n_routed_experts", "num_experts", "num_local_experts"),
    "num_experts_per_tok": ("num_experts_per_tok",),
    "hidden_size": ("hidden_size",),
    "moe_intermediate_size": ("moe_intermediate_size", "intermediate_size"),
}

#: Where layer L lives: "" / "language_model." prefixes, VL models' model.language_model.layers,
#: and (as kt-kernel also tries) the bare "layers." without "model.".
_LAYER_BASES = (
    "model.layers.{L}",
    "language_model.model.layers.{L}",
    "model.language_model.layers.{L}",
    "layers.{L}",
)
#: Per-expert families: (name, gate, up, down) suffixes after the layer base.
_EXPERT_FAMILIES = (
    (
        "deepseek",
        "mlp.experts.{e}.gate_proj.weight",
        "mlp.experts.{e}.up_proj.weight",
        "mlp.experts.{e}.down_proj.weight",
    ),
    (
        "mixtral",
        "block_sparse_moe.experts.{e}.w1.weight",
        "block_sparse_moe.experts.{e}.w3.weight",
        "block_sparse_moe.experts.{e}.w2.weight",
    ),
    ("mistral", "experts.{e}.w1.weight", "experts.{e}.w3.weight", "experts.{e}.w2.weight"),
)
#: Fused family: gate_up [E, 2I, H] (first I rows of each expert = gate), down [E, H, I].
_FUSED_FAMILIES = (
    ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"),
    ("mlp.experts.gate_up_proj.weight", "mlp.experts.down_proj.weight"),
)


class CheckpointError(RuntimeError):
    """A checkpoint file that cannot be read (truncated, corrupt)."""


def _shape_str(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


# ------------------------------------------------------------------------------------------------
# config.json


def find_config(weight_path: str) -> str | None:
    """The ``config.json`` for ``weight_path`` (a directory, or a .safetensors file in one), or
    None when there is none."""
    d = weight_path if os.path.isdir(weight_path) else os.path.dirname(weight_path) or "."
    p = os.path.join(d, "config.json")
    return p if os.path.isfile(p) else None


def read_model_shape(weight_path: str) -> dict[str, tuple[str, int]] | None:
    """``{field: (config key, value)}`` for num_experts, num_experts_per_tok, hidden_size and
    moe_intermediate_size as found in config.json (``text_config`` unwrapped); fields whose keys
    are absent are left out. None when there is no config.json."""
    path = find_config(weight_path)
    if path is None:
        return None
    try:
        with open(path, "r", encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read config.json: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    text = cfg.get("text_config")
    if isinstance(text, dict):
        cfg = {**cfg, **text}
    out: dict[str, tuple[str, int]] = {}
    for field, keys in _CONFIG_KEYS.items():
        for k in keys:
            v = cfg.get(k)
            if isinstance(v, int) and not isinstance(v, bool):
                out[field] = (k, int(v))
                break
    return out


def check_model_shape(
    weight_path: str,
    num_experts: int,
    num_experts_per_tok: int,
    hidden_size: int,
    moe_intermediate_size: int,
) -> None:
    """ValueError naming the config.json key when the wrapper's shape disagrees with it."""
    shape = read_model_shape(weight_path)
    if not shape:
        return
    expected = {
        "num_experts": num_experts,
        "num_experts_per_tok": num_experts_per_tok,
        "hidden_size": hidden_size,
        "moe_intermediate_size": moe_intermediate_size,
    }
    for field, (key, value) in shape.items():
        if value != expected[field]:
            raise ValueError(
                f"{field}: the wrapper has {expected[field]} but {find_config(weight_path)} says "
                f"{key} = {value}"
            )


# ------------------------------------------------------------------------------------------------
# safetensors index


def _read_header_keys(path: str) -> list[str]:
    """Tensor names from a safetensors header, read by hand (for files safetensors refuses)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                return []
            (n,) = struct.unpack("<Q", raw)
            if n > 100 * 1024 * 1024:
                return []
            header = json.loads(f.read(n).decode("utf-8"))
        return [k for k in header if k != "__metadata__"] if isinstance(header, dict) else []
    except Exception:
        return []


class SafetensorsIndex:
    """Every tensor in the ``*.safetensors`` files of a directory (or one file): name → file,
    shape, dtype. Files are memory-mapped by safetensors and tensors read lazily, one key at a
    time."""

    def __init__(self, weight_path: str):
        if not weight_path or not os.path.exists(weight_path):
            raise FileNotFoundError(f"weight_path: {weight_path!r} does not exist")
        if os.path.isdir(weight_path):
            files = sorted(
                os.path.join(weight_path, n)
                for n in os.listdir(weight_path)
                if n.endswith(".safetensors") and os.path.isfile(os.path.join(weight_path, n))
            )
        else:
            files = [weight_path] if weight_path.endswith(".safetensors") else []
        if not files:
            raise FileNotFoundError(f"weight_path: no *.safetensors files in {weight_path!r}")
        try:
            from safetensors import safe_open
        except ImportError as e:  # pragma: no cover - declared dependency
            raise ImportError(
                "loading a Hugging Face checkpoint needs the 'safetensors' package "
                "(pip install safetensors)"
            ) from e
        self._safe_open = safe_open
        self.weight_path = weight_path
        self.files = files
        self.entries: dict[str, tuple[str, tuple[int, ...], str]] = {}
        #: keys a file's header names although the file itself cannot be read → (file, error)
        self.broken: dict[str, tuple[str, str]] = {}
        self.broken_files: dict[str, str] = {}
        self._handles: dict[str, object] = {}
        for path in files:
            try:
                h = safe_open(path, framework="pt")
                for k in h.keys():
                    sl = h.get_slice(k)
                    self.entries[k] = (path, tuple(int(s) for s in sl.get_shape()), sl.get_dtype())
                self._handles[path] = h
            except Exception as e:  # truncated / corrupt: remember it and carry on
                msg = f"{type(e).__name__}: {e}"
                self.broken_files[path] = msg
                for k in _read_header_keys(path):
                    self.broken.setdefault(k, (path, msg))
                logger.warning("%s: cannot read safetensors file (%s)", path, msg)

    def __contains__(self, key: str) -> bool:
        return key in self.entries or key in self.broken

    def close(self) -> None:
        self._handles.clear()

    def _check_readable(self, key: str) -> tuple[str, tuple[int, ...], str]:
        if key in self.entries:
            return self.entries[key]
        if key in self.broken:
            path, msg = self.broken[key]
            raise CheckpointError(
                f"{path}: cannot read tensor {key!r}: the file is truncated or corrupt ({msg})"
            )
        raise self.missing(key)

    def missing(self, key: str, hint: str = "") -> Exception:
        """ValueError for a key no file has; CheckpointError when some file could not be read
        (the key may be in it)."""
        names = ", ".join(os.path.basename(p) for p in self.files)
        if not self.broken_files:
            return ValueError(
                f"tensor {key!r} not found in {self.weight_path} ({len(self.files)} safetensors "
                f"files: {names}){hint}"
            )
        # A corrupt header hides a file's names, so the cause comes first, not "not found".
        unreadable = "; ".join(f"{p} ({m})" for p, m in self.broken_files.items())
        return CheckpointError(
            f"tensor {key!r} not found in the readable files of {self.weight_path}, and "
            f"{len(self.broken_files)} of its {len(self.files)} safetensors files are "
            f"unreadable (truncated or corrupt) and may hold it: {unreadable}{hint}"
        )

    def info(self, key: str) -> tuple[str, tuple[int, ...], str]:
        """(file, shape, safetensors dtype) of ``key``; errors name the file and key."""
        return self._check_readable(key)

    def _handle(self, path: str):
        h = self._handles.get(path)
        if h is None:
            h = self._safe_open(path, framework="pt")
            self._handles[path] = h
        return h

    def get_tensor(self, key: str) -> torch.Tensor:
        path, _, _ = self._check_readable(key)
        try:
            return self._handle(path).get_tensor(key)
        except Exception as e:
            raise CheckpointError(
                f"{path}: cannot read tensor {key!r}: {type(e).__name__}: {e}"
            ) from None

    def get_row(self, key: str, index: int) -> torch.Tensor:
        """``tensor[index]`` of a stacked tensor, read alone through get_slice."""
        path, _, _ = self._check_readable(key)
        try:
            return self._handle(path).get_slice(key)[index]
        except Exception as e:
            raise CheckpointError(
                f"{path}: cannot read tensor {key!r}[{index}]: {type(e).__name__}: {e}"
            ) from None


# ------------------------------------------------------------------------------------------------
# key families


class _Layout:
    """How one layer's experts are stored: per-expert keys or fused stacks."""

    def __init__(self, base: str, family: str, keys=None, fused=None):
        self.base, self.family, self.keys, self.fused = base, family, keys, fused

    def expert_keys(self, e: int) -> tuple[str, str, str]:
        return tuple(f"{self.base}.{k.format(e=e)}" for k in self.keys)  # type: ignore


def _detect_layout(index: SafetensorsIndex, layer_idx: int, num_experts: int) -> _Layout:
    best, best_hits = None, 0
    for b in _LAYER_BASES:
        base = b.format(L=layer_idx)
        for gu, dn in _FUSED_FAMILIES:
            gk, dk = f"{base}.{gu}", f"{base}.{dn}"
            hits = (gk in index) + (dk in index)
            if hits > best_hits:
                best, best_hits = _Layout(base, "fused", fused=(gk, dk)), hits
        for name, g, u, d in _EXPERT_FAMILIES:
            lay = _Layout(base, name, keys=(g, u, d))
            hits = sum(k in index for e in range(num_experts) for k in lay.expert_keys(e))
            if hits > best_hits:
                best, best_hits = lay, hits
    if best is None:
        tried = [
            f"{b.format(L=layer_idx)}.{fam[1].format(e=0)}"
            for b in _LAYER_BASES
            for fam in _EXPERT_FAMILIES
        ] + [f"{b.format(L=layer_idx)}.{_FUSED_FAMILIES[0][0]}" for b in _LAYER_BASES]
        raise index.missing(
            tried[0],
            hint=f"; no expert weights of layer {layer_idx} under any known key family "
            f"(tried e.g. {', '.join(repr(t) for t in tried[1:])})",
        )
    return best


# ------------------------------------------------------------------------------------------------
# BF16 loader


def _checked(index: SafetensorsIndex, key: str, shape: Sequence[int], what: str) -> str:
    """Check key's dtype and shape; return the load_experts dtype string."""
    path, got_shape, got_dtype = index.info(key)
    dt = _SOURCE_DTYPES.get(got_dtype)
    if dt is None:
        raise ValueError(
            f"{path}: tensor {key!r} ({what}): expected dtype BF16 (F16 and F32 are accepted "
            f"too), got {got_dtype}"
        )
    if tuple(got_shape) != tuple(shape):
        raise ValueError(
            f"{path}: tensor {key!r} ({what}): expected shape {_shape_str(shape)}, got "
            f"{_shape_str(got_shape)}"
        )
    return dt


def load_bf16_layer(
    layer,
    weight_path: str,
    layer_idx: int,
    num_experts: int,
    hidden: int,
    intermediate: int,
    pmap: torch.Tensor | None = None,
    batch: int = 16,
    progress: bool | None = None,
) -> dict:
    """Load layer ``layer_idx``'s experts from a Hugging Face checkpoint into ``layer`` (a native
    MoELayer made for E=num_experts, H=hidden, I=intermediate): physical slot p gets logical
    expert ``pmap[p]`` (identity when None). Returns {bytes, seconds, gb_per_s, layout}."""
    E, H, I = int(num_experts), int(hidden), int(intermediate)
    t0 = time.perf_counter()
    index = SafetensorsIndex(weight_path)
    try:
        lay = _detect_layout(index, layer_idx, E)
        logical = list(range(E)) if pmap is None else [int(v) for v in pmap.tolist()]

        # Check every tensor (dtype, shape) before reading any data.
        if lay.fused is not None:
            gk, dk = lay.fused
            dt_gu = _checked(index, gk, (E, 2 * I, H), f"layer {layer_idx} fused gate_up_proj")
            dt_dn = _checked(index, dk, (E, H, I), f"layer {layer_idx} fused down_proj")
            dtypes = {e: (dt_gu, dt_gu, dt_dn) for e in range(E)}
        else:
            dtypes = {}
            for e in sorted(set(logical)):
                keys = lay.expert_keys(e)
                for k, what, shape in zip(keys, ("gate", "up", "down"), ((I, H), (I, H), (H, I))):
                    if k not in index:
                        sib = next((s for s in keys if s in index.entries), None)
                        hint = (
                            f"; expert {e}'s other projections are in {index.entries[sib][0]}"
                            if sib
                            else ""
                        )
                        where = f" (layer {layer_idx}, expert {e} {what}){hint}"
                        raise index.missing(k, hint=where)
                dtypes[e] = tuple(
                    _checked(index, k, shape, f"layer {layer_idx}, expert {e} {what}")
                    for k, what, shape in zip(
                        keys, ("gate", "up", "down"), ((I, H), (I, H), (H, I))
                    )
                )

        def read(e: int):
            if lay.fused is not None:
                gu = index.get_row(lay.fused[0], e)
                tensors = [gu[:I], gu[I:], index.get_row(lay.fused[1], e)]
            else:
                tensors = [index.get_tensor(k) for k in lay.expert_keys(e)]
            dts = dtypes[e]
            if len(set(dts)) != 1:  # mixed dtypes inside one expert: widen to fp32
                tensors = [t.to(torch.float32) for t in tensors]
                dt = "f32"
            else:
                dt = dts[0]
            return dt, [t.contiguous() for t in tensors]

        def read_batch(slots: list[int]):
            return [(p, *read(logical[p])) for p in slots]

        batches = [list(range(s, min(E, s + batch))) for s in range(0, E, batch)]
        bar = progress_bar(E, f"layer {layer_idx} experts", progress is not False)
        nbytes = 0
        # Read the next batch while the native code packs this one (it releases the GIL).
        with ThreadPoolExecutor(max_workers=1) as ex:
            fut = ex.submit(read_batch, batches[0]) if batches else None
            for i in range(len(batches)):
                items = fut.result()
                fut = ex.submit(read_batch, batches[i + 1]) if i + 1 < len(batches) else None
                by_dtype: dict[str, list] = {}
                for p, dt, ts in items:
                    by_dtype.setdefault(dt, []).append((p, ts))
                    nbytes += sum(t.numel() * t.element_size() for t in ts)
                for dt, group in by_dtype.items():
                    layer.load_experts(
                        [p for p, _ in group],
                        [ts[0].data_ptr() for _, ts in group],
                        [ts[1].data_ptr() for _, ts in group],
                        [ts[2].data_ptr() for _, ts in group],
                        dt,
                    )
                del items, by_dtype
                if bar is not None:
                    bar.update(len(batches[i]))
        if bar is not None:
            bar.close()
    finally:
        index.close()
    stats = load_stats(nbytes, t0)
    logger.info(
        "layer %d: loaded %d experts from %s (%s, %s layout): %.1f MB in %.2f s, %.2f GB/s",
        layer_idx,
        E,
        weight_path,
        lay.base,
        lay.family,
        nbytes / 1e6,
        stats["seconds"],
        stats["gb_per_s"],
    )
    return {**stats, "layout": f"{lay.base}:{lay.family}"}


# ------------------------------------------------------------------------------------------------
# FP8 loader (DeepSeek-V3 style: e4m3 weights with 128x128 block scales, or per-channel scales)


def _check_tensor(index: SafetensorsIndex, key: str, shape, dtypes, what: str) -> str:
    """Check key's dtype (one of ``dtypes``) and shape; returns the dtype string."""
    path, got_shape, got_dtype = index.info(key)
    if got_dtype not in dtypes:
        raise ValueError(
            f"{path}: tensor {key!r} ({what}): expected dtype {' or '.join(dtypes)}, got {got_dtype}"
        )
    if tuple(got_shape) not in [tuple(s) for s in shape]:
        raise ValueError(
            f"{path}: tensor {key!r} ({what}): expected shape "
            f"{' or '.join(_shape_str(s) for s in shape)}, got {_shape_str(got_shape)}"
        )
    return got_dtype


def load_fp8_layer(
    layer,
    weight_path: str,
    layer_idx: int,
    num_experts: int,
    hidden: int,
    intermediate: int,
    pmap: torch.Tensor | None = None,
    block: bool = True,
    batch: int = 16,
) -> dict:
    """Load layer ``layer_idx``'s FP8 experts into ``layer`` (a native MoELayer for method FP8 when
    ``block`` else FP8_PERCHANNEL): per-expert ``.weight`` (F8_E4M3) with ``.weight_scale_inv``
    ([ceil(N/128), ceil(K/128)] fp32, 128x128 blocks) or ``.weight_scale`` ([N] or [N, 1])."""
    E, H, I = int(num_experts), int(hidden), int(intermediate)
    t0 = time.perf_counter()
    index = SafetensorsIndex(weight_path)
    try:
        lay = _detect_layout(index, layer_idx, E)
        if lay.fused is not None:
            raise ValueError(
                f"{weight_path}: layer {layer_idx} stores fused expert tensors "
                f"({lay.fused[0]!r}); FP8 checkpoints are read from per-expert keys"
            )
        logical = list(range(E)) if pmap is None else [int(v) for v in pmap.tolist()]
        suffix = "_scale_inv" if block else "_scale"
        shapes = ((I, H), (I, H), (H, I))
        for e in sorted(set(logical)):
            for k, what, (n, kk) in zip(lay.expert_keys(e), ("gate", "up", "down"), shapes):
                where = f"layer {layer_idx}, expert {e} {what}"
                if k not in index:
                    raise index.missing(k, hint=f" ({where})")
                _check_tensor(index, k, [(n, kk)], ("F8_E4M3",), where)
                sk = k + suffix
                if sk not in index:
                    raise index.missing(sk, hint=f" ({where} scale)")
                sshape = [((n + 127) // 128, (kk + 127) // 128)] if block else [(n,), (n, 1)]
                _check_tensor(index, sk, sshape, ("F32", "BF16", "F16"), where + " scale")

        def read(e: int):
            keys = lay.expert_keys(e)
            w = [index.get_tensor(k).view(torch.uint8).contiguous() for k in keys]
            s = [
                index.get_tensor(k + suffix).to(torch.float32).reshape(-1).contiguous()
                for k in keys
            ]
            return w, s

        nbytes = 0
        bar = progress_bar(E, f"layer {layer_idx} experts", E >= 2 * batch)
        for b0 in range(0, E, batch):
            slots = list(range(b0, min(E, b0 + batch)))
            items = [read(logical[p]) for p in slots]
            nbytes += sum(t.numel() for w, _ in items for t in w)
            layer.load_experts_fp8(
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
        "layer %d: loaded %d FP8 experts from %s (%s): %.1f MB in %.2f s, %.2f GB/s",
        layer_idx,
        E,
        weight_path,
        lay.family,
        nbytes / 1e6,
        stats["seconds"],
        stats["gb_per_s"],
    )
    return {**stats, "layout": f"{lay.base}:{lay.family}"}
