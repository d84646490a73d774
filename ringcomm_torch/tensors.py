"""Torch tensors <-> the NumPy arrays the ringcomm core reads and writes.

The core moves C-contiguous NumPy arrays of a fixed set of dtypes
(``ringcomm.core.ops.SUPPORTED_DTYPES``).  This module turns any tensor into such
an array (:func:`stage`) and puts results back (:meth:`Staged.write_back`,
:func:`to_tensor`):

* CPU, contiguous, core dtype: zero-copy, the array *is* the tensor's memory
  (``tensor.detach().numpy()``), so an in-place allreduce writes straight into it.
* non-contiguous: a contiguous host copy, copied back on completion.
* bfloat16 (no NumPy dtype): reductions run in float32 (upcast, reduce,
  round back once); data movement (broadcast, allgather, alltoall) views the
  bits as int16, so values arrive bit-exact.
* CUDA: device -> host into a page-locked buffer taken from :class:`PinnedPool`
  (one free list per power-of-two size class, reused across steps), copied on a
  side ``torch.cuda.Stream`` that first waits for the current stream; the copy's
  event is :attr:`Staged.ready`, and the stager thread (:mod:`.device`) waits for it
  before the core reads the buffer (:func:`begin`), so the caller never waits for
  the GPU.  Results go back host -> device on the side stream; the current stream
  waits for that copy, and the buffer returns to the pool only once the copy's
  event has completed.

Example (any rank)::

    s = stage(torch.ones(3), reduce=True, what="allreduce")
    s.array              # array([1., 1., 1.], dtype=float32), same memory as the tensor
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from ringcomm import api as _core_api
from ringcomm.errors import InvalidTypeError
from ringcomm.core.ops import SUPPORTED_DTYPES

from .device import stager, staging_ops
from .host_memory import empty_host

__all__ = ["Staged", "stage", "begin", "to_tensor", "empty_result", "wire_dtype", "PinnedPool", "pinned_pool", "check_dtype",
           "check_stageable", "stageable_dtype"]

_CORE_TORCH_DTYPES: dict[torch.dtype, str] = {
    torch.uint8: "uint8",
    torch.int8: "int8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.float16: "float16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.bool: "bool",
}
assert set(_CORE_TORCH_DTYPES.values()) <= set(SUPPORTED_DTYPES)

_SUPPORTED_NAMES = ", ".join(str(d).replace("torch.", "") for d in (*_CORE_TORCH_DTYPES, torch.bfloat16))


def check_dtype(dtype: torch.dtype, what: str) -> None:
    """Raise :class:`InvalidTypeError` naming the supported dtypes if ``dtype`` cannot be communicated."""
    if dtype not in _CORE_TORCH_DTYPES and dtype is not torch.bfloat16:
        raise InvalidTypeError(
            f"{what}: tensor dtype {str(dtype).replace('torch.', '')} is not supported; "
            f"use one of {_SUPPORTED_NAMES} (convert with tensor.to(...))"
        )


def wire_dtype(dtype: torch.dtype, reduce: bool) -> torch.dtype:
    """The dtype the core sees for a tensor of ``dtype``.

    >>> wire_dtype(torch.bfloat16, reduce=True)    # reductions happen in float32
    torch.float32
    >>> wire_dtype(torch.bfloat16, reduce=False)   # data movement keeps the bits
    torch.int16
    """
    if dtype is torch.bfloat16:
        return torch.float32 if reduce else torch.int16
    return dtype


def _to_wire(t: torch.Tensor, wire: torch.dtype) -> torch.Tensor:
    """``t`` (detached) converted to the wire dtype, contiguous; no copy when nothing changes."""
    t = t.detach()
    if t.dtype is wire:
        return t.contiguous()
    if t.dtype is torch.bfloat16 and wire is torch.int16:
        return t.contiguous().view(torch.int16)
    return t.to(wire).contiguous()


def _from_wire(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`_to_wire`'s dtype change (bit view for int16 -> bfloat16, else a cast)."""
    if t.dtype is dtype:
        return t
    if dtype is torch.bfloat16 and t.dtype is torch.int16:
        return t.view(torch.bfloat16)
    return t.to(dtype)


def _size_class(nbytes: int) -> int:
    """Smallest power of two >= nbytes (at least 4 KiB): buffers are shared within a class."""
    return max(4096, 1 << max(0, (nbytes - 1)).bit_length())


# -- device<->host copies on the timeline --------------------------------------
# A D2H copy happens in stage(), before the core has named the op; the span waits in this
# thread's pending list until the Handle is made (same thread, same call) and takes the core
# name from it.  An H2D copy happens inside Handle.wait(), which sets the thread's current name.
_trace = threading.local()


@contextmanager
def traced_copy(phase: str) -> Iterator[bool]:
    """Time a device<->host copy for the timeline; yields whether a timeline is being written.

    When it is, the caller must make the copy complete before the block ends (synchronize), so
    the span covers the copy itself; without a timeline nothing is timed and nothing waits.
    """
    if not _core_api.timeline_active():
        yield False
        return
    start = time.perf_counter()
    yield True
    end = time.perf_counter()
    name = getattr(_trace, "name", None)
    if name is not None:
        _core_api.timeline_span(name, phase, start, end)
    else:
        pending = getattr(_trace, "pending", None)
        if pending is None:
            pending = _trace.pending = []
        pending.append((phase, start, end))


