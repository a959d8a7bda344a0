"""4-bit group-quantized Hugging Face checkpoints (methods RAWINT4 and GPTQ_INT4) on the qgroup
kernels (docs/FORMATS.md "qgroup", "RAWINT4 / GPTQ_INT4").

- RAWINT4 (compressed-tensors ``pack-quantized``, e.g. Kimi-K2-Thinking): per expert and matrix
  ``{stem}.weight_packed`` — uint8 ``[N, K/2]`` or int32 ``[N, K/8]`` — and ``{stem}.weight_scale``
  (bf16, also f16/f32) ``[N, K/gs]``, optional ``{stem}.weight_shape`` ``[N, K]``. Element k of a row
  is nibble ``k mod 8`` of int32 word ``k/8`` (compressed-tensors ``pack_to_int32``: bits 4j..4j+3
  hold column 8w+j, stored as q + 8), i.e. for the little-endian bytes: byte k/2, low nibble = even
  k. w = (nibble - 8) * scale[row, k / gs]. A ``weight_zero_point`` (asymmetric) is refused.
- GPTQ_INT4 (AutoGPTQ / GPTQModel, sym, no act-order): ``{stem}.qweight`` int32 ``[K/8, N]``
  (nibble j of word r = input k = 8r + j, AutoGPTQ ``pack``), ``{stem}.scales`` (f16, also
  bf16/f32) ``[K/gs, N]``; w = (nibble - 8) * scale[k / gs, col]. ``qzeros`` must hold the
  symmetric zero point everywhere (stored 7 in the ``gptq`` v1 format, which stores zero - 1; 8 in
  ``gptq_v2``), ``g_idx`` must be ``k // gs``; ``desc_act``, ``sym: false`` and ``bits != 4`` from
  ``quantize_config.json`` / ``config.json``'s ``quantization_config`` are refused.

Both map to the qgroup form exactly: codes = nibble - 8 in [-8, 7] stored as nibbles through the
table ``lut[i] = i - 8``, fp32 scales per (row, group) (bf16/f16 -> fp32 is exact), no bias. Each
expert is decoded in one pass from the memory-mapped file into an int8 code matrix and an fp32
scale matrix (``_core.int4_decode_rows`` / ``int4_decode_gptq``, python/bindings_int4.cpp; torch
bit ops when the build lacks them) and handed to ``MoELayer.load_experts_grouped``; the next batch is
decoded while the native code packs this one. Gate and up share one group size (the finer one;
the coarser matrix's scales are repeated, exactly); the layer gets one shard per worker pool on
down's group boundaries (``_core.grouped_shard_bounds``).

Every error names the file and the tensor key (ValueError for a missing key, a wrong dtype or
shape, a group size that does not divide or is not a multiple of 16, a refused GPTQ variant;
``CheckpointError`` for a truncated or corrupt file). All dtypes and shapes — and the small
qzeros / g_idx / weight_shape tensors — are checked before any weight data is read.
"""

from __future__ import annotations

import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from .. import _core
from .._progress import load_stats, progress_bar
from .hf import _LAYER_BASES, SafetensorsIndex, _shape_str

logger = logging.getLogger("kt_jit")

METHODS = ("RAWINT4", "GPTQ_INT4")
PROJS = ("gate", "up", "down")
#: nibble i stands for code i - 8 (RAWINT4 and symmetric GPTQ alike)
LUT = list(range(-8, 8))
#: Per-expert key families: (name, gate stem, up stem, down stem) after the layer base.
FAMILIES = (
    ("deepseek", "mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.down_proj"),
    ("mixtral", "block_sparse_moe.experts.{e}.w1", "block_sparse_moe.experts.{e}.w3",
     "block_sparse_moe.experts.{e}.w2"),
    ("mistral", "experts.{e}.w1", "experts.{e}.w3", "experts.{e}.w2"),
)  # fmt: skip
#: The tensor that marks a matrix in each method (used to detect the family).
_MAIN = {"RAWINT4": "weight_packed", "GPTQ_INT4": "qweight"}
_SCALE_DTYPES = ("BF16", "F16", "F32")
#: checkpoint scale dtype -> the 16-bit type the layer keeps it in (fp32 scales stay fp32)
_HALF = {"BF16": "bf16", "F16": "f16"}


