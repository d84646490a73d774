"""Payload streams across hosts: one plain TCP connection per direction between two ranks.

ZeroMQ moves a payload through its I/O thread (one more copy of every byte on each side), and
one connection carries both directions.  On a 10 Gbit/s link that costs a rank whose peer is
on another host a fifth of what the wire gives (64 MiB each way: ZeroMQ's exchange 80-92 ms,
one plain connection per direction 65-74 ms).  So a payload of at least
RINGCOMM_STREAM_MIN_BYTES for a rank on another host goes over a stream of its own:

- the sender's thread writes it straight from the caller's array (``sendall``, no copy), as
  ZeroMQ's zero-copy sends did: the caller leaves the array alone until ``flush``;
- the receiver's thread reads it straight into a buffer of its size (``recv_into``) and
  queues it, whatever the receiver's engine thread is doing, as ZeroMQ's I/O thread did, so
  a sender's ``flush`` never waits for the receiver's engine thread;
- it is received like an inline payload, by ``(seq, tag)``, in any order
  (:class:`ringcomm.net.transport.DataPlane`).

Everything else still travels on the pair's ZeroMQ socket: small payloads, loss notices and
the heartbeats that find a stopped peer.  A stream that breaks names its peer as lost.

The sender connects when it first streams to a peer, and proves that it holds the job's
secret (its rank and an HMAC of the pair and direction); the receiver answers with its own
HMAC before any payload, and closes a connection that proves nothing.  Payloads travel in
clear, so a job with RINGCOMM_ENCRYPT keeps them on ZeroMQ.  Each message is a
:data:`ringcomm.core.wire.STREAM` head (seq, tag, byte count) and the bytes.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import struct
import threading

import numpy as np

from ..core import ring, wire
from ..core.buffers import SpareBuffers
from ..errors import ProtocolError, RendezvousError
from ..job.ports import PortRange
from .handshake import HELLO, PROOF_BYTES, Proofs, nodelay, read_exact, read_into
from .ports import bind_plain

__all__ = ["Incoming", "Outgoing", "Streams"]

log = logging.getLogger("ringcomm.net.streams")

_ACCEPT_SLICE = 0.5  # seconds between the accepting thread's looks at whether the plane closes


def _tune(sock: socket.socket, buffer_bytes: int) -> None:
    nodelay(sock)
    if buffer_bytes > 0:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)


class Outgoing:
    """This rank's stream to one peer: a thread that connects at the first payload, then writes the
    queued payloads in order.  ``put`` never waits; ``wait_sent`` waits until all have left."""

    def __init__(self, rank: int, peer: int, address: tuple[str, int], proofs: Proofs,
                 connect_timeout: float, buffer_bytes: int = 0) -> None:
        self.rank, self.peer, self.address = rank, peer, address
        self._proofs = proofs
        self._timeout, self._buffer_bytes = connect_timeout, buffer_bytes
        self._items: collections.deque[tuple[bytes, memoryview]] = collections.deque()
        self._cv = threading.Condition()
        self.queued = self.written = 0
        self.error: str | None = None  # why the stream broke (then nothing more is written)
        self._closing = False
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def put(self, head: bytes, payload: memoryview) -> None:
        """Queue one payload (``head`` from :data:`ringcomm.core.wire.STREAM`); ``payload`` is read later."""
        with self._cv:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"ringcomm-stream-{self.rank}-to-{self.peer}")
                self._thread.start()
            self._items.append((head, payload))
            self.queued += 1
            self._cv.notify_all()

    def wait_sent(self, timeout: float) -> bool:
        """Whether, within ``timeout`` seconds, every queued payload left or the stream broke."""
        with self._cv:
            return self._cv.wait_for(lambda: self.written == self.queued or self.error is not None, timeout)

    def close(self) -> None:
        with self._cv:
            self._closing = True
            self._items.clear()
            self._cv.notify_all()
            sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # a write waiting on a stopped peer returns
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(2.0)
        if sock is not None:
            sock.close()

    def _run(self) -> None:
        try:
            try:
                sock = socket.create_connection(self.address, timeout=self._timeout)
            except OSError as exc:
                raise ConnectionError(
                    f"cannot connect to its stream port ({exc}): a firewall between the hosts must let the port "
                    "through as it does the data plane's (RINGCOMM_PORT_RANGE keeps every port the job listens on "
                    "in a range it opens), or set RINGCOMM_STREAM_MIN_BYTES=0 on every rank") from exc
            with self._cv:
                if self._closing:  # closed while it connected: close() did not see this socket
                    sock.close()
                    return
                self._sock = sock
            _tune(sock, self._buffer_bytes)
            sock.sendall(self._proofs.hello(self.rank, self.rank, self.peer))
            if not self._proofs.holds(read_exact(sock, PROOF_BYTES), self.rank, self.peer, "answer"):
                raise ConnectionError("its answer did not prove the job secret")
            sock.settimeout(None)
            while True:
                with self._cv:
                    self._cv.wait_for(lambda: bool(self._items) or self._closing)
                    if self._closing:
                        return
                    head, payload = self._items[0]
                sock.sendall(head)
                sock.sendall(payload)
                with self._cv:
                    if self._items:
                        self._items.popleft()
                    self.written += 1
                    self._cv.notify_all()
        except (OSError, ConnectionError) as exc:
            with self._cv:
                if not self._closing:
                    self.error = f"stream to {self.address[0]}:{self.address[1]}: {exc}"
                self._cv.notify_all()


class Incoming:
    """What peers on other hosts stream to this rank: a listener, a thread that accepts, one thread
    per connection that reads, and per peer the payloads read and not yet taken.

    A connection is taken once its hello holds the job's ``proofs`` (:mod:`ringcomm.net.handshake`).  ``fileno`` turns
    readable whenever a payload arrives or a stream breaks (:meth:`clear_wake` before looking).
    """

    def __init__(self, rank: int, size: int, addr: str, proofs: Proofs, max_payload: int,
                 handshake_timeout: float, buffer_bytes: int = 0, ports: PortRange | None = None) -> None:
        self.rank, self.size = rank, size
        self._proofs, self._max, self._buffer_bytes = proofs, max_payload, buffer_bytes
        self._handshake_timeout = handshake_timeout
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            bind_plain(self._listener, addr, ports, f"rank {rank}'s payload streams")
            self._listener.listen(max(8, size))
            self._listener.settimeout(_ACCEPT_SLICE)
        except (OSError, RendezvousError):
            self._listener.close()
            raise
        self.address: list[str | int] = [addr, self._listener.getsockname()[1]]
        #: per peer, what it streamed and is not taken yet: ``(seq, tag, bytes, placed)``, ``placed`` when
        #: the bytes were read into the memory :meth:`expect` named, not into a buffer of this object's
        self.arrived: dict[int, collections.deque[tuple[int, int, np.ndarray, bool]]] = {
            r: collections.deque() for r in range(size)}
        self.broken: dict[int, str] = {}  # peer -> why its stream ended (read once what arrived is taken)
        # buffers given back, kept up to what a pass sends ahead (under _lock)
        self._spare = SpareBuffers(ring.STREAM_AHEAD_BYTES)
        self._placed: dict[int, dict[tuple[int, int], np.ndarray]] = {r: {} for r in range(size)}  # under _lock
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.fileno = self._wake_r
        self._closing = False
        self._lock = threading.Lock()
        self._socks: dict[int, socket.socket] = {}
        self._open: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._acceptor: threading.Thread | None = None  # started with the first peer on another host

    def start(self) -> None:
        """Accept peers' streams from now on (a job on one host never starts the thread)."""
        if self._acceptor is None:
            self._acceptor = threading.Thread(target=self._accept, daemon=True, name=f"ringcomm-streams-{self.rank}")
            self._acceptor.start()

    def expect(self, src: int, seq: int, tag: int, view: np.ndarray) -> None:
        """Read the payload ``(seq, tag)`` from ``src``, if it comes later, straight into ``view`` (uint8, its size)."""
        with self._lock:
            self._placed[src][(seq, tag)] = view

    def forget_before(self, src: int, seq: int) -> None:
        """Drop what :meth:`expect` was told for ``src``'s payloads of sequence numbers below ``seq``."""
        with self._lock:
            placed = self._placed[src]
            for key in [k for k in placed if k[0] < seq]:
                del placed[key]

    def take(self, src: int) -> tuple[int, int, np.ndarray, bool] | None:
        """The oldest payload ``src`` streamed that is not taken yet: ``(seq, tag, bytes, placed)``."""
        arrived = self.arrived.get(src)
        return arrived.popleft() if arrived else None

    def give_back(self, buf: np.ndarray) -> None:
        """``buf`` (from :meth:`take`) is no longer used: a later payload of its size may be read into it."""
        with self._lock:
            self._spare.give(buf)

    def _buffer(self, nbytes: int) -> np.ndarray:
        with self._lock:
            return self._spare.take(nbytes)

    def clear_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass  # full: a wake is pending already; closed: nobody waits

    def close(self) -> None:
        with self._lock:
            self._closing = True
            socks = list(self._open)
        self._listener.close()
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._acceptor is not None:
            self._acceptor.join(2 * _ACCEPT_SLICE)
        for t in self._threads:
            t.join(1.0)
        for sock in socks:
            sock.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _accept(self) -> None:
        while not self._closing:
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            with self._lock:
                if self._closing:
                    sock.close()
                    return
                self._open.append(sock)
                t = threading.Thread(target=self._serve, args=(sock,), daemon=True,
                                     name=f"ringcomm-stream-in-{self.rank}")
                self._threads.append(t)
            t.start()

    def _serve(self, sock: socket.socket) -> None:
        """Check one connection's hello, then read its payloads until it ends."""
        peer = -1
        try:
            sock.settimeout(self._handshake_timeout)
            hello = bytearray(HELLO.size)
            if not read_into(sock, memoryview(hello)):
                raise ConnectionError("closed before its hello")
            peer, proof = HELLO.unpack(bytes(hello))
            valid = 0 <= peer < self.size and peer != self.rank and self._proofs.holds(proof, peer, self.rank, "hello")
            with self._lock:
                if not valid or peer in self._socks:
                    peer = -1
                    log.warning("rank %d: refused a stream connection that did not prove the job secret",
                                self.rank)
                    sock.close()
                    return
                self._socks[peer] = sock
            sock.sendall(self._proofs.of(peer, self.rank, "answer"))
            sock.settimeout(None)
            _tune(sock, self._buffer_bytes)
            arrived = self.arrived[peer]
            head = bytearray(wire.STREAM.size)
            head_view = memoryview(head)
            while read_into(sock, head_view):
                msg = wire.parse_stream_head(bytes(head), self._max)
                with self._lock:
                    buf = self._placed[peer].pop((msg.seq, msg.tag), None)
                placed = buf is not None and buf.nbytes == msg.nbytes
                if not placed:
                    buf = self._buffer(msg.nbytes)
                assert buf is not None
                if msg.nbytes and not read_into(sock, buf.data):
                    raise ConnectionError("the stream ended between a head and its payload")
                arrived.append((msg.seq, msg.tag, buf, placed))
                self._wake()
            why = "the peer closed its stream"
        except (OSError, ConnectionError, ProtocolError, struct.error) as exc:
            why = str(exc) or type(exc).__name__
        if peer >= 0 and not self._closing:
            self.broken[peer] = why
            self._wake()



