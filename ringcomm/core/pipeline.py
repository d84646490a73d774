"""When each phase of a pipelined hierarchical allreduce may start (pure: no I/O).

The hierarchical allreduce (``ringcomm.collectives.hierarchical``) cuts a large buffer
into ``pieces`` and runs three ring passes on each: a reduce-scatter within
the host (``RS``), an allreduce across hosts (``AR``) and an allgather within
the host (``AG``).  Run one after another, the two passes within the host
leave the link between hosts idle; pipelined, they overlap the cross-host
passes of other pieces::

    within the host   RS0 RS1 RS2 RS3 . AG0 . AG1 . AG2 . AG3
    across hosts          AR0 . . AR1 . . AR2 . . AR3 . .

The rules, the same on every rank (so every rank starts the same passes in
the same order and no rank waits for a pass its peer never starts):

- ``RS(c)`` after ``RS(c-1)`` has finished (one reduce-scatter at a time: the
  next piece is ready early, without slowing the one the link waits for);
- ``AR(c)`` after ``RS(c)`` has finished and ``AR(c-1)`` has queued everything
  it sends (the link gets the next piece's bytes behind the last ones of the
  one before, with no gap while the previous piece's last segments travel);
- ``AG(c)`` after ``AR(c)`` has finished.

Each pass has a sequence number of its own: :func:`seq_offset`.

    >>> s = PieceSchedule(2)
    >>> s.ready()
    [(0, 0)]
    >>> s.finished(RS, 0); s.ready()
    [(1, 0), (0, 1)]
"""

from __future__ import annotations

#: The three passes of each piece.
RS, AR, AG = 0, 1, 2
PASSES = 3


def seq_offset(phase: int, piece: int) -> int:
    """The sequence number of pass ``phase`` of ``piece``, past the op's own."""
    return PASSES * piece + phase


class PieceSchedule:
    """Which passes may start, from which have finished and which have queued all they send."""

    def __init__(self, pieces: int) -> None:
        if pieces < 1:
            raise ValueError(f"pieces must be >= 1, got {pieces}")
        self.pieces = pieces
        self._started: set[tuple[int, int]] = set()
        self._done: set[tuple[int, int]] = set()
        self._sent: set[tuple[int, int]] = set()

    def finished(self, phase: int, piece: int) -> None:
        """Pass ``phase`` of ``piece`` is over (it has also queued everything it sends)."""
        self._done.add((phase, piece))
        self._sent.add((phase, piece))

    def sent_all(self, phase: int, piece: int) -> None:
        """Pass ``phase`` of ``piece`` has queued everything it sends (it may still receive)."""
        self._sent.add((phase, piece))

    @property
    def over(self) -> bool:
        return len(self._done) == PASSES * self.pieces

    def ready(self) -> list[tuple[int, int]]:
        """The ``(phase, piece)`` passes to start now, in the order to start them; each is given once."""
        out = []
        for c in range(self.pieces):
            for phase, needs in ((RS, [(RS, c - 1)] if c else []),
                                 (AR, [(RS, c)]),
                                 (AG, [(AR, c)])):
                if (phase, c) in self._started or not all(n in self._done for n in needs):
                    continue
                if phase == AR and c and (AR, c - 1) not in self._sent:
                    continue
                self._started.add((phase, c))
                out.append((phase, c))
        return out
