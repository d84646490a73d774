"""Process sets: subsets of ranks that run collectives among themselves, Horovod's API.

A :class:`ProcessSet` names a sorted list of global ranks.  It gets an id when
it is registered — passed to ``init(process_sets=[...])`` or to
``add_process_set()`` after ``init(process_sets="dynamic")`` — and from then
on ``process_set=`` on any collective runs that collective on its members
only: each set has its own negotiation order at rank 0 and its own ring
(neighbours within the set, over the job's existing connections), so ops on
disjoint sets run concurrently.  ``global_process_set`` (id 0) is every rank.

What each rank sees (``ringcomm-run -np 4``)::

    even = rc.ProcessSet([0, 2])
    rc.init(process_sets=[even])
    even.process_set_id          # every rank: 1
    even.rank(), even.size()     # rank 0: (0, 2)   rank 2: (1, 2)   ranks 1, 3: (-1, 2)
    even.included()              # ranks 0, 2: True   ranks 1, 3: False
    rc.allreduce(np.array([rc.rank()]), op=rc.Sum, process_set=even)   # ranks 0, 2: [2]; ranks 1, 3 must not call it
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from . import wire
from .errors import InvalidInputError, InvalidTypeError

if TYPE_CHECKING:
    from .api import Runtime


class ProcessSet:
    """A set of global ranks; registered sets carry ``process_set_id`` (None until registered)."""

    def __init__(self, ranks: Iterable[int]) -> None:
        if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Iterable):
            raise InvalidTypeError(f"ProcessSet(ranks): expected a list of ranks, got {type(ranks).__name__}")
        values = list(ranks)
        if any(isinstance(r, bool) or not isinstance(r, (int, np.integer)) for r in values):
            raise InvalidTypeError(f"ProcessSet(ranks): ranks must be ints, got {values!r}")
        ints = sorted(int(r) for r in values)
        if len(set(ints)) != len(ints):
            raise InvalidInputError(f"ProcessSet(ranks): duplicate ranks in {values!r}")
        if ints and ints[0] < 0:
            raise InvalidInputError(f"ProcessSet(ranks): ranks must be >= 0, got {values!r}")
        self.ranks: list[int] | None = ints
        self.process_set_id: int | None = None
        self._round = -1  # which init() registered it: a set from before shutdown() is not valid after

    def _this_rank(self) -> int:
        from . import api

        return api.rank()

    def size(self) -> int | None:
        """Number of ranks in the set (None once removed)."""
        return None if self.ranks is None else len(self.ranks)

    def rank(self) -> int | None:
        """This process's rank within the set: 0..size()-1, -1 when it is not a member (None once removed)."""
        if self.ranks is None:
            return None
        me = self._this_rank()
        return self.ranks.index(me) if me in self.ranks else -1

    def included(self) -> bool | None:
        """Whether this process is a member (None once removed)."""
        return None if self.ranks is None else self._this_rank() in self.ranks

    def invalidate(self) -> None:
        """Forget the registration (``remove_process_set`` calls it)."""
        self.process_set_id = None
        self.ranks = None

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"

    __str__ = __repr__


#: Every rank of the job; its ``ranks`` are filled in by ``init()``.
global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


def as_process_set(value: Any, what: str) -> ProcessSet:
    """A ProcessSet from a ProcessSet or a list of ranks."""
    if isinstance(value, ProcessSet):
        return value
    try:
        return ProcessSet(value)
    except InvalidTypeError as exc:
        raise InvalidTypeError(f"{what}: expected a ProcessSet or a list of ranks ({exc})") from None


def register(rt: Runtime, ps: ProcessSet, what: str, name: str | None = None) -> ProcessSet:
    """Register ``ps`` on every rank (a collective of the global set); sets its id.

    ``name``: the op's name, taken before the arguments were checked: when this rank refuses them,
    rank 0 hears of it and the call fails on every rank instead of leaving the others waiting.
    """
    try:
        done = _check_new_set(rt, ps, what)
    except (InvalidInputError, InvalidTypeError) as exc:
        if name is not None:
            rt.refuse(wire.ADD_PSET, name, 0, str(exc))
        raise
    if done is not None:
        return done
    req = wire.Request(name or rt.auto_name(wire.ADD_PSET, None), wire.ADD_PSET, splits=tuple(ps.ranks or ()))
    ps.process_set_id = int(rt.submit(req, []).wait())
    ps._round = rt.round
    return ps


