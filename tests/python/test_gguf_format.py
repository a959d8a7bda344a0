"""GGML block types (formats/gguf): our decoder and reference dequantizer against the ``gguf``
package's own numpy dequantization, bit for bit, for every supported type.

"Random valid blocks" are random bytes in which every f16 field (d, and dmin/m where the type has
them) is forced finite — any finite f16, subnormals and zeros included; every other bit pattern of
every supported type is a valid block (scales, mins, high bits and nibbles take all their values).
"""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from kt_jit import _core

QT = gguf.GGMLQuantizationType

#: byte offsets of the f16 fields inside one block, per type
F16_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "IQ4_NL": (0,),
    "IQ4_XS": (0,),
}
INT_TYPES = list(F16_FIELDS)
FLOAT_TYPES = ["F32", "F16", "BF16"]
#: (group, bias, codes range) we claim per type (formats/gguf.hpp's table)
EXPECTED = {
    "Q4_0": (32, False, (-8, 7)),
    "Q4_1": (32, True, (0, 15)),
    "Q5_0": (32, False, (-16, 15)),
    "Q5_1": (32, True, (0, 31)),
    "Q8_0": (32, False, (-128, 127)),
    "Q2_K": (16, True, (0, 3)),
    "Q3_K": (16, False, (-4, 3)),
    "Q4_K": (32, True, (0, 15)),
    "Q5_K": (32, True, (0, 31)),
    "Q6_K": (16, False, (-32, 31)),
    "IQ4_NL": (32, False, (-127, 113)),
    "IQ4_XS": (32, False, (-127, 113)),
}
IQ4_VALUES = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]


def types_by_name():
    return {t["name"]: t for t in _core.gguf_types()}


def random_blocks(name: str, rows: int, k: int, seed: int) -> np.ndarray:
    """[rows, row_bytes] uint8 of random valid blocks (finite f16 fields)."""
    block, tsize = gguf.GGML_QUANT_SIZES[QT[name]]
    nb = k // block
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * nb, tsize), dtype=np.uint8)
    for off in F16_FIELDS[name]:
        bits = raw[:, off : off + 2].copy().view(np.uint16)
        inf_nan = (bits & 0x7C00) == 0x7C00
        bits = np.where(inf_nan, bits ^ np.uint16(0x4000), bits)  # any finite value
        raw[:, off : off + 2] = bits.view(np.uint8).reshape(-1, 2)
    # a few blocks with d = 0 and with tiny (subnormal) d
    raw[0, F16_FIELDS[name][0] : F16_FIELDS[name][0] + 2] = 0
    raw[1, F16_FIELDS[name][0] : F16_FIELDS[name][0] + 2] = (1, 0)
    return raw.reshape(rows, nb * tsize)


def ours_dequantize(tid: int, raw: np.ndarray, rows: int, k: int) -> np.ndarray:
    out = np.empty((rows, k), dtype=np.float32)
    raw = np.ascontiguousarray(raw)
    _core.gguf_dequantize(tid, raw.ctypes.data, rows, k, out.ctypes.data)
    return out


