"""GGUF checkpoints (method LLAMAFILE): ``blk.{L}.ffn_{gate,up,down}_exps.weight`` from a ``.gguf``
file, a split set (``name-00001-of-0000N.gguf``) or a directory of them, read with the ``gguf``
package's memory-mapped ``GGUFReader``.

Integer block types are decoded per expert (``formats/gguf``: int8 codes, fp32 scales and biases
per K group, bit-exact against ``gguf.quants.dequantize``) and handed to the native layer's
grouped format (``MoELayer.load_experts_grouped``); gate and up share one spec (the finer group,
a bias if either has one, 4-bit codes only when both use the same table). All-float experts
(F32/F16/BF16) go through the BF16 method's path. Experts that mix float and block types are
dequantized to fp32 and take the BF16 path as well (logged).

Every error names the file and the tensor key: FileNotFoundError for a missing path or split
part, ValueError for a missing key, an unsupported type (listing the supported ones), a wrong
shape or a metadata value that disagrees with the wrapper, ``CheckpointError`` for a file the
reader cannot parse (truncated, corrupt).
"""

from __future__ import annotations

import logging
import os
import re
import time

import numpy as np
import torch

from .. import _core
from .._progress import load_stats, progress_bar
from .hf import CheckpointError

logger = logging.getLogger("kt_jit")

PROJS = ("gate", "up", "down")
_SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<n>\d{5})\.gguf$")
_FLOAT_DTYPE = {"F32": "f32", "F16": "f16", "BF16": "bf16"}
#: GGUF metadata keys checked against the wrapper ({arch} = general.architecture)
_META_KEYS = (
    ("num_experts", "{arch}.expert_count"),
    ("num_experts_per_tok", "{arch}.expert_used_count"),
    ("hidden_size", "{arch}.embedding_length"),
    ("moe_intermediate_size", "{arch}.expert_feed_forward_length"),
)


def type_table() -> dict[int, dict]:
    """ggml type id -> {id, name, block, block_bytes, is_float, group, bias, lut}."""
    return {t["id"]: t for t in _core.gguf_types()}


def supported_type_names() -> str:
    return ", ".join(t["name"] for t in _core.gguf_types())


def tensor_key(layer_idx: int, proj: str) -> str:
    return f"blk.{layer_idx}.ffn_{proj}_exps.weight"


def gguf_files(weight_path: str) -> list[str]:
    """The files of ``weight_path``: one .gguf file, every part of a split set given by any of
    its parts, or every .gguf file of a directory (split sets checked complete)."""
    if not weight_path or not os.path.exists(weight_path):
        raise FileNotFoundError(f"weight_path: {weight_path!r} does not exist")
    if os.path.isdir(weight_path):
        files = sorted(
            os.path.join(weight_path, n)
            for n in os.listdir(weight_path)
            if n.endswith(".gguf") and os.path.isfile(os.path.join(weight_path, n))
        )
        if not files:
            raise FileNotFoundError(f"weight_path: no *.gguf files in {weight_path!r}")
    else:
        files = [weight_path]
    out: list[str] = []
    for f in files:
        m = _SPLIT_RE.match(os.path.basename(f))
        if not m:
            out.append(f)
            continue
        n = int(m["n"])
        d = os.path.dirname(f)
        for i in range(1, n + 1):
            part = os.path.join(d, f"{m['stem']}-{i:05d}-of-{n:05d}.gguf")
            if not os.path.isfile(part):
                raise FileNotFoundError(
                    f"{f}: split GGUF part {i} of {n} is missing (expected {part})"
                )
            if part not in out:
                out.append(part)
    return out


