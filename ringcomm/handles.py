"""Handles: what an async collective returns to the user thread, and the entry the engine keeps for it."""

from __future__ import annotations

import _thread
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from .errors import HorovodInternalError
from .core.wire import Request


@runtime_checkable
class OpHandle(Protocol):
    """What every handle of an op in flight offers, in the core and in the torch layer alike.

    ``done()`` never blocks; ``wait()`` blocks until the op finished, then returns its result or
    raises its error (the same on every call).  The core's :class:`Handle`, :class:`GroupHandle`
    and :class:`MappedHandle`, the lane's handle, the torch layer's handles, its device staging and
    return handles and the "ringcomm" backend's work objects all satisfy it (tests/core/test_handles.py,
    checked by mypy too).
    """

    def done(self) -> bool: ...

    def wait(self) -> Any: ...


class Handle:
    """The future result of one submitted collective.

    ``done()`` never blocks; ``wait()`` blocks until the engine finished the op
    and returns its result or raises its error (the same error on every call).

    Completion is a bare lock, held from creation until the engine finishes the
    op: about a tenth of the cost of a ``threading.Event`` (which builds a
    ``Condition`` per op), and this is paid on every collective.
    """

    __slots__ = ("name", "_pending", "_done", "_result", "_error", "_on_done", "__weakref__")

    def __init__(self, name: str, on_done: Callable[[], None] | None = None) -> None:
        self.name = name
        self._on_done = on_done
        self._pending = _thread.allocate_lock()
        self._pending.acquire()  # released once, by the engine, when the op is finished
        self._done = False
        self._result: Any = None
        self._error: BaseException | None = None

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<ringcomm.Handle {self.name!r} {state}>"

    def done(self) -> bool:
        return self._done

    def wait(self, timeout: float | None = None) -> Any:
        if not self._done:
            if not self._pending.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
                raise TimeoutError(f"op {self.name!r} did not finish within {timeout} s")
            self._pending.release()  # let any other waiter through too
        if self._error is not None:
            raise self._error
        return self._result

    # engine side -----------------------------------------------------------

    def _finish(self) -> None:
        if self._done:  # pragma: no cover - the engine finishes each op once
            return
        # release the name before waking the waiter, so it can be reused at once
        if self._on_done is not None:
            self._on_done()
            self._on_done = None
        self._done = True
        self._pending.release()

    def set_result(self, result: Any) -> None:
        self._result = result
        self._finish()

    def set_error(self, error: BaseException) -> None:
        if not isinstance(error, BaseException):  # pragma: no cover - defensive
            error = HorovodInternalError(str(error))
        self._error = error
        self._finish()


class GroupHandle:
    """Several handles completed as one (``grouped_allgather`` and friends, the torch layer's grouped
    and sparse ops); ``wait()`` returns their results in order.

    It waits for every handle before it raises the first error, so no buffer of the group is still
    in use when the caller sees the error.  ``name`` is None where the group has no name of its own
    (the first handle's name stands for it).
    """

    def __init__(self, name: str | None, handles: Sequence[OpHandle]) -> None:
        self.name = name
        self.handles = list(handles)

    def __repr__(self) -> str:
        return f"<ringcomm.GroupHandle {self.name!r} of {len(self.handles)}>"

    def done(self) -> bool:
        return all(h.done() for h in self.handles)

    def wait(self, timeout: float | None = None) -> list[Any]:
        results: list[Any] = []
        error: BaseException | None = None
        for h in self.handles:
            try:
                results.append(h.wait() if timeout is None else h.wait(timeout))  # type: ignore[call-arg]
            except BaseException as exc:
                error = error or exc
        if error is not None:
            raise error
        return results


class MappedHandle:
    """Another handle's result passed through ``fn`` (once, on the first ``wait``).

    Adasum is an allgather whose rows every rank then reduces the same way: its handle
    is the allgather's, mapped by the reduction.
    """

    def __init__(self, name: str, inner: Handle, fn: Callable[[Any], Any]) -> None:
        self.name = name
        self._inner = inner
        self._fn: Callable[[Any], Any] | None = fn
        self._lock = _thread.allocate_lock()
        self._result: Any = None
        self._error: BaseException | None = None

    def __repr__(self) -> str:
        return f"<ringcomm.MappedHandle {self.name!r} {'done' if self.done() else 'pending'}>"

    def done(self) -> bool:
        return self._inner.done()

    def wait(self, timeout: float | None = None) -> Any:
        raw = self._inner.wait(timeout)
        with self._lock:
            if self._fn is not None:
                fn, self._fn = self._fn, None
                try:
                    self._result = fn(raw)
                except BaseException as exc:
                    self._error = exc
        if self._error is not None:
            raise self._error
        return self._result


@dataclasses.dataclass(slots=True)
class Entry:
    """One op submitted on this rank: its request, its arrays and its handle."""

    req: Request
    arrays: list[np.ndarray]
    handle: Handle
    outs: list[np.ndarray | None] = dataclasses.field(default_factory=list)
    grouped: bool = False
    submitted_at: float = 0.0  # perf_counter when the user thread submitted it
    drained_at: float = 0.0  # ... when the engine thread took it from the queue and asked rank 0
    #: seconds this rank had already waited for the op when the engine got it (the small-op lane's
    #: wait, when the lane handed the op on): rank 0 counts a stall from then
    waited: float = 0.0

    @property
    def key(self) -> tuple[int, str]:
        """Names are unique per process set: ``(set id, name)``."""
        return (self.req.pset, self.req.name)
