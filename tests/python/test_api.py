"""The kt-kernel compatible API surface: constructor, validation, edge cases, helpers and CLIs."""

from __future__ import annotations

import inspect
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import kt_jit
from conftest import make_routing, make_weights, make_wrapper, run_python
from kt_jit import _core

E, K, H, I = 8, 2, 128, 64


@pytest.fixture(scope="module")
def w3():
    return make_weights(E, H, I, seed=1)


@pytest.fixture(scope="module")
def wrapper(w3):
    wr = make_wrapper(E, K, H, I, method="AMXINT8")
    wr.load_weights_from_tensors(*w3, torch.arange(E))
    return wr


def _inputs(T, dtype=torch.float32, seed=0):
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(seed)).to(dtype)
    ids, w = make_routing(T, E, K, seed=seed)
    return x, ids, w


# ------------------------------------------------------------------------------------------------
# module surface


def test_module_surface():
    assert isinstance(kt_jit.__version__, str) and kt_jit.__version__
    assert kt_jit.__isa__ in ("amx", "avx512_bf16", "avx512_vnni", "avx512", "avx2", "ref")
    assert isinstance(kt_jit.cpu_features(), dict)
    assert kt_jit.MoELayer is _core.MoELayer
    for name in ("KTMoEWrapper", "generate_gpu_experts_masks"):
        assert hasattr(kt_jit, name)


def test_constructor_signature_matches_kt_kernel():
    params = list(inspect.signature(kt_jit.KTMoEWrapper.__init__).parameters.values())[1:]
    expected = [
        ("layer_idx", inspect.Parameter.empty),
        ("num_experts", inspect.Parameter.empty),
        ("num_experts_per_tok", inspect.Parameter.empty),
        ("hidden_size", inspect.Parameter.empty),
        ("moe_intermediate_size", inspect.Parameter.empty),
        ("gpu_experts_mask", inspect.Parameter.empty),
        ("cpuinfer_threads", inspect.Parameter.empty),
        ("threadpool_count", inspect.Parameter.empty),
        ("weight_path", inspect.Parameter.empty),
        ("chunked_prefill_size", inspect.Parameter.empty),
        ("cpu_save", False),
        ("max_deferred_experts_per_token", None),
        ("method", "AMXINT4"),
        ("numa_nodes", None),
        ("mode", "inference"),
        ("num_gpu_experts", 0),
        ("lora_rank", 16),
        ("lora_alpha", 32.0),
        ("lora_dropout", 0.0),
        ("max_cache_depth", 1),
        ("group_size", 128),
        ("zero_point", True),
        ("full_weight_grad", False),
        ("swiglu_limit", 0.0),
        ("swiglu_alpha", 0.0),
    ]
    assert [(p.name, p.default) for p in params] == expected


def test_unknown_method_lists_valid_ones():
    with pytest.raises(ValueError) as ei:
        make_wrapper(E, K, H, I, method="INT3")
    msg = str(ei.value)
    assert "method" in msg and "INT3" in msg
    for m in ("AMXINT4", "AMXINT8", "RAWINT4", "FP8", "BF16", "LLAMAFILE", "MOE_INT8", "MXFP4"):
        assert m in msg


def test_unknown_mode_lists_valid_ones():
    with pytest.raises(ValueError) as ei:
        make_wrapper(E, K, H, I, method="AMXINT8", mode="training")
    assert "mode" in str(ei.value) and "inference" in str(ei.value)


@pytest.mark.parametrize("method", ["GPTQ_INT4", "LLAMAFILE", "RAWINT4", "MXFP4", "MXFP8"])
def test_checkpoint_only_methods_construct(method):
    """Every kt-kernel method name constructs; these load from checkpoint files only (their
    loaders are tested in test_loader_*), and nothing touches weights before load_weights."""
    wr = make_wrapper(E, K, H, I, method=method)
    assert wr.method == method and wr.moe is None


