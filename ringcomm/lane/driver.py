"""The lane's driver: small collectives of the global set without the engine, run by the calling thread.

Every op of the global process set takes the next index of this rank's lane, a region of slots
(:class:`ringcomm.core.lane.LaneRegion`: :mod:`ringcomm.lane.shm_lane` on one host,
:mod:`ringcomm.lane.net_lane` across hosts); what each index becomes is decided from the ranks'
slots alone (:mod:`ringcomm.core.lane`). A small allreduce, broadcast, allgather, reducescatter,
alltoall or barrier is posted *fast*: its payload goes into this rank's slot, and the thread that waits for its handle
(a :class:`~ringcomm.lane.handle.LaneHandle`, which calls :meth:`LaneDriver.drive`) reads the
others' slots, computes the result and returns: no thread hop, no message, no round trip through
rank 0.
Anything else (a large op, a refused call, a timeline being written) is posted as
*engine*: the ranks divert that index, each hands its op to the engine, and rank 0 negotiates it as
always.

The waiting thread re-reads a peer's counter a few times (when the host has a core per rank), then
sleeps on it in a futex, waking every :data:`SLICE` to see whether the engine has found a peer lost
(its heartbeats and connection monitors keep running), to warn of a stall, and to honour a deadline.
An async fast op nobody waits for is resolved by a sweeper thread within :data:`SWEEP_SECONDS`, so a
peer that diverted it is never left waiting; the sweeper also posts the ops a submit queued rather
than wait for a peer, and sleeps without a timeout once the lane is idle.

    rank 0: allreduce(x) -> post k (fast, x)  -> every slot at k fast, same key -> reduce, return
    rank 1: allreduce(y) -> post k (fast, y)  -> ... the same, bitwise
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable

from ..shm import futex
from ..core import lane, wire
from ..core.coordinator import Stall
from ..errors import ShutdownError
from ..handles import Entry, Handle
from .handle import LaneHandle
from .records import EngineSide, Pending, Queued, State, naming, reacquire
from .spinning import SpinBudget, spin_allowed

log = logging.getLogger("ringcomm.lane.driver")

#: Seconds one futex sleep lasts before the waiter checks the engine, stalls and its deadline.
SLICE = 0.05
#: Yields of the core to a peer before sleeping on it (only with more local ranks than cores).
YIELDS = 50
#: An async fast op still unresolved after this long is resolved by the sweeper.
SWEEP_SECONDS = 0.01
#: After this long without a fast op the sweeper sleeps until the next one.
IDLE_SECONDS = 1.0
#: A small op behind ops in flight a peer has not posted yet stays queued this long for it at most
#: (the submitting thread does not wait), then goes to the engine.
AGREE_SECONDS = 0.002
#: How often the sweeper tries to post queued ops.
BACKLOG_POLL = 0.0005
#: Finished engine ops are dropped from the record of open ones once it holds this many.
OPEN_PRUNE = 32
#: Requests whose key and fast size are kept (a training loop submits the same ones every step).
PLANS = 4096
#: A payload of at least this many bytes is copied into the slot only while no peer has posted its
#: index otherwise (ranks whose payloads fall on both sides of the bound: the op diverts anyway).
LOOK_FIRST_BYTES = 64 * 1024


class LaneDriver:
    """This rank's side of the lane: posts every global op, resolves fast ones, diverts the rest.

    ``region`` holds every rank's slots; ``engine`` is where diverted ops go and what says the
    engine has failed or times ops (:class:`~ringcomm.lane.records.EngineSide`).  It satisfies
    :class:`~ringcomm.lane.handle.Drives`, what a waiting handle asks of it.  The lane's
    lifecycle (making the region, closing it) is :class:`~ringcomm.lane.owner.LaneOwner`'s.

    One lock guards the driver's state; the calls that may block while holding it each say so.
    The waits for a peer (:meth:`_await_posts`, :meth:`_await_agreement`, :meth:`_make_room`)
    release it first.
    """

    def __init__(self, region: lane.LaneRegion, engine: EngineSide, max_bytes: int, stall_check: float,
                 stall_shutdown: float, move_bytes: int = -1) -> None:
        self._region = region
        self.rank, self.size = region.rank, region.size
        self._engine = engine
        self._max = max_bytes  # the bound of reductions
        self._move = move_bytes  # of broadcasts, allgathers and alltoalls (-1: the same)
        self._peers = [r for r in range(self.size) if r != self.rank]
        self._stall_check, self._stall_shutdown = stall_check, stall_shutdown
        # re-reads and yields help only where a peer's post lands in this host's memory
        spins = region.SPIN and spin_allowed(region.size)
        self._spin = SpinBudget() if spins else SpinBudget(0)  # re-reads before a sleep; lock held
        self._yields = YIELDS if region.SPIN and not spins else 0
        self._slice = futex.timespec(SLICE)
        self._lock = threading.Lock()  # taken directly on the hot paths: `with` on the lock itself is cheaper
        self._cond = threading.Condition(self._lock)
        self._next = 0  # the index of this rank's next post
        self._free_below = 0  # every rank has finished reading every index below this one
        self._pending: dict[int, Pending] = {}  # ops posted fast, not yet resolved
        self._backlog: collections.deque[Queued] = collections.deque()  # submitted, not yet posted
        self._plans: dict[wire.Request, tuple[int, int]] = {}  # request -> (op key, fast bytes or -1)
        # indices posted for the engine, their ops maybe in flight: index -> (key, the op's handle,
        # weakly: a result the caller dropped is not kept alive here)
        self._engine_open: dict[int, tuple[int, weakref.ref[Handle]]] = {}
        self._state = State.OPEN
        self._last_fast = 0.0
        self._sweeper_idle = True
        self._unlinked = self.rank != 0
        self._sweeper = threading.Thread(target=self._sweep, name=f"ringcomm-lane-{self.rank}", daemon=True)
        self._sweeper.start()
        log.debug("rank %d: paths: ops of the global set up to %d B (broadcasts, allgathers and alltoalls "
                  "up to %d B, an alltoall's head included) whose ops in flight every rank has submitted alike "
                  "go through the small-op lane (%d ranks, %s)", self.rank, max_bytes,
                  max_bytes if move_bytes < 0 else move_bytes, self.size,
                  f"up to {self._spin.most} re-reads before sleeping, fewer while they miss" if self._spin.most
                  else "no spinning before sleeping: more ranks than cores")

    @property
    def state(self) -> State:
        """Where this rank's side of the lane stands (:class:`~ringcomm.lane.records.State`)."""
        return self._state

    # -- posting ----------------------------------------------------------------

    def submit(self, entry: Entry, others: int) -> bool:
        """Post ``entry`` (a global set's op) at the next index, or queue it: never waits for a peer.
        True: the lane has it (fast, or queued); False: the caller hands it to the engine.

        ``others`` (this rank's other ops in flight) must all sit at indices where every rank
        posted the same op for this one to go fast (:meth:`_agreement`), else a fast op could
        wait for a peer that waits, in the engine, for it.  While the slot of the next index is
        still read, or a peer has not posted those ops yet, the op is queued; the sweeper (or its
        waiter) posts it later, fast if the peer caught up within :data:`AGREE_SECONDS`.

        The steps: :meth:`_choose` (fast or not, from this rank's view), :meth:`_flush` (post what
        is queued, this op last, as far as the slots and the peers allow), :meth:`_park` (left queued)."""
        key, nbytes = self._choose(entry)
        with self._lock:
            if entry.req.kind == wire.JOIN:  # a joined rank posts no more: the others divert what it misses
                # may block: resolves what this rank posted fast, waiting for the peers with the lock released
                self._close_locked(None)
                return False
            if self._state is not State.OPEN:
                return False
            q = Queued(entry, key, nbytes, others, time.monotonic() + AGREE_SECONDS)
            self._backlog.append(q)
            self._flush(block=False, own=q)  # waits for no peer; a NetLane post may wait for a full socket (_post)
            if q.posted:
                return q.fast
            self._park(entry)
        return True

    def _choose(self, entry: Entry) -> tuple[int, int]:
        """``entry``'s op key and what this rank posts for it fast, -1 when it asks for the engine
        (too large, not a lane op, a grouped op other than an allreduce, a timeline being written)."""
        req = entry.req
        plan = self._plans.get(req)
        if plan is None:
            plan = self._plan(entry)
        key, nbytes = plan
        if nbytes >= 0 and ((entry.grouped and req.kind != wire.ALLREDUCE) or self._engine.timeline_active):
            nbytes = -1
        return key, nbytes

    def _park(self, entry: Entry) -> None:
        """``entry`` stays queued (lock held): its waiter or the sweeper posts it later."""
        handle = entry.handle
        assert isinstance(handle, LaneHandle)
        handle.lane, handle.index = self, -1  # queued: wait() posts it if the sweeper has not
        self._sweeper_idle = False
        self._cond.notify()

    def _flush(self, block: bool, own: Queued | None = None, until: Queued | None = None) -> None:
        """Post queued ops in order (lock held); stop at one that would wait for a peer, or with
        ``block`` wait (lock released) until ``until`` is posted.  ``own``: the caller's op."""
        backlog = self._backlog
        while backlog and self._state is State.OPEN and not (until is not None and until.posted):
            if not self._room(block) or not backlog:  # (a wait released the lock)
                return
            q = backlog[0]
            fast = q.nbytes >= 0
            if fast and q.others:
                agreement = self._agreement(q.others)
                if agreement is not True:
                    if agreement is not False and time.monotonic() < q.deadline:
                        if not block:
                            return
                        self._await_agreement(agreement, q.deadline)
                        continue  # waited with the lock released: everything is read again
                    fast = False
            backlog.popleft()
            self._post(q, fast, q is own)

    def _post(self, q: Queued, fast: bool, own: bool) -> None:
        """Write ``q`` at this rank's next index (its slot is free) and hand it on."""
        k, entry = self._next, q.entry
        if fast and q.nbytes >= LOOK_FIRST_BYTES and self._region.still_missing(self._peers, k, q.key) is None:
            fast = False  # a peer posted this index otherwise: it diverts, so the payload is not copied in
        # lock held: a NetLane post may wait in _drain for a peer's full socket buffer to take the
        # frame; bounded by that peer reading (it reads while it waits) or the engine finding it lost
        self._region.post(k, q.key, fast, lane.payload(entry.req, entry.arrays) if fast and q.nbytes else ())
        self._next, q.posted, q.fast = k + 1, True, fast
        if not self._unlinked:
            self._unlink_once_all_posted()
        handle = entry.handle
        assert isinstance(handle, LaneHandle)
        if not fast:
            if len(self._engine_open) >= OPEN_PRUNE:
                self._prune_open()
            self._engine_open[k] = (q.key, weakref.ref(handle))
            self._publish_read()
            handle.lane = None  # an ordinary handle: the engine finishes it (the caller's, if ``own``)
            if not own:
                self._divert_entry(entry)
            return
        now = time.monotonic()
        self._pending[k] = Pending(entry, q.key, now, q.nbytes)
        handle.lane, handle.index, self._last_fast = self, k, now
        if self._sweeper_idle:
            self._sweeper_idle = False
            self._cond.notify()

    def _room(self, block: bool) -> bool:
        """Whether the slot of this rank's next index is free; waits for it when ``block``."""
        if block:
            self._make_room()
            return True
        oldest = self._next - self._region.slots
        if oldest < self._free_below:
            return True
        if oldest in self._pending:  # this rank's own: resolve it if the peers have posted
            self._resolve(oldest, None, block=False)
            if oldest in self._pending:
                return False
        free = self._region.all_read_below(oldest)
        if free > oldest:
            self._free_below = free
            return True
        return False

    def _drain_backlog(self, err: BaseException | None) -> None:
        """The lane is off, or the engine failed (``err``): queued ops go to the engine, or fail."""
        while self._backlog:
            q = self._backlog.popleft()
            q.posted = True
            handle = q.entry.handle
            assert isinstance(handle, LaneHandle)
            handle.lane = None
            if err is not None:
                handle.set_error(err)
            else:
                self._divert_entry(q.entry)

    def _plan(self, entry: Entry) -> tuple[int, int]:
        """``entry``'s op key and what this rank posts for it fast (-1: not fast), kept per request."""
        req = entry.req
        if len(self._plans) >= PLANS:
            self._plans.clear()
        plan = self._plans[req] = (lane.op_key(req),
                                   lane.fast_nbytes(req, entry.arrays, self.rank, self._max, self._move))
        return plan

    def _prune_open(self) -> None:
        for k in [k for k, (_, ref) in self._engine_open.items() if (h := ref()) is None or h.done()]:
            del self._engine_open[k]

    def _agreement(self, others: int) -> bool | tuple[int, int]:
        """Whether this rank's ``others`` ops in flight are all ops it posted on the lane at indices
        where every rank posted the same op (the same key): fast ones still pending, or ones posted
        for the engine not finished yet.  True or False, or ``(rank, index)``: so far so good, but that rank has not
        posted that index yet.  An index posted for the engine that this rank has finished
        reading may have been rewritten since: it then counts as not agreed."""
        self._prune_open()
        if len(self._engine_open) + len(self._pending) != others:
            return False  # ops of other process sets, or ops that left the lane: not known here
        region, me = self._region, self.rank
        peers = [r for r in range(self.size) if r != me]
        unposted: tuple[int, int] | None = None
        for k, (key, _) in self._engine_open.items():
            for r in peers:
                got = region.key_at(r, k)
                if got is None and not lane.reached(region.posted(r), k) and not region.off(r):
                    unposted = unposted or (r, k)
                elif got != key:
                    return False
        for k, p in self._pending.items():  # this rank still reads k: the slots are intact
            for r in peers:
                s = region.seen(r, k)
                if not s.posted and not s.off:
                    unposted = unposted or (r, k)
                elif not (s.posted and s.fast and s.key == p.key):
                    return False
        return True if unposted is None else unposted

    def _await_agreement(self, unposted: tuple[int, int], deadline: float) -> bool:
        """Wait (lock released) until rank ``r`` posts index ``k`` (``unposted``), until ``deadline``
        at most (then the op goes to the engine); False once the deadline has passed."""
        if time.monotonic() >= deadline:
            return False
        r, k = unposted
        region = self._region
        reads = self._spin.reads()
        caught: bool | None = None  # how the re-reads went, told to the budget
        self._cond.release()
        try:
            for i in range(reads):
                if lane.reached(region.posted(r), k):
                    caught = i > 0 or None  # posted before the first read: nothing learnt
                    return True
            caught = False if reads else None
            seen = region.posted(r)
            if not lane.reached(seen, k) and not region.off(r):
                left = deadline - time.monotonic()
                if left > 0:
                    region.sleep_on_posted(r, seen, futex.timespec(left))
        finally:
            reacquire(self._cond)
            self._spun(caught)
        return True

    def _spun(self, caught: bool | None) -> None:
        """Tell the spin budget how a wait's re-reads went (None: it had none, or needed none); lock held."""
        if caught is not None:
            (self._spin.caught if caught else self._spin.missed)()

    def _make_room(self) -> int:
        """Wait until the slot of this rank's next index k is free (every rank has finished
        reading index k - slots); returns k."""
        while self._state is State.OPEN:
            oldest = self._next - self._region.slots
            if oldest in self._pending:  # this rank's own: resolve it first
                self._resolve(oldest, None, block=True)
            elif self._room(False):
                break
            else:
                self._cond.release()  # another thread may post meanwhile: k is read again
                try:
                    self._check_engine()
                    time.sleep(0.0002)
                finally:
                    reacquire(self._cond)
        return self._next

    def _publish_read(self) -> None:
        """This rank has finished reading every index below the oldest it still holds."""
        self._region.set_read_below(min(self._pending) if self._pending else self._next)

    def _unlink_once_all_posted(self) -> None:
        if all(lane.reached(self._region.posted(r), 0) for r in range(self.size)):
            self._unlinked = True
            self._region.unlink()  # every rank has it mapped: nothing stays in /dev/shm (a quick system call)

    # -- resolving --------------------------------------------------------------

    def drive(self, handle: LaneHandle, deadline: float | None, block: bool) -> None:
        """Resolve ``handle``'s index on this thread (waiting for the peers when ``block``)."""
        with self._lock:
            if handle.index < 0:  # still queued: post it (and the ops before it), waiting if need be
                q = next((q for q in self._backlog if q.entry.handle is handle), None)
                if q is not None:
                    self._flush(block=True, until=q)
                if handle.index < 0:
                    return  # posted for the engine (or the lane went off): the engine finishes it
            self._resolve(handle.index, deadline, block)

    def _resolve(self, k: int, deadline: float | None, block: bool) -> bool:
        """Resolve index ``k`` if it is still pending; the lock is held (and released while sleeping)."""
        while True:
            p = self._pending.get(k)
            if p is None:
                return True
            sizes = self._region.fast_sizes(k, p.key, p.nbytes)
            if sizes is not None:  # the common case (also right after a wait), read in one pass
                self._finish_fast(k, p, sizes)
                return True
            own = p.own
            seen = [own if r == self.rank else self._region.seen(r, k) for r in range(self.size)]
            decision = lane.decide(p.key, seen)
            if decision == lane.FAST:
                self._finish_fast(k, p, [s.nbytes for s in seen])
                return True
            if decision == lane.DIVERT:
                self._divert(k, p)
                return True
            err = self._engine.failure
            if err is not None:
                self._fail(k, p, naming(err, p.entry.req, [r for r, s in enumerate(seen) if not s.posted]))
                return True
            if not block or (deadline is not None and time.monotonic() >= deadline):
                return False
            missing = [r for r, s in enumerate(seen) if not s.posted]
            self._check_stall(p, seen, missing)
            self._await_posts(missing, k, p.key)

    def _check_stall(self, p: Pending, seen: list[lane.Seen], missing: list[int]) -> None:
        """A warning every stall-check period ``p`` waits for the ``missing`` ranks; past the stall
        deadline this rank stops posting and has rank 0 stop every rank (lock held, never waits).

        The op is not given up here: a slot once posted stays, so a late rank that posted it before
        it stopped would finish it.  Once every rank has stopped, the index resolves from the slots
        alone, alike on every rank: fast if all posted it, else every rank hands it to the engine,
        where rank 0 fails it on every rank (counting the time it waited here) and answers a late
        rank with the same error when that one submits it."""
        waited = time.monotonic() - p.posted_at
        if self._stall_shutdown and waited >= self._stall_shutdown and not p.reported:
            p.reported = True
            self._go_off()
            self._engine.lane_stalled(p.entry.req.name)
        if self._stall_check > 0 and waited >= (p.warned + 1) * self._stall_check:
            p.warned = int(waited // self._stall_check)
            stall = Stall(p.entry.req.name, p.entry.req.kind, tuple(r for r, s in enumerate(seen) if s.posted),
                          tuple(missing), waited)
            deadline = (f"; it fails on every rank once it has waited {self._stall_shutdown:g} s "
                        "(RINGCOMM_STALL_SHUTDOWN_SECONDS)" if self._stall_shutdown else "")
            log.warning("stall: %s (the small-op lane)%s; every rank must run the same collectives in the end",
                        stall.text(), deadline)

    def _await_posts(self, missing: list[int], k: int, key: int) -> None:
        """Wait (lock released) until the ``missing`` ranks have posted index ``k`` fast with ``key``,
        or one of them posts anything else or goes off (the index is decided then), or a slice passes.
        Ranks that post the same op are checked off here, so the slots are read again only once."""
        region = self._region
        reads = self._spin.reads()
        caught: bool | None = None  # how the re-reads went, told to the budget
        self._cond.release()
        try:
            left = missing
            for i in range(reads + self._yields + 1):
                now_left = region.still_missing(left, k, key)
                if not now_left:  # every one posted the op, or one decided the index otherwise
                    caught = 0 < i <= reads or None
                    return
                left = now_left
                if reads <= i < reads + self._yields:
                    os.sched_yield()  # more ranks than cores: let a peer run on this core
            caught = False if reads else None
            r = left[0]
            seen = region.posted(r)
            if not lane.reached(seen, k) and not region.off(r):
                region.sleep_on_posted(r, seen, self._slice)
        finally:
            reacquire(self._cond)
            self._spun(caught)

    def _finish_fast(self, k: int, p: Pending, sizes: list[int]) -> None:
        if not self._unlinked:  # every rank posted index k: each has the region mapped
            self._unlink_once_all_posted()
        e = p.entry
        req = e.req
        try:
            result = None if req.kind == wire.BARRIER else lane.finish(
                req, e.arrays, e.outs, e.grouped, self._region.typed_parts(k, sizes, lane.posted_dtype(req)), self.size,
                rank=self.rank)
        except BaseException as exc:  # every rank computes the same: an alltoall's unmet receipts fail all of them
            del self._pending[k]
            self._publish_read()
            e.handle.set_error(exc)
            return
        del self._pending[k]
        self._publish_read()
        if log.isEnabledFor(logging.DEBUG):
            log.debug("rank %d: %s %r: %d B, process set 0: small-op lane (index %d, every rank computes "
                      "the result from the posted payloads)", self.rank, e.req.kind, e.req.name, sizes[self.rank], k)
        e.handle.set_result(result)  # lock held: runs only the handle's name release, which does not block

    def _divert(self, k: int, p: Pending) -> None:
        log.debug("rank %d: %s %r: lane index %d diverts to the engine (another rank posted another op, or "
                  "not fast)", self.rank, p.entry.req.kind, p.entry.req.name, k)
        del self._pending[k]
        self._publish_read()
        handle = p.entry.handle
        assert isinstance(handle, LaneHandle)
        handle.lane = None  # from here on an ordinary handle: the engine finishes it
        p.entry.waited = time.monotonic() - p.posted_at  # rank 0 counts a stall from the post
        self._divert_entry(p.entry)

    def _divert_entry(self, entry: Entry) -> None:
        """Hand ``entry`` to the engine (lock held: the engine only queues it and writes one wake byte)."""
        try:
            self._engine.submit(entry)
        except BaseException as exc:
            entry.handle.set_error(exc)

    def _fail(self, k: int, p: Pending, err: BaseException) -> None:
        del self._pending[k]
        self._publish_read()
        p.entry.handle.set_error(err)

    def _check_engine(self) -> None:
        err = self._engine.failure
        if err is not None:
            raise err

    # -- the sweeper ------------------------------------------------------------

    def _sweep(self) -> None:
        """Resolve async fast ops nobody waits for (a peer that diverted one waits for this rank's)."""
        with self._cond:
            while self._state is State.OPEN:
                if not self._pending and not self._backlog and time.monotonic() - self._last_fast > IDLE_SECONDS:
                    self._sweeper_idle = True
                    self._cond.wait()  # the lock is released while it sleeps
                    continue
                self._cond.wait(BACKLOG_POLL if self._backlog else SWEEP_SECONDS)
                now = time.monotonic()
                for k in sorted(self._pending):
                    p = self._pending.get(k)
                    if p is not None and now - p.posted_at >= SWEEP_SECONDS:
                        self._resolve(k, None, block=False)
                if self._backlog:
                    err = self._engine.failure
                    if err is not None:
                        self._drain_backlog(err)
                    else:
                        self._flush(block=False)

    # -- closing ----------------------------------------------------------------

    def close(self, timeout: float = 10.0) -> None:
        """This rank posts no more (a shutdown): the others divert what it never posts."""
        with self._cond:
            self._close_locked(time.monotonic() + timeout)
        if self._sweeper is not threading.current_thread():
            self._sweeper.join(timeout=1.0)

    def stop_posting(self) -> None:
        """This rank posts no more until the next join (rank 0 says so after a stall): what it
        submits goes to the engine, and what it posted fast stays pending until the slots decide
        it (every rank stops, so each such index resolves, alike everywhere)."""
        with self._cond:
            self._go_off()

    def _go_off(self) -> None:
        """This rank posts no more: what it submits from now on goes to the engine, and an index
        it never posts diverts on the others (a stall: OFF; a close: CLOSING)."""
        if self._state is State.OPEN:
            self._state = State.OFF
            # lock held: a NetLane sends its off frame, which may wait in _drain as a post does
            self._region.set_off()
            self._drain_backlog(None)
            self._cond.notify_all()

    def _close_locked(self, deadline: float | None) -> None:
        """Go off; ops already posted fast still resolve as the slots say (the others may have
        finished them already), waiting for the peers until ``deadline`` (None: no limit) with the
        lock released while it waits."""
        if self._state in (State.CLOSING, State.CLOSED):
            return
        self._go_off()
        self._state = State.CLOSING
        for k in sorted(self._pending):
            if not self._resolve(k, deadline, block=True) and k in self._pending:
                self._fail(k, self._pending[k], self._unmatched(self._pending[k].entry.req.name))
        self._publish_read()  # reads no more: whatever an interrupted resolve left unpublished
        self._state = State.CLOSED
        if not self._unlinked:
            # only once every rank has it mapped: a rank still starting (rank 0 may join or shut
            # down right after init) would find no region and run without a lane, while this one
            # reopens its lane after the join; the lane's owner unlinks it when the engine closes otherwise
            self._unlink_once_all_posted()

    def _unmatched(self, name: str) -> BaseException:
        """The error of an op this rank posted fast that the others never matched before it closed."""
        return ShutdownError(
            f"rank {self.rank}: ringcomm was shut down while op {name!r} waited for the other ranks; "
            "wait for every op (synchronize) before shutdown()")

    def reopen_after_join(self, barrier: Callable[[], None]) -> None:
        """Every rank has joined, so every rank closed its lane before (and reads no slot any more):
        each zeroes its counters, ``barrier()`` (through the engine) waits until all have, and the
        lanes start again from index 0, so a training loop that joins every epoch keeps the lane."""
        with self._cond:
            ready = self._state in (State.CLOSING, State.CLOSED) and not self._pending  # join closed it and resolved what it posted
            if ready:
                self._region.reset()  # lock held: a NetLane waits for its socket reader, one poll slice at most
                self._next = self._free_below = 0
                self._engine_open.clear()
        self._sweeper.join(timeout=1.0)  # it ended when the lane closed
        barrier()  # on every rank, whatever happens here: the others wait for it
        if not ready:  # pragma: no cover
            return
        with self._cond:
            self._state = State.OPEN
            self._last_fast = 0.0
            self._sweeper_idle = True
            self._sweeper = threading.Thread(target=self._sweep, name=f"ringcomm-lane-{self.rank}", daemon=True)
            self._sweeper.start()
