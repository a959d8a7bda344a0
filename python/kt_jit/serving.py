"""Asynchronous ``submit_forward`` / ``sync_forward`` for ``KTMoEWrapper`` (kt-kernel's serving path).

One process-wide ``_core.TaskQueue`` (a FIFO run by one worker thread, like kt-kernel's CPUInfer)
executes every wrapper's forwards in submission order. ``submit`` stages the inputs into fp32
buffers and returns at once; ``sync`` waits for that layer's task and returns a fresh tensor.

Staging buffers follow kt-kernel's ``KExpertsCPUBuffer``: one set per (T, H, K), shared by all
layers, two slots (``slot = layer_idx % 2``). Batch sizes named in ``set_capture_batch_sizes`` keep
their buffers until ``clear_buffer_cache()``; any other T uses one temporary set, replaced when T
changes. The queue holds every tensor a task reads or writes until the task has finished, so
buffers may be replaced, and wrappers dropped, with work in flight.

Deferred experts (``max_deferred_experts_per_token = d > 0``): per batch an expert is *immediate*
if it is among the top ``K - d`` routing slots (by weight) of any token; the other (token, slot)
pairs run as a second task that writes the other slot's output buffer. If the next forward
submitted is layer ``layer_idx + 1`` with the same buffer set, its task adds its result into that
buffer (``incremental``), so layer L's deferred contribution appears in layer L+1's output, as in
kt-kernel. Otherwise the deferred contribution is dropped (SGLang sets d = 0 on the last layer).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
from typing import List, Optional, Tuple

import torch

from . import _core

logger = logging.getLogger("kt_jit")

_lock = threading.RLock()
_queue: Optional["_core.TaskQueue"] = None
_capture_bs: List[int] = []
_cache: dict = {}  # (T, H, K) -> _Buffers for capture batch sizes
_temp: Optional["_Buffers"] = None  # the one set for any other T
# (layer index that consumes it, buffer set) after a forward that deferred experts
_carry: Optional[Tuple[int, "_Buffers"]] = None


def get_queue() -> "_core.TaskQueue":
    """The process-wide task queue (created on first use, drained at interpreter exit)."""
    global _queue
    q = _queue
    if q is None:
        with _lock:
            if _queue is None:
                _queue = _core.TaskQueue()
                atexit.register(_drain_at_exit)
            q = _queue
    return q


def drain() -> None:
    """Wait for every submitted task; raise the first task error not yet reported."""
    q = _queue
    if q is not None:
        q.sync()


def _drain_at_exit() -> None:
    try:
        drain()
    except Exception as e:  # pragma: no cover - reported, never raised at exit
        logger.warning("kt-jit: a forward still in flight at exit failed: %s", e)


class _Buffers:
    """fp32 staging for one (T, H, K): inputs, immediate/deferred ids and output, two slots."""

    __slots__ = ("key", "x", "ids", "ids_deferred", "w", "out", "ptrs")

    def __init__(self, T: int, H: int, K: int):
        self.key = (T, H, K)
        # Page-locked when CUDA is present, so stream-ordered copies to and from the GPU are
        # asynchronous.
        pin = torch.cuda.is_available()
        f32, i64 = torch.float32, torch.int64
        self.x = [torch.empty(T, H, dtype=f32, pin_memory=pin) for _ in range(2)]
        self.ids = [torch.empty(T, K, dtype=i64, pin_memory=pin) for _ in range(2)]
        self.ids_deferred = [torch.full((T, K), -1, dtype=i64, pin_memory=pin) for _ in range(2)]
        self.w = [torch.empty(T, K, dtype=f32, pin_memory=pin) for _ in range(2)]
        self.out = [torch.zeros(T, H, dtype=f32, pin_memory=pin) for _ in range(2)]
        # per slot: (x, ids, w, out) data pointers, for the staged fast path
        self.ptrs = [
            (
                self.x[s].data_ptr(),
                self.ids[s].data_ptr(),
                self.w[s].data_ptr(),
                self.out[s].data_ptr(),
            )
            for s in range(2)
        ]


def _buffers(T: int, H: int, K: int) -> _Buffers:
    global _temp
    key = (T, H, K)
    if T in _capture_bs:
        b = _cache.get(key)
        if b is None:
            b = _cache[key] = _Buffers(T, H, K)
        return b
    if _temp is None or _temp.key != key:
        _temp = _Buffers(T, H, K)
    return _temp


def set_capture_batch_sizes(capture_bs) -> None:
    global _capture_bs
    with _lock:
        _capture_bs = [int(b) for b in capture_bs]


def get_capture_batch_sizes() -> List[int]:
    return list(_capture_bs)


def clear_buffer_cache() -> None:
    """Wait for work in flight, then drop every staging buffer (and any pending deferral)."""
    global _temp, _carry
    drain()
    with _lock:
        _cache.clear()
        _temp = None
        _carry = None


def select_deferred_experts(
    ids: torch.Tensor, weights: torch.Tensor, num_experts: int, protected_k: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Split routing ids [T, K] into (immediate, deferred) ids, -1 where a slot is not in the set.

    Per token the top ``protected_k`` slots by weight protect their expert for the whole batch;
    slots of protected experts are immediate, the others deferred. Ids outside [0, E) are -1 in
    both (they contribute nothing either way). ``protected_k <= 0`` defers everything.
    """
    E = int(num_experts)
    T, K = ids.shape
    valid = (ids >= 0) & (ids < E)
    protected = torch.zeros(E + 1, dtype=torch.bool, device=ids.device)  # E: invalid ids
    k = min(int(protected_k), K)
    if k > 0 and T > 0:
        top = torch.topk(weights, k, dim=1).indices
        sel = ids.gather(1, top)
        sel = torch.where(valid.gather(1, top), sel, torch.full_like(sel, E))
        protected[sel.reshape(-1)] = True
    protected[E] = False
    safe = torch.where(valid, ids, torch.full_like(ids, E))
    is_prot = protected[safe]
    minus = torch.full_like(ids, -1)
    immediate = torch.where(valid & is_prot, ids, minus)
    deferred = torch.where(valid & ~is_prot, ids, minus)
    return immediate, deferred


