"""kt-jit's own weight artifact (written by ``kt-jit convert``, ``kt_jit.convert``): the format, its
checks, and the loader that feeds ``MoELayer.load_experts_quantized`` without re-quantizing.

An artifact is a directory::

    kt_jit_artifact.json          manifest (format, version, method, scheme, shape, layers, source)
    config.json                   the source's config.json, copied (shape checks, tools)
    layer_{L}.safetensors         one file per converted MoE layer

holding, per expert e of layer L, the full-I quantized matrices (NUMA-independent):

    experts.{e}.{gate|up}.qweight   int8 [I, H] (int8 scheme) | uint8 [I, H/2] (int4 scheme)
    experts.{e}.{gate|up}.scale     float32 [I]
    experts.{e}.down.qweight        int8 [H, I]               | uint8 [H, I/2]
    experts.{e}.down.scale          float32 [H]

int8 scheme (AMXINT8 / MOE_INT8): q = clamp(rne(w / d), ±127), d = amax/127 per output row.
int4 scheme (AMXINT4 / MOE_INT4): d = amax/112, q4 ∈ [−7, 7] as in formats/int8.cpp, stored as
two's-complement nibbles, element 2j of a row in the low nibble of byte j and 2j+1 in the high
nibble; the kernels receive 16·q4. Loading into S shards slices rows [b_s, b_s+1) of gate/up (with
their scales) and the same columns of down, which keeps its full-row scales: the shard partials
d_h·Σ_{i∈s} a_i·q[h, i] add up to the full row's product, so nothing is re-quantized.

Every error names the file and the key.
"""

from __future__ import annotations

import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from .._progress import load_stats, progress_bar
from .hf import CheckpointError, SafetensorsIndex

logger = logging.getLogger("kt_jit")

MANIFEST = "kt_jit_artifact.json"
FORMAT = "kt-jit-moe-artifact"
FORMAT_VERSION = 1
#: wrapper method -> quantization scheme stored in the artifact
METHOD_SCHEME = {"AMXINT8": "int8", "MOE_INT8": "int8", "AMXINT4": "int4", "MOE_INT4": "int4"}
SCHEME_BITS = {"int8": 8, "int4": 4}
PROJS = ("gate", "up", "down")


def layer_file(layer_idx: int) -> str:
    return f"layer_{int(layer_idx)}.safetensors"


def tensor_key(e: int, proj: str, kind: str) -> str:
    """``experts.{e}.{proj}.{qweight|scale}``"""
    return f"experts.{int(e)}.{proj}.{kind}"


def proj_shape(proj: str, hidden: int, inter: int) -> tuple[int, int]:
    return (inter, hidden) if proj != "down" else (hidden, inter)


def stored_qweight(scheme: str, n: int, k: int) -> tuple[str, tuple[int, int]]:
    """(safetensors dtype, shape) of a stored [n, k] quantized matrix."""
    return ("I8", (n, k)) if scheme == "int8" else ("U8", (n, k // 2))


def is_artifact(weight_path: str) -> bool:
    return bool(weight_path) and os.path.isfile(os.path.join(weight_path, MANIFEST))


def read_manifest(weight_path: str) -> dict:
    """The manifest, checked for format and version (ValueError naming the file)."""
    path = os.path.join(weight_path, MANIFEST)
    try:
        with open(path, "r", encoding="utf-8") as f:
            m = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no kt-jit artifact manifest") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read the artifact manifest: {e}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise ValueError(f"{path}: not a kt-jit artifact manifest (expected format {FORMAT!r})")
    if m.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path}: format_version {m.get('format_version')!r} is not supported by this kt-jit "
            f"(reads version {FORMAT_VERSION}); re-run kt-jit convert"
        )
    for key in ("scheme", "method", "num_experts", "hidden_size", "moe_intermediate_size"):
        if key not in m:
            raise ValueError(f"{path}: manifest key {key!r} is missing")
    if m["scheme"] not in SCHEME_BITS:
        raise ValueError(f"{path}: manifest scheme {m['scheme']!r}, expected one of int8, int4")
    return m


