"""The engine: the loop that owns one process's thread, sockets and poll.

User threads call :meth:`Engine.submit` (append to a queue, poke a pipe) and
wait on the returned :class:`Handle`.  The engine thread feeds events to the
pure pieces and does what they return:

1. drained ops go to the :class:`~ringcomm.core.session.Session`, which returns
   the frames that announce them to rank 0 (rank 0 hands its own to its service);
2. on rank 0, every rank's frames go to the :class:`~ringcomm.core.service.Service`,
   which returns the ordered responses: frames for each rank, and rank 0's own;
3. each response, in that order, is begun by the session, its data moved by the
   :class:`~ringcomm.collectives.executor.Executor` (pack, ring or shared memory, unpack),
   and the handles completed with the results it returns.

Rank 0's control socket and its service live in one object, :class:`~ringcomm.net.control.Rank0Control`.
While rank 0 waits for a peer's data inside step 3, the data plane runs that object's
:meth:`~ringcomm.net.control.Rank0Control.step` when the socket is readable: it answers the sets
without rank 0 and never hands rank 0 an op, so a transfer never starts inside another.  The
loop sleeps in ``zmq.Poller.poll`` with no timeout when idle, so an idle job uses no CPU.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Any, Protocol

import zmq

from . import bootstrap
from .collectives import hierarchical
from .core import routing, wire
from .job.config import Settings
from .core.coordinator import SHUTDOWN_NAME, set_label
from .errors import HorovodInternalError, PeerLostError, ShutdownError, StallError
from .collectives.executor import Executor
from .core.service import Service
from .core.session import Session
from .handles import Entry, Handle
from .timeline import Timeline, negotiate_phase
from .job.topology import Topology
from .net.transport import DataPlane
from .net.control import Rank0Control
from .core.wire import Request, Response

log = logging.getLogger("ringcomm.engine")


#: When a peer is lost while ops are pending, how long a rank other than 0 waits for rank 0's answer
#: that may already be on its way (the error that made the peer leave)
_LATE_ANSWER_MS = 200
#: How long a rank that lost a peer waits for ringcomm-run to take its report
_REPORT_LOST_SECONDS = 1.0
#: How long rank 0's control socket keeps unsent answers when it closes (to ranks still connected)
_FINAL_ANSWERS_LINGER_MS = 500


class LaneControl(bootstrap.LaneMeeting, Protocol):
    """What the engine asks of the small-op lane's owner (:class:`ringcomm.lane.owner.LaneOwner`),
    which the dispatcher hands it: meet at the rendezvous (:class:`~ringcomm.bootstrap.LaneMeeting`,
    through the wiring), stop posting when rank 0 says so, release the region once the engine closed."""

    def stop_posting(self) -> None:
        """Rank 0 answered LANE_OFF (an op stalled in the lane): this rank posts no more until a join."""
        ...

    def release(self) -> None:
        """The engine is closed: nothing reads the lane's region any more."""
        ...


