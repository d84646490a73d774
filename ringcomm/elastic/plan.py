"""Pure membership logic of an elastic job: who gets which rank, which hosts get new workers, blacklisting.

Nothing here starts a process or opens a socket; the driver
(:mod:`ringcomm.launch.elastic_driver`) feeds it what it observed and acts on the answers.

Example: four workers on two hosts, worker 1 lost, one free slot appears on a
third host (``max_np=4``)::

    >>> members = [Member(0, "a"), Member(1, "a"), Member(2, "b"), Member(3, "b")]
    >>> survivors = [m for m in members if m.wid != 1]
    >>> new_worker_hosts({"a": 2, "b": 2, "c": 1}, survivors, Blacklist(), now=0.0, limit=4)
    ['a']
    >>> [(a.wid, a.rank, a.local_rank, a.cross_rank) for a in assign_ranks(survivors + [Member(4, "a")])]
    [(0, 0, 0, 0), (2, 1, 0, 1), (3, 2, 1, 0), (4, 3, 1, 1)]

Survivors keep their relative order, so the new rank 0 is always a worker
that holds the committed state (it is what everybody syncs from).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence

__all__ = ["Member", "Assignment", "Blacklist", "assign_ranks", "new_worker_hosts", "free_slots"]


@dataclasses.dataclass(frozen=True)
class Member:
    """One worker process: its id (unique for the job's lifetime) and the host it runs on."""

    wid: int
    host: str


@dataclasses.dataclass(frozen=True)
class Assignment:
    """Where one worker sits in a world (one generation of the job's membership)."""

    wid: int
    host: str
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int


def assign_ranks(members: Sequence[Member]) -> list[Assignment]:
    """Ranks ``0..n-1`` in the order given; local and cross ranks as Horovod defines them.

    ``local_rank`` counts the workers before this one on its host; ``cross_rank``
    is this worker's index among the workers with the same ``local_rank``
    (hosts in order of first appearance), ``cross_size`` their number.
    """
    wids = [m.wid for m in members]
    if len(set(wids)) != len(wids):
        raise ValueError(f"worker ids must be unique, got {wids}")
    per_host: collections.Counter[str] = collections.Counter(m.host for m in members)
    seen_on_host: collections.Counter[str] = collections.Counter()
    local = []
    for m in members:
        local.append(seen_on_host[m.host])
        seen_on_host[m.host] += 1
    per_local: collections.Counter[int] = collections.Counter(local)
    seen_local: collections.Counter[int] = collections.Counter()
    out = []
    for rank, (m, lr) in enumerate(zip(members, local)):
        out.append(Assignment(m.wid, m.host, rank, len(members), lr, per_host[m.host], seen_local[lr], per_local[lr]))
        seen_local[lr] += 1
    return out


class Blacklist:
    """Hosts whose workers keep failing get no new workers for a while.

    A host is blacklisted once ``failures`` of its workers have failed since it
    was last let back in; it stays out for ``cooldown`` seconds, doubled each
    further time it is blacklisted (capped at ``max_cooldown``).  The driver
    also stops the workers still running there when the job next re-forms, as
    Horovod does.  Times are whatever clock the caller passes (the driver uses
    ``time.monotonic()``).

        >>> bl = Blacklist(failures=2, cooldown=10.0)
        >>> bl.record_failure("h", now=0.0), bl.blacklisted("h", now=0.0)
        (False, False)
        >>> bl.record_failure("h", now=1.0), bl.blacklisted("h", now=5.0), bl.blacklisted("h", now=11.5)
        (True, True, False)
    """

    def __init__(self, failures: int = 3, cooldown: float = 60.0, max_cooldown: float = 3600.0) -> None:
        if failures < 1:
            raise ValueError(f"failures must be >= 1, got {failures}")
        if cooldown < 0:
            raise ValueError(f"cooldown must be >= 0 seconds, got {cooldown}")
        self.failures = failures
        self.cooldown = cooldown
        self.max_cooldown = max(max_cooldown, cooldown)
        self._count: collections.Counter[str] = collections.Counter()
        self._until: dict[str, float] = {}
        self._times: collections.Counter[str] = collections.Counter()

    def record_failure(self, host: str, now: float) -> bool:
        """Count a failed worker on ``host``; True when this failure blacklists the host."""
        if self.blacklisted(host, now):
            return False
        self._count[host] += 1
        if self._count[host] < self.failures:
            return False
        self._count[host] = 0
        self._times[host] += 1
        self._until[host] = now + min(self.max_cooldown, self.cooldown * 2 ** (self._times[host] - 1))
        return True

    def blacklisted(self, host: str, now: float) -> bool:
        """True while ``host`` is in its cooldown."""
        return now < self._until.get(host, float("-inf"))

    def until(self, host: str) -> float | None:
        """When ``host``'s current or last cooldown ends (``None``: never blacklisted)."""
        return self._until.get(host)


def free_slots(hosts: Mapping[str, int], running: Sequence[Member], blacklist: Blacklist, now: float) -> dict[str, int]:
    """Slots per host not taken by ``running`` workers, leaving out blacklisted hosts (discovery order)."""
    used = collections.Counter(m.host for m in running)
    return {h: n - used[h] for h, n in hosts.items() if n - used[h] > 0 and not blacklist.blacklisted(h, now)}


def new_worker_hosts(
    hosts: Mapping[str, int], running: Sequence[Member], blacklist: Blacklist, now: float, limit: int
) -> list[str]:
    """Hosts to start new workers on (one entry per worker), so the job has at most ``limit`` workers.

    Free slots are filled host by host in discovery order.
    """
    want = limit - len(running)
    out: list[str] = []
    for host, n in free_slots(hosts, running, blacklist, now).items():
        take = min(n, want - len(out))
        out += [host] * max(take, 0)
    return out
