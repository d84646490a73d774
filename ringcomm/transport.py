"""Data plane over ZeroMQ: one PULL inbox per rank, one PUSH socket per peer.

Owned by the engine thread.  Messages from one peer arrive in order; messages
from different peers (or for a later op) may interleave, so ``recv`` keeps
anything it was not asked for yet in a stash keyed by ``(src, seq, tag)``.

Large segments are sent zero-copy and tracked; ``flush()`` waits until ZeroMQ
has let go of them, so a buffer is never reused while it is still being read.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import zmq

from . import wire
from .errors import PeerLostError

log = logging.getLogger("ringcomm.transport")


class DataPlane:
    """Point-to-point messaging between the ranks of one job (implements ``algorithms.Link``)."""

    def __init__(
        self,
        ctx: zmq.Context,
        rank: int,
        size: int,
        token: bytes,
        zero_copy_min_bytes: int,
        peer_timeout: float,
    ) -> None:
        self.rank = rank
        self.size = size
        self._ctx = ctx
        self._token = token
        self._zc_min = zero_copy_min_bytes
        self._timeout = peer_timeout
        self._inbox = ctx.socket(zmq.PULL)
        self._inbox.setsockopt(zmq.LINGER, 0)
        self._inbox.setsockopt(zmq.RCVHWM, 0)
        self._inbox.setsockopt(zmq.MAXMSGSIZE, -1)
        self._peers: dict[int, zmq.Socket] = {}
        self._stash: dict[tuple[int, int, int], zmq.Frame] = {}
        self._trackers: list[zmq.MessageTracker] = []
        self._headers: dict[tuple[int, int, int], bytes] = {}
        self.peer_names: dict[int, str] = {}

    # -- setup ---------------------------------------------------------------

    def bind(self, endpoints: list[str]) -> list[str]:
        """Bind the inbox to each endpoint (``tcp://ip:0`` picks a port); returns the real addresses."""
        bound = []
        for ep in endpoints:
            self._inbox.bind(ep)
            bound.append(self._inbox.getsockopt_string(zmq.LAST_ENDPOINT))
        return bound

    def connect(self, peer: int, endpoint: str, description: str) -> None:
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.IMMEDIATE, 0)
        sock.connect(endpoint)
        self._peers[peer] = sock
        self.peer_names[peer] = description

    def close(self) -> None:
        for sock in self._peers.values():
            sock.close(0)
        self._peers.clear()
        self._inbox.close(0)
        self._stash.clear()
        self._trackers.clear()

    # -- Link ----------------------------------------------------------------

    def send(self, dst: int, seq: int, tag: int, arr: np.ndarray) -> None:
        header = wire.pack_header(self._token, self.rank, seq, tag)
        payload = arr.view(np.uint8) if arr.ndim == 1 else arr.reshape(-1).view(np.uint8)
        sock = self._peers[dst]
        if payload.nbytes < self._zc_min:
            sock.send_multipart([header, payload], copy=True)
        else:
            tracker = sock.send_multipart([header, payload], copy=False, track=True)
            self._trackers.append(tracker)

    def recv(self, src: int, seq: int, tag: int) -> memoryview:
        key = (src, seq, tag)
        frame = self._stash.pop(key, None)
        if frame is not None:
            return frame.buffer
        deadline = time.monotonic() + self._timeout
        inbox = self._inbox
        while True:
            if not inbox.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                if time.monotonic() >= deadline:
                    raise PeerLostError(
                        f"rank {self.rank}: no data from rank {src} ({self.peer_names.get(src, '?')}) "
                        f"for {self._timeout:.0f} s during op #{seq}; the peer died or hangs. "
                        "Raise RINGCOMM_PEER_TIMEOUT if it is only slow."
                    )
                continue
            frames = inbox.recv_multipart(copy=False)
            if len(frames) != 2:
                log.debug("dropping data message with %d frames", len(frames))
                continue
            try:
                got = wire.unpack_header(self._token, frames[0].bytes)
            except ValueError as exc:
                log.debug("dropping data message: %s", exc)
                continue
            if got == key:
                return frames[1].buffer
            self._stash[got] = frames[1]

    def flush(self) -> None:
        """Wait until ZeroMQ has released every zero-copy send."""
        deadline = time.monotonic() + self._timeout
        for tracker in self._trackers:
            left = deadline - time.monotonic()
            try:
                tracker.wait(max(0.001, left))
            except zmq.NotDone:
                raise PeerLostError(
                    f"rank {self.rank}: outgoing data was not taken by a peer within {self._timeout:.0f} s"
                ) from None
        self._trackers.clear()
