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
* CUDA: through the device's one :class:`~.device.DeviceService` (the optimizer's buckets
  and the ``"ringcomm"`` backend use the same one): device -> host into a page-locked buffer
  of its pool (one free list per power-of-two size class, reused across steps), copied on its
  side stream after the current stream's work; the copy's event is :attr:`Staged.ready`, and
  the stager thread waits for it before the core reads the buffer (:func:`begin`), so the
  caller never waits for the GPU.  A blocking collective, whose caller waits for the op anyway,
  copies on the current stream and waits for that event itself (behind an async op still
  waiting for its copy, the stager does).  Results go back
  host -> device on the current stream (the stream that uses them), in its order, and the
  buffer returns to the pool only once the event recorded after that copy has happened.  A
  result the core allocated (allgather, alltoall, reducescatter) is first copied into a pooled
  pinned buffer, so that no copy reads pageable memory.

Example (any rank)::

    s = stage(torch.ones(3), reduce=True, what="allreduce")
    s.array              # array([1., 1., 1.], dtype=float32), same memory as the tensor
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ringcomm import api as _core_api
from ringcomm.errors import InvalidTypeError
from ringcomm.core.ops import SUPPORTED_DTYPES

from .device import DeviceService, cuda_ops, service, service_for
from .device_threads import caller_is_waiting
from .host_memory import HUGE_PAGE_MIN_BYTES, empty_host

__all__ = ["Staged", "stage", "begin", "to_tensor", "empty_result", "wire_dtype", "check_dtype", "check_stageable",
           "stageable_dtype"]

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


def _device_service(device: torch.device) -> DeviceService:
    return service(cuda_ops(), device)


# -- device<->host copies on the timeline --------------------------------------
# A D2H copy happens in stage(), before the core has named the op; the span waits in this
# thread's pending list until the Handle is made (same thread, same call) and takes the core
# name from it.  An H2D copy happens inside Handle.wait(), which sets the thread's current name.
_trace = threading.local()


class traced_copy:  # lower case: used as a function, like contextlib's managers
    """Time a device<->host copy for the timeline; ``with`` gives whether a timeline is being written.

    When it is, the caller must make the copy complete before the block ends (synchronize), so
    the span covers the copy itself; without a timeline nothing is timed and nothing waits.  A
    class, as :class:`copies_belong_to`: every device op enters one or two."""

    __slots__ = ("_phase", "_start")

    def __init__(self, phase: str) -> None:
        self._phase = phase
        self._start: float | None = None

    def __enter__(self) -> bool:
        if not _core_api.timeline_active():
            return False
        self._start = time.perf_counter()
        return True

    def __exit__(self, exc_type: object, *exc: object) -> None:
        start = self._start
        if start is None or exc_type is not None:
            return
        end = time.perf_counter()
        name = getattr(_trace, "name", None)
        if name is not None:
            _core_api.timeline_span(name, self._phase, start, end)
        else:
            pending = getattr(_trace, "pending", None)
            if pending is None:
                pending = _trace.pending = []
            pending.append((self._phase, start, end))


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


class Staged:
    """One tensor's values as a C-contiguous host array in the wire dtype.

    ``array`` is what the core reads (and, for in-place ops, writes).
    ``direct`` is True when ``array`` shares memory with the tensor itself, so a
    result written into ``array`` needs no copy back.  ``service`` is the device's
    :class:`~.device.DeviceService` for a device tensor (None on the host): ``array``
    is then a pinned buffer of its pool, filled once ``ready`` (an event) happened.
    """

    __slots__ = ("array", "dtype", "wire", "device", "direct", "ready", "service", "consumer", "_buf", "_keep",
                 "_last")

    def __init__(self, array: np.ndarray, dtype: torch.dtype, wire: torch.dtype, device: torch.device,
                 direct: bool, buf: torch.Tensor | None, keep: Any, ready: Any = None,
                 service: DeviceService | None = None) -> None:
        self.array = array
        self.ready = ready  # the device -> host copy's event (None: ``array`` holds the values now)
        self.dtype = dtype
        self.wire = wire
        self.device = device
        self.direct = direct
        self.service = service
        self.consumer: Any = None  # the stream results are ordered on (None: the current one then)
        self._buf = buf
        self._keep = keep
        self._last: Any = ready  # an event recorded after the buffer's last copy (None: none yet)

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
        if self.service is not None:
            self._last = _copy_to_device(self.service, target, host, pinned=result is None,
                                         consumer=self.consumer)
        else:
            if host.dtype is torch.int16 and target.dtype is torch.bfloat16:
                host = host.view(torch.bfloat16)  # bits; any other dtype change happens in copy_
            with torch.no_grad():
                target.copy_(host)
        return target

    def to_tensor(self, result: np.ndarray, like: torch.Tensor) -> torch.Tensor:
        """A new tensor of ``like``'s dtype and device holding ``result`` (a core array in the wire
        dtype, of any shape)."""
        out, home = _to_tensor(result, like.dtype, like.device, self.service)
        if home is not None:
            self._last = home
        return out

    def release(self) -> None:
        """Return a pinned staging buffer to the pool (no-op for host tensors), once its last copy
        (to the host, or home) is done."""
        if self._buf is not None:
            buf, self._buf = self._buf, None
            if self.service is not None:
                self.service.release(buf, self._last)
        self._keep = None
        self._last = None


