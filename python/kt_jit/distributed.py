"""Expert parallelism across processes with torch.distributed (gloo on CPU works).

Each rank owns a contiguous block of physical expert slots and holds only those experts' weights
(a local ``KTMoEWrapper`` over them: global ids are remapped to local ones, others become -1).
Every rank runs the same tokens; the partial outputs are summed with ``all_reduce``::

    moe = ExpertParallelMoE(layer_idx=0, num_experts=E, num_experts_per_tok=K, hidden_size=H,
                            moe_intermediate_size=I, cpuinfer_threads=8, threadpool_count=1,
                            chunked_prefill_size=4096, method="AMXINT8")
    moe.load_weights_from_tensors(gate, up, down)        # full [E, ...] tensors; each rank slices
    out = moe.forward(x, topk_ids, topk_weights)         # identical on every rank

``gpu_experts_mask`` (global, [E]) is read at every forward, as for KTMoEWrapper.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from .wrapper import KTMoEWrapper


def expert_range(num_experts: int, rank: int, world_size: int) -> Tuple[int, int]:
    """[begin, end) of the physical expert slots rank owns (contiguous, sizes differ by <= 1)."""
    E, r, n = int(num_experts), int(rank), int(world_size)
    if not 0 <= r < n:
        raise ValueError(f"rank: expected 0 <= rank < world_size={n}, got {r}")
    return E * r // n, E * (r + 1) // n


class ExpertParallelMoE:
    """A MoE layer whose experts are split over the ranks of a process group."""

    def __init__(
        self,
        layer_idx: int,
        num_experts: int,
        num_experts_per_tok: int,
        hidden_size: int,
        moe_intermediate_size: int,
        cpuinfer_threads: int,
        threadpool_count: int = 1,
        chunked_prefill_size: int = 4096,
        method: str = "AMXINT8",
        gpu_experts_mask: Optional[torch.Tensor] = None,
        max_deferred_experts_per_token: Optional[int] = None,
        group=None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
    ):
        self.group = group
        self.rank = dist.get_rank(group) if rank is None else int(rank)
        self.world_size = dist.get_world_size(group) if world_size is None else int(world_size)
        E, K = int(num_experts), int(num_experts_per_tok)
        self.num_experts, self.num_experts_per_tok = E, K
        self.hidden_size, self.moe_intermediate_size = int(hidden_size), int(moe_intermediate_size)
        self.begin, self.end = expert_range(E, self.rank, self.world_size)
        # KTMoEWrapper needs num_experts >= top_k: pad with never-routed slots (masked off)
        self.local_experts = max(self.end - self.begin, K, 1)
        self.gpu_experts_mask = (
            torch.zeros(E, dtype=torch.bool)
            if gpu_experts_mask is None
            else gpu_experts_mask.detach().to("cpu", torch.bool).clone()
        )
        self.local = KTMoEWrapper(
            layer_idx=layer_idx,
            num_experts=self.local_experts,
            num_experts_per_tok=K,
            hidden_size=hidden_size,
            moe_intermediate_size=moe_intermediate_size,
            gpu_experts_mask=None,
            cpuinfer_threads=cpuinfer_threads,
            threadpool_count=threadpool_count,
            weight_path="",
            chunked_prefill_size=chunked_prefill_size,
            method=method,
            max_deferred_experts_per_token=max_deferred_experts_per_token,
        )
        self._sync_mask()

    def _sync_mask(self) -> None:
        n = self.end - self.begin
        m = self.local.gpu_experts_mask
        m[:n].copy_(self.gpu_experts_mask.reshape(-1)[self.begin : self.end])
        m[n:] = True  # padding slots

    def load_weights_from_tensors(
        self,
        gate_proj: torch.Tensor,
        up_proj: torch.Tensor,
        down_proj: torch.Tensor,
        physical_to_logical_map_cpu: Optional[torch.Tensor] = None,
    ) -> None:
        """Full [E, I, H], [E, I, H], [E, H, I] tensors; this rank keeps its slots' experts."""
        E = self.num_experts
        pmap = (
            torch.arange(E)
            if physical_to_logical_map_cpu is None
            else physical_to_logical_map_cpu.to(torch.int64)
        )
        logical = pmap[self.begin : self.end]
        pad = self.local_experts - logical.numel()
        parts = []
        for w in (gate_proj, up_proj, down_proj):
            lw = w.index_select(0, logical)
            if pad:
                lw = torch.cat([lw, torch.zeros((pad,) + tuple(w.shape[1:]), dtype=w.dtype)])
            parts.append(lw)
        self.local.load_weights_from_tensors(*parts, torch.arange(self.local_experts))

    def _local_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        ids = topk_ids.to(torch.int64)
        own = (ids >= self.begin) & (ids < self.end)
        return torch.where(own, ids - self.begin, torch.full_like(ids, -1))

    def submit_forward(self, hidden_states, topk_ids, topk_weights, cuda_stream=None) -> None:
        self._sync_mask()
        self._dtype = hidden_states.dtype
        x = hidden_states.to(torch.float32)  # partial sums stay fp32 until after the all_reduce
        self.local.submit_forward(x, self._local_ids(topk_ids), topk_weights, cuda_stream)

    def sync_forward(self, hidden_states=None, cuda_stream=None) -> torch.Tensor:
        """This rank's partial output, summed over the group (all_reduce): [T, H]."""
        acc = self.local.sync_forward(None, cuda_stream)
        dist.all_reduce(acc, op=dist.ReduceOp.SUM, group=self.group)
        return acc.to(self._dtype)

    def forward(self, hidden_states, topk_ids, topk_weights, cuda_stream=None) -> torch.Tensor:
        self.submit_forward(hidden_states, topk_ids, topk_weights, cuda_stream)
        return self.sync_forward(hidden_states, cuda_stream)
