"""The lane's lifecycle in one owner: the region offered and accepted at the rendezvous, the driver, its restart, its end.

The dispatcher (:class:`ringcomm.dispatch.Dispatcher`) makes the owner and hands it to the engine;
the two call :class:`LaneOwner` and nothing else of the lane's lifecycle::

    engine      offer()    before the ranks meet: what this rank publishes in the rendezvous table
                accept()   once every rank's offer is in: a shared region (one host), TCP (across
                           hosts), or no lane  (both through the wiring: bootstrap.LaneMeeting)
    dispatcher  start()    the driver over the region, given the engine as the one narrow
                           interface it diverts ops to (:class:`~ringcomm.lane.records.EngineSide`)
                close()    this rank posts no more (a shutdown), before the engine shuts down
                reopen_after_join()   every rank joined: the lane starts again from index 0
    engine      stop_posting()   rank 0 has every rank stop posting (a stall)
                release()  the engine is closed: unlink and unmap the region, close a listener
                           (both through engine.LaneControl)

The dispatcher submits ops to the driver :meth:`LaneOwner.start` returned (the hot path goes
through no owner).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from typing import Any

from ..core import lane, routing
from ..job.ports import PortRange
from . import net_lane, shm_lane
from .driver import LaneDriver
from .records import EngineSide

log = logging.getLogger("ringcomm.lane.owner")

#: Slots per rank in the lane on one host (a rank rewrites one once every rank has read it).
SLOTS = 4


class LaneOwner:
    """Makes, starts, restarts and ends this rank's side of the small-op lane.

    ``region`` is the shared region or the connections once :meth:`accept` made one (None: this
    job runs without the lane); ``driver`` is the :class:`~ringcomm.lane.driver.LaneDriver` once
    :meth:`start` made it."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.region: shm_lane.ShmLane | net_lane.NetLane | None = None
        self.driver: LaneDriver | None = None
        self._shm_bytes = 0  # this rank's own bound for payloads on one host (reductions)
        self._shm_move_bytes = 0  # ... and for the ops that only move data (the region's entries, at rank 0)
        self._offered: shm_lane.ShmLane | None = None  # rank 0's shared region, until accept()
        self._listener: socket.socket | None = None  # until the lane across hosts is connected
        self._engine: EngineSide | None = None  # given by start()

    # -- making the region (the engine, at the rendezvous) --------------------------------

    def offer(self, job_id: str, round_: int, addr: str, shm_bytes: int, net_bytes: int,
              encrypt: bool, ports: PortRange | None = None, shm_move_bytes: int | None = None) -> dict[str, Any]:
        """Before the ranks meet: rank 0 creates the shared region (unnamed) and every rank listens for
        the lane across hosts (on a port of ``ports``; None: any free one); returns this rank's entries
        of the rendezvous table (``lane``: rank 0's region path, or whether this rank could map one;
        ``net_lane``: where it listens, or False).  ``shm_bytes``: this rank's bound on one host for
        reductions; ``shm_move_bytes`` (default: the same) for broadcasts, allgathers and alltoalls,
        the size of the region's entries that rank 0 asks for."""
        self._shm_bytes = shm_bytes
        # an alltoall's posted bytes start with its head: the entries hold it beside a payload of the bound
        head = lane.head_bytes(self.size) if shm_bytes > 0 else 0
        self._shm_move_bytes = (shm_bytes if shm_move_bytes is None else max(shm_bytes, shm_move_bytes)) + head
        self._offered, lane_offer = shm_lane.offer(job_id, round_, self.rank, self.size, SLOTS,
                                                   self._shm_move_bytes, shm_bytes + head)
        self._listener, net_offer = net_lane.offer(self.rank, self.size, addr, net_bytes, encrypt, ports)
        return {"lane": lane_offer, "net_lane": net_offer}

    def accept(self, table: list[dict[str, Any]], secret: bytes, job_id: str, round_: int, start_timeout: float,
               peer_timeout: float) -> None:
        """Once every rank's offer is in ``table``: the shared region when every rank is on this host
        and could map it, else the connections when the job spans hosts and every rank listens, else
        no lane (see :func:`ringcomm.lane.shm_lane.accept`, :func:`ringcomm.lane.net_lane.accept`)."""
        self.region = shm_lane.accept(self._offered, table, self.rank, SLOTS, peer_timeout)
        self._offered = None  # the region now, or closed
        listener, self._listener = self._listener, None
        if self.region is None:
            self.region = net_lane.accept(listener, table, self.rank, secret, job_id, round_, start_timeout,
                                          peer_timeout, self._engine_failure)
        elif listener is not None:
            listener.close()

    def _engine_failure(self) -> BaseException | None:
        """The engine's failure, for a post across hosts that waits for a peer's room (none before start())."""
        return None if self._engine is None else self._engine.failure

    # -- running it (the dispatcher) --------------------------------------------------------

    def start(self, engine: EngineSide, stall_check: float, stall_shutdown: float) -> LaneDriver | None:
        """The driver over the region (None without one): ops it cannot take go to ``engine``.

        A rank posts fast up to its own bound: across hosts the one it offered; on one host its
        setting, within the slots rank 0 made (their payload size is rank 0's)."""
        self._engine = engine
        region = self.region
        if region is None:
            return None
        across = isinstance(region, net_lane.NetLane)
        max_bytes = routing.lane_bytes(region.payload_bytes, None if across else self._shm_bytes)
        move_bytes = routing.lane_bytes(region.payload_bytes, None if across else self._shm_move_bytes)
        self.driver = LaneDriver(region, engine, max_bytes, stall_check, stall_shutdown, move_bytes=move_bytes)
        return self.driver

    def close(self, timeout: float) -> None:
        """This rank posts no more (a shutdown): the others divert what it never posts; ops it
        posted fast resolve, waiting up to ``timeout`` for the peers."""
        if self.driver is not None:
            self.driver.close(timeout)

    def stop_posting(self) -> None:
        """Rank 0 has every rank stop posting (a stall): see :meth:`LaneDriver.stop_posting`."""
        if self.driver is not None:
            self.driver.stop_posting()

    def reopen_after_join(self, barrier: Callable[[], None]) -> None:
        """Every rank has joined: the lane starts again from index 0 (see
        :meth:`~ringcomm.lane.driver.LaneDriver.reopen_after_join`).  ``barrier()`` runs on every
        rank, with a lane or without: ranks may disagree on having one, and a rank that skipped it
        would leave the others waiting in it."""
        if self.driver is None:
            barrier()
        else:
            self.driver.reopen_after_join(barrier)

    # -- ending it (the engine, once closed) -----------------------------------------------

    def release(self) -> None:
        """Close a listener never connected, unlink the region's name if it still has one (setup was
        cut short) and unmap it: after the engine closed, nothing reads it any more."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        region = self.region if self.region is not None else self._offered
        if region is not None:
            region.unlink()  # gone already unless setup was cut short
            region.close()
