"""tools/kernel_profile.py: samples attributed to kernels by the perf map, loops found in the
disassembly, and the report, on a hand-made kernel (objdump from binutils disassembles it)."""

from __future__ import annotations

import importlib.util
import os
import shutil

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location(
    "kernel_profile", os.path.join(ROOT, "tools", "kernel_profile.py")
)
kp = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kp)

# xor ecx,ecx ; L: add ecx,1 ; dec rdx ; jne L ; ret  (offsets 0, 2, 5, 8, 10)
CODE = bytes.fromhex("31c9" "83c101" "48ffca" "75f8" "c3")
MAP = "7f0000001000 b loop_kernel\n7f0000002000 40 other_kernel\nnot a line\n"


def test_samples_land_in_the_kernel_that_holds_them():
    kernels = kp.parse_perf_map(MAP)
    assert kernels == [(0x7F0000001000, 11, "loop_kernel"), (0x7F0000002000, 0x40, "other_kernel")]
    ips = kp.parse_ips("7f0000001002\n7f0000001005\n7f0000001005\n7f000000100b\n7f0000002010\nzz\n")
    per_kernel, offsets, outside = kp.attribute(ips, kernels)
    # 0x100b is one past loop_kernel's last byte: outside, as is nothing else
    assert per_kernel == {"loop_kernel": 3, "other_kernel": 1} and outside == 1
    assert offsets["loop_kernel"] == {2: 1, 5: 2}


@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) disassembles")
def test_loops_and_report_from_a_dumped_kernel(tmp_path, capsys):
    (tmp_path / "loop_kernel.bin").write_bytes(CODE)
    insns = kp.disassemble(str(tmp_path / "loop_kernel.bin"))
    assert [o for o, _ in insns] == [0, 2, 5, 8, 10]
    assert insns[3][1].startswith("jne")
    assert kp.loops(insns) == [(2, 10)]  # the jne back to offset 2; the loop ends after it
    ips = tmp_path / "ips.txt"
    ips.write_text("7f0000001000\n" + "7f0000001005\n" * 3 + "7f0000002000\n")
    mp = tmp_path / "perf.map"
    mp.write_text(MAP)
    assert kp.main(["--ips", str(ips), "--map", str(mp), "--dump", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "5 samples; 0 (0.0 %) outside kernels" in out
    assert " 80.00 %  loop_kernel" in out and " 20.00 %  other_kernel" in out
    assert "[   0x2,    0xa)   75.0 %  3" in out  # 3 of the kernel's 4 samples in its loop
    assert "0x5   75.0 %  dec" in out


def test_refusals(tmp_path):
    mp = tmp_path / "perf.map"
    mp.write_text(MAP)
    ips = tmp_path / "ips.txt"
    ips.write_text("7f0000001002\n")
    with pytest.raises(SystemExit, match="one of --perf-data or --ips"):
        kp.main(["--map", str(mp)])
    with pytest.raises(SystemExit, match="not in"):
        kp.main(["--ips", str(ips), "--map", str(mp), "--kernel", "nope"])
    with pytest.raises(SystemExit, match="missing"):
        kp.main(["--ips", str(ips), "--map", str(mp), "--dump", str(tmp_path)])
    ips.write_text("1234\n")
    with pytest.raises(SystemExit, match="no sample fell"):
        kp.main(["--ips", str(ips), "--map", str(mp)])
