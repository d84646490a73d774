"""The device operations ringcomm_torch uses (streams, events, copies, pinned buffers), behind one
small interface, and the thread that hands staged device data to the core once it is ready.

:class:`CudaOps` is the real one.  :class:`FakeOps` runs the same calls on CPU tensors for tests:
it records every call with the thread that made it, and while :meth:`FakeOps.hold` is on it
leaves recorded events *not ready* and fills the destinations of the copies with NaN until
:meth:`FakeOps.fire` runs them, so a reader that does not wait for the event reads poison.

Nothing here blocks the calling thread except :meth:`DeviceOps.wait_event`, which only the
:class:`Stager` thread calls (and ``synchronize()``/``wait()`` through it).  The
:class:`Completer`'s threads wait for core ops and then queue the device work that brings their
results back, so the thread in ``synchronize()`` only makes its stream wait for an event::

    ops.record(ready, ops.side_stream(dev))   # autograd thread: queue the copy, record its event
    staging = stager.submit(ops, ready, start_op)   # returns at once
    # stager thread: ops.wait_event(ready) (GIL released), then start_op() hands the buffer to the core
    back = completer.submit(staging, copy_back)     # returns at once
    # a completer thread: staging.wait(), then copy_back(result) queues the copy home, records an event
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch

__all__ = ["DeviceOps", "CudaOps", "FakeOps", "cuda_ops", "staging_ops", "ops_for", "override", "Stager", "Staging",
           "stager", "Completer", "Returning", "completer"]


class DeviceOps(Protocol):
    """What the CUDA path asks of a device; every call but :meth:`wait_event` only queues work."""

    def side_stream(self, device: torch.device) -> Any: ...
    def current_stream(self, device: torch.device) -> Any: ...
    def event(self) -> Any: ...
    def record(self, event: Any, stream: Any) -> None: ...
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
        """``dst`` = ``src`` on ``stream``, without the host waiting (pinned <-> device)."""
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
        with torch.cuda.stream(stream), torch.no_grad():
            dst.copy_(src, non_blocking=True)

    def on(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)


class _FakeEvent:
    def __init__(self) -> None:
        self.done = threading.Event()


class FakeOps:
    """:class:`DeviceOps` on CPU tensors, for tests; ``calls`` lists ``(call, thread name)``.

    While :meth:`hold` is on, copies and unpacks are deferred, in order (their destinations hold
    NaN meanwhile), and recorded events stay not ready until :meth:`fire`; packs and torch
    operations under :meth:`on` run at once.  ``pinned_allocations`` counts buffers;
    ``count(call, buffer=flat)`` counts the packs and unpacks (batched or in parts) of one
    bucket's flat buffer, and the copies into or out of it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self._storages: list[tuple[int, ...]] = []  # per call: the storages it wrote or read in bulk
        self.pinned_allocations = 0
        self._held = False
        self._deferred: list[Callable[[], None]] = []
        self._events: list[_FakeEvent] = []
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
        return _FakeEvent()

    def record(self, event: Any, stream: Any) -> None:
        self._note("record")
        with self._lock:
            if self._held:
                self._events.append(event)
                return
        event.done.set()

    def stream_wait(self, stream: Any, event: Any) -> None:
        self._note("stream_wait")

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
        snapshot = src.detach().clone()

        def run() -> None:
            with torch.no_grad():
                dst.copy_(snapshot)
        with self._lock:
            if self._held:
                if dst.is_floating_point() or dst.dtype is torch.uint8:
                    dst.view(torch.uint8).fill_(0xFF)  # all ones: NaN in every float dtype
                self._deferred.append(run)
                return
        run()

    def on(self, stream: Any) -> Any:
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


def staging_ops() -> DeviceOps:
    """What stages CUDA tensors for the collectives: the :func:`override` if one is in force."""
    return _override if _override is not None else cuda_ops()


def ops_for(t: torch.Tensor) -> DeviceOps | None:
    """The device operations for ``t``: CUDA's for a CUDA tensor, the :func:`override` if one is
    in force (for every tensor), else None (a host tensor: no staging needed)."""
    if _override is not None:
        return _override
    return cuda_ops() if t.device.type == "cuda" else None


