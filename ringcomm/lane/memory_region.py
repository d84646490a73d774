"""The small-op lane's region for ranks that are threads of one process: counters and slots in plain memory.

It keeps what the shared region (:mod:`ringcomm.lane.shm_lane`) keeps, with the same rules, and
holds no OS resource: one :class:`MemoryBoard` per job (every rank's post, read and off
counters, and ``slots`` slots per rank of ``payload_bytes`` each), one :class:`MemoryLane` view
per rank.  Index k lives in slot k % slots; a rank writes only its own counters and slots and
reads everyone's; a slot's head names the index it holds, so a slot rewritten before a rank read
it is caught (as on one host).  A post stores the slot, then the count, and wakes the threads
asleep on a count (one condition for the board, where the shared region has a futex per rank).

    board = MemoryBoard(size=2, slots=4, payload_bytes=4096)
    lanes = [MemoryLane(board, r) for r in range(2)]   # one per rank's LaneDriver
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..core import lane
from ..errors import HorovodInternalError, InvalidInputError

_M32 = 0xFFFFFFFF


class MemoryBoard:
    """Every rank's counters and slots, shared by the ranks' :class:`MemoryLane` views."""

    def __init__(self, size: int, slots: int, payload_bytes: int) -> None:
        if size < 1 or slots < 1 or payload_bytes < 0:
            raise InvalidInputError(f"a lane region needs a rank, a slot and no negative payload size; got "
                                    f"size={size}, slots={slots}, payload_bytes={payload_bytes}")
        self.size, self.slots, self.payload_bytes = size, slots, payload_bytes
        self.posted = [0] * size  # per rank: indices posted (32 bits, wrapping)
        self.read = [0] * size  # per rank: it has finished reading every index below this
        self.off = [False] * size  # per rank: posts no more
        # per rank and slot: (index, key, fast, nbytes) of what it holds, and its payload bytes
        self.heads: list[list[tuple[int, int, bool, int]]] = [[(-1, 0, False, 0)] * slots for _ in range(size)]
        self.payloads = [[np.zeros(payload_bytes, np.uint8) for _ in range(slots)] for _ in range(size)]
        self.changed = threading.Condition()  # notified on every post and every rank going off


class MemoryLane:
    """One rank's view of a :class:`MemoryBoard`: a :class:`~ringcomm.core.lane.LaneRegion`."""

    #: Waits sleep on the board's condition: a post wakes them, re-reading would not help.
    SPIN = False

    def __init__(self, board: MemoryBoard, rank: int) -> None:
        if not 0 <= rank < board.size:
            raise InvalidInputError(f"rank {rank} is not one of the board's {board.size} ranks")
        self._board = board
        self.rank, self.size, self.slots, self.payload_bytes = rank, board.size, board.slots, board.payload_bytes
        self.closed = False

    # -- counters ----------------------------------------------------------------------

    def posted(self, rank: int) -> int:
        return self._board.posted[rank] & _M32

    def off(self, rank: int) -> bool:
        return self._board.off[rank]

    def read_below(self, rank: int) -> int:
        """``rank``'s read counter: it has finished reading every index below it."""
        return self._board.read[rank] & _M32

    def all_read_below(self, index: int) -> int:
        """The first index at or after ``index`` that some rank may still read (:func:`lane.first_unread`)."""
        board = self._board
        with board.changed:
            reads, posts, offs = list(board.read), list(board.posted), list(board.off)
        return lane.first_unread(index, [r & _M32 for r in reads], [p & _M32 for p in posts], offs)

    def set_read_below(self, count: int) -> None:
        self._board.read[self.rank] = count & _M32

    def set_off(self) -> None:
        board = self._board
        with board.changed:
            board.off[self.rank] = True
            board.changed.notify_all()

    def reset(self) -> None:
        """Zero this rank's counters (only while no rank reads them, as after a join)."""
        board = self._board
        with board.changed:
            board.posted[self.rank] = board.read[self.rank] = 0
            board.off[self.rank] = False

    # -- slots -----------------------------------------------------------------------------

    def seen(self, rank: int, index: int) -> lane.Seen:
        board = self._board
        off = board.off[rank]  # before the count: a rank that is off posts no more, so the count is final
        if not lane.reached(board.posted[rank], index):
            return lane.Seen(False, off, False, 0, 0)
        stored, key, fast, nbytes = board.heads[rank][index % self.slots]
        if stored != index:
            raise HorovodInternalError(f"rank {self.rank}: small-op lane slot for index {index} of rank {rank} "
                                       f"holds index {stored}: it was rewritten before this rank read it")
        return lane.Seen(True, off, fast, key, nbytes)

    def key_at(self, rank: int, index: int) -> int | None:
        if not lane.reached(self._board.posted[rank], index):
            return None
        stored, key, _, _ = self._board.heads[rank][index % self.slots]
        return key if stored == index else None

    def _matched(self, rank: int, index: int, key: int) -> int | None:
        """``rank``'s payload length if it posted ``index`` fast with ``key``; -1 if it has not posted
        it yet (and is not off); None if it posted something else there or went off."""
        board = self._board
        if not lane.reached(board.posted[rank], index):
            return None if board.off[rank] else -1
        stored, got, fast, nbytes = board.heads[rank][index % self.slots]
        return nbytes if stored == index and got == key and fast else None

    def still_missing(self, ranks: list[int], index: int, key: int) -> list[int] | None:
        return lane.still_missing(ranks, [self._matched(r, index, key) for r in ranks])

    def fast_sizes(self, index: int, key: int, own_nbytes: int) -> list[int] | None:
        sizes = []
        for r in range(self.size):
            if r == self.rank:
                sizes.append(own_nbytes)
                continue
            got = self._matched(r, index, key)
            if got is None or got < 0:
                return None
            sizes.append(got)
        return sizes

    def typed_parts(self, index: int, sizes: Sequence[int], dtype: np.dtype) -> list[np.ndarray]:
        slot = index % self.slots
        return [self._board.payloads[r][slot][:n].view(dtype) for r, n in enumerate(sizes)]

    def post(self, index: int, key: int, fast: bool, payload: Sequence[np.ndarray]) -> None:
        """Write this rank's slot for ``index`` (the arrays, concatenated), then its count, and wake
        the sleepers."""
        board, slot = self._board, index % self.slots
        buf, pos = board.payloads[self.rank][slot], 0
        for a in payload:
            n = a.nbytes
            if pos + n > self.payload_bytes:
                raise InvalidInputError(f"rank {self.rank}: a payload of {pos + n} B does not fit the lane's "
                                        f"{self.payload_bytes} B slots")
            buf[pos:pos + n] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
            pos += n
        board.heads[self.rank][slot] = (index, key, bool(fast), pos)
        with board.changed:
            board.posted[self.rank] = (index + 1) & _M32
            board.changed.notify_all()

    # -- waiting -----------------------------------------------------------------------------

    def sleep_on_posted(self, rank: int, seen: int, timeout: Any) -> bool:
        """Sleep while ``rank``'s count is ``seen`` and it is not off; ``timeout`` (``tv_sec``,
        ``tv_nsec``) at most.  False when the time ran out."""
        board = self._board
        seconds = timeout.tv_sec + timeout.tv_nsec / 1e9
        with board.changed:
            return board.changed.wait_for(lambda: (board.posted[rank] & _M32) != seen or board.off[rank], seconds)

    # -- lifecycle ---------------------------------------------------------------------------

    def unlink(self) -> None:
        """Nothing to remove: the region has no name."""

    def close(self) -> None:
        self.closed = True
