"""Rank 0's coordinator: turns every rank's requests into one ordered list of responses.  Pure.

Ranks announce named ops in any order; the coordinator releases an op once
every rank has announced it (ranks that called ``join()`` count as present
for allreduce), checks that the ranks agree, fuses ready allreduces that
share a dtype and reduction, and returns responses that every rank then
executes in the same order.  No sockets, threads or clocks: the engine feeds
it and passes the time in.

What each rank sees (size 2)::

    rank 0 submits  a, b          rank 1 submits  b, a
    coordinator.take_responses() -> [Response(allreduce, names=(a, b))]   # fused, same on both
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import numpy as np

from . import routing, wire
from .fusion import FusionItem, plan_fusion
from .wire import Request, Response

#: Ops failed on a stall whose late ranks are still expected, remembered per process set (the oldest
#: is forgotten first: its late ranks would then wait for the others again).
LATE_KEPT = 4096

JOIN_NAME = "__join__"
SHUTDOWN_NAME = "__shutdown__"


class Stall(NamedTuple):
    """An op some ranks submitted long ago while others did not."""

    name: str
    kind: str
    submitted: tuple[int, ...]
    missing: tuple[int, ...]
    waited: float
    #: seconds since a rank last submitted it
    quiet: float = float("inf")

    def text(self, where: str = "") -> str:
        """``allreduce 'x' was submitted by ranks [0] 3 s ago but ranks [1, 2] have not submitted it``."""
        ago = f"{self.waited:.0f}" if self.waited >= 10 else f"{self.waited:.1f}"
        return (f"{self.kind} '{self.name}'{where} was submitted by ranks {list(self.submitted)} "
                f"{ago} s ago but ranks {list(self.missing)} have not submitted it")

    def failure(self, shutdown_seconds: float, where: str = "") -> str:
        """What the op fails with, on every rank, once it has waited ``shutdown_seconds``."""
        late = f"rank {self.missing[0]} gets" if len(self.missing) == 1 else f"ranks {list(self.missing)} get"
        return (f"stalled: {self.text(where)} (RINGCOMM_STALL_SHUTDOWN_SECONDS={shutdown_seconds:g}). The op "
                f"failed on every rank and reduced no data: {late} this error when submitting it, and later "
                "ops run as usual. Every rank must run the same collectives; if a rank is "
                "only slow, raise RINGCOMM_STALL_SHUTDOWN_SECONDS (0: wait for ever)")

    def blocked_by(self, barrier: Stall) -> bool:
        """Whether every rank this op waits for sits in ``barrier``, which only this op's ranks
        have not reached: they cannot reach it while they wait here, so neither op can finish.
        Never for a barrier, join or shutdown waiting itself (which side to fail is unclear)."""
        return (barrier.kind == wire.BARRIER and self.kind not in (wire.BARRIER, wire.JOIN, wire.SHUTDOWN)
                and bool(self.missing)
                and set(self.missing) <= set(barrier.submitted) and set(barrier.missing) <= set(self.submitted))

    def diverged(self, barrier: Stall, where: str = "") -> str:
        """What the op fails with when :meth:`blocked_by` ``barrier`` holds."""
        return (f"the ranks diverged: {self.text(where)}; ranks {list(self.missing)} wait in barrier "
                f"'{barrier.name}', which ranks {list(barrier.missing)} would reach only after this op, "
                "so neither can finish (did a test or step fail on some ranks only?). This op fails on "
                f"ranks {list(self.submitted)} so that they go on to the barrier")


def itemsize_of(dtype: str) -> int:
    return np.dtype(dtype).itemsize if dtype else 1


def _describe(values: Mapping[int, object]) -> str:
    """'rank 0 and rank 2 have (3,); rank 1 has (4,)' from {rank: value}."""
    groups: dict[str, list[int]] = {}
    for rank in sorted(values):
        groups.setdefault(repr(values[rank]), []).append(rank)
    parts = []
    for text, ranks in groups.items():
        who = " and ".join(f"rank {r}" for r in ranks) if len(ranks) <= 3 else f"ranks {ranks}"
        parts.append(f"{who} {'have' if len(ranks) > 1 else 'has'} {text}")
    return "; ".join(parts)


_FIELD_LABEL = {
    "kind": "the collective",
    "dtype": "dtype",
    "shapes": "shape",
    "op": "reduce op",
    "root": "root_rank",
    "prescale": "prescale_factor",
    "postscale": "postscale_factor",
}

_MUST_AGREE = {
    wire.ALLREDUCE: ("dtype", "shapes", "op", "prescale", "postscale"),
    wire.BROADCAST: ("dtype", "shapes", "root"),
    wire.REDUCESCATTER: ("dtype", "shapes", "op", "prescale", "postscale"),
    wire.ALLGATHER: ("dtype",),
    wire.ALLTOALL: ("dtype",),
    wire.BARRIER: (),
    wire.JOIN: (),
    wire.SHUTDOWN: (),
    wire.ADD_PSET: ("set_ranks",),
    wire.REMOVE_PSET: ("set_id",),
}

_KIND_FIELD_LABEL = {(wire.ADD_PSET, "set_ranks"): "the ranks", (wire.REMOVE_PSET, "set_id"): "the process set id"}


def set_label(pset: int, ranks: tuple[int, ...]) -> str:
    """' in process set 1 (ranks [0, 2])' for a set other than the global one, else ''."""
    return f" in process set {pset} (ranks {list(ranks)})" if pset else ""


def check_agreement(name: str, reqs: dict[int, Request], where: str = "") -> str:
    """Return '' if the ranks' requests for ``name`` are compatible, else an error message.

    ``reqs`` is keyed by global rank; ``where`` (e.g. `` in process set 1 (ranks [0, 2])``)
    follows the op's name in the message.
    """
    refusals = {r: q.refused for r, q in reqs.items() if q.refused}
    if refusals:  # a rank refused its call: the op fails everywhere with its reason
        r = min(refusals)
        others = sorted(set(refusals) - {r})
        also = f" (rank(s) {others} refused it too)" if others else ""
        return f"rank {r} refused the call{also}: {refusals[r].removeprefix(f'rank {r}: ')}"
    it = iter(reqs.values())
    first = next(it)
    if first.kind in (wire.ALLREDUCE, wire.BROADCAST, wire.REDUCESCATTER, wire.BARRIER, wire.JOIN, wire.SHUTDOWN,
                      wire.ADD_PSET, wire.REMOVE_PSET):
        if all(q == first for q in it):  # the common case: identical requests
            return ""
    kinds = {r: q.kind for r, q in reqs.items()}
    if len(set(kinds.values())) > 1:
        return (f"op '{name}'{where}: ranks disagree on the collective: {_describe(kinds)}. "
                "Every rank must call the same collective under one name.")
    kind = next(iter(kinds.values()))
    for field in _MUST_AGREE[kind]:
        values = {r: getattr(q, field) for r, q in reqs.items()}
        if field == "shapes":
            values = {r: (v[0] if len(v) == 1 else list(v)) for r, v in values.items()}
        if field == "op":
            values = {r: _op_name(v) for r, v in values.items()}
        if field in ("splits", "set_ranks"):
            values = {r: list(v or ()) for r, v in values.items()}
        if len({repr(v) for v in values.values()}) > 1:
            label = _KIND_FIELD_LABEL.get((kind, field), _FIELD_LABEL.get(field, field))
            return (
                f"{kind} '{name}'{where}: ranks disagree on {label}: {_describe(values)}. "
                f"Pass the same {label.removeprefix('the ')} on every rank."
            )
    if kind in (wire.ALLGATHER, wire.ALLTOALL):
        trailing = {r: tuple(q.shapes[0][1:]) if q.shapes and q.shapes[0] else () for r, q in reqs.items()}
        if len(set(trailing.values())) > 1:
            return (
                f"{kind} '{name}'{where}: ranks disagree on the dimensions after the first: {_describe(trailing)}. "
                "Only dim 0 may differ between ranks."
            )
    if kind == wire.ALLTOALL:
        size = len(reqs)
        bad = {r: len(q.splits or ()) for r, q in reqs.items() if len(q.splits or ()) != size}
        if bad:
            return f"alltoall '{name}'{where}: splits must have one entry per rank ({size}): {_describe(bad)}."
        return unmet_receipts(name, where, [reqs[r].splits or () for r in sorted(reqs)],
                              [reqs[r].received_splits for r in sorted(reqs)], sorted(reqs))
    return ""


def unmet_receipts(name: str, where: str, splits: Sequence[Sequence[int]],
                   expected: Sequence[Sequence[int] | None], ranks: Sequence[int]) -> str:
    """'' unless a rank that said what it expects from each rank of an alltoall (``expected[i]``,
    or None) would receive other rows; then an error message naming the first such rank.

    ``splits[j]`` is member ``j``'s split vector; ``ranks`` the members' global ranks (for the
    message).  The engine's agreement and the small-op lane both decide with it, so an alltoall
    fails on every rank, not only on the one whose output would not fit.

        unmet_receipts("x", "", [[1, 1], [2, 1]], [[1, 1], None], [0, 1])
        -> "alltoall 'x': rank 0 expects [1, 1] rows from ranks [0, 1], which send it [1, 2]; ..."
    """
    for i, want in enumerate(expected):
        if want is None:
            continue
        sent = [int(s[i]) if i < len(s) else 0 for s in splits]
        if len(want) != len(splits) or [int(v) for v in want] != sent:
            return (f"alltoall '{name}'{where}: rank {ranks[i]} expects {list(want)} rows from ranks "
                    f"{list(ranks)}, which send it {sent}. Each rank must send every rank the rows that rank "
                    "expects (in torch.distributed: output_split_sizes against the others' input_split_sizes, "
                    "or the sizes of the scatter, gather or alltoall tensors).")
    return ""


def _op_name(op: int) -> str:
    from .ops import ReduceOp

    try:
        return ReduceOp(op).name.capitalize()
    except ValueError:
        return str(op)


class Coordinator:
    """Collects requests from the ``size`` ranks of one process set and emits ordered, fused responses.

    ``ranks`` are the set's global ranks (default ``0..size-1``, the global set);
    :meth:`submit` takes global ranks, and messages name global ranks.
    ``first_dims``/``splits`` in responses are in the order of ``ranks``.
    """

    def __init__(self, size: int, fusion_threshold: int, itemsize: Callable[[str], int] = itemsize_of,
                 small_bytes: int = 0, ranks: tuple[int, ...] | None = None, pset: int = 0) -> None:
        self.size = size
        self.ranks = tuple(ranks) if ranks is not None else tuple(range(size))
        if len(self.ranks) != size:
            raise ValueError(f"process set of size {size} given {len(self.ranks)} ranks")
        self._members = frozenset(self.ranks)
        self.pset = pset
        self.where = set_label(pset, self.ranks)
        self.fusion_threshold = fusion_threshold
        # allreduces of the rank-0 path fuse only with each other (rank 0 reduces them)
        self._limits = routing.RouteLimits(small_bytes=small_bytes)
        self._itemsize = itemsize
        self._pending: dict[str, dict[int, Request]] = {}
        self._first_seen: dict[str, float] = {}
        self._last_seen: dict[str, float] = {}
        self._ready: list[str] = []
        self._ready_set: set[str] = set()  # the names in _ready: a membership test per submit stays O(1)
        self._errors: dict[str, str] = {}
        self._stalled: set[str] = set()
        self._joined: list[int] = []
        #: ops failed on a stall before some ranks submitted them: name -> (error, those ranks);
        #: each one's next submission of the name is answered with that error, and nothing else
        self._late: dict[str, tuple[str, set[int]]] = {}
        self._recipients: dict[str, tuple[int, ...]] = {}  # failed ops answered to their submitters only

    # -- input ---------------------------------------------------------------

    def submit(self, rank: int, req: Request, now: float = 0.0, waited: float = 0.0) -> str:
        """Record that ``rank`` announced ``req`` at ``now``, having waited ``waited`` seconds for it
        before (an op its small-op lane handed on): a stall counts from then.

        Returns '' or, when the op already failed on a stall while ``rank`` had not submitted it, that
        error: the caller answers ``rank`` alone with it, and the op is not pending again.
        """
        if rank not in self._members:
            raise ValueError(f"rank {rank} is not a member of{self.where or ' the job'} (ranks {list(self.ranks)})")
        name = req.name
        late = self._late.get(name)
        if late is not None and rank in late[1]:
            late[1].discard(rank)
            if not late[1]:
                del self._late[name]
            return late[0]
        if name in self._ready_set:
            # a rank re-used a name whose previous instance has not been taken yet
            self._errors.setdefault(name, f"op '{name}'{self.where} was submitted twice by rank {rank} before it completed")
            return ""
        slot = self._pending.setdefault(name, {})
        if rank in slot:
            self._errors[name] = f"op '{name}'{self.where} was submitted twice by rank {rank} before it completed"
        slot[rank] = req
        self._first_seen[name] = min(now - waited, self._first_seen.get(name, now))
        self._last_seen[name] = now
        if req.kind == wire.JOIN and rank not in self._joined:
            self._joined.append(rank)
            self._recheck_all()
        else:
            self._check_ready(name)
        return ""

    def is_member(self, rank: int) -> bool:
        """Whether global ``rank`` belongs to this set (constant time)."""
        return rank in self._members

    def _mark_ready(self, name: str) -> None:
        self._ready.append(name)
        self._ready_set.add(name)

    def _check_ready(self, name: str) -> None:
        # Called once per submit: constant work unless some rank has joined (slots hold members only).
        slot = self._pending.get(name)
        if not slot or name in self._ready_set:
            return
        if len(slot) == self.size:
            self._mark_ready(name)
            return
        if not self._joined:
            return
        kind = next(iter(slot.values())).kind
        if kind in (wire.JOIN, wire.SHUTDOWN):
            return
        joined = set(self._joined)
        if joined | slot.keys() >= self._members:
            if kind != wire.ALLREDUCE:
                self._errors[name] = (
                    f"{kind} '{name}' cannot run while rank(s) {sorted(joined - slot.keys())} have joined; "
                    "after join() only allreduce proceeds (joined ranks contribute zeros)"
                )
            self._mark_ready(name)

    def _recheck_all(self) -> None:
        for name in list(self._pending):
            self._check_ready(name)

    # -- output --------------------------------------------------------------

    def take_responses(self) -> list[Response]:
        """Responses for every op that became ready, in execution order (fused where possible)."""
        if not self._ready:
            return []
        ready, self._ready = self._ready, []
        self._ready_set.clear()
        out: list[Response | None] = []
        fusable: list[tuple[int, str, Request]] = []  # (slot in out, name, req)
        joined = tuple(sorted(set(self._joined)))
        for name in ready:
            reqs = self._pending.pop(name)
            self._first_seen.pop(name, None)
            self._last_seen.pop(name, None)
            error = self._errors.pop(name, "") or check_agreement(name, reqs, self.where)
            first = reqs[min(reqs)]
            if error:
                if first.kind == wire.JOIN:
                    self._joined = []
                kind = "stall" if name in self._stalled else "mismatch"
                self._stalled.discard(name)
                out.append(Response(first.kind, (name,), error=error, error_kind=kind, pset=self.pset))
                continue
            if first.kind == wire.JOIN:
                last = self._joined[-1]
                self._joined = []
                out.append(Response(wire.JOIN, (name,), last_joined=last, pset=self.pset))
            elif first.kind == wire.ALLREDUCE:
                fusable.append((len(out), name, first))
                out.append(None)
            else:
                out.append(self._single(name, first, reqs, joined))
        if fusable:
            items = []
            for _, _, q in fusable:
                nbytes = q.numel() * self._itemsize(q.dtype)
                rank0 = routing.route(wire.ALLREDUCE, nbytes, routing.ENGINE_FACTS, self._limits) is routing.Path.RANK0
                items.append(FusionItem((q.dtype, q.op, q.prescale, q.postscale, rank0), nbytes))
            for group in plan_fusion(items, self.fusion_threshold):
                members = [fusable[i] for i in group]
                q = members[0][2]
                out[members[0][0]] = Response(
                    wire.ALLREDUCE,
                    tuple(m[1] for m in members),
                    dtype=q.dtype,
                    op=q.op,
                    prescale=q.prescale,
                    postscale=q.postscale,
                    numels=tuple(m[2].numel() for m in members),
                    joined=joined,
                    pset=self.pset,
                )
        return [r for r in out if r is not None]

    def _single(self, name: str, q: Request, reqs: dict[int, Request], joined: tuple[int, ...]) -> Response:
        kind = q.kind
        if kind == wire.ALLGATHER:
            dims = tuple(reqs[r].shapes[0][0] if reqs[r].shapes[0] else 1 for r in self.ranks)
            return Response(kind, (name,), dtype=q.dtype, first_dims=dims, pset=self.pset)
        if kind == wire.ALLTOALL:
            splits = tuple(tuple(reqs[r].splits or ()) for r in self.ranks)
            return Response(kind, (name,), dtype=q.dtype, splits=splits, pset=self.pset)
        if kind == wire.ADD_PSET:
            return Response(kind, (name,), set_ranks=q.set_ranks, pset=self.pset)
        if kind == wire.REMOVE_PSET:
            return Response(kind, (name,), set_id=q.set_id, pset=self.pset)
        return Response(
            kind, (name,), dtype=q.dtype, op=q.op, root=q.root, prescale=q.prescale,
            postscale=q.postscale, numels=(q.numel(),), joined=joined, pset=self.pset,
        )

    # -- diagnostics ---------------------------------------------------------

    def stalled(self, now: float, after: float) -> list[Stall]:
        """Ops first announced more than ``after`` seconds ago and still missing some ranks."""
        stalls = []
        for name, since in self._first_seen.items():
            if now - since < after or name not in self._pending:
                continue
            slot = self._pending[name]
            kind = next(iter(slot.values())).kind
            missing = tuple(r for r in self.ranks if r not in slot and r not in self._joined)
            stalls.append(Stall(name, kind, tuple(sorted(slot)), missing, now - since,
                                now - self._last_seen.get(name, since)))
        return stalls

    def fail(self, name: str, message: str, stall: bool = True, late: tuple[int, ...] = ()) -> None:
        """Release ``name`` now as an error on every rank (a stall that lasted too long, or with
        ``stall=False`` a mismatch: ranks that will never submit it).

        ``late``: ranks that have not submitted it and are expected to: the error goes to the others
        now, and to each of these when it submits the op (:meth:`submit`), so the op fails on every
        rank and runs on none.  At most :data:`LATE_KEPT` such ops are remembered per set."""
        if name in self._pending and name not in self._ready_set:
            self._errors[name] = message
            if stall:
                self._stalled.add(name)
            if late:
                self._late.pop(name, None)
                while len(self._late) >= LATE_KEPT:
                    del self._late[next(iter(self._late))]
                self._late[name] = (message, set(late))
                self._recipients[name] = tuple(r for r in self.ranks if r not in late)
            self._mark_ready(name)

    def recipients(self, resp: Response) -> tuple[int, ...]:
        """The ranks that execute ``resp``, one of :meth:`take_responses`'s: the set's ranks, but only
        the submitters for an op failed with ``late`` ranks (asked once per response)."""
        if resp.error and len(resp.names) == 1:
            return self._recipients.pop(resp.names[0], self.ranks)
        return self.ranks

    def waiting_for(self, rank: int) -> list[tuple[str, str, tuple[int, ...]]]:
        """``(name, kind, ranks that submitted it)`` of every pending op that ``rank`` has not submitted."""
        out = []
        for name, slot in self._pending.items():
            if rank not in slot and name not in self._ready_set and rank not in self._joined:
                out.append((name, next(iter(slot.values())).kind, tuple(sorted(slot))))
        return out

    def pending_names(self) -> list[str]:
        return list(self._pending)

    def has_ready(self) -> bool:
        return bool(self._ready)
