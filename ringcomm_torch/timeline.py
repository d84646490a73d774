"""Horovod's ``start_timeline`` / ``stop_timeline``, backed by the core's Chrome-trace timeline.

The core (:mod:`ringcomm.timeline`) records, on rank 0, every op's negotiation,
packing, ring and unpacking phases, so torch ops and gradient reductions
(``allreduce.<param name>``) appear there under the names Horovod gives them::

    hvd.start_timeline("/tmp/timeline.json")
    ...train a few steps...
    hvd.stop_timeline()      # open the file in chrome://tracing or https://ui.perfetto.dev
"""

from __future__ import annotations

import ringcomm as _rc

__all__ = ["start_timeline", "stop_timeline"]


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing rank 0's timeline to ``file_path`` (other ranks write nothing, as in Horovod)."""
    _rc.start_timeline(str(file_path), mark_cycles=mark_cycles)


def stop_timeline() -> None:
    """Finish the timeline file; a no-op when none is running or the job is shut down."""
    if _rc.is_initialized():
        _rc.stop_timeline()
