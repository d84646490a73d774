"""The small-op lane of a job that spans hosts: each rank's slots sent to every peer over TCP.

On one host the lane is a shared region (:mod:`ringcomm.lane.shm_lane`).  Across
hosts each rank sends every lane slot it posts (its index, op key, whether
fast, and a fast op's payload: :mod:`ringcomm.core.lane_frames`) straight
to every other rank, from the thread that posts it, over one TCP connection
per pair of ranks (Nagle off).  Each rank keeps what it receives, so every
rank reads every rank's slot at an index, and :class:`~ringcomm.lane.driver.LaneDriver`
decides each index exactly as on one host: a small op whose slots agree is
computed by every rank from the payloads, in rank order, with no engine
thread, no rank 0 and no ZeroMQ I/O thread between the caller and the wire.

One thread at a time reads the sockets (whoever waits, or a sender whose
peer's buffer is full, which keeps reading meanwhile, so two ranks that send
to each other never wait for each other's reads).  Slots a rank has
finished reading are dropped once :data:`KEEP` newer ones arrived.

The connections are made once, at ``init()``: the higher rank of each pair
connects, both prove they hold the job secret (an HMAC of the pair), and a
stranger's connection is refused.  The lane carries payloads in clear, so a
job with ``RINGCOMM_ENCRYPT`` set runs without it.
"""

from __future__ import annotations

import collections
import logging
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ..shm import futex
from ..core import lane
from ..core.lane_frames import OFF, Frame, FrameReader, slot_head, off_frame
from ..errors import HorovodInternalError, PeerLostError, ProtocolError, RendezvousError
from ..job.ports import PortRange
from ..net.handshake import HELLO, PROOF_BYTES, Proofs, nodelay, read_exact
from ..net.ports import bind_plain

log = logging.getLogger("ringcomm.lane.net_lane")

#: Slots per peer kept after this rank finished reading them (an op in flight compares its key).
KEEP = 64
#: A rank never waits for room: every rank holds its own copy of what it read.
SLOTS = 1 << 30
#: Bytes one read takes off a socket at most.
READ_BYTES = 1 << 20
_M32 = 0xFFFFFFFF
_IN = select.POLLIN | select.POLLERR | select.POLLHUP


