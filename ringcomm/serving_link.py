"""Rank 0's link: the data plane, plus negotiation while rank 0 waits inside its own transfers.

Rank 0 coordinates every process set and also executes ops.  Without this,
a set that rank 0 is not in would wait for rank 0's current transfer to end
before its next op could even be negotiated.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import zmq

from .transport import DataPlane


class ServingLink:
    """Rank 0's data plane while it executes an op: waiting for a peer's data, it keeps negotiating.

    Requests that arrive on the control socket while rank 0 waits inside a
    transfer are handed to ``serve``: the engine feeds them to the controller
    and answers at once the ready ops of process sets without rank 0, so those
    sets are not held up by rank 0's own transfer.  Ops of sets with rank 0
    are answered by the engine's main loop after the current op.  Everything
    else is the :class:`DataPlane`'s.
    """

    def __init__(self, link: DataPlane, ctrl: zmq.Socket, serve: Callable[[], None]) -> None:
        self._link, self._ctrl, self._serve = link, ctrl, serve
        self.rank, self.size = link.rank, link.size
        self._pollers: dict[int, tuple[zmq.Poller, zmq.Socket]] = {}

    def send(self, dst: int, seq: int, tag: int, arr: np.ndarray) -> None:
        self._link.send(dst, seq, tag, arr)

    def flush(self) -> None:
        self._link.flush()

    def reserve(self, dst: int, nbytes: int) -> np.ndarray | None:
        return self._link.reserve(dst, nbytes)

    def commit(self, dst: int, seq: int, tag: int, view: np.ndarray) -> None:
        self._link.commit(dst, seq, tag, view)

    def recv(self, src: int, seq: int, tag: int) -> object:
        if (seq, tag) not in self._link._stash[src]:
            self._serve_until_data(src)
        return self._link.recv(src, seq, tag)

    def recv_any(self, src: int, seq: int) -> tuple[int, object]:
        if not any(key[0] == seq for key in self._link._stash[src]):
            self._serve_until_data(src)
        return self._link.recv_any(src, seq)

    def _serve_until_data(self, src: int) -> None:
        """Answer control messages until ``src`` sends something (or a slice passes: the data plane's
        own wait, with its peer checks and timeout, takes over then)."""
        self._link._ack_held(src)  # as the data plane's recv would: the last view from src is used
        entry = self._pollers.get(src)
        if entry is None:
            poller = zmq.Poller()
            data = self._link._socks[src]
            poller.register(data, zmq.POLLIN)
            poller.register(self._ctrl, zmq.POLLIN)
            entry = self._pollers[src] = (poller, data)
        poller, data = entry
        deadline = time.monotonic() + 1.0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            events = dict(poller.poll(max(1, int(left * 1000))))
            if self._ctrl in events:
                self._serve()
            if data in events or not events:
                return