def _copy_to_device(service: DeviceService, target: torch.Tensor, host: torch.Tensor, *, pinned: bool,
                    consumer: Any = None) -> Any:
    """Host -> ``target`` on ``consumer`` (default: the current stream), in its order.  Returns the
    event recorded after the copy there."""
    if host.dtype is torch.int16 and target.dtype is torch.bfloat16:
        host = host.view(torch.bfloat16)  # the bits as they were sent
    with traced_copy("MEMCPY_H2D") as timed:
        home = service.to_device(target, host, pinned=pinned, consumer=consumer)
        if timed:  # only with a timeline: wait so that the span is the copy's real duration
            service.ops.wait_event(home)
    return home


def check_stageable(t: Any, what: str) -> None:
    """Raise :class:`InvalidTypeError` unless :func:`stage` can stage ``t`` (a strided CPU or CUDA
    tensor of a supported dtype); copies nothing."""
    if not isinstance(t, torch.Tensor):
        raise InvalidTypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.layout is not torch.strided:  # sparse (COO, CSR...) and other layouts
        raise InvalidTypeError(
            f"{what}: {t.layout} tensors are not supported; convert with tensor.to_dense()"
        )
    check_dtype(t.dtype, what)
    if not (t.is_cpu or t.is_cuda):
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


def stage(t: torch.Tensor, *, reduce: bool, what: str, values: bool = True) -> Staged:
    """A host array holding ``t``'s values in the wire dtype (see the module docstring).

    ``values=False``: the op only writes the array (a broadcast on a rank other than the root),
    so ``t``'s values are not copied into it: a device tensor queues no copy to the host and its
    op starts at once, without waiting for the device."""
    check_stageable(t, what)
    wire = wire_dtype(t.dtype, reduce)
    svc = service_for(t)
    if svc is None:
        return _stage_host(t, wire, values)
    if not values:
        return _receive_device(svc, t, wire)
    return _stage_device(svc, t, wire)


def host_memory(t: torch.Tensor, wire: torch.dtype) -> np.ndarray | None:
    """``t``'s own memory as a flat array of the wire dtype, for the core to write a result into;
    None unless ``t`` is a contiguous CPU tensor of that dtype (bfloat16 as int16 bits)."""
    mem = _own_memory(t, wire)
    return None if mem is None else mem.reshape(-1)


def _own_memory(t: torch.Tensor, wire: torch.dtype) -> np.ndarray | None:
    """:func:`host_memory` in ``t``'s shape."""
    if not t.is_cpu or not t.is_contiguous():
        return None
    src = t.detach()
    if wire is torch.int16 and src.dtype is torch.bfloat16:
        src = src.view(torch.int16)
    return src.numpy() if src.dtype is wire else None


def _stage_host(t: torch.Tensor, wire: torch.dtype, values: bool = True) -> Staged:
    """A CPU tensor: its own memory when contiguous in the wire dtype (bfloat16 bits viewed as
    int16 count), else one copy (with ``values``), converted as it goes, into a new host tensor."""
    mem = _own_memory(t, wire)
    if mem is not None:
        return Staged(mem, t.dtype, wire, t.device, True, None, t)
    src = t.detach()
    if wire is torch.int16 and src.dtype is torch.bfloat16:
        src = src.view(torch.int16)  # the bits, whatever the strides
    host = empty_host(src.shape, wire, _core_api.current_settings().host_cache_bytes)
    if values:
        host.copy_(src)
    return Staged(host.numpy(), t.dtype, wire, t.device, False, None, host)


