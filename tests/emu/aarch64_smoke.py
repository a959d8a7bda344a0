"""AArch64 smoke test of the kt_jit Python package, meant to run under ``qemu-aarch64`` with an
arm64 CPython, torch and the cross-built extension (see run_aarch64_python.sh).

Checks, for the CPU model qemu emulates:
- the probe reports AArch64 (HWCAP bits) and the engine selects the expected NEON level
  (``KT_JIT_EXPECT_ISA``: neon_bf16 under ``-cpu max``, neon under ``-cpu cortex-a72``);
- ``machine_limits()`` measures a read bandwidth and the peaks of that level with the generated
  NEON loops (fmla, sdot / smull+sadalp, bfdot), and zero for the x86-64 ones;
- AMXINT8, AMXINT4 and BF16 layers loaded from random weights, and an FP8 layer (e4m3 with
  128x128 block scales, through load_experts_fp8), run on generated NEON kernels, and for T in
  (1, 7, 40) give the same bits as the core's plain C++ reference path and agree with the
  independent fp32 torch reference of tests/python/conftest.py within the pytest suite's bars;
- the k-group integer layers of tests/python/test_moe_qgroup.py (LLAMAFILE bytes and nibble
  tables with and without a bias, GPTQ_INT4, RAWINT4) likewise at T = 1 and 40, against its fp32
  and same-activation-quantization torch references;
- MXFP4 and MXFP8 layers of tests/python/test_moe_mx.py, plain and with the SwiGLU limit and
  alpha, at T = 1 and 40, against its torch reference (SPEC §4's activation written there);
- kt-jit doctor's pieces: the NEON levels above the selected one, and the FP8, MXFP4, MXFP8,
  LLAMAFILE, RAWINT4 and AMXINT8 self-tests passing (every format has NEON kernels).

Prints one ``PASS <check>`` / ``FAIL <check>: <why>`` line per check, then
``smoke: N passed, M failed``; exits 1 if anything failed.
"""

from __future__ import annotations

import os
import sys
import time

T0 = time.time()
import torch  # noqa: E402

T_TORCH = time.time() - T0
import kt_jit  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from smoke_checks import check, check_matches_reference, run  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import conftest as ref  # noqa: E402  (plain torch: the reference of the pytest suite)
import test_moe_mx as mxt  # noqa: E402  (its MX weights, layers and torch reference)
import test_moe_qgroup as qg  # noqa: E402  (its experts, layers and torch references)

E, K, H, I = 8, 2, 64, 48
# Bars as in tests/python: relative L1 vs the fp32 reference over the dequantized weights.
METHODS = {
    "AMXINT8": (ref.quantize_rows, 3e-2),
    "AMXINT4": (ref.quantize_rows_int4, 3e-2),
    "BF16": (lambda w: (w.to(torch.bfloat16).to(torch.float32), torch.ones(1)), 1e-2),
}


def isa_tag(isa: str) -> str:
    """The level as kernel names spell it (jit/cpu/cpu.cpp isa_tag), between underscores."""
    return "_" + {"neon_dotprod": "neondot"}.get(isa, isa.replace("_", "")) + "_"


def check_kernels(what: str, layer, want_isa: str, marker: str = "") -> None:
    """Every kernel the layer built is generated for `want_isa` (and names `marker`)."""
    names = list(layer.kernel_names())
    check(
        f"{what}: kernels generated for {want_isa}",
        bool(names) and all(isa_tag(want_isa) in n and marker in n for n in names),
        f"{len(names)} kernels, e.g. {names[:2]}",
    )


def run_method(method: str, want_isa: str) -> None:
    quantizer, bar = METHODS[method]
    gate, up, down = ref.make_weights(E, H, I, seed=7)
    pmap = torch.randperm(E, generator=torch.Generator().manual_seed(3))
    moe = ref.make_wrapper(E, K, H, I, method=method)
    moe.load_weights_from_tensors(gate, up, down, pmap)
    layer = moe.moe
    check(f"{method}: layer isa is {want_isa}", layer.isa == want_isa, f"layer.isa = {layer.isa!r}")
    # T = 40 puts about 10 rows on an expert: the prefill tiles (bfdot pairs at neon_bf16) run.
    for T in (1, 7, 40):
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(100 + T))
        ids, w = ref.make_routing(T, E, K, seed=T)
        t0 = time.time()
        out = moe.forward(x, ids, w)
        dt = time.time() - t0
        check(
            f"{method} T={T} forward shape and finite",
            tuple(out.shape) == (T, H) and bool(torch.isfinite(out).all()),
            f"{tuple(out.shape)}, {dt:.2f} s",
        )
        check_matches_reference(
            f"{method} T={T} generated {want_isa} == forward_reference bitwise",
            layer,
            x,
            ids,
            w,
            out,
        )
        expect = ref.moe_reference(x, ids, w, gate, up, down, pmap=pmap, wq=quantizer)
        err = ref.rel_l1(out, expect)
        check(f"{method} T={T} vs torch fp32 reference", err <= bar, f"relative L1 {err:.3g}")
    check_kernels(method, layer, want_isa)


