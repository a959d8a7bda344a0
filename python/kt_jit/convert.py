"""``kt-jit convert``: a Hugging Face checkpoint → kt-jit's NUMA-independent weight artifact.

Sources: per-expert bf16 / fp16 / fp32 weights, fused ``gate_up_proj`` / ``down_proj`` stacks, or
float8_e4m3fn weights with 128×128 block scales (``.weight_scale_inv``), under every key family and
prefix ``loaders/hf.py`` recognises; the model shape comes from ``config.json``. Each expert is
quantized with the engine's own per-row quantizers (``_core.quantize_rows`` → formats/int8.cpp), so
an artifact holds exactly the numbers ``load_weights_from_tensors`` computes for one shard. fp8
sources are dequantized block-wise in fp32 first (``w = fp32(e4m3) · scale``, one fp32 product per
element) and then quantized like a fp32 source.

The artifact (format in ``loaders/ktjit.py`` and docs/FORMATS.md) is one safetensors file per MoE
layer plus a manifest; files are written as streams (header first, then expert by expert), so
memory stays at a few experts whatever the layer size.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import struct
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from . import _core
from ._progress import load_stats, progress_bar
from .loaders import hf
from .loaders import ktjit as art

logger = logging.getLogger("kt_jit")

#: safetensors dtypes quantize_rows reads directly
_FLOAT = {"BF16": "bf16", "F16": "f16", "F32": "f32"}
_ST_ELEM = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "I8": 1, "U8": 1}


def parse_layers(spec: str | None) -> list[int] | None:
    """'0,3-5' → [0, 3, 4, 5]; None/'' → None (every MoE layer)."""
    if not spec:
        return None
    out: list[int] = []
    for part in str(spec).split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise ValueError(f"--layers: expected e.g. '0,3-5', got {spec!r}")
        a, b = int(m.group(1)), int(m.group(2) or m.group(1))
        if b < a:
            raise ValueError(f"--layers: empty range {part!r}")
        out.extend(range(a, b + 1))
    return sorted(set(out))


# ------------------------------------------------------------------------------------------------
# streaming safetensors writer


class _StreamWriter:
    """A safetensors file written tensor by tensor in a fixed order: the header (every name, dtype,
    shape and offset) first, then the data; the file appears under its name only when complete."""

    def __init__(self, path: str, entries: list[tuple[str, str, tuple[int, ...]]], meta: dict):
        header: dict = {"__metadata__": {k: str(v) for k, v in meta.items()}}
        self.order: list[tuple[str, int]] = []
        off = 0
        for key, dt, shape in entries:
            n = int(np.prod(shape)) * _ST_ELEM[dt]
            header[key] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + n]}
            self.order.append((key, n))
            off += n
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-(8 + len(raw)) % 8)
        self.path, self.tmp = path, path + ".partial"
        self.f = open(self.tmp, "wb")  # noqa: SIM115 - closed by close() or abort()
        self.f.write(struct.pack("<Q", len(raw)))
        self.f.write(raw)
        self.next = 0
        self.nbytes = 8 + len(raw) + off

    def write(self, key: str, a: np.ndarray) -> None:
        want, n = self.order[self.next]
        if key != want or a.nbytes != n:  # pragma: no cover - internal ordering bug
            raise RuntimeError(f"{self.tmp}: writing {key!r} ({a.nbytes} B), expected {want!r}")
        self.f.write(np.ascontiguousarray(a).data)
        self.next += 1

    def close(self) -> None:
        self.f.close()
        if self.next != len(self.order):  # pragma: no cover - internal ordering bug
            raise RuntimeError(f"{self.tmp}: {len(self.order) - self.next} tensors not written")
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        try:
            self.f.close()
        finally:
            if os.path.exists(self.tmp):
                os.remove(self.tmp)


# ------------------------------------------------------------------------------------------------
# source layers


class _SourceLayer:
    """One MoE layer of a HF checkpoint: checked keys and a reader of one expert as
    [(tensor, quantize_rows dtype)] for gate, up, down."""

    def __init__(self, index: hf.SafetensorsIndex, layer_idx: int, E: int, H: int, I: int):
        self.index, self.L, self.E, self.H, self.I = index, layer_idx, E, H, I
        self.lay = hf._detect_layout(index, layer_idx, E)
        shapes = ((I, H), (I, H), (H, I))
        self.kinds: dict[int, tuple[str, str, str]] = {}
        if self.lay.fused is not None:
            gk, dk = self.lay.fused
            dg = hf._checked(index, gk, (E, 2 * I, H), f"layer {layer_idx} fused gate_up_proj")
            dd = hf._checked(index, dk, (E, H, I), f"layer {layer_idx} fused down_proj")
            self.dtype_name = dg if dg == dd else f"{dg}+{dd}"
            self.nbytes = (2 * I * H * hf._ELEM_BYTES[dg] + H * I * hf._ELEM_BYTES[dd]) * E
            self.kinds = {e: (dg, dg, dd) for e in range(E)}
            return
        names = set()
        self.nbytes = 0
        for e in range(E):
            keys = self.lay.expert_keys(e)
            kinds = []
            for k, what, (n, kk) in zip(keys, ("gate", "up", "down"), shapes):
                where = f"layer {layer_idx}, expert {e} {what}"
                if k not in index:
                    raise index.missing(k, hint=f" ({where})")
                path, shape, dt = index.info(k)
                if dt not in _FLOAT and dt != "F8_E4M3":
                    raise ValueError(
                        f"{path}: tensor {k!r} ({where}): expected dtype BF16, F16, F32 or "
                        f"F8_E4M3 (with .weight_scale_inv), got {dt}"
                    )
                if tuple(shape) != (n, kk):
                    raise ValueError(
                        f"{path}: tensor {k!r} ({where}): expected shape [{n}, {kk}], got "
                        f"{hf._shape_str(shape)}"
                    )
                self.nbytes += n * kk * _ST_ELEM[dt]
                if dt == "F8_E4M3":
                    sk = k + "_scale_inv"
                    if sk not in index:
                        raise index.missing(sk, hint=f" ({where} block scale)")
                    sshape = ((n + 127) // 128, (kk + 127) // 128)
                    hf._check_tensor(index, sk, [sshape], ("F32", "BF16", "F16"), where + " scale")
                    self.nbytes += int(np.prod(sshape)) * _ST_ELEM[index.info(sk)[2]]
                    kinds.append("fp8")
                    names.add("fp8_e4m3_block128")
                else:
                    kinds.append(_FLOAT[dt])
                    names.add(_FLOAT[dt])
            self.kinds[e] = tuple(kinds)
        self.dtype_name = "+".join(sorted(names))

    @property
    def layout(self) -> str:
        return f"{self.lay.base}:{self.lay.family}"

    def read(self, e: int) -> list[tuple[torch.Tensor, str]]:
        I = self.I
        if self.lay.fused is not None:
            gu = self.index.get_row(self.lay.fused[0], e)
            ts = [gu[:I], gu[I:], self.index.get_row(self.lay.fused[1], e)]
            return [(t.contiguous(), k) for t, k in zip(ts, self.kinds[e])]
        out = []
        for key, kind in zip(self.lay.expert_keys(e), self.kinds[e]):
            t = self.index.get_tensor(key)
            if kind == "fp8":
                t, kind = dequantize_fp8_block(t, self.index.get_tensor(key + "_scale_inv")), "f32"
            out.append((t.contiguous(), kind))
        return out


def dequantize_fp8_block(w: torch.Tensor, scale_inv: torch.Tensor, block: int = 128):
    """float8_e4m3fn [n, k] with fp32 scales per 128×128 block → fp32 [n, k] = fp32(w) · scale
    (e4m3 → fp32 is exact; one fp32 rounding per element, in the product)."""
    n, k = w.shape
    s = scale_inv.to(torch.float32)
    s = s.repeat_interleave(block, dim=0)[:n].repeat_interleave(block, dim=1)[:, :k]
    return w.to(torch.float32) * s


# ------------------------------------------------------------------------------------------------
# convert


def _quantize(t: torch.Tensor, kind: str, bits: int) -> tuple[np.ndarray, np.ndarray]:
    n, k = (int(s) for s in t.shape)
    if bits == 8:
        q = np.empty((n, k), dtype=np.int8)
    else:
        if k % 2:
            raise ValueError(f"INT4 artifacts need even row lengths, got a [{n}, {k}] matrix")
        q = np.empty((n, k // 2), dtype=np.uint8)
    d = np.empty(n, dtype=np.float32)
    _core.quantize_rows(t.data_ptr(), kind, n, k, bits, q.ctypes.data, d.ctypes.data, bits == 4)
    return q, d


def _discover_layers(index: hf.SafetensorsIndex, cfg: dict, E: int) -> list[int]:
    n = cfg.get("num_hidden_layers")
    if isinstance(n, int) and n > 0:
        cand = range(n)
    else:  # no config entry: every layer number some key mentions
        nums = set()
        for key in list(index.entries) + list(index.broken):
            m = re.search(r"layers\.(\d+)\.", key)
            if m:
                nums.add(int(m.group(1)))
        cand = sorted(nums)
    out = []
    for L in cand:
        try:
            hf._detect_layout(index, L, E)
        except ValueError:  # a dense layer (no expert keys); CheckpointError propagates
            continue
        out.append(L)
    return out


def _read_config(src: str) -> dict:
    path = hf.find_config(src)
    if path is None:
        return {}
    with open(path, "r", encoding="utf-8") as f:
        cfg = json.load(f)
    text = cfg.get("text_config") if isinstance(cfg, dict) else None
    return {**cfg, **text} if isinstance(text, dict) else cfg


def convert(
    src: str,
    out: str,
    method: str = "AMXINT8",
    layers: list[int] | None = None,
    threads: int | None = None,
    overwrite: bool = False,
    progress: bool | None = None,
    batch: int = 8,
) -> dict:
    """Convert the MoE layers of the HF checkpoint ``src`` into a kt-jit artifact at ``out``.

    ``method``: AMXINT8 / MOE_INT8 (int8 scheme) or AMXINT4 / MOE_INT4 (int4). ``layers``: layer
    indices (default: every layer with expert weights). Returns {layers, bytes_read,
    bytes_written, seconds, gb_per_s (source bytes per second), out}."""
    scheme = art.METHOD_SCHEME.get(method)
    if scheme is None:
        raise ValueError(
            f"method: {method!r} cannot be converted; expected one of "
            f"{', '.join(art.METHOD_SCHEME)}"
        )
    bits = art.SCHEME_BITS[scheme]
    t0 = time.perf_counter()
    if not src or not os.path.exists(src):
        raise FileNotFoundError(f"source: {src!r} does not exist")
    shape = hf.read_model_shape(src)
    if shape is None:
        raise FileNotFoundError(
            f"source: {src!r} has no config.json (it gives num_experts, hidden_size and "
            "moe_intermediate_size)"
        )
    for field in ("num_experts", "hidden_size", "moe_intermediate_size"):
        if field not in shape:
            raise ValueError(
                f"{hf.find_config(src)}: no {field} entry "
                f"({' / '.join(hf._CONFIG_KEYS[field])})"
            )
    E, H, I = (shape[f][1] for f in ("num_experts", "hidden_size", "moe_intermediate_size"))
    K = shape.get("num_experts_per_tok", (None, None))[1]
    if bits == 4 and (H % 2 or I % 2):
        raise ValueError(f"{method}: INT4 artifacts need even hidden_size and I, got {H}, {I}")
    if os.path.exists(out) and not os.path.isdir(out):
        raise FileExistsError(f"out: {out!r} exists and is not a directory")
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        raise FileExistsError(
            f"out: {out!r} is not empty; pass overwrite=True (kt-jit convert --force)"
        )
    os.makedirs(out, exist_ok=True)
    cfg = _read_config(src)

    from .wrapper import _ensure_pool

    nthreads = threads or len(os.sched_getaffinity(0))
    _ensure_pool(int(nthreads), 1, [0], method)

    index = hf.SafetensorsIndex(src)
    read_bytes = written = 0
    done: list[int] = []
    layouts: dict[str, str] = {}
    dtypes: set[str] = set()
    try:
        todo = _discover_layers(index, cfg, E) if layers is None else list(layers)
        if not todo:
            raise ValueError(
                f"source: {src!r} has no MoE layer with expert weights under any known key family"
            )
        for L in todo:
            source = _SourceLayer(index, L, E, H, I)  # checks every key before any data
            layouts[str(L)] = source.layout
            dtypes.add(source.dtype_name)
            entries = []
            for e in range(E):
                for proj in art.PROJS:
                    n, k = art.proj_shape(proj, H, I)
                    qdt, qshape = art.stored_qweight(scheme, n, k)
                    entries.append((art.tensor_key(e, proj, "qweight"), qdt, qshape))
                    entries.append((art.tensor_key(e, proj, "scale"), "F32", (n,)))
            meta = {"format": art.FORMAT, "method": method, "scheme": scheme, "layer": L}
            w = _StreamWriter(os.path.join(out, art.layer_file(L)), entries, meta)
            try:
                _convert_layer(source, w, bits, E, batch, progress, method)
                w.close()
            except BaseException:
                w.abort()
                raise
            read_bytes += source.nbytes
            written += w.nbytes
            done.append(L)
    finally:
        index.close()

    cfg_path = hf.find_config(src)
    if cfg_path and os.path.abspath(os.path.dirname(cfg_path)) != os.path.abspath(out):
        shutil.copyfile(cfg_path, os.path.join(out, "config.json"))
    manifest = {
        "format": art.FORMAT,
        "format_version": art.FORMAT_VERSION,
        "method": method,
        "scheme": scheme,
        "storage": {
            "qweight": (
                "int8 [n, k] row-major, q = clamp(rne(w/d), -127, 127)"
                if scheme == "int8"
                else "uint8 [n, k/2]: signed 4-bit q4 in [-7, 7], element 2j in the low nibble "
                "of byte j, 2j+1 in the high nibble; value 16*q4*d"
            ),
            "scale": "float32 [n], one per output row (d = amax/127 int8, amax/112 int4)",
            "matrices": "gate, up [I, H]; down [H, I]; full I (NUMA-independent)",
        },
        "num_experts": E,
        "num_experts_per_tok": K,
        "hidden_size": H,
        "moe_intermediate_size": I,
        "layers": done,
        "files": {str(L): art.layer_file(L) for L in done},
        "source": {
            "path": os.path.abspath(src),
            "dtype": "+".join(sorted(dtypes)),
            "layout": layouts,
            "fp8": "dequantized block-wise in fp32 (w = fp32(e4m3) * scale) before quantizing",
        },
        "bytes": written,
        "kt_jit_version": _core.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    tmp = os.path.join(out, art.MANIFEST + ".partial")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
    os.replace(tmp, os.path.join(out, art.MANIFEST))
    stats = load_stats(read_bytes, t0)
    stats.update(layers=done, bytes_read=read_bytes, bytes_written=written, out=out, method=method)
    logger.info(
        "converted %d layers x %d experts of %s (%s) to %s (%s): read %.2f GB, wrote %.2f GB "
        "in %.2f s, %.2f GB/s",
        len(done),
        E,
        src,
        manifest["source"]["dtype"],
        out,
        method,
        read_bytes / 1e9,
        written / 1e9,
        stats["seconds"],
        stats["gb_per_s"],
    )
    return stats


def _convert_layer(source: _SourceLayer, w: _StreamWriter, bits: int, E: int, batch, progress, m):
    batches = [list(range(s, min(E, s + batch))) for s in range(0, E, batch)]
    bar = progress_bar(E, f"layer {source.L}: {m}", progress is not False)

    def read_batch(es):
        return [(e, source.read(e)) for e in es]

    def write_batch(items):
        for e, mats in items:
            for proj, (q, d) in zip(art.PROJS, mats):
                w.write(art.tensor_key(e, proj, "qweight"), q)
                w.write(art.tensor_key(e, proj, "scale"), d)

    # read batch i+1 || quantize batch i (native, GIL released) || write batch i-1
    with ThreadPoolExecutor(max_workers=1) as rd, ThreadPoolExecutor(max_workers=1) as wr:
        fut = rd.submit(read_batch, batches[0]) if batches else None
        pending = None
        for i in range(len(batches)):
            items = fut.result()
            fut = rd.submit(read_batch, batches[i + 1]) if i + 1 < len(batches) else None
            quant = [(e, [_quantize(t, kind, bits) for t, kind in mats]) for e, mats in items]
            del items
            if pending is not None:
                pending.result()
            pending = wr.submit(write_batch, quant)
            if bar is not None:
                bar.update(len(quant))
        if pending is not None:
            pending.result()
    if bar is not None:
        bar.close()


def main(argv: list[str] | None = None) -> int:
    """``kt-jit convert SRC OUT [--method M] [--layers 0,3-5] [--threads N] [--force]``"""
    import argparse

    p = argparse.ArgumentParser(
        prog="kt-jit convert",
        description="Convert a Hugging Face MoE checkpoint (bf16/fp16/fp32, or fp8 e4m3 with "
        "128x128 block scales) into a kt-jit artifact: per-layer safetensors of full-I quantized "
        "experts plus a manifest, loadable on any NUMA / pool count without re-quantizing.",
    )
    p.add_argument("src", help="Hugging Face checkpoint directory (*.safetensors + config.json)")
    p.add_argument("out", help="artifact directory to write")
    p.add_argument(
        "--method",
        default="AMXINT8",
        choices=sorted(art.METHOD_SCHEME),
        help="quantization (AMXINT8/MOE_INT8: int8, AMXINT4/MOE_INT4: int4); default AMXINT8",
    )
    p.add_argument("--layers", default=None, help="layers to convert, e.g. '0,3-5' (default: all)")
    p.add_argument("--threads", type=int, default=None, help="worker threads (default: all CPUs)")
    p.add_argument("--force", action="store_true", help="write into a non-empty directory")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    try:
        stats = convert(
            args.src,
            args.out,
            method=args.method,
            layers=parse_layers(args.layers),
            threads=args.threads,
            overwrite=args.force,
            progress=not args.quiet,
        )
    except (ValueError, FileNotFoundError, FileExistsError, hf.CheckpointError) as e:
        print(f"kt-jit convert: error: {e}", file=sys.stderr)
        return 1
    print(
        f"kt-jit convert: {len(stats['layers'])} layers ({args.method}) -> {args.out}: "
        f"read {stats['bytes_read'] / 1e9:.3f} GB, wrote {stats['bytes_written'] / 1e9:.3f} GB "
        f"in {stats['seconds']:.2f} s, {stats['gb_per_s']:.2f} GB/s"
    )
    return 0
