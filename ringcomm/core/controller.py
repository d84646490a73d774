"""Rank 0's negotiation for every process set: one :class:`Coordinator` per set, keyed by set id.  Pure.

Each process set (0 is the global set, every rank) has its own coordinator:
its own pending names, its own order, fusion, mismatch checks, join and stall
report.  A set's op is released as soon as that set's members have announced
it, whatever other sets are doing.  Adding and removing a set is itself a
collective of the global set (``wire.ADD_PSET`` / ``wire.REMOVE_PSET``): when
its response is taken here, the set is created or dropped, and because every
rank executes the global set's responses in this order, every rank numbers
the sets alike.

:meth:`Controller.take_responses` returns ``(response, recipients)`` pairs in
one order; each rank executes the responses it receives in that order, so two
ranks that share several sets run their common ops in the same order.

What each rank sees (size 4, sets 1 = [0, 2] and 2 = [1, 3])::

    rank 0 and rank 2 submit  allreduce 'a' on set 1
    rank 1 submits            allreduce 'b' on set 2     (rank 3 has not yet)
    take_responses() -> [(Response(allreduce, ('a',), pset=1), (0, 2))]   # 'b' waits for rank 3 only
"""

from __future__ import annotations

from collections.abc import Callable

from . import wire
from .coordinator import Coordinator, Stall, itemsize_of, set_label
from .wire import Request, Response

#: Kinds that only the global set runs.
GLOBAL_ONLY = (wire.JOIN, wire.SHUTDOWN, wire.ADD_PSET, wire.REMOVE_PSET)


