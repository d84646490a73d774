"""The two kinds of thread that move device work along, shared by every device of the process.

* :class:`Stager` (one thread, ``ringcomm-torch-stager``): waits for each staged buffer's
  *ready* event with the GIL released, then starts the op's core collective, in submission
  order.  A blocking collective (``hvd.allreduce``, not ``allreduce_async``: its caller waits
  for the op at once) does that on its own thread, with no other thread between it and its
  op, when the stager has nothing queued or in hand (:class:`waiting_caller`); otherwise its op
  queues behind the others.  Apart from those, and the return threads with
  ``RINGCOMM_DEVICE_IPC_WAIT=host``, the stager is the only thread of the CUDA path that waits
  for the device.
* :class:`ReturnPool` (at most :data:`RETURN_THREADS` threads, ``ringcomm-torch-device-return``):
  waits for an op's core collective and then runs its ``then(result)``, which queues the device
  work that brings the results home.  An idle thread takes the first job whose op is done, else
  the oldest, so a late op holds back at most one thread while the others carry finished ones.

Neither is the ``"ringcomm"`` backend's :class:`~ringcomm_torch.distributed.work.Completer`,
which completes torch futures.  Both start on first use and again in a forked child::

    staging = stager.submit(ops, ready, start_op, name)     # returns at once
    back = returns.submit(staging, copy_home, name)         # returns at once
    back.wait()                                              # what copy_home returned
"""

from __future__ import annotations

import collections
import functools
import os
import threading
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

__all__ = ["waiting_caller", "caller_waits", "Staging", "Stager", "stager", "Returning", "ReturnPool", "returns",
           "RETURN_THREADS", "STAGER_THREAD", "RETURN_THREAD"]

#: The most threads that wait for ops on their way home (per process).
RETURN_THREADS = 4
STAGER_THREAD = "ringcomm-torch-stager"
RETURN_THREAD = "ringcomm-torch-device-return"

_P = ParamSpec("_P")
_R = TypeVar("_R")
_caller = threading.local()  # .waits: this thread is in a blocking collective


class waiting_caller:  # lower case: used as a function, like contextlib's managers
    """Within the block, this thread is in a blocking collective: its caller waits for the ops it
    submits, so a staged op of its starts on this thread (:meth:`Stager.submit`) rather than the
    stager's, sparing two handoffs between threads."""

    __slots__ = ("_outer",)

    def __enter__(self) -> None:
        self._outer = getattr(_caller, "waits", False)
        _caller.waits = True

    def __exit__(self, *exc: object) -> None:
        _caller.waits = self._outer


def caller_is_waiting() -> bool:
    """Whether this thread is in a blocking collective (:class:`waiting_caller`)."""
    return getattr(_caller, "waits", False)


def caller_waits(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """``fn``, a blocking collective, run as a :class:`waiting_caller`."""
    @functools.wraps(fn)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with waiting_caller():
            return fn(*args, **kwargs)
    return run


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
    its core op, in submission order; the submitting thread never waits, unless it is in a
    blocking collective (:class:`waiting_caller`)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._jobs: collections.deque[tuple[Any, Any, Callable[[], Any], Staging]] = collections.deque()
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._busy = False  # a job is being started (by the thread or a blocking caller): the next one waits
        self.started = 0  # jobs started so far, on the thread or by a blocking caller

    def submit(self, ops: Any, ready: Any, start: Callable[[], Any], name: str | None) -> Staging:
        """``start()`` (which returns the core handle) runs once ``ready`` (an event, or a list of
        them, of ``ops``) happened: on the stager, or, in a blocking collective with nothing queued
        before it, here, before this returns (so ops still start in submission order)."""
        staging = Staging(name)
        here = caller_is_waiting()
        with self._cond:
            if self._pid != os.getpid():  # a forked child has none of its parent's jobs or thread
                self._pid, self._thread, self._busy = os.getpid(), None, False
                self._jobs.clear()
            if here and not self._jobs and not self._busy:
                self._busy = True
            else:
                here = False
                if self._thread is None or not self._thread.is_alive():
                    self._thread = threading.Thread(target=self._run, name=STAGER_THREAD, daemon=True)
                    self._thread.start()
                self._jobs.append((ops, ready, start, staging))
                self._cond.notify()
        if here:
            self._start(ops, ready, start, staging)
        return staging

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs or self._busy:
                    self._cond.wait()
                ops, ready, start, staging = self._jobs.popleft()
                self._busy = True
            self._start(ops, ready, start, staging)

    def _start(self, ops: Any, ready: Any, start: Callable[[], Any], staging: Staging) -> None:
        """Wait for ``ready``, start the op, then let the next job go."""
        try:
            for event in ready if isinstance(ready, list) else [ready]:
                ops.wait_event(event)
            staging._core = start()
        except BaseException as exc:  # raised again by wait(), on the caller's thread
            staging._error = exc
        with self._cond:
            self._busy = False
            self.started += 1
            if self._jobs:
                self._cond.notify()
        staging._started.set()


class Returning:
    """One op's way back: ``done()``/``wait()`` as a core handle's; ``wait()`` returns what the
    pool's ``then`` returned (or raises the op's error, or ``then``'s)."""

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


class ReturnPool:
    """At most ``limit`` daemon threads that each wait for an op (its ``wait()``, GIL released)
    and then run its ``then(result)`` there (see the module docstring)."""

    def __init__(self, limit: int = RETURN_THREADS) -> None:
        self.limit = max(1, int(limit))
        self._cond = threading.Condition()
        self._jobs: collections.deque[tuple[Any, Callable[[Any], Any], Returning]] = collections.deque()
        self._threads = 0
        self._idle = 0
        self._pid = 0

    @property
    def threads(self) -> int:
        """How many threads this pool has started in this process (never above ``limit``)."""
        return self._threads

    def submit(self, op: Any, then: Callable[[Any], Any], name: str | None) -> Returning:
        """``then(op.wait())`` runs on a pool thread; returns at once."""
        returning = Returning(name)
        with self._cond:
            if self._pid != os.getpid():  # a forked child has none of its parent's threads
                self._pid, self._threads, self._idle = os.getpid(), 0, 0
                self._jobs.clear()
            self._jobs.append((op, then, returning))
            if self._idle < len(self._jobs) and self._threads < self.limit:
                self._threads += 1
                threading.Thread(target=self._run, name=RETURN_THREAD, daemon=True).start()
            else:
                self._cond.notify()
        return returning

    def _take(self) -> tuple[Any, Callable[[Any], Any], Returning]:
        """The first job whose op is done (no wait), else the oldest; under the condition."""
        for i, job in enumerate(self._jobs):
            if job[0].done():
                del self._jobs[i]
                return job
        return self._jobs.popleft()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._idle += 1
                while not self._jobs:
                    self._cond.wait()
                self._idle -= 1
                op, then, returning = self._take()
            try:
                returning._result = then(op.wait())
            except BaseException as exc:  # raised again by wait(), on the caller's thread
                returning._error = exc
            returning._done.set()


stager = Stager()
returns = ReturnPool()