@contextmanager
def override(ops: DeviceOps | None) -> Iterator[DeviceOps | None]:
    """Within the block, objects created treat every tensor as a device tensor served by ``ops``."""
    global _override
    previous, _override = _override, ops
    try:
        yield ops
    finally:
        _override = previous


class Staging:
    """One op waiting for its device data: ``done()``/``wait()`` as a core handle's, once started."""

    __slots__ = ("name", "_started", "_core", "_error")

    def __init__(self, name: str | None) -> None:
        self.name = name
        self._started = threading.Event()
        self._core: Any = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._started.is_set() and (self._error is not None or self._core is None or bool(self._core.done()))

    def started(self) -> Any:
        """Wait until the op was handed to the core; returns what ``start()`` returned."""
        self._started.wait()
        if self._error is not None:
            raise self._error
        return self._core

    def wait(self) -> Any:
        core = self.started()
        return None if core is None else core.wait()


class Stager:
    """One daemon thread that waits for each staged buffer's event (GIL released) and then starts
    its core op, in submission order; the submitting thread never waits."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._jobs: collections.deque[tuple[DeviceOps, Any, Callable[[], Any], Staging]] = collections.deque()
        self._thread: threading.Thread | None = None
        self._pid = 0

    def submit(self, ops: DeviceOps, ready: Any, start: Callable[[], Any], name: str | None) -> Staging:
        """``start()`` (which returns the core handle) runs on the stager once ``ready`` (an event,
        or a list of them) happened."""
        import os

        staging = Staging(name)
        with self._cond:
            if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
                self._pid = os.getpid()  # a forked child starts its own thread
                self._jobs.clear()
                self._thread = threading.Thread(target=self._run, name="ringcomm-torch-stager", daemon=True)
                self._thread.start()
            self._jobs.append((ops, ready, start, staging))
            self._cond.notify()
        return staging

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs:
                    self._cond.wait()
                ops, ready, start, staging = self._jobs.popleft()
            try:
                for event in ready if isinstance(ready, list) else [ready]:
                    ops.wait_event(event)
                staging._core = start()
            except BaseException as exc:  # raised again by wait(), on the caller's thread
                staging._error = exc
            staging._started.set()


stager = Stager()


class Returning:
    """One op's way back: ``done()``/``wait()`` as a core handle's; ``wait()`` returns what the
    completer's ``then`` returned (or raises the op's error, or ``then``'s)."""

    __slots__ = ("name", "_done", "_result", "_error")

    def __init__(self, name: str | None) -> None:
        self.name = name
        self._done = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> Any:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._result


class Completer:
    """Daemon threads that each wait for one op (its ``wait()``, GIL released) and then run its
    ``then(result)`` there, which queues the device work that brings the results back.

    A job takes an idle thread, or a new one when none is idle, so an op whose peers are late
    never holds back the way back of another that is done; the threads stay for later jobs."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._jobs: collections.deque[tuple[Any, Callable[[Any], Any], Returning]] = collections.deque()
        self._idle = 0
        self._pid = 0

    def submit(self, op: Any, then: Callable[[Any], Any], name: str | None) -> Returning:
        """``then(op.wait())`` runs on a completer thread; returns at once."""
        import os

        returning = Returning(name)
        with self._cond:
            if self._pid != os.getpid():  # a forked child has none of its parent's threads
                self._pid, self._idle = os.getpid(), 0
                self._jobs.clear()
            self._jobs.append((op, then, returning))
            if self._idle < len(self._jobs):
                threading.Thread(target=self._run, name="ringcomm-torch-completer", daemon=True).start()
            else:
                self._cond.notify()
        return returning

    def _run(self) -> None:
        while True:
            with self._cond:
                self._idle += 1
                while not self._jobs:
                    self._cond.wait()
                self._idle -= 1
                op, then, returning = self._jobs.popleft()
            try:
                returning._result = then(op.wait())
            except BaseException as exc:  # raised again by wait(), on the caller's thread
                returning._error = exc
            returning._done.set()


completer = Completer()