def has_pending_copies() -> bool:
    """Whether this thread holds copy spans not yet given to an op (only with a timeline and CUDA)."""
    return bool(getattr(_trace, "pending", None))


def claim_pending_copies(name: str | None) -> None:
    """Record this thread's untimed-to-an-op copy spans (from :func:`stage`) under core op ``name``."""
    pending = getattr(_trace, "pending", None)
    if not pending:
        return
    _trace.pending = []
    if name is not None:
        for phase, start, end in pending:
            _core_api.timeline_span(name, phase, start, end)


class copies_belong_to:  # lower case: used as a function, like contextlib's managers
    """Within the block, timed copies on this thread are spans of core op ``name``.

    A class rather than a ``@contextmanager`` generator: it runs once per op, and this costs a
    third as much."""

    __slots__ = ("_name", "_previous")

    def __init__(self, name: str | None) -> None:
        self._name = name
        self._previous: str | None = None

    def __enter__(self) -> None:
        self._previous = getattr(_trace, "name", None)
        _trace.name = self._name

    def __exit__(self, *exc: object) -> None:
        _trace.name = self._previous


class PinnedPool:
    """Page-locked host buffers for staging CUDA tensors, allocated once per size class and reused.

    ``acquire(n)`` returns a uint8 pinned tensor of at least ``n`` bytes;
    ``release(buf, event)`` gives it back, usable again once ``event`` (a
    ``torch.cuda.Event`` recorded after the last copy that reads it) has completed.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[int, list[torch.Tensor]] = {}
        self._in_flight: list[tuple[Any, torch.Tensor]] = []
        self.allocations = 0

    def _reclaim(self) -> None:
        still: list[tuple[Any, torch.Tensor]] = []
        for event, buf in self._in_flight:
            if event is None or event.query():
                self._free.setdefault(buf.numel(), []).append(buf)
            else:
                still.append((event, buf))
        self._in_flight = still

    def acquire(self, nbytes: int) -> torch.Tensor:
        cls = _size_class(nbytes)
        with self._lock:
            self._reclaim()
            free = self._free.get(cls)
            if free:
                return free.pop()
            self.allocations += 1
        return torch.empty(cls, dtype=torch.uint8, pin_memory=True)

    def release(self, buf: torch.Tensor, event: Any = None) -> None:
        with self._lock:
            self._in_flight.append((event, buf))

    def clear(self) -> None:
        """Drop every cached buffer (e.g. at shutdown); in-flight ones are dropped once done."""
        with self._lock:
            self._reclaim()
            self._free.clear()


pinned_pool = PinnedPool()
_side_streams: dict[int, Any] = {}
_streams_lock = threading.Lock()


def _side_stream(device: torch.device) -> Any:
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _streams_lock:
        stream = _side_streams.get(index)
        if stream is None:
            stream = _side_streams[index] = torch.cuda.Stream(device=index)
        return stream


class Staged:
    """One tensor's values as a C-contiguous host array in the wire dtype.

    ``array`` is what the core reads (and, for in-place ops, writes).
    ``direct`` is True when ``array`` shares memory with the tensor itself, so a
    result written into ``array`` needs no copy back.
    """

    __slots__ = ("array", "dtype", "wire", "device", "direct", "ready", "_buf", "_keep")

    def __init__(self, array: np.ndarray, dtype: torch.dtype, wire: torch.dtype, device: torch.device,
                 direct: bool, buf: torch.Tensor | None, keep: Any, ready: Any = None) -> None:
        self.array = array
        self.ready = ready  # the device -> host copy's event (None: ``array`` holds the values now)
        self.dtype = dtype
        self.wire = wire
        self.device = device
        self.direct = direct
        self._buf = buf
        self._keep = keep

    def write_back(self, target: torch.Tensor, result: np.ndarray | None = None) -> torch.Tensor:
        """Copy ``result`` (default: ``self.array``) into ``target``, which has this tensor's shape."""
        src = self.array if result is None else result
        if result is None and self.direct:
            return target
        if target.numel() == 0:
            return target
        if not src.flags.writeable:
            src = src.copy()
        host = torch.from_numpy(np.ascontiguousarray(src)).reshape(target.shape)
        if target.device.type == "cuda":
            _copy_to_device(target, host, self)
        else:
            if host.dtype is torch.int16 and target.dtype is torch.bfloat16:
                host = host.view(torch.bfloat16)  # bits; any other dtype change happens in copy_
            with torch.no_grad():
                target.copy_(host)
        return target

    def release(self) -> None:
        """Return a pinned staging buffer to the pool (no-op for CPU tensors)."""
        if self._buf is not None:
            buf, self._buf = self._buf, None
            event = None
            if self.device.type == "cuda":
                event = torch.cuda.Event()
                event.record(_side_stream(self.device))
            pinned_pool.release(buf, event)
        self._keep = None


