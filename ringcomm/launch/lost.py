"""Which rank ``ringcomm-run`` stops because the job lost it (pure: the ranks' reports and the clock in).

When a rank stops answering (SIGSTOP, a wedged process), the others raise ``PeerLostError``
after ``RINGCOMM_PEER_TIMEOUT`` and each tells the launcher, through its rendezvous, which
rank it lost (:func:`ringcomm.net.rendezvous_client.report_lost`).  The ranks that caught the
error may then exit 0; the launcher must not wait for the lost process forever.

A rank reported lost is stopped

* at once when its process is stopped (state T): it can do nothing more for the job;
* else :data:`CONFIRM_SECONDS` after the first report, unless it has itself reported a loss
  by then: a rank that reports is running ringcomm, so what broke is the link between two
  live ranks, and each ends on its own error.

Only a report can start this, and a rank is reported only once the job has given up on it
(every rank's ops fail); a slow rank whose heartbeats are answered is never reported.

    >>> lost = LostRanks(confirm_seconds=2.0)
    >>> lost.update({0: 1, 2: 1}, now=10.0)
    >>> lost.to_stop(running={1}, frozen=set(), now=11.0), lost.to_stop(running={1}, frozen=set(), now=12.0)
    ([], [1])
    >>> lost.reporters_of(1)
    [0, 2]
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

__all__ = ["LostRanks", "CONFIRM_SECONDS"]

#: Seconds between the first report of a rank as lost and the launcher stopping it (a stopped process: at once).
CONFIRM_SECONDS = 2.0


class LostRanks:
    """The ranks reported lost, who reported them and since when; which of them to stop now."""

    def __init__(self, confirm_seconds: float = CONFIRM_SECONDS) -> None:
        self.confirm_seconds = confirm_seconds
        #: reporting rank -> the rank it lost
        self.reports: dict[int, int] = {}
        self._since: dict[int, float] = {}  # lost rank -> when it was first reported
        self._stopped: set[int] = set()

    def update(self, reports: Mapping[int, int], now: float) -> None:
        """Take the reports as read now (reporting rank -> lost rank; reports are never withdrawn)."""
        for reporter, lost in reports.items():
            if reporter != lost and reporter not in self.reports:
                self.reports[reporter] = lost
                self._since.setdefault(lost, now)

    def reported(self) -> list[int]:
        """The ranks some rank reported lost, in rank order."""
        return sorted(self._since)

    def reporters_of(self, rank: int) -> list[int]:
        """The ranks that reported ``rank`` lost."""
        return sorted(r for r, lost in self.reports.items() if lost == rank)

    def to_stop(self, running: Collection[int], frozen: Collection[int], now: float) -> list[int]:
        """The reported ranks to stop now (each once): ``running`` are the ranks whose process runs,
        ``frozen`` those whose process is stopped."""
        out = []
        for rank, since in sorted(self._since.items()):
            if rank in self._stopped or rank not in running or rank in self.reports:
                continue
            if rank in frozen or now - since >= self.confirm_seconds:
                self._stopped.add(rank)
                out.append(rank)
        return out
