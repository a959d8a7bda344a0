"""Expert parallelism over 2 processes (torch.distributed, gloo, loopback only): each rank owns
half the experts; the all-reduced output equals the 1-process output up to fp32 summation order."""

from __future__ import annotations

import socket

import torch
import torch.multiprocessing as mp

from conftest import make_routing, make_weights, make_wrapper
from kt_jit.distributed import expert_range

E, K, H, I = 8, 4, 128, 64
WORLD = 2


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _case():
    gate, up, down = make_weights(E, H, I, seed=5)
    pmap = torch.randperm(E, generator=torch.Generator().manual_seed(9))
    mask = torch.zeros(E, dtype=torch.bool)
    mask[[1, 6]] = True
    steps = []
    for s, T in enumerate((1, 5, 3)):
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(50 + s))
        ids, w = make_routing(T, E, K, seed=60 + s, invalid=True)
        steps.append((x, ids, w))
    return (gate, up, down), pmap, mask, steps


def _rank_main(rank, port, out_dir):
    import os

    import torch.distributed as dist

    from kt_jit.distributed import ExpertParallelMoE

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        weights, pmap, mask, steps = _case()
        moe = ExpertParallelMoE(0, E, K, H, I, cpuinfer_threads=1, gpu_experts_mask=mask)
        moe.load_weights_from_tensors(*weights, pmap)
        outs = []
        for s, (x, ids, w) in enumerate(steps):
            if s == 2:
                moe.gpu_experts_mask[3] = True  # edited in place between forwards
            outs.append(moe.forward(x, ids, w))
        torch.save(outs, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_expert_range_covers_all():
    for n in (1, 2, 3, 5):
        got = [expert_range(E, r, n) for r in range(n)]
        assert got[0][0] == 0 and got[-1][1] == E
        assert all(a[1] == b[0] for a, b in zip(got, got[1:]))


def test_two_ranks_match_one_process(tmp_path):
    mp.spawn(_rank_main, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    outs = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]

    weights, pmap, mask, steps = _case()
    single = make_wrapper(E, K, H, I, mask=mask)
    single.load_weights_from_tensors(*weights, pmap)
    for s, (x, ids, w) in enumerate(steps):
        if s == 2:
            single.gpu_experts_mask[3] = True
        ref = single.forward(x, ids, w)
        for r in range(WORLD):
            out = outs[r][s]
            assert torch.equal(out, outs[0][s])  # every rank holds the same sum
            rel = ((out - ref).abs().sum() / ref.abs().sum()).item()
            assert rel <= 1e-6, f"step {s} rank {r}: rel diff {rel:.3g}"
            assert ((out - ref).abs().max() <= 1e-5 * ref.abs().max()).item()