class _Stems:
    def __init__(self, base: str, family: str, stems: tuple[str, str, str]):
        self.base, self.family, self.stems = base, family, stems

    def stem(self, e: int, proj: int) -> str:
        return f"{self.base}.{self.stems[proj].format(e=e)}"


def _detect(index: SafetensorsIndex, layer_idx: int, E: int, method: str) -> _Stems:
    main = _MAIN[method]
    best, best_hits = None, 0
    for b in _LAYER_BASES:
        base = b.format(L=layer_idx)
        for name, *stems in FAMILIES:
            lay = _Stems(base, name, tuple(stems))
            hits = sum(f"{lay.stem(e, p)}.{main}" in index for e in range(E) for p in range(3))
            if hits > best_hits:
                best, best_hits = lay, hits
    if best is None:
        tried = [
            f"{b.format(L=layer_idx)}.{f[1].format(e=0)}.{main}"
            for b in _LAYER_BASES
            for f in FAMILIES
        ]
        other = "qweight (GPTQ_INT4)" if method == "RAWINT4" else "weight_packed (RAWINT4)"
        raise index.missing(
            tried[0],
            hint=f"; no {method} expert weights (.{main}) of layer {layer_idx} under any known key "
            f"family (tried e.g. {', '.join(repr(t) for t in tried[1:4])}; a checkpoint with "
            f".{other} keys loads with the other method)",
        )  # fmt: skip
    return best


# ------------------------------------------------------------------------------------------------
# quantization config (GPTQ)


def _read_json(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "r", encoding="utf-8") as f:
            v = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read JSON: {e}") from None
    return v if isinstance(v, dict) else None


def gptq_config(weight_path: str) -> dict:
    """The GPTQ settings of a checkpoint: ``quantize_config.json`` and ``config.json``'s
    ``quantization_config`` (either may be absent), checked: bits 4, sym, no desc_act. Returns
    {bits, group_size, checkpoint_format, source} (group_size None when not given)."""
    d = weight_path if os.path.isdir(weight_path) else os.path.dirname(weight_path) or "."
    found: list[tuple[str, dict]] = []
    qc = _read_json(os.path.join(d, "quantize_config.json"))
    if qc is not None:
        found.append((os.path.join(d, "quantize_config.json"), qc))
    cfg = _read_json(os.path.join(d, "config.json"))
    if cfg is not None:
        q = cfg.get("quantization_config")
        if not isinstance(q, dict) and isinstance(cfg.get("text_config"), dict):
            q = cfg["text_config"].get("quantization_config")
        if isinstance(q, dict):
            found.append((os.path.join(d, "config.json") + ": quantization_config", q))
    out = {"bits": 4, "group_size": None, "checkpoint_format": "gptq", "source": None}
    for src, q in found:
        qm = q.get("quant_method")
        if isinstance(qm, str) and qm.lower() not in ("gptq",):
            hint = (
                " (compressed-tensors checkpoints load with method RAWINT4)"
                if "compressed" in qm
                else ""
            )
            raise ValueError(
                f"{src}: quant_method = {qm!r}; method GPTQ_INT4 reads GPTQ checkpoints{hint}"
            )  # fmt: skip
        bits = q.get("bits", 4)
        if bits != 4:
            raise ValueError(f"{src}: bits = {bits!r}; GPTQ_INT4 reads 4-bit GPTQ checkpoints only")
        if q.get("desc_act") is True:
            raise ValueError(
                f"{src}: desc_act = true (act-order, permuted groups through g_idx) is not "
                "supported by GPTQ_INT4 (as in kt-kernel); re-quantize with desc_act = false"
            )
        if q.get("sym") is False:
            raise ValueError(
                f"{src}: sym = false (asymmetric zero points in qzeros) is not supported by "
                "GPTQ_INT4 (as in kt-kernel: value = (nibble - 8) * scale); re-quantize with sym = true"
            )  # fmt: skip
        gs = q.get("group_size")
        if isinstance(gs, int) and not isinstance(gs, bool) and out["group_size"] is None:
            out["group_size"] = gs
        fmt = q.get("checkpoint_format")
        if isinstance(fmt, str):
            out["checkpoint_format"] = fmt.lower()
        out["source"] = out["source"] or src
    return out


