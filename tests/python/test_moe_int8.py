"""AMXINT8 / MOE_INT8 numerics: accuracy against an independent torch reference, masks, routing
edge cases, determinism (run to run, thread count, chunking) and JIT-vs-reference per ISA."""

from __future__ import annotations

import os

import pytest
import torch

import kt_jit
from conftest import make_routing
from kt_jit import _core

E, K, H, I = 16, 4, 576, 352
MASKED = (3, 11)  # physical slots marked as GPU experts at construction
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def weights(ref):
    return ref.make_weights(E, H, I, seed=7)


@pytest.fixture(scope="module")
def pmap():
    return torch.randperm(E, generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def loaded(ref, weights, pmap):
    mask = torch.zeros(E, dtype=torch.bool)
    mask[list(MASKED)] = True
    wrapper = ref.make_wrapper(E, K, H, I, method="AMXINT8", mask=mask)
    gate, up, down = weights
    wrapper.load_weights_from_tensors(gate, up, down, pmap)
    return wrapper


def _inputs(T, dtype, seed=0):
    g = torch.Generator().manual_seed(100 + seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    ids, w = make_routing(T, E, K, seed=seed)
    return x, ids, w


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("T", [1, 3, 64, 300])
def test_accuracy_vs_torch(ref, loaded, weights, pmap, T, dtype):
    gate, up, down = weights
    x, ids, w = _inputs(T, dtype, seed=T)
    mask = loaded.gpu_experts_mask.clone()
    out = loaded.forward(x, ids, w)
    assert out.shape == (T, H)
    assert out.dtype == dtype

    ref1 = ref.moe_reference(x, ids, w, gate, up, down, pmap=pmap, mask=mask)
    err1 = ref.rel_l1(out, ref1)
    assert err1 <= 3e-2, f"relative L1 vs dequantized fp32 reference: {err1:.4g} (T={T})"

    ref2 = ref.moe_reference_actq(x, ids, w, gate, up, down, pmap=pmap, mask=mask)
    ref2 = ref2.to(torch.float32).to(dtype)  # the only remaining rounding: the output dtype
    err2 = ref.rel_l1(out, ref2)
    assert err2 <= 1e-3, f"relative L1 vs same-activation-quantization reference: {err2:.4g}"


def test_invalid_and_masked_slots_contribute_nothing(ref, loaded):
    T = 8
    x, ids, w = _inputs(T, torch.float32, seed=42)
    # a token whose every slot is invalid or masked gives exactly zero
    bad = torch.tensor([[-1, E, E + 100, MASKED[0]]] * T, dtype=torch.int64)
    assert torch.count_nonzero(loaded.forward(x, bad, w)) == 0
    # every kind of skipped id gives the same result, which equals a zero routing weight
    outs = []
    for skipped in (-1, -(2**40), E, E + 12345, MASKED[1]):
        ids2 = ids.clone()
        ids2[:, 0] = skipped
        outs.append(loaded.forward(x, ids2, w))
    for o in outs[1:]:
        assert torch.equal(o, outs[0])
    ids3 = ids.clone()
    ids3[:, 0] = torch.where(ids[:, 0] >= 0, ids[:, 0], torch.zeros_like(ids[:, 0]))
    ids3[:, 0] = torch.where(ids3[:, 0] < E, ids3[:, 0], torch.zeros_like(ids3[:, 0]))
    w3 = w.clone()
    w3[:, 0] = 0.0
    assert torch.allclose(loaded.forward(x, ids3, w3), outs[0], rtol=1e-6, atol=1e-7)


def test_gpu_mask_edited_in_place(ref, weights, pmap):
    gate, up, down = weights
    orig_mask = torch.zeros(E, dtype=torch.bool)
    wrapper = ref.make_wrapper(E, K, H, I, method="AMXINT8", mask=orig_mask)
    assert wrapper.gpu_experts_mask.data_ptr() != orig_mask.data_ptr(), "mask must be a copy"
    assert (
        wrapper.gpu_experts_mask.dtype == torch.bool
        and wrapper.gpu_experts_mask.device.type == "cpu"
    )
    wrapper.load_weights_from_tensors(gate, up, down, pmap)
    T = 16
    x, ids, w = _inputs(T, torch.float32, seed=5)
    out0 = wrapper.forward(x, ids, w)

    # editing the caller's tensor after construction has no effect
    orig_mask[:] = True
    assert torch.equal(wrapper.forward(x, ids, w), out0)

    # SGLang-style in-place edit of wrapper.gpu_experts_mask takes effect at the next forward
    used = [int(e) for e in ids[ids >= 0].unique() if int(e) < E][:3]
    new_mask = torch.zeros(E, dtype=torch.bool)
    new_mask[used] = True
    wrapper.gpu_experts_mask.copy_(new_mask)
    out1 = wrapper.forward(x, ids, w)
    assert not torch.equal(out1, out0)
    ref1 = ref.moe_reference_actq(x, ids, w, gate, up, down, pmap=pmap, mask=new_mask)
    assert ref.rel_l1(out1, ref1) <= 1e-3

    wrapper.gpu_experts_mask[:] = True
    assert torch.count_nonzero(wrapper.forward(x, ids, w)) == 0

    wrapper.gpu_experts_mask.zero_()
    assert torch.equal(wrapper.forward(x, ids, w), out0)


def test_bf16_and_fp16_weights(ref, weights, pmap):
    gate, up, down = weights
    T = 5
    x, ids, w = _inputs(T, torch.bfloat16, seed=9)
    for wdtype in (torch.bfloat16, torch.float16):
        wg, wu, wd = (t.to(wdtype) for t in (gate, up, down))
        wrapper = ref.make_wrapper(E, K, H, I, method="MOE_INT8")
        wrapper.load_weights_from_tensors(wg, wu, wd, pmap)
        out = wrapper.forward(x, ids, w)
        refq = ref.moe_reference_actq(
            x, ids, w, wg.float(), wu.float(), wd.float(), pmap=pmap
        ).float()
        assert ref.rel_l1(out, refq.to(torch.bfloat16)) <= 1e-3, wdtype


def test_identity_map_default(ref, weights):
    gate, up, down = weights
    T = 4
    x, ids, w = _inputs(T, torch.float32, seed=11)
    a = ref.make_wrapper(E, K, H, I, method="AMXINT8")
    a.load_weights_from_tensors(gate, up, down, torch.arange(E))
    b = ref.make_wrapper(E, K, H, I, method="AMXINT8")
    b.load_weights_from_tensors(gate, up, down, None)
    assert torch.equal(a.forward(x, ids, w), b.forward(x, ids, w))


def test_amxint8_equals_moe_int8(ref, weights, pmap):
    gate, up, down = weights
    x, ids, w = _inputs(7, torch.float32, seed=12)
    outs = []
    for method in ("AMXINT8", "MOE_INT8"):
        wr = ref.make_wrapper(E, K, H, I, method=method)
        wr.load_weights_from_tensors(gate, up, down, pmap)
        outs.append(wr.forward(x, ids, w))
    assert torch.equal(outs[0], outs[1])


# ------------------------------------------------------------------------------------------------
# determinism


def test_bitwise_run_to_run(loaded):
    x, ids, w = _inputs(64, torch.float32, seed=21)
    a = loaded.forward(x, ids, w)
    b = loaded.forward(x, ids, w)
    assert torch.equal(a, b)
    loaded.submit_forward(x, ids, w, None)
    c = loaded.sync_forward(x, None)
    assert torch.equal(a, c)


def test_chunked_prefill_matches_unsplit(ref, weights, pmap):
    gate, up, down = weights
    T = 300
    x, ids, w = _inputs(T, torch.bfloat16, seed=31)
    whole = ref.make_wrapper(E, K, H, I, method="AMXINT8", chunked_prefill_size=4096)
    whole.load_weights_from_tensors(gate, up, down, pmap)
    expected = whole.forward(x, ids, w)
    for chunk in (64, 7):
        split = ref.make_wrapper(E, K, H, I, method="AMXINT8", chunked_prefill_size=chunk)
        split.load_weights_from_tensors(gate, up, down, pmap)
        got = split.forward(x, ids, w)
        assert got.shape == (T, H) and got.dtype == torch.bfloat16
        assert torch.equal(got, expected), f"chunked_prefill_size={chunk}"


_THREAD_SCRIPT = r"""
import sys, torch
sys.path.insert(0, {tests_dir!r})
import conftest as c
import kt_jit
E, K, H, I = {E}, {K}, {H}, {I}
gate, up, down = c.make_weights(E, H, I, seed=7)
pmap = torch.randperm(E, generator=torch.Generator().manual_seed(3))
wr = kt_jit.KTMoEWrapper(0, E, K, H, I, None, {threads}, 1, "", 1024, method="AMXINT8")
wr.load_weights_from_tensors(gate, up, down, pmap)
outs = []
for T, seed in ((1, 1), (9, 2), (200, 3)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    ids, w = c.make_routing(T, E, K, seed=seed)
    outs.append(wr.forward(x, ids, w))
torch.save(outs, {path!r})
"""


def test_thread_count_independent(ref, tmp_path):
    results = []
    for threads in (1, 2):
        path = str(tmp_path / f"out_{threads}.pt")
        code = _THREAD_SCRIPT.format(
            tests_dir=TESTS_DIR, E=E, K=K, H=H, I=I, threads=threads, path=path
        )
        proc = ref.run_python(code, cwd=str(tmp_path))
        assert proc.returncode == 0, proc.stderr[-3000:]
        results.append(torch.load(path))
    for a, b in zip(*results):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------
# JIT kernels vs the C++ reference kernels, per ISA level


SHAPES = [
    # E, K, H, I, T
    (4, 2, 64, 32, 1),
    (16, 4, 576, 352, 5),
    (6, 3, 130, 70, 33),
    (8, 8, 256, 192, 67),
]


@pytest.mark.parametrize("isa", list(_core.runnable_isas()))
def test_jit_equals_reference_per_isa(ref, isa):
    for n, (e, k, h, i, t) in enumerate(SHAPES):
        gate, up, down = ref.make_weights(e, h, i, seed=50 + n)
        layer = _core.MoELayer(e, k, h, i, "AMXINT8", isa)
        assert layer.isa == isa
        p = torch.randperm(e, generator=torch.Generator().manual_seed(n))
        layer.load_from_float(gate.data_ptr(), up.data_ptr(), down.data_ptr(), "f32", p.data_ptr())
        x = torch.randn(t, h, generator=torch.Generator().manual_seed(60 + n))
        ids, w = ref.make_routing(t, e, k, seed=70 + n)
        mask = torch.zeros(e, dtype=torch.bool)
        mask[e - 1] = True
        for mask_ptr in (0, mask.data_ptr()):
            out = torch.full((t, h), float("nan"))
            exp = torch.full((t, h), float("nan"))
            layer.forward(t, x.data_ptr(), ids.data_ptr(), w.data_ptr(), mask_ptr, out.data_ptr())
            layer.forward_reference(
                t, x.data_ptr(), ids.data_ptr(), w.data_ptr(), mask_ptr, exp.data_ptr()
            )
            assert torch.equal(out, exp), (
                f"isa={isa} E={e} K={k} H={h} I={i} T={t} mask={'on' if mask_ptr else 'off'}: "
                f"max diff {(out - exp).abs().max().item():.3g}"
            )
            refq = ref.moe_reference_actq(
                x, ids, w, gate, up, down, pmap=p, mask=mask if mask_ptr else None
            )
            assert ref.rel_l1(out, refq) <= 1e-3


# ------------------------------------------------------------------------------------------------
# KT_JIT_ISA caps


def test_isa_cap_avx2(ref, tmp_path):
    if "avx2" not in _core.runnable_isas():
        pytest.skip("this machine cannot run the avx2 level")
    proc = ref.run_python(
        "import kt_jit; print(kt_jit.__isa__)", env_extra={"KT_JIT_ISA": "avx2"}, cwd=str(tmp_path)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "avx2"


def test_isa_cap_ref(ref, tmp_path):
    proc = ref.run_python(
        "import kt_jit; print(kt_jit.__isa__)", env_extra={"KT_JIT_ISA": "ref"}, cwd=str(tmp_path)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "ref"


_AMX_SCRIPT = r"""
import sys
try:
    import kt_jit
    from kt_jit import _core
    isa = kt_jit.__isa__
    layer = _core.MoELayer(4, 2, 64, 32, "AMXINT8")
    isa = layer.isa
except Exception as e:
    print("ERROR:", type(e).__name__, e)
    sys.exit(3)
print("ISA:", isa)
"""


def test_isa_cap_amx_missing(ref, tmp_path):
    if kt_jit.cpu_features().get("detected_isa") == "amx":
        pytest.skip("this machine has AMX: asking for it is not an error here")
    proc = ref.run_python(_AMX_SCRIPT, env_extra={"KT_JIT_ISA": "amx"}, cwd=str(tmp_path))
    msg = proc.stdout + proc.stderr
    assert proc.returncode == 3, f"KT_JIT_ISA=amx on a machine without AMX did not fail: {msg}"
    assert "amx" in msg.lower(), msg


def test_selected_isa_is_runnable():
    runnable = list(_core.runnable_isas())
    assert runnable[-1] == "ref"
    assert kt_jit.__isa__ in runnable
    assert kt_jit.__isa__ == _core.isa()
    feats = kt_jit.cpu_features()
    assert isinstance(feats, dict) and "isa" in feats and "detected_isa" in feats
    if not os.environ.get("KT_JIT_ISA"):
        assert kt_jit.__isa__ == runnable[0]


def test_layers_share_the_forward_scratch_safely(ref):
    """All layers' forwards take one per-process scratch in turn (runtime/moe_layer.cpp
    shared_scratch, laid out anew each forward): two layers of different shapes and methods,
    forwards interleaved at growing and shrinking T, give each layer the bits it gives alone.
    (Concurrent forwards: tests/cpp/test_moe_layer.cpp LayersShareTheForwardScratchSafely; the
    binding runs one forward at a time.)"""
    _core.init_pool(ref.THREADS, ref.POOLS)
    shapes = [(16, 4, 576, 352, "AMXINT8"), (8, 2, 320, 192, "AMXINT4")]
    layers, cases = [], []
    for li, (e, k, h, i, method) in enumerate(shapes):
        g = torch.Generator().manual_seed(20 + li)
        src = [torch.randn(*sh, generator=g) * 0.05 for sh in ((e, i, h), (e, i, h), (e, h, i))]
        layer = _core.MoELayer(e, k, h, i, method, _core.isa())
        layer.load_from_float(src[0].data_ptr(), src[1].data_ptr(), src[2].data_ptr(), "f32", 0)
        layers.append((layer, h))
        for t in (300, 1, 40):
            x = torch.randn(t, h, generator=g)
            ids, w = make_routing(t, e, k, seed=t + li)
            cases.append((li, x, ids, w))

    def forward(idx):
        li, x, ids, w = cases[idx]
        layer, h = layers[li]
        out = torch.empty(x.shape[0], h)
        layer.forward(x.shape[0], x.data_ptr(), ids.data_ptr(), w.data_ptr(), 0, out.data_ptr())
        return out

    # each case alone first, then interleaved: large T on one layer, small on the other
    alone = [forward(idx) for idx in range(len(cases))]
    order = list(range(len(cases)))
    for idx in order + order[::-1]:
        assert torch.equal(forward(idx), alone[idx]), idx
