"""Gradient buckets of ``DistributedOptimizer`` for device (CUDA) parameters, kept for the
optimizer's life.

A bucket owns a flat device buffer and a pinned host buffer of its parameters' total size.
When its last gradient is ready the hook (autograd thread) only *queues* work on a side
stream and returns:

1. the side stream waits for an event recorded on the current stream (the gradients' producers);
2. one batched copy packs the gradients into the flat buffer (compressed if asked);
3. one device-to-host copy into the pinned buffer, then a *ready* event;
4. the stager thread (:mod:`.device`) waits for that event, GIL released, and starts one core
   allreduce of the pinned buffer in place.

``synchronize()`` waits for the core op, then queues one host-to-device copy into the flat
buffer and one batched copy back into the gradients on the side stream, records an event and
makes the current stream wait for it: no thread but the stager (and ``synchronize()``'s wait
for the peers) ever waits, and nothing synchronizes a stream or the device.

Sizes follow DDP: a first bucket of :data:`FIRST_BUCKET_BYTES` (so communication starts
early), then :data:`BUCKET_BYTES`, never above the fusion threshold::

    plan_buckets([4, 4, 8, 2], first_cap=4, cap=10)   # [[0], [1], [2, 3]]  (sizes in bytes)
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

import ringcomm as _rc
from ringcomm import api as _core_api

from .device import DeviceOps, stager
from .handles import Handle

__all__ = ["DeviceBucket", "plan_buckets", "host_buckets", "split_list", "bucket_caps", "FIRST_BUCKET_BYTES", "BUCKET_BYTES", "DEVICE_DTYPES"]

#: The first bucket's size (DDP's ``_DEFAULT_FIRST_BUCKET_BYTES``).
FIRST_BUCKET_BYTES = 1024 * 1024
#: Every later bucket's size (DDP's ``bucket_cap_mb=25``).
BUCKET_BYTES = 25 * 1024 * 1024
#: Parameter dtypes a device bucket carries (the others take the per-tensor path).
DEVICE_DTYPES = (torch.float16, torch.float32, torch.float64)


def bucket_caps(fusion_threshold: int, bucket_bytes: int) -> tuple[int, int]:
    """``(first, later)`` bucket sizes: DDP's, capped by the fusion threshold (0: no fusion, one
    parameter per bucket) and by ``RINGCOMM_BUCKET_BYTES`` when that is 0 (one op per parameter).

    >>> bucket_caps(64 << 20, 1 << 20)
    (1048576, 26214400)
    >>> bucket_caps(4 << 20, 1 << 20)
    (1048576, 4194304)
    >>> bucket_caps(0, 1 << 20)
    (0, 0)
    """
    if fusion_threshold <= 0 or bucket_bytes <= 0:
        return 0, 0
    return min(FIRST_BUCKET_BYTES, fusion_threshold), min(BUCKET_BYTES, fusion_threshold)


def plan_buckets(nbytes: Sequence[int], first_cap: int, cap: int) -> list[list[int]]:
    """Indices of ``nbytes`` (in the order backward produces the gradients) cut into runs: the
    first of at most ``first_cap`` bytes, the others of at most ``cap``; an item larger than its
    cap is a bucket of its own (a cap of 0: every item alone)."""
    out: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i, n in enumerate(nbytes):
        limit = first_cap if not out else cap
        if current and total + n > limit:
            out.append(current)
            current, total = [], 0
        current.append(i)
        total += n
    if current:
        out.append(current)
    return out


def host_buckets(params: list[torch.Tensor], cap: int) -> list[list[torch.Tensor]]:
    """``params`` in reverse order (the order backward produces their gradients), cut into runs of
    at most ``cap`` bytes; a parameter larger than ``cap`` is a bucket of its own.

    >>> [len(b) for b in host_buckets([torch.zeros(100), torch.zeros(300), torch.zeros(10)], cap=1600)]
    [2, 1]
    """
    order = params[::-1]
    return [[order[i] for i in run] for run in plan_buckets([p.numel() * p.element_size() for p in order], cap, cap)]


def split_list(items: list[Any], n: int) -> list[list[Any]]:
    """``items`` cut into ``n`` contiguous, nearly equal parts (the first ones one longer)."""
    n = max(1, min(n, len(items)))
    q, r = divmod(len(items), n)
    out, start = [], 0
    for i in range(n):
        end = start + q + (1 if i < r else 0)
        out.append(items[start:end])
        start = end
    return [g for g in out if g]


class DeviceBucket:
    """One bucket's buffers and its in-place reduction (see the module docstring)."""

    def __init__(self, params: Sequence[torch.Tensor], names: Sequence[str], ops: DeviceOps) -> None:
        self.params = tuple(params)
        self.names = list(names)
        self.ops = ops
        self.device = self.params[0].device
        self.dtype = self.params[0].dtype
        self.numel = sum(p.numel() for p in self.params)
        self._flat: torch.Tensor | None = None
        self._pinned: torch.Tensor | None = None

    def _buffers(self, wire: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self._flat is None:
            self._flat = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        nbytes = self.numel * wire.itemsize
        if self._pinned is None or self._pinned.numel() < nbytes:
            self._pinned = self.ops.pinned(nbytes)
        return self._flat, self._pinned[:nbytes].view(wire)

    def start(self, grads: list[torch.Tensor], *, name: str, op: Any, compression: Any, prescale: float,
              postscale: float, process_set: Any) -> Handle:
        """Queue the copies and hand the op to the stager; returns at once.  ``synchronize`` on the
        handle waits for the reduction and queues the results back into ``grads``."""
        ops, dev = self.ops, self.device
        t0 = time.perf_counter()
        side = ops.side_stream(dev)
        produced = ops.event()
        ops.record(produced, ops.current_stream(dev))
        ops.stream_wait(side, produced)  # the gradients' producers come first
        flat, _ = self._buffers(self.dtype)
        ops.pack(flat, grads, side)
        with ops.on(side):
            wire, ctx = compression.compress(flat)
        _, host = self._buffers(wire.dtype)
        ops.copy(host, wire, side)
        ready = ops.event()
        ops.record(ready, side)
        array = host.numpy()
        core_name = f"allreduce.{name}"
        if _core_api.timeline_active():  # which parameters this bucket carries
            _core_api.timeline_span(core_name, "BUCKET_PACK", t0, time.perf_counter(),
                                    {"parameters": self.names})

        def begin() -> Any:  # on the stager thread, once the pinned buffer holds the gradients
            return _rc.allreduce_async(array, op=op, name=core_name, prescale_factor=prescale,
                                       postscale_factor=postscale, out=array, process_set=process_set)

        staging = stager.submit(ops, ready, begin, core_name)

        def finish(_raw: Any) -> list[torch.Tensor]:  # on the thread in synchronize()
            ops.copy(wire, host, side)
            with ops.on(side):
                value = compression.decompress(wire, ctx)
            ops.unpack(value, grads, side)
            back = ops.event()
            ops.record(back, side)
            ops.stream_wait(ops.current_stream(dev), back)  # later kernels see the reduced values
            return grads

        return Handle("allreduce", name, staging, finish, None, int(array.nbytes))
