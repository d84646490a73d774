"""Gradient buckets of ``DistributedOptimizer`` for device (CUDA) parameters, kept for the
optimizer's life.

A bucket owns a flat device buffer and a pinned host buffer of its parameters' total size.
When its last gradient is ready the hook (autograd thread) only *queues* work on a side
stream and returns:

1. the side stream waits for an event recorded on the current stream (the gradients' producers);
2. one batched copy packs into the flat buffer the gradients that are not already there
   (compressed if asked);
3. one device-to-host copy into the pinned buffer, then a *ready* event;
4. the stager thread (:mod:`.device_threads`) waits for that event, GIL released, and starts one core
   allreduce of the pinned buffer in place;
5. a return thread waits for that allreduce and, the moment it is done, queues on the same
   side stream one host-to-device copy into the flat buffer (then the decompression and one
   batched copy into the gradients that are not views of it), and records a *back* event.

``synchronize()`` only makes the current stream wait for each bucket's *back* event: it copies
nothing, and nothing but the stager synchronizes with the device.

As DDP's ``gradient_as_bucket_view``: where the compression leaves the flat buffer as it is
(``Compression.none``), the first reduction makes each contiguous parameter's ``.grad`` a view
of its part of the flat buffer.  Autograd then accumulates straight into the bucket and the
reduced values land in place, so a step packs and unpacks nothing.  A gradient that is no
longer the view (``zero_grad(set_to_none=True)``, torch's default, or a ``.grad`` you
assigned) is packed for that step and becomes the view again::

    opt.zero_grad(set_to_none=False); loss.backward(); opt.step()  # copies: one each way per bucket

Sizes follow DDP: a first bucket of :data:`FIRST_BUCKET_BYTES` (so communication starts
early), then :data:`BUCKET_BYTES`, never above the fusion threshold::

    plan_buckets([4, 4, 8, 2], first_cap=4, cap=10)   # [[0], [1], [2, 3]]  (sizes in bytes)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

import ringcomm as _rc
from ringcomm import api as _core_api

from .device import DeviceService
from .handles import Handle

__all__ = ["DeviceBucket", "HostBucket", "FlatBucket", "GroupKey", "plan_buckets", "split_list", "bucket_caps", "FIRST_BUCKET_BYTES", "BUCKET_BYTES", "DEVICE_DTYPES"]

#: The first bucket's size (DDP's ``_DEFAULT_FIRST_BUCKET_BYTES``).
FIRST_BUCKET_BYTES = 1024 * 1024
#: Every later bucket's size (DDP's ``bucket_cap_mb=25``).
BUCKET_BYTES = 25 * 1024 * 1024
#: Parameter dtypes a device bucket carries (the others take the per-tensor path).
DEVICE_DTYPES = (torch.float16, torch.float32, torch.float64)


def bucket_caps(fusion_threshold: int, bucket_bytes: int) -> tuple[int, int]:
    """``(first, later)`` bucket sizes: DDP's (a first bucket of at most :data:`FIRST_BUCKET_BYTES`,
    then ``RINGCOMM_BUCKET_BYTES``), never above the fusion threshold; either setting 0 gives no
    buckets (one op per parameter).

    >>> bucket_caps(64 << 20, 25 << 20)
    (1048576, 26214400)
    >>> bucket_caps(4 << 20, 25 << 20)
    (1048576, 4194304)
    >>> bucket_caps(64 << 20, 1600)
    (1600, 1600)
    >>> bucket_caps(0, 25 << 20)
    (0, 0)
    """
    if fusion_threshold <= 0 or bucket_bytes <= 0:
        return 0, 0
    later = min(bucket_bytes, fusion_threshold)
    return min(FIRST_BUCKET_BYTES, later), later


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


class GroupKey(tuple):  # type: ignore[type-arg]
    """One group's parameters (a bucket's, or a ``groups=`` entry's) as a dict key that hashes and
    compares by identity: a plain tuple of tensors hashes every tensor through Python, which a hook
    paid several times per call (a 30-tensor key took 1.8 us per lookup against 0.04 us).

        k = GroupKey([a, b]);  {k: 1}[k] -> 1;  k == GroupKey([a, b]) -> False;  k[0] is a
    """

    __slots__ = ()
    __hash__ = object.__hash__

    def __eq__(self, other: object) -> bool:
        return self is other

    def __ne__(self, other: object) -> bool:
        return self is not other


def _same(grad: torch.Tensor, view: torch.Tensor) -> bool:
    """``grad`` is ``view`` (the same memory, shape and strides): autograd accumulated in place."""
    return (grad.layout is torch.strided and grad.data_ptr() == view.data_ptr() and grad.shape == view.shape
            and grad.stride() == view.stride() and grad.dtype is view.dtype and grad.device == view.device)


class FlatBucket:
    """A bucket's parameters, its flat buffer (allocated at the first reduction, on their device)
    and each parameter's place in it, shaped like the parameter."""

    def __init__(self, params: Sequence[torch.Tensor], names: Sequence[str]) -> None:
        self.params = tuple(params)
        self.names = list(names)
        self.device = self.params[0].device
        self.dtype = self.params[0].dtype
        self.numel = sum(p.numel() for p in self.params)
        self._flat: torch.Tensor | None = None
        self._parts: list[torch.Tensor] = []  # each parameter's place in the flat buffer, shaped like it

    def _allocate(self) -> torch.Tensor:
        """The flat buffer's memory (a bucket shared between processes allocates its own)."""
        return torch.empty(self.numel, dtype=self.dtype, device=self.device)

    def _flat_buffer(self) -> torch.Tensor:
        if self._flat is None:
            self._flat = self._allocate()
            self._parts, start = [], 0
            for p in self.params:
                self._parts.append(self._flat[start:start + p.numel()].view(p.shape))
                start += p.numel()
        return self._flat

    def views(self) -> list[bool]:
        """Per parameter: whether its ``.grad`` is its view of the flat buffer right now."""
        return [p.grad is not None and bool(self._parts) and _same(p.grad, part)
                for p, part in zip(self.params, self._parts)]

    def _sources(self, grads: list[torch.Tensor], todo: list[int], clone: Callable[[torch.Tensor], torch.Tensor]
                 ) -> list[torch.Tensor]:
        """The gradients at ``todo``, each copied first (``clone``) if it lies in the flat buffer
        (a view that moved to another place: packing it in place would overwrite another)."""
        home = self._flat_buffer().untyped_storage().data_ptr()
        return [clone(grads[i]) if grads[i].untyped_storage().data_ptr() == home else grads[i] for i in todo]

    def _become_views(self, grads: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
        """Point each contiguous parameter's ``.grad`` at its part of the flat buffer (the values
        are there already, or queued to be); returns the gradients as they are now and the indices
        of those that are not views (their results are copied back)."""
        now, rest = list(grads), []
        for i, (p, g, part) in enumerate(zip(self.params, grads, self._parts)):
            if _same(g, part):
                continue
            if p.is_contiguous() and p.grad is g and not g.requires_grad:
                p.grad = now[i] = part
            else:
                rest.append(i)
        return now, rest


class HostBucket(FlatBucket):
    """A bucket of host (CPU) parameters of one dtype: the gradients become views of one flat
    buffer, which one core allreduce reduces in place, so a step copies nothing in or out of a
    fusion buffer (only a gradient that is not its view is packed, and copied back if it stays so)."""

    def start(self, grads: list[torch.Tensor], *, name: str, op: Any, prescale: float, postscale: float,
              process_set: Any) -> Handle:
        """Pack what is not in place, submit the allreduce and return at once; ``synchronize`` on
        the handle leaves the results in the gradients."""
        t0 = time.perf_counter()
        flat = self._flat_buffer()
        todo = [i for i, (g, part) in enumerate(zip(grads, self._parts)) if not _same(g, part)]
        if todo:
            with torch.no_grad():
                torch._foreach_copy_([self._parts[i] for i in todo], self._sources(grads, todo, torch.clone))
        grads, back_into = self._become_views(grads)
        array = flat.numpy()
        core_name = f"allreduce.{name}"
        if _core_api.timeline_active():  # which parameters this bucket carries
            _core_api.timeline_span(core_name, "BUCKET_PACK", t0, time.perf_counter(), {"parameters": self.names})
        core = _rc.allreduce_async(array, op=op, name=core_name, prescale_factor=prescale,
                                   postscale_factor=postscale, out=array, process_set=process_set)

        def finish(_raw: Any) -> list[torch.Tensor]:
            if back_into:
                with torch.no_grad():
                    torch._foreach_copy_([grads[i] for i in back_into], [self._parts[i] for i in back_into])
            return grads

        return Handle("allreduce", name, core, finish, None, int(array.nbytes))


class DeviceBucket(FlatBucket):
    """One bucket's buffers and its in-place reduction (see the module docstring)."""

    def __init__(self, params: Sequence[torch.Tensor], names: Sequence[str], service: DeviceService) -> None:
        super().__init__(params, names)
        self.service = service
        self.ops = service.ops
        self._pinned: torch.Tensor | None = None
        self._in_place: bool | None = None  # whether the compression reduces the flat buffer itself

    def _buffers(self, wire: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        flat = self._flat_buffer()
        nbytes = self.numel * wire.itemsize
        if self._pinned is None or self._pinned.numel() < nbytes:
            self._pinned = self.service.pool.allocate(nbytes)  # kept for the bucket's life
        return flat, self._pinned[:nbytes].view(wire)

    def _pack(self, flat: torch.Tensor, grads: list[torch.Tensor], side: Any) -> None:
        """Bring into the flat buffer the gradients that are not already there (all of them until
        the compression is known to leave the buffer as it is)."""
        todo = [i for i, (g, part) in enumerate(zip(grads, self._parts)) if not (self._in_place and _same(g, part))]
        if not todo:
            return

        def clone(g: torch.Tensor) -> torch.Tensor:
            with self.ops.on(side):
                return g.clone()
        sources = self._sources(grads, todo, clone)
        if len(todo) == len(grads):
            self.ops.pack(flat, sources, side)
        else:
            self.ops.pack_parts([self._parts[i] for i in todo], sources, side)

    def start(self, grads: list[torch.Tensor], *, name: str, op: Any, compression: Any, prescale: float,
              postscale: float, process_set: Any) -> Handle:
        """Queue the copies and hand the op to the stager, and its way back to a return thread;
        returns at once.  ``synchronize`` on the handle waits for both and makes the current
        stream wait for the results, which are then in ``grads`` (or in the flat buffer, where
        each gradient is a view of it)."""
        ops, svc = self.ops, self.service
        t0 = time.perf_counter()
        side = svc.after(svc.current())  # the gradients' producers come first
        flat, _ = self._buffers(self.dtype)
        self._pack(flat, grads, side)
        with ops.on(side):
            wire, ctx = compression.compress(flat)
        if self._in_place is None:
            self._in_place = wire is flat
        # the reduced values land in the flat buffer: gradients that are views of it need no copy back
        grads, back_into = self._become_views(grads) if wire is flat else (grads, list(range(len(grads))))
        _, host = self._buffers(wire.dtype)
        ops.copy(host, wire, side)
        ready = svc.mark()
        array = host.numpy()
        core_name = f"allreduce.{name}"
        if _core_api.timeline_active():  # which parameters this bucket carries
            _core_api.timeline_span(core_name, "BUCKET_PACK", t0, time.perf_counter(),
                                    {"parameters": self.names})

        def begin() -> Any:  # on the stager thread, once the pinned buffer holds the gradients
            return _rc.allreduce_async(array, op=op, name=core_name, prescale_factor=prescale,
                                       postscale_factor=postscale, out=array, process_set=process_set)

        def home(_raw: Any) -> Any:  # on a return thread, once the reduction is done
            t1 = time.perf_counter()
            ops.copy(wire, host, side)  # after the device-to-host copy on the same stream
            with ops.on(side):
                value = compression.decompress(wire, ctx)
            if value is not flat:
                ops.unpack(value, grads, side)
            elif back_into:
                ops.unpack_parts([self._parts[i] for i in back_into], [grads[i] for i in back_into], side)
            back = svc.mark()
            if _core_api.timeline_active():
                _core_api.timeline_span(core_name, "BUCKET_UNPACK", t1, time.perf_counter(),
                                        {"parameters": self.names})
            return back

        returning = svc.then(svc.start(ready, begin, core_name), home, core_name)

        def finish(back: Any) -> list[torch.Tensor]:  # on the thread in synchronize(): no copy, no wait
            ops.stream_wait(svc.current(), back)  # later kernels see the reduced values
            return grads

        return Handle("allreduce", name, returning, finish, None, int(array.nbytes))
