"""Run a Hugging Face transformers MoE model's routed experts on kt-jit.

    import kt_jit.integrations.transformers as ktt
    ktt.offload_experts(model, method="BF16", cpuinfer_threads=8)
    model.generate(...)

What is replaced: in transformers >= 5 every sparse MoE block (``Qwen3MoeSparseMoeBlock``,
``MixtralSparseMoeBlock``, ``DeepseekV3MoE``, ...) keeps its router in ``block.gate`` and its routed
experts in ``block.experts``, a module holding fused ``gate_up_proj`` / ``down_proj`` parameters whose
``forward(hidden_states, top_k_index, top_k_weights)`` is the expert loop. ``offload_experts`` swaps
``block.experts`` for a :class:`KTJitExperts` module that calls ``KTMoEWrapper.forward`` on the same
arguments. Everything else stays transformers' own torch code: the router (gate linear, softmax or
sigmoid, top-k, group limits, renormalisation, routed scaling factor), shared experts, the block's
reshapes and its return value, attention and norms.

The original expert parameters are released (unless ``keep_original=True``), so the model's
``state_dict()`` no longer holds them. Hidden states on another device (e.g. CUDA) are copied to
the CPU for the experts and the result copied back.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from ..wrapper import KTMoEWrapper

logger = logging.getLogger("kt_jit")

__all__ = ["KTJitExperts", "offload_experts", "find_moe_blocks", "expert_weights"]

_SILU = ("silu", "swish")
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


class KTJitExperts(nn.Module):
    """Drop-in for a transformers ``*Experts`` module: ``forward(hidden_states [T, H],
    top_k_index [T, K], top_k_weights [T, K]) -> [T, H]`` computed by a :class:`KTMoEWrapper`.

    Holds no parameters. ``self.wrapper`` is the kt-jit layer; ``self.original`` the replaced
    module when ``offload_experts(..., keep_original=True)``, else None."""

    def __init__(self, wrapper: KTMoEWrapper, source: str, original: Optional[nn.Module] = None):
        super().__init__()
        self.wrapper = wrapper
        self.num_experts = wrapper.num_experts
        self.hidden_dim = wrapper.hidden_size
        self.intermediate_dim = wrapper.moe_intermediate_size
        self.top_k = wrapper.num_experts_per_tok
        self.source = source
        # Kept outside the module tree so state_dict(), .to() and parameters() do not see it.
        self.__dict__["original"] = original

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, self.hidden_dim)
        T = x.shape[0]
        ids = top_k_index.reshape(T, -1)
        w = top_k_weights.reshape(T, -1)
        device = x.device
        if device.type != "cpu":
            x, ids, w = x.cpu(), ids.cpu(), w.cpu()
        out = self.wrapper.forward(x, ids, w)
        if device.type != "cpu":
            out = out.to(device)
        return out.reshape(shape)

    def extra_repr(self) -> str:
        return (
            f"{self.source} on kt-jit: method={self.wrapper.method}, E={self.num_experts}, "
            f"K={self.top_k}, H={self.hidden_dim}, I={self.intermediate_dim}, "
            f"layer_idx={self.wrapper.layer_idx}"
        )


def _is_fused_experts(m) -> bool:
    gu, dn = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    return (
        isinstance(m, nn.Module)
        and isinstance(gu, torch.Tensor)
        and isinstance(dn, torch.Tensor)
        and gu.dim() == 3
        and dn.dim() == 3
    )


def find_moe_blocks(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """(name, block) for every module whose ``experts`` child is a transformers fused experts
    module (3-D ``gate_up_proj`` and ``down_proj``) and that has a router in ``gate``/``router``.
    Blocks already offloaded are skipped."""
    found = []
    for name, mod in model.named_modules():
        experts = getattr(mod, "experts", None)
        if experts is None or isinstance(experts, KTJitExperts):
            continue
        if _is_fused_experts(experts):
            found.append((name, mod))
        elif isinstance(experts, nn.ModuleList):
            raise NotImplementedError(
                f"{name}.experts is an nn.ModuleList of per-expert modules "
                f"({type(mod).__name__}): that is the transformers 4.x layout, where the block's "
                "own forward loops over the experts. kt_jit.integrations.transformers supports "
                "transformers >= 5 (fused gate_up_proj/down_proj experts; tested with 5.23.0)"
            )
    return found


def _config_of(model: nn.Module, experts: nn.Module):
    return getattr(experts, "config", None) or getattr(model, "config", None)


def expert_weights(experts: nn.Module) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gate [E, I, H], up [E, I, H], down [E, H, I] (CPU views where possible) from a transformers
    fused experts module, honouring its ``is_transposed`` / ``is_concatenated`` layout flags."""
    if (
        getattr(experts, "has_bias", False)
        or getattr(experts, "gate_up_proj_bias", None) is not None
    ):
        raise NotImplementedError(
            f"{type(experts).__name__}: experts with biases are not supported by kt-jit"
        )
    if not getattr(experts, "has_gate", True):
        raise NotImplementedError(
            f"{type(experts).__name__}: experts without a gate projection are not supported"
        )
    if getattr(experts, "has_post_expert_norm", False):
        raise NotImplementedError(
            f"{type(experts).__name__}: experts with a post-expert norm are not supported"
        )
    gu = experts.gate_up_proj.detach().cpu()
    dn = experts.down_proj.detach().cpu()
    if getattr(experts, "is_transposed", False):  # [E, H, 2I] and [E, I, H]
        gu, dn = gu.transpose(1, 2), dn.transpose(1, 2)
    E, two_i, H = gu.shape
    if two_i % 2 or tuple(dn.shape) != (E, H, two_i // 2):
        raise ValueError(
            f"{type(experts).__name__}: gate_up_proj {tuple(gu.shape)} and down_proj "
            f"{tuple(dn.shape)} are not [E, 2I, H] and [E, H, I]"
        )
    I = two_i // 2
    if getattr(experts, "is_concatenated", True):
        gate, up = gu[:, :I], gu[:, I:]
    else:  # interleaved rows: gate0, up0, gate1, up1, ...
        gate, up = gu[:, 0::2], gu[:, 1::2]
    return gate.contiguous(), up.contiguous(), dn.contiguous()


def _top_k(block: nn.Module, config) -> int:
    for owner in (getattr(block, "gate", None), getattr(block, "router", None), block):
        k = getattr(owner, "top_k", None) if owner is not None else None
        if isinstance(k, int) and k > 0:
            return k
    k = getattr(config, "num_experts_per_tok", None)
    if isinstance(k, int) and k > 0:
        return k
    raise ValueError(f"{type(block).__name__}: cannot find the router's top_k")


def _check_activation(experts: nn.Module, config, where: str):
    act = getattr(config, "hidden_act", None)
    if act is not None and str(act).lower() not in _SILU:
        raise NotImplementedError(
            f"{where}: hidden_act={act!r}; kt-jit's experts compute silu(gate) * up"
        )
    fn = getattr(experts, "act_fn", None)
    if fn is not None and type(fn).__name__ not in ("SiLU", "SiLUActivation"):
        raise NotImplementedError(
            f"{where}: activation {type(fn).__name__}; kt-jit's experts compute silu(gate) * up"
        )


def offload_experts(
    model: nn.Module,
    method: str = "BF16",
    cpuinfer_threads: Optional[int] = None,
    threadpool_count: int = 1,
    chunked_prefill_size: int = 8192,
    numa_nodes: Optional[List[int]] = None,
    keep_original: bool = False,
    **wrapper_kwargs,
) -> Dict[str, KTJitExperts]:
    """Replace the routed experts of every sparse MoE block in ``model`` (in place) by kt-jit
    layers built from the block's own weights with ``load_weights_from_tensors``.

    ``method``: a built kt-jit method (``BF16``, ``AMXINT8``, ``AMXINT4``, ...), quantized online
    from the model's weights. ``cpuinfer_threads`` defaults to ``os.cpu_count()``; the worker pool
    is process-wide (the first kt-jit layer created fixes it). Other keyword arguments go to
    :class:`KTMoEWrapper`. Returns ``{block name: KTJitExperts}``; raises ``ValueError`` when the
    model has no supported MoE block."""
    if cpuinfer_threads is None:
        cpuinfer_threads = os.cpu_count() or 1
    blocks = find_moe_blocks(model)
    if not blocks:
        raise ValueError(
            f"{type(model).__name__}: no sparse MoE block with fused experts "
            "(block.experts.gate_up_proj / down_proj) found"
        )
    done: Dict[str, KTJitExperts] = {}
    for n, (name, block) in enumerate(blocks):
        experts = block.experts
        config = _config_of(model, experts)
        where = f"{name}.experts ({type(experts).__name__})"
        _check_activation(experts, config, where)
        gate, up, down = expert_weights(experts)
        E, I, H = gate.shape
        m = _LAYER_RE.search(name)
        layer_idx = int(m.group(1)) if m else n
        wrapper = KTMoEWrapper(
            layer_idx=layer_idx,
            num_experts=E,
            num_experts_per_tok=_top_k(block, config),
            hidden_size=H,
            moe_intermediate_size=I,
            gpu_experts_mask=None,
            cpuinfer_threads=cpuinfer_threads,
            threadpool_count=threadpool_count,
            weight_path="",
            chunked_prefill_size=chunked_prefill_size,
            method=method,
            numa_nodes=numa_nodes,
            **wrapper_kwargs,
        )
        wrapper.load_weights_from_tensors(gate, up, down, torch.arange(E, dtype=torch.int64))
        del gate, up, down
        new = KTJitExperts(wrapper, type(experts).__name__, experts if keep_original else None)
        block.experts = new
        done[name] = new
    logger.info(
        "kt_jit.integrations.transformers: %d MoE blocks of %s on kt-jit (%s)",
        len(done),
        type(model).__name__,
        method,
    )
    return done
