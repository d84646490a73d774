"""The engine: one background thread per process that owns every socket.

User threads call :meth:`Engine.submit` (append to a queue, poke a pipe) and
wait on the returned :class:`Handle`.  The engine thread

1. drains the queue and announces the new ops to rank 0 (an id from the
   response cache when the same request was seen before),
2. on rank 0, feeds every rank's announcements to the :class:`Coordinator`
   and sends the resulting ordered responses to all ranks,
3. executes each response in that order (the data movement is
   :class:`ringcomm.executor.Executor`'s: pack fused tensors, run the ring or
   the shared-memory allreduce, unpack) and completes the handles.

It sleeps in ``zmq.Poller.poll`` with no timeout when idle, so an idle job uses
no CPU.
"""

from __future__ import annotations

import collections
import logging
import os
import sys
import threading
import time
from typing import Any

import numpy as np
import zmq

from . import auth, hierarchical, ops, shm_allreduce, wire
from .cache import ResponseCache
from .config import Settings
from .controller import Controller
from .coordinator import SHUTDOWN_NAME, set_label
from .errors import (
    HorovodInternalError, InvalidInputError, MismatchError, PeerLostError, ProtocolError, ShutdownError, StallError,
)
from .executor import Executor
from .handles import Entry, Handle
from .ops import ReduceOp
from .serving_link import ServingLink
from .timeline import Timeline
from .topology import Topology
from .transport import DataPlane, ipc_base, ipc_file, remove_files
from .wire import Request, Response

log = logging.getLogger("ringcomm.engine")




class _NullLink:
    """The link of a single-process job: never sends."""

    rank = 0
    size = 1

    def send(self, dst: int, seq: int, tag: int, arr: np.ndarray) -> None:  # pragma: no cover
        raise AssertionError("single-process job has no peers")

    def recv(self, src: int, seq: int, tag: int) -> object:  # pragma: no cover
        raise AssertionError("single-process job has no peers")

    def flush(self) -> None:
        pass


def _check_same_security(table: list[dict], rank: int) -> None:
    """Raise when ranks disagree on ``RINGCOMM_ENCRYPT``: their handshakes would fail for ever."""
    flags = {int(peer["rank"]): bool(peer.get("encrypt", False)) for peer in table}
    if len(set(flags.values())) > 1:
        on = [r for r, f in sorted(flags.items()) if f]
        off = [r for r, f in sorted(flags.items()) if not f]
        raise InvalidInputError(
            f"rank {rank}: ranks {on} run with RINGCOMM_ENCRYPT=1 and ranks {off} without; encrypted and "
            f"plain sockets cannot connect. Set RINGCOMM_ENCRYPT to the same value on every rank."
        )


#: A process set's id goes into the high bits of its ops' data-plane sequence numbers: members of a
#: set count that set's ops alike, and messages of different sets never share a number.
_PSET_SHIFT = 40
#: When a peer is lost while ops are pending, how long a rank other than 0 waits for rank 0's answer
#: that may already be on its way (the error that made the peer leave)
_LATE_ANSWER_MS = 200
#: How long rank 0's control socket keeps unsent answers when it closes (to ranks still connected)
_FINAL_ANSWERS_LINGER_MS = 500