def _check_new_set(rt: Runtime, ps: ProcessSet, what: str) -> ProcessSet | None:
    """Raise if ``ps`` cannot be registered; ``ps`` when it needs no new set; None when it must be added."""
    if ps.ranks is None:
        raise InvalidInputError(f"{what}: {ps!r} was removed; create a new ProcessSet")
    bad = [r for r in ps.ranks if r >= rt.topo.size]
    if not ps.ranks or bad:
        raise InvalidInputError(
            f"{what}: ranks {ps.ranks} do not form a process set of this job of size {rt.topo.size}; "
            f"use a non-empty list of ranks in 0..{rt.topo.size - 1}"
        )
    if tuple(ps.ranks) == rt.all_ranks:  # every rank: that is the global set (as in Horovod)
        ps.process_set_id, ps._round = 0, rt.round
        return ps
    existing = rt.engine.find_set(tuple(ps.ranks))
    if existing is not None and what.startswith("init"):  # the same ranks twice in init(): one set
        ps.process_set_id, ps._round = existing, rt.round
        return ps
    if existing is not None:  # every rank sees the same registry here: all raise alike
        raise InvalidInputError(f"{what}: a process set with ranks {ps.ranks} already exists (id {existing})")
    return None


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a new process set at run time; every rank must call it, with the same ranks, in the same order.

    Needs ``init(process_sets="dynamic")``.  Returns the registered set::

        odd = rc.add_process_set([1, 3])   # every rank: ProcessSet(process_set_id=1, ranks=[1, 3])
    """
    from . import api

    rt = api._rt("add_process_set")
    if not rt.dynamic_sets:
        raise InvalidInputError(
            "add_process_set: process sets can be added at run time only after init(process_sets='dynamic'); "
            "or pass them to init(process_sets=[...])"
        )
    name = rt.auto_name(wire.ADD_PSET, None)  # on every rank, before any check: a refusal names this op
    try:
        ps = as_process_set(process_set, "add_process_set")
        if ps.process_set_id is not None and ps._round == rt.round and rt.engine.set_ranks(ps.process_set_id):
            raise InvalidInputError(f"add_process_set: {ps!r} is already registered")
    except (InvalidInputError, InvalidTypeError) as exc:
        rt.refuse(wire.ADD_PSET, name, 0, str(exc))
        raise
    return register(rt, ps, "add_process_set", name)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a set on every rank (every rank calls it, in the same order); returns True when removed.

    The global set is never removed (returns False).  ``process_set`` is
    invalidated: its id and ranks become None.  Ops of the set that were still
    waiting for members fail.
    """
    from . import api

    rt = api._rt("remove_process_set")
    if not rt.dynamic_sets:
        raise InvalidInputError("remove_process_set: needs init(process_sets='dynamic')")
    if not isinstance(process_set, ProcessSet):
        raise InvalidTypeError(f"remove_process_set: expected a ProcessSet, got {type(process_set).__name__}")
    if process_set is global_process_set or process_set.process_set_id == 0:
        return False
    pid = process_set.process_set_id
    if pid is None or process_set._round != rt.round or rt.engine.set_ranks(pid) is None:
        raise InvalidInputError(f"remove_process_set: {process_set!r} is not a registered process set")
    req = wire.Request(rt.auto_name(wire.REMOVE_PSET, None), wire.REMOVE_PSET, root=pid)
    rt.submit(req, []).wait()
    process_set.invalidate()
    return True


def resolve_process_set(process_set: Any, what: str) -> tuple[int, tuple[int, ...]]:
    """``(set id, global ranks)`` of a registered set that includes this rank; raises otherwise.

    For layers above the core (ringcomm_torch) that check ``process_set=`` before staging data.
    """
    from . import api

    return api._rt(what).resolve_set(process_set, what)


def process_set_ids() -> list[int]:
    """Ids of the registered process sets (0 is the global set)."""
    from . import api

    return api._rt("process_set_ids").engine.set_ids()
