"""The device layer of ringcomm_torch: every CUDA op goes through one :class:`DeviceService` per
device (its side stream, its pool of pinned buffers, the process's stager and return threads),
behind one small interface of device operations.

:class:`CudaOps` is the real interface.  :class:`FakeOps` runs the same calls on CPU tensors for
tests: it records every call with the thread that made it, and while :meth:`FakeOps.hold` is on
it leaves recorded events *not ready* and fills the destinations of the copies with NaN until
:meth:`FakeOps.fire` runs them, so a reader that does not wait for the event reads poison.
Under :func:`override` every tensor is a device tensor served by the given operations, so the
fake covers the optimizer's buckets, the per-tensor collectives and the ``"ringcomm"`` backend.

Nothing here blocks the calling thread except :meth:`DeviceOps.wait_event`, which the stager
thread calls (:mod:`.device_threads`; a blocking collective's own thread does it for its op),
and, on the device path, a return thread or ``synchronize()`` with
``RINGCOMM_DEVICE_IPC_WAIT=host`` (and any thread while a timeline is written, so that a copy's
span is the copy).  A return thread waits for each core op and then
queues the device work that brings its results back, so the thread in ``synchronize()`` only
makes its stream wait for an event::

    svc = service_for(grad)                      # the device's one service
    side = svc.after(svc.current())              # autograd thread: the side stream follows the current one
    svc.ops.copy(pinned, grad, side)             # queue the copy to a pinned buffer of svc.pool
    ready = svc.mark()                           # and record its event
    staging = svc.start(ready, start_op, name)   # returns at once
    # stager thread: ops.wait_event(ready) (GIL released), then start_op() hands the buffer to the core
    back = svc.then(staging, copy_home, name)    # returns at once
    # a return thread: staging.wait(), then copy_home(result) queues the copy home, records an event
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from .device_threads import Returning, Staging, returns, stager

__all__ = ["DeviceOps", "CudaOps", "FakeOps", "FakeEvent", "cuda_ops", "ops_for", "override", "PinnedPool", "DeviceService",
           "service", "service_for", "Staging", "Returning", "stager", "returns"]


class DeviceOps(Protocol):
    """What the CUDA path asks of a device; every call but :meth:`wait_event` only queues work."""

    def side_stream(self, device: torch.device) -> Any: ...
    def current_stream(self, device: torch.device) -> Any: ...
    def event(self) -> Any: ...
    def record(self, event: Any, stream: Any) -> None:
        """Record ``event`` on ``stream`` (None: the calling thread's current stream)."""
    def stream_wait(self, stream: Any, event: Any) -> None:
        """``stream`` runs nothing more until ``event`` has happened (the host does not wait)."""
    def wait_event(self, event: Any) -> None:
        """The calling thread waits until ``event`` has happened (with the GIL released)."""
    def query(self, event: Any) -> bool: ...
    def pinned(self, nbytes: int) -> torch.Tensor:
        """A page-locked uint8 host buffer of ``nbytes``."""
    def pack(self, flat: torch.Tensor, tensors: Sequence[torch.Tensor], stream: Any) -> None:
        """``flat`` = the tensors one after another (one batched copy on ``stream``)."""
    def unpack(self, flat: torch.Tensor, tensors: Sequence[torch.Tensor], stream: Any) -> None:
        """The tensors = their parts of ``flat`` (one batched copy on ``stream``)."""
    def pack_parts(self, parts: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor], stream: Any) -> None:
        """Each of ``parts`` (views of one flat buffer) = its tensor (one batched copy on ``stream``)."""
    def unpack_parts(self, parts: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor], stream: Any) -> None:
        """Each tensor = its part (views of one flat buffer; one batched copy on ``stream``)."""
    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        """``dst`` = ``src`` on ``stream`` (None: the calling thread's current stream), without the
        host waiting (pinned <-> device)."""
    def on(self, stream: Any) -> Any:
        """A context in which torch operations run on ``stream``."""