class Engine(Executor):
    """Owns the sockets of one rank and executes collectives in rank 0's order."""

    def __init__(self, topo: Topology, settings: Settings, round_: int = 0) -> None:
        self.topo = topo
        self.settings = settings
        self.rank, self.size = topo.rank, topo.size
        self._queue: collections.deque[Entry] = collections.deque()
        self._wake_pending = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._inflight: dict[tuple[int, str], Entry] = {}
        # per process set: its global ranks, its own op count and response cache (every member
        # records the set's responses in the same order; rank 0 records every set's)
        self._sets: dict[int, tuple[int, ...]] = {0: tuple(range(self.size))}
        self._links: dict[int, Any] = {}
        self._host_plans: dict[int, Any] = {}  # process set -> hierarchical.HostPlan or None (executor's cache)
        self._seqs: dict[int, int] = {0: 0}
        self._caches: dict[int, ResponseCache] = {0: ResponseCache(settings.cache_capacity)}
        self._stopping = False
        self._failed: BaseException | None = None
        self._fusion = np.empty(0, dtype=np.uint8)
        # payloads travel inside control frames, which are bounded: never more than one frame's share
        self._small = min(settings.small_allreduce_bytes_for(self.size), wire.CONTROL_DATA_BYTES) if self.size > 1 else 0
        # an allgather's result is every rank's part: a rank's part goes through rank 0 up to 1/size of that
        self._small_gather = self._small // max(1, self.size)
        self._coord = Controller(self.size, settings.fusion_threshold, small_bytes=self._small) if self.rank == 0 else None
        self._payloads: dict[tuple[int, str], dict[int, bytes]] = {}  # rank 0: small allreduce data sent with requests
        self._canon: dict[tuple[int, str], Request] = {}  # rank 0: the first request seen per op, for the caches
        self._backlog: collections.deque[Response] = collections.deque()  # rank 0: emitted, not yet executed
        self._executing = False
        self._serving: ServingLink | None = None
        self._warned_stalls: set[tuple[int, str]] = set()
        self._phases: list[tuple[str, float, float]] = []
        self._star_spans: dict[tuple[Any, ...], tuple[float, float]] = {}  # timeline: rank 0's small reductions
        self._last_emit = 0.0
        self._thread: threading.Thread | None = None
        self._idents = {r: f"rank{r}".encode() for r in range(1, self.size)}
        self.timeline: Timeline | None = None
        if settings.timeline and self.rank == 0:
            self.timeline = Timeline(settings.timeline, self.rank, settings.timeline_mark_cycles)
        self._server: Any = None  # a rendezvous.RendezvousServer on the rank that hosts it
        self._ipc_paths: list[str] = []
        self._ctx: zmq.Context | None = None
        self._zap: auth.ZapThread | None = None
        self._ctrl: zmq.Socket | None = None
        self._link: Any = _NullLink()
        self._shm_ar: shm_allreduce.ShmAllreduce | None = None  # all ranks on one host: large allreduces
        self.peer_table: list[dict] = [{"rank": 0, "host": topo.hostname, "pid": os.getpid()}]
        if self.size > 1:
            try:
                self._connect(round_)
            except BaseException:
                self._close()  # a failed init() leaves no socket, context or file behind
                raise

    # -- setup ---------------------------------------------------------------

    def _connect(self, round_: int) -> None:
        from . import rendezvous

        topo, st = self.topo, self.settings
        # every connection to this process proves it holds the job secret before it is attached
        creds = auth.Credentials.derive(topo.secret, "job", encrypt=st.encrypt)
        ctx = self._ctx = zmq.Context(io_threads=st.io_threads)
        self._zap = auth.ZapThread(ctx, creds, f"rank {self.rank}")  # before the first bind
        link = DataPlane(
            ctx, self.rank, self.size, st.zero_copy_min_bytes, st.peer_timeout, st.socket_buffer_bytes,
            shm_slots=st.shm_slots, shm_slot_bytes=st.segment_bytes, shm_min_bytes=st.shm_min_bytes,
            job_id=topo.job_id, round_=round_, max_payload_bytes=st.segment_bytes, credentials=creds,
        )
        self._link = link  # from here on, _close() closes it
        base = ipc_base(topo.job_id, os.getpid(), round_)
        data_eps = link.bind(base + "-data", topo.addr)
        info: dict[str, Any] = {
            "rank": self.rank, "host": topo.hostname, "pid": os.getpid(), "data": data_eps,
            "encrypt": st.encrypt,  # ranks that disagree could never connect: found at init, below
        }
        if self.rank == 0:
            ctrl = self._ctrl = ctx.socket(zmq.ROUTER)
            ctrl.setsockopt(zmq.LINGER, 0)
            ctrl.setsockopt(zmq.MAXMSGSIZE, wire.MAX_CONTROL_BYTES + wire.TAG_BYTES)
            ctrl.setsockopt(zmq.ROUTER_MANDATORY, 1)
            creds.apply_server(ctrl)
            ctrl.bind(base + "-ctrl")
            ipc_ep = ctrl.getsockopt_string(zmq.LAST_ENDPOINT)
            path = ipc_file(ipc_ep)
            if path is not None:
                self._ipc_paths.append(path)
            ctrl.bind(f"tcp://{topo.addr}:0")
            info["ctrl"] = [ipc_ep, ctrl.getsockopt_string(zmq.LAST_ENDPOINT)]
            if topo.host_rendezvous:
                port = int(topo.rendezvous.rpartition(":")[2])
                self._server = rendezvous.RendezvousServer(
                    self.size, topo.secret, host=topo.rendezvous_bind, port=port
                )
        else:
            ctrl = self._ctrl = ctx.socket(zmq.DEALER)
            ctrl.setsockopt(zmq.LINGER, 0)
            ctrl.setsockopt(zmq.MAXMSGSIZE, wire.MAX_CONTROL_BYTES + wire.TAG_BYTES)
            ctrl.setsockopt(zmq.IDENTITY, f"rank{self.rank}".encode())
            creds.apply_client(ctrl)
        self._ctrl = ctrl
        if self.rank == 0:
            self._serving = ServingLink(link, ctrl, self._serve_control)
        table = rendezvous.register(
            topo.rendezvous, topo.secret, self.rank, self.size, info, st.start_timeout, round=round_,
            progress=_print_waiting if self.rank == 0 else None,
        )
        self.peer_table = table
        _check_same_security(table, self.rank)
        for peer in table:
            r = int(peer["rank"])
            same_host = peer["host"] == topo.hostname
            if r != self.rank:
                link.connect(r, peer["data"], same_host, f"host {peer['host']}, pid {peer['pid']}", peer.get("pid"))
        if shm_allreduce.usable(self.size, [p["host"] for p in table], st.shm_allreduce_min_bytes,
                                st.shm_allreduce_min_ranks):
            self._shm_ar = shm_allreduce.ShmAllreduce(topo.job_id, round_, st.shm_allreduce_piece_bytes,
                                                       st.peer_timeout)
        if self.rank != 0:
            root = table[0]
            ctrl.connect(root["ctrl"][0] if root["host"] == topo.hostname else root["ctrl"][1])
        if log.isEnabledFor(logging.DEBUG):
            self._log_setup(table, info)

    def _log_setup(self, table: list[dict], info: dict[str, Any]) -> None:
        """DEBUG: the transports this rank chose for each peer and the thresholds that pick an op's path."""
        st, host = self.settings, self.topo.hostname
        local = [int(p["rank"]) for p in table if p["host"] == host and int(p["rank"]) != self.rank]
        remote = [int(p["rank"]) for p in table if p["host"] != host]
        shm = (f"shared-memory slots ({st.shm_slots} x {st.segment_bytes} B) for payloads from {st.shm_min_bytes} B"
               if st.shm_slots > 0 and local else "no shared-memory slots")
        log.debug("rank %d: data plane: same-host peers %s over ipc sockets with %s; other-host peers %s over tcp "
                  "(%s); zero-copy sends from %d B; %s", self.rank, local, shm, remote, self.topo.addr,
                  st.zero_copy_min_bytes, "CURVE-encrypted" if st.encrypt else "authenticated, not encrypted")
        if self.rank == 0:
            log.debug("rank 0: control plane: serving the other ranks on %s", info.get("ctrl"))
        else:
            via = "ipc" if table[0]["host"] == host else "tcp"
            log.debug("rank %d: control plane: connected to rank 0 over %s", self.rank, via)
        hier = {1: "whenever the hosts allow it", 0: "off", -1: f"from {hierarchical.AUTO_MIN_BYTES} B when the hosts allow it"}
        log.debug("rank %d: paths: allreduces up to %d B go through rank 0 in one round trip (allgather parts up "
                  "to %d B); larger ones take the ring in %d B segments%s; hierarchical allreduce %s (%d host(s)); "
                  "ops fused up to %d B, cycle time %g ms", self.rank, self._small, self._small_gather,
                  st.segment_bytes,
                  f", or one shared-memory region from {st.shm_allreduce_min_bytes} B (all ranks on this host)"
                  if self._shm_ar is not None else "; no shared-memory allreduce (not every rank on one host, "
                  "or switched off)", hier.get(st.hierarchical_allreduce, str(st.hierarchical_allreduce)),
                  len({p["host"] for p in table}), st.fusion_threshold, st.cycle_time)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"ringcomm-engine-{self.rank}", daemon=True)
        self._thread.start()

    # -- user thread side ------------------------------------------------------

    def submit(self, entry: Entry) -> Handle:
        if self._failed is not None:
            raise self._failed
        if self._stopping:
            raise ShutdownError("ringcomm is shutting down; no new ops are accepted")
        entry.submitted_at = time.perf_counter()
        self._queue.append(entry)
        if not self._wake_pending:  # one byte per engine wake-up, not per op: bursts share a wake
            self._wake_pending = True
            os.write(self._wake_w, b"x")
        return entry.handle

    def shutdown(self, timeout: float = 10.0) -> None:
        """Collective shutdown (waits up to ``timeout`` for the other ranks), then close."""
        thread = self._thread
        if thread is not None and thread.is_alive() and self._failed is None and timeout > 0:
            handle = Handle(SHUTDOWN_NAME)
            try:
                self.submit(Entry(Request(SHUTDOWN_NAME, wire.SHUTDOWN), [], handle))
                handle.wait(timeout)
            except Exception as exc:  # other ranks gone: close anyway
                log.debug("rank %d: shutdown did not complete collectively: %s", self.rank, exc)
        self._stopping = True
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        if thread is not None:
            thread.join(timeout=5.0)
        self._close()

    def _close(self) -> None:
        err = ShutdownError("ringcomm was shut down while this op was pending")
        for entry in list(self._inflight.values()) + list(self._queue):
            if not entry.handle.done():
                entry.handle.set_error(err)
        self._inflight.clear()
        self._queue.clear()
        if self._shm_ar is not None:
            self._shm_ar.close()
        if isinstance(self._link, DataPlane):
            self._link.close()
        if self._ctrl is not None:
            # rank 0's last answers (an error that ends the program) still reach the other ranks
            self._ctrl.close(_FINAL_ANSWERS_LINGER_MS if self.rank == 0 else 0)
        remove_files(self._ipc_paths)
        if self._server is not None:
            self._server.close()
        if self.timeline is not None:
            self.timeline.close()
        if self._zap is not None:
            self._zap.stop()
        if self._ctx is not None:
            self._ctx.term()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    # -- engine thread -------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._ctrl is not None:
            poller.register(self._ctrl, zmq.POLLIN)
        monitors = self._link.monitor_sockets if isinstance(self._link, DataPlane) else []
        for mon in monitors:
            poller.register(mon, zmq.POLLIN)
        try:
            while not self._stopping:
                events = dict(poller.poll(self._poll_timeout()))
                if self._wake_r in events:
                    # Order matters: consume the wake-up bytes, then clear the flag, then drain.  A
                    # submit after the clear writes a new byte (at worst a spurious wake); clearing
                    # before the read could swallow that byte and leave the flag set: a lost wake-up.
                    try:
                        os.read(self._wake_r, 65536)
                    except BlockingIOError:
                        pass
                    self._wake_pending = False
                    self._drain_queue()
                if self._ctrl is not None and self._ctrl in events:
                    self._drain_control()
                if self._coord is not None:
                    self._coordinate()
                if monitors and (any(m in events for m in monitors) or self._link.suspects or self._link.unconnected):
                    self._on_connection_events()
        except BaseException as exc:  # the engine must never die silently
            if isinstance(exc, PeerLostError):
                log.error("%s", exc)
            else:
                log.exception("rank %d: engine failed", self.rank)
            self._fail_all(exc if isinstance(exc, HorovodInternalError) else HorovodInternalError(
                f"rank {self.rank}: ringcomm engine failed: {exc!r}"))

    def _on_connection_events(self) -> None:
        """A peer's connection closed: unless the job is shutting down, every pending op fails."""
        link = self._link
        assert isinstance(link, DataPlane)
        lost = link.check_peers()
        if not lost or self._stopping:
            return
        leaving = self._inflight.pop((0, SHUTDOWN_NAME), None)
        if leaving is not None:
            # This rank is shutting down too: a peer that left has most likely finished the
            # collective shutdown before this rank received its response.  Finish quietly.
            self._stopping = True
            leaving.handle.set_result(None)
            return
        if self._ctrl is not None and (self._inflight or self._queue):
            # The peer may have left because of an error rank 0 already answered (a mismatch, a refused
            # call): take that answer first, so the ops it covers fail with their cause, not as lost.
            if self._coord is None:
                self._ctrl.poll(_LATE_ANSWER_MS)
            while self._drain_control():
                pass
            if self._coord is not None:
                self._coordinate()
        peer = link.culprit()
        pending = [e.req.name + set_label(e.req.pset, self._sets.get(e.req.pset, ()))
                   for e in list(self._inflight.values()) + list(self._queue)]
        shown = ", ".join(pending[:8]) + (f" and {len(pending) - 8} more" if len(pending) > 8 else "")
        raise link.lost_error(peer, f"; pending ops on rank {self.rank}: {shown or 'none'}")

    def _poll_timeout(self) -> int | None:
        if isinstance(self._link, DataPlane) and (self._link.suspects or self._link.unconnected):
            return 200  # re-check a peer whose connection closed while its process ran, or not yet made
        if self._coord is None:
            return None
        if self.settings.cycle_time > 0 and self._coord.has_ready():
            return max(1, int(self.settings.cycle_time))
        if self._coord.has_pending():
            return 1000  # stall checks
        return None

    def _fail_all(self, exc: BaseException) -> None:
        self._failed = exc
        self._backlog.clear()
        for entry in list(self._inflight.values()) + list(self._queue):
            if not entry.handle.done():
                entry.handle.set_error(exc)
        self._inflight.clear()
        self._queue.clear()

    def _drain_queue(self) -> None:
        items: list[Any] = []
        carried = 0  # payload bytes in ``items``
        now = time.monotonic()
        drained_at = time.perf_counter()
        while self._queue:
            entry = self._queue.popleft()
            entry.drained_at = drained_at
            self._inflight[entry.key] = entry
            if self._coord is not None:
                self._canon.setdefault(entry.key, entry.req)
                self._coord.submit(0, entry.req, now)
            else:
                pset = entry.req.pset
                cache = self._caches.get(pset)
                cid = cache.lookup(entry.req) if cache is not None else None
                item: Any = list(entry.req) if cid is None else cid if pset == 0 else {"s": pset, "c": cid}
                nbytes = self._nbytes(entry)
                kind = entry.req.kind
                if 0 < nbytes and (kind == wire.ALLREDUCE and nbytes <= self._small
                                   or kind == wire.ALLGATHER and nbytes <= self._small_gather):
                    if carried + nbytes > wire.CONTROL_DATA_BYTES:
                        self._send_requests(items)  # keep every control frame within its bound
                        items, carried = [], 0
                    item = {"q": item, "d": b"".join(a.tobytes() for a in entry.arrays)}
                    carried += nbytes
                items.append(item)
        if items:
            self._send_requests(items)

    def _send_requests(self, items: list[Any]) -> None:
        assert self._ctrl is not None
        self._ctrl.send(wire.pack_control(self.topo.secret, ["req", self.rank, items]))

    def _drain_control(self) -> bool:
        """Handle one control message (the poller is level-triggered: it reports the next one).

        Returns whether there was one.
        """
        assert self._ctrl is not None
        secret = self.topo.secret
        try:
            frames = self._ctrl.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return False
        if self._coord is not None:
            if len(frames) == 2:  # ROUTER: [sender identity, message]
                self._on_request(frames[1], secret)
            return True
        try:
            msg = wire.unpack_control(secret, frames[0] if len(frames) == 1 else b"")
            resps = wire.parse_response_batch(msg)
        except ProtocolError as exc:
            log.debug("rank %d: dropping control message: %s", self.rank, exc)
            return True
        for resp in resps:
            self._execute(resp)
        return True

    def _serve_control(self) -> None:
        """Rank 0, called while it waits inside a transfer: take every waiting request, and answer
        the ready ops of sets without rank 0 (the others wait for rank 0's main loop: a set with
        rank 0 cannot run its next op before rank 0 is done, and a shutdown must not reach the
        other ranks while rank 0 still needs their data)."""
        while self._drain_control():
            pass
        self._coordinate(nested=True)

    def _on_request(self, frame: bytes, secret: bytes) -> None:
        assert self._coord is not None
        try:
            rank, items = wire.parse_request_batch(wire.unpack_control(secret, frame), self.size)
            reqs = []
            for it, data in items:
                if not isinstance(it, wire.Request):  # a response-cache id: (set id, id)
                    pset, cid = it
                    try:
                        it = self._caches[pset].get(cid)
                    except KeyError:
                        raise ProtocolError(f"unknown response-cache id {cid} of process set {pset} "
                                            f"from rank {rank}") from None
                reqs.append((it, data))
        except ProtocolError as exc:
            log.debug("coordinator: dropping control message: %s", exc)
            return
        now = time.monotonic()
        for req, data in reqs:
            if data is not None:
                self._payloads.setdefault((req.pset, req.name), {})[rank] = data
            self._canon.setdefault((req.pset, req.name), req)
            self._coord.submit(rank, req, now)

    def _coordinate(self, nested: bool = False) -> None:
        coord = self._coord
        assert coord is not None
        now = time.monotonic()
        if self.settings.cycle_time > 0 and coord.has_ready():
            if (now - self._last_emit) * 1000 < self.settings.cycle_time:
                return
        pairs = coord.take_responses(skip_member=0 if nested else None)
        if self._payloads:
            pairs = [(self._star(r, members), members) for r, members in pairs]
        if pairs:
            self._last_emit = now
            if self.timeline is not None and self.timeline.mark_cycles:
                self.timeline.marker("CYCLE", time.perf_counter())
            self._record_emitted(pairs)
            if self.size > 1:
                self._send_responses(pairs)
            self._backlog.extend(resp for resp, members in pairs if 0 in members)
            if not self._executing:  # else this runs inside rank 0's current transfer: they wait their turn
                while self._backlog:
                    self._execute(self._backlog.popleft())
        self._check_stalls(now)

    def _record_emitted(self, pairs: list[tuple[Response, tuple[int, ...]]]) -> None:
        """Rank 0 caches every set's requests as it emits them, members cache theirs as they execute.

        The order is the same, so the caches agree; rank 0 must know an id before a member can
        send it, and it may not be a member of the set at all.
        """
        for resp, _ in pairs:
            if resp.kind == wire.ADD_PSET and not resp.error:
                self._caches[resp.root] = ResponseCache(self.settings.cache_capacity)
            if resp.kind == wire.REMOVE_PSET and not resp.error:
                self._caches.pop(resp.root, None)
            if resp.error or resp.joined or resp.kind not in (wire.ALLREDUCE, wire.BROADCAST, wire.REDUCESCATTER):
                continue
            cache = self._caches.get(resp.pset)
            for name in resp.names:
                req = self._canon.get((resp.pset, name))
                if cache is not None and req is not None:
                    cache.record(req)
        for resp, _ in pairs:
            for name in resp.names:
                self._canon.pop((resp.pset, name), None)

    def _send_responses(self, pairs: list[tuple[Response, tuple[int, ...]]]) -> None:
        """Each rank gets the responses of its sets, in emission order (one message per distinct list)."""
        assert self._ctrl is not None
        per_rank: dict[int, list[int]] = {}
        for i, (_, members) in enumerate(pairs):
            for r in members:
                if r != 0:
                    per_rank.setdefault(r, []).append(i)
        frames: dict[tuple[int, ...], list[bytes]] = {}
        for r, idx in per_rank.items():
            key = tuple(idx)
            if key not in frames:  # each batch keeps the result data of a frame within its bound
                frames[key] = [wire.pack_control(self.topo.secret, ["resp", [list(resp) for resp in batch]])
                               for batch in _control_batches([pairs[i][0] for i in idx])]
            ident = self._idents[r]
            try:
                for frame in frames[key]:
                    self._ctrl.send_multipart([ident, frame])
            except zmq.ZMQError as exc:
                # that rank's connection is gone: it left after the collective shutdown,
                # or it died, which its data-plane monitor reports as a lost peer
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
                log.debug("rank 0: %s is gone; response not delivered", ident.decode())

    @staticmethod
    def _nbytes(entry: Entry) -> int:
        return sum(a.nbytes for a in entry.arrays)

    def _star(self, resp: Response, members: tuple[int, ...]) -> Response:
        """Rank 0 finishes a small allreduce or allgather from the payloads sent with the requests
        (2 hops, no ring): the response carries the result.  Anything else comes back unchanged."""
        payloads = [self._payloads.pop((resp.pset, n), {}) for n in resp.names]
        if resp.error or not resp.names:
            return resp
        if resp.kind == wire.ALLREDUCE and resp.numels:
            return self._star_reduce(resp, members, payloads)
        if resp.kind == wire.ALLGATHER:
            return self._star_gather(resp, members, payloads[0])
        return resp

    def _star_gather(self, resp: Response, members: tuple[int, ...], payloads: dict[int, bytes]) -> Response:
        """The members' parts, concatenated in set order; unchanged (the ring runs) if one is missing."""
        started = time.perf_counter()
        (name,) = resp.names
        req = self._canon.get((resp.pset, name))
        if req is None or len(resp.first_dims) != len(members):
            return resp
        row_bytes = int(np.prod(req.shapes[0][1:], dtype=np.int64)) * np.dtype(resp.dtype).itemsize
        if sum(resp.first_dims) * row_bytes > wire.CONTROL_DATA_BYTES:
            return resp
        parts: list[bytes] = []
        for rank, dim in zip(members, resp.first_dims):
            if rank == 0:
                entry = self._inflight.get((resp.pset, name))
                part = entry.arrays[0].tobytes() if entry is not None else None
            else:
                part = payloads.get(rank)
            if part is None or len(part) != dim * row_bytes:
                return resp
            parts.append(part)
        if self.timeline is not None:
            self._star_spans[(resp.pset, name)] = (started, time.perf_counter())
        return resp._replace(data=b"".join(parts))

    def _star_reduce(self, resp: Response, members: tuple[int, ...], payloads: list[dict[int, bytes]]) -> Response:
        """Rank 0 reduces a small allreduce from the payloads sent with the requests."""
        started = time.perf_counter()
        dtype = np.dtype(resp.dtype)
        if sum(resp.numels) * dtype.itemsize > wire.CONTROL_DATA_BYTES:
            return resp  # too much to carry in one control frame (many small ones fused): run the ring
        op = ReduceOp(resp.op)
        joined = set(resp.joined)
        acc: np.ndarray | None = None
        total = sum(resp.numels)
        for rank in members:
            if rank in joined:
                continue
            if rank == 0:
                arrays = []
                for n in resp.names:
                    entry = self._inflight.get((resp.pset, n))
                    if entry is None:
                        return resp
                    arrays.extend(entry.arrays)
                contrib = arrays[0].reshape(-1) if len(arrays) == 1 else np.concatenate([a.reshape(-1) for a in arrays])
            else:
                parts = [p.get(rank) for p in payloads]
                if any(p is None for p in parts):
                    return resp  # some rank sent no payload: run the ring
                raw = parts[0] if len(parts) == 1 else b"".join(parts)  # type: ignore[arg-type]
                contrib = np.frombuffer(raw, dtype=dtype)  # type: ignore[arg-type]
            if contrib.size != total:
                return resp
            if resp.prescale != 1.0:
                contrib = contrib.copy()
                ops.scale_inplace(contrib, resp.prescale)
            if acc is None:
                acc = contrib.copy()
            else:
                ops.reduce_into(op, acc, contrib)
        if acc is None:
            return resp
        ops.scale_inplace(acc, ops.postscale(op, len(members), resp.postscale))
        if self.timeline is not None:
            self._star_spans[(resp.pset, *resp.names)] = (started, time.perf_counter())
        return resp._replace(data=acc.tobytes())

    def start_timeline(self, path: str, mark_cycles: bool = False) -> None:
        """Start writing a timeline (rank 0 only, as Horovod does); replaces one already running."""
        if self.rank != 0:
            return
        old, self.timeline = self.timeline, Timeline(path, self.rank, mark_cycles)
        if old is not None:
            old.close()

    def stop_timeline(self) -> None:
        old, self.timeline = self.timeline, None
        if old is not None:
            old.close()

    def _check_stalls(self, now: float) -> None:
        assert self._coord is not None
        st = self.settings
        after = min(st.stall_check_seconds, st.stall_shutdown_seconds or st.stall_check_seconds)
        for pset, stall in self._coord.stalled(now, after):
            text = (f"{stall.kind} '{stall.name}'{self._coord.where(pset)} was submitted by ranks "
                    f"{list(stall.submitted)} {stall.waited:.0f} s ago but ranks {list(stall.missing)} "
                    "have not submitted it")
            if st.stall_shutdown_seconds and stall.waited >= st.stall_shutdown_seconds:
                self._coord.fail(pset, stall.name, f"stalled: {text} (RINGCOMM_STALL_SHUTDOWN_SECONDS="
                                                   f"{st.stall_shutdown_seconds:g})")
                continue
            if (pset, stall.name) in self._warned_stalls or stall.waited < st.stall_check_seconds:
                continue
            self._warned_stalls.add((pset, stall.name))
            log.warning("stall: %s; every rank must run the same collectives in the end", text)

    # -- execution -----------------------------------------------------------

    def _execute(self, resp: Response) -> None:
        pset = resp.pset
        entries = [self._inflight.pop((pset, name)) for name in resp.names if (pset, name) in self._inflight]
        tl = self.timeline
        start = time.perf_counter()
        if tl is not None:
            star = self._star_spans.get((resp.pset, *resp.names))  # rank 0 reduced it before answering
            for e in entries:
                tl.span(e.req.name, "QUEUE", e.submitted_at, e.drained_at or start)
                tl.span(e.req.name, "NEGOTIATE", e.drained_at or start, star[0] if star else start)
            self._phases = []
        if resp.error:
            cls = StallError if resp.error_kind == "stall" else MismatchError
            err: Exception = cls(f"{resp.error} [raised on rank {self.rank}]")
            for e in entries:
                e.handle.set_error(err)
            return
        # the set's op count advances only for ops that move data (errors may reach one rank only)
        n = self._seqs.get(pset, 0)
        self._seqs[pset] = n + 1
        seq = (pset << _PSET_SHIFT) | (n * hierarchical.PHASES)  # room for an op's phases
        if not resp.joined and self._coord is None:  # rank 0 recorded it when it emitted the response
            cache = self._caches.get(pset)
            for e in entries:
                if cache is not None and e.req.kind in (wire.ALLREDUCE, wire.BROADCAST, wire.REDUCESCATTER):
                    cache.record(e.req)
        try:
            self._executing = True
            results = self._dispatch(resp, entries, seq)
        except PeerLostError as exc:
            for e in entries:
                e.handle.set_error(exc)
            raise
        except Exception as exc:
            # A data-plane failure leaves the peers' streams out of step: the job cannot go on.
            log.exception("rank %d: %s %s failed", self.rank, resp.kind, resp.names)
            err = HorovodInternalError(f"rank {self.rank}: {resp.kind} {list(resp.names)} failed: {exc!r}")
            for e in entries:
                e.handle.set_error(err)
            raise err from exc
        finally:
            self._executing = False
        if tl is not None:
            end = time.perf_counter()
            args = {"op": seq, "fused": len(resp.names), "tensors": sum(len(e.arrays) for e in entries),
                    "dtype": resp.dtype}
            for e in entries:
                if self._phases:
                    for phase, a, b in self._phases:
                        tl.span(e.req.name, phase, a, b, args)
                else:
                    tl.span(e.req.name, resp.kind.upper(), start, end, args)
        for e, result in zip(entries, results):
            e.handle.set_result(result)
        if resp.kind == wire.SHUTDOWN:
            self._stopping = True

    def set_ranks(self, pset: int) -> tuple[int, ...] | None:
        """The global ranks of registered process set ``pset`` (None if unknown); any thread."""
        return self._sets.get(pset)

    def find_set(self, ranks: tuple[int, ...]) -> int | None:
        """The id of the registered set with exactly these ranks, if any; any thread."""
        for pset, members in list(self._sets.items()):
            if members == ranks:
                return pset
        return None

    def set_ids(self) -> list[int]:
        return sorted(self._sets)

    def _register_set(self, resp: Response) -> int:
        """Every rank, in the same order: an ADD_PSET response creates set ``resp.root``."""
        pset, ranks = resp.root, tuple(resp.splits[0])
        self._sets[pset] = ranks
        self._seqs[pset] = 0
        if self.rank in ranks:
            self._caches.setdefault(pset, ResponseCache(self.settings.cache_capacity))
        return pset

    def _unregister_set(self, pset: int) -> None:
        self._sets.pop(pset, None)
        self._links.pop(pset, None)
        self._host_plans.pop(pset, None)
        self._seqs.pop(pset, None)
        self._caches.pop(pset, None)

def _control_batches(resps: list[Response]) -> list[list[Response]]:
    """Split responses into batches whose result data stays within ``wire.CONTROL_DATA_BYTES``.

    Without this, many small allreduces reduced at rank 0 in one cycle made one
    control frame larger than ``wire.MAX_CONTROL_BYTES``; the other ranks dropped
    it and waited forever for their results.
    """
    batches: list[list[Response]] = [[]]
    carried = 0
    for resp in resps:
        if batches[-1] and carried + len(resp.data) > wire.CONTROL_DATA_BYTES:
            batches.append([])
            carried = 0
        batches[-1].append(resp)
        carried += len(resp.data)
    return batches


def _print_waiting(line: str) -> None:
    """Rank 0's report of the ranks still missing at the rendezvous: on stderr, whatever the logging setup."""
    print(f"ringcomm: rank 0: {line}", file=sys.stderr, flush=True)
