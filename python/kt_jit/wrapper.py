"""kt-kernel compatible ``KTMoEWrapper`` on top of the native ``kt_jit._core.MoELayer``."""

from __future__ import annotations

import logging
import operator
import os
import threading
import time
from typing import List, Optional, Sequence

import torch

from . import _core, serving
from ._progress import load_stats, progress_bar

logger = logging.getLogger("kt_jit")

#: kt-kernel's inference methods (KTMoEWrapper factory, mode="inference").
INFERENCE_METHODS = (
    "AMXINT4",
    "AMXINT8",
    "RAWINT4",
    "FP8",
    "FP8_PERCHANNEL",
    "BF16",
    "GPTQ_INT4",
    "MXFP4",
    "MXFP8",
    "LLAMAFILE",
    "MOE_INT4",
    "MOE_INT8",
)
#: Methods this build of kt-jit implements.
BUILT_METHODS = tuple(m.strip() for m in _core.built_methods().split(","))
#: Methods that take swiglu_limit / swiglu_alpha.
SWIGLU_LIMIT_METHODS = ("MXFP4", "MXFP8")
#: kt-kernel's modes.
MODES = ("inference", "sft")

_WEIGHT_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
# Every integer dtype torch has (SPEC §3: ids of "any int dtype"); the wide unsigned ones only
# where this torch defines them. A uint64 id past int64's range reads as negative: skipped, as an
# id >= num_experts would be.
_INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64) + tuple(
    getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n)
)
_DEVICE_HELP = "pass CPU tensors, or CUDA tensors with their stream (cuda_stream)"

_pool_lock = threading.Lock()
_pool_state: Optional[dict] = None


#: Experts handed to the packer per call of the online-quantization load.
_LOAD_BATCH = 16


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(int(s)) for s in t.shape) + "]"


def _ensure_pool(threads: int, pools: int, numa_nodes: List[int], method: str) -> dict:
    """Create the process-wide worker pool once (first wrapper wins) and log the start-up line."""
    global _pool_state
    with _pool_lock:
        if _pool_state is None:
            in_effect = _core.init_pool(int(threads), int(pools), [int(n) for n in numa_nodes])
            try:
                eff_threads, eff_pools = (int(v) for v in in_effect)
            except (TypeError, ValueError):
                eff_threads, eff_pools = int(threads), int(pools)
            info = dict(_core.pool_info()) if hasattr(_core, "pool_info") else {}
            # The nodes in effect: a node the machine lacks is replaced (one warning from the core).
            eff_nodes = list(info.get("numa_nodes", numa_nodes))
            _pool_state = {
                "threads": eff_threads,
                "pools": eff_pools,
                "numa_nodes": eff_nodes,
                "pool_threads": list(info.get("pool_threads", [])),
                "bound": bool(info.get("bound", False)),
                "topology": info.get("topology", ""),
            }
            logger.info(
                "kt-jit %s: isa=%s threads=%d pools=%d numa_nodes=%s threads_per_pool=%s "
                "method=%s; %s",
                _core.__version__,
                _core.isa(),
                eff_threads,
                eff_pools,
                eff_nodes,
                _pool_state["pool_threads"],
                method,
                _pool_state["topology"],
            )
        elif (threads, pools) != (_pool_state["threads"], _pool_state["pools"]):
            logger.debug(
                "worker pool already running with threads=%d pools=%d; "
                "cpuinfer_threads=%d threadpool_count=%d ignored",
                _pool_state["threads"],
                _pool_state["pools"],
                threads,
                pools,
            )
        return _pool_state


def _check_positive_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected an int, got bool ({value!r})")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(
            f"{name}: expected an int, got {type(value).__name__} ({value!r})"
        ) from None
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return int(value)