class NetLane:
    """One rank's lane across hosts: what :class:`~ringcomm.lane.driver.LaneDriver` reads and posts.

    ``socks`` holds one connected socket per peer; ``payload_bytes`` is this rank's own bound
    (what it posts fast), ``max_payload`` the largest any rank may post; ``failure()`` is the
    engine's error once it found a peer lost (a post that waits for a peer's room gives up then).
    """

    #: Waits sleep in poll(): re-reading a counter would not bring a peer's slot sooner.
    SPIN = False

    def __init__(self, rank: int, size: int, socks: Mapping[int, socket.socket], payload_bytes: int,
                 max_payload: int, peer_timeout: float,
                 failure: Callable[[], BaseException | None] = lambda: None) -> None:
        self.rank, self.size, self.slots = rank, size, SLOTS
        self.payload_bytes = payload_bytes
        self._peer_timeout = peer_timeout
        self._failure = failure
        self._socks = dict(socks)
        self._fd_rank: dict[int, int] = {}
        self._poller = select.poll()
        for r, sock in self._socks.items():
            sock.setblocking(False)
            self._fd_rank[sock.fileno()] = r
            self._poller.register(sock.fileno(), _IN)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller.register(self._wake_r, select.POLLIN)
        self._readers = {r: FrameReader(max_payload) for r in self._socks}
        # per rank (this one's own too): index -> its slot (key, fast, payload)
        self._kept: list[dict[int, tuple[int, bool, bytes]]] = [{} for _ in range(size)]
        self._oldest = [0] * size  # the lowest index each rank's dict may still hold
        self._count = [0] * size  # indices posted (received, for the peers)
        self._off = [False] * size
        self._lost: dict[int, str] = {}  # peers whose connection broke: what the socket said
        self._epoch = 0
        self._read_below = 0  # this rank has finished reading every index below it
        self._out: dict[int, collections.deque[memoryview]] = {r: collections.deque() for r in self._socks}
        self._send_lock = threading.Lock()
        self._io = threading.Lock()  # held by the one thread that polls and reads
        self._arrived = threading.Condition(threading.Lock())
        self._gen = 0  # bumped (under _arrived) whenever a read took frames in
        self._closed = False

    # -- what the driver reads---------------------------------------------------

    def posted(self, rank: int) -> int:
        return self._count[rank] & _M32

    def off(self, rank: int) -> bool:
        return self._off[rank]

    def seen(self, rank: int, index: int) -> lane.Seen:
        off = self._off[rank]  # before the count: a rank that is off posts no more, so the count is final
        if not lane.reached(self._count[rank] & _M32, index):
            return lane.Seen(False, off, False, 0, 0)
        slot = self._kept[rank].get(index)
        if slot is None:
            raise HorovodInternalError(f"rank {self.rank}: small-op lane slot for index {index} of rank {rank} was dropped "
                                       "before this rank read it; set RINGCOMM_NET_LANE_BYTES=0 to run without the lane")
        key, fast, payload = slot
        return lane.Seen(True, off, fast, key, len(payload))

    def key_at(self, rank: int, index: int) -> int | None:
        slot = self._kept[rank].get(index)
        return None if slot is None else slot[0]

    def fast_sizes(self, index: int, key: int, own_nbytes: int) -> list[int] | None:
        """Every rank's payload length at ``index`` once every peer posted it fast with ``key``, else None."""
        self._read_now()
        sizes = []
        for r, kept in enumerate(self._kept):
            if r == self.rank:
                sizes.append(own_nbytes)
                continue
            slot = kept.get(index)
            if slot is None or slot[0] != key or not slot[1]:
                return None
            sizes.append(len(slot[2]))
        return sizes

    def still_missing(self, ranks: list[int], index: int, key: int) -> list[int] | None:
        """Those of ``ranks`` that have not posted ``index``; None once one posted something else or went off."""
        self._read_now()
        left = []
        for r in ranks:
            if not lane.reached(self._count[r] & _M32, index):
                if self._off[r]:
                    return None
                left.append(r)
                continue
            slot = self._kept[r].get(index)
            if slot is None or slot[0] != key or not slot[1]:
                return None
        return left

    def typed_parts(self, index: int, sizes: Sequence[int], dtype: np.dtype) -> list[np.ndarray]:
        """Every rank's payload at ``index`` as read-only arrays of ``dtype``, in rank order."""
        return [np.frombuffer(self._kept[r][index][2], dtype=dtype) for r in range(self.size)]

    def all_read_below(self, index: int) -> int:
        return index + SLOTS  # no rank rewrites what another reads: each holds its own copy

    def set_read_below(self, count: int) -> None:
        self._read_below = count

    # -- posting --------------------------------------------------------------------

    def post(self, index: int, key: int, fast: bool, payload: Sequence[np.ndarray]) -> None:
        """Keep this rank's slot for ``index`` and send it to every peer (a peer's full buffer is read
        from meanwhile: :meth:`_drain`)."""
        own = b"".join([a.tobytes() for a in payload if a.nbytes]) if payload else b""
        self._kept[self.rank][index] = (key, fast, own)
        self._count[self.rank] = index + 1
        self._prune(self.rank, index)
        self._send(slot_head(self._epoch, index, key, fast, len(own)) + own)

    def set_off(self) -> None:
        """This rank posts no more: tell every peer, so they divert what it never posts."""
        self._off[self.rank] = True
        try:
            self._send(off_frame(self._epoch))
        except PeerLostError as exc:  # going off while a peer is gone: the engine reports it
            log.debug("rank %d: small-op lane: going off: %s", self.rank, exc)

    def reset(self) -> None:
        """Start again from index 0 (after a join: no rank reads a slot now); frames the peers sent
        before their own reset are stale, and dropped as they arrive."""
        with self._io:
            self._epoch += 1
            for kept in self._kept:
                kept.clear()
            self._oldest = [0] * self.size
            self._count = [0] * self.size
            self._off = [False] * self.size
            self._read_below = 0

    def unlink(self) -> None:
        """Nothing to remove: the lane lives in the connections."""

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for sock in self._socks.values():
            sock.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # -- waiting ----------------------------------------------------------------------

    def sleep_on_posted(self, rank: int, seen: int, timeout: futex.Timespec) -> bool:
        """Wait while ``rank``'s post count is ``seen`` and it is not off, ``timeout`` at most."""
        deadline = time.monotonic() + timeout.tv_sec + timeout.tv_nsec / 1e9
        while True:
            with self._arrived:
                gen = self._gen
            if (self._count[rank] & _M32) != seen or self._off[rank]:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self._io.acquire(blocking=False):
                try:
                    self._pump(left)
                finally:
                    self._io.release()
            else:  # another thread reads: it says when frames came in
                with self._arrived:
                    if self._gen == gen:
                        self._arrived.wait(left)

    # -- moving bytes ------------------------------------------------------------------

    def _read_now(self) -> None:
        """Take in whatever has arrived, without waiting (unless another thread reads already)."""
        if self._io.acquire(blocking=False):
            try:
                self._pump(0)
            finally:
                self._io.release()

    def _pump(self, timeout: float, writers: Sequence[int] = ()) -> None:
        """Wait up to ``timeout`` s for a frame (or for room to send to ``writers``) and read every
        socket that has data.  The caller holds ``_io``."""
        poller = self._poller
        for r in writers:
            poller.modify(self._socks[r].fileno(), _IN | select.POLLOUT)
        try:
            events = poller.poll(timeout * 1000.0)
        finally:
            for r in writers:
                if r not in self._lost:
                    poller.modify(self._socks[r].fileno(), _IN)
        took = False
        for fd, ev in events:
            if fd == self._wake_r:
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
                continue
            if ev & _IN:
                took |= self._read(self._fd_rank[fd])
        if took:
            with self._arrived:
                self._gen += 1
                self._arrived.notify_all()

    def _read(self, r: int) -> bool:
        if r in self._lost:
            return False
        sock = self._socks[r]
        took = False
        while True:
            try:
                data = sock.recv(READ_BYTES)
            except BlockingIOError:
                return took
            except OSError as exc:
                self._lose(r, str(exc))
                return took
            if not data:
                self._lose(r, "the connection was closed")
                return took
            for frame in self._readers[r].feed(data):
                took |= self._take(r, frame)
            if len(data) < READ_BYTES:
                return took

    def _take(self, r: int, frame: Frame) -> bool:
        mine = self._epoch & _M32
        if frame.epoch != mine:
            if 0 < (frame.epoch - mine) & _M32 < 0x80000000:
                raise ProtocolError(f"rank {self.rank}: small-op lane: rank {r} sent a frame of restart "
                                    f"{frame.epoch} while this rank is at {mine}")
            return False  # sent before the peer's last restart
        if frame.kind == OFF:
            self._off[r] = True
            return True
        expected = self._count[r]
        if frame.lane_index != expected:
            raise ProtocolError(f"rank {self.rank}: small-op lane: rank {r} sent index {frame.lane_index}, "
                                f"expected {expected}")
        self._kept[r][frame.lane_index] = (frame.key, frame.fast, frame.payload)
        self._count[r] = expected + 1
        self._prune(r, frame.lane_index)
        return True

    def _prune(self, r: int, newest: int) -> None:
        """Drop ``r``'s slots this rank finished reading, keeping the newest :data:`KEEP`."""
        kept, below = self._kept[r], min(self._read_below, newest - KEEP)
        oldest = self._oldest[r]
        while oldest < below:
            kept.pop(oldest, None)
            oldest += 1
        self._oldest[r] = max(oldest, self._oldest[r])

    def _lose(self, r: int, why: str) -> None:
        """``r``'s connection broke: read it no more (the engine reports a lost peer; a peer that
        shut down said it was off first)."""
        self._lost[r] = why
        self._out[r].clear()
        try:
            self._poller.unregister(self._socks[r].fileno())
        except (KeyError, ValueError):
            pass
        log.debug("rank %d: small-op lane: connection to rank %d ended (%s)", self.rank, r, why)

    def _send(self, frame: bytes) -> None:
        """Send ``frame`` to every peer; where a peer's buffer is full, keep reading until it drains."""
        with self._send_lock:
            for r, sock in self._socks.items():
                if r in self._lost:
                    continue
                queue = self._out[r]
                if queue:
                    queue.append(memoryview(frame))
                    continue
                try:
                    sent = sock.send(frame)
                except BlockingIOError:
                    sent = 0
                except OSError as exc:
                    self._lose(r, str(exc))
                    continue
                if sent < len(frame):
                    queue.append(memoryview(frame)[sent:])
            if not any(self._out.values()):
                return
        self._drain()

    def _flush(self) -> list[int]:
        """Send what is queued as far as the peers' buffers allow; the peers still waiting (send lock held)."""
        waiting = []
        for r, queue in self._out.items():
            sock = self._socks[r]
            while queue:
                try:
                    sent = sock.send(queue[0])
                except BlockingIOError:
                    break
                except OSError as exc:
                    self._lose(r, str(exc))
                    break
                if sent < len(queue[0]):
                    queue[0] = queue[0][sent:]
                    break
                queue.popleft()
            if queue:
                waiting.append(r)
        return waiting

    def _drain(self) -> None:
        """Wait until the queued frames are out: a peer that reads nothing (busy elsewhere, it posts
        nothing either) holds this post back like any collective would; a lost one ends it."""
        warn_at = time.monotonic() + self._peer_timeout
        while True:
            with self._send_lock:
                waiting = self._flush()
            if not waiting:
                return
            err = self._failure()
            if err is not None:
                raise err
            if time.monotonic() > warn_at:
                warn_at += self._peer_timeout
                log.warning("rank %d: small-op lane: rank %d has read nothing of this rank's for %g s; this "
                            "rank's next op waits until it does", self.rank, waiting[0], self._peer_timeout)
            try:
                os.write(self._wake_w, b"\0")  # a thread asleep in poll() lets this one read and send
            except BlockingIOError:
                pass
            with self._io:
                self._pump(0.05, waiting)