_FLOAT_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_IDS_INT32 = {torch.int64: False, torch.int32: True}


def _signature(x, ids, w):
    """What _prepare's checks depend on, for inputs the staged fast path can take (else None)."""
    if type(x) is not torch.Tensor or type(ids) is not torch.Tensor or type(w) is not torch.Tensor:
        return None
    return (
        x.dtype,
        x.shape,
        x.stride(),
        ids.dtype,
        ids.shape,
        ids.stride(),
        w.dtype,
        w.shape,
        w.stride(),
        x.is_cpu,
        ids.is_cpu,
        w.is_cpu,
    )


def _fast_path(wrapper, x, ids, w, cuda_stream):
    """(T, codes) when these inputs may skip _prepare: same signature as inputs that passed it,
    contiguous, CPU, dtypes the native staging converts. None means: take the full path."""
    if cuda_stream is not None and cuda_stream != 0:
        return None
    if wrapper.max_deferred_experts_per_token or wrapper.moe is None:
        return None
    sig = _signature(x, ids, w)
    if sig is None:
        return None
    hit = wrapper._fast_sig
    if hit is not None and hit[0] == sig:
        return hit[1]
    # Validate fully once (raises on bad input), then remember the signature if it qualifies.
    T = wrapper._prepare(x, ids, w, cuda_stream)[0]
    ok = (
        T > 0
        and x.dtype in _FLOAT_CODE
        and w.dtype in _FLOAT_CODE
        and ids.dtype in _IDS_INT32
        and x.is_cpu
        and ids.is_cpu
        and w.is_cpu
        and x.is_contiguous()
        and ids.is_contiguous()
        and w.is_contiguous()
    )
    if not ok:
        return None
    codes = (T, _FLOAT_CODE[x.dtype], _IDS_INT32[ids.dtype], _FLOAT_CODE[w.dtype])
    wrapper._fast_sig = (sig, codes)
    return codes


def _mask_fast(wrapper):
    """The mask tensor for this forward, re-validated only when the attribute changed object."""
    m = wrapper.gpu_experts_mask
    if m is None:
        return None
    if m is wrapper._mask_checked and m.data_ptr() == wrapper._mask_checked_ptr:
        return m
    v = wrapper._mask_for_forward()
    if v is m:  # already the right dtype/layout: later forwards may skip the checks
        wrapper._mask_checked, wrapper._mask_checked_ptr = m, m.data_ptr()
    return v