def shard_bounds(inter: int, shards: int) -> list[int]:
    """[0, ..., I] splitting I into ``shards`` near-equal parts on the widest alignment (64, 32,
    16, 8 rows: vector and kt-kernel part boundaries) that leaves every part non-empty."""
    n = max(1, min(int(shards), int(inter)))
    for align in (64, 32, 16, 8, 1):
        units = inter // align
        if units >= n:
            b = [round(s * units / n) * align for s in range(n)] + [inter]
            if all(b[i] < b[i + 1] for i in range(n)):
                return b
    return [0, inter]  # pragma: no cover - align 1 always succeeds


class ArtifactLayer:
    """One layer of an artifact: checks every key's dtype and shape, reads experts."""

    def __init__(self, weight_path: str, manifest: dict, layer_idx: int):
        self.path = weight_path
        self.scheme = manifest["scheme"]
        self.H, self.I = int(manifest["hidden_size"]), int(manifest["moe_intermediate_size"])
        self.layer_idx = int(layer_idx)
        layers = manifest.get("layers", [])
        mpath = os.path.join(weight_path, MANIFEST)
        if self.layer_idx not in layers:
            raise ValueError(
                f"{mpath}: layer {self.layer_idx} is not in the artifact (layers: {layers})"
            )
        files = manifest.get("files", {})
        name = files.get(str(self.layer_idx), layer_file(self.layer_idx))
        self.file = os.path.join(weight_path, name)
        if not os.path.isfile(self.file):
            raise FileNotFoundError(
                f"{self.file}: missing layer file of layer {self.layer_idx} (named in {mpath})"
            )
        self.index = SafetensorsIndex(self.file)

    def check(self, e: int) -> None:
        for proj in PROJS:
            n, k = proj_shape(proj, self.H, self.I)
            qdt, qshape = stored_qweight(self.scheme, n, k)
            for kind, dt, shape in (("qweight", qdt, qshape), ("scale", "F32", (n,))):
                key = tensor_key(e, proj, kind)
                what = f"layer {self.layer_idx}, expert {e} {proj} {kind}"
                if key not in self.index:
                    raise self.index.missing(key, hint=f" ({what})")
                path, got_shape, got_dt = self.index.info(key)
                if got_dt != dt:
                    raise ValueError(
                        f"{path}: tensor {key!r} ({what}): expected dtype {dt} "
                        f"({self.scheme} artifact), got {got_dt}"
                    )
                if tuple(got_shape) != tuple(shape):
                    raise ValueError(
                        f"{path}: tensor {key!r} ({what}): expected shape "
                        f"[{', '.join(map(str, shape))}], got [{', '.join(map(str, got_shape))}]"
                    )

    def read(self, e: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """[(int8 [n, k] values the kernels multiply, float32 [n] scales)] for gate, up, down."""
        from .. import _core

        out = []
        for proj in PROJS:
            n, k = proj_shape(proj, self.H, self.I)
            q = self.index.get_tensor(tensor_key(e, proj, "qweight")).numpy()
            d = self.index.get_tensor(tensor_key(e, proj, "scale")).numpy()
            if self.scheme == "int4":
                q = np.ascontiguousarray(q)
                full = np.empty((n, k), dtype=np.int8)
                _core.unpack_nibbles(q.ctypes.data, n, k, full.ctypes.data)
                q = full
            out.append((np.ascontiguousarray(q), np.ascontiguousarray(d, dtype=np.float32)))
        return out

    def nbytes(self, e: int) -> int:
        return sum(
            int(np.prod(self.index.info(tensor_key(e, p, kind))[1])) * (4 if kind == "scale" else 1)
            for p in PROJS
            for kind in ("qweight", "scale")
        )

    def close(self) -> None:
        self.index.close()


def load_artifact_layer(
    layer,
    weight_path: str,
    layer_idx: int,
    num_experts: int,
    hidden: int,
    intermediate: int,
    pmap: torch.Tensor | None = None,
    method: str = "AMXINT8",
    shards: int = 1,
    batch: int = 16,
    progress: bool | None = None,
):
    """Load layer ``layer_idx`` of a kt-jit artifact.

    ``layer`` is a native MoELayer (its shard_bounds are used as they are) or a factory
    ``f(shard_bounds) -> MoELayer``, called with ``shard_bounds(I, shards)``. Physical slot p
    receives logical expert ``pmap[p]`` (identity when None). Returns (layer, stats) with
    stats = {bytes, seconds, gb_per_s, shards}."""
    E, H, I = int(num_experts), int(hidden), int(intermediate)
    t0 = time.perf_counter()
    m = read_manifest(weight_path)
    mpath = os.path.join(weight_path, MANIFEST)
    want = METHOD_SCHEME.get(method)
    if want is None:
        raise ValueError(
            f"{mpath}: a kt-jit artifact ({m['method']}, {m['scheme']}) loads with methods "
            f"{', '.join(k for k, v in METHOD_SCHEME.items() if v == m['scheme'])}, not {method!r}"
        )
    if m["scheme"] != want:
        raise ValueError(
            f"{mpath}: the artifact was converted for {m['method']} ({m['scheme']} weights); "
            f"method {method!r} needs {want} weights — convert again with --method {method}"
        )
    for field, value in (
        ("num_experts", E),
        ("hidden_size", H),
        ("moe_intermediate_size", I),
    ):
        if int(m[field]) != value:
            raise ValueError(f"{mpath}: {field} is {m[field]}, the wrapper has {value}")
    art = ArtifactLayer(weight_path, m, layer_idx)
    try:
        if hasattr(layer, "load_experts_quantized"):
            bounds = list(layer.shard_bounds)
        else:
            bounds = shard_bounds(I, shards)
            layer = layer(bounds)
        logical = list(range(E)) if pmap is None else [int(v) for v in pmap.tolist()]
        for e in sorted(set(logical)):  # every key's dtype and shape before any data
            art.check(e)

        def read_batch(slots: list[int]):
            return [(p, art.read(logical[p])) for p in slots]

        batches = [list(range(s, min(E, s + batch))) for s in range(0, E, batch)]
        ns = len(bounds) - 1
        bar = progress_bar(E, f"layer {layer_idx} experts", progress is not False)
        nbytes = 0
        with ThreadPoolExecutor(max_workers=1) as ex:
            fut = ex.submit(read_batch, batches[0]) if batches else None
            for i in range(len(batches)):
                items = fut.result()
                fut = ex.submit(read_batch, batches[i + 1]) if i + 1 < len(batches) else None
                slots = [p for p, _ in items]
                nbytes += sum(art.nbytes(logical[p]) for p in slots)
                for s in range(ns):
                    b0, b1 = bounds[s], bounds[s + 1]
                    whole = b0 == 0 and b1 == I
                    ptr = [[], [], [], [], [], []]
                    keep = []
                    for _, ((qg, dg), (qu, du), (qd, dd)) in items:
                        # rows of gate/up (contiguous views), columns of down (a copy) with down's
                        # full-row scales
                        parts = (
                            (qg[b0:b1], dg[b0:b1]),
                            (qu[b0:b1], du[b0:b1]),
                            (qd if whole else np.ascontiguousarray(qd[:, b0:b1]), dd),
                        )
                        keep.append(parts)
                        for j, (q, d) in enumerate(parts):
                            ptr[2 * j].append(q.ctypes.data)
                            ptr[2 * j + 1].append(d.ctypes.data)
                    layer.load_experts_quantized(s, slots, *ptr)
                    del keep
                del items
                if bar is not None:
                    bar.update(len(slots))
        if bar is not None:
            bar.close()
    finally:
        art.close()
    stats = {**load_stats(nbytes, t0), "shards": len(bounds) - 1}
    logger.info(
        "layer %d: loaded %d experts from kt-jit artifact %s (%s, %d shards): "
        "%.1f MB in %.2f s, %.2f GB/s",
        layer_idx,
        E,
        weight_path,
        m["scheme"],
        len(bounds) - 1,
        nbytes / 1e6,
        stats["seconds"],
        stats["gb_per_s"],
    )
    return layer, stats


__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "METHOD_SCHEME",
    "ArtifactLayer",
    "CheckpointError",
    "is_artifact",
    "layer_file",
    "load_artifact_layer",
    "read_manifest",
    "shard_bounds",
    "stored_qweight",
    "tensor_key",
]
