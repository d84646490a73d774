"""The handle of an op of the small-op lane, and the one thing it asks of the lane: to be driven.

An op the lane posts fast is resolved by the thread that waits for it: ``LaneHandle.wait`` asks
the lane to read the peers' slots and finish it there (no thread hop, which is what keeps a small
allreduce's latency down).  That call goes through :class:`Drives`, declared here and satisfied by
the lane's driver (:class:`ringcomm.lane.driver.LaneDriver`), so the handle knows nothing else of
the driver.  An op the lane hands to the engine drops its driver and is an ordinary
:class:`~ringcomm.handles.Handle`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from ..handles import Handle


class Drives(Protocol):
    """What a :class:`LaneHandle` asks of the lane that holds its op (the lane's driver)."""

    def drive(self, handle: LaneHandle, deadline: float | None, block: bool) -> None:
        """Resolve ``handle``'s op on the calling thread, waiting for the peers until ``deadline``
        (``time.monotonic()``; None: no limit) when ``block``: post it first if it is still queued."""
        ...


class LaneHandle(Handle):
    """A handle whose op may be resolved by the waiting thread itself (see :mod:`ringcomm.lane.driver`).

    ``lane`` is the driver that still holds the op (None once the engine has it, or it is done);
    ``index`` its index in the lane (-1 while queued).  Both are the driver's to set.
    ``done()`` does not resolve it (an async op stays pending until waited for, or swept after
    :data:`~ringcomm.lane.driver.SWEEP_SECONDS`, as Horovod's ``poll()`` is False right after the submit)."""

    __slots__ = ("lane", "index")

    def __init__(self, name: str, on_done: Callable[[], None] | None = None) -> None:
        super().__init__(name, on_done)
        self.lane: Drives | None = None
        self.index = -1

    def wait(self, timeout: float | None = None) -> Any:
        lane = self.lane
        if not self._done and lane is not None:
            lane.drive(self, None if timeout is None else time.monotonic() + timeout, block=True)
        if self._done:  # the usual case: resolved by this thread just now
            if self._error is not None:
                raise self._error
            return self._result
        return super().wait(timeout)
