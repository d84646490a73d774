"""Chrome-trace timeline (chrome://tracing, https://ui.perfetto.dev) of what each op spent its time on.

Like Horovod's, written by rank 0, one row ("process") per tensor name.  The
phases of one op, back to back:

- ``QUEUE``: from the user thread's submit until the engine thread took it and
  sent its request to rank 0,
- ``NEGOTIATE_<KIND>`` (Horovod's names: ``NEGOTIATE_ALLREDUCE``,
  ``NEGOTIATE_ALLGATHER``, ...; the op's kind, whatever its name): until
  rank 0's response arrived (waiting for the other ranks to submit it, and the round trip),
- allreduce: ``MEMCPY_IN_FUSION_BUFFER`` (several tensors fused; a single
  tensor is reduced where it lies), ``RING_REDUCE_SCATTER`` (until this rank's
  own chunk is fully reduced), ``RING_ALLGATHER``, ``MEMCPY_OUT_FUSION_BUFFER``;
  or ``RANK0_REDUCE`` when rank 0 reduced a small one from the payloads sent
  with the requests; ``RING`` in a one-rank job,
- ``RANK0_GATHER``: a small allgather that rank 0 concatenated from the parts
  sent with the requests,
- ``<KIND>`` (other collectives): the data movement,
- ``MEMCPY_D2H`` / ``MEMCPY_H2D`` (``ringcomm_torch``, CUDA tensors): staging
  through pinned host memory, before ``QUEUE`` and after the result arrives,
- ``CYCLE_START`` markers (``mark_cycles=True``) for each batch of responses.

Every event is flushed as it is written, so the file can be read while the job runs.

Written by the engine thread (and framework layers through
:func:`ringcomm.api.timeline_span`); ``close()`` may come from any thread.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, TextIO


_MARKERS = {"CYCLE": "CYCLE_START"}  # the engine's marker names -> Horovod's


def negotiate_phase(kind: str) -> str:
    """Horovod's name of the negotiation of an op of ``kind``: ``NEGOTIATE_ALLREDUCE`` for ``"allreduce"``."""
    return f"NEGOTIATE_{kind.upper()}"


class Timeline:
    def __init__(self, path: str, rank: int, mark_cycles: bool = False) -> None:
        self.path = path
        self.rank = rank
        self.mark_cycles = mark_cycles
        self._lock = threading.Lock()
        self._file: TextIO | None = open(path, "w")
        self._file.write("[\n")
        self._first = True
        self._pids: dict[str, int] = {}
        self._t0 = time.perf_counter()

    def _us(self, t: float) -> float:
        return round((t - self._t0) * 1e6, 1)

    def _write(self, event: dict[str, Any]) -> None:
        f = self._file
        if f is None:
            return
        f.write(("" if self._first else ",\n") + json.dumps(event, separators=(",", ":")))
        f.flush()
        self._first = False

    def _pid(self, tensor: str) -> int:
        pid = self._pids.get(tensor)
        if pid is None:
            pid = self._pids[tensor] = len(self._pids) + 1
            self._write({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": tensor}})
            self._write({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})
        return pid

    def span(self, tensor: str, phase: str, start: float, end: float, args: dict[str, Any] | None = None) -> None:
        """A complete event: ``tensor`` spent ``[start, end]`` (perf_counter seconds) in ``phase``."""
        with self._lock:
            if self._file is None:
                return
            event = {"name": phase, "ph": "X", "pid": self._pid(tensor), "tid": self.rank,
                     "ts": self._us(start), "dur": round(max(0.0, end - start) * 1e6, 1)}
            if args:
                event["args"] = args
            self._write(event)

    def marker(self, name: str, t: float) -> None:
        with self._lock:
            if self._file is not None:
                self._write({"name": _MARKERS.get(name, name), "ph": "i", "s": "g", "pid": 0, "tid": self.rank, "ts": self._us(t)})

    def close(self) -> None:
        with self._lock:
            f, self._file = self._file, None
            if f is not None:
                f.write("\n]\n")
                f.flush()
                os.fsync(f.fileno())
                f.close()