def _views(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out, start = [], 0
    for t in tensors:
        n = t.numel()
        out.append(flat[start:start + n].view_as(t))
        start += n
    return out


class CudaOps:
    """:class:`DeviceOps` on CUDA: one side stream per device, kept for the life of the process."""

    def __init__(self) -> None:
        self._streams: dict[int, Any] = {}
        self._lock = threading.Lock()

    def side_stream(self, device: torch.device) -> Any:
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            stream = self._streams.get(index)
            if stream is None:
                stream = self._streams[index] = torch.cuda.Stream(device=index)
            return stream

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def event(self) -> Any:
        return torch.cuda.Event()

    def record(self, event: Any, stream: Any) -> None:
        if stream is None:
            event.record()
        else:
            event.record(stream)

    def stream_wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def wait_event(self, event: Any) -> None:
        event.synchronize()  # torch releases the GIL while it waits

    def query(self, event: Any) -> bool:
        return bool(event.query())

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def pack(self, flat: torch.Tensor, tensors: Sequence[torch.Tensor], stream: Any) -> None:
        with torch.cuda.stream(stream), torch.no_grad():
            torch.cat([t.detach().reshape(-1) for t in tensors], out=flat)
        for t in tensors:
            t.record_stream(stream)  # the allocator keeps t until the side stream has read it

    def unpack(self, flat: torch.Tensor, tensors: Sequence[torch.Tensor], stream: Any) -> None:
        with torch.cuda.stream(stream), torch.no_grad():
            torch._foreach_copy_(list(tensors), _views(flat, tensors))

    def pack_parts(self, parts: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor], stream: Any) -> None:
        with torch.cuda.stream(stream), torch.no_grad():
            torch._foreach_copy_(list(parts), [t.detach() for t in tensors])
        for t in tensors:
            t.record_stream(stream)

    def unpack_parts(self, parts: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor], stream: Any) -> None:
        with torch.cuda.stream(stream), torch.no_grad():
            torch._foreach_copy_(list(tensors), list(parts))

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        if stream is None:  # the current stream: in its order, as any torch operation there
            with torch.no_grad():
                dst.copy_(src, non_blocking=True)
            return
        with torch.cuda.stream(stream), torch.no_grad():
            dst.copy_(src, non_blocking=True)
        for t in (dst, src):
            if t.is_cuda:
                t.record_stream(stream)  # the allocator keeps it until that stream is done with it

    def on(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)


class FakeEvent:
    """A :class:`FakeOps` event: ``done`` is set when it happens."""

    def __init__(self) -> None:
        self.done: Any = threading.Event()

    def on_record(self) -> None:
        """Called as it is recorded (an interprocess one counts its records)."""

    def on_stream_wait(self) -> None:
        """Called when a stream is made to wait for it (a peer's interprocess one blocks: the fake
        runs a stream's work at once, so the wait happens where it is queued)."""


class FakeOps:
    """:class:`DeviceOps` on CPU tensors, for tests; ``calls`` lists ``(call, thread name)``.

    While :meth:`hold` is on, copies and unpacks are deferred, in order (their destinations hold
    NaN meanwhile), and recorded events stay not ready until :meth:`fire`; packs and torch
    operations under :meth:`on` run at once.  ``pinned_allocations`` counts buffers;
    ``count(call, buffer=flat)`` counts the packs and unpacks (batched or in parts) of one
    bucket's flat buffer, and the copies into or out of it."""

    def __init__(self, ipc: bool = False) -> None:
        self.ipc = ipc  # whether ranks may share its buffers and events (device_ipc_ops.FakeIpc)
        self.calls: list[tuple[str, str]] = []
        self._storages: list[tuple[int, ...]] = []  # per call: the storages it wrote or read in bulk
        self.pinned_allocations = 0
        self._held = False
        self._deferred: list[Callable[[], None]] = []
        self._events: list[FakeEvent] = []
        self._lock = threading.Lock()

    def _note(self, call: str, *tensors: torch.Tensor) -> None:
        storages = tuple(t.untyped_storage().data_ptr() for t in tensors)
        with self._lock:
            self.calls.append((call, threading.current_thread().name))
            self._storages.append(storages)

    def count(self, call: str, thread: str | None = None, buffer: torch.Tensor | None = None) -> int:
        """How many ``call`` calls were made (on the thread named ``thread``, and touching the
        memory of ``buffer`` as a whole, if given)."""
        key = None if buffer is None else buffer.untyped_storage().data_ptr()
        with self._lock:
            return sum(1 for (c, t), s in zip(self.calls, self._storages)
                       if c == call and (thread is None or t == thread) and (key is None or key in s))

    def hold(self) -> None:
        with self._lock:
            self._held = True

    def fire(self) -> None:
        """Run the deferred copies, then make every event recorded so far ready."""
        with self._lock:
            self._held = False
            deferred, self._deferred = self._deferred, []
            events, self._events = self._events, []
        for run in deferred:
            run()
        for ev in events:
            ev.done.set()

    def side_stream(self, device: torch.device) -> Any:
        return "side"

    def current_stream(self, device: torch.device) -> Any:
        return "current"

    def event(self) -> Any:
        return FakeEvent()

    def record(self, event: Any, stream: Any) -> None:
        self._note("record")
        event.on_record()
        with self._lock:
            if self._held:
                self._events.append(event)
                return
        event.done.set()

    def stream_wait(self, stream: Any, event: Any) -> None:
        self._note("stream_wait")
        event.on_stream_wait()

    def wait_event(self, event: Any) -> None:
        self._note("wait_event")
        event.done.wait()

    def query(self, event: Any) -> bool:
        return event.done.is_set()

    def pinned(self, nbytes: int) -> torch.Tensor:
        self._note("pinned")
        with self._lock:
            self.pinned_allocations += 1
        return torch.empty(nbytes, dtype=torch.uint8)

    def pack(self, flat: torch.Tensor, tensors: Sequence[torch.Tensor], stream: Any) -> None:
        self._note("pack", flat)
        with torch.no_grad():
            torch.cat([t.detach().reshape(-1) for t in tensors], out=flat)

    def unpack(self, flat: torch.Tensor, tensors: Sequence[torch.Tensor], stream: Any) -> None:
        self._note("unpack", flat)
        self._run_or_defer(list(tensors), lambda: torch._foreach_copy_(list(tensors), _views(flat, tensors)))

    def pack_parts(self, parts: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor], stream: Any) -> None:
        self._note("pack", *parts[:1])
        with torch.no_grad():
            torch._foreach_copy_(list(parts), [t.detach() for t in tensors])

    def unpack_parts(self, parts: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor], stream: Any) -> None:
        self._note("unpack", *parts[:1])
        self._run_or_defer(list(tensors), lambda: torch._foreach_copy_(list(tensors), list(parts)))

    def _run_or_defer(self, dsts: list[torch.Tensor], run: Callable[[], Any]) -> None:
        """``run()`` now, or (held) at :meth:`fire`, after the copies queued before it, with the
        destinations NaN meanwhile: the way back reads the host-to-device copy's destination."""
        def later() -> None:
            with torch.no_grad():
                run()
        with self._lock:
            if self._held:
                with torch.no_grad():
                    for t in dsts:
                        if t.is_floating_point():
                            t.fill_(float("nan"))
                self._deferred.append(later)
                return
        later()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        self._note("copy", dst, src)

        def run() -> None:
            with torch.no_grad():
                dst.copy_(src)
        with self._lock:
            if self._held:  # read at fire(), as the device reads a copy's source when it runs it
                if dst.is_floating_point() or dst.dtype is torch.uint8:
                    dst.view(torch.uint8).fill_(0xFF)  # all ones: NaN in every float dtype
                self._deferred.append(run)
                return
        run()

    def on(self, stream: Any) -> Any:
        self._note("on")  # a switch of the current stream: it costs host time on a GPU
        return _null()


