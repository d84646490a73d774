"""``Work`` objects of the ``"ringcomm"`` torch.distributed backend, and the thread that completes them.

A collective on the backend submits its arrays to the ringcomm core and returns at once
with a :class:`RingcommWork`.  Its ``torch.futures.Future`` completes when the core's
handles do: one daemon thread per process (:class:`Completer`) waits on the handles in
submission order, copies results into the caller's tensors (only where the core could not
write into them directly), then sets the future's result, so DDP's bucket allreduces run
while backward goes on and its ``then()`` callbacks see finished tensors.

A failed op (a lost rank, a refused argument on another rank) completes the future with
``torch.distributed.DistBackendError`` whose message carries ringcomm's error (which names
the rank that was lost).
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..device import Staging
from ..device_threads import waiting_caller

__all__ = ["RingcommWork", "Completer", "completer", "as_backend_error", "completed_work", "sync_calls_wait"]

Finish = Callable[[list[Any]], Any]
_local = threading.local()  # .completing: this thread completes futures (and so runs their callbacks)


def as_backend_error(what: str, exc: BaseException) -> BaseException:
    """``exc`` as torch's ``DistBackendError`` (kept as is when it already is one)."""
    if isinstance(exc, dist.DistBackendError):
        return exc
    err = dist.DistBackendError(f"ringcomm backend: {what} failed: {type(exc).__name__}: {exc}")
    err.__cause__ = exc
    return err


class RingcommWork(dist._Work):
    """One collective in flight: ``wait()`` blocks until it finished, ``get_future()`` completes with it."""

    def __init__(self, what: str, future: torch.futures.Future, source: torch.futures.Future | None = None) -> None:
        super().__init__()
        self.what = what
        self._future = future
        self._source = source  # what the completer set: the op's own error where it failed

    def wait(self, timeout: Any = None) -> bool:
        try:
            self._future.wait()
        except dist.DistBackendError:
            raise
        except Exception as exc:  # torch re-wraps the error its callback raised: raise the op's own
            failed = self._source.value() if self._source is not None and self._source.done() else None
            if isinstance(failed, _Failed):
                raise failed.error from None
            raise as_backend_error(self.what, exc) from exc
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def is_completed(self) -> bool:
        return bool(self._future.done())

    def done(self) -> bool:
        """:meth:`is_completed` under the name every ringcomm handle answers to
        (:class:`ringcomm.handles.OpHandle`)."""
        return self.is_completed()

    def is_success(self) -> bool:
        if not self._future.done():
            return False
        try:
            self._future.value()
        except Exception:
            return False
        return True

    def result(self) -> Any:
        self.wait()
        return self._future.value()

    def __repr__(self) -> str:
        return f"<RingcommWork {self.what} {'done' if self.is_completed() else 'pending'}>"


class _Failed:
    """What a failed op's source future holds; :func:`_unwrap` raises it into the user-facing future."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _unwrap(src: torch.futures.Future) -> Any:
    value = src.value()
    if isinstance(value, _Failed):
        raise value.error
    return value


class Completer:
    """Waits on the core's handles in submission order and completes each op's future.

    ``submit(what, handles, finish)``: ``finish(results)`` (the handles' results, in order)
    turns them into the future's value; it runs on this thread once every handle is done.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[str, Any, Finish, torch.futures.Future]] = collections.deque()
        self._thread: threading.Thread | None = None

    def submit(self, what: str, handles: list[Any] | Staging, finish: Finish) -> RingcommWork:
        # C++ consumers (DDP's reducer) read a future's value as tensors: an error must be the future's error
        # state, which only then() gives (a Python set_exception would hand them the exception object)
        src: torch.futures.Future = torch.futures.Future()
        fut = src.then(_unwrap)
        if getattr(_local, "completing", False):
            # submitted by a future's callback on a completing thread (PowerSGD's hooks chain collectives and
            # wait for them inside callbacks): that thread may block until this op completes, so it gets its own
            threading.Thread(target=self._complete, args=(what, handles, finish, src), daemon=True,
                             name="ringcomm-torch-completer-nested").start()
            return RingcommWork(what, fut, src)
        with self._cond:
            self._queue.append((what, handles, finish, src))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="ringcomm-torch-completer", daemon=True)
                self._thread.start()
            self._cond.notify()
        return RingcommWork(what, fut, src)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                what, handles, finish, fut = self._queue.popleft()
            self._complete(what, handles, finish, fut)

    @staticmethod
    def _complete(what: str, handles: list[Any] | Staging, finish: Finish, fut: torch.futures.Future) -> None:
        _local.completing = True  # callbacks run on this thread when the future completes
        results: list[Any] = []
        error: BaseException | None = None
        started: list[Any] = []
        if isinstance(handles, Staging):  # CUDA: submitted by the stager once the copies were done
            try:
                started = handles.started()
            except BaseException as exc:
                error = exc
        else:
            started = handles
        for h in started:  # wait for every handle, so no buffer is still in use when the op fails
            try:
                results.append(h.wait())
            except BaseException as exc:
                error = error or exc
        value: Any = None
        if error is None:
            try:
                value = finish(results)
            except BaseException as exc:
                error = exc
        fut.set_result(_Failed(as_backend_error(what, error)) if error is not None else value)


completer = Completer()


def completed_work(what: str, value: Any) -> RingcommWork:
    """A work that is already done (ops with nothing to send, e.g. a size-1 group)."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return RingcommWork(what, fut)


def sync_calls_wait(cls: type, names: Sequence[str]) -> None:
    """Make each of ``cls``'s methods ``names`` a blocking collective
    (:class:`~ringcomm_torch.device_threads.waiting_caller`) when torch calls it for a synchronous
    op: its options say ``asyncOp=False``, and torch waits for the work at once.  A device tensor's
    op then waits for its copy to the host and starts on the calling thread, as ``hvd.allreduce``
    does; DDP's buckets and every ``async_op=True`` call keep the stager."""
    for name in names:
        setattr(cls, name, _waits_when_sync(getattr(cls, name)))


def _waits_when_sync(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        if any(getattr(a, "asyncOp", True) is False for a in (*args, *kwargs.values())):
            with waiting_caller():
                return fn(self, *args, **kwargs)
        return fn(self, *args, **kwargs)
    return run
