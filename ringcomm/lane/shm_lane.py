"""The small-op lane's shared region: per-rank counters and slots in one mapped file.

Layout (``size`` ranks, ``slots`` slots per rank, payloads up to ``payload_bytes``)::

    counters   one cache line per rank: posted (indices posted, a futex word), read
               (indices this rank has finished reading), off (1: posts no more),
               sleeping (how many of this rank's threads sleep on a posted word)
    slots      per rank, ``slots`` slots: a 64-byte head (index, key, fast, nbytes)
               and the payload; index k lives in slot k % slots

A rank writes only its own line and slots; it reads everyone's.  Posting
index k writes the slot, then stores posted = k + 1 and wakes the futex
sleepers on that word: a reader that sees the count sees the slot (x86-64
keeps stores in order; :func:`ringcomm.shm.futex.available` is False elsewhere).
A poster skips the wake (a
system call) while no other rank has a thread asleep: each side stores its
word (posted / sleeping) and then reads the other's through a full fence
(a lock's atomic instruction; the kernel's futex lock on the sleeper's
side), so at least one of them sees the other's store: no wake is lost.
A slot is rewritten (index k + slots) only once every rank's ``read`` shows
it finished reading index k.  What the slots mean is decided in
:mod:`ringcomm.core.lane`; this module only moves bytes and waits.

Rank 0 creates the file (mode 0600, exclusively) before the ranks meet, but
without a name: a rank 0 killed while it waits for the others leaves nothing
in /dev/shm.  Once every rank has met, rank 0 names it and the others map it
(waiting the moment it may take rank 0 to get there); rank 0 unlinks it once
every rank has posted (so nothing is left in /dev/shm), or at close.  A name
left by a rank 0 killed in between is reclaimed by the next job (see
:class:`ringcomm.shm.slots.MappedFile`).
"""

from __future__ import annotations

import _thread
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..shm import futex, slots as shm, barrier as shm_barrier, space
from ..job import names
from ..core import lane
from ..errors import HorovodInternalError

log = logging.getLogger("ringcomm.lane.shm_lane")

#: Bytes of one rank's counters (one cache line: ranks never write the same line), laid out as
#: the futex barrier's are.
LINE = shm_barrier.STRIDE
#: Bytes of a slot's head.
HEAD = 64
#: Typed payload views kept for reuse (slot, dtype and sizes each): dropped all at once past this.
TYPED_VIEWS = 512
_POSTED, _READ, _OFF, _SLEEPING = 0, 1, 2, 3
_LINE_WORDS = LINE // 4


def region_path(job_id: str, round_: int) -> str:
    return names.shm_lane_region(job_id, round_)


def region_bytes(size: int, slots: int, payload_bytes: int) -> int:
    return shm_barrier.header_bytes(size) + size * slots * _slot_bytes(payload_bytes)


