"""Data plane over ZeroMQ: one PAIR socket per pair of ranks.

Owned by the engine thread.  Every rank executes the same ops in the same
order and, within an op, receives from each peer in exactly the order that
peer sent (the algorithms are written so), so messages need no header: the
next message on the socket from rank ``p`` *is* the one wanted.  A message of
an unexpected length means the streams are out of step; the engine then fails
the job rather than guess.

Segments of at least ``zero_copy_min_bytes`` go out zero-copy and tracked;
``flush()`` waits until ZeroMQ has released the last one sent to each peer
(ZeroMQ writes a connection's messages in order, so earlier ones are done too).
"""

from __future__ import annotations

import logging

import numpy as np
import zmq

from .errors import PeerLostError

log = logging.getLogger("ringcomm.transport")


class DataPlane:
    """Point-to-point messaging between the ranks of one job (implements ``algorithms.Link``)."""

    def __init__(self, ctx: zmq.Context, rank: int, size: int, zero_copy_min_bytes: int, peer_timeout: float) -> None:
        self.rank = rank
        self.size = size
        self._ctx = ctx
        self._zc_min = zero_copy_min_bytes
        self._timeout = peer_timeout
        self._socks: dict[int, zmq.Socket] = {}
        self._last_tracker: dict[int, zmq.MessageTracker] = {}
        self.peer_names: dict[int, str] = {}

    def _socket(self, peer: int) -> zmq.Socket:
        sock = self._ctx.socket(zmq.PAIR)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.RCVTIMEO, max(1, int(self._timeout * 1000)))
        self._socks[peer] = sock
        return sock

    # -- setup ---------------------------------------------------------------

    def bind(self, ipc_base: str, tcp_host: str) -> list[list[str] | None]:
        """Bind one socket for each higher-ranked peer; returns ``[ipc, tcp]`` endpoints by peer rank."""
        table: list[list[str] | None] = [None] * self.size
        for peer in range(self.rank + 1, self.size):
            sock = self._socket(peer)
            eps = []
            for ep in (f"{ipc_base}-{peer}", f"tcp://{tcp_host}:0"):
                sock.bind(ep)
                eps.append(sock.getsockopt_string(zmq.LAST_ENDPOINT))
            table[peer] = eps
        return table

    def connect(self, peer: int, endpoints: list[list[str] | None], same_host: bool, description: str) -> None:
        """Connect to a lower-ranked peer's socket for this rank (``endpoints`` is its bind table)."""
        self.peer_names[peer] = description
        if peer > self.rank:
            return
        eps = endpoints[self.rank]
        if eps is None:
            raise ValueError(f"rank {peer} published no endpoint for rank {self.rank}")
        self._socket(peer).connect(eps[0] if same_host else eps[1])

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close(0)
        self._socks.clear()
        self._last_tracker.clear()

    # -- Link ----------------------------------------------------------------

    def send(self, dst: int, seq: int, tag: int, arr: np.ndarray) -> None:
        payload = arr if arr.ndim == 1 else arr.reshape(-1)
        if payload.dtype != np.uint8:
            payload = payload.view(np.uint8)
        if payload.nbytes < self._zc_min:
            self._socks[dst].send(payload, copy=True)
        else:
            self._last_tracker[dst] = self._socks[dst].send(payload, copy=False, track=True)

    def recv(self, src: int, seq: int, tag: int) -> memoryview | bytes:
        try:
            frame = self._socks[src].recv(copy=False)
        except zmq.Again:
            raise PeerLostError(
                f"rank {self.rank}: no data from rank {src} ({self.peer_names.get(src, '?')}) for "
                f"{self._timeout:.0f} s during op #{seq}; the peer died or hangs. "
                "Raise RINGCOMM_PEER_TIMEOUT if it is only slow."
            ) from None
        return frame.buffer

    def flush(self) -> None:
        """Wait until ZeroMQ has released every zero-copy send."""
        for dst, tracker in self._last_tracker.items():
            try:
                tracker.wait(self._timeout)
            except zmq.NotDone:
                raise PeerLostError(
                    f"rank {self.rank}: rank {dst} ({self.peer_names.get(dst, '?')}) did not take its data "
                    f"within {self._timeout:.0f} s"
                ) from None
        self._last_tracker.clear()