class GGUFIndex:
    """Tensors and metadata of a set of GGUF files (memory-mapped; nothing is read until used)."""

    def __init__(self, weight_path: str):
        try:
            from gguf import GGUFReader
        except ImportError as e:  # pragma: no cover - declared dependency
            raise ImportError(
                "method LLAMAFILE reads GGUF files with the 'gguf' package (pip install gguf)"
            ) from e
        self.weight_path = weight_path
        self.files = gguf_files(weight_path)
        self.readers: dict[str, object] = {}
        self.tensors: dict[str, tuple[str, object]] = {}  # name -> (file, ReaderTensor)
        self.broken: dict[str, str] = {}  # file -> error
        for path in self.files:
            try:
                r = GGUFReader(path, "r")
                if getattr(r, "byte_order", "I") != "I":
                    raise ValueError("big-endian GGUF files are not supported")
            except Exception as e:  # truncated / corrupt: remember it; keys then say so
                self.broken[path] = f"{type(e).__name__}: {e}"
                logger.warning("%s: cannot read GGUF file (%s)", path, self.broken[path])
                continue
            self.readers[path] = r
            for t in r.tensors:
                if t.name in self.tensors:
                    prev = self.tensors[t.name][0]
                    raise ValueError(
                        f"tensor {t.name!r} is in two GGUF files: {prev} and {path}; "
                        "point weight_path at one model"
                    )
                self.tensors[t.name] = (path, t)

    def close(self) -> None:
        self.tensors.clear()
        self.readers.clear()

    def missing(self, key: str, hint: str = "") -> Exception:
        names = ", ".join(os.path.basename(p) for p in self.files)
        msg = (
            f"tensor {key!r} not found in {self.weight_path} ({len(self.files)} GGUF files: "
            f"{names}){hint}"
        )
        if self.broken:
            msg += "; unreadable files: " + "; ".join(f"{p} ({m})" for p, m in self.broken.items())
            return CheckpointError(msg)
        return ValueError(msg)

    def tensor(self, key: str, hint: str = ""):
        if key not in self.tensors:
            raise self.missing(key, hint)
        return self.tensors[key]

    def field(self, key: str):
        """(file, value) of a scalar metadata key from the first file that has it, or None."""
        for path, r in self.readers.items():
            f = r.get_field(key)
            if f is None:
                continue
            try:
                v = f.contents()
            except Exception:
                continue
            return path, v
        return None


def _check_metadata(index: GGUFIndex, expected: dict[str, int]) -> None:
    arch = index.field("general.architecture")
    if arch is None or not isinstance(arch[1], str):
        return
    for field, key in _META_KEYS:
        k = key.format(arch=arch[1])
        got = index.field(k)
        if got is None or isinstance(got[1], (list, str)):
            continue
        path, v = got
        if int(v) != expected[field]:
            raise ValueError(
                f"{field}: the wrapper has {expected[field]} but {path} says {k} = {int(v)}"
            )


