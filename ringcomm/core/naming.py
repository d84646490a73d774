"""The names of a rank's ops: the ones users give, and ``kind.noname.N`` for the others.

Ranks pair their ops by name, so an op that a user leaves unnamed must get the same name on every
rank: the N-th unnamed op of a kind in a process set is ``kind.noname.N`` everywhere.  Two events
move the count (:class:`OpNames` keeps it, with no I/O and no lock; the runtime holds the lock):

* a completed ``join()``: ranks that joined early skipped the unnamed ops the others ran (and failed)
  meanwhile, so their counts differ; after the J-th join every rank counts from 0 again, as
  ``kind.noname.J.N``;
* an op rank 0 failed as stalled that this rank never submitted (it had diverged from the others
  and skipped it): the count of that kind moves past it, so the next unnamed op pairs with theirs.

Example (one rank; the same on every rank)::

    >>> names = OpNames()
    >>> names.name("allreduce", None, 0), names.name("allreduce", None, 0), names.name("allreduce", "w", 0)
    ('allreduce.noname.0', 'allreduce.noname.1', 'w')
    >>> names.caught_up([(0, "allreduce.noname.5")]); names.name("allreduce", None, 0)
    'allreduce.noname.6'
    >>> names.joined(); names.name("allreduce", None, 0)
    1
    'allreduce.noname.1.0'
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import NamedTuple

from ..errors import InvalidInputError
from . import wire

#: What an unnamed op's name holds between its kind and its number
NONAME = ".noname."

#: The wire kind of the op (or, split, the ops) each kind of call submits; the call's kind is the one
#: its unnamed ops are counted under
WIRE_KINDS = {
    "allreduce": wire.ALLREDUCE, "grouped_allreduce": wire.ALLREDUCE, "allgather": wire.ALLGATHER,
    "grouped_allgather": wire.ALLGATHER, "broadcast": wire.BROADCAST, "alltoall": wire.ALLTOALL,
    "reducescatter": wire.REDUCESCATTER, "grouped_reducescatter": wire.REDUCESCATTER,
    "broadcast_object": wire.BROADCAST, "allgather_object": wire.ALLGATHER, "barrier": wire.BARRIER,
    wire.ADD_PSET: wire.ADD_PSET, wire.REMOVE_PSET: wire.REMOVE_PSET,
}


class ClaimedName(str):
    """An op's name taken before the op is submitted (:meth:`ringcomm.process_runtime.Runtime.claim_name`):
    the op submitted under this very object is the claimed one; any other op of that name
    submitted meanwhile is a duplicate, as it would be if the claimed op were in flight already.

        >>> later = ClaimedName("allreduce.grad")
        >>> later == "allreduce.grad", isinstance(later, ClaimedName), isinstance("allreduce.grad", ClaimedName)
        (True, True, False)
    """

    __slots__ = ()


class OpCall(NamedTuple):
    """One call of a collective on one rank, named: made when the op is named, before its arguments
    are checked, and what the rank tells rank 0 if it refuses them (:meth:`refusal`).

    ``kind`` is the wire kind of the op the call submits; ``pset`` the id of its process set.
    Every rank that makes the call names it alike, so a refusal fails the op the others submitted.
    """

    rank: int
    kind: str
    name: str
    pset: int

    def refusal(self, reason: str) -> wire.Request:
        """The request that refuses this op: it fails on every member with ``rank R: reason``."""
        return wire.Request(self.name, self.kind, pset=self.pset, refused=f"rank {self.rank}: {reason}")

    def part(self, suffix: str) -> OpCall:
        """The op ``name.suffix`` the call submits as a part of itself (an object's ``len``, a grouped op's ``0``...)."""
        return self._replace(name=f"{self.name}.{suffix}")


class OpNames:
    """The names one rank gives its ops: unnamed ones counted per process set and kind, from 0 after each join."""

    def __init__(self) -> None:
        self._counters: collections.Counter[tuple[int, str]] = collections.Counter()
        #: completed ``join()`` calls so far
        self.joins = 0

    def name(self, kind: str, name: str | None, pset: int) -> str:
        """``name`` (checked), or the next ``kind.noname.N`` of process set ``pset``."""
        if name is not None:
            if not isinstance(name, str) or not name:
                raise InvalidInputError(f"{kind}: name must be a non-empty string, got {name!r}")
            return name
        n = self._counters[(pset, kind)]
        self._counters[(pset, kind)] += 1
        return f"{kind}{NONAME}{n}" if not self.joins else f"{kind}{NONAME}{self.joins}.{n}"

    def caught_up(self, skipped: Iterable[tuple[int, str]]) -> None:
        """Count the ops ``(set, name)`` rank 0 failed as stalled that this rank never submitted: an
        unnamed one numbered since the last join moves its kind's count past it."""
        for pset, name in skipped:
            kind, sep, rest = name.partition(NONAME)
            parts = rest.split(".")
            if not sep or (self.joins and parts[0] != str(self.joins)):
                continue  # named, or numbered before the last join
            number = parts[1] if self.joins and len(parts) > 1 else parts[0]
            if number.isdigit():
                key = (pset, kind)
                self._counters[key] = max(self._counters[key], int(number) + 1)

    def joined(self) -> int:
        """Every rank completed a ``join()``: unnamed ops count from 0 again.  Returns the joins so far."""
        self.joins += 1
        self._counters.clear()
        return self.joins
