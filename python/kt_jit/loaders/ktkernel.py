"""kt-kernel converted AMXINT8 / AMXINT4 / MOE_INT8 / MOE_INT4 directories
(``kt-kernel/scripts/convert_cpu_weights.py``).

Two on-disk forms hold the same bytes (kt-kernel-api.md §3.1):

* safetensors: ``blk.{L}.ffn_{gate,up,down}_exps.{e}.numa.{n}.weight`` (int8, 1-D, kt-kernel's
  AMX-packed bytes) and ``….scale`` (float32, 1-D, one scale per output row);
* ``.kt`` tree: ``{dir}/_layer_{L}/_numa_{n}/{INT8|INT4}_{up|gate|down}_{e}_{NBYTES}Byte_{quant|scale}_.kt``.

Part n of tp parts is rows ``[n·I/tp, (n+1)·I/tp)`` of gate/up (a ``[I/tp, H]`` matrix) and that
column slice of down (``[H, I/tp]``, with its own ``[H]`` row scales). Each part becomes one shard
of the native ``MoELayer`` (``shard_bounds``), so the numbers are kt-kernel's exactly: nothing is
re-quantized, and the intermediate is quantized per part as kt-kernel does.

Byte layout (``GemmKernel224Int8`` / ``GemmKernel224Int4`` ``BufferB``): N_STEP 32, K_STEP 64,
K_BLOCK 3584, N_BLOCK 64 (INT8) / 128 (INT4); inside each 32-row × 64-byte step, each 16-row half
is transposed as a 16×16 matrix of 4-byte words. INT4 packs 128-wide K chunks: byte j of a row
holds column kbeg+j in the low nibble and kbeg+64+j in the high nibble (two's complement).
``amx_offsets`` computes, once per shape, the byte offset of every element from that formula;
the packers scatter with it and the unpackers gather with it.

MOE_INT8 / MOE_INT4 (``--quant-method moe_int8|moe_int4``; kt-kernel's ``operators/moe_kernel``,
``GemmKernelInt8`` / ``GemmKernelInt4`` ``BufferB``, read at kvcache-ai/ktransformers commit
95009ea6856c0799e517e93cb12be5e8494bc7ce, ``kt-kernel/operators/moe_kernel/la/kernel.hpp`` and
``moe.hpp``): the same keys and ``.kt`` tree (file prefix ``MOE_INT8`` / ``MOE_INT4``), one fp32 scale
per output row. The quant bytes are the "plain" packed layout of KML builds (AArch64; the only
builds with MOE_INT4): rows in groups of 8, each group ``8·k`` elements, cut into column chunks
of 32 (INT8) / 64 (INT4) stored as 8 rows × 32 bytes. INT8: element (r, c) at
``(r/8)·8k + (c/32)·256 + (r%8)·32 + c%32``, scale amax/127. INT4: byte
``(r/8)·4k + (c/64)·256 + (r%8)·32 + c%32``, column c%64 < 32 in the **high** nibble and
c%64 ≥ 32 in the low nibble, signed; the value is 16·q4 with scale amax/112 (kt-jit's int4
semantics). x86 builds of moe_kernel (AMD, AOCL) store AOCL's reordered B buffers instead (their
size is not rows × columns); those are refused with an error saying so.

Every error names the file and the key (or, for ``.kt`` files, the file name).
"""

from __future__ import annotations

import functools
import glob
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from .hf import CheckpointError, SafetensorsIndex

logger = logging.getLogger("kt_jit")

from .._progress import load_stats, progress_bar

N_STEP = 32
K_STEP = 64
K_BLOCK = 3584
N_BLOCK = {8: 64, 4: 128}
#: file name prefix of the .kt tree (kt-kernel's ``T::name()``) of the AMX layout
KT_PREFIX = {8: "INT8", 4: "INT4"}
#: wrapper method -> bits
METHOD_BITS = {"AMXINT8": 8, "AMXINT4": 4, "MOE_INT8": 8, "MOE_INT4": 4}
#: wrapper method -> .kt file name prefix
METHOD_PREFIX = {
    "AMXINT8": "INT8",
    "AMXINT4": "INT4",
    "MOE_INT8": "MOE_INT8",
    "MOE_INT4": "MOE_INT4",
}
#: moe_kernel's plain layout: PACK_SIZE_N rows × PACK_SIZE_K bytes per tile
MOE_PACK_N = 8
MOE_PACK_K = 32
PROJS = ("gate", "up", "down")


