"""One rank's session: the ops it has in flight and what it knows of the job, with no I/O.

The loop that owns the sockets feeds the session events and does what it returns:

- :meth:`Session.announce`: ops the user threads submitted → what to tell rank 0
  (each op as its request, or as a response-cache id once the same request was
  seen before; a small op's data rides along, so rank 0 can finish it alone);
- :meth:`Session.receive`: a control frame from rank 0 → the ordered responses;
- :meth:`Session.begin`: one response → a :class:`Step` (the entries it completes,
  the data-plane sequence number, the set's ranks, or the error they fail with);
- :meth:`Session.complete`: the result of an op that moves no data (barrier,
  join, shutdown, adding or removing a process set).

The process-set registry is read by user threads (``set_ranks``, ``find_set``)
while the loop's thread changes it: each change installs a new mapping (never
mutated in place), so a reader always sees one whole registry.
"""

from __future__ import annotations

import logging
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

from . import routing, wire
from .cache import ResponseCache
from ..errors import MismatchError, ProtocolError, StallError
from .wire import Request, Response

log = logging.getLogger("ringcomm.session")

#: Kinds whose requests go into the response caches (the others are rare or vary in shape).
CACHED_KINDS = (wire.ALLREDUCE, wire.BROADCAST, wire.REDUCESCATTER)

#: An op announced after this rank had waited for it this long (seconds) tells rank 0 so, which counts
#: a stall from then; shorter waits are not worth the bytes.
WAITED_MIN = 0.5

#: A process set's id goes into the high bits of its ops' data-plane sequence numbers: members of a
#: set count that set's ops alike, and messages of different sets never share a number.
PSET_SHIFT = 40


class Op(Protocol):
    """What the session reads of one op submitted on this rank (the runtime's ``handles.Entry`` is one)."""

    req: Request
    arrays: list[Any]  # the op's buffers (``nbytes``, ``tobytes()``)
    waited: float  # seconds this rank waited for it before the engine got it (see ``handles.Entry``)

    @property
    def key(self) -> tuple[int, str]:
        """``(process set id, name)``: names are unique per set."""
        ...


#: The runtime's op type the session hands back in its steps and completions.
E = TypeVar("E", bound=Op)


class Step(NamedTuple, Generic[E]):
    """What to do with one response on this rank."""

    resp: Response
    entries: list[E]
    seq: int  # the op's data-plane sequence number (room for ``phases`` messages per op)
    members: tuple[int, ...]  # the global ranks of the op's set
    error: Exception | None  # the op failed on every member: its entries fail with this