class KTMoEWrapper:
    """Drop-in replacement for kt-kernel's ``KTMoEWrapper`` (inference mode).

    Same constructor parameters, names, order and defaults as kt-kernel's factory. Methods built in
    this version: AMXINT8 / MOE_INT8 (per-row symmetric int8 weights) and AMXINT4 / MOE_INT4
    (per-row int4, kt-kernel's amax/112 scheme), all with per-token int8 activations.
    """

    _capture_batch_sizes: List[int] = []

    def __init__(
        self,
        layer_idx: int,
        num_experts: int,
        num_experts_per_tok: int,
        hidden_size: int,
        moe_intermediate_size: int,
        gpu_experts_mask: Optional[torch.Tensor],
        cpuinfer_threads: int,
        threadpool_count: int,
        weight_path: str,
        chunked_prefill_size: int,
        cpu_save: bool = False,
        max_deferred_experts_per_token: Optional[int] = None,
        method: str = "AMXINT4",
        numa_nodes: Optional[List[int]] = None,
        mode: str = "inference",
        num_gpu_experts: int = 0,
        lora_rank: int = 16,
        lora_alpha: float = 32.0,
        lora_dropout: float = 0.0,
        max_cache_depth: int = 1,
        group_size: int = 128,
        zero_point: bool = True,
        full_weight_grad: bool = False,
        swiglu_limit: float = 0.0,
        swiglu_alpha: float = 0.0,
    ):
        # --- mode and method -------------------------------------------------------------------
        if mode not in MODES:
            raise ValueError(f"mode: unknown mode {mode!r}; valid modes: {', '.join(MODES)}")
        if mode != "inference":
            raise NotImplementedError(
                f"mode: {mode!r} (LoRA fine-tuning) is not built in kt-jit; only 'inference' is"
            )
        if not isinstance(method, str) or method not in INFERENCE_METHODS:
            raise ValueError(
                f"method: unknown method {method!r}; valid methods: {', '.join(INFERENCE_METHODS)}"
            )
        if swiglu_limit is None:
            swiglu_limit = 0.0
        if swiglu_alpha is None:
            swiglu_alpha = 0.0
        if float(swiglu_limit) != 0.0 and method not in SWIGLU_LIMIT_METHODS:
            raise ValueError(
                f"swiglu_limit: only supported for methods {', '.join(SWIGLU_LIMIT_METHODS)}; "
                f"got swiglu_limit={swiglu_limit} with method {method!r}"
            )
        if method not in BUILT_METHODS:
            raise NotImplementedError(
                f"method: {method!r} is a kt-kernel method that this kt-jit build does not "
                f"implement yet; built methods: {', '.join(BUILT_METHODS)}"
            )

        # --- shapes and pool -------------------------------------------------------------------
        self.layer_idx = int(layer_idx)
        self.num_experts = _check_positive_int("num_experts", num_experts)
        self.num_experts_per_tok = _check_positive_int("num_experts_per_tok", num_experts_per_tok)
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok: expected <= num_experts={self.num_experts}, "
                f"got {self.num_experts_per_tok}"
            )
        self.hidden_size = _check_positive_int("hidden_size", hidden_size)
        self.moe_intermediate_size = _check_positive_int(
            "moe_intermediate_size", moe_intermediate_size
        )
        self.cpuinfer_threads = _check_positive_int("cpuinfer_threads", cpuinfer_threads)
        self.threadpool_count = _check_positive_int("threadpool_count", threadpool_count)
        self.chunked_prefill_size = _check_positive_int(
            "chunked_prefill_size", chunked_prefill_size
        )
        if numa_nodes is None:
            numa_nodes = list(range(self.threadpool_count))
        else:
            numa_nodes = [int(n) for n in numa_nodes]
            if len(numa_nodes) != self.threadpool_count:
                raise ValueError(
                    f"numa_nodes: expected {self.threadpool_count} entries "
                    f"(threadpool_count), got {len(numa_nodes)}: {numa_nodes}"
                )
            if any(n < 0 for n in numa_nodes):
                raise ValueError(f"numa_nodes: expected node ids >= 0, got {numa_nodes}")
        self.numa_nodes = numa_nodes

        self.weight_path = weight_path
        self.cpu_save = bool(cpu_save)
        self.max_deferred_experts_per_token = int(max_deferred_experts_per_token or 0)
        if self.max_deferred_experts_per_token < 0:
            raise ValueError(
                "max_deferred_experts_per_token: expected >= 0 or None, "
                f"got {max_deferred_experts_per_token}"
            )
        self.method = method
        self.mode = mode
        self.swiglu_limit = float(swiglu_limit)
        self.swiglu_alpha = float(swiglu_alpha)
        # SFT-only parameters, kept for signature compatibility.
        self.lora_rank = lora_rank
        self.lora_alpha = lora_alpha
        self.lora_dropout = lora_dropout
        self.max_cache_depth = max_cache_depth
        self.group_size = group_size
        self.zero_point = zero_point
        self.full_weight_grad = full_weight_grad

        # --- GPU experts mask: our own CPU copy, read at every forward --------------------------
        self.gpu_experts_mask = self._make_mask(gpu_experts_mask)
        self.num_gpu_experts = int(self.gpu_experts_mask.sum().item())

        self.cpu_infer = _ensure_pool(
            self.cpuinfer_threads, self.threadpool_count, self.numa_nodes, self.method
        )
        self.moe = None  # the native MoELayer, created at load
        self._pending = None
        # serving's fast path: the last input signature that passed _prepare, and the mask object
        # last validated
        self._fast_sig = None
        self._stream_forwards = {}  # (kind, slot, incremental) -> serving._StreamEntry
        self._mask_checked, self._mask_checked_ptr = None, 0

    # ----------------------------------------------------------------------------------------
    def _make_mask(self, gpu_experts_mask: Optional[torch.Tensor]) -> torch.Tensor:
        E = self.num_experts
        pin = torch.cuda.is_available()
        if gpu_experts_mask is None:
            mask = torch.zeros(E, dtype=torch.bool)
        else:
            if not isinstance(gpu_experts_mask, torch.Tensor):
                raise TypeError(
                    "gpu_experts_mask: expected a bool torch.Tensor of shape "
                    f"[{E}] or None, got {type(gpu_experts_mask).__name__}"
                )
            if tuple(gpu_experts_mask.shape) != (E,):
                raise ValueError(
                    f"gpu_experts_mask: expected shape [{E}] (num_experts), "
                    f"got {_shape(gpu_experts_mask)}"
                )
            mask = gpu_experts_mask.detach().to(device="cpu", dtype=torch.bool).clone()
        mask = mask.contiguous()
        if pin:
            try:
                mask = mask.pin_memory()
            except RuntimeError:  # pragma: no cover - CUDA present but pinning refused
                pass
        return mask

    def _mask_for_forward(self):
        """The mask tensor whose data_ptr goes to the core, re-validated at every forward."""
        m = self.gpu_experts_mask
        E = self.num_experts
        if m is None:
            return None
        if not isinstance(m, torch.Tensor):
            raise TypeError(
                f"gpu_experts_mask: expected a bool torch.Tensor of shape [{E}], "
                f"got {type(m).__name__}"
            )
        if m.numel() != E:
            raise ValueError(
                f"gpu_experts_mask: expected shape [{E}] (num_experts), got {_shape(m)}"
            )
        if m.dtype != torch.bool or m.device.type != "cpu" or not m.is_contiguous() or m.dim() != 1:
            m = m.detach().reshape(E).to(device="cpu", dtype=torch.bool).contiguous()
        return m

    # ----------------------------------------------------------------------------------------
    def load_weights(self, physical_to_logical_map_cpu: Optional[torch.Tensor] = None):
        """Load this layer's experts from ``weight_path`` in the format ``method`` implies.

        BF16, FP8, FP8_PERCHANNEL: a Hugging Face checkpoint directory (``*.safetensors`` +
        ``config.json``), see docs/FORMATS.md "Loading from a checkpoint" and "FP8". AMXINT8 /
        AMXINT4: a directory converted by kt-kernel (safetensors or ``.kt`` tree, any number of
        NUMA parts), see docs/FORMATS.md "Loading kt-kernel converted directories"; the integer
        methods also read a kt-jit artifact (``kt-jit convert``, one shard per threadpool_count),
        see docs/FORMATS.md "kt-jit artifact". LLAMAFILE: a
        ``.gguf`` file, split set or directory, see docs/FORMATS.md "GGUF". MXFP4 / MXFP8: a
        DeepSeek-V4 / MiniMax-M3 checkpoint (e2m1 / e4m3 bytes, ue8m0 scales per 32 inputs) with
        ``swiglu_limit`` / ``swiglu_alpha`` applied, see docs/FORMATS.md "MXFP4 / MXFP8".
        RAWINT4 / GPTQ_INT4: a compressed-tensors pack-quantized / symmetric GPTQ checkpoint
        (4-bit nibbles, group scales) on the qgroup kernels, one shard per pool, see
        docs/FORMATS.md "RAWINT4 / GPTQ_INT4"."""
        from .loaders import hf, ktjit, ktkernel

        method, E, K = self.method, self.num_experts, self.num_experts_per_tok
        H, I = self.hidden_size, self.moe_intermediate_size
        kt_dir = method in ("AMXINT8", "AMXINT4", "MOE_INT8", "MOE_INT4")
        mx = method in ("MXFP4", "MXFP8")
        int4 = method in ("RAWINT4", "GPTQ_INT4")
        hf_methods = ("BF16", "FP8", "FP8_PERCHANNEL", "LLAMAFILE")
        if not (kt_dir or mx or int4 or method in hf_methods):
            raise NotImplementedError(
                f"load_weights: method {method!r} has no loader for weight_path "
                f"({self.weight_path!r}); use load_weights_from_tensors"
            )
        pmap = self._check_map(physical_to_logical_map_cpu)
        artifact = ktjit.is_artifact(self.weight_path)  # written by `kt-jit convert`
        if artifact and not kt_dir:
            raise ValueError(
                f"weight_path: {self.weight_path!r} is a kt-jit artifact (integer weights); it "
                f"loads with AMXINT8/MOE_INT8 or AMXINT4/MOE_INT4, not {method!r}"
            )
        if kt_dir and not artifact:
            ktkernel.method_bits(method)  # an unknown integer method fails before any I/O
        if not self.weight_path or not os.path.exists(self.weight_path):
            raise FileNotFoundError(f"weight_path: {self.weight_path!r} does not exist")
        hf.check_model_shape(self.weight_path, E, K, H, I)
        args = (self.weight_path, self.layer_idx, E, H, I, pmap)
        if int4:  # nibble - 8 codes with group scales on the qgroup kernels, shard per pool
            from .loaders import int4 as int4_loader

            layer, self.load_stats = int4_loader.load_int4_layer(
                self.weight_path, self.layer_idx, E, K, H, I, pmap, method,
                pools=self.cpu_infer["pools"],
            )  # fmt: skip
        elif method == "LLAMAFILE":  # one shard per pool, split on the down type's blocks
            from .loaders import gguf

            layer, self.load_stats = gguf.load_gguf_layer(
                self.weight_path, self.layer_idx, E, K, H, I, pmap, pools=self.cpu_infer["pools"]
            )
        elif artifact:  # full-I experts, sliced into one shard per threadpool_count
            layer, self.load_stats = ktjit.load_artifact_layer(
                lambda bounds: _core.MoELayer(E, K, H, I, method, "", shard_bounds=bounds),
                *args,
                method,
                shards=self.threadpool_count,
            )
        elif kt_dir:  # one shard per NUMA part of the converted files
            layer, self.load_stats = ktkernel.load_ktkernel_layer(
                lambda bounds: _core.MoELayer(E, K, H, I, method, "", shard_bounds=bounds),
                *args,
                method,
            )
        elif mx:  # e2m1 / e4m3 bytes with ue8m0 scales, SwiGLU variants per swiglu_limit/alpha
            from .loaders import mx as mx_loader

            layer = _core.MoELayer(
                E,
                K,
                H,
                I,
                method,
                swiglu_limit=self.swiglu_limit,
                swiglu_alpha=self.swiglu_alpha,
            )
            self.load_stats = mx_loader.load_mx_layer(layer, *args, method=method)
        else:
            layer = _core.MoELayer(E, K, H, I, method)
            if method == "BF16":
                self.load_stats = hf.load_bf16_layer(layer, *args)
            else:
                self.load_stats = hf.load_fp8_layer(layer, *args, block=method == "FP8")
        if not layer.loaded:  # pragma: no cover - the loaders fill every slot or raise
            raise RuntimeError(f"load_weights: layer {self.layer_idx} has unloaded expert slots")
        self.moe = layer

    def _check_map(self, physical_to_logical_map_cpu) -> Optional[torch.Tensor]:
        E = self.num_experts
        name = "physical_to_logical_map_cpu"
        if physical_to_logical_map_cpu is None:
            return None
        m = physical_to_logical_map_cpu
        if not isinstance(m, torch.Tensor):
            raise TypeError(f"{name}: expected an int64 torch.Tensor of shape [{E}], got {type(m)}")
        if m.dtype not in _INT_DTYPES:
            raise TypeError(f"{name}: expected an integer dtype (e.g. int64), got {m.dtype}")
        if m.device.type != "cpu":
            raise ValueError(f"{name}: expected a CPU tensor, got device {m.device}")
        if tuple(m.shape) != (E,):
            raise ValueError(f"{name}: expected shape [{E}] (num_experts), got {_shape(m)}")
        m = m.to(torch.int64).contiguous()
        if E > 0:
            lo, hi = int(m.min().item()), int(m.max().item())
            if lo < 0 or hi >= E:
                bad = int(m[(m < 0) | (m >= E)][0].item())
                raise ValueError(
                    f"{name}: expected values in [0, {E}) (logical expert ids), got {bad}"
                )
        return m

    def _check_weight(self, name: str, t, expected: Sequence[int]) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _WEIGHT_DTYPES:
            raise TypeError(f"{name}: expected dtype bfloat16, float16 or float32, got {t.dtype}")
        if t.device.type != "cpu":
            raise ValueError(f"{name}: expected a CPU tensor, got device {t.device}")
        if tuple(t.shape) != tuple(expected):
            raise ValueError(
                f"{name}: expected shape [{', '.join(str(s) for s in expected)}], got {_shape(t)}"
            )
        return t

    def load_weights_from_tensors(
        self,
        gate_proj: torch.Tensor,
        up_proj: torch.Tensor,
        down_proj: torch.Tensor,
        physical_to_logical_map_cpu: Optional[torch.Tensor] = None,
    ):
        """Quantize bf16/fp16/fp32 CPU weights online: gate/up [E, I, H], down [E, H, I]."""
        if self.method in ("FP8", "FP8_PERCHANNEL", "MXFP4", "MXFP8"):
            raise NotImplementedError(
                f"load_weights_from_tensors: method {self.method!r} loads e4m3 / MX checkpoints "
                "with load_weights(); there is no online FP8 / MX quantization"
            )
        if self.method in ("RAWINT4", "GPTQ_INT4"):
            raise NotImplementedError(
                f"load_weights_from_tensors: method {self.method!r} loads 4-bit group-quantized "
                "checkpoints (compressed-tensors / GPTQ) with load_weights(); there is no online "
                "RAWINT4 / GPTQ quantization (use AMXINT4 or AMXINT8 for float tensors)"
            )
        if self.method == "LLAMAFILE":
            raise NotImplementedError(
                "load_weights_from_tensors: method 'LLAMAFILE' loads GGUF files with "
                "load_weights(); there is no online GGML block quantization (use AMXINT4/AMXINT8 "
                "or BF16 for float tensors)"
            )
        E, H, I = self.num_experts, self.hidden_size, self.moe_intermediate_size
        gate = self._check_weight("gate_proj", gate_proj, (E, I, H))
        up = self._check_weight("up_proj", up_proj, (E, I, H))
        down = self._check_weight("down_proj", down_proj, (E, H, I))
        pmap = self._check_map(physical_to_logical_map_cpu)
        if not (gate.dtype == up.dtype == down.dtype):
            gate, up, down = (w.to(torch.float32) for w in (gate, up, down))
        gate, up, down = (w.detach().contiguous() for w in (gate, up, down))
        dtype = _WEIGHT_DTYPES[gate.dtype]
        layer = _core.MoELayer(E, self.num_experts_per_tok, H, I, self.method)
        # Experts go to the packer in batches (each packed on all pool threads) so a long load
        # shows progress; slot p takes logical expert pmap[p].
        logical = list(range(E)) if pmap is None else [int(v) for v in pmap.tolist()]
        esz = gate.element_size()
        gb, ub, db = gate.data_ptr(), up.data_ptr(), down.data_ptr()
        t0 = time.perf_counter()
        bar = progress_bar(
            E, f"layer {self.layer_idx}: {self.method} packing", E >= 2 * _LOAD_BATCH
        )
        for s in range(0, E, _LOAD_BATCH):
            slots = list(range(s, min(E, s + _LOAD_BATCH)))
            layer.load_experts(
                slots,
                [gb + logical[p] * I * H * esz for p in slots],
                [ub + logical[p] * I * H * esz for p in slots],
                [db + logical[p] * H * I * esz for p in slots],
                dtype,
            )
            if bar is not None:
                bar.update(len(slots))
        if bar is not None:
            bar.close()
        nbytes = (gate.numel() + up.numel() + down.numel()) * esz
        self.load_stats = load_stats(nbytes, t0)
        self.moe = layer
        logger.info(
            "layer %d: %s from %s tensors: %.2f GB in %.2f s (%.2f GB/s), %d experts, isa %s",
            self.layer_idx,
            self.method,
            dtype,
            nbytes / 1e9,
            self.load_stats["seconds"],
            self.load_stats["gb_per_s"],
            E,
            layer.isa,
        )

    # ----------------------------------------------------------------------------------------
    def _prepare(self, hidden_states, topk_ids, topk_weights, cuda_stream):
        """Validate everything; return (T, x [T, H] view, ids int64 [T, K], w fp32 [T, K], dtype)."""
        H, K = self.hidden_size, self.num_experts_per_tok
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(
                f"hidden_states: expected a torch.Tensor, got {type(hidden_states).__name__}"
            )
        if not isinstance(topk_ids, torch.Tensor):
            raise TypeError(f"topk_ids: expected a torch.Tensor, got {type(topk_ids).__name__}")
        if not isinstance(topk_weights, torch.Tensor):
            raise TypeError(
                f"topk_weights: expected a torch.Tensor, got {type(topk_weights).__name__}"
            )
        for name, t in (
            ("hidden_states", hidden_states),
            ("topk_ids", topk_ids),
            ("topk_weights", topk_weights),
        ):
            if t.device.type not in ("cpu", "cuda"):
                raise NotImplementedError(f"{name}: on device {t.device}; {_DEVICE_HELP}")
            if t.layout != torch.strided:
                raise TypeError(
                    f"{name}: expected a dense (strided) tensor, got layout {t.layout}; "
                    "pass .to_dense()"
                )
        devices = {hidden_states.device, topk_ids.device, topk_weights.device}
        if len(devices) != 1:
            raise ValueError(
                "hidden_states, topk_ids, topk_weights: expected one device, got "
                + ", ".join(sorted(str(d) for d in devices))
            )
        if not hidden_states.dtype.is_floating_point:
            raise TypeError(
                f"hidden_states: expected a floating-point dtype (bfloat16, float16, float32), "
                f"got {hidden_states.dtype}"
            )
        if hidden_states.dim() < 1 or hidden_states.shape[-1] != H:
            raise ValueError(
                f"hidden_states: expected shape [..., {H}] (hidden_size={H}), "
                f"got {_shape(hidden_states)}"
            )
        T = hidden_states.numel() // H
        if topk_ids.dtype not in _INT_DTYPES:
            raise TypeError(
                f"topk_ids: expected an integer dtype (e.g. int64), got {topk_ids.dtype}"
            )
        if topk_ids.dim() != 2 or tuple(topk_ids.shape) != (T, K):
            raise ValueError(
                f"topk_ids: expected shape [{T}, {K}] (T from hidden_states, "
                f"K=num_experts_per_tok), got {_shape(topk_ids)}"
            )
        if not topk_weights.dtype.is_floating_point:
            raise TypeError(
                f"topk_weights: expected a floating-point dtype (float32), got {topk_weights.dtype}"
            )
        if topk_weights.dim() != 2 or tuple(topk_weights.shape) != (T, K):
            raise ValueError(
                f"topk_weights: expected shape [{T}, {K}] (T from hidden_states, "
                f"K=num_experts_per_tok), got {_shape(topk_weights)}"
            )
        if T > 0 and self.moe is None:
            raise RuntimeError(
                "forward: weights are not loaded; call load_weights_from_tensors(...) "
                "(or load_weights(...)) before forward"
            )
        # Views only: the staging copies (serving.submit) convert dtypes and gather strided data
        # in one pass, so nothing is copied twice on the decode path.
        x = hidden_states.detach().reshape(T, H)
        ids = topk_ids.detach()
        if ids.dtype != torch.int64:
            ids = ids.to(torch.int64)
        w = topk_weights.detach()
        if w.dtype != torch.float32:
            w = w.to(torch.float32)
        return T, x, ids, w, hidden_states.dtype

    def submit_forward(self, hidden_states, topk_ids, topk_weights, cuda_stream=None):
        """Stage the inputs and enqueue the forward on the process-wide task queue; returns at
        once. With max_deferred_experts_per_token > 0 a second task runs the deferred experts,
        whose result is added into the next layer's output (see kt_jit.serving)."""
        serving.submit(self, hidden_states, topk_ids, topk_weights, cuda_stream)

    def sync_forward(self, hidden_states=None, cuda_stream=None) -> torch.Tensor:
        """Wait for the last submit_forward and return its result: [T, H] in hidden_states' dtype
        (a new tensor). Errors raised inside the task are raised here."""
        return serving.sync(self, cuda_stream)

    def forward(self, hidden_states, topk_ids, topk_weights, cuda_stream=None) -> torch.Tensor:
        """MoE forward: out[t] = sum_j w[t,j] * expert_{ids[t,j]}(x[t]); returns [T, H].

        Same as submit_forward + sync_forward (so deferral applies here too)."""
        serving.submit(self, hidden_states, topk_ids, topk_weights, cuda_stream)
        return serving.sync(self, cuda_stream)

    # ----------------------------------------------------------------------------------------
    def submit_write_weight_scale_to_buffer(
        self,
        gpu_tp_count,
        expert_id,
        w13_weight_ptrs,
        w13_scale_ptrs,
        w2_weight_ptrs,
        w2_scale_ptrs,
    ):
        """Enqueue writing expert ``expert_id`` (a physical slot, as in topk_ids) in its
        checkpoint encoding for each of ``gpu_tp_count`` GPU ranks: element r of each list is the
        address of rank r's buffer — host memory, or CUDA device memory (then the expert is
        written to a host staging buffer and copied with cudaMemcpy). w13 = [gate rows; up rows]
        of rank r's I slice ([2·I/tp, H]), w2 = down's column slice ([H, I/tp]); scales alike —
        FP8: fp32 128×128 block scales, FP8_PERCHANNEL: fp32 row scales, MXFP4 / MXFP8: ue8m0
        bytes [N, K/32], RAWINT4: compressed-tensors packed bytes [N, K/2] and bf16 group scales
        [N, K/g], GPTQ_INT4: AutoGPTQ qweight int32 [K/8, N] and fp16 scales [K/g, N] (N the
        output features, K the inputs), BF16: none (pointers ignored). Weights are read back
        from the packed layer, bit-exact. Finish with ``sync_write_weight_scale_to_buffer()``."""
        supported = ("BF16", "FP8", "FP8_PERCHANNEL", "MXFP4", "MXFP8", "RAWINT4", "GPTQ_INT4")
        if self.method not in supported:
            raise NotImplementedError(
                f"write_weight_scale_to_buffer: method {self.method} keeps no checkpoint encoding "
                f"to write back (supported: {', '.join(supported)})"
            )
        if self.moe is None:
            raise RuntimeError("write_weight_scale_to_buffer: weights are not loaded")
        tp = int(gpu_tp_count)
        lists = {
            "w13_weight_ptrs": w13_weight_ptrs,
            "w13_scale_ptrs": w13_scale_ptrs,
            "w2_weight_ptrs": w2_weight_ptrs,
            "w2_scale_ptrs": w2_scale_ptrs,
        }
        ptrs = {}
        for name, v in lists.items():
            v = [int(p) for p in (v if v is not None else [])]
            if name.endswith("scale_ptrs") and self.method == "BF16" and not v:
                v = [0] * tp
            if len(v) != tp:
                raise ValueError(
                    f"{name}: expected {tp} addresses (gpu_tp_count={tp}), got {len(v)}"
                )
            ptrs[name] = v
        for name in ("w13_weight_ptrs", "w2_weight_ptrs"):
            if any(p == 0 for p in ptrs[name]):
                raise ValueError(f"{name}: null address")
        moe, slot = self.moe, int(expert_id)
        names = ("w13_weight_ptrs", "w13_scale_ptrs", "w2_weight_ptrs", "w2_scale_ptrs")
        # Device buffers (SGLang may hand CUDA tensors' data_ptr()) get a host staging buffer.
        on_device = [[False] * 4 for _ in range(tp)]
        if torch.cuda.is_available() and _core.cuda_runtime() is not None:
            for r in range(tp):
                for j, name in enumerate(names):
                    p = ptrs[name][r]
                    on_device[r][j] = bool(p) and _core.cuda_is_device_pointer(p)

        def task():
            sizes = moe.write_expert_bytes(tp)  # raises (at sync) for a tp it cannot split
            for r in range(tp):
                target = [ptrs[name][r] for name in names]
                staged = [
                    (
                        torch.empty(sizes[j], dtype=torch.uint8)
                        if on_device[r][j] and sizes[j]
                        else None
                    )
                    for j in range(4)
                ]
                use = [s.data_ptr() if s is not None else target[j] for j, s in enumerate(staged)]
                moe.write_expert(slot, tp, r, *use)
                for j, s in enumerate(staged):
                    if s is not None:
                        _core.cuda_memcpy(target[j], s.data_ptr(), sizes[j])

        serving.get_queue().submit(task)

    def sync_write_weight_scale_to_buffer(self):
        """Wait for the writes submitted so far; raises a write's error here."""
        serving.get_queue().sync()

    # ----------------------------------------------------------------------------------------
    @staticmethod
    def set_capture_batch_sizes(capture_bs: List[int]):
        """Batch sizes whose staging buffers are kept (kt-kernel: CUDA-graph capture sizes)."""
        serving.set_capture_batch_sizes(capture_bs)
        KTMoEWrapper._capture_batch_sizes = serving.get_capture_batch_sizes()

    @staticmethod
    def get_capture_batch_sizes() -> List[int]:
        return serving.get_capture_batch_sizes()

    @staticmethod
    def clear_buffer_cache():
        """Wait for forwards in flight, then drop the cached staging buffers."""
        serving.clear_buffer_cache()

    def __repr__(self) -> str:
        return (
            f"KTMoEWrapper(layer_idx={self.layer_idx}, method={self.method!r}, "
            f"E={self.num_experts}, K={self.num_experts_per_tok}, H={self.hidden_size}, "
            f"I={self.moe_intermediate_size}, isa={_core.isa()!r}, "
            f"loaded={self.moe is not None})"
        )


def generate_gpu_experts_masks(activation_freq: torch.Tensor, num_gpu_experts: int) -> torch.Tensor:
    """Global top-``num_gpu_experts`` over the flattened [L, E] table → bool [L, E] (CPU)."""
    if not isinstance(activation_freq, torch.Tensor):
        raise TypeError(
            f"activation_freq: expected a torch.Tensor [L, E], got {type(activation_freq).__name__}"
        )
    if activation_freq.dim() != 2:
        raise ValueError(
            f"activation_freq: expected a 2-D tensor [num_layers, num_experts], "
            f"got shape {_shape(activation_freq)}"
        )
    L, E = (int(s) for s in activation_freq.shape)
    total = L * E
    n = max(0, min(int(num_gpu_experts), total))
    masks = torch.zeros(total, dtype=torch.bool)
    if n > 0:
        flat = activation_freq.detach().reshape(-1).to(device="cpu")
        if not flat.dtype.is_floating_point:
            flat = flat.to(torch.float64)
        _, top = torch.topk(flat, k=n, largest=True, sorted=False)
        masks[top] = True
    return masks.view(L, E)