# ------------------------------------------------------------------------------------------------
# byte layout


def check_shape(bits: int, n: int, k: int, what: str = "matrix") -> None:
    """kt-kernel's BufferB accepts n % 32 == 0 and k % 64 (INT8) / k % 128 (INT4) == 0 only; the
    layout is undefined for other shapes."""
    kstep = K_STEP if bits == 8 else 2 * K_STEP
    if n <= 0 or k <= 0 or n % N_STEP or k % kstep:
        raise ValueError(
            f"{what}: kt-kernel's AMX INT{bits} layout needs rows % {N_STEP} == 0 and "
            f"columns % {kstep} == 0, got [{n}, {k}]"
        )


@functools.lru_cache(maxsize=32)
def amx_offsets(bits: int, n: int, k: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Byte offset of every element (r, c) of an [n, k] matrix in kt-kernel's packed layout.

    Returns (offsets [n, k] int32/int64, high [n, k] bool or None): for INT4, ``high`` tells
    whether the element is the byte's high nibble. Read-only arrays, cached per shape.

    Formula (kt-kernel-api.md §3.1): nb = ⌊r/NB⌋·NB, nbs = min(NB, n−nb), kb = ⌊c/KB⌋·KB,
    kbs = min(KB, k−kb), nbeg = ⌊(r−nb)/32⌋·32, i = r−nb−nbeg. INT8: kbeg = ⌊(c−kb)/64⌋·64,
    j = c−kb−kbeg, tile = nb·k + kb·nbs + nbeg·kbs + kbeg·32 (+1024 for rows 16–31 of the step),
    and (i mod 16, j) of the 16×64-byte half tile lands at (j/4)·64 + (i mod 16)·4 + j mod 4.
    INT4: kbeg steps by 128, jj = c−kb−kbeg, j = jj mod 64, high = jj ≥ 64, element offsets as
    above halved to bytes (each 16-row half is again 1024 bytes), the same word transpose.
    """
    if bits not in (4, 8):
        raise ValueError(f"bits: expected 4 or 8, got {bits}")
    check_shape(bits, n, k)
    NB = N_BLOCK[bits]
    r = np.arange(n, dtype=np.int64)[:, None]
    c = np.arange(k, dtype=np.int64)[None, :]
    nb = r // NB * NB
    nbs = np.minimum(NB, n - nb)
    kb = c // K_BLOCK * K_BLOCK
    kbs = np.minimum(K_BLOCK, k - kb)
    nbeg = (r - nb) // N_STEP * N_STEP
    i = r - nb - nbeg
    chunk = K_STEP if bits == 8 else 2 * K_STEP
    kbeg = (c - kb) // chunk * chunk
    jj = c - kb - kbeg
    j = jj % K_STEP
    base = nb * k + kb * nbs + nbeg * kbs + kbeg * N_STEP  # element offset of the 32-row step
    if bits == 4:
        base = base // 2  # always even: k % 128 == 0
    half = (i // 16) * 1024
    off = base + half + (j // 4) * 64 + (i % 16) * 4 + (j % 4)
    total = n * k if bits == 8 else n * k // 2
    off = off.astype(np.int32 if total < 2**31 else np.int64)
    off.setflags(write=False)
    high = None
    if bits == 4:
        high = np.broadcast_to(jj >= K_STEP, (n, k)).copy()
        high.setflags(write=False)
    return off, high


def _as_bytes(raw, nbytes: int, what: str) -> np.ndarray:
    if isinstance(raw, torch.Tensor):
        raw = raw.detach().contiguous().view(torch.uint8).numpy()
    elif isinstance(raw, (bytes, bytearray, memoryview)):
        raw = np.frombuffer(raw, dtype=np.uint8)
    raw = np.ascontiguousarray(raw).reshape(-1)
    if raw.dtype.itemsize != 1:
        raise TypeError(f"{what}: expected int8/uint8 bytes, got dtype {raw.dtype}")
    if raw.size != nbytes:
        raise ValueError(f"{what}: expected {nbytes} bytes, got {raw.size}")
    return raw.view(np.uint8)


def unpack_amx_int8(raw, n: int, k: int) -> np.ndarray:
    """kt-kernel's packed AMXINT8 bytes (n·k) → int8 [n, k] row-major."""
    off, _ = amx_offsets(8, int(n), int(k))
    b = _as_bytes(raw, n * k, f"INT8 [{n}, {k}]")
    return b.view(np.int8)[off]


def unpack_amx_int4(raw, n: int, k: int) -> np.ndarray:
    """kt-kernel's packed AMXINT4 bytes (n·k/2) → int8 [n, k] holding 16·q4 (the value the
    kernels multiply: ``(b & 0x0F) << 4`` for a low nibble, ``b & 0xF0`` for a high one)."""
    off, high = amx_offsets(4, int(n), int(k))
    b = _as_bytes(raw, n * k // 2, f"INT4 [{n}, {k}]")
    g = b[off]
    return np.where(high, g & 0xF0, (g << 4) & 0xF0).astype(np.uint8).view(np.int8)


def pack_amx_int8(q) -> bytes:
    """int8 [n, k] → kt-kernel's packed AMXINT8 bytes (the inverse of unpack_amx_int8)."""
    q = np.asarray(q)
    if q.ndim != 2:
        raise ValueError(f"pack_amx_int8: expected a 2-D [n, k] array, got shape {q.shape}")
    n, k = q.shape
    off, _ = amx_offsets(8, n, k)
    out = np.zeros(n * k, dtype=np.int8)
    out[off] = q.astype(np.int8)
    return out.tobytes()


def pack_amx_int4(q16) -> bytes:
    """int8 [n, k] of 16·q4 (multiples of 16 in [−128, 112]) → kt-kernel's packed AMXINT4 bytes."""
    q16 = np.asarray(q16).astype(np.int64)
    if q16.ndim != 2:
        raise ValueError(f"pack_amx_int4: expected a 2-D [n, k] array, got shape {q16.shape}")
    if np.any(q16 % 16) or q16.min(initial=0) < -128 or q16.max(initial=0) > 112:
        raise ValueError("pack_amx_int4: values must be 16·q4 with q4 in [-8, 7]")
    n, k = q16.shape
    off, high = amx_offsets(4, n, k)
    nib = ((q16 // 16) & 0xF).astype(np.uint8)
    out = np.zeros(n * k // 2, dtype=np.uint8)
    out[off[~high]] = nib[~high]
    out[off[high]] |= (nib[high] << 4).astype(np.uint8)
    return out.tobytes()


def packed_nbytes(bits: int, n: int, k: int) -> int:
    return n * k if bits == 8 else n * k // 2


# moe_kernel (MOE_INT8 / MOE_INT4) plain layout


def check_moe_shape(bits: int, n: int, k: int, what: str = "matrix") -> None:
    """moe_kernel's plain layout tiles rows by 8 and columns by 32 bytes (32 int8 / 64 int4
    columns); other shapes overlap tiles in kt-kernel's writer, so they are refused."""
    kstep = MOE_PACK_K if bits == 8 else 2 * MOE_PACK_K
    if n <= 0 or k <= 0 or n % MOE_PACK_N or k % kstep:
        raise ValueError(
            f"{what}: kt-kernel's moe_kernel INT{bits} layout needs rows % {MOE_PACK_N} == 0 "
            f"and columns % {kstep} == 0, got [{n}, {k}]"
        )


@functools.lru_cache(maxsize=32)
def moe_offsets(bits: int, n: int, k: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Byte offset of every element (r, c) of an [n, k] matrix in moe_kernel's plain layout
    (``GemmKernelInt8/Int4::BufferB::from_mat`` with PACKED, PLAIN): (offsets, high) as for
    amx_offsets; for INT4 ``high`` marks the first 32 columns of each 64-column chunk."""
    if bits not in (4, 8):
        raise ValueError(f"bits: expected 4 or 8, got {bits}")
    check_moe_shape(bits, n, k)
    r = np.arange(n, dtype=np.int64)[:, None]
    c = np.arange(k, dtype=np.int64)[None, :]
    row_bytes = k if bits == 8 else k // 2
    chunk = MOE_PACK_K if bits == 8 else 2 * MOE_PACK_K
    off = (
        (r // MOE_PACK_N) * (MOE_PACK_N * row_bytes)
        + (c // chunk) * (MOE_PACK_N * MOE_PACK_K)
        + (r % MOE_PACK_N) * MOE_PACK_K
        + c % MOE_PACK_K
    )
    off = off.astype(np.int32 if n * row_bytes < 2**31 else np.int64)
    off.setflags(write=False)
    high = None
    if bits == 4:
        high = np.broadcast_to(c % chunk < MOE_PACK_K, (n, k)).copy()
        high.setflags(write=False)
    return off, high


def unpack_moe_int8(raw, n: int, k: int) -> np.ndarray:
    """moe_kernel's packed MOE_INT8 bytes (n·k) → int8 [n, k] row-major."""
    off, _ = moe_offsets(8, int(n), int(k))
    return _as_bytes(raw, n * k, f"MOE_INT8 [{n}, {k}]").view(np.int8)[off]


def unpack_moe_int4(raw, n: int, k: int) -> np.ndarray:
    """moe_kernel's packed MOE_INT4 bytes (n·k/2) → int8 [n, k] holding 16·q4."""
    off, high = moe_offsets(4, int(n), int(k))
    g = _as_bytes(raw, n * k // 2, f"MOE_INT4 [{n}, {k}]")[off]
    return np.where(high, g & 0xF0, (g << 4) & 0xF0).astype(np.uint8).view(np.int8)


def pack_moe_int8(q) -> bytes:
    """int8 [n, k] → moe_kernel's packed MOE_INT8 bytes (the inverse of unpack_moe_int8)."""
    q = np.asarray(q)
    if q.ndim != 2:
        raise ValueError(f"pack_moe_int8: expected a 2-D [n, k] array, got shape {q.shape}")
    off, _ = moe_offsets(8, *q.shape)
    out = np.zeros(q.size, dtype=np.int8)
    out[off] = q.astype(np.int8)
    return out.tobytes()


def pack_moe_int4(q16) -> bytes:
    """int8 [n, k] of 16·q4 → moe_kernel's packed MOE_INT4 bytes (inverse of unpack_moe_int4)."""
    q16 = np.asarray(q16).astype(np.int64)
    if q16.ndim != 2:
        raise ValueError(f"pack_moe_int4: expected a 2-D [n, k] array, got shape {q16.shape}")
    if np.any(q16 % 16) or q16.min(initial=0) < -128 or q16.max(initial=0) > 112:
        raise ValueError("pack_moe_int4: values must be 16·q4 with q4 in [-8, 7]")
    off, high = moe_offsets(4, *q16.shape)
    nib = ((q16 // 16) & 0xF).astype(np.uint8)
    out = np.zeros(q16.size // 2, dtype=np.uint8)
    out[off[high]] = (nib[high] << 4).astype(np.uint8)
    out[off[~high]] |= nib[~high]
    return out.tobytes()


def unpack(bits: int, raw, n: int, k: int, moe: bool = False) -> np.ndarray:
    if moe:
        return unpack_moe_int8(raw, n, k) if bits == 8 else unpack_moe_int4(raw, n, k)
    return unpack_amx_int8(raw, n, k) if bits == 8 else unpack_amx_int4(raw, n, k)


# ------------------------------------------------------------------------------------------------
# directory reader


def _st_key(layer_idx: int, proj: str, e: int, part: int, kind: str) -> str:
    return f"blk.{layer_idx}.ffn_{proj}_exps.{e}.numa.{part}.{kind}"


def kt_file_name(bits_or_method, proj: str, e: int, nbytes: int, kind: str) -> str:
    """``{PREFIX}_{proj}_{e}_{NBYTES}Byte_{quant|scale}_.kt``; PREFIX is INT8/INT4 for bits 8/4
    (the AMX methods) or the method's own (``MOE_INT8``, ``MOE_INT4``)."""
    prefix = (
        METHOD_PREFIX[bits_or_method]
        if isinstance(bits_or_method, str)
        else KT_PREFIX[int(bits_or_method)]
    )
    return f"{prefix}_{proj}_{e}_{nbytes}Byte_{kind}_.kt"


AOCL_HINT = (
    "; a larger MOE_INT8/MOE_INT4 weight is AOCL's reordered B buffer written by an x86 (AMD, "
    "AOCL) build of kt-kernel's moe_kernel, which kt-jit does not decode: convert the Hugging Face "
    "checkpoint with kt-kernel's --quant-method int8/int4 (AMXINT8/AMXINT4) or `kt-jit convert`"
)


class KtKernelDir:
    """One layer of a kt-kernel converted directory: mode ('safetensors' or 'kt'), tp (number of
    NUMA parts), num_experts (found by probing), and readers for one (part, projection, expert).
    ``method``: AMXINT8 / AMXINT4 / MOE_INT8 / MOE_INT4, or bits 8 / 4 for the AMX methods."""

    def __init__(self, weight_path: str, layer_idx: int, method, hidden: int, inter: int):
        if not weight_path or not os.path.isdir(weight_path):
            raise FileNotFoundError(f"weight_path: {weight_path!r} is not a directory")
        if not isinstance(method, str):
            method = {8: "AMXINT8", 4: "AMXINT4"}[int(method)]
        bits = method_bits(method)
        self.method, self.moe, self.prefix = (
            method,
            method.startswith("MOE_"),
            METHOD_PREFIX[method],
        )
        self.path, self.layer_idx, self.bits = weight_path, int(layer_idx), bits
        self.H, self.I = int(hidden), int(inter)
        self.index: SafetensorsIndex | None = None
        L = self.layer_idx
        if glob.glob(os.path.join(weight_path, "*.safetensors")):  # kt-kernel's own rule
            self.mode = "safetensors"
            self.index = SafetensorsIndex(weight_path)
            probe = _st_key(L, "up", 0, 0, "weight")
            if probe not in self.index:
                raise self.index.missing(
                    probe,
                    hint=f" (layer {L}: no kt-kernel AMX expert weights; expected keys "
                    f"blk.{L}.ffn_{{gate,up,down}}_exps.{{e}}.numa.{{n}}.{{weight,scale}})",
                )

            # A part / expert exists when any of its six tensors does, so one missing tensor is
            # reported by name (check) instead of shrinking the part or expert count.
            def _has(e: int, part: int) -> bool:
                return any(
                    _st_key(L, proj, e, part, kind) in self.index
                    for proj in PROJS
                    for kind in ("weight", "scale")
                )

            tp = 0
            while _has(0, tp):
                tp += 1
            ne = 0
            while _has(ne, 0):
                ne += 1
        else:
            self.mode = "kt"
            layer_dir = os.path.join(weight_path, f"_layer_{L}")
            if not os.path.isdir(layer_dir):
                raise FileNotFoundError(
                    f"weight_path: {weight_path!r} has neither *.safetensors files nor a .kt "
                    f"tree for layer {L} ({layer_dir} does not exist)"
                )
            tp = 0
            while os.path.isdir(os.path.join(layer_dir, f"_numa_{tp}")):
                tp += 1
            if tp == 0:
                raise FileNotFoundError(f"{layer_dir}: no _numa_0 folder")
            d0 = os.path.join(layer_dir, "_numa_0")
            ne = 0
            while glob.glob(os.path.join(d0, f"{self.prefix}_up_{ne}_*Byte_quant_.kt")):
                ne += 1
            if ne == 0:
                hint = ""
                for other in sorted(set(METHOD_PREFIX.values()) - {self.prefix}):
                    if glob.glob(os.path.join(d0, f"{other}_up_0_*Byte_quant_.kt")):
                        hint = f"; it holds {other} files — the method does not match the directory"
                        break
                raise ValueError(
                    f"{d0}: no {self.prefix}_up_0_*Byte_quant_.kt file (layer {L}, part 0, "
                    f"expert 0 up){hint}"
                )
        self.tp, self.num_experts = tp, ne
        if self.I % tp:
            raise ValueError(
                f"{weight_path}: {tp} NUMA parts do not divide moe_intermediate_size {self.I}"
            )
        self.part_i = self.I // tp

    def shard_bounds(self) -> list[int]:
        return [p * self.part_i for p in range(self.tp + 1)]

    def shape(self, proj: str) -> tuple[int, int]:
        return (self.part_i, self.H) if proj != "down" else (self.H, self.part_i)

    def _where(self, part: int, proj: str, e: int) -> str:
        return f"layer {self.layer_idx}, part {part}, expert {e} {proj}"

    def _kt_path(self, part: int, proj: str, e: int, kind: str, nbytes: int) -> str:
        d = os.path.join(self.path, f"_layer_{self.layer_idx}", f"_numa_{part}")
        want = os.path.join(d, kt_file_name(self.method, proj, e, nbytes, kind))
        if os.path.isfile(want):
            return want
        pat = os.path.join(d, f"{self.prefix}_{proj}_{e}_*Byte_{kind}_.kt")
        found = sorted(glob.glob(pat))
        if found:
            hint = AOCL_HINT if self.moe and kind == "quant" else ""
            raise ValueError(
                f"{found[0]}: wrong size for {kind} of {self._where(part, proj, e)}: expected "
                f"{nbytes} bytes (file {os.path.basename(want)}){hint}"
            )
        raise FileNotFoundError(f"{want}: missing {kind} file of {self._where(part, proj, e)}")

    def check(self, part: int, proj: str, e: int) -> None:
        """Sizes and dtypes of one (part, proj, expert) before reading any data."""
        n, k = self.shape(proj)
        nq, ns = packed_nbytes(self.bits, n, k), 4 * n
        what = self._where(part, proj, e)
        if self.mode == "safetensors":
            for kind, want_bytes, dtypes in (("weight", nq, ("I8", "U8")), ("scale", ns, ("F32",))):
                key = _st_key(self.layer_idx, proj, e, part, kind)
                if key not in self.index:
                    raise self.index.missing(key, hint=f" ({what} {kind})")
                path, shape, dt = self.index.info(key)
                if dt not in dtypes:
                    raise ValueError(
                        f"{path}: tensor {key!r} ({what} {kind}): expected dtype "
                        f"{' or '.join(dtypes)}, got {dt}"
                    )
                count = int(np.prod(shape)) if len(shape) else 1
                nbytes = count * (4 if dt == "F32" else 1)
                if nbytes != want_bytes:
                    hint = (
                        AOCL_HINT if self.moe and kind == "weight" and nbytes > want_bytes else ""
                    )
                    raise ValueError(
                        f"{path}: tensor {key!r} ({what} {kind}): expected {want_bytes} bytes "
                        f"({self.method} [{n}, {k}]{' scales' if kind == 'scale' else ''}), "
                        f"got shape {list(shape)} {dt} = {nbytes} bytes{hint}"
                    )
        else:
            for kind, nbytes in (("quant", nq), ("scale", ns)):
                p = self._kt_path(part, proj, e, kind, nbytes)
                size = os.path.getsize(p)
                if size != nbytes:
                    raise CheckpointError(
                        f"{p}: {what} {kind}: file has {size} bytes, its name and the shape say "
                        f"{nbytes} (truncated or corrupt)"
                    )

    def read(self, part: int, proj: str, e: int) -> tuple[np.ndarray, np.ndarray]:
        """(int8 [n, k] values the kernels multiply, float32 [n] scales) of one projection."""
        n, k = self.shape(proj)
        nq, ns = packed_nbytes(self.bits, n, k), 4 * n
        if self.mode == "safetensors":
            wkey = _st_key(self.layer_idx, proj, e, part, "weight")
            skey = _st_key(self.layer_idx, proj, e, part, "scale")
            raw = self.index.get_tensor(wkey)
            sc = self.index.get_tensor(skey)
            raw = raw.contiguous().view(torch.uint8).numpy().reshape(-1)
            scale = sc.to(torch.float32).contiguous().numpy().reshape(-1)
            if raw.size != nq or scale.size != n:  # pragma: no cover - checked before
                raise ValueError(f"{self.index.info(wkey)[0]}: tensor {wkey!r}: wrong size")
        else:
            qp = self._kt_path(part, proj, e, "quant", nq)
            sp = self._kt_path(part, proj, e, "scale", ns)
            raw = self._read_file(qp, nq, f"{self._where(part, proj, e)} quant")
            scale = self._read_file(sp, ns, f"{self._where(part, proj, e)} scale").view(np.float32)
        q = unpack(self.bits, raw, n, k, moe=self.moe)
        return q, np.ascontiguousarray(scale, dtype=np.float32)

    @staticmethod
    def _read_file(path: str, nbytes: int, what: str) -> np.ndarray:
        try:
            with open(path, "rb") as f:
                data = f.read(nbytes + 1)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read {what}: {e}") from None
        if len(data) != nbytes:
            raise CheckpointError(
                f"{path}: {what}: expected exactly {nbytes} bytes, got {len(data)} "
                "(truncated or corrupt)"
            )
        return np.frombuffer(data, dtype=np.uint8)

    def close(self) -> None:
        if self.index is not None:
            self.index.close()


def method_bits(method: str) -> int:
    if method not in METHOD_BITS:
        raise ValueError(
            f"method: {method!r} is not a kt-kernel converted format; expected one of "
            f"{', '.join(METHOD_BITS)}"
        )
    return METHOD_BITS[method]


def load_ktkernel_layer(
    layer,
    weight_path: str,
    layer_idx: int,
    num_experts: int,
    hidden: int,
    intermediate: int,
    pmap: torch.Tensor | None = None,
    method: str = "AMXINT8",
    batch: int = 16,
    progress: bool | None = None,
):
    """Load layer ``layer_idx`` of a kt-kernel converted directory.

    ``layer`` is either a native MoELayer already built with this directory's shard_bounds, or a
    factory ``f(shard_bounds) -> MoELayer`` (the NUMA part count is only known once the directory
    has been probed). Physical slot p receives logical expert ``pmap[p]`` (identity when None).
    Returns (layer, stats) with stats = {bytes, seconds, gb_per_s, mode, tp}.
    """
    bits = method_bits(method)
    E, H, I = int(num_experts), int(hidden), int(intermediate)
    t0 = time.perf_counter()
    kd = KtKernelDir(weight_path, layer_idx, method, H, I)
    try:
        if kd.num_experts < E:
            missing = (
                _st_key(layer_idx, "up", kd.num_experts, 0, "weight")
                if kd.mode == "safetensors"
                else os.path.join(
                    weight_path,
                    f"_layer_{layer_idx}",
                    "_numa_0",
                    f"{kd.prefix}_up_{kd.num_experts}_*Byte_quant_.kt",
                )
            )
            raise ValueError(
                f"{weight_path}: layer {layer_idx} has {kd.num_experts} experts, the wrapper "
                f"expects num_experts={E} (missing {missing!r})"
            )
        if kd.num_experts > E:
            raise ValueError(
                f"{weight_path}: layer {layer_idx} has {kd.num_experts} experts, the wrapper "
                f"expects num_experts={E}"
            )
        for proj in PROJS:
            (check_moe_shape if kd.moe else check_shape)(
                bits,
                *kd.shape(proj),
                what=(
                    f"{proj} part [I/tp={kd.part_i}, H={H}]"
                    if proj != "down"
                    else f"down part [H={H}, I/tp={kd.part_i}]"
                ),
            )
        bounds = kd.shard_bounds()
        if hasattr(layer, "load_experts_quantized"):
            got = list(layer.shard_bounds)
            if got != bounds:
                raise ValueError(
                    f"{weight_path}: the layer has shard_bounds {got}, the directory's "
                    f"{kd.tp} NUMA parts need {bounds}"
                )
        else:
            layer = layer(bounds)
        logical = list(range(E)) if pmap is None else [int(v) for v in pmap.tolist()]
        # Check every file/key before reading any data.
        for part in range(kd.tp):
            for e in sorted(set(logical)):
                for proj in PROJS:
                    kd.check(part, proj, e)

        def read_batch(part: int, slots: list[int]):
            out = []
            for p in slots:
                e = logical[p]
                out.append((p, [kd.read(part, proj, e) for proj in PROJS]))
            return part, out

        jobs = [
            (part, list(range(s, min(E, s + batch))))
            for part in range(kd.tp)
            for s in range(0, E, batch)
        ]
        bar = progress_bar(E * kd.tp, f"layer {layer_idx} experts x parts", progress is not False)
        nbytes = 0
        with ThreadPoolExecutor(max_workers=1) as ex:
            fut = ex.submit(read_batch, *jobs[0]) if jobs else None
            for i in range(len(jobs)):
                part, items = fut.result()
                fut = ex.submit(read_batch, *jobs[i + 1]) if i + 1 < len(jobs) else None
                slots = [p for p, _ in items]
                ptr = [[], [], [], [], [], []]
                for _, mats in items:
                    for j, (q, d) in enumerate(mats):
                        ptr[2 * j].append(q.ctypes.data)
                        ptr[2 * j + 1].append(d.ctypes.data)
                        nbytes += packed_nbytes(bits, *q.shape) + d.nbytes
                layer.load_experts_quantized(part, slots, *ptr)
                del items
                if bar is not None:
                    bar.update(len(slots))
        if bar is not None:
            bar.close()
    finally:
        kd.close()
    stats = {**load_stats(nbytes, t0), "mode": kd.mode, "tp": kd.tp}
    logger.info(
        "layer %d: loaded %d experts x %d NUMA parts from %s (kt-kernel %s, %s): "
        "%.1f MB in %.2f s, %.2f GB/s",
        layer_idx,
        E,
        kd.tp,
        weight_path,
        kd.mode,
        method,
        nbytes / 1e6,
        stats["seconds"],
        stats["gb_per_s"],
    )
    return layer, stats