class Engine:
    """Owns the sockets of one rank and executes collectives in rank 0's order.

    ``lane`` is the small-op lane's owner, made above the engine (by the dispatcher) and used here
    only through :class:`LaneControl`: at the rendezvous, on rank 0's LANE_OFF, and when it closes."""

    def __init__(self, topo: Topology, settings: Settings, lane: LaneControl, round_: int = 0) -> None:
        self.topo = topo
        self.settings = settings
        self.rank, self.size = topo.rank, topo.size
        self._queue: collections.deque[Entry] = collections.deque()
        self._wake_pending = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._stopping = False
        self._failed: BaseException | None = None
        # the sizes that pick an op's path (rank 0, shared memory, hierarchical, doubling, the ring)
        self.limits = lim = routing.limits_for(settings, self.size)
        # in-flight ops, op counts, response caches (every member records a set's responses in the
        # same order; rank 0's service records every set's) and the process-set registry
        self._session: Session[Entry] = Session(self.rank, self.size, topo.secret, settings.cache_capacity, lim.small_bytes,
                                lim.small_gather_bytes, hierarchical.PHASES, records=self.rank != 0)
        self._service = Service(self.size, topo.secret, settings.fusion_threshold, lim.small_bytes, settings.cache_capacity,
                                settings.cycle_time, clock=time.perf_counter) if self.rank == 0 else None
        # rank 0: its control socket (bound by bootstrap.connect) and its service
        self._control = Rank0Control(self._service, self.size, settings.stall_check_seconds,
                                     settings.stall_shutdown_seconds) if self._service is not None else None
        #: ``(set, name)`` of ops rank 0 failed as stalled that this rank never submitted: it skipped
        #: them, so its count of unnamed ops is behind (the runtime catches up; appended here only).
        self.skipped_ops: collections.deque[tuple[int, str]] = collections.deque(maxlen=1024)
        self._thread: threading.Thread | None = None
        self.timeline: Timeline | None = None
        if settings.timeline and self.rank == 0:
            self.timeline = Timeline(settings.timeline, self.rank, settings.timeline_mark_cycles)
            self._note_timeline()
        #: The small-op lane's owner: a shared region when all ranks share one host, else TCP between
        #: ranks; offered and accepted at the rendezvous, stopped on LANE_OFF, released when closed.
        self._lane = lane
        # the sockets, the rendezvous table and what else the wiring opened (nothing in a job of one)
        self._wiring = bootstrap.alone(topo.hostname)
        if self.size > 1:
            try:
                self._wiring = bootstrap.connect(topo, settings, round_, lim, lane, self._control)
            except BaseException:
                self._close()  # connect closed what it opened; the lane's offer, the timeline, the pipe remain
                raise
        self.peer_table: list[dict] = self._wiring.peer_table
        self._ctrl: zmq.Socket | None = self._wiring.ctrl
        self._link: Any = self._wiring.link
        self._shm_ar = self._wiring.shm_ar  # all ranks on one host: large allreduces
        self._exec = Executor(self.rank, self.size, settings, self._link, shm_ar=self._shm_ar,
                              hosts=[str(p["host"]) for p in self.peer_table], limits=lim)

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
        for entry in self._session.pending() + list(self._queue):
            if not entry.handle.done():
                entry.handle.set_error(err)
        self._session.drop_all()
        self._queue.clear()
        self._lane.release()
        # rank 0's last answers (an error that ends the program) still reach the other ranks
        self._wiring.close(_FINAL_ANSWERS_LINGER_MS if self.rank == 0 else 0)
        if self.timeline is not None:
            self.timeline.close()
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
                if self._control is not None:
                    self._coordinate()
                if monitors and (any(m in events for m in monitors) or self._link.suspects
                                 or self._link.unconnected):
                    self._on_connection_events()
        except BaseException as exc:  # the engine must never die silently
            if isinstance(exc, PeerLostError):
                log.error("%s", exc)
                self._report_lost(exc)  # before the ops fail: the program may end as soon as they do
            else:
                log.exception("rank %d: engine failed", self.rank)
            self._fail_all(exc if isinstance(exc, HorovodInternalError) else HorovodInternalError(
                f"rank {self.rank}: ringcomm engine failed: {exc!r}"))

    def _report_lost(self, exc: PeerLostError) -> None:
        """Tell ``ringcomm-run`` (or its elastic driver) which rank this job lost, so it stops that process
        even if every rank that lost it goes on to exit 0 or to re-form (a stopped process would otherwise
        keep the launcher waiting)."""
        lost = exc.lost_rank
        if lost is None or self.topo.source not in ("ringcomm-run", "elastic") or not self.topo.rendezvous:
            return
        from .net.rendezvous_client import report_lost

        try:
            report_lost(self.topo.rendezvous, self.topo.secret, self.rank, lost, _REPORT_LOST_SECONDS)
        except Exception as err:  # noqa: BLE001 - the launcher is gone or busy: the ops fail all the same
            log.debug("rank %d: could not tell the launcher about rank %d: %s", self.rank, lost, err)

    def _on_connection_events(self) -> None:
        """A peer's connection closed: unless the job is shutting down, every pending op fails."""
        link = self._link
        assert isinstance(link, DataPlane)
        lost = link.check_peers()
        if not lost or self._stopping:
            return
        leaving = self._session.drop((0, SHUTDOWN_NAME))
        if leaving is not None:
            # This rank is shutting down too: a peer that left has most likely finished the
            # collective shutdown before this rank received its response.  Finish quietly.
            self._stopping = True
            leaving.handle.set_result(None)
            return
        if self._ctrl is not None and (self._session.pending() or self._queue):
            # The peer may have left because of an error rank 0 already answered (a mismatch, a refused
            # call): take that answer first, so the ops it covers fail with their cause, not as lost.
            if self._control is None:
                self._ctrl.poll(_LATE_ANSWER_MS)
            while self._drain_control():
                pass
            if self._control is not None:
                self._coordinate()
        peer = link.culprit()
        pending = [e.req.name + set_label(e.req.pset, self._session.set_ranks(e.req.pset) or ())
                   for e in self._session.pending() + list(self._queue)]
        shown = ", ".join(pending[:8]) + (f" and {len(pending) - 8} more" if len(pending) > 8 else "")
        raise link.lost_error(peer, f"; pending ops on rank {self.rank}: {shown or 'none'}")

    def _poll_timeout(self) -> int | None:
        if isinstance(self._link, DataPlane) and (self._link.suspects or self._link.unconnected):
            return 200  # re-check a peer whose connection closed while its process ran, or not yet made
        return self._control.next_wake_ms() if self._control is not None else None

    @property
    def failure(self) -> BaseException | None:
        """The error the engine failed with (a lost peer...), or None while it runs."""
        return self._failed

    @property
    def timeline_active(self) -> bool:
        return self.timeline is not None

    def lane_stalled(self, name: str) -> None:
        """The small-op lane's op ``name`` waited past the stall deadline here: rank 0 then has every
        rank stop posting to the lane, so the op is decided by rank 0 (any thread)."""
        try:
            self.submit(Entry(Request(name, wire.LANE_OFF), [], Handle(name)))
        except HorovodInternalError as exc:  # the engine failed or is shutting down: it ends the op itself
            log.debug("rank %d: lane stall of %r not reported: %s", self.rank, name, exc)

    def _fail_all(self, exc: BaseException) -> None:
        self._failed = exc
        for entry in self._session.pending() + list(self._queue):
            if not entry.handle.done():
                entry.handle.set_error(exc)
        self._session.drop_all()
        self._queue.clear()

    def _drain_queue(self) -> None:
        entries: list[Entry] = []
        now = time.monotonic()
        drained_at = time.perf_counter()
        while self._queue:
            entry = self._queue.popleft()
            entry.drained_at = drained_at
            entries.append(entry)
        if self._service is not None:  # rank 0 is its own coordinator
            for entry in entries:
                if entry.req.kind != wire.LANE_OFF:  # a notice, not an op
                    self._session.track(entry)
                self._service.submit_local(entry.req, entry.arrays, now, entry.waited)
            return
        frames = self._session.announce(entries)
        assert self._ctrl is not None or not frames
        for frame in frames:
            self._ctrl.send(frame)  # type: ignore[union-attr]

    def _drain_control(self) -> bool:
        """Handle one control message (the poller is level-triggered: it reports the next one).

        Returns whether there was one.
        """
        if self._control is not None:
            return self._control.receive_one()
        assert self._ctrl is not None
        try:
            frames = self._ctrl.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return False
        for resp in self._session.receive(frames[0] if len(frames) == 1 else b""):
            self._execute(resp)
        return True

    def _coordinate(self) -> None:
        """Rank 0, in the loop: answer what is ready and run its own share, in the service's order."""
        assert self._control is not None
        for resp in self._control.answer():
            self._execute(resp)
        notes = self._control.notes
        if notes.cycles:
            if self.timeline is not None:
                for t in notes.cycles:
                    self.timeline.marker("CYCLE", t)
            notes.cycles.clear()

    def start_timeline(self, path: str, mark_cycles: bool = False) -> None:
        """Start writing a timeline (rank 0 only, as Horovod does); replaces one already running."""
        if self.rank != 0:
            return
        old, self.timeline = self.timeline, Timeline(path, self.rank, mark_cycles)
        self._note_timeline()
        if old is not None:
            old.close()

    def stop_timeline(self) -> None:
        old, self.timeline = self.timeline, None
        self._note_timeline()
        if old is not None:
            old.close()

    def _note_timeline(self) -> None:
        """Rank 0's control notes what the timeline needs only while one is written."""
        if self._control is not None:
            notes = self._control.notes
            notes.on, notes.mark_cycles = self.timeline is not None, bool(self.timeline and self.timeline.mark_cycles)
            if not notes.on:
                notes.reduced_at.clear()

    # -- execution -----------------------------------------------------------

    def _execute(self, resp: Response) -> None:
        if resp.kind == wire.LANE_OFF:  # rank 0 says: every rank stops posting to the small-op lane
            self._lane.stop_posting()
            return
        step = self._session.begin(resp)
        entries = step.entries
        tl = self.timeline
        start = time.perf_counter()
        # rank 0 reduced it before answering
        reduced_at = None if self._control is None else self._control.notes.reduced_at.pop((resp.pset, *resp.names), None)
        if tl is not None:
            for e in entries:
                tl.span(e.req.name, "QUEUE", e.submitted_at, e.drained_at or start)
                tl.span(e.req.name, negotiate_phase(e.req.kind), e.drained_at or start, start if reduced_at is None else reduced_at)
        if step.error is not None:
            if isinstance(step.error, StallError) and not entries:
                # the ranks diverged and this one never submits it (a rank that is only late does not
                # get the response: rank 0 answers it when it submits the op)
                self.skipped_ops.extend((resp.pset, n) for n in resp.names)
            for e in entries:
                e.handle.set_error(step.error)
            return
        phases: list[tuple[str, float, float]] = []
        if resp.kind in routing.DATA_KINDS:
            try:
                results, phases = self._exec.execute(resp, entries, step.seq, step.members, timed=tl is not None,
                                                     reduced_at=reduced_at)
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
        else:
            results = [self._session.complete(resp)] * len(entries)
            if resp.kind == wire.REMOVE_PSET:
                self._exec.forget_set(resp.set_id)
        if tl is not None:
            end = time.perf_counter()
            args = {"op": step.seq, "fused": len(resp.names), "tensors": sum(len(e.arrays) for e in entries),
                    "dtype": resp.dtype}
            for e in entries:
                if phases:
                    for phase, a, b in phases:
                        tl.span(e.req.name, phase, a, b, args)
                else:
                    tl.span(e.req.name, resp.kind.upper(), start, end, args)
        for e, result in zip(entries, results):
            e.handle.set_result(result)
        if resp.kind == wire.SHUTDOWN:
            self._stopping = True

    def set_ranks(self, pset: int) -> tuple[int, ...] | None:
        """The global ranks of registered process set ``pset`` (None if unknown); any thread."""
        return self._session.set_ranks(pset)

    def find_set(self, ranks: tuple[int, ...]) -> int | None:
        """The id of the registered set with exactly these ranks, if any; any thread."""
        return self._session.find_set(ranks)

    def set_ids(self) -> list[int]:
        return self._session.set_ids()

