"""Rank 0's control socket: the requests it reads into its service and the answers it sends back.

Rank 0 negotiates every op (:class:`~ringcomm.core.service.Service`, pure).  This
module is the I/O around it: a ROUTER socket that every other rank's DEALER talks
to.  It is used at two places, and the difference matters:

* the engine's loop calls :meth:`Rank0Control.drain` when the socket is
  readable and :meth:`Rank0Control.answer` after every turn; the answers for
  rank 0 itself come back as values, and the loop executes them;
* while rank 0 waits for a peer's data inside one of its own transfers, the data
  plane runs :meth:`Rank0Control.step` when the socket is readable (see
  :meth:`~ringcomm.net.transport.DataPlane.serve_while_waiting`).  That step
  answers only the process sets without rank 0: a set with rank 0 cannot run its
  next op before rank 0 is done, and a shutdown must not reach the other ranks
  while rank 0 still needs their data.  So it never yields work for rank 0, and
  no transfer starts inside another.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from ..core.service import Service
from ..core.wire import Response

log = logging.getLogger("ringcomm.net.control")


@dataclass
class TimelineNotes:
    """What rank 0's negotiation leaves for the timeline (kept only while one is written)."""

    on: bool = False
    mark_cycles: bool = False
    #: ``(set, *names)`` -> when rank 0 began reducing a small op before answering it
    reduced_at: dict[tuple[Any, ...], float] = field(default_factory=dict)
    #: when each negotiation cycle emitted answers (only with ``mark_cycles``)
    cycles: list[float] = field(default_factory=list)


class Rank0Control:
    """Rank 0's ROUTER socket and its :class:`Service`: reads requests, sends answers, warns of stalls.

    ``stall_check_seconds`` / ``stall_shutdown_seconds``: how often to warn of an op some ranks have
    not submitted (every period it waits), and when the service fails it on every rank.
    """

    def __init__(self, service: Service, size: int, stall_check_seconds: float,
                 stall_shutdown_seconds: float) -> None:
        #: the ROUTER socket, once bound (a job of one process has none)
        self.socket: zmq.Socket | None = None
        self.service = service
        self.notes = TimelineNotes()
        self._idents = {r: f"rank{r}".encode() for r in range(1, size)}
        self._stall_check = stall_check_seconds
        self._stall_shutdown = stall_shutdown_seconds

    def receive_one(self) -> bool:
        """Read one waiting message into the service; returns whether there was one."""
        if self.socket is None:
            return False
        try:
            frames = self.socket.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return False
        if len(frames) == 2:  # ROUTER: [sender identity, message]
            self.service.receive(frames[1], time.monotonic())
        return True

    def drain(self) -> None:
        """Read every waiting message into the service."""
        while self.receive_one():
            pass

    def answer(self, nested: bool = False) -> list[Response]:
        """Send the answers ready now to the other ranks; returns rank 0's own, in order.

        ``nested``: rank 0 is inside a transfer: only the sets without rank 0 are answered, so
        the list returned is empty.
        """
        now = time.monotonic()
        out = self.service.take(now, nested)
        local: list[Response] = []
        if out is not None:
            notes = self.notes
            if notes.on:
                if notes.mark_cycles:
                    notes.cycles.append(time.perf_counter())
                notes.reduced_at.update(out.reduced_at)
            self._send(out.frames)
            local = out.local
        self._check_stalls(now)
        return local

    def step(self) -> None:
        """The control socket is readable while rank 0 waits inside a transfer: take every
        waiting request and answer the sets without rank 0 (nothing for rank 0 to run)."""
        self.drain()
        mine = self.answer(nested=True)
        assert not mine, f"rank 0 was handed {[r.names for r in mine]} inside a transfer"

    def next_wake_ms(self) -> int | None:
        """How long the loop may sleep before the service needs a turn (see :meth:`Service.next_wake`)."""
        return self.service.next_wake(time.monotonic())

    def _send(self, frames: dict[int, list[bytes]]) -> None:
        """Each other rank gets the frames the service encoded for it."""
        assert self.socket is not None or not frames
        for r, batch in frames.items():
            ident = self._idents[r]
            try:
                for frame in batch:
                    self.socket.send_multipart([ident, frame])  # type: ignore[union-attr]
            except zmq.ZMQError as exc:
                # that rank's connection is gone: it left after the collective shutdown,
                # or it died, which its data-plane monitor reports as a lost peer
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
                log.debug("rank 0: %s is gone; response not delivered", ident.decode())

    def _check_stalls(self, now: float) -> None:
        for _, text in self.service.stalls(now, self._stall_check, self._stall_shutdown):
            log.warning("stall: %s; every rank must run the same collectives in the end", text)
