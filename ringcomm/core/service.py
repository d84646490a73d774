"""Rank 0's service: negotiation for every rank, with no I/O.

The service takes every rank's announcements (rank 0's own, and the signed
control frames of the others) and gives back, for each cycle, the ordered
responses: the frames to send to each other rank and the responses rank 0
executes itself.  On the way it

- expands response-cache ids with its own copy of each set's cache, and
  records every emitted response so that its caches stay identical to the members';
- finishes small allreduces and allgathers from the payloads sent with the
  requests (the response then carries the result: 2 hops, no ring);
- holds ops back until the cycle time has passed, and reports stalls.

It never sends, sleeps or calls back: the loop that owns the sockets feeds it
and sends what it returns.  The clock is handed in (``clock``: seconds, used
only to time rank 0's reductions for the timeline).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from . import lane, ops, routing, wire
from .cache import ResponseCache
from .controller import Controller
from ..errors import ProtocolError
from .ops import ReduceOp
from .session import CACHED_KINDS
from .wire import Request, Response

log = logging.getLogger("ringcomm.service")

Pair = tuple[Response, tuple[int, ...]]

#: An op past the stall deadline fails once no rank has submitted it for this long: the ranks whose
#: small-op lanes waited for it too hand it over within that time (each one's lane stops when rank 0
#: says so), and the error then names every rank that waited.
HAND_OVER_SECONDS = 1.0


class Emission(NamedTuple):
    """One cycle's output: every response with its recipients, in execution order; the frames
    for each other rank; the responses rank 0 executes itself; and when rank 0 began each small
    reduction or gather it finished (keyed ``(set, *names)``, for the timeline)."""

    pairs: list[Pair]
    frames: dict[int, list[bytes]]
    local: list[Response]
    reduced_at: dict[tuple[Any, ...], float]


class Service:
    """Rank 0's negotiation state: the controller, the caches, the small ops' payloads."""

    def __init__(self, size: int, secret: bytes, fusion_threshold: int, small_bytes: int, cache_capacity: int,
                 cycle_time_ms: float = 0.0, clock: Callable[[], float] | None = None) -> None:
        self.size, self._secret = size, secret
        self._limits = routing.RouteLimits(small_bytes=small_bytes)  # and rank 0 finishes one control frame's worth
        self._capacity = cache_capacity
        self._cycle = cycle_time_ms
        self._clock = clock
        self.controller = Controller(size, fusion_threshold, small_bytes=small_bytes)
        self._caches: dict[int, ResponseCache] = {0: ResponseCache(cache_capacity)}
        self._payloads: dict[tuple[int, str], dict[int, bytes]] = {}  # small ops' data sent with requests
        self._local: dict[tuple[int, str], list[np.ndarray]] = {}  # rank 0's own arrays
        self._canon: dict[tuple[int, str], Request] = {}  # the first request seen per op, for the caches
        self._last_emit = 0.0
        #: names of ops that turn every rank's small-op lane off, sent with the next emission
        self._lane_off: list[str] = []
        #: stall warnings given per op (one per check period it has waited)
        self._warned: dict[tuple[int, str], int] = {}

    # -- input ---------------------------------------------------------------

    def submit_local(self, req: Request, arrays: list[np.ndarray], now: float, waited: float = 0.0) -> None:
        """Rank 0's own op (its arrays stay rank 0's: they are read if the op is finished here).

        ``waited``: seconds rank 0 had waited for it already (an op its small-op lane handed on)."""
        if self._admit(0, req, now, waited):
            key = (req.pset, req.name)
            self._canon.setdefault(key, req)
            if arrays:
                self._local[key] = arrays

    def _admit(self, rank: int, req: Request, now: float, waited: float) -> bool:
        """Hand ``req`` to the controller; whether it now waits there (a lane notice never does)."""
        if req.kind == wire.LANE_OFF:  # an op of that rank's lane waited past the stall deadline
            log.debug("coordinator: rank %d's small-op lane gave up waiting for op %r: every rank stops "
                      "posting to the lane", rank, req.name)
            self._lane_off.append(req.name)
            return False
        return self.controller.submit(rank, req, now, waited)

    def receive(self, frame: bytes, now: float) -> None:
        """Another rank's signed control frame: its announcements (a bad frame is dropped and logged)."""
        try:
            rank, items = wire.parse_request_batch(wire.unpack_control(self._secret, frame), self.size)
            reqs = []
            for it, data, waited in items:
                if not isinstance(it, wire.Request):  # a response-cache id: (set id, id)
                    pset, cid = it
                    try:
                        it = self._caches[pset].get(cid)
                    except KeyError:
                        raise ProtocolError(f"unknown response-cache id {cid} of process set {pset} "
                                            f"from rank {rank}") from None
                reqs.append((it, data, waited))
        except ProtocolError as exc:
            log.debug("coordinator: dropping control message: %s", exc)
            return
        for req, data, waited in reqs:
            if self._admit(rank, req, now, waited):
                if data is not None:
                    self._payloads.setdefault((req.pset, req.name), {})[rank] = data
                self._canon.setdefault((req.pset, req.name), req)

    # -- output --------------------------------------------------------------

    def has_ready(self) -> bool:
        return bool(self._lane_off) or self.controller.has_ready()

    def has_pending(self) -> bool:
        return self.controller.has_pending()

    def next_wake(self, now: float | None = None) -> int | None:
        """How long the loop may sleep before the service needs another turn (None: until an event).

        An op that is ready never waits for a timer: 0 with no cycle time, else what is left of the
        cycle (``now``, in the clock of :meth:`take`; without it, a whole cycle).  Ops can become ready
        outside the loop's own turn (rank 0 takes requests while it waits inside a transfer, and
        answers only the sets without itself there), so the loop asks after every turn.
        """
        if self.has_ready():
            if self._cycle <= 0:
                return 0
            if now is None:
                return max(1, int(self._cycle))
            return max(0, int(self._cycle - (now - self._last_emit) * 1000 + 0.999))
        if self.controller.has_pending():
            return 1000  # stall checks: nothing can become ready without a message, which wakes the loop
        return None

    def take(self, now: float, nested: bool = False) -> Emission | None:
        """The responses ready now, or None (none ready, or the cycle time has not passed).

        ``nested``: rank 0 is inside a transfer of its own: answer only the sets without it (a set
        with rank 0 cannot run its next op before rank 0 is done, and a shutdown must not reach the
        other ranks while rank 0 still needs their data).
        """
        coord = self.controller
        if self._cycle > 0 and coord.has_ready() and (now - self._last_emit) * 1000 < self._cycle:
            return None
        pairs = coord.take_responses(skip_member=0 if nested else None)
        lane_off = bool(self._lane_off) and not nested  # it goes to rank 0 too: not while rank 0 is busy
        if not pairs and not lane_off:
            return None
        self._last_emit = now
        reduced_at: dict[tuple[Any, ...], float] = {}
        if self._payloads:
            pairs = [(self._finish_small(r, members, reduced_at), members) for r, members in pairs]
        self._record(pairs)
        for resp, _ in pairs:
            for name in resp.names:
                self._local.pop((resp.pset, name), None)
        if lane_off:  # first: a rank told of a failed op posts its next ones to the engine already
            pairs.insert(0, (Response(wire.LANE_OFF, (self._lane_off[0],)), tuple(range(self.size))))
            self._lane_off = []
        frames = self._frames(pairs) if self.size > 1 else {}
        local = [resp for resp, members in pairs if 0 in members]
        return Emission(pairs, frames, local, reduced_at)

    def _record(self, pairs: list[Pair]) -> None:
        """Rank 0 caches every set's requests as it emits them, members cache theirs as they execute.

        The order is the same, so the caches agree; rank 0 must know an id before a member can
        send it, and it may not be a member of the set at all.
        """
        for resp, _ in pairs:
            if resp.kind == wire.ADD_PSET and not resp.error:
                self._caches[resp.set_id] = ResponseCache(self._capacity)
            if resp.kind == wire.REMOVE_PSET and not resp.error:
                self._caches.pop(resp.set_id, None)
            if resp.error or resp.joined or resp.kind not in CACHED_KINDS:
                continue
            cache = self._caches.get(resp.pset)
            for name in resp.names:
                req = self._canon.get((resp.pset, name))
                if cache is not None and req is not None:
                    cache.record(req)
        for resp, _ in pairs:
            for name in resp.names:
                self._canon.pop((resp.pset, name), None)

    def _frames(self, pairs: list[Pair]) -> dict[int, list[bytes]]:
        """Each other rank's frames: the responses of its sets, in emission order (ranks that get the
        same list share its frames)."""
        per_rank: dict[int, list[int]] = {}
        for i, (_, members) in enumerate(pairs):
            for r in members:
                if r != 0:
                    per_rank.setdefault(r, []).append(i)
        encoded: dict[tuple[int, ...], list[bytes]] = {}
        out: dict[int, list[bytes]] = {}
        for r, idx in per_rank.items():
            key = tuple(idx)
            if key not in encoded:
                encoded[key] = wire.encode_responses(self._secret, [pairs[i][0] for i in idx])
            out[r] = encoded[key]
        return out

    # -- small ops finished at rank 0 ----------------------------------------

    def _now(self) -> float:
        return self._clock() if self._clock is not None else 0.0

    def _finish_small(self, resp: Response, members: tuple[int, ...],
                      reduced_at: dict[tuple[Any, ...], float]) -> Response:
        """A small allreduce or allgather finished from the payloads sent with the requests (the
        response carries the result).  Anything else comes back unchanged."""
        payloads = [self._payloads.pop((resp.pset, n), {}) for n in resp.names]
        if resp.error or not resp.names:
            return resp
        started = self._now()
        if resp.kind == wire.ALLREDUCE and resp.numels:
            done = self._reduce(resp, members, payloads)
        elif resp.kind == wire.ALLGATHER:
            done = self._gather(resp, members, payloads[0])
        else:
            return resp
        if done is not resp:
            reduced_at[(resp.pset, *resp.names)] = started
        return done

    def _gather(self, resp: Response, members: tuple[int, ...], payloads: dict[int, bytes]) -> Response:
        """The members' parts, concatenated in set order; unchanged (the ring runs) if one is missing."""
        (name,) = resp.names
        req = self._canon.get((resp.pset, name))
        if req is None or len(resp.first_dims) != len(members):
            return resp
        row_bytes = int(np.prod(req.shapes[0][1:], dtype=np.int64)) * np.dtype(resp.dtype).itemsize
        if routing.route(wire.ALLGATHER, sum(resp.first_dims) * row_bytes, routing.RANK0_FACTS,
                         self._limits) is not routing.Path.RANK0:
            return resp  # too much to carry in one control frame: run the ring
        parts: list[bytes] = []
        for rank, dim in zip(members, resp.first_dims):
            if rank == 0:
                local = self._local.get((resp.pset, name))
                part = local[0].tobytes() if local else None
            else:
                part = payloads.get(rank)
            if part is None or len(part) != dim * row_bytes:
                return resp
            parts.append(part)
        return resp._replace(data=b"".join(parts))

    def _reduce(self, resp: Response, members: tuple[int, ...], payloads: list[dict[int, bytes]]) -> Response:
        """A small allreduce reduced from the payloads sent with the requests."""
        dtype = np.dtype(resp.dtype)
        if routing.route(wire.ALLREDUCE, sum(resp.numels) * dtype.itemsize, routing.RANK0_FACTS,
                         self._limits) is not routing.Path.RANK0:
            return resp  # too much to carry in one control frame (many small ones fused): run the ring
        op = ReduceOp(resp.op)
        joined = set(resp.joined)
        contribs: list[np.ndarray] = []
        total = sum(resp.numels)
        for rank in members:
            if rank in joined:
                continue
            if rank == 0:
                arrays = []
                for n in resp.names:
                    local = self._local.get((resp.pset, n))
                    if local is None:
                        return resp
                    arrays.extend(local)
                contrib = arrays[0].reshape(-1) if len(arrays) == 1 else np.concatenate([a.reshape(-1) for a in arrays])
            else:
                parts = [p.get(rank) for p in payloads]
                if any(p is None for p in parts):
                    return resp  # some rank sent no payload: run the ring
                raw = parts[0] if len(parts) == 1 else b"".join(parts)  # type: ignore[arg-type]
                contrib = np.frombuffer(raw, dtype=dtype)  # type: ignore[arg-type]
            if contrib.size != total:
                return resp
            contribs.append(contrib)
        if not contribs:
            return resp
        # the same arithmetic as the one-host lane's (core/lane.py): both paths agree bitwise
        acc = lane.reduce_ordered(op, contribs, resp.prescale, ops.postscale(op, len(members), resp.postscale))
        return resp._replace(data=acc.tobytes())

    # -- diagnostics ---------------------------------------------------------

    def stalls(self, now: float, check_seconds: float, shutdown_seconds: float) -> list[tuple[tuple[int, str], str]]:
        """``((set, name), text)`` for each op to warn about now: one that has waited for some ranks
        for another ``check_seconds`` (a warning every period, with the time waited so far).  One
        waiting ``shutdown_seconds`` (if set) fails instead, on every member: on the ranks that
        submitted it now, on each late rank when it submits it (:meth:`Coordinator.fail`).  A join
        or a shutdown is never a stall (a rank that joined may wait for the others' last batches).

        An op waiting ``check_seconds`` for ranks that all sit in a barrier its own ranks have not
        reached is failed at once (:meth:`Stall.blocked_by`): the ranks diverged (a test failed on
        some ranks only), and failing that op lets its ranks go on to the barrier, in step again.
        The barrier itself is left waiting.  Every failure of an op of the global set also turns
        every rank's small-op lane off: the ranks' lane indexes may no longer line up."""
        coord = self.controller
        after = min(check_seconds, shutdown_seconds or check_seconds)
        out = []
        stalls = [(p, s) for p, s in coord.stalled(now, after) if s.kind not in (wire.JOIN, wire.SHUTDOWN)]
        barriers = [(pset, s) for pset, s in coord.stalled(now, 0.0) if s.kind == wire.BARRIER] if stalls else []
        warned: dict[tuple[int, str], int] = {}
        for pset, stall in stalls:
            where = coord.where(pset)
            if stall.waited >= check_seconds:
                blocker = next((b for p, b in barriers if p == pset and stall.blocked_by(b)), None)
                if blocker is not None:  # a deadlock, not a slow rank: end it where the barrier can go on
                    coord.fail(pset, stall.name, stall.diverged(blocker, where))
                    self._lane_off.extend([stall.name] if pset == 0 else [])
                    continue
            if shutdown_seconds and stall.waited >= shutdown_seconds:
                if stall.quiet >= HAND_OVER_SECONDS:  # else other ranks' lanes may still hand it over
                    coord.fail(pset, stall.name, stall.failure(shutdown_seconds, where), late=stall.missing)
                    self._lane_off.extend([stall.name] if pset == 0 else [])
                continue
            key = (pset, stall.name)
            periods = int(stall.waited // check_seconds) if check_seconds > 0 else 0
            warned[key] = max(periods, self._warned.get(key, 0))
            if periods > self._warned.get(key, 0):
                deadline = (f"; it fails on every rank once it has waited {shutdown_seconds:g} s "
                            "(RINGCOMM_STALL_SHUTDOWN_SECONDS)" if shutdown_seconds else "")
                out.append((key, stall.text(where) + deadline))
        self._warned = warned  # ops that finished or failed are forgotten
        return out