class Controller:
    """Every process set's coordinator, the set registry, and requests that cannot be placed."""

    def __init__(self, size: int, fusion_threshold: int, small_bytes: int = 0,
                 itemsize: Callable[[str], int] = itemsize_of) -> None:
        self.size = size
        self._fusion_threshold = fusion_threshold
        self._small = small_bytes
        self._itemsize = itemsize
        self.sets: dict[int, Coordinator] = {0: self._coordinator(0, tuple(range(size)))}
        self._next_id = 1
        self._removed: set[int] = set()
        self._out: list[tuple[Response, tuple[int, ...]]] = []  # errors for requests that fit no set
        #: ranks that submitted the collective shutdown: they will never submit another op
        self._left: list[int] = []

    def _coordinator(self, pset: int, ranks: tuple[int, ...]) -> Coordinator:
        return Coordinator(len(ranks), self._fusion_threshold, self._itemsize, self._small, ranks, pset)

    def members(self, pset: int) -> tuple[int, ...]:
        """The global ranks of a registered set; KeyError for an unknown id."""
        return self.sets[pset].ranks

    # -- input ---------------------------------------------------------------

    def submit(self, rank: int, req: Request, now: float = 0.0, waited: float = 0.0) -> bool:
        """Record that global ``rank`` announced ``req`` on process set ``req.pset`` (at ``now``, after
        waiting ``waited`` seconds for it already: see :meth:`Coordinator.submit`).

        Returns whether the op now waits for its set (False: it is answered already, to ``rank``
        alone: refused here, or failed on a stall before this rank submitted it)."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} out of range for size {self.size}")
        coord = self.sets.get(req.pset)
        what = f"{req.kind} '{req.name}'"
        if coord is None:
            state = "was removed" if req.pset in self._removed else "is not registered"
            self._reject(rank, req, f"{what}: process set {req.pset} {state}; register it with "
                                    "add_process_set() (on every rank) before using it")
        elif not coord.is_member(rank):
            self._reject(rank, req, f"{what}: rank {rank} is not a member of process set {req.pset} "
                                    f"(ranks {list(coord.ranks)}); only its members may run collectives on it")
        elif req.pset != 0 and req.kind in GLOBAL_ONLY:
            self._reject(rank, req, f"{what}: {req.kind} runs on the global process set only")
        else:
            failed = coord.submit(rank, req, now, waited)
            if failed:  # the op failed on a stall before this rank came: it fails here too
                self._reject(rank, req, failed, "stall")
                return False
            if req.kind == wire.SHUTDOWN:
                if rank not in self._left:
                    self._left.append(rank)
                for c in self.sets.values():
                    if c.is_member(rank):
                        self._fail_waiting_for(c, rank)
            elif self._left and req.kind != wire.JOIN:
                for gone in self._left:
                    if coord.is_member(gone):
                        self._fail_waiting_for(coord, gone)
                        break
            return True
        return False

    def _fail_waiting_for(self, coord: Coordinator, rank: int) -> None:
        """Ops of ``coord`` that ``rank`` never submitted and never will (it shut down) fail at once."""
        for name, kind, ranks in coord.waiting_for(rank):
            if kind not in (wire.SHUTDOWN, wire.JOIN):
                coord.fail(name, f"rank {rank} shut down (its program ended, or it called shutdown()) while "
                                 f"rank(s) {list(ranks)} waited for it in {kind} '{name}'{coord.where}; every "
                                 "rank must run the same collectives before it ends", stall=False)

    def _reject(self, rank: int, req: Request, message: str, error_kind: str = "") -> None:
        self._out.append((Response(req.kind, (req.name,), error=message, error_kind=error_kind, pset=req.pset),
                          (rank,)))

    # -- output --------------------------------------------------------------

    def take_responses(self, skip_member: int | None = None) -> list[tuple[Response, tuple[int, ...]]]:
        """Every set's ready responses, each with the global ranks that execute it, in execution order.

        ``skip_member``: leave the ops of sets with this rank for a later call (rank 0 answers only
        other sets while it is busy inside a transfer of its own).
        """
        out, self._out = self._out, []
        for pset in list(self.sets):  # the global set first, then by id
            coord = self.sets.get(pset)
            if coord is None:  # removed by a response taken earlier in this call
                continue
            if skip_member is not None and coord.is_member(skip_member):
                continue
            for resp in coord.take_responses():
                if resp.kind == wire.ADD_PSET and not resp.error:
                    resp = self._add(resp)
                elif resp.kind == wire.REMOVE_PSET and not resp.error:
                    resp = self._remove(resp, out)
                out.append((resp, coord.recipients(resp)))
        return out

    def _add(self, resp: Response) -> Response:
        ranks = resp.set_ranks
        error = self.check_ranks(ranks)
        if not error:
            for pset, coord in self.sets.items():
                if coord.ranks == ranks:
                    error = f"a process set with ranks {list(ranks)} already exists (id {pset})"
                    break
        if error:
            return resp._replace(error=f"add_process_set: {error}")
        pset = self._next_id
        self._next_id += 1
        self.sets[pset] = self._coordinator(pset, ranks)
        return resp._replace(set_id=pset)

    def check_ranks(self, ranks: tuple[int, ...]) -> str:
        """'' if ``ranks`` can form a process set of this job, else why not."""
        if not ranks:
            return "a process set needs at least one rank"
        if any(not isinstance(r, int) or isinstance(r, bool) for r in ranks):
            return f"ranks must be ints, got {list(ranks)}"
        if list(ranks) != sorted(set(ranks)):
            return f"ranks must be sorted and distinct, got {list(ranks)}"
        if ranks[0] < 0 or ranks[-1] >= self.size:
            return f"ranks {list(ranks)} are out of range for a job of size {self.size}; use 0..{self.size - 1}"
        return ""

    def _remove(self, resp: Response, out: list[tuple[Response, tuple[int, ...]]]) -> Response:
        pset = resp.set_id
        if pset == 0:
            return resp._replace(error="remove_process_set: the global process set cannot be removed")
        coord = self.sets.get(pset)
        if coord is None:
            return resp._replace(error=f"remove_process_set: there is no process set {pset}")
        # ops that were already agreed run first; ops still waiting for members fail
        out.extend((r, coord.ranks) for r in coord.take_responses())
        for name in coord.pending_names():
            coord.fail(name, f"op '{name}'{coord.where} was still waiting for ranks when the set was removed")
        out.extend((r._replace(error_kind=""), coord.ranks) for r in coord.take_responses())
        del self.sets[pset]
        self._removed.add(pset)
        return resp

    # -- diagnostics ---------------------------------------------------------

    def stalled(self, now: float, after: float) -> list[tuple[int, Stall]]:
        """``(set id, stall)`` for every op waiting longer than ``after`` seconds for some members."""
        return [(pset, s) for pset, coord in self.sets.items() for s in coord.stalled(now, after)]

    def fail(self, pset: int, name: str, message: str, late: tuple[int, ...] = ()) -> None:
        """Release op ``name`` of set ``pset`` as an error on its members (a stall that lasted too long;
        ``late``: members that get it when they submit the op, see :meth:`Coordinator.fail`)."""
        coord = self.sets.get(pset)
        if coord is not None:
            coord.fail(name, message, late=late)

    def where(self, pset: int) -> str:
        coord = self.sets.get(pset)
        return coord.where if coord is not None else set_label(pset, ())

    def has_ready(self) -> bool:
        return bool(self._out) or any(c.has_ready() for c in self.sets.values())

    def has_pending(self) -> bool:
        return any(c.pending_names() for c in self.sets.values())