def _slot_bytes(payload_bytes: int) -> int:
    return HEAD + -(-payload_bytes // 64) * 64


class ShmLane(shm.MappedFile):
    """One rank's view of the job's lane region."""

    #: A peer's post lands in this host's memory: re-reading a counter sees it at once.
    SPIN = True

    def __init__(self, path: str, rank: int, size: int, slots: int, payload_bytes: int, create: bool,
                 named: bool = True) -> None:
        super().__init__(path, region_bytes(size, slots, payload_bytes), create, reserve=create, named=named)
        self.rank, self.size, self.slots, self.payload_bytes = rank, size, slots, payload_bytes
        self._slot = _slot_bytes(payload_bytes)
        self._base = shm_barrier.header_bytes(size)
        # counters and heads through memoryviews: an item read or write is several times cheaper
        # than through a NumPy scalar, and the lane's waits re-read them in a loop
        self._view = memoryview(self._map)
        self._words = self._view[: size * LINE].cast("I")
        self._heads = self._view[self._base:].cast("Q")
        self._addr = self._bytes.ctypes.data
        self._peer_sleep_words = [r * _LINE_WORDS + _SLEEPING for r in range(size) if r != rank]
        # where each of this rank's slots starts: its head (in 8-byte words) and its payload (bytes)
        self._own = [(h, self._base + h * 8 + HEAD) for h in (self._head(rank, s) for s in range(slots))]
        self._words_per_slot = self._slot // 8
        self._fence = _thread.allocate_lock()  # acquiring it is an atomic instruction: a full fence on x86-64
        self._sleep_lock = _thread.allocate_lock()
        self._sleepers = 0  # this rank's threads asleep in sleep_on_posted
        # every rank's payload at one slot, viewed as one dtype: a training loop reads the same
        # slots with the same sizes over and over, so the views are made once
        self._typed: dict[tuple[int, np.dtype, tuple[int, ...]], list[np.ndarray]] = {}

    def _head(self, rank: int, index: int) -> int:
        """Where ``rank``'s slot for ``index`` starts in :attr:`_heads` (8-byte words)."""
        return (rank * self.slots + index % self.slots) * self._slot // 8

    def close(self) -> None:
        self._typed.clear()  # its arrays view the map
        for view in (self._words, self._heads, self._view):  # no view may keep the map alive
            view.release()
        super().close()

    # -- counters --------------------------------------------------------------

    def posted(self, rank: int) -> int:
        return self._words[rank * _LINE_WORDS + _POSTED]

    def read_below(self, rank: int) -> int:
        """``rank``'s read counter: it has finished reading every index below it."""
        return self._words[rank * _LINE_WORDS + _READ]

    def sleeping(self, rank: int) -> int:
        """How many of ``rank``'s threads sleep on a posted word now."""
        return self._words[rank * _LINE_WORDS + _SLEEPING]

    def off(self, rank: int) -> bool:
        return bool(self._words[rank * _LINE_WORDS + _OFF])

    def all_read_below(self, index: int) -> int:
        """The first index at or after ``index`` that some rank has not finished reading (``index``
        itself when a rank has not finished it): every rank has finished every index below it."""
        words = self._words  # every rank's counters, one line each: strided views, no copies
        return lane.first_unread(index, words[_READ::_LINE_WORDS], words[_POSTED::_LINE_WORDS],
                                 words[_OFF::_LINE_WORDS])

    def set_read_below(self, count: int) -> None:
        self._words[self.rank * _LINE_WORDS + _READ] = count & 0xFFFFFFFF

    def set_off(self) -> None:
        """This rank posts no more: wake whoever waits on it, so they divert."""
        self._words[self.rank * _LINE_WORDS + _OFF] = 1
        futex.wake(self._addr + self.rank * LINE)

    def reset(self) -> None:
        """Zero this rank's counters (only while no rank reads them: see LaneDriver.reopen_after_join)."""
        at = self.rank * _LINE_WORDS
        self._words[at + _POSTED] = self._words[at + _READ] = self._words[at + _OFF] = 0

    def seen(self, rank: int, index: int) -> lane.Seen:
        """What ``rank``'s lane holds at ``index`` (``off`` is read before ``posted``: a rank that
        is off never posts again, so a count read after it is final)."""
        words, at = self._words, rank * _LINE_WORDS
        off = words[at + _OFF]
        if not lane.reached(words[at + _POSTED], index):
            return lane.Seen(False, bool(off), False, 0, 0)
        heads, h = self._heads, self._head(rank, index)
        stored, key, fast, nbytes = heads[h], heads[h + 1], heads[h + 2], heads[h + 3]
        if stored != index:  # the slot was rewritten before this rank read it: a broken promise
            raise HorovodInternalError(f"rank {self.rank}: small-op lane slot for index {index} of rank {rank} holds "
                                       f"index {stored}; set RINGCOMM_SHM_LANE_BYTES=0 to run without the lane")
        return lane.Seen(True, bool(off), bool(fast), key, nbytes)

    def key_at(self, rank: int, index: int) -> int | None:
        """The key ``rank`` posted at ``index``, or None if it has not posted it or has rewritten the
        slot since (its index is read before and after the key: a rewrite stores the index first)."""
        if not lane.reached(self._words[rank * _LINE_WORDS + _POSTED], index):
            return None
        heads, h = self._heads, self._head(rank, index)
        if heads[h] != index:
            return None
        key = heads[h + 1]
        return key if heads[h] == index else None

    # -- slots -----------------------------------------------------------------

    def post(self, index: int, key: int, fast: bool, payload: Sequence[np.ndarray]) -> None:
        """Write this rank's slot for ``index`` (its payload: the arrays, concatenated) and publish it."""
        h, start = self._own[index % self.slots]
        pos = start
        for a in payload:
            n = a.nbytes
            if not n:
                continue
            if a.flags.c_contiguous:
                self._view[pos:pos + n] = a.data.cast("B")
            else:
                self._bytes[pos:pos + n] = a.reshape(-1).view(np.uint8)
            pos += n
        heads = self._heads
        heads[h], heads[h + 1], heads[h + 2], heads[h + 3] = index, key, int(fast), pos - start
        words = self._words
        words[self.rank * _LINE_WORDS + _POSTED] = (index + 1) & 0xFFFFFFFF
        fence = self._fence
        fence.acquire()
        fence.release()
        for at in self._peer_sleep_words:
            if words[at]:
                futex.wake(self._addr + self.rank * LINE)
                return

    def _matched(self, rank: int, index: int, key: int) -> int | None:
        """``rank``'s payload length if it posted ``index`` fast with ``key``; -1 if it has not
        posted it yet (and is not off); None if it posted something else there or went off."""
        at = rank * _LINE_WORDS
        if not lane.reached(self._words[at + _POSTED], index):
            return None if self._words[at + _OFF] else -1
        heads, h = self._heads, self._head(rank, index)
        if heads[h] != index or heads[h + 1] != key or not heads[h + 2]:
            return None
        return heads[h + 3]

    def still_missing(self, ranks: list[int], index: int, key: int) -> list[int] | None:
        """Those of ``ranks`` that have not posted ``index`` yet, once the others posted it fast with
        ``key``; None as soon as one posted something else there or went off (the index is decided
        without waiting more)."""
        return lane.still_missing(ranks, [self._matched(r, index, key) for r in ranks])

    def fast_sizes(self, index: int, key: int, own_nbytes: int) -> list[int] | None:
        """Every rank's payload length at ``index`` when every other rank has posted it fast with
        ``key`` (this rank's own slot counts as ``own_nbytes``), else None: the common case of
        :func:`ringcomm.core.lane.decide` read in one pass; anything else takes :meth:`seen`."""
        words, heads, me, slots = self._words, self._heads, self.rank, self.slots
        first, stride = index % slots * self._words_per_slot, slots * self._words_per_slot
        sizes = []
        for r in range(self.size):  # _matched, unrolled: this runs once per op
            if r == me:
                sizes.append(own_nbytes)
                continue
            if not lane.reached(words[r * _LINE_WORDS + _POSTED], index):
                return None
            h = first + r * stride
            if heads[h] != index or heads[h + 1] != key or not heads[h + 2]:
                return None
            sizes.append(heads[h + 3])
        return sizes

    def payload(self, rank: int, index: int, nbytes: int) -> np.ndarray:
        """``rank``'s payload at ``index``: a uint8 view into the region (valid until it is rewritten)."""
        start = self._base + self._head(rank, index) * 8 + HEAD
        return self._bytes[start:start + nbytes]

    def typed_parts(self, index: int, sizes: Sequence[int], dtype: np.dtype) -> list[np.ndarray]:
        """Every rank's payload at ``index`` (``sizes[r]`` bytes each) as arrays of ``dtype``, in rank
        order: views into the region, valid until the slots are rewritten."""
        at = (index % self.slots, dtype, tuple(sizes))
        parts = self._typed.get(at)
        if parts is None:
            if len(self._typed) >= TYPED_VIEWS:
                self._typed.clear()
            parts = self._typed[at] = [self.payload(r, index, n).view(dtype) for r, n in enumerate(sizes)]
        return parts

    # -- waiting ---------------------------------------------------------------

    def sleep_on_posted(self, rank: int, seen: int, timeout: futex.Timespec) -> bool:
        """Sleep while ``rank``'s post counter holds ``seen`` (a post or :meth:`set_off` wakes it).

        This rank's sleeping word counts the sleep, so posters know to wake it."""
        words, at = self._words, self.rank * _LINE_WORDS + _SLEEPING
        with self._sleep_lock:  # its release is the fence between this store and the futex's read
            self._sleepers += 1
            words[at] = self._sleepers
        try:
            return futex.wait(self._addr + rank * LINE, seen, timeout)
        finally:
            with self._sleep_lock:
                self._sleepers -= 1
                words[at] = self._sleepers


# -- setting up: rank 0 offers a region, every rank accepts it or none does ---------------


def offer(job_id: str, round_: int, rank: int, size: int, slots: int, payload_bytes: int,
          floor_bytes: int | None = None) -> tuple[ShmLane | None, Any]:
    """Before the ranks meet: rank 0 creates the region (with no name yet) and offers ``[path, payload
    bytes]`` (False if it could not); the others say whether they could map one.  Returns (rank 0's
    region, the offer).  The region's slots are rank 0's size: ``payload_bytes``, less where /dev/shm
    has little room, down to ``floor_bytes`` (default: ``payload_bytes``; see
    :func:`ringcomm.shm.space.lane_payload_bytes`); each rank posts fast only what its own setting allows."""
    able = size > 1 and payload_bytes > 0 and shm.available() and futex.available()
    if rank != 0 or not able:
        return None, able
    path = region_path(job_id, round_)
    floor = payload_bytes if floor_bytes is None else min(floor_bytes, payload_bytes)
    payload_bytes = space.lane_payload_bytes(payload_bytes, floor, space.free_bytes(os.path.dirname(path)),
                                             size * slots)
    try:
        return ShmLane(path, 0, size, slots, payload_bytes, create=True, named=False), [path, payload_bytes]
    except OSError as exc:
        log.warning("rank 0: small-op lane disabled: cannot create %s (%s)", path, exc)
        return None, False


def accept(region: ShmLane | None, table: list[dict[str, Any]], rank: int, slots: int,
           wait_seconds: float = 30.0) -> ShmLane | None:
    """Once every rank's offer is in ``table``: the lane runs when all ranks share one host and
    could map it and rank 0 made it; then rank 0 names it and the others map it (waiting up to
    ``wait_seconds`` for the name, less if rank 0's process ends).  Otherwise rank 0 drops it."""
    if len({p["host"] for p in table}) != 1 or not all(p.get("lane") for p in table):
        if region is not None:
            region.close()
        return None
    if rank == 0:
        assert region is not None
        try:
            region.name()
        except OSError as exc:
            region.close()
            raise HorovodInternalError(
                f"rank 0: cannot name the small-op lane {region.path} ({exc}); stop the other job with "
                "this job id, or set RINGCOMM_SHM_LANE_BYTES=0 on every rank to run without the lane") from exc
        return region
    path, payload_bytes = str(table[0]["lane"][0]), int(table[0]["lane"][1])
    deadline = time.monotonic() + wait_seconds
    pause = 0.0002
    # rank 0's pid, where this rank can look it up (containers each have a pid namespace of their own)
    root_pid = int(table[0].get("pid") or 0) if table[0].get("pidns") == table[rank].get("pidns") else 0
    # in another pid namespace, or without /proc showing it (even as a zombie): only the deadline
    watch_root = root_pid > 0 and shm.process_visible(root_pid) and os.path.exists(f"/proc/{root_pid}")
    while True:
        try:
            return ShmLane(path, rank, len(table), slots, payload_bytes, create=False)
        except FileNotFoundError:
            # rank 0 names it right after the ranks meet: it may not be there yet
            if watch_root and not shm.process_alive(root_pid):
                # rank 0 left (it died, or named, used and removed it and shut down; a zombie counts, as its
                # parent may collect it only after this rank gave up): the job is ending, and the engine
                # reports why; go on without the lane
                log.debug("rank %d: the small-op lane %s is gone: rank 0 has left the job", rank, path)
                return None
            if time.monotonic() > deadline:
                raise HorovodInternalError(
                    f"rank {rank}: rank 0 did not make the small-op lane {path} within {wait_seconds:g} s "
                    "of the ranks meeting (did it die?); set RINGCOMM_SHM_LANE_BYTES=0 on every rank to run "
                    "without the lane") from None
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
        except OSError as exc:  # rank 0 made it moments ago: only a broken /dev/shm gets here
            raise HorovodInternalError(
                f"rank {rank}: cannot map the small-op lane {path} that rank 0 created ({exc}); "
                "set RINGCOMM_SHM_LANE_BYTES=0 on every rank to run without it") from exc
