"""Which TCP ports a job's listening sockets may take (``RINGCOMM_PORT_RANGE``): pure, no sockets.

By default every socket a rank listens on takes a port the operating system picks (an ephemeral
one), and so does the launcher's rendezvous.  A cluster whose firewall opens only some ports sets
``RINGCOMM_PORT_RANGE=LOW-HIGH`` (both included) on every host: then every one of them binds a
port of that range, the first free one from a random place in it (:meth:`PortRange.candidates`),
so that the ranks of one host starting at once seldom try the same port.

How many a host needs: each rank listens on one data socket per higher-ranked peer, one socket for
payload streams from other hosts, and one for the small-op lane across hosts when it is on; rank 0
also on its control socket, and the launcher on the rendezvous (:func:`ports_needed`).

    parse("40000-40099") -> PortRange(low=40000, high=40099)      parse("") -> None
    PortRange(40000, 40003).candidates(2) -> [40002, 40003, 40000, 40001]
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

#: The variable that holds the range, named in every message about it.
VAR = "RINGCOMM_PORT_RANGE"


class PortRange(NamedTuple):
    """Ports ``low`` to ``high``, both included."""

    low: int
    high: int

    def __str__(self) -> str:
        return f"{self.low}-{self.high}"

    @property
    def size(self) -> int:
        return self.high - self.low + 1

    def candidates(self, start: int) -> list[int]:
        """Every port of the range once, from the ``start``-th (modulo the size) on, wrapping round."""
        first = start % self.size
        return [self.low + (first + i) % self.size for i in range(self.size)]


def parse(text: str) -> PortRange | None:
    """The range ``text`` names (``"LOW-HIGH"``), or None for an empty one; a ValueError says what is wrong."""
    text = text.strip()
    if not text:
        return None
    low_text, dash, high_text = text.partition("-")
    try:
        low, high = int(low_text), int(high_text if dash else low_text)
    except ValueError:
        raise ValueError(f"{VAR}={text!r}: use LOW-HIGH, two port numbers (e.g. 40000-40999)") from None
    if not 1 <= low <= high <= 65535:
        raise ValueError(f"{VAR}={text!r}: the ports must satisfy 1 <= LOW <= HIGH <= 65535")
    return PortRange(low, high)


def ports_needed(size: int, local_ranks: Iterable[int], net_lane: bool = False, launcher: bool = True) -> int:
    """The most ports one host's listening sockets take in a job of ``size`` ranks whose ranks on that
    host are ``local_ranks``: a data socket per higher-ranked peer, a stream socket each (and a lane
    socket with ``net_lane``), rank 0's control socket, and the launcher's rendezvous.

        ports_needed(4, [0, 1, 2, 3]) -> 6 + 4 + 1 + 1 = 12      ports_needed(4, [2, 3]) -> 1 + 2 = 3
    """
    ranks = list(local_ranks)
    total = sum(size - 1 - r for r in ranks) + len(ranks) * (2 if net_lane else 1)
    if 0 in ranks:
        total += 1 + (1 if launcher else 0)
    return total