# -- setting up: every rank listens; the higher rank of each pair connects ------------------


def offer(rank: int, size: int, addr: str, payload_bytes: int, encrypt: bool,
          ports: PortRange | None = None) -> tuple[socket.socket | None, Any]:
    """Before the ranks meet: a listening socket (on a port of ``ports``; None: any free one) and
    ``[address, port, payload bytes]`` to publish, or ``(None, False)`` when this rank cannot take part
    (one rank, the lane off, encryption on, no port)."""
    if size < 2 or payload_bytes <= 0 or encrypt:
        return None, False
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        bind_plain(listener, addr, ports, f"rank {rank}'s small-op lane across hosts")
        listener.listen(size)
    except (OSError, RendezvousError) as exc:
        listener.close()
        log.warning("rank %d: small-op lane across hosts disabled: cannot listen on %s (%s)", rank, addr, exc)
        return None, False
    return listener, [addr, listener.getsockname()[1], payload_bytes]


def accept(listener: socket.socket | None, table: list[dict[str, Any]], rank: int, secret: bytes, job_id: str,
           round_: int, timeout: float, peer_timeout: float,
           failure: Callable[[], BaseException | None] = lambda: None) -> NetLane | None:
    """Once every rank's offer is in ``table``: connect the lane when the job spans hosts and every
    rank offered one; otherwise (one host, or a rank without it) close the listener, None."""
    hosts = {p["host"] for p in table}
    offers: dict[int, Any] = {int(p["rank"]): p.get("net_lane") for p in table}
    if listener is None or len(hosts) < 2 or not all(offers.values()):
        if listener is not None:
            listener.close()
        return None
    size = len(table)
    deadline = time.monotonic() + timeout
    proofs = Proofs(secret, "lane", job_id, round_)  # the pair named lower rank first
    socks: dict[int, socket.socket] = {}
    peer = rank
    try:
        for peer in range(rank):  # connect and say hello; the acks are read once the others are in
            host, port = str(offers[peer][0]), int(offers[peer][1])
            sock = socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic()))
            socks[peer] = nodelay(sock)
            sock.sendall(proofs.hello(rank, peer, rank))
        while len(socks) < size - 1:
            listener.settimeout(max(0.1, deadline - time.monotonic()))
            sock, _ = listener.accept()
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                peer, proof = HELLO.unpack(read_exact(sock, HELLO.size))
            except (OSError, ConnectionError, struct.error):
                sock.close()
                continue
            if not (rank < peer < size and peer not in socks
                    and proofs.holds(proof, rank, peer, "hello")):
                log.warning("rank %d: small-op lane: refused a connection that did not prove the job secret", rank)
                sock.close()
                continue
            socks[peer] = nodelay(sock)
            sock.sendall(proofs.of(rank, peer, "answer"))
        for peer in range(rank):
            socks[peer].settimeout(max(0.1, deadline - time.monotonic()))
            if not proofs.holds(read_exact(socks[peer], PROOF_BYTES), peer, rank, "answer"):
                raise ConnectionError("its answer did not prove the job secret")
    except (OSError, ConnectionError) as exc:
        for sock in socks.values():
            sock.close()
        missing = [r for r in range(size) if r != rank and r not in socks] or [peer]
        where = ", ".join(f"rank {r} at {offers[r][0]}:{offers[r][1]}" for r in missing)
        raise HorovodInternalError(
            f"rank {rank}: cannot connect the small-op lane across hosts to {where} ({exc}); "
            "set RINGCOMM_NET_LANE_BYTES=0 on every rank to run without it") from exc
    finally:
        listener.close()
    max_payload = max(int(o[2]) for o in offers.values())
    return NetLane(rank, size, socks, int(offers[rank][2]), max_payload, peer_timeout, failure)
