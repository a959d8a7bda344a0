"""Every built method at every ISA level this machine runs: the generated kernels give bitwise the
output of the same executor on the C++ reference kernels (the AMXINT8 version, with masks and a
permuted map, lives in test_moe_int8.py)."""

from __future__ import annotations

import pytest
import torch

from kt_jit import _core

SHAPES = [(4, 2, 64, 32, 1), (8, 2, 200, 72, 9), (16, 4, 576, 352, 40)]  # E, K, H, I, T
FORMAT_TAG = {"AMXINT4": "int4", "MOE_INT4": "int4", "BF16": "bf16"}


@pytest.mark.parametrize("isa", list(_core.runnable_isas()))
@pytest.mark.parametrize("method", sorted(FORMAT_TAG))
def test_jit_equals_reference(ref, method, isa):
    for n, (e, k, h, i, t) in enumerate(SHAPES):
        gate, up, down = ref.make_weights(e, h, i, seed=90 + n)
        layer = _core.MoELayer(e, k, h, i, method, isa)
        layer.load_from_float(gate.data_ptr(), up.data_ptr(), down.data_ptr(), "f32", 0)
        x = torch.randn(t, h, generator=torch.Generator().manual_seed(n))
        ids, w = ref.make_routing(t, e, k, seed=n)
        out = torch.full((t, h), float("nan"))
        exp = torch.full((t, h), float("nan"))
        layer.forward(t, x.data_ptr(), ids.data_ptr(), w.data_ptr(), 0, out.data_ptr())
        layer.forward_reference(t, x.data_ptr(), ids.data_ptr(), w.data_ptr(), 0, exp.data_ptr())
        assert torch.equal(out, exp), f"{method} isa={isa} E={e} H={h} I={i} T={t}"
        if isa != "ref":
            assert all(FORMAT_TAG[method] in name for name in layer.kernel_names())