def _copy_to_device(target: torch.Tensor, host: torch.Tensor, staged: Staged | None) -> None:
    """Host -> ``target`` on the side stream; the current stream then waits for it."""
    stream = _side_stream(target.device)
    current = torch.cuda.current_stream(target.device)
    stream.wait_stream(current)  # target may still be in use by queued kernels
    with traced_copy("MEMCPY_H2D") as timed:
        with torch.cuda.stream(stream), torch.no_grad():
            dev = host.to(target.device, non_blocking=host.is_pinned())
            target.copy_(_from_wire(dev, target.dtype))
        if timed:  # only with a timeline: wait so that the span is the copy's real duration
            stream.synchronize()
    current.wait_stream(stream)


def check_stageable(t: Any, what: str) -> None:
    """Raise :class:`InvalidTypeError` unless :func:`stage` can stage ``t`` (a strided CPU or CUDA
    tensor of a supported dtype); copies nothing."""
    if not isinstance(t, torch.Tensor):
        raise InvalidTypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.is_sparse or t.layout is not torch.strided:
        raise InvalidTypeError(
            f"{what}: {t.layout} tensors are not supported; convert with tensor.to_dense()"
        )
    check_dtype(t.dtype, what)
    if t.device.type not in ("cpu", "cuda"):
        raise InvalidTypeError(
            f"{what}: tensors on device {t.device} are not supported; use CPU or CUDA tensors"
        )


def stageable_dtype(t: Any, reduce: bool) -> str | None:
    """The core dtype :func:`stage` would hand the core for ``t`` (e.g. ``"float32"``), or None
    when ``t`` cannot be staged."""
    try:
        check_stageable(t, "")
    except InvalidTypeError:
        return None
    return _CORE_TORCH_DTYPES[wire_dtype(t.dtype, reduce)]


def stage(t: torch.Tensor, *, reduce: bool, what: str) -> Staged:
    """A host array holding ``t``'s values in the wire dtype (see the module docstring)."""
    check_stageable(t, what)
    wire = wire_dtype(t.dtype, reduce)
    if t.device.type == "cpu":
        return _stage_host(t, wire)
    return _stage_cuda(t, wire)


def _stage_host(t: torch.Tensor, wire: torch.dtype) -> Staged:
    """A CPU tensor: its own memory when contiguous in the wire dtype (bfloat16 bits viewed as
    int16 count), else one copy, converted as it goes, into a new host tensor."""
    src = t.detach()
    if wire is torch.int16 and src.dtype is torch.bfloat16:
        src = src.view(torch.int16)  # the bits, whatever the strides
    if src.dtype is wire and src.is_contiguous():
        return Staged(src.numpy(), t.dtype, wire, t.device, True, None, src)
    host = empty_host(src.shape, wire)
    host.copy_(src)
    return Staged(host.numpy(), t.dtype, wire, t.device, False, None, host)


def _stage_cuda(t: torch.Tensor, wire: torch.dtype) -> Staged:
    nbytes = t.numel() * wire.itemsize
    buf = pinned_pool.acquire(nbytes)
    host = buf[:nbytes].view(wire).view(t.shape)
    stream = _side_stream(t.device)
    stream.wait_stream(torch.cuda.current_stream(t.device))  # t's producers have finished
    with traced_copy("MEMCPY_D2H") as timed:
        with torch.cuda.stream(stream), torch.no_grad():
            src = _to_wire(t, wire)
            host.copy_(src, non_blocking=True)
            t.record_stream(stream)
        ready = torch.cuda.Event()
        ready.record(stream)  # the stager waits for it before the core reads the buffer
        if timed:  # only with a timeline: wait so that the span is the copy's real duration
            ready.synchronize()
    return Staged(host.numpy(), t.dtype, wire, t.device, False, buf, None, ready)


def begin(staged: Sequence[Staged], start: Callable[[], Any], name: str | None) -> Any:
    """``start()`` (which hands the staged arrays to the core and returns its handle) now when
    every array holds its values, else on the stager thread once the copies' events happened
    (the handle returned then waits for that first).  Returns the core handle or a stand-in."""
    ready = [s.ready for s in staged if s.ready is not None]
    if not ready:
        return start()
    return stager.submit(staging_ops(), ready, start, name)


def to_tensor(result: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A new tensor of ``dtype`` on ``device`` from a core result array in the wire dtype."""
    arr = np.ascontiguousarray(result)
    if not arr.flags.writeable:
        arr = arr.copy()
    host = torch.from_numpy(arr)
    if device.type == "cuda":
        out = torch.empty(host.shape, dtype=dtype, device=device)
        _copy_to_device(out, host, None)
        return out
    return _from_wire(host, dtype)


def empty_result(like: torch.Tensor) -> torch.Tensor:
    """A new contiguous tensor with ``like``'s shape, dtype and device (for out-of-place results);
    on the CPU advised for huge pages (:mod:`.host_memory`): the core writes into it first."""
    if like.device.type == "cpu":
        return empty_host(like.shape, like.dtype)
    return torch.empty_like(like, memory_format=torch.contiguous_format)