def submit(wrapper, hidden_states, topk_ids, topk_weights, cuda_stream) -> None:
    """KTMoEWrapper.submit_forward: validate, stage, enqueue; returns without waiting."""
    global _carry
    fast = _fast_path(wrapper, hidden_states, topk_ids, topk_weights, cuda_stream)
    if fast is not None:
        T, x_code, ids32, w_code = fast
        H, K = wrapper.hidden_size, wrapper.num_experts_per_tok
        layer_idx = wrapper.layer_idx
        mask = _mask_fast(wrapper)
        q = get_queue()
        with _lock:
            bufs = _buffers(T, H, K)
            slot = layer_idx % 2
            incremental = _carry is not None and _carry[0] == layer_idx and _carry[1] is bufs
            _carry = None
            px, pids, pw, pout = bufs.ptrs[slot]
            seq = q.submit_forward_staged(
                wrapper.moe,
                T,
                hidden_states.data_ptr(),
                x_code,
                topk_ids.data_ptr(),
                ids32,
                topk_weights.data_ptr(),
                w_code,
                px,
                pids,
                pw,
                0 if mask is None else mask.data_ptr(),
                pout,
                incremental,
                wrapper.chunked_prefill_size,
                (bufs, mask),
            )
        wrapper._pending = (seq, bufs, slot, T, hidden_states.dtype)
        return
    T, x, ids, w, out_dtype = wrapper._prepare(hidden_states, topk_ids, topk_weights, cuda_stream)
    stream = _stream_handle(x, cuda_stream)
    if stream is not None:
        return _submit_stream(wrapper, T, x, ids, w, out_dtype, stream)
    H, K, E = wrapper.hidden_size, wrapper.num_experts_per_tok, wrapper.num_experts
    layer_idx = wrapper.layer_idx
    wrapper._pending = None
    if T == 0:
        with _lock:
            _carry = None
        wrapper._pending = (0, None, 0, 0, out_dtype)
        return
    mask = wrapper._mask_for_forward()
    mask_ptr = 0 if mask is None else mask.data_ptr()
    d = int(wrapper.max_deferred_experts_per_token or 0)
    chunk = int(wrapper.chunked_prefill_size)
    q = get_queue()
    with _lock:
        bufs = _buffers(T, H, K)
        slot = layer_idx % 2
        incremental = _carry is not None and _carry[0] == layer_idx and _carry[1] is bufs
        _carry = None
        xb, wb, ob = bufs.x[slot], bufs.w[slot], bufs.out[slot]
        xb.copy_(x)
        wb.copy_(w)
        keep = (bufs, mask)
        if d > 0:
            immediate, deferred = select_deferred_experts(ids, w, E, K - d)
            bufs.ids[slot].copy_(immediate)
            bufs.ids_deferred[slot].copy_(deferred)
        else:
            bufs.ids[slot].copy_(ids)
        seq = q.submit_forward(
            wrapper.moe,
            T,
            xb.data_ptr(),
            bufs.ids[slot].data_ptr(),
            wb.data_ptr(),
            mask_ptr,
            ob.data_ptr(),
            incremental,
            chunk,
            keep,
        )
        if d > 0:
            q.submit_forward(
                wrapper.moe,
                T,
                xb.data_ptr(),
                bufs.ids_deferred[slot].data_ptr(),
                wb.data_ptr(),
                mask_ptr,
                bufs.out[1 - slot].data_ptr(),
                False,
                chunk,
                keep,
            )
            _carry = (layer_idx + 1, bufs)
    wrapper._pending = (seq, bufs, slot, T, out_dtype)


def sync(wrapper, cuda_stream=None) -> torch.Tensor:
    """KTMoEWrapper.sync_forward: wait for this wrapper's last submit; [T, H] in its dtype.

    A deferred task the submit left behind keeps running (kt-kernel's ``allow_pending``).
    """
    pending = wrapper._pending
    if pending is None:
        raise RuntimeError("sync_forward: no forward was submitted (call submit_forward first)")
    wrapper._pending = None
    if isinstance(pending[0], _StreamEntry):
        return _sync_stream(wrapper, *pending)
    seq, bufs, slot, T, out_dtype = pending
    H = wrapper.hidden_size
    if seq == 0:
        return torch.empty((0, H), dtype=out_dtype)
    get_queue().wait(seq)
    out = bufs.out[slot]
    return out.clone() if out_dtype == torch.float32 else out.to(out_dtype)


# ------------------------------------------------------------------------------------------------
# Stream order (kt-kernel's submit_with_cuda_stream / sync_with_cuda_stream).
#
# With CUDA tensors (or any non-zero cuda_stream) the forward runs in the stream's order: the
# staging copies are enqueued on the stream (asynchronous, into page-locked buffers), then a host
# callback that enqueues the CPU forward; sync_forward enqueues a host callback that blocks the
# stream until that forward is done, then the copy of the result back to the device. Nothing here
# waits on the host, so the sequence can be captured into a CUDA graph; each callback reads a
# fixed _core.StreamForward per (wrapper, buffer set, slot), which a replay reuses as it is. The
# CUDA runtime is found with dlopen at first use (see runtime/cuda_bridge.hpp).
# An error inside a stream-ordered forward cannot reach the caller at once (the host has moved
# on); it is raised by the next sync_forward of the same wrapper, or at once for CPU tensors.


class _StreamEntry:
    __slots__ = ("bufs", "mask", "moe", "fwd")

    def __init__(self, bufs, mask, moe, fwd):
        self.bufs, self.mask, self.moe, self.fwd = bufs, mask, moe, fwd