class Session(Generic[E]):
    """The per-rank state: in-flight ops, response caches, op counts, the process-set registry.

    ``small_bytes``: an allreduce up to this size travels with its request (rank 0
    reduces it); ``small_gather_bytes``: the same for an allgather's part (the rule is
    :func:`routing.route`'s; the engine takes both from :func:`routing.limits_for`).  ``phases``:
    the data-plane sequence numbers one op may use.  ``records``: whether this rank
    records responses in its caches as it executes them (rank 0's service records
    them as it emits them instead).
    """

    def __init__(self, rank: int, size: int, secret: bytes, cache_capacity: int, small_bytes: int = 0,
                 small_gather_bytes: int = 0, phases: int = 1, records: bool = True) -> None:
        self.rank, self.size = rank, size
        self._secret = secret
        self._capacity = cache_capacity
        self._limits = routing.RouteLimits(small_bytes=small_bytes, small_gather_bytes=small_gather_bytes)
        self._phases = phases
        self._records = records
        self._inflight: dict[tuple[int, str], E] = {}
        self._sets: dict[int, tuple[int, ...]] = {0: tuple(range(size))}
        self._seqs: dict[int, int] = {0: 0}
        self._caches: dict[int, ResponseCache] = {0: ResponseCache(cache_capacity)}

    # -- the registry (any thread) --------------------------------------------

    def set_ranks(self, pset: int) -> tuple[int, ...] | None:
        """The global ranks of registered process set ``pset`` (None if unknown)."""
        return self._sets.get(pset)

    def find_set(self, ranks: tuple[int, ...]) -> int | None:
        """The id of the registered set with exactly these ranks, if any."""
        for pset, members in self._sets.items():
            if members == ranks:
                return pset
        return None

    def set_ids(self) -> list[int]:
        return sorted(self._sets)

    # -- events (the loop's thread) ----------------------------------------------

    def track(self, entry: E) -> None:
        """``entry`` is in flight from now on (rank 0: its service has the request)."""
        self._inflight[entry.key] = entry

    def announce(self, entries: list[E]) -> list[bytes]:
        """Track ``entries`` and return the control frames that announce them to rank 0."""
        items: list[tuple[Request | int, int, bytes | None, float]] = []
        for entry in entries:
            req = entry.req
            if req.kind != wire.LANE_OFF:  # a notice, not an op: nothing comes back for it
                self._inflight[entry.key] = entry
            cache = self._caches.get(req.pset)
            cid = cache.lookup(req) if cache is not None else None
            nbytes = sum(a.nbytes for a in entry.arrays)
            data = None
            # an op of no bytes has nothing to carry: it takes the data plane
            if 0 < nbytes and routing.route(req.kind, nbytes, routing.ENGINE_FACTS, self._limits) is routing.Path.RANK0:
                data = b"".join(a.tobytes() for a in entry.arrays)
            waited = entry.waited if entry.waited >= WAITED_MIN else 0.0
            items.append((req if cid is None else cid, req.pset, data, waited))
        return wire.encode_requests(self._secret, self.rank, items) if items else []

    def receive(self, frame: bytes) -> list[Response]:
        """The responses in a control frame from rank 0 (none if it is not one: dropped and logged)."""
        try:
            return wire.parse_response_batch(wire.unpack_control(self._secret, frame))
        except ProtocolError as exc:
            log.debug("rank %d: dropping control message: %s", self.rank, exc)
            return []

    def begin(self, resp: Response) -> Step[E]:
        """Take the entries ``resp`` completes; number the op; record its request in the set's cache."""
        pset = resp.pset
        entries = [self._inflight.pop((pset, name)) for name in resp.names if (pset, name) in self._inflight]
        members = self._sets.get(pset, ())
        if resp.error:
            cls = StallError if resp.error_kind == "stall" else MismatchError
            return Step(resp, entries, -1, members, cls(f"{resp.error} [raised on rank {self.rank}]"))
        # the set's op count advances only for ops that move data (errors may reach one rank only)
        n = self._seqs.get(pset, 0)
        self._seqs[pset] = n + 1
        if not resp.joined and self._records:
            cache = self._caches.get(pset)
            for e in entries:
                if cache is not None and e.req.kind in CACHED_KINDS:
                    cache.record(e.req)
        return Step(resp, entries, (pset << PSET_SHIFT) | (n * self._phases), members, None)

    def complete(self, resp: Response) -> Any:
        """The result of an op that moves no data: barrier, join, shutdown, process-set changes."""
        if resp.kind == wire.JOIN:
            return resp.last_joined
        if resp.kind == wire.ADD_PSET:
            pset, ranks = resp.set_id, resp.set_ranks
            self._sets = {**self._sets, pset: ranks}
            self._seqs[pset] = 0
            if self.rank in ranks:
                self._caches.setdefault(pset, ResponseCache(self._capacity))
            return pset
        if resp.kind == wire.REMOVE_PSET:
            pset = resp.set_id
            self._sets = {p: r for p, r in self._sets.items() if p != pset}
            self._seqs.pop(pset, None)
            self._caches.pop(pset, None)
            return True
        return None

    def pending(self) -> list[E]:
        """The ops in flight (announced, not yet begun)."""
        return list(self._inflight.values())

    def in_flight(self, key: tuple[int, str]) -> bool:
        """Whether the op ``(set, name)`` is announced and not yet begun."""
        return key in self._inflight

    def drop(self, key: tuple[int, str]) -> E | None:
        """Stop tracking the op ``(set, name)``; returns it, or None if it was not in flight."""
        return self._inflight.pop(key, None)

    def drop_all(self) -> list[E]:
        """Stop tracking every op (the engine failed or closed); returns them."""
        out = list(self._inflight.values())
        self._inflight.clear()
        return out
