"""How long a rank re-reads a peer's counter before it sleeps: a budget that follows what the re-reads catch.

Re-reading pays when the peer posts within a few hundred reads: the wait then costs no sleep and
no wake-up.  It costs when the peer is not running: on a host busier than its cores (data-loader
workers, another job, a hypervisor taking the core), the re-reading rank holds a core its peer may
need, and every op pays the whole spin before the sleep that would have let the peer run.  So the
budget halves every time the re-reads run out without the post, and doubles every time a post
lands while they run.  Once it is spent, one wait in :data:`PROBE_EVERY` still re-reads
:data:`PROBE` times, so a host that quietens down wins the spin back.

Pure: no clock, no I/O; the driver (:mod:`ringcomm.lane.driver`) asks :meth:`SpinBudget.reads`
before a wait and reports :meth:`SpinBudget.caught` or :meth:`SpinBudget.missed` after it, with its
lock held.
"""

from __future__ import annotations

from ..job.cores import available_cores

#: The most re-reads of a peer's counter before one sleep (only with a core per local rank).
SPINS = 400
#: Re-reads of a probe, once the budget is spent.
PROBE = 16
#: Once the budget is spent, one wait in this many probes.
PROBE_EVERY = 16


def spin_allowed(local_ranks: int) -> bool:
    """Re-read before sleeping only when every local rank has a core of its own."""
    return available_cores() >= local_ranks


class SpinBudget:
    """Re-reads before the next sleep: up to ``most``, halved by a miss, doubled by a catch."""

    def __init__(self, most: int = SPINS) -> None:
        self.most = max(0, most)
        self.budget = self.most
        self._since_probe = 0

    def reads(self) -> int:
        """How many times to re-read before this wait's sleep."""
        if self.budget or not self.most:
            return self.budget
        self._since_probe += 1
        if self._since_probe >= PROBE_EVERY:
            self._since_probe = 0
            return min(PROBE, self.most)
        return 0

    def caught(self) -> None:
        """The peer posted while this wait re-read (not already before its first read)."""
        self.budget = min(self.most, max(2 * self.budget, PROBE))

    def missed(self) -> None:
        """The re-reads ran out and the wait slept."""
        self.budget = 0 if self.budget < 2 * PROBE else self.budget // 2