@contextmanager
def _null() -> Iterator[None]:
    yield


_cuda_ops: CudaOps | None = None
_override: DeviceOps | None = None


def cuda_ops() -> CudaOps:
    """The process's :class:`CudaOps` (its side streams are shared by every caller)."""
    global _cuda_ops
    if _cuda_ops is None:
        _cuda_ops = CudaOps()
    return _cuda_ops


def ops_for(t: torch.Tensor) -> DeviceOps | None:
    """The device operations for ``t``: CUDA's for a CUDA tensor, the :func:`override` if one is
    in force (for every tensor), else None (a host tensor: no staging needed)."""
    if _override is not None:
        return _override
    return cuda_ops() if t.is_cuda else None


@contextmanager
def override(ops: DeviceOps | None) -> Iterator[DeviceOps | None]:
    """Within the block, objects created treat every tensor as a device tensor served by ``ops``."""
    global _override
    previous, _override = _override, ops
    try:
        yield ops
    finally:
        _override = previous


        _forget(ops)


#: :meth:`DeviceService.mark`'s default: the service's side stream (None is the current one).
SIDE: Any = object()


def _size_class(nbytes: int) -> int:
    """Smallest power of two >= nbytes (at least 4 KiB): pooled buffers are shared within a class."""
    return max(4096, 1 << max(0, (nbytes - 1)).bit_length())


