"""Worker pools on simulated NUMA topologies (issue #5 items 1-3).

The pools are process-wide, so every layout runs in a fresh interpreter with KT_JIT_TOPOLOGY set
to an hwloc synthetic description ("node:2 core:2 pu:1", "node:4 core:1 pu:1"): nothing is bound
there (the PUs are not this machine's), but the pools, the shards and the executor run exactly as
on a NUMA machine. Acceptance: with I not divisible by the pool count, P pools give the output of
one pool within fp32 summation order (BF16), the very bits of the same shards run on one pool
(every method), and the same bits run to run.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

E, K, H, I = 8, 3, 160, 200  # I = 200: not a multiple of 2, 3 or 4 pools' vector split
TOKENS = (1, 3, 64)  # decode plan (<= one tile per expert) and prefill plan

METHODS = ("BF16", "AMXINT8", "AMXINT4")

# One interpreter per layout: for each method, the wrapper's layer (one shard per pool) and, when
# `shards` > 0, a layer cut into that many shards run on this process's pools.
_SCRIPT = r"""
import json, sys, torch, kt_jit
from kt_jit import _core

pools, threads, shards, path = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
E, K, H, I = %(E)d, %(K)d, %(H)d, %(I)d
g = torch.Generator().manual_seed(0)
gate = torch.randn(E, I, H, generator=g) * 0.05
up = torch.randn(E, I, H, generator=g) * 0.05
down = torch.randn(E, H, I, generator=g) * 0.05


def outputs(layer):
    res = {}
    for T in %(TOKENS)r:
        g = torch.Generator().manual_seed(100 + T)
        x = torch.randn(T, H, generator=g)
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
        ids[0, K - 1] = -1
        w = torch.rand(T, K, generator=g)
        outs = []
        for _ in range(3):
            out = torch.full((T, H), -1.0)
            layer.forward(T, x.data_ptr(), ids.data_ptr(), w.data_ptr(), 0, out.data_ptr())
            outs.append(out.view(torch.int32).flatten().tolist())
        res[str(T)] = outs
    return {"bounds": list(layer.shard_bounds), "out": res}


res = {}
for method in [m for m in %(METHODS)r if m in kt_jit.wrapper.BUILT_METHODS]:
    wrapper = kt_jit.KTMoEWrapper(0, E, K, H, I, None, threads, pools, "", 1024, method=method)
    wrapper.load_weights_from_tensors(gate, up, down)
    res[method] = {"wrapper": outputs(wrapper.moe)}
    if shards:
        layer = _core.MoELayer(E, K, H, I, method, shards=shards)
        layer.load_experts(list(range(E)), [gate[e].data_ptr() for e in range(E)],
                           [up[e].data_ptr() for e in range(E)],
                           [down[e].data_ptr() for e in range(E)], "f32")
        res[method]["sharded"] = outputs(layer)