def ours_decode(info: dict, raw: np.ndarray, rows: int, k: int, group=None, biases=None):
    group = group or info["group"]
    codes = np.empty((rows, k), dtype=np.int8)
    scales = np.empty((rows, k // group), dtype=np.float32)
    want_bias = info["bias"] if biases is None else biases
    b = np.empty((rows, k // group), dtype=np.float32) if want_bias else None
    raw = np.ascontiguousarray(raw)
    _core.gguf_decode(
        info["id"],
        raw.ctypes.data,
        rows,
        k,
        group,
        codes.ctypes.data,
        scales.ctypes.data,
        b.ctypes.data if b is not None else 0,
    )
    return codes, scales, b


def test_type_table():
    t = types_by_name()
    assert sorted(t) == sorted(INT_TYPES + FLOAT_TYPES)
    for name in INT_TYPES:
        block, tsize = gguf.GGML_QUANT_SIZES[QT[name]]
        assert (t[name]["id"], t[name]["block"], t[name]["block_bytes"]) == (
            int(QT[name]),
            block,
            tsize,
        )
        group, bias, _ = EXPECTED[name]
        assert (t[name]["group"], t[name]["bias"], t[name]["is_float"]) == (group, bias, False)
    for name in FLOAT_TYPES:
        assert t[name]["is_float"] and t[name]["id"] == int(QT[name])


@pytest.mark.parametrize("name", INT_TYPES)
def test_dequantize_matches_gguf_bitwise(name):
    info = types_by_name()[name]
    block = info["block"]
    rows, k = 24, 2 * 256  # two K-quant blocks / sixteen 32-blocks per row
    raw = random_blocks(name, rows, k, seed=INT_TYPES.index(name))
    theirs = gguf.quants.dequantize(raw, QT[name])
    assert theirs.shape == (rows, k) and theirs.dtype == np.float32
    assert np.isfinite(theirs).all()
    ours = ours_dequantize(info["id"], raw, rows, k)
    diff = np.nonzero(ours.view(np.uint32) != theirs.view(np.uint32))
    assert diff[0].size == 0, (
        f"{name}: {diff[0].size} elements differ, first at row {diff[0][0]} col {diff[1][0]} "
        f"(block {diff[1][0] // block}): ours {ours[diff][0]!r} gguf {theirs[diff][0]!r}"
    )


@pytest.mark.parametrize("name", INT_TYPES)
def test_decode_reproduces_gguf(name):
    """(codes, scales, biases): scale * code (+ bias) in fp32, in that order, is gguf's value."""
    info = types_by_name()[name]
    group, bias, (lo, hi) = EXPECTED[name]
    rows, k = 16, 512
    raw = random_blocks(name, rows, k, seed=100 + INT_TYPES.index(name))
    theirs = gguf.quants.dequantize(raw, QT[name])
    codes, scales, biases = ours_decode(info, raw, rows, k)
    assert (biases is not None) == bias
    assert codes.min() >= lo and codes.max() <= hi
    # random blocks reach both ends of the code range, which the type table states
    assert codes.min() == lo and codes.max() == hi
    assert info["code_range"] == [lo, hi]
    s = np.repeat(scales, group, axis=1)
    w = s * codes.astype(np.float32)
    if bias:
        w = w + np.repeat(biases, group, axis=1)
    assert np.array_equal(w.view(np.uint32), theirs.view(np.uint32))
    if info["lut"]:
        assert len(info["lut"]) == 16 and len(set(info["lut"])) == 16
        assert set(np.unique(codes).tolist()) <= set(info["lut"])
    else:
        assert name in ("Q5_0", "Q5_1", "Q8_0", "Q5_K", "Q6_K")  # > 16 code values


def test_luts():
    t = types_by_name()
    assert t["IQ4_NL"]["lut"] == IQ4_VALUES and t["IQ4_XS"]["lut"] == IQ4_VALUES
    assert t["Q4_0"]["lut"] == list(range(-8, 8)) == t["Q3_K"]["lut"]
    assert t["Q4_1"]["lut"] == list(range(16)) == t["Q4_K"]["lut"] == t["Q2_K"]["lut"]
    for name in ("Q5_0", "Q5_1", "Q8_0", "Q6_K", "Q5_K"):
        assert t[name]["lut"] == []


@pytest.mark.parametrize("name", ["Q4_0", "Q4_K", "Q8_0", "IQ4_XS", "Q5_1"])
def test_decode_finer_group_and_zero_bias(name):
    """A 32-group type decoded at group 16 repeats each scale exactly; biases of a bias-free type
    come back as zeros — the common spec of a gate and an up of different types."""
    info = types_by_name()[name]
    rows, k = 8, 512
    raw = random_blocks(name, rows, k, seed=3)
    c32, s32, b32 = ours_decode(info, raw, rows, k)
    c16, s16, b16 = ours_decode(info, raw, rows, k, group=16, biases=True)
    assert np.array_equal(c16, c32)
    assert np.array_equal(s16.view(np.uint32), np.repeat(s32, 2, axis=1).view(np.uint32))
    if b32 is None:
        assert not b16.any()
    else:
        assert np.array_equal(b16.view(np.uint32), np.repeat(b32, 2, axis=1).view(np.uint32))
    theirs = gguf.quants.dequantize(raw, QT[name])
    w = np.repeat(s16, 16, axis=1) * c16.astype(np.float32) + np.repeat(b16, 16, axis=1)
    assert np.array_equal(w, theirs)  # values (a -0 may become +0)


@pytest.mark.parametrize("name", FLOAT_TYPES)
def test_float_passthrough(name):
    rng = np.random.default_rng(5)
    rows, k = 6, 64
    if name == "F32":
        vals = rng.standard_normal((rows, k)).astype(np.float32)
        raw = vals.view(np.uint8)
    elif name == "F16":
        bits = rng.integers(0, 1 << 16, size=(rows, k), dtype=np.uint16)
        bits = np.where((bits & 0x7C00) == 0x7C00, bits ^ np.uint16(0x4000), bits)
        raw = bits.view(np.uint8)
    else:
        bits = rng.integers(0, 1 << 16, size=(rows, k), dtype=np.uint16)
        bits = np.where((bits & 0x7F80) == 0x7F80, bits ^ np.uint16(0x4000), bits)
        raw = bits.view(np.uint8)
    theirs = gguf.quants.dequantize(np.ascontiguousarray(raw), QT[name]).reshape(rows, k)
    ours = ours_dequantize(int(QT[name]), raw, rows, k)
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


def test_errors():
    raw = np.zeros(4096, dtype=np.uint8)
    out = np.zeros(4096, dtype=np.float32)
    with pytest.raises(ValueError, match="supported: F32, F16, BF16, Q4_0"):
        _core.gguf_dequantize(int(QT.IQ2_XXS), raw.ctypes.data, 1, 256, out.ctypes.data)
    with pytest.raises(ValueError, match="not a whole number of 256-element blocks"):
        _core.gguf_dequantize(int(QT.Q4_K), raw.ctypes.data, 1, 288, out.ctypes.data)
    codes = np.zeros(4096, dtype=np.int8)
    with pytest.raises(ValueError, match="float type"):
        _core.gguf_decode(
            int(QT.F16), raw.ctypes.data, 1, 64, 32, codes.ctypes.data, out.ctypes.data, 0
        )
    with pytest.raises(ValueError, match="does not divide"):
        _core.gguf_decode(
            int(QT.Q6_K), raw.ctypes.data, 1, 256, 32, codes.ctypes.data, out.ctypes.data, 0
        )
    with pytest.raises(ValueError, match="biases"):
        _core.gguf_decode(
            int(QT.Q4_K), raw.ctypes.data, 1, 256, 32, codes.ctypes.data, out.ctypes.data, 0
        )


def test_multithreaded_decode_is_identical():
    """Large calls split rows over the worker pool; the result does not depend on it."""
    from kt_jit import wrapper  # noqa: F401  (creates nothing; the pool may exist already)

    _core.init_pool(2, 1)
    info = types_by_name()["Q4_K"]
    rows, k = 512, 512
    raw = random_blocks("Q4_K", rows, k, seed=11)
    ours = ours_dequantize(info["id"], raw, rows, k)
    theirs = gguf.quants.dequantize(raw, QT.Q4_K)
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))