class PinnedPool:
    """A device's page-locked host buffers, allocated through its :class:`DeviceOps`.

    ``acquire(n)`` returns a uint8 buffer of at least ``n`` bytes, one per power-of-two size
    class, reused; ``release(buf, event)`` gives it back, usable again once ``event`` (recorded
    after the last copy that reads or writes it) has happened.  ``allocate(n)`` is a buffer of
    exactly ``n`` bytes that its owner keeps (a bucket's, for the optimizer's life).
    ``allocations`` counts both kinds."""

    def __init__(self, ops: DeviceOps) -> None:
        self._ops = ops
        self._lock = threading.Lock()
        self._free: dict[int, list[torch.Tensor]] = {}
        self._in_flight: list[tuple[Any, torch.Tensor]] = []
        self.allocations = 0

    def _reclaim(self) -> None:
        still: list[tuple[Any, torch.Tensor]] = []
        for event, buf in self._in_flight:
            if event is None or self._ops.query(event):
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
        return self._ops.pinned(cls)

    def allocate(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            self.allocations += 1
        return self._ops.pinned(nbytes)

    def release(self, buf: torch.Tensor, event: Any = None) -> None:
        with self._lock:
            self._in_flight.append((event, buf))

    def clear(self) -> None:
        """Drop every cached buffer; in-flight ones are dropped once done."""
        with self._lock:
            self._reclaim()
            self._free.clear()


class DeviceService:
    """Everything one device's CUDA work goes through: its side stream, its :class:`PinnedPool`,
    and the process's :data:`~.device_threads.stager` and :data:`~.device_threads.returns`.

    Optimizer buckets, the per-tensor collectives and the ``"ringcomm"`` backend stage through
    the same service (:func:`service_for`), so a device has one side stream and one pool.  Every
    method only queues device work, except none: the waits are the stager's."""

    def __init__(self, ops: DeviceOps, device: torch.device) -> None:
        self.ops = ops
        self.device = device
        self.pool = PinnedPool(ops)
        self._side: Any = None

    def __repr__(self) -> str:
        return f"<DeviceService {self.device} via {type(self.ops).__name__}>"

    @property
    def side(self) -> Any:
        """The side stream every staging copy of this device runs on."""
        if self._side is None:
            self._side = self.ops.side_stream(self.device)
        return self._side

    def current(self) -> Any:
        """The calling thread's current stream on this device."""
        return self.ops.current_stream(self.device)

    def after(self, stream: Any) -> Any:
        """The side stream, made to wait for what ``stream`` has queued so far; returns it."""
        produced = self.ops.event()
        self.ops.record(produced, stream)
        self.ops.stream_wait(self.side, produced)
        return self.side

    def mark(self, stream: Any = SIDE) -> Any:
        """An event recorded now on ``stream`` (default: the side stream; None: the calling
        thread's current one)."""
        event = self.ops.event()
        self.ops.record(event, self.side if stream is SIDE else stream)
        return event

    def to_device(self, target: torch.Tensor, host: torch.Tensor, *, pinned: bool, consumer: Any = None) -> Any:
        """Queue ``target`` = ``host`` on ``consumer`` (default: the current stream), in its order:
        its later work sees the result, and nothing of its earlier work is overtaken; returns the
        event recorded after the copy there.  A ``host`` that is not a pinned buffer is first
        copied into one from the pool (a copy from pageable memory would make the host wait)."""
        buf = None
        if not pinned:
            nbytes = host.numel() * host.element_size()
            buf = self.pool.acquire(nbytes)
            staged = buf[:nbytes].view(host.dtype).view(host.shape)
            with torch.no_grad():
                staged.copy_(host)
            host = staged
        self.ops.copy(target, host, consumer)
        back = self.mark(consumer)
        if buf is not None:
            self.pool.release(buf, back)
        return back

    def release(self, buf: torch.Tensor, after: Any = None) -> None:
        """Give a pooled buffer back once ``after`` (the event of its last copy) has happened;
        None: once the copies queued so far on the side stream are done."""
        self.pool.release(buf, self.mark() if after is None else after)

    def start(self, ready: Any, start: Callable[[], Any], name: str | None) -> Staging:
        """``start()`` (the core op) on the stager once ``ready`` (an event or a list) happened."""
        return stager.submit(self.ops, ready, start, name)

    def then(self, op: Any, then: Callable[[Any], Any], name: str | None) -> Returning:
        """``then(op.wait())`` on a return thread; returns at once."""
        return returns.submit(op, then, name)


_services: dict[tuple[int, str], DeviceService] = {}
_known: dict[tuple[int, torch.device], DeviceService] = {}  # by the device as tensors name it
_services_lock = threading.Lock()


def _device_key(device: torch.device) -> str:
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


def service(ops: DeviceOps, device: torch.device) -> DeviceService:
    """The one :class:`DeviceService` of ``device`` served by ``ops``."""
    svc = _known.get((id(ops), device))  # every op asks: a dict read, without the lock
    if svc is not None:
        return svc
    key = (id(ops), _device_key(device))
    with _services_lock:
        svc = _services.get(key)
        if svc is None:
            svc = _services[key] = DeviceService(ops, torch.device(key[1]))
        if device.type != "cuda" or device.index is not None:  # "cuda" alone: whichever is current
            _known[(id(ops), device)] = svc
        return svc


def service_for(t: torch.Tensor) -> DeviceService | None:
    """The service that stages ``t``: its CUDA device's, every tensor's under an :func:`override`,
    else None (a host tensor: nothing to stage)."""
    ops = ops_for(t)
    return None if ops is None else service(ops, t.device)


def _forget(ops: DeviceOps | None) -> None:
    """Drop the services of an override's ``ops`` (objects made meanwhile keep theirs)."""
    if ops is None or ops is _cuda_ops:
        return
    with _services_lock:
        for key in [k for k in _services if k[0] == id(ops)]:
            del _services[key]
        for known in [k for k in _known if k[0] == id(ops)]:
            del _known[known]