res["info"] = {k: (list(v) if isinstance(v, list) else v) for k, v in dict(_core.pool_info()).items()}
json.dump(res, open(path, "w"))
""" % {"E": E, "K": K, "H": H, "I": I, "TOKENS": TOKENS, "METHODS": METHODS}


def _run(ref, tmp_path, topology, pools, threads, shards=0):
    path = tmp_path / f"out_{pools}_{threads}_{shards}.json"
    env = {"KT_JIT_LOG_LEVEL": "INFO"}
    if topology:
        env["KT_JIT_TOPOLOGY"] = topology
    argv = [str(pools), str(threads), str(shards), str(path)]
    proc = ref.run_python(
        "import sys; sys.argv = ['x'] + %r\n" % argv + _SCRIPT, env_extra=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(path.read_text())
    res["stderr"] = proc.stderr
    for method, parts in res.items():
        if method in ("info", "stderr"):
            continue
        for part in parts.values():
            part["out"] = {
                T: [
                    torch.tensor(o, dtype=torch.int32).view(torch.float32).view(int(T), H)
                    for o in outs
                ]
                for T, outs in part["out"].items()
            }
    return res


LAYOUTS = [("node:2 core:2 pu:1", 2, 3), ("node:4 core:1 pu:1", 4, 5)]


@pytest.mark.parametrize("topology,pools,threads", LAYOUTS)
def test_numa_pools_match_one_pool(ref, tmp_path, topology, pools, threads):
    multi = _run(ref, tmp_path, topology, pools, threads)
    # The pools in effect: one per simulated node, threads split unevenly, nothing bound.
    info = multi["info"]
    assert info["pools"] == pools and info["numa_nodes"] == list(range(pools)), info
    assert sum(info["pool_threads"]) == threads and not info["bound"], info
    line = [ln for ln in multi["stderr"].splitlines() if "threads=" in ln]
    assert line and f"pools={pools}" in line[0] and "numa_nodes=" in line[0], multi["stderr"]
    warnings = [ln for ln in multi["stderr"].splitlines() if "warning" in ln]
    assert len(warnings) == 1 and "not bound" in warnings[0], multi["stderr"]

    # One pool: the plain one-shard layer, and the same shards as the P pools use.
    one = _run(ref, tmp_path, None, 1, 2, shards=pools)
    methods = [m for m in METHODS if m in multi]
    assert methods, "no method built"
    for method in methods:
        bounds = multi[method]["wrapper"]["bounds"]
        assert len(bounds) == pools + 1 and bounds[-1] == I, bounds
        assert len({b - a for a, b in zip(bounds, bounds[1:])}) > 1, f"uneven split {bounds}"
        assert one[method]["sharded"]["bounds"] == bounds
        assert one[method]["wrapper"]["bounds"] == [0, I]
        for T, outs in multi[method]["wrapper"]["out"].items():
            where = f"{method} T={T}"
            for again in outs[1:]:
                assert torch.equal(outs[0], again), f"run to run, {where}"
            # The same shards on one pool: the same bits (partials summed in shard order).
            same = one[method]["sharded"]["out"][T][0]
            assert torch.equal(outs[0], same), f"{pools} pools vs 1 pool, {where}"
            s = one[method]["wrapper"]["out"][T][0]
            if method == "BF16":  # only the fp32 summation order differs
                torch.testing.assert_close(outs[0], s, rtol=0, atol=1e-5 * s.abs().max().item())
            else:  # the down projection's input (and INT4 weight rows) are quantized per shard
                tol = 2e-2 if method == "AMXINT8" else 0.2
                assert ref.rel_l1(outs[0], s) < tol, (where, ref.rel_l1(outs[0], s))


def test_bad_topology_is_a_value_error(ref):
    proc = ref.run_python(
        "import kt_jit\n"
        "try:\n"
        "    kt_jit.KTMoEWrapper(0, 4, 2, 64, 32, None, 2, 2, '', 64, method='AMXINT8')\n"
        "except ValueError as e:\n"
        "    print('VALUE_ERROR', e)\n",
        env_extra={"KT_JIT_TOPOLOGY": "node:zero banana"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "VALUE_ERROR" in proc.stdout and "KT_JIT_TOPOLOGY" in proc.stdout, proc.stdout


def test_missing_numa_node_warns_once_and_wraps(ref):
    # Two pools asked for nodes 0 and 5 of a two-node machine: pool 1 uses node 1 (5 % 2).
    proc = ref.run_python(
        "import kt_jit\n"
        "from kt_jit import _core\n"
        "kt_jit.KTMoEWrapper(0, 4, 2, 64, 32, None, 2, 2, '', 64, method='AMXINT8',\n"
        "                    numa_nodes=[0, 5])\n"
        "print(dict(_core.pool_info())['numa_nodes'])\n",
        env_extra={"KT_JIT_TOPOLOGY": "node:2 core:1 pu:1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("[0, 1]"), proc.stdout
    assert proc.stderr.count("no NUMA node 5") == 1, proc.stderr


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v"]))