def _stream_handle(x, cuda_stream):
    """The stream to order the forward on, or None for the plain (host) path."""
    if cuda_stream is not None and int(cuda_stream) != 0:
        return int(cuda_stream)
    if x.device.type == "cuda":
        return int(torch.cuda.current_stream(x.device).cuda_stream)
    return None


def _stream_ctx(device, stream):
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.stream(torch.cuda.ExternalStream(stream, device=device))


def _stream_entry(wrapper, kind, slot, incremental, bufs, mask, stream, make):
    """The StreamForward for this (kind, slot, incremental), rebuilt when its buffers, mask
    object or layer changed. A replaced one may still be referenced by callbacks on the stream, so
    the stream is drained before it is dropped (never the case inside a graph capture, where the
    buffers are the fixed capture-size ones)."""
    key = (kind, slot, incremental)
    e = wrapper._stream_forwards.get(key)
    if e is not None and e.bufs is bufs and e.mask is mask and e.moe is wrapper.moe:
        return e
    if e is not None:
        _core.cuda_stream_synchronize(stream)
    e = _StreamEntry(bufs, mask, wrapper.moe, make())
    wrapper._stream_forwards[key] = e
    return e


def _raise_stream_errors(wrapper):
    for e in wrapper._stream_forwards.values():
        msg = e.fwd.take_error()
        if msg:
            raise RuntimeError(f"a stream-ordered forward failed: {msg}")


def _submit_stream(wrapper, T, x, ids, w, out_dtype, stream) -> None:
    global _carry
    if _core.cuda_runtime() is None:
        raise RuntimeError(
            f"cuda_stream: ordering a forward on stream {stream:#x} needs the CUDA runtime; "
            f"{_core.cuda_runtime_error()}"
        )
    _raise_stream_errors(wrapper)
    H, K, E = wrapper.hidden_size, wrapper.num_experts_per_tok, wrapper.num_experts
    layer_idx = wrapper.layer_idx
    mask = wrapper._mask_for_forward()
    mask_ptr = 0 if mask is None else mask.data_ptr()
    d = int(wrapper.max_deferred_experts_per_token or 0)
    chunk = int(wrapper.chunked_prefill_size)
    q = get_queue()
    with _lock:
        bufs = _buffers(T, H, K)
        slot = layer_idx % 2
        incremental = _carry is not None and _carry[0] == layer_idx and _carry[1] is bufs
        _carry = None
        xb, wb, ob = bufs.x[slot], bufs.w[slot], bufs.out[slot]
        with _stream_ctx(x.device, stream):
            xb.copy_(x, non_blocking=True)
            wb.copy_(w, non_blocking=True)
            if d > 0:
                immediate, deferred = select_deferred_experts(ids, w, E, K - d)
                bufs.ids[slot].copy_(immediate, non_blocking=True)
                bufs.ids_deferred[slot].copy_(deferred, non_blocking=True)
            else:
                bufs.ids[slot].copy_(ids, non_blocking=True)

        def make(ids_t, out_t, inc):
            return lambda: _core.StreamForward(
                q,
                wrapper.moe,
                T,
                xb.data_ptr(),
                ids_t.data_ptr(),
                wb.data_ptr(),
                mask_ptr,
                out_t.data_ptr(),
                inc,
                chunk,
                (bufs, mask),
            )

        main = _stream_entry(
            wrapper,
            "main",
            slot,
            incremental,
            bufs,
            mask,
            stream,
            make(bufs.ids[slot], ob, incremental),
        )
        main.fwd.launch_submit(stream)
        if d > 0:
            other = bufs.out[1 - slot]
            deferred_e = _stream_entry(
                wrapper,
                "deferred",
                slot,
                False,
                bufs,
                mask,
                stream,
                make(bufs.ids_deferred[slot], other, False),
            )
            deferred_e.fwd.launch_submit(stream)
            _carry = (layer_idx + 1, bufs)
    wrapper._pending = (main, slot, T, out_dtype, x.device, stream)


def _sync_stream(wrapper, entry, slot, T, out_dtype, device, stream) -> torch.Tensor:
    entry.fwd.launch_wait(stream)
    ob = entry.bufs.out[slot]
    if device.type == "cuda":
        with _stream_ctx(device, stream):
            out = torch.empty((T, wrapper.hidden_size), dtype=out_dtype, device=device)
            out.copy_(ob, non_blocking=True)
        return out
    # CPU tensors ordered on a stream: the result is needed now.
    _core.cuda_stream_synchronize(stream)
    _raise_stream_errors(wrapper)
    return ob.clone() if out_dtype == torch.float32 else ob.to(out_dtype)