def test_swiglu_limit_only_for_mx():
    with pytest.raises(ValueError) as ei:
        make_wrapper(E, K, H, I, method="AMXINT8", swiglu_limit=7.0)
    assert "swiglu_limit" in str(ei.value)


def test_numa_nodes_length():
    with pytest.raises(ValueError) as ei:
        kt_jit.KTMoEWrapper(0, E, K, H, I, None, 2, 2, "", 64, method="AMXINT8", numa_nodes=[0])
    assert "numa_nodes" in str(ei.value)


def test_attributes_and_mask_copy():
    m = torch.zeros(E, dtype=torch.bool)
    m[1] = True
    wr = make_wrapper(E, K, H, I, method="MOE_INT8", mask=m)
    assert wr.num_experts == E and wr.num_experts_per_tok == K
    assert wr.hidden_size == H and wr.moe_intermediate_size == I
    assert wr.num_gpu_experts == 1
    assert wr.gpu_experts_mask.dtype == torch.bool and wr.gpu_experts_mask.shape == (E,)
    assert wr.gpu_experts_mask.data_ptr() != m.data_ptr()
    assert torch.equal(wr.gpu_experts_mask, m)
    wr2 = make_wrapper(E, K, H, I, method="MOE_INT8", mask=None)
    assert torch.count_nonzero(wr2.gpu_experts_mask) == 0
    with pytest.raises(ValueError, match="gpu_experts_mask"):
        make_wrapper(E, K, H, I, method="MOE_INT8", mask=torch.zeros(E + 1, dtype=torch.bool))


def test_capture_batch_sizes_and_cache():
    kt_jit.KTMoEWrapper.set_capture_batch_sizes([1, 2, 4])
    assert kt_jit.KTMoEWrapper.get_capture_batch_sizes() == [1, 2, 4]
    kt_jit.KTMoEWrapper.clear_buffer_cache()
    kt_jit.KTMoEWrapper.set_capture_batch_sizes([])


def test_load_weights_moe_int8_needs_a_weight_path():
    # MOE_INT8 reads kt-kernel's converted directories (test_loader_ktkernel.py); no path: clear error
    wr = make_wrapper(E, K, H, I, method="MOE_INT8")
    with pytest.raises(FileNotFoundError, match="weight_path"):
        wr.load_weights(torch.arange(E))


# ------------------------------------------------------------------------------------------------
# validation of load_weights_from_tensors


def test_load_validation(w3):
    gate, up, down = w3
    wr = make_wrapper(E, K, H, I, method="AMXINT8")
    cases = [
        ((gate[:, :, :-1], up, down, None), ValueError, "gate_proj"),
        ((gate, up[:-1], down, None), ValueError, "up_proj"),
        ((gate, up, down.transpose(1, 2), None), ValueError, "down_proj"),
        ((gate.to(torch.int32), up, down, None), TypeError, "gate_proj"),
        ((gate, up, down, torch.arange(E + 1)), ValueError, "physical_to_logical_map_cpu"),
        ((gate, up, down, torch.full((E,), E)), ValueError, "physical_to_logical_map_cpu"),
        ((gate, up, down, torch.full((E,), -1)), ValueError, "physical_to_logical_map_cpu"),
        ((gate, up, down, torch.zeros(E)), TypeError, "physical_to_logical_map_cpu"),
        (("gate", up, down, None), TypeError, "gate_proj"),
    ]
    for args, exc, name in cases:
        with pytest.raises(exc) as ei:
            wr.load_weights_from_tensors(*args)
        assert name in str(ei.value), (name, str(ei.value))
    assert wr.moe is None


def test_load_accepts_noncontiguous(w3):
    gate, up, down = w3
    x, ids, w = _inputs(5, seed=3)
    a = make_wrapper(E, K, H, I, method="AMXINT8")
    a.load_weights_from_tensors(gate, up, down, torch.arange(E))
    gate_nc = gate.transpose(1, 2).contiguous().transpose(1, 2)
    down_nc = torch.stack([down, down], dim=-1)[..., 0]  # strided view of the same values
    assert not gate_nc.is_contiguous() and not down_nc.is_contiguous()
    b = make_wrapper(E, K, H, I, method="AMXINT8")
    b.load_weights_from_tensors(gate_nc, up, down_nc, torch.arange(E, dtype=torch.int32))
    assert torch.equal(a.forward(x, ids, w), b.forward(x, ids, w))