# ------------------------------------------------------------------------------------------------
# checks (no weight data read)


def _info(index: SafetensorsIndex, key: str, what: str):
    if key not in index:
        raise index.missing(key, hint=f" ({what})")
    return index.info(key)


def _dtype_error(path, key, what, expected, got):
    return ValueError(f"{path}: tensor {key!r} ({what}): expected dtype {expected}, got {got}")


def _shape_error(path, key, what, expected, got):
    return ValueError(
        f"{path}: tensor {key!r} ({what}): expected shape {expected}, got {_shape_str(got)}"
    )


def _group_of(path, key, what, k: int, ngroups: int) -> int:
    if ngroups <= 0 or k % ngroups:
        raise ValueError(
            f"{path}: tensor {key!r} ({what}): {ngroups} scale groups do not divide the "
            f"{k} inputs of a row (group size K / groups must be a whole number)"
        )
    g = k // ngroups
    if g % 16:
        raise ValueError(
            f"{path}: tensor {key!r} ({what}): group size {g} (= {k} / {ngroups}) is not a "
            "multiple of 16, which the qgroup kernels need"
        )
    return g


def _check_rawint4(index, stem: str, n: int, k: int, what: str):
    """(packing 'u8'|'i32', scale dtype, group) of one compressed-tensors matrix."""
    pk = f"{stem}.weight_packed"
    path, shape, dt = _info(index, pk, what)
    if dt in ("U8", "I8"):
        if tuple(shape) != (n, k // 2) or k % 2:
            raise _shape_error(path, pk, what, f"[{n}, {k // 2}] ([N, K/2] bytes)", shape)
        packing = "u8"
    elif dt == "I32":
        if tuple(shape) != (n, k // 8) or k % 8:
            raise _shape_error(path, pk, what, f"[{n}, {k // 8}] ([N, K/8] int32)", shape)
        packing = "i32"
    else:
        raise _dtype_error(path, pk, what, "U8 ([N, K/2]) or I32 ([N, K/8])", dt)
    sk = f"{stem}.weight_scale"
    spath, sshape, sdt = _info(index, sk, what + " scale")
    if sdt not in _SCALE_DTYPES:
        raise _dtype_error(spath, sk, what + " scale", "BF16 (F16 and F32 are accepted too)", sdt)
    if len(sshape) != 2 or sshape[0] != n:
        raise _shape_error(spath, sk, what + " scale", f"[{n}, K/group] with K = {k}", sshape)
    g = _group_of(spath, sk, what + " scale", k, int(sshape[1]))
    zk = f"{stem}.weight_zero_point"
    if zk in index:
        raise ValueError(
            f"{index.info(zk)[0]}: tensor {zk!r} ({what}): asymmetric compressed-tensors weights "
            "(zero points) are not supported by RAWINT4 (as in kt-kernel: value = (nibble - 8) * "
            "scale)"
        )
    wk = f"{stem}.weight_shape"
    if wk in index:
        wpath, _wshape, _ = index.info(wk)
        v = [int(x) for x in index.get_tensor(wk).reshape(-1).tolist()]
        if v != [n, k]:
            raise ValueError(
                f"{wpath}: tensor {wk!r} ({what}): the weight shape is {v}, expected [{n}, {k}]"
            )
    return packing, sdt, g


def _check_gptq(index, stem: str, n: int, k: int, what: str, cfg: dict):
    """(scale dtype, group) of one GPTQ matrix; reads only qzeros and g_idx."""
    qk = f"{stem}.qweight"
    path, shape, dt = _info(index, qk, what)
    if dt != "I32":
        raise _dtype_error(path, qk, what, "I32 ([K/8, N] packed nibbles)", dt)
    if tuple(shape) != (k // 8, n) or k % 8:
        hint = ""
        if len(shape) == 2 and shape[0] * 8 != k and shape[0] * 32 // k in (2, 3, 8):
            hint = f" (that is {shape[0] * 32 // k}-bit packing; GPTQ_INT4 reads 4 bits)"
        raise _shape_error(path, qk, what, f"[{k // 8}, {n}] ([K/8, N] int32){hint}", shape)
    sk = f"{stem}.scales"
    spath, sshape, sdt = _info(index, sk, what + " scales")
    if sdt not in _SCALE_DTYPES:
        raise _dtype_error(spath, sk, what + " scales", "F16 (BF16 and F32 are accepted too)", sdt)
    if len(sshape) != 2 or sshape[1] != n:
        raise _shape_error(spath, sk, what + " scales", f"[K/group, {n}] with K = {k}", sshape)
    g = _group_of(spath, sk, what + " scales", k, int(sshape[0]))
    gs = cfg.get("group_size")
    if gs is not None and gs != g and not (gs == -1 and g == k):
        raise ValueError(
            f"{spath}: tensor {sk!r} ({what} scales): group size {g} (= {k} / {sshape[0]}) "
            f"disagrees with {cfg['source']}: group_size = {gs}"
        )
    zk = f"{stem}.qzeros"
    if zk in index:
        zpath, zshape, zdt = index.info(zk)
        if zdt != "I32" or tuple(zshape) != (k // g, n // 8):
            raise ValueError(
                f"{zpath}: tensor {zk!r} ({what} zero points): expected I32 "
                f"[{k // g}, {n // 8}], got {zdt} {_shape_str(zshape)}"
            )
        # v1 ("gptq") stores zero - 1, v2 stores the zero itself; symmetric 4-bit zero = 8.
        nib = 7 if cfg.get("checkpoint_format", "gptq") == "gptq" else 8
        z = index.get_tensor(zk).view(torch.uint8)
        word = nib | (nib << 4)
        if not bool((z == word).all()):
            bad = z[z != word][0].item()
            raise ValueError(
                f"{zpath}: tensor {zk!r} ({what} zero points): asymmetric GPTQ weights are not "
                f"supported by GPTQ_INT4 (every stored zero must be {nib}, the symmetric zero 8 in "
                f"the {cfg.get('checkpoint_format', 'gptq')!r} checkpoint format; found byte "
                f"0x{int(bad):02x})"
            )
    ik = f"{stem}.g_idx"
    if ik in index:
        ipath, ishape, idt = index.info(ik)
        if idt not in ("I32", "I64") or tuple(ishape) != (k,):
            raise ValueError(
                f"{ipath}: tensor {ik!r} ({what} g_idx): expected I32 [{k}], got {idt} "
                f"{_shape_str(ishape)}"
            )
        gi = index.get_tensor(ik).to(torch.int64)
        if not torch.equal(gi, torch.arange(k, dtype=torch.int64) // g):
            raise ValueError(
                f"{ipath}: tensor {ik!r} ({what} g_idx): act-order (desc_act) GPTQ weights — "
                f"g_idx is not k // {g} — are not supported by GPTQ_INT4; re-quantize with "
                "desc_act = false"
            )
    return sdt, g


# ------------------------------------------------------------------------------------------------
# decoding (one pass per matrix)


def _native(native: bool | None, name: str) -> bool:
    """Use the C++ helper (python/bindings_int4.cpp) unless told not to or the build lacks it."""
    return native is not False and hasattr(_core, name)


def decode_rawint4(
    packed: torch.Tensor, scale: torch.Tensor, n: int, k: int, group: int, native=None
):
    """codes int8 [n, k] (nibble - 8) and fp32 scales [n, k / group] of a compressed-tensors
    matrix (``packed`` uint8 [n, k/2] or int32 [n, k/8], little-endian words). ``native``: False
    forces the torch path (same result)."""
    b = packed.contiguous().view(torch.uint8).reshape(n, k // 2)
    codes = torch.empty(n, k, dtype=torch.int8)
    if _native(native, "int4_decode_rows"):
        _core.int4_decode_rows(b.data_ptr(), n, k, codes.data_ptr())
    else:
        cv = codes.view(n, k // 2, 2)
        cv[:, :, 0] = b & 15
        cv[:, :, 1] = b >> 4
        codes.sub_(8)
    return codes, _scales(scale.to(torch.float32), k, group)


def decode_gptq(
    qweight: torch.Tensor, scales: torch.Tensor, n: int, k: int, group: int, native=None
):
    """codes int8 [n, k] (nibble - 8; input k = 8r + j is nibble j of qweight[r]) and fp32 scales
    [n, k / group] of a GPTQ matrix (qweight int32 [k/8, n], scales [k/gs, n])."""
    q = qweight.contiguous()
    codes = torch.empty(n, k, dtype=torch.int8)
    if _native(native, "int4_decode_gptq"):
        _core.int4_decode_gptq(q.data_ptr(), n, k, codes.data_ptr())
    else:
        b = q.view(torch.uint8).reshape(k // 8, n, 4).permute(1, 0, 2)
        cv = codes.view(n, k // 8, 4, 2)  # byte m of a word: nibbles 2m (low) and 2m + 1 (high)
        cv[..., 0] = b & 15
        cv[..., 1] = b >> 4
        codes.sub_(8)
    return codes, _scales(scales.to(torch.float32).t(), k, group)


def _scales(s: torch.Tensor, k: int, group: int) -> torch.Tensor:
    """[n, k / g] scales → [n, k / group] (group divides g: each scale repeated, exactly)."""
    g = k // s.shape[1]
    if g != group:
        s = s.repeat_interleave(g // group, dim=1)
    return s.contiguous()


# ------------------------------------------------------------------------------------------------
# loader


def load_int4_layer(
    weight_path: str,
    layer_idx: int,
    num_experts: int,
    top_k: int,
    hidden: int,
    intermediate: int,
    pmap: torch.Tensor | None = None,
    method: str = "RAWINT4",
    pools: int = 1,
    isa: str = "",
    batch: int = 16,
    progress: bool | None = None,
):
    """Build and load the native qgroup MoELayer for layer ``layer_idx`` of a RAWINT4
    (compressed-tensors) or GPTQ_INT4 checkpoint: slot p gets logical expert ``pmap[p]``
    (identity when None); one shard per pool on down's group boundaries. Returns (layer, stats)."""
    if method not in METHODS:
        raise ValueError(f"method: expected one of {', '.join(METHODS)}, got {method!r}")
    E, H, I = int(num_experts), int(hidden), int(intermediate)
    t0 = time.perf_counter()
    cfg = gptq_config(weight_path) if method == "GPTQ_INT4" else {}
    index = SafetensorsIndex(weight_path)
    try:
        lay = _detect(index, layer_idx, E, method)
        logical = list(range(E)) if pmap is None else [int(v) for v in pmap.tolist()]
        dims = ((I, H), (I, H), (H, I))
        # Check every tensor before reading any weight data; group sizes per projection.
        info: dict[int, list] = {}
        groups: list[dict[int, tuple[int, str]]] = [{}, {}, {}]
        for e in sorted(set(logical)):
            info[e] = []
            for p, (n, k) in enumerate(dims):
                what = f"layer {layer_idx}, expert {e} {PROJS[p]}"
                stem = lay.stem(e, p)
                if method == "RAWINT4":
                    r = _check_rawint4(index, stem, n, k, what)
                    g, key = r[2], f"{stem}.weight_scale"
                else:
                    r = _check_gptq(index, stem, n, k, what, cfg)
                    g, key = r[1], f"{stem}.scales"
                groups[p].setdefault(g, (e, key))
                info[e].append(r)
        for p in range(3):
            if len(groups[p]) > 1:
                (g0, (e0, k0)), (g1, (_, k1)) = list(groups[p].items())[:2]
                raise ValueError(
                    f"{index.info(k1)[0]}: tensor {k1!r}: group size {g1}, but {k0!r} (expert "
                    f"{e0}) has {g0}: every {PROJS[p]} matrix of a layer must share one group size"
                )
        gg, ug, dg = (next(iter(groups[p])) for p in range(3))
        gu_group = min(gg, ug)
        if max(gg, ug) % gu_group:
            raise ValueError(
                f"{weight_path}: layer {layer_idx}: gate group size {gg} and up group size {ug} "
                "are not multiples of one another (gate and up share one group in the kernels)"
            )
        bounds = [int(b) for b in _core.grouped_shard_bounds(I, dg, max(1, int(pools)))]
        # The layer keeps the scales in the checkpoint's 16-bit type when every matrix of the
        # projection group has it (exact; half the bytes of fp32).
        sdts = [{r[1] if method == "RAWINT4" else r[0] for e in info for r in info[e][a:b]}
                for a, b in ((0, 2), (2, 3))]  # fmt: skip
        gu_sdt, dn_sdt = (_HALF.get(next(iter(s)), "") if len(s) == 1 else "" for s in sdts)
        layer = _core.MoELayer(
            E,
            int(top_k),
            H,
            I,
            method,
            isa,
            shard_bounds=bounds,
            gu_group=gu_group,
            down_group=dg,
            gu_lut=LUT,
            down_lut=LUT,
            gu_scale_dtype=gu_sdt,
            down_scale_dtype=dn_sdt,
        )
        pgroup = (gu_group, gu_group, dg)

        def read(e: int):
            out, nb = [], 0
            for p, (n, k) in enumerate(dims):
                stem = lay.stem(e, p)
                if method == "RAWINT4":
                    w = index.get_tensor(f"{stem}.weight_packed")
                    s = index.get_tensor(f"{stem}.weight_scale")
                    out.append(decode_rawint4(w, s, n, k, pgroup[p]))
                else:
                    w = index.get_tensor(f"{stem}.qweight")
                    s = index.get_tensor(f"{stem}.scales")
                    out.append(decode_gptq(w, s, n, k, pgroup[p]))
                nb += w.numel() * w.element_size() + s.numel() * s.element_size()
                del w, s
            return out, nb

        def read_batch(slots: list[int]):
            return [read(logical[p]) for p in slots]

        # Decoded experts take ~1.1 bytes per weight: keep a batch under ~256 MB.
        batch = max(1, min(int(batch), (256 << 20) // max(1, 3 * I * H * 9 // 8)))
        batches = [list(range(s, min(E, s + batch))) for s in range(0, E, batch)]
        bar = progress_bar(E, f"layer {layer_idx} {method} experts", progress is not False)
        nbytes = 0
        with ThreadPoolExecutor(max_workers=1) as ex:
            fut = ex.submit(read_batch, batches[0]) if batches else None
            for i, slots in enumerate(batches):
                items = fut.result()
                fut = ex.submit(read_batch, batches[i + 1]) if i + 1 < len(batches) else None
                ptrs = []
                for p in range(3):
                    ptrs.append([it[0][p][0].data_ptr() for it in items])
                    ptrs.append([it[0][p][1].data_ptr() for it in items])
                    ptrs.append([0] * len(items))
                layer.load_experts_grouped(slots, *ptrs)
                nbytes += sum(it[1] for it in items)
                del items, ptrs
                if bar is not None:
                    bar.update(len(slots))
        if bar is not None:
            bar.close()
    finally:
        index.close()
    packing = ""
    if method == "RAWINT4" and info:
        packing = " " + "/".join(sorted({r[0] for rs in info.values() for r in rs}))
    layout = (
        f"{lay.base}:{lay.family}{packing}, gate/up G{gu_group} down G{dg} 4-bit, shards {bounds}"
    )
    stats = load_stats(nbytes, t0)
    logger.info(
        "layer %d: loaded %d %s experts from %s (%s): %.1f MB in %.2f s, %.2f GB/s",
        layer_idx,
        E,
        method,
        weight_path,
        layout,
        nbytes / 1e6,
        stats["seconds"],
        stats["gb_per_s"],
    )
    return layer, {**stats, "layout": layout, "group": (gu_group, dg)}