def _even_bounds(I: int, unit: int, parts: int) -> list[int]:
    """[0, ..., I] in at most ``parts`` slices on multiples of ``unit`` (uneven allowed)."""
    units = I // unit
    parts = max(1, min(parts, units))
    return [units * s // parts * unit for s in range(parts)] + [I]


#: The storage keys of a grouped spec; MoELayer takes each as gu_<key> and down_<key>.
SPEC_KEYS = ("group", "bias", "lut", "code_range", "super_group", "scale_dtype")


def _widest(bounds: list[int]) -> int:
    return max(b - a for a, b in zip(bounds, bounds[1:]))


def gate_up_spec(tg: dict, tu: dict) -> dict:
    """One spec for gate and up (fused in the kernels): the finer group (16 divides 32, scales are
    repeated exactly), a bias if either type has one (zeros for the other), 4-bit codes only when
    both types use the same 16-entry table; byte codes span both types' code ranges (a narrow
    range lets avx2 run offset-code kernels)."""
    lut = tg["lut"] if tg["lut"] and tg["lut"] == tu["lut"] else []
    lo = min(tg["code_range"][0], tu["code_range"][0])
    hi = max(tg["code_range"][1], tu["code_range"][1])
    return {
        "group": min(tg["group"], tu["group"]),
        "bias": tg["bias"] or tu["bias"],
        "lut": lut,
        "code_range": [lo, hi],
        # two-level scales only when both types have them on the same super block
        "super_group": tg["super_group"] if tg["super_group"] == tu["super_group"] else 0,
        # f16 scales (legacy types' d and m) only when both types have them
        "scale_dtype": tg["scale_dtype"] if tg["scale_dtype"] == tu["scale_dtype"] else "",
    }


def _decode(t: dict, raw: np.ndarray, rows: int, k: int, spec: dict):
    """codes [rows, k] int8, scales and (spec bias) biases [rows, k / group] fp32."""
    g = spec["group"]
    codes = np.empty((rows, k), dtype=np.int8)
    scales = np.empty((rows, k // g), dtype=np.float32)
    biases = np.empty((rows, k // g), dtype=np.float32) if spec["bias"] else None
    _core.gguf_decode(
        t["id"],
        raw.ctypes.data,
        rows,
        k,
        g,
        codes.ctypes.data,
        scales.ctypes.data,
        0 if biases is None else biases.ctypes.data,
    )
    return codes, scales, biases


def _dequantize(t: dict, raw: np.ndarray, rows: int, k: int) -> np.ndarray:
    out = np.empty((rows, k), dtype=np.float32)
    _core.gguf_dequantize(t["id"], raw.ctypes.data, rows, k, out.ctypes.data)
    return out


def load_gguf_layer(
    weight_path: str,
    layer_idx: int,
    num_experts: int,
    top_k: int,
    hidden: int,
    intermediate: int,
    pmap: torch.Tensor | None = None,
    pools: int = 1,
    isa: str = "",
    batch: int = 16,
    progress: bool | None = None,
):
    """Build and load the native MoELayer for layer ``layer_idx`` of a GGUF checkpoint: slot p
    gets logical expert ``pmap[p]`` (identity when None). Integer types: one shard per pool,
    split on the down type's block boundaries (256 for K-quants, whose group scales the layer
    keeps as int8 sub-scales times an fp32 factor per block). Returns (layer, stats)."""
    E, H, I = int(num_experts), int(hidden), int(intermediate)
    t0 = time.perf_counter()
    index = GGUFIndex(weight_path)
    try:
        _check_metadata(
            index,
            {
                "num_experts": E,
                "num_experts_per_tok": int(top_k),
                "hidden_size": H,
                "moe_intermediate_size": I,
            },
        )
        table = type_table()
        shapes = {"gate": (E, I, H), "up": (E, I, H), "down": (E, H, I)}
        types, datas = {}, {}
        # Check every tensor (type, shape, size) before reading any data.
        for proj in PROJS:
            key = tensor_key(layer_idx, proj)
            path, t = index.tensor(key, f" (layer {layer_idx} {proj} experts)")
            tid = int(t.tensor_type)
            info = table.get(tid)
            tname = getattr(t.tensor_type, "name", str(tid))
            if info is None:
                raise ValueError(
                    f"{path}: tensor {key!r}: GGML type {tname} is not supported; supported "
                    f"types: {supported_type_names()}"
                )
            shape = tuple(int(s) for s in reversed(t.shape.tolist()))
            if shape != shapes[proj]:
                raise ValueError(
                    f"{path}: tensor {key!r}: expected shape [{', '.join(map(str, shapes[proj]))}]"
                    f" ({'[E, I, H]' if proj != 'down' else '[E, H, I]'}), got "
                    f"[{', '.join(map(str, shape))}]"
                )
            n, k = shapes[proj][1], shapes[proj][2]
            if k % info["block"]:
                raise ValueError(
                    f"{path}: tensor {key!r}: rows of {k} elements are not whole "
                    f"{info['block']}-element {info['name']} blocks"
                )
            nbytes = E * n * (k // info["block"]) * info["block_bytes"]
            raw = np.asarray(t.data).view(np.uint8).reshape(-1)
            if raw.size != nbytes:
                raise CheckpointError(
                    f"{path}: tensor {key!r}: expected {nbytes} bytes of {info['name']} data, "
                    f"the file holds {raw.size} (truncated?)"
                )
            types[proj], datas[proj] = info, raw.reshape(E, n, -1)

        logical = list(range(E)) if pmap is None else [int(v) for v in pmap.tolist()]
        tg, tu, td = types["gate"], types["up"], types["down"]
        all_float = tg["is_float"] and tu["is_float"] and td["is_float"]
        any_float = tg["is_float"] or tu["is_float"] or td["is_float"]
        names = "/".join(types[p]["name"] for p in PROJS)
        if any_float and not all_float:
            logger.warning(
                "layer %d: %s mixes float and block types: experts are dequantized to fp32 and "
                "run as BF16 (2 bytes per weight)",
                layer_idx,
                names,
            )
        dims = {"gate": (I, H), "up": (I, H), "down": (H, I)}
        bar = progress_bar(E, f"layer {layer_idx} experts ({names})", progress is not False)
        nbytes = 0
        if any_float:
            layer = _core.MoELayer(E, int(top_k), H, I, "BF16", isa)
            dts = {_FLOAT_DTYPE.get(types[p]["name"]) for p in PROJS}
            common = dts.pop() if all_float and len(dts) == 1 else "f32"
            if common == "f32":  # fp32 copies: keep a batch under ~512 MB
                batch = max(1, min(batch, (512 << 20) // (3 * I * H * 4)))
            for b0 in range(0, E, batch):
                slots = list(range(b0, min(E, b0 + batch)))
                mats = {p: [] for p in PROJS}
                for s in slots:
                    e = logical[s]
                    for p in PROJS:
                        raw = datas[p][e]
                        nbytes += raw.size
                        if common != "f32":
                            mats[p].append(np.ascontiguousarray(raw))
                        else:
                            raw = np.ascontiguousarray(raw)
                            mats[p].append(_dequantize(types[p], raw, *dims[p]))
                layer.load_experts(
                    slots, *[[m.ctypes.data for m in mats[p]] for p in PROJS], common
                )
                if bar is not None:
                    bar.update(len(slots))
            layout = f"float ({common})"
        else:
            gu = gate_up_spec(tg, tu)
            dn = {k: td[k] for k in SPEC_KEYS}
            bounds = _even_bounds(I, dn["super_group"] or dn["group"], int(pools))
            fine = _even_bounds(I, dn["group"], int(pools))
            if _widest(fine) < _widest(bounds):
                # Pools split down's K (I) on whole super blocks; where that is less even than
                # on groups (Qwen3's I = 768 over 2 pools: 256 + 512 against 384 + 384), down
                # keeps fp32 group scales so the pools stay balanced.
                dn["super_group"], bounds = 0, fine
            layer = _core.MoELayer(
                E,
                int(top_k),
                H,
                I,
                "LLAMAFILE",
                isa,
                shard_bounds=bounds,
                **{
                    f"{side}_{k}": sp[k]
                    for side, sp in (("gu", gu), ("down", dn))
                    for k in SPEC_KEYS
                },
            )
            spec = {"gate": gu, "up": gu, "down": dn}
            # Decoded experts take ~1.3-1.5 bytes per weight: keep a batch under ~512 MB.
            batch = max(1, min(batch, (512 << 20) // (3 * I * H * 3 // 2)))
            for b0 in range(0, E, batch):
                slots = list(range(b0, min(E, b0 + batch)))
                dec = {p: [] for p in PROJS}
                for s in slots:
                    e = logical[s]
                    for p in PROJS:
                        raw = np.ascontiguousarray(datas[p][e])
                        nbytes += raw.size
                        dec[p].append(_decode(types[p], raw, *dims[p], spec[p]))
                ptrs = []
                for p in PROJS:
                    for i in range(3):
                        ptrs.append([0 if d[i] is None else int(d[i].ctypes.data) for d in dec[p]])
                layer.load_experts_grouped(slots, *ptrs)
                del dec
                if bar is not None:
                    bar.update(len(slots))

            def desc(sp):
                two = f" int8 scales x fp32 per {sp['super_group']}" if sp["super_group"] else ""
                two += f" {sp['scale_dtype']} scales" if sp["scale_dtype"] else ""
                return (
                    f"G{sp['group']}{'+bias' if sp['bias'] else ''}"
                    f"{' 4-bit' if sp['lut'] else ' 8-bit'}{two}"
                )

            layout = f"grouped (gate/up {desc(gu)}, down {desc(dn)}, shards {bounds})"

        if bar is not None:
            bar.close()
    finally:
        index.close()
    stats = load_stats(nbytes, t0)
    logger.info(
        "layer %d: loaded %d %s experts from %s (%s): %.1f MB in %.2f s, %.2f GB/s",
        layer_idx,
        E,
        names,
        weight_path,
        layout,
        nbytes / 1e6,
        stats["seconds"],
        stats["gb_per_s"],
    )
    return layer, {**stats, "types": names, "layout": layout}