# ------------------------------------------------------------------------------------------------
# validation of forward


def test_forward_before_load():
    wr = make_wrapper(E, K, H, I, method="AMXINT8")
    x, ids, w = _inputs(2)
    with pytest.raises(RuntimeError) as ei:
        wr.forward(x, ids, w)
    assert "load" in str(ei.value)


def test_forward_validation(wrapper):
    T = 3
    x, ids, w = _inputs(T)
    cases = [
        ((torch.randn(T, H + 1), ids, w), ValueError, "hidden_states"),
        ((torch.randint(0, 5, (T, H)), ids, w), TypeError, "hidden_states"),
        ((x, ids[:2], w), ValueError, "topk_ids"),
        ((x, torch.zeros(T, K + 1, dtype=torch.int64), w), ValueError, "topk_ids"),
        ((x, ids.reshape(-1), w), ValueError, "topk_ids"),
        ((x, ids.float(), w), TypeError, "topk_ids"),
        ((x, ids, w[:, :1]), ValueError, "topk_weights"),
        ((x, ids, w[:2]), ValueError, "topk_weights"),
        ((x, ids, (w * 10).to(torch.int32)), TypeError, "topk_weights"),
        (("x", ids, w), TypeError, "hidden_states"),
        ((x.to_sparse(), ids, w), TypeError, "hidden_states: expected a dense"),
        ((x, ids.to_sparse(), w), TypeError, "topk_ids: expected a dense"),
        ((x, ids, w.to_sparse()), TypeError, "topk_weights: expected a dense"),
    ]
    for args, exc, name in cases:
        with pytest.raises(exc) as ei:
            wrapper.forward(*args)
        assert name in str(ei.value), (name, str(ei.value))


def test_forward_error_message_names_expected_and_actual(wrapper):
    x, ids, w = _inputs(3)
    with pytest.raises(ValueError) as ei:
        wrapper.forward(x, torch.zeros(3, K + 3, dtype=torch.int64), w)
    msg = str(ei.value)
    assert f"[3, {K}]" in msg and f"[3, {K + 3}]" in msg


def test_cuda_stream_without_cuda_runtime():
    """A non-zero stream needs the CUDA runtime; without one (KT_JIT_CUDART names a library that
    does not exist) the error says so and stream 0 still works. The stream path itself is tested
    with a stand-in runtime in test_cuda_stream.py."""
    code = f"""
import sys, torch, pytest
sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r})
from conftest import make_weights, make_routing, make_wrapper
from kt_jit import _core
assert _core.cuda_runtime() is None and "no-such-cudart" in _core.cuda_runtime_error()
wr = make_wrapper(8, 2, 128, 64)
wr.load_weights_from_tensors(*make_weights(8, 128, 64, seed=1), torch.arange(8))
x = torch.randn(2, 128)
ids, w = make_routing(2, 8, 2, seed=1)
with pytest.raises(RuntimeError, match="CUDA runtime"):
    wr.forward(x, ids, w, cuda_stream=12345)
assert wr.forward(x, ids, w, cuda_stream=0).shape == (2, 128)
print("ok")
"""
    r = run_python(code, env_extra={"KT_JIT_CUDART": "/no-such-cudart.so"})
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_t_zero_returns_empty(wrapper, dtype):
    x = torch.empty(0, H, dtype=dtype)
    out = wrapper.forward(x, torch.empty(0, K, dtype=torch.int64), torch.empty(0, K))
    assert out.shape == (0, H) and out.dtype == dtype