class Streams:
    """A data plane's streams: its listener, its streams out, and where each peer on another host
    listens.  Owned by the engine thread; the threads inside hand payloads over through queues.

    A peer is streamed to, and read from, only if both ranks listen (``carries``).  Errors come
    back as values (``put`` and ``broken`` return why a stream broke); the data plane names the
    peer as lost.
    """

    def __init__(self, rank: int, size: int, key: bytes, job_id: str, round_: int, min_bytes: int,
                 max_payload: int, timeout: float, buffer_bytes: int = 0) -> None:
        self.rank, self.size, self.min_bytes = rank, size, min_bytes
        self._proofs = Proofs(key, "stream", job_id, round_)
        self._max, self._timeout, self._buffer_bytes = max_payload, timeout, buffer_bytes
        self.incoming: Incoming | None = None
        self.outgoing: dict[int, Outgoing] = {}
        self._to: dict[int, tuple[str, int]] = {}  # peer -> where it listens

    def listen(self, addr: str, ports: PortRange | None = None) -> list[str | int] | None:
        """Start listening on ``addr``, on a port of ``ports`` (None: any free one); ``[address, port]``
        to publish, or None (off, or no port)."""
        if self.min_bytes <= 0 or self.size < 2:
            return None
        rank = self.rank
        try:
            self.incoming = Incoming(rank, self.size, addr, self._proofs, self._max,
                                     max(1.0, min(self._timeout, 10.0)), self._buffer_bytes, ports)
        except (OSError, RendezvousError) as exc:
            log.warning("rank %d: payload streams across hosts off (payloads for other hosts go through the data "
                        "sockets): cannot listen on %s (%s)", rank, addr, exc)
            return None
        return self.incoming.address

    def add_peer(self, peer: int, address: list | None) -> None:
        """``peer`` is on another host and listens at ``address`` (None: it does not)."""
        if address and self.incoming is not None:
            self._to[peer] = (str(address[0]), int(address[1]))
            self.incoming.start()

    def carries(self, peer: int) -> bool:
        return peer in self._to

    def put(self, dst: int, seq: int, tag: int, payload: np.ndarray) -> str | None:
        """Queue a 1-D uint8 ``payload`` (read later: left alone until :meth:`wait_sent`) for ``dst``;
        why the stream broke, if it did."""
        out = self.outgoing.get(dst)
        if out is None:
            out = self.outgoing[dst] = Outgoing(self.rank, dst, self._to[dst], self._proofs, max(1.0, self._timeout),
                                                self._buffer_bytes)
        if out.error is None:
            out.put(wire.STREAM.pack(b"T", seq, tag, payload.nbytes), payload.data)
        return out.error

    @property
    def wake_fd(self) -> int | None:
        """Readable when a payload arrived or a stream broke (None: nothing listens)."""
        return None if self.incoming is None else self.incoming.fileno

    def clear_wake(self) -> None:
        if self.incoming is not None:
            self.incoming.clear_wake()

    def take(self, src: int) -> tuple[int, int, np.ndarray, bool] | None:
        return None if self.incoming is None else self.incoming.take(src)

    def expect(self, src: int, seq: int, tag: int, view: np.ndarray) -> None:
        if self.incoming is not None and view.nbytes >= self.min_bytes and self.carries(src):
            self.incoming.expect(src, seq, tag, view)

    def forget_before(self, src: int, seq: int) -> None:
        if self.incoming is not None and self.carries(src):
            self.incoming.forget_before(src, seq)

    def waiting(self, src: int) -> bool:
        """Whether something from ``src`` waits to be taken: a payload, or the news that its stream broke."""
        return self.incoming is not None and bool(self.incoming.arrived[src] or src in self.incoming.broken)

    def give_back(self, buf: np.ndarray) -> None:
        if self.incoming is not None:
            self.incoming.give_back(buf)

    def broken(self, src: int) -> str | None:
        """Why ``src``'s stream to this rank ended, once everything it brought is taken."""
        return None if self.incoming is None else self.incoming.broken.get(src)

    def close(self) -> None:
        for out in self.outgoing.values():
            out.close()
        self.outgoing.clear()
        if self.incoming is not None:
            self.incoming.close()
            self.incoming = None
        self._to.clear()