def _stage_device(svc: DeviceService, t: torch.Tensor, wire: torch.dtype) -> Staged:
    """Queue ``t``'s copy into a pinned buffer of the device's pool; the caller does not wait.

    The copy runs on the side stream, after the current stream's work so far, so that the
    current stream's later work does not wait for it; in a blocking collective, which queues no
    later work before its op is done, on the current stream itself (no event to wait for)."""
    buf, host = _pinned_for(svc, t, wire)
    with traced_copy("MEMCPY_D2H") as timed:
        stream = None if caller_is_waiting() else svc.after(svc.current())  # t's producers have finished
        if t.dtype is wire and t.is_contiguous():
            src = t.detach()  # nothing to run on the device before the copy
        elif stream is None:
            with torch.no_grad():
                src = _to_wire(t, wire)  # a cast (bfloat16 -> float32) or a gather, in the stream's order
        else:
            with svc.ops.on(stream), torch.no_grad():
                src = _to_wire(t, wire)  # on the side stream too
        svc.ops.copy(host, src, stream)
        ready = svc.mark(stream)  # the stager (or the blocking caller) waits for it before the core reads the buffer
        if timed:  # only with a timeline: wait so that the span is the copy's real duration
            svc.ops.wait_event(ready)
    return Staged(host.numpy(), t.dtype, wire, t.device, False, buf, None, ready, svc)


def _receive_device(svc: DeviceService, t: torch.Tensor, wire: torch.dtype) -> Staged:
    """A pinned buffer of the device's pool for ``t``'s result, with nothing copied into it."""
    buf, host = _pinned_for(svc, t, wire)
    return Staged(host.numpy(), t.dtype, wire, t.device, False, buf, None, None, svc)


def _pinned_for(svc: DeviceService, t: torch.Tensor, wire: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A pooled pinned buffer for ``t`` in the wire dtype, and its view in ``t``'s shape."""
    nbytes = t.numel() * wire.itemsize
    buf = svc.pool.acquire(nbytes)
    return buf, buf[:nbytes].view(wire).view(t.shape)


def begin(staged: Sequence[Staged], start: Callable[[], Any], name: str | None) -> Any:
    """``start()`` (which hands the staged arrays to the core and returns its handle) now when
    every array holds its values, else on the stager thread once the copies' events happened
    (the handle returned then waits for that first).  Returns the core handle or a stand-in."""
    waiting = [s for s in staged if s.ready is not None]
    if not waiting:
        return start()
    svc = waiting[0].service
    assert svc is not None  # only a device tensor's staging has a ready event
    return svc.start([s.ready for s in waiting], start, name)


def to_tensor(result: np.ndarray, dtype: torch.dtype, device: torch.device,
              service: DeviceService | None = None) -> torch.Tensor:
    """A new tensor of ``dtype`` on ``device`` from a core result array in the wire dtype; through
    ``service`` (default: the device's, for a CUDA device) when it goes to a device."""
    return _to_tensor(result, dtype, device, service)[0]


def _to_tensor(result: np.ndarray, dtype: torch.dtype, device: torch.device,
               service: DeviceService | None) -> tuple[torch.Tensor, Any]:
    """:func:`to_tensor`, and the event of its copy to the device (None: no copy)."""
    arr = np.ascontiguousarray(result)
    if not arr.flags.writeable:
        arr = arr.copy()
    host = torch.from_numpy(arr)
    if service is None and device.type == "cuda":
        service = _device_service(device)
    if service is not None:
        out = torch.empty(host.shape, dtype=dtype, device=device)
        return out, _copy_to_device(service, out, host, pinned=False)
    return _from_wire(host, dtype), None


def empty_result(like: torch.Tensor) -> torch.Tensor:
    """A new contiguous tensor with ``like``'s shape, dtype and device (for out-of-place results);
    on the CPU advised for huge pages (:mod:`.host_memory`): the core writes into it first."""
    if like.is_cpu:
        if like.numel() * like.element_size() < HUGE_PAGE_MIN_BYTES:  # small: neither advised nor cached
            return torch.empty(like.shape, dtype=like.dtype)
        return empty_host(like.shape, like.dtype, _core_api.current_settings().host_cache_bytes)
    return torch.empty_like(like, memory_format=torch.contiguous_format)