def test_t_zero_before_load():
    wr = make_wrapper(E, K, H, I, method="AMXINT8")
    out = wr.forward(torch.empty(0, H), torch.empty(0, K, dtype=torch.int64), torch.empty(0, K))
    assert out.shape == (0, H)


def test_leading_dims_flattened_and_dtypes(wrapper):
    T = 6
    x, ids, w = _inputs(T, seed=4)
    base = wrapper.forward(x, ids, w)
    got = wrapper.forward(x.reshape(2, 3, H), ids.to(torch.int32), w.to(torch.float64))
    assert got.shape == (T, H)
    assert torch.equal(got, base)
    for dt in (torch.bfloat16, torch.float16):
        o = wrapper.forward(x.to(dt), ids.to(torch.int16), w.to(torch.bfloat16).float())
        assert o.dtype == dt and o.shape == (T, H)
    # ids of any integer dtype (SPEC §3), the wide unsigned ones included
    for name in ("int8", "uint8", "uint16", "uint32", "uint64"):
        if hasattr(torch, name):
            assert torch.equal(wrapper.forward(x, ids.to(getattr(torch, name)), w), base), name


def test_noncontiguous_inputs_bitwise(wrapper):
    T = 9
    x, ids, w = _inputs(T, seed=8)
    base = wrapper.forward(x, ids, w)
    x_t = x.t().contiguous().t()  # transposed view, same values
    big = torch.zeros(T, 2 * K, dtype=torch.int64)
    big[:, ::2] = ids
    ids_s = big[:, ::2]  # strided slice
    w_t = w.t().contiguous().t()
    assert not x_t.is_contiguous() and not ids_s.is_contiguous() and not w_t.is_contiguous()
    assert torch.equal(wrapper.forward(x_t, ids_s, w_t), base)
    x_big = torch.zeros(2 * T, H)
    x_big[::2] = x
    assert torch.equal(wrapper.forward(x_big[::2], ids, w), base)


def test_submit_sync(wrapper):
    x, ids, w = _inputs(4, dtype=torch.bfloat16, seed=10)
    wrapper.submit_forward(x, ids, w, None)
    out = wrapper.sync_forward(x, None)
    assert out.dtype == torch.bfloat16 and out.shape == (4, H)
    assert torch.equal(out, wrapper.forward(x, ids, w))


# ------------------------------------------------------------------------------------------------
# generate_gpu_experts_masks


def test_generate_gpu_experts_masks():
    freq = torch.tensor([[0.1, 0.5, 0.3, 0.8], [0.2, 0.4, 0.9, 0.1]])
    m = kt_jit.generate_gpu_experts_masks(freq, 3)
    expected = torch.tensor([[False, True, False, True], [False, False, True, False]])
    assert m.dtype == torch.bool and m.shape == (2, 4)
    assert torch.equal(m, expected)
    assert torch.count_nonzero(kt_jit.generate_gpu_experts_masks(freq, 0)) == 0
    assert torch.count_nonzero(kt_jit.generate_gpu_experts_masks(freq, -3)) == 0
    assert bool(kt_jit.generate_gpu_experts_masks(freq, 100).all())
    ints = torch.tensor([[10, 2, 8, 1], [1, 9, 3, 7]])
    expected = torch.tensor([[True, False, True, False], [False, True, False, False]])
    assert torch.equal(kt_jit.generate_gpu_experts_masks(ints, 3), expected)


# ------------------------------------------------------------------------------------------------
# command lines


def _run(args, tmp_path, timeout=180):
    env = dict(os.environ)
    env.pop("KT_JIT_ISA", None)
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(tmp_path),
        timeout=timeout,
    )