def run_fp8(want_isa: str) -> None:
    """FP8 (e4m3, 128x128 block scales) through load_experts_fp8, as the HF loader feeds it."""
    e, k, h, i = 8, 2, 256, 128  # two scale blocks along H, one along I
    g = torch.Generator().manual_seed(11)
    shapes = ((i, h), (i, h), (h, i))
    mats = [(torch.randn(e, n, kk, generator=g) * 20).to(torch.float8_e4m3fn) for n, kk in shapes]
    scales = [
        torch.rand(e, (n + 127) // 128, (kk + 127) // 128, generator=g) * 0.01 + 0.001
        for n, kk in shapes
    ]
    layer = kt_jit._core.MoELayer(e, k, h, i, "FP8", want_isa)
    slots = list(range(e))
    layer.load_experts_fp8(slots, *[[t[x].data_ptr() for x in slots] for t in mats + scales])
    check(f"FP8: layer isa is {want_isa}", layer.isa == want_isa, f"layer.isa = {layer.isa!r}")

    def dequant(q, s):
        big = s.repeat_interleave(128, dim=1).repeat_interleave(128, dim=2)
        return q.to(torch.float32) * big[:, : q.shape[1], : q.shape[2]]

    gate, up, down = (dequant(q, s) for q, s in zip(mats, scales))
    for T in (1, 7, 40):
        x = torch.randn(T, h, generator=torch.Generator().manual_seed(200 + T))
        ids, w = ref.make_routing(T, e, k, seed=T)
        out = torch.empty(T, h)
        layer.forward(T, x.data_ptr(), ids.data_ptr(), w.data_ptr(), 0, out.data_ptr())
        check_matches_reference(
            f"FP8 T={T} generated {want_isa} == forward_reference bitwise", layer, x, ids, w, out
        )
        expect = ref.moe_reference(x, ids, w, gate, up, down, wq=lambda t: (t, torch.ones(1)))
        err = ref.rel_l1(out, expect)
        check(f"FP8 T={T} vs torch fp32 reference", err <= 1e-2, f"relative L1 {err:.3g}")
    check_kernels("FP8", layer, want_isa, "_fp8_")


def run_qgroup(want_isa: str) -> None:
    """The k-group integer cases of the pytest suite (GGUF-like bytes and nibble tables, biases,
    GPTQ_INT4, RAWINT4) on the generated NEON qgroup kernels."""
    for method, gg, dg, lut, bias in qg.CASES:
        what = f"{method} G={gg}/{dg} {'nibbles' if lut else 'bytes'}{' bias' if bias else ''}"
        experts = qg.make_experts(7 + gg + dg + len(lut), gg, dg, lut, bias)
        layer = qg.make_layer(method, gg, dg, lut, bias, experts)
        check(f"{what}: layer isa is {want_isa}", layer.isa == want_isa, f"{layer.isa!r}")
        for T in (1, 40):
            x, ids, w = qg.inputs(T, T)
            out = qg.forward(layer, x, ids, w)
            check_matches_reference(
                f"{what} T={T} generated {want_isa} == forward_reference bitwise",
                layer,
                x,
                ids,
                w,
                out,
            )
            err1 = ref.rel_l1(out, qg.ref_fp32(x, ids, w, experts))
            check(f"{what} T={T} vs torch fp32 reference", err1 <= 3e-2, f"relative L1 {err1:.3g}")
            err2 = ref.rel_l1(out, qg.ref_actq(x, ids, w, experts, [0, qg.I]))
            check(
                f"{what} T={T} vs float64 with the kernels' activation quantization",
                err2 <= 1e-3,
                f"relative L1 {err2:.3g}",
            )
        check_kernels(what, layer, want_isa, "_qg")


def run_mx(want_isa: str) -> None:
    """MXFP4 / MXFP8 on the generated NEON kernels, plain and with the SwiGLU limit and alpha."""
    for method in ("MXFP4", "MXFP8"):
        for limit, alpha in ((0.0, 0.0), (1.0, 1.702)):
            what = f"{method} L={limit} alpha={alpha}"
            for T in (1, 40):
                ws, ss, (gate, up, down) = mxt._mx_weights(T, method == "MXFP4")
                layer = mxt._layer(method, "", ws, ss, limit, alpha)
                if T == 1:
                    check(f"{what}: layer isa is {want_isa}", layer.isa == want_isa, layer.isa)
                x = torch.randn(T, mxt.H, generator=torch.Generator().manual_seed(100 + T))
                ids, w = ref.make_routing(T, mxt.E, mxt.K, seed=T)
                out = torch.empty(T, mxt.H)
                layer.forward(T, x.data_ptr(), ids.data_ptr(), w.data_ptr(), 0, out.data_ptr())
                check_matches_reference(
                    f"{what} T={T} generated {want_isa} == forward_reference bitwise",
                    layer,
                    x,
                    ids,
                    w,
                    out,
                )
                expect = mxt._reference(x, ids, w, gate, up, down, limit, alpha)
                err = ref.rel_l1(out, expect)
                # fp32 activations on NEON: the pytest suite's tight bar for fp32 paths
                check(f"{what} T={T} vs torch reference", err <= 1e-5, f"relative L1 {err:.3g}")
            check_kernels(what, layer, want_isa, "_" + method.lower() + "_")


def main() -> int:
    want = os.environ.get("KT_JIT_EXPECT_ISA", "")
    print(
        f"aarch64_smoke: python {sys.version.split()[0]}, torch {torch.__version__} "
        f"(import {T_TORCH:.1f} s), kt_jit {kt_jit.__version__}, expect isa {want!r}",
        flush=True,
    )
    feats = kt_jit.cpu_features()
    check(
        "probe reports aarch64", feats.get("aarch64") is True, f"aarch64 = {feats.get('aarch64')}"
    )
    check("asimd present", feats.get("asimd") is True)
    check(
        f"isa is {want}",
        kt_jit.__isa__ == want,
        f"kt_jit.__isa__ = {kt_jit.__isa__!r}, asimd_dp = {feats.get('asimd_dp')}, "
        f"arm_bf16 = {feats.get('arm_bf16')}",
    )

    t0 = time.time()
    lim = kt_jit._core.machine_limits()
    summary = ", ".join(f"{k} {v:.3g}" for k, v in lim.items() if v)
    print(f"aarch64_smoke: machine_limits in {time.time() - t0:.1f} s: {summary}", flush=True)
    check("read bandwidth measured", lim["read_gbs_1t"] > 0)
    check("fmla peak measured", lim["peak_fma_gflops"] > 0)
    check("smull+sadalp peak measured", lim["peak_smull_gops"] > 0)
    check(
        "sdot peak measured where the level has it",
        (lim["peak_sdot_gops"] > 0) == (want != "neon"),
        f"{lim['peak_sdot_gops']:.3g}",
    )
    check(
        "bfdot peak measured where the level has it",
        (lim["peak_bfdot_gflops"] > 0) == (want == "neon_bf16"),
        f"{lim['peak_bfdot_gflops']:.3g}",
    )
    x86 = ("peak_vnni_gops", "peak_maddubsw_gops", "peak_bf16_gflops", "peak_amx_int8_gops")
    check("no x86-64 peaks", all(lim[k] == 0 for k in x86))

    for method in METHODS:
        run_method(method, want)
    run_fp8(want)
    run_qgroup(want)
    run_mx(want)

    # kt-jit doctor's pieces: this architecture's levels, and each format's self-test on the
    # generated NEON kernels.
    from kt_jit import cli

    higher = cli._higher_levels(feats, want)
    check(
        "doctor lists the NEON levels above the selected one",
        higher == list(cli.NEON_LEVELS[: cli.NEON_LEVELS.index(want)]),
        f"{higher}",
    )
    for method in ("FP8", "MXFP4", "MXFP8", "LLAMAFILE", "RAWINT4"):
        problem = cli._self_test(want, method)
        check(f"doctor: {method} self-test passes (NEON kernels)", problem == "", problem)
    problem = cli._self_test(want, "AMXINT8")
    check("doctor: AMXINT8 self-test passes", problem == "", problem)
    return 0


if __name__ == "__main__":
    run(main, T0)
