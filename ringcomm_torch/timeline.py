"""Chrome-trace timeline of the ops submitted through ``ringcomm_torch``.

``start_timeline(path)`` / ``stop_timeline()`` delegate to the core's timeline
when ``ringcomm`` provides one (it sees negotiation and ring phases).  Otherwise
this module records, per rank, one complete event per op: it begins when the op
is submitted and ends when this process first sees it finished (``poll`` or
``synchronize``), and writes a Chrome-trace JSON file that
``chrome://tracing`` and https://ui.perfetto.dev open.

What each rank writes (its own file; put ``{rank}`` in the path to keep them apart)::

    hvd.start_timeline("/tmp/tl-{rank}.json")
    hvd.allreduce(torch.ones(4), name="x")
    hvd.stop_timeline()
    # /tmp/tl-0.json: {"traceEvents": [..., {"name": "allreduce.x", "ph": "X", "ts": ..., "dur": ...}]}
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from typing import Any

import ringcomm as _rc
from ringcomm.errors import InvalidInputError

__all__ = ["start_timeline", "stop_timeline", "start_from_settings", "Timeline", "active", "op_started",
           "op_finished"]

_KIND_TID = {"allreduce": 1, "allgather": 2, "broadcast": 3, "alltoall": 4, "reducescatter": 5,
             "barrier": 6, "join": 7}


class Timeline:
    """Collects op spans in memory and writes them as Chrome-trace JSON on :meth:`close`."""

    def __init__(self, path: str, rank: int, mark_cycles: bool = False) -> None:
        self.path = path
        self.rank = rank
        self.mark_cycles = mark_cycles
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self._events: list[dict[str, Any]] = []
        self._in_flight = 0

    def _now_us(self) -> float:
        return (time.perf_counter() - self._t0) * 1e6

    def op_started(self, kind: str, name: str, nbytes: int) -> tuple[str, str, float, int]:
        """Note that ``name`` was submitted; returns the token :meth:`op_finished` takes."""
        ts = self._now_us()
        with self._lock:
            if self.mark_cycles and self._in_flight == 0:
                self._events.append({"name": "CYCLE_START", "ph": "i", "s": "p", "ts": ts,
                                     "pid": self.rank, "tid": 0})
            self._in_flight += 1
        return kind, name, ts, nbytes

    def op_finished(self, token: tuple[str, str, float, int], error: str | None = None) -> None:
        kind, name, ts, nbytes = token
        end = self._now_us()
        args: dict[str, Any] = {"bytes": nbytes}
        if error:
            args["error"] = error
        with self._lock:
            self._in_flight = max(0, self._in_flight - 1)
            self._events.append({"name": name, "cat": kind, "ph": "X", "ts": ts, "dur": max(end - ts, 0.0),
                                 "pid": self.rank, "tid": _KIND_TID.get(kind, 9), "args": args})

    def close(self) -> str:
        """Write the trace; returns the path written."""
        with self._lock:
            events = list(self._events)
        meta: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": self.rank,
                                       "args": {"name": f"rank {self.rank}"}}]
        for kind, tid in _KIND_TID.items():
            meta.append({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid, "args": {"name": kind}})
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"traceEvents": meta + events, "displayTimeUnit": "ms"}, f)
        os.replace(tmp, self.path)
        return self.path


_active: Timeline | None = None
_core_active = False


def active() -> Timeline | None:
    """The recorder in use by this module, or None (not started, or the core records instead)."""
    return _active


def op_started(kind: str, name: str, nbytes: int) -> Any:
    tl = _active
    return None if tl is None else (tl, tl.op_started(kind, name, nbytes))


def op_finished(token: Any, error: str | None = None) -> None:
    if token is not None:
        tl, tok = token
        tl.op_finished(tok, error)


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start recording to ``file_path`` (``{rank}`` in it is replaced by this rank)."""
    global _active, _core_active
    if not file_path:
        raise InvalidInputError("start_timeline: file_path must be a non-empty path")
    if _active is not None or _core_active:
        raise InvalidInputError("start_timeline: a timeline is already being recorded; call stop_timeline() first")
    rank = _rc.rank()
    path = file_path.replace("{rank}", str(rank))
    core_start = getattr(_rc, "start_timeline", None)
    if callable(core_start):
        try:
            core_start(path, mark_cycles=mark_cycles)
        except TypeError:  # a core timeline without cycle marks
            core_start(path)
        _core_active = True
        return
    _active = Timeline(path, rank, mark_cycles)


def stop_timeline() -> None:
    """Stop recording and write the file.  A no-op when no timeline is running."""
    global _active, _core_active
    if _core_active:
        _core_active = False
        _rc.stop_timeline()
        return
    tl, _active = _active, None
    if tl is not None:
        tl.close()


_atexit_registered = False


def start_from_settings() -> None:
    """Honour ``RINGCOMM_TIMELINE`` (``ringcomm-run --timeline-filename``) when the core does not record one.

    As with Horovod's ``HOROVOD_TIMELINE``, rank 0 writes the file; put ``{rank}``
    in the path to get one file per rank.  The file is written at shutdown or exit.
    """
    global _atexit_registered
    if callable(getattr(_rc, "start_timeline", None)) or _active is not None or _core_active:
        return
    from ringcomm.config import Settings

    path = Settings.from_env().timeline
    if not path or ("{rank}" not in path and _rc.rank() != 0):
        return
    start_timeline(path)
    if not _atexit_registered:
        atexit.register(stop_timeline)
        _atexit_registered = True
