"""Where each op of this process goes, the small-op lane or the engine, and the two's lifecycle in order.

A :class:`Dispatcher` is the one owner of both paths.  :meth:`Dispatcher.connect` makes the lane's
owner (:class:`~ringcomm.lane.owner.LaneOwner`) and the engine, handing the engine that owner: the
engine offers and accepts the lane at the rendezvous, stops it on rank 0's LANE_OFF and releases
it when it closes, and knows it only as :class:`~ringcomm.engine.LaneControl`.  The dispatcher then
starts, reopens and closes the lane around the engine, in this order::

    connect()             LaneOwner(rank, size); Engine(..., lane owner): the ranks meet, the lane is made
    start()               the engine's thread, then the lane's driver over the region (None: no lane)
    reopen_after_join()   every rank joined: the lane starts again from index 0 after a barrier
    shutdown()            the lane closes (the others divert what this rank will not post), then the
                          engine shuts down and, closing, releases the lane's region

Every op the runtime names and checks comes here (:meth:`Dispatcher.submit`; a refused call through
:meth:`Dispatcher.refuse`)::

    global set (pset 0), the job has a lane -> LaneHandle; LaneDriver.submit (True: the lane has it,
                                               False: the engine's) -> Engine.submit
    a process set, or no lane in this job   -> Handle; Engine.submit

The lane itself decides which of its ops go fast and which it diverts to the engine; nothing here
compares sizes.  :meth:`Dispatcher.submit` is on every op's path: it allocates only the op's handle and
entry, takes no lock, and calls the lane or the engine directly.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .core import wire
from .engine import Engine
from .handles import Entry, Handle
from .job.config import Settings
from .job.topology import Topology
from .lane.driver import LaneDriver
from .lane.handle import LaneHandle
from .lane.owner import LaneOwner


class Dispatcher:
    """This process's small-op lane and engine: which one takes each op, and when each starts and ends.

    ``engine`` and ``lane_owner`` are made by :meth:`connect` (a test may pass its own);
    ``lane`` is the lane's driver once :meth:`start` ran and the job has a lane, else None."""

    def __init__(self, engine: Engine, lane_owner: LaneOwner, settings: Settings) -> None:
        self.engine = engine
        self.lane_owner = lane_owner
        self.settings = settings
        self.lane: LaneDriver | None = None

    @classmethod
    def connect(cls, topo: Topology, settings: Settings, round_: int) -> Dispatcher:
        """Make the lane's owner and the engine (which meets the other ranks, and offers and accepts
        the lane there; on an error it has closed what it opened, the lane's offer included)."""
        lane_owner = LaneOwner(topo.rank, topo.size)
        return cls(Engine(topo, settings, lane_owner, round_), lane_owner, settings)

    # -- the lifecycle -----------------------------------------------------------

    def start(self) -> None:
        """Start the engine's thread, then the lane's driver over the region the engine accepted (small
        ops of the global set then skip the engine; the driver hands it what it cannot take)."""
        self.engine.start()
        self.lane = self.lane_owner.start(self.engine, self.settings.stall_check_seconds,
                                          self.settings.stall_shutdown_seconds)

    def reopen_after_join(self, barrier: Callable[[], None]) -> None:
        """Every rank has joined: the lane starts again from index 0 after ``barrier()``, which runs on
        every rank, with a lane or without (see :meth:`~ringcomm.lane.owner.LaneOwner.reopen_after_join`)."""
        self.lane_owner.reopen_after_join(barrier)

    def shutdown(self, timeout: float) -> None:
        """Leave the job, waiting up to ``timeout`` for the other ranks (0: not at all): the lane first,
        so the others divert what this rank will not post, then the engine (which releases the lane)."""
        self.lane_owner.close(timeout)
        self.engine.shutdown(timeout=timeout)

    # -- every op ----------------------------------------------------------------

    def submit(self, req: wire.Request, arrays: list[np.ndarray], outs: list[np.ndarray | None], grouped: bool,
               on_done: Callable[[], None] | None, others: int) -> Handle:
        """Hand the op of ``req`` to the lane (the global set, when the job has one) or to the engine,
        and return its handle; ``on_done`` runs once when it finishes.  ``others``: this rank's other
        ops in flight (the lane takes an op fast only where every rank posted those alike).  Raises
        what the engine raises once it failed or is shutting down (the handle is then not finished)."""
        lane = self.lane if req.pset == 0 else None
        if lane is None:
            handle = Handle(req.name, on_done)
            self.engine.submit(Entry(req, arrays, handle, outs, grouped))
            return handle
        handle = LaneHandle(req.name, on_done)
        entry = Entry(req, arrays, handle, outs, grouped)
        if not lane.submit(entry, others):
            self.engine.submit(entry)
        return handle

    def refuse(self, req: wire.Request) -> Handle:
        """Hand the refusal ``req`` (:meth:`~ringcomm.core.naming.OpCall.refusal`) to where its op
        would have gone, and return the handle that finishes when rank 0 has answered it.

        In the lane a refused op is never fast, so the others divert theirs too; the lane hands it
        to the engine itself if it had to queue it (False: posted now, the engine's to take)."""
        return self.submit(req, [], [], False, None, 0)
