"""Data plane: one ZeroMQ PAIR socket per pair of ranks, shared memory on the same host.

Owned by the engine thread.  Messages on a pair's socket:

- ``S`` notification (same host): the payload is in shared-memory slot
  ``slot`` of the sender's ring to this rank; the receiver acks the slot once
  it has used it.  The sender alone decides whether a ring is used and its
  shape (sized from the room in /dev/shm, :mod:`ringcomm.shm.space`); the
  receiver maps whatever ring it is told of, whatever its own settings.
- ``I`` inline: the payload travels in a second ZeroMQ frame (other hosts,
  small payloads, or no free slot).  Large inline payloads go zero-copy and
  tracked; ``flush()`` waits until ZeroMQ has released them.
- ``A`` ack: the sender may reuse that slot.
- ``R``, ``B``, ``P``, ``Y`` (same host): a payload read from the sender's memory, and the answers
  and probe that go with it (:mod:`ringcomm.shm.cross_memory`); ``flush()`` waits for the answers.

Payloads of at least ``stream_min_bytes`` for a rank on another host go over a TCP stream per
direction instead (:mod:`.streams`), and are received like inline ones.

Data messages carry ``(seq, tag)``; one that arrives before it is asked for
(another segment or op from the same peer) waits in a per-peer stash.  An op
owns ``seq_stride`` consecutive sequence numbers, which may be received in any
interleaving (``recv_first``: several ring passes of one op at once); the
messages of earlier ops are over.  A
message that does not parse (``wire.parse_data``) is dropped and logged at
DEBUG; frames larger than a segment are refused by ZeroMQ (``MAXMSGSIZE``).

Nothing is left on the file system when a rank is killed: on Linux the ipc
endpoints live in the abstract socket namespace (no files), and a
shared-memory ring's name is unlinked as soon as both sides have it mapped
(by the receiver when it maps it, by the sender at the first ack, and by the
receiver at close for a ring it never mapped).

Every connection is authenticated at the handshake (:mod:`.auth`): the bound
sockets are security servers checked by the context's ZAP handler, the
connecting ones present credentials derived from the job secret.  A stranger
is refused before it can take a bound PAIR socket's single slot, so what a
socket receives comes from the one peer it was meant for.  (The abstract ipc
namespace has no file permissions: any local user can connect, and is refused
there.)
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import zmq

from ..job import names
from ..job.ports import PortRange
from ..shm import space as shm_space
from ..shm.cross_memory import CrossMemory
from ..shm.rings import PeerRings
from ..core import wire
from ..core.inbox import Inbox
from .auth import Credentials
from ..errors import PeerLostError, ProtocolError
from .pair import pair_socket
from .peers import PeerWatch
from .ports import bind_zmq
from .serving import ControlStep, WaitServing
from .streams import Streams

log = logging.getLogger("ringcomm.net.transport")

_NOTE, _INLINE, _ACK = wire.NOTE, wire.INLINE, wire.ACK  # layouts live in the pure codec
_SLICE = 1.0  # seconds a blocked receive waits before it checks whether a peer is gone
#: Seconds past RINGCOMM_PEER_TIMEOUT before a rank waiting on one peer gives up on it: a stopped or
#: wedged process is found by its heartbeats first (on every rank connected to it, so all of them
#: name it), not by a rank that only waits behind it in a ring and would blame its innocent neighbour
_HEARTBEAT_GRACE = 2 * _SLICE
#: Seconds a rank whose peer's stream broke waits for that peer's notice of a rank it lost itself
_NOTICE_GRACE = 0.2


class _Placed(NamedTuple):
    """A payload read straight into the memory named by :meth:`DataPlane.expect`."""

    view: np.ndarray


class DataPlane:
    """Point-to-point messaging between the ranks of one job (implements ``algorithms.Link``)."""

    def __init__(self, ctx: zmq.Context, rank: int, size: int, zero_copy_min_bytes: int, peer_timeout: float,
                 socket_buffer_bytes: int = 0, shm_slots: int = 0, shm_slot_bytes: int = 0,
                 shm_min_bytes: int = 65536, job_id: str = "", round_: int = 0,
                 max_payload_bytes: int = 0, *, credentials: Credentials, seq_stride: int = 1,
                 stream_min_bytes: int = 0, cross_memory_min_bytes: int = 0) -> None:
        """``credentials``: what the bound sockets check and the connecting ones present; ``ctx``
        must already have a ZAP handler for them (:class:`ringcomm.net.auth.ZapThread`).  ``seq_stride``:
        how many sequence numbers each op owns (``seq // seq_stride`` numbers the op).
        ``stream_min_bytes``: payloads of at least this many bytes for peers on other hosts go over
        :mod:`.streams` (0: never; never with encrypting credentials, as streams are in clear).
        ``cross_memory_min_bytes``: payloads of at least this many bytes for peers on this host are read
        from this process's memory by the peer where the host allows it (:mod:`ringcomm.shm.cross_memory`;
        0: never)."""
        self.rank = rank
        self.size = size
        self._ctx = ctx
        self._creds = credentials
        self._zc_min = zero_copy_min_bytes
        self._timeout = peer_timeout
        self._sockbuf = socket_buffer_bytes
        #: shared-memory rings to and from peers on this host: their shapes and free slots
        self.rings = PeerRings(rank, job_id, round_, shm_slots, shm_slot_bytes, shm_min_bytes)
        #: payloads for and from peers on this host that are read from the sender's memory
        self.cross = CrossMemory(cross_memory_min_bytes)
        self._job, self._round = job_id, round_
        self._max_payload = max_payload_bytes  # no data frame is larger (a segment); 0: no bound
        #: payload streams to and from peers on other hosts (see listen_streams())
        self.streams = Streams(rank, size, credentials.password, job_id, round_,
                               stream_min_bytes if not credentials.encrypted else 0,
                               max_payload_bytes or (1 << 62), peer_timeout, socket_buffer_bytes)
        self._socks: dict[int, zmq.Socket] = {}
        self._trackers: dict[int, zmq.MessageTracker] = {}
        #: what arrived from each peer and is not taken yet (and which arrivals are stale)
        self.inbox = Inbox(seq_stride)
        self._serving = WaitServing()  # see serve_while_waiting()
        self._either_pollers: dict[int, zmq.Poller] = {}
        self._reserved: dict[int, int] = {}
        self._lent: dict[int, list[np.ndarray]] = collections.defaultdict(list)  # read-into buffers handed out
        self.ipc_paths: list[str] = []  # socket files this rank bound (ZeroMQ leaves them behind)
        #: which peers are still there (reads the sockets above); its maps are shared, never rebound
        self.peers = PeerWatch(rank, size, peer_timeout, self._socks, shm_space.MAX_SLOTS, shm_slot_bytes,
                               (lambda r: names.lost_notice(job_id, round_, r)) if job_id else None)
        self.unconnected, self.suspects, self.lost = self.peers.unconnected, self.peers.suspects, self.peers.lost
        self.reports, self.peer_names = self.peers.reports, self.peers.peer_names
        #: messages sent through shared memory / inline, for the benchmark and the performance page's numbers
        self.stats: collections.Counter[str] = collections.Counter()

    def _socket(self, peer: int, server: bool) -> zmq.Socket:
        sock = pair_socket(self._ctx, self._creds, server, self._timeout, _SLICE, self._max_payload, self._sockbuf)
        self._socks[peer] = sock
        self.peers.watch(peer, sock)
        return sock

    # -- peer loss (ringcomm.net.peers) -----------------------------------------

    @property
    def monitor_sockets(self) -> list[zmq.Socket]:
        return list(self.peers.monitors.values())

    def check_peers(self) -> dict[int, str]:
        """Read pending connection events; returns the peers found lost by this call."""
        return self.peers.check_peers()

    def raise_if_lost(self, awaited: int, what: str = "data", sending: bool = False) -> None:
        """Raise :class:`PeerLostError` if a peer is found gone, naming the rank that failed first."""
        self.peers.raise_if_lost(awaited, what, sending)

    def culprit(self, awaited: int = -1) -> int:
        """The rank to blame among the lost ones (:meth:`ringcomm.net.peers.PeerWatch.culprit`)."""
        return self.peers.culprit(awaited)

    def lost_error(self, peer: int, context: str = "") -> PeerLostError:
        """The error naming ``peer``, with how its loss was learned; tells the other peers, once."""
        return self.peers.lost_error(peer, context)

    # -- setup ---------------------------------------------------------------

    def bind(self, ipc_base: str, tcp_host: str, ports: PortRange | None = None) -> list[list[str] | None]:
        """Bind one socket for each higher-ranked peer, its TCP end on a port of ``ports`` (None: any
        free one); returns ``[ipc, tcp]`` endpoints by peer rank."""
        table: list[list[str] | None] = [None] * self.size
        for peer in range(self.rank + 1, self.size):
            sock = self._socket(peer, server=True)
            ipc = f"{ipc_base}-{peer}"
            sock.bind(ipc)
            path = names.ipc_file(ipc)
            if path is not None:
                self.ipc_paths.append(path)
            table[peer] = [sock.getsockopt_string(zmq.LAST_ENDPOINT),
                           bind_zmq(sock, tcp_host, ports, f"rank {self.rank}'s data socket for rank {peer}")]
        return table

    def listen_streams(self, tcp_host: str, ports: PortRange | None = None) -> list[str | int] | None:
        """Listen for peers' payload streams (:mod:`.streams`) on a port of ``ports`` (None: any free
        one); ``[address, port]`` to publish, or None when this rank uses none (off, encrypted, or no
        port free).  Peers stream to this rank only if it listens."""
        return self.streams.listen(tcp_host, ports)

    def connect(self, peer: int, endpoints: list[list[str] | None], same_host: bool, description: str,
                pid: int | None = None, stream: list | None = None) -> None:
        """Connect to a lower-ranked peer's socket for this rank; set up shared memory with same-host peers;
        ``stream``: where a peer on another host listens for streams (:meth:`listen_streams`), if it does."""
        self.peers.expect(peer, description, pid if same_host else None)
        if not same_host:
            self.streams.add_peer(peer, stream)
        if peer < self.rank:
            eps = endpoints[self.rank]
            if eps is None:
                raise ValueError(f"rank {peer} published no endpoint for rank {self.rank}")
            self._socket(peer, server=False).connect(eps[0] if same_host else eps[1])
        if same_host:
            self.rings.add_peer(peer)
            self.cross.add_peer(peer, pid)

    def close(self) -> None:
        self.peers.close()
        for sock in self._socks.values():
            sock.close(200 if self.peers.noticed else 0)  # a notice of a lost peer gets a moment to leave
        self.streams.close()  # after: a peer reads this rank's notice before its streams end, if it can
        self._socks.clear()
        self._trackers.clear()
        self.inbox.clear()
        self.rings.close()
        self.cross.close()
        names.remove_files(self.ipc_paths)
        self.ipc_paths.clear()

    # -- Link ----------------------------------------------------------------

    def expect(self, src: int, seq: int, tag: int, view: np.ndarray) -> None:
        """The payload ``(seq, tag)`` from ``src`` goes to ``view`` (1-D, contiguous, its size): if it comes
        over a stream or from a same-host peer's memory, it is read straight there, and :meth:`recv` returns
        that memory (nothing to copy).  Until then this rank leaves ``view`` alone."""
        if self.streams.carries(src):
            self.streams.expect(src, seq, tag, view.view(np.uint8))
        else:
            self.cross.expect(src, seq, tag, view.view(np.uint8))

    def reserve(self, dst: int, nbytes: int) -> np.ndarray | None:
        """A free shared-memory slot to ``dst`` to write a payload into directly, or None.

        The caller fills it and calls :meth:`commit`; that saves the copy ``send`` makes.
        """
        if not self.rings.fits(nbytes):
            return None
        ring = self.rings.out_ring(dst)
        if ring is None or nbytes > ring.slot_bytes:
            return None
        free = self.rings.free[dst]
        if not free:
            self._pump(dst, block=False)
            if not free:
                return None
        slot = free.popleft()
        self._reserved[dst] = slot
        return ring.slot(slot, nbytes)

    def commit(self, dst: int, seq: int, tag: int, view: np.ndarray) -> None:
        """Send the slot filled after :meth:`reserve`."""
        slot = self._reserved.pop(dst)
        self._send(dst, [_NOTE.pack(b"S", slot, view.nbytes, seq, tag)])
        self.stats["shm_direct"] += 1

    def queues_by_reference(self, dst: int, nbytes: int) -> bool:
        """Whether :meth:`send` of ``nbytes`` to ``dst`` queues the caller's array itself (a stream to
        another host): queued sends then hold no memory of their own and no slot of a ring."""
        return nbytes >= self.streams.min_bytes > 0 and self.streams.carries(dst)

    def send(self, dst: int, seq: int, tag: int, arr: np.ndarray) -> None:
        payload = arr if arr.ndim == 1 else arr.reshape(-1)
        if payload.dtype != np.uint8:
            payload = payload.view(np.uint8)
        n = payload.nbytes
        if self.cross.by_reference(dst, n):
            self._send(dst, [self.cross.lend(dst, payload, seq, tag)])
            self.stats["cross_memory"] += 1
            return
        probe = self.cross.probe(dst, n)
        if probe is not None:  # this payload goes the usual way; later ones by reference, if the peer can read
            self._send(dst, [probe])
        if self.queues_by_reference(dst, n):
            broke = self.streams.put(dst, seq, tag, payload)
            if broke is not None:
                raise self._stream_lost(dst, broke, outgoing=True)
            self.stats["stream"] += 1
            return
        ring = self.rings.out_ring(dst) if self.rings.fits(n) else None
        if ring is not None and n > ring.slot_bytes:  # a ring made small for lack of room
            ring = None
            self.stats["shm_small"] += 1
        if ring is not None:
            free = self.rings.free[dst]
            if not free:
                self._pump(dst, block=False)
            if free:
                slot = free.popleft()
                ring.slot(slot, n)[...] = payload
                self._send(dst, [_NOTE.pack(b"S", slot, n, seq, tag)])
                self.stats["shm"] += 1
                return
            self.stats["shm_full"] += 1
        header = _INLINE.pack(b"I", seq, tag)
        self.stats["inline"] += 1
        # A same-host peer whose slots are all in use is behind: copying costs nothing on the critical
        # path, and a job on one host never starts pyzmq's zero-copy tracking thread for a rare case.
        if n < self._zc_min or ring is not None:
            self._send(dst, [header, payload])
        else:
            tracker = self._send(dst, [header, payload], copy=False)
            if tracker is not None:  # always, for a zero-copy send
                self._trackers[dst] = tracker

    def _stream_lost(self, peer: int, why: str, outgoing: bool = False) -> PeerLostError:
        """The error for ``peer``'s stream breaking: a rank that leaves because it lost another one
        sends a notice on its socket first, and that rank is named instead (the notice and the stream's
        end travel on different connections, so the notice gets a moment to arrive)."""
        self.raise_if_lost(peer)  # a loss found first names the rank that failed first
        sock = self._socks.get(peer)
        if sock is not None and peer not in self.peers.reports:
            sock.poll(int(_NOTICE_GRACE * 1000), zmq.POLLIN)
        self.peers.lost.setdefault(peer, self.peer_names.get(peer, "?"))
        src, dst = (self.rank, peer) if outgoing else (peer, self.rank)
        broke = f"rank {src}'s payload stream to rank {dst} broke: {why}"
        culprit = self.culprit(peer)
        if culprit == peer:
            return self.peers.lost_error(peer, how=broke)
        return self.lost_error(culprit, f" ({broke})")

    def _send(self, dst: int, frames: list, copy: bool = True) -> zmq.MessageTracker | None:
        """Queue one message for ``dst`` without ever blocking on a peer that is gone.

        A bound PAIR socket whose peer died has no pipe, and a plain send would wait for one
        forever.  Sends here never block: while ZeroMQ cannot take the message the socket is
        polled in slices, between which the connection monitors are read (a lost peer raises
        :class:`PeerLostError` naming it) and, after RINGCOMM_PEER_TIMEOUT with no way to
        send, the peer is declared lost.  Zero-copy sends (``copy=False``) return their tracker.
        """
        sock = self._socks[dst]
        waited = 0.0
        while True:
            try:
                return sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=copy, track=not copy)
            except zmq.Again:
                pass
            if sock.poll(int(_SLICE * 1000), zmq.POLLOUT):
                continue
            waited = self._slice_waited(
                dst, waited, "room to send", True,
                f"could not send to rank {dst} ({self.peer_names.get(dst, '?')}) for {self._timeout:.0f} s: it is "
                "not connected to this rank (it died, never connected, or hangs). Raise RINGCOMM_PEER_TIMEOUT if it "
                "is only slow.")

    def _slice_waited(self, peer: int, waited: float, what: str, sending: bool, timeout_message: str) -> float:
        """One more slice spent waiting on ``peer``: raises if a peer is lost or ``peer`` used up the peer
        timeout (``timeout_message``, after the rank); returns the time waited so far."""
        waited += _SLICE
        self.raise_if_lost(peer, what, sending=sending)
        if waited >= self._timeout + _HEARTBEAT_GRACE:
            self.peers.notify_lost(peer)  # so that the peers waiting on this rank name ``peer`` too
            raise PeerLostError(f"rank {self.rank}: lost rank {peer}: {timeout_message}")
        return waited

    def _no_data(self, src: int) -> str:
        return (f"no data from rank {src} ({self.peer_names.get(src, '?')}) for {self._timeout:.0f} s; the peer "
                "hangs or is stopped. Raise RINGCOMM_PEER_TIMEOUT if it is only slow.")

    def _pump(self, src: int, block: bool) -> tuple[int, int] | None:
        """Take one message from ``src``: apply an ack, or stash data.  Returns the data key, if any."""
        sock = self._socks[src]
        streams = self.streams.carries(src)
        waited = 0.0
        while True:
            if streams:
                if block:  # before looking: a payload that arrives after the look wakes the poll below
                    self.streams.clear_wake()
                key = self._streamed(src)
                if key is not None:
                    return key
            try:
                frames = sock.recv_multipart(copy=False, flags=0 if block and not streams else zmq.NOBLOCK)
            except zmq.Again:
                if not block:
                    return None
                if streams and self._wait_either(src):
                    continue
                # a slice passed with no data: has a peer gone?
                waited = self._slice_waited(
                    src, waited, "data", False,
                    self._no_data(src))
                continue
            try:
                key = self._accept(src, frames)
                if key is None and self.lost:  # a notice: the peer lost a rank and is failing
                    self.raise_if_lost(src)
                return key
            except ProtocolError as exc:
                # Not something a ringcomm peer sends: drop it (the stream itself is intact,
                # since ZeroMQ delivers whole messages) and keep waiting for real data.
                self.stats["dropped"] += 1
                log.debug("rank %d: dropped a data message from rank %d: %s", self.rank, src, exc)
                if not block:
                    return None

    def _streamed(self, src: int) -> tuple[int, int] | None:
        """Stash the oldest payload ``src`` streamed to this rank, if any; its key.  Raises once the stream
        broke and everything it brought is taken."""
        while (got := self.streams.take(src)) is not None:
            seq, tag, buf, placed = got
            try:
                self.inbox.put(src, seq, tag, _Placed(buf) if placed else buf)
            except ProtocolError as exc:
                self.stats["dropped"] += 1
                log.debug("rank %d: dropped a streamed payload from rank %d: %s", self.rank, src, exc)
                continue
            self.stats["stream_placed"] += placed
            return seq, tag
        why = self.streams.broken(src)
        if why is not None:
            raise self._stream_lost(src, why)
        return None

    def _wait_either(self, src: int) -> bool:
        """Wait one slice for ``src``'s socket or a streamed payload; whether either came."""
        poller = self._either_pollers.get(src)
        if poller is None:
            poller = self._either_pollers[src] = zmq.Poller()
            poller.register(self._socks[src], zmq.POLLIN)
            poller.register(self.streams.wake_fd, zmq.POLLIN)
        return bool(poller.poll(int(_SLICE * 1000)))

    def _accept(self, src: int, frames: list) -> tuple[int, int] | None:
        """Apply an ack or stash a payload; raises :class:`ProtocolError` for a malformed message."""
        # any shape the sender chose passes here; the ring itself bounds its slots below
        msg = wire.parse_data(frames[0].bytes, len(frames), shm_space.MAX_SLOTS, self.rings.slot_bytes)
        if msg.kind == b"L":  # the peer lost a rank and is failing: the error will name that rank
            self.peers.noted(src, msg.lost)
            return None
        if msg.kind == b"A":
            self.rings.acked(src, msg.slot)
            return None
        if msg.kind in (b"R", b"B", b"P", b"Y"):
            return self._cross_memory(src, msg)
        if msg.kind == b"S":
            ring = self.rings.in_ring(src)
            if msg.slot >= ring.slots or msg.nbytes > ring.slot_bytes:
                raise ProtocolError(f"data notification for slot {msg.slot} of {msg.nbytes} bytes; rank {src}'s ring "
                                    f"has {ring.slots} slots of {ring.slot_bytes} bytes")
            self.inbox.put(src, msg.seq, msg.tag, [msg.slot, msg.nbytes])
        else:
            self.inbox.put(src, msg.seq, msg.tag, frames[1])
        self.cross.settled(src, msg.seq, msg.tag)
        return msg.seq, msg.tag

    def _cross_memory(self, src: int, msg: wire.DataMessage) -> tuple[int, int] | None:
        """Apply a message of reading a same-host peer's memory (:mod:`ringcomm.shm.cross_memory`)."""
        try:
            reply, got = self.cross.take(src, msg, self._max_payload)
        except OSError as exc:
            raise self.lost_error(src, f" (reading its payload of {msg.nbytes} bytes from its memory failed: {exc}; "
                                  "RINGCOMM_CROSS_MEMORY_MIN_BYTES=0 sends them through shared memory)") from exc
        if reply is not None:
            self._send(src, [reply])
        if got is None:
            return None
        buf, placed = got
        self.inbox.put(src, msg.seq, msg.tag, _Placed(buf) if placed else buf)
        self.stats["cross_memory_read"] += 1
        return msg.seq, msg.tag

    def _ack_held(self, src: int) -> None:
        lent = self._lent.get(src)
        if lent:  # buffers of a stream (a peer on another host) or of a same-host peer's payloads
            owner = self.streams if self.streams.carries(src) else self.cross
            for buf in lent:
                owner.give_back(buf)
            lent.clear()
        held = self.rings.held.get(src)
        if held:
            for slot in held:
                self._send(src, [_ACK.pack(b"A", slot)])
            held.clear()

    def _enter(self, src: int, seq: int) -> None:
        """This rank now receives op ``seq`` from ``src``: earlier ops' messages are stale from here on."""
        first = self.inbox.enter(src, seq)
        if first is not None:
            self.streams.forget_before(src, first)
            self.cross.forget_before(src, first)

    def serve_while_waiting(self, control: ControlStep) -> None:
        """While a receive waits for a peer's data, also watch ``control.socket`` and run ``control.step()``
        whenever it is readable (rank 0's control: :mod:`.serving`)."""
        self._serving.serve(control)

    def _serve_until_data(self, src: int) -> None:
        """Run the serving hook until ``src`` sends something (or a slice passes)."""
        if self._serving.socket is None:
            return
        streams = self.streams.wake_fd if self.streams.carries(src) else None
        if streams is not None:
            self.streams.clear_wake()  # before looking: a payload that arrives after the look wakes the poll
            if self.streams.waiting(src):
                return
        self._serving.until_data(src, self._socks[src], streams)

    def recv(self, src: int, seq: int, tag: int) -> memoryview | np.ndarray:
        self._ack_held(src)  # the view returned last time has been used by now
        self._enter(src, seq)
        if not self.inbox.has(src, seq, tag):
            self._serve_until_data(src)
        while not self.inbox.has(src, seq, tag):
            self._pump(src, block=True)
        return self._open(src, self.inbox.take(src, seq, tag))

    def recv_any(self, src: int, seq: int) -> tuple[int, memoryview | np.ndarray]:
        """The next payload of op ``seq`` from ``src``, whichever tag arrives first."""
        self._ack_held(src)
        self._enter(src, seq)
        waiting = self.inbox.take_op(src, seq)
        if waiting is not None:
            return waiting[0], self._open(src, waiting[1])
        self._serve_until_data(src)
        while True:
            got = self._pump(src, block=True)
            if got is not None and got[0] == seq:
                return got[1], self._open(src, self.inbox.take(src, *got))

    def recv_first(self, wants: Sequence[tuple[int, int]]) -> tuple[int, int, memoryview | np.ndarray]:
        """The next payload of any of the ops ``wants`` (``(src, seq)`` pairs, of one op's sequence
        numbers per peer): ``(index in wants, tag, payload)``.  Waits like :meth:`recv`, on all at once."""
        for src, seq in wants:
            self._ack_held(src)
            self._enter(src, seq)
        for i, (src, seq) in enumerate(wants):
            if (waiting := self.inbox.take_op(src, seq)) is not None:
                return i, waiting[0], self._open(src, waiting[1])
        poller = zmq.Poller()
        srcs = list(dict.fromkeys(src for src, _ in wants))
        for src in srcs:
            poller.register(self._socks[src], zmq.POLLIN)
        ctrl = self._serving.socket
        if ctrl is not None:
            poller.register(ctrl, zmq.POLLIN)
        wake = self.streams.wake_fd if any(self.streams.carries(s) for s in srcs) else None
        if wake is not None:
            poller.register(wake, zmq.POLLIN)
        waited = 0.0
        events: dict = {}
        woke = wake is not None  # payloads streamed earlier wait in their queues with no wake pending
        while True:
            if woke:  # before looking: a payload that arrives after the look wakes the next poll
                self.streams.clear_wake()
            for src in srcs:
                if self._socks[src] not in events and not (woke and self.streams.carries(src)):
                    continue
                while (got := self._pump(src, block=False)) is not None:
                    for i, want in enumerate(wants):
                        if want == (src, got[0]):
                            return i, got[1], self._open(src, self.inbox.take(src, *got))
            events = dict(poller.poll(int(_SLICE * 1000)))
            if ctrl is not None and ctrl in events:
                self._serving.step()
            woke = wake is not None and wake in events
            if not events:
                src = wants[0][0]
                waited = self._slice_waited(
                    src, waited, "data", False,
                    self._no_data(src))

    def _open(self, src: int, item: object) -> memoryview | np.ndarray:
        if isinstance(item, list):
            slot, n = item
            self.rings.held[src].append(slot)
            return self.rings.in_ring(src).slot(slot, n)
        if isinstance(item, _Placed):  # read straight to where the caller wanted it
            return item.view
        if isinstance(item, np.ndarray):  # read into a buffer that is reused once the caller is done with it
            self._lent[src].append(item)
            return item
        return item.buffer  # type: ignore[attr-defined]

    def flush(self) -> None:
        """Hand back every used slot and wait until ZeroMQ has released every zero-copy send, each stream
        has written its payloads and each same-host peer has read those it was sent by reference."""
        for src in {*self.rings.held, *self._lent}:
            self._ack_held(src)
        for dst in self.cross.lent_to():
            while self.cross.lent(dst):  # its answers come on its socket: take them (and stash any data)
                self._pump(dst, block=True)
        for dst, tracker in self._trackers.items():
            waited = 0.0
            while True:  # in slices, so a peer that died with data in flight is named at once
                try:
                    tracker.wait(_SLICE)
                    break
                except zmq.NotDone:
                    pass
                waited = self._slice_waited(
                    dst, waited, "its data to be taken", True,
                    f"rank {dst} ({self.peer_names.get(dst, '?')}) did not take its data within {self._timeout:.0f} s")
        self._trackers.clear()
        for dst, out in self.streams.outgoing.items():
            waited = 0.0
            while not out.wait_sent(_SLICE):
                waited = self._slice_waited(
                    dst, waited, "its data to be taken", True,
                    f"rank {dst} ({self.peer_names.get(dst, '?')}) did not take its data within {self._timeout:.0f} s")
            if out.error is not None:
                raise self._stream_lost(dst, out.error, outgoing=True)
