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

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from ..errors import InvalidInputError, InvalidTypeError, NotInitializedError

#: Where ProcessSet.rank() learns this process's global rank (the runtime installs it: see use_rank_source).
_rank_source: Callable[[], int] | None = None


def use_rank_source(source: Callable[[], int]) -> None:
    """Install the function that gives this process's global rank (``ringcomm.runtime.rank``)."""
    global _rank_source
    _rank_source = source


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
        #: Which init() registered it: a set from before shutdown() is not valid after.
        self.registered_round = -1

    def _this_rank(self) -> int:
        if _rank_source is None:
            raise NotInitializedError("ProcessSet.rank() needs ringcomm.init() first")
        return _rank_source()

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
