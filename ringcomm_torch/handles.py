"""Handles returned by the ``*_async`` collectives, and ``poll`` / ``synchronize``.

A :class:`Handle` wraps the core's handle plus what turns the core's NumPy
result into the torch result (copy back to the device, cast bfloat16 back,
release pinned staging buffers).  That finishing step runs once, on the thread
that calls :func:`synchronize`.  For a single tensor it queues the CUDA copies
on that thread's current stream; for the optimizer's gradient buckets the
copies home were already queued as each reduction finished (on a completer
thread), and the step only makes the current stream wait for them.

What each rank sees (size 2)::

    h = hvd.allreduce_async_(t)      # returns at once; t must not be touched yet
    hvd.poll(h)                      # False while in flight, True once done
    hvd.synchronize(h) is t          # True: the in-place result is the same tensor
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ringcomm.errors import InvalidTypeError

from .tensors import claim_pending_copies, copies_belong_to, has_pending_copies
from .tracing import untraced

__all__ = ["Handle", "poll", "synchronize", "completed"]

_UNSET = object()


class Handle:
    """An op in flight.  Pass it to :func:`poll` or :func:`synchronize`."""

    __slots__ = ("kind", "name", "_core", "_finish", "_cleanup", "_result", "_error", "_lock")

    def __init__(self, kind: str, name: str | None, core: Any, finish: Callable[[Any], Any],
                 cleanup: Callable[[], None] | None = None, nbytes: int = 0) -> None:
        self.kind = kind
        self.name = name
        self._core = core
        self._finish = finish
        self._cleanup = cleanup
        self._result: Any = _UNSET
        self._error: BaseException | None = None
        self._lock = threading.Lock()  # held by wait() while it blocks
        if has_pending_copies():  # CUDA staging copies made for this op (timeline)
            claim_pending_copies(self.core_name)

    @property
    def core_name(self) -> str | None:
        """The name the core negotiated this op under (the timeline's row), if known."""
        core = self._core
        name = getattr(core, "name", None)
        if name is None and getattr(core, "handles", None):
            name = core.handles[0].name
        return name

    def done(self) -> bool:
        """True once the op has finished (``synchronize`` will not block)."""
        if self._result is not _UNSET or self._error is not None:
            return True
        core = self._core
        return core is None or bool(core.done())

    def wait(self) -> Any:
        """Block until done; return the torch result (or raise the op's error, on every call)."""
        with self._lock:
            if self._result is not _UNSET:
                return self._result
            if self._error is not None:
                raise self._error
            try:
                raw = None if self._core is None else self._core.wait()
                with copies_belong_to(self.core_name):
                    self._result = self._finish(raw)
            except BaseException as exc:
                self._error = exc
                raise
            finally:
                if self._cleanup is not None:
                    cleanup, self._cleanup = self._cleanup, None
                    cleanup()
                self._core = None
                self._finish = _drop
            return self._result

    def __repr__(self) -> str:
        state = "done" if self._result is not _UNSET else ("failed" if self._error else "in flight")
        return f"<ringcomm_torch.Handle {self.kind} {self.name!r} {state}>"


def _drop(raw: Any) -> Any:
    return None


def completed(kind: str, result: Any) -> Handle:
    """A handle that is already done (e.g. a grouped op over an empty list)."""
    return Handle(kind, None, None, lambda _raw: result)


def _check(handle: Any, what: str) -> Handle:
    if not isinstance(handle, Handle):
        raise InvalidTypeError(
            f"{what}: expected a handle returned by an *_async collective, got {type(handle).__name__}"
        )
    return handle


@untraced
def poll(handle: Handle) -> bool:
    """True if the op behind ``handle`` has finished, so :func:`synchronize` returns at once."""
    return _check(handle, "poll").done()


@untraced
def synchronize(handle: Handle) -> Any:
    """Wait for ``handle``'s op and return its result.

    In-place ops (``allreduce_async_``, ``broadcast_async_``...) return the very
    tensor that was passed in, now holding the result.  ``alltoall_async``
    returns ``(output, received_splits)``.  Errors raised by the op (for
    example :class:`~ringcomm.errors.MismatchError`, a ``HorovodInternalError``)
    are raised here.
    """
    return _check(handle, "synchronize").wait()