def test_dump_cli_no_disasm(tmp_path):
    if "avx512_vnni" not in _core.runnable_isas():
        pytest.skip("this machine cannot run avx512_vnni")
    proc = _run(["-m", "kt_jit.dump", "--isa", "avx512_vnni", "--no-disasm"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "avx512_vnni" in proc.stdout
    assert "bytes" in proc.stdout


def test_dump_cli_out_dir(tmp_path):
    if "avx2" not in _core.runnable_isas():
        pytest.skip("this machine cannot run avx2")
    out = tmp_path / "kernels"
    proc = _run(
        [
            "-m",
            "kt_jit.dump",
            "--isa",
            "avx2",
            "--experts",
            "16",
            "--top-k",
            "4",
            "--out",
            str(out),
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    bins = sorted(out.glob("*.bin"))
    assert bins, proc.stdout[-2000:]
    for b in bins:
        assert "avx2" in b.stem.replace("_", "")  # kernel names carry the ISA tag
        assert b.stat().st_size > 0
        meta = json.loads(b.with_suffix(".json").read_text())
        assert meta["size"] == b.stat().st_size > 0
        assert meta["name"] and meta["key"]
    # the disassembly is shown (objdump, or a hex dump without it)
    assert len(proc.stdout.splitlines()) > 3 * len(bins)


def test_dump_kernels_api():
    if _core.isa() == "ref":
        pytest.skip("the ref level generates no kernels")
    ks = _core.dump_kernels("AMXINT8", 16, 4, 256, 128, _core.isa())
    assert isinstance(ks, list)
    for k in ks:
        assert set(k) >= {"name", "key", "size", "gen_us", "code"}
        assert k["size"] == len(k["code"]) > 0


def test_version_cli(tmp_path):
    proc = _run(["-m", "kt_jit.cli", "version"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert kt_jit.__isa__ in proc.stdout
    assert kt_jit.__version__ in proc.stdout


def test_convert_cli_needs_arguments(tmp_path):
    # the converter itself is tested in test_convert.py
    proc = _run(["-m", "kt_jit.cli", "convert"], tmp_path)
    assert proc.returncode == 2
    assert "usage: kt-jit convert" in proc.stderr and "src" in proc.stderr


def test_doctor_cli(tmp_path):
    proc = _run(["-m", "kt_jit.cli", "doctor"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert kt_jit.__isa__ in proc.stdout
    for isa in _core.runnable_isas():
        assert f"{isa}" in proc.stdout
    assert "FAIL" not in proc.stdout
    # the system section: NUMA nodes with their CPUs, huge-page state
    assert "numa " in proc.stdout and "transparent huge pages:" in proc.stdout
    assert "huge pages:" in proc.stdout


def test_doctor_notes_thp_off(monkeypatch):
    """With transparent huge pages off, the system section says what that costs and how to
    turn them on; in madvise mode it says nothing more."""
    from kt_jit import cli

    state = {"thp": "always madvise [never]"}

    def fake_read(path):
        if path.endswith("transparent_hugepage/enabled"):
            return state["thp"]
        return ""

    monkeypatch.setattr(cli, "_read", fake_read)
    lines = cli._system_lines()
    assert any(x.startswith("note: transparent huge pages are off") for x in lines), lines
    state["thp"] = "always [madvise] never"
    assert not any(x.startswith("note:") for x in cli._system_lines())


def test_startup_log_line(tmp_path):
    """The start-up line is visible by default (stderr) and KT_JIT_LOG_LEVEL=WARNING silences it."""
    code = (
        "import kt_jit\n"
        "kt_jit.KTMoEWrapper(0, 8, 2, 64, 32, None, 2, 1, '', 64, method='MOE_INT8')\n"
    )
    env = dict(os.environ)
    env.pop("KT_JIT_ISA", None)
    env.pop("KT_JIT_DEBUG", None)
    env.pop("KT_JIT_LOG_LEVEL", None)
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=str(tmp_path)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stderr.splitlines() if "threads=" in ln]
    assert line, proc.stderr[-3000:]
    for part in (kt_jit.__version__, f"isa={kt_jit.__isa__}", "pools=1", "numa_nodes", "MOE_INT8"):
        assert part in line[0], line[0]
    env["KT_JIT_LOG_LEVEL"] = "WARNING"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=str(tmp_path)
    )
    assert proc.returncode == 0 and "threads=" not in proc.stderr, proc.stderr[-3000:]
