"""Job-wide shared-memory allreduce, for jobs whose ranks all run on one host.

The ring moves every byte through ``2(p-1)`` hand-offs between neighbours; when
all ``p`` ranks share one host's memory they can instead meet in one shared
region.  Per round each rank handles a *piece* of its buffer (at most
``slab_bytes``):

1. copy its piece into its own slab (all but its own range);       -- barrier --
2. reduce *its own range* (1/p of the piece) across all ``p`` slabs (its own
   part straight from its input), in rank order, and write it (post-scaled)
   into the set's result slab;                                     -- barrier --
3. copy the whole reduced piece out of the result slab into its output.

Steps 2 of one piece and 1 of the next share a barrier (below).

The region holds two sets of ``p`` input slabs plus one result slab; piece k
uses set ``k mod 2`` (a global round counter, so also across ops).  That needs
only one barrier per piece: after barrier k+1 every rank has reduced piece k
and copied in piece k+1, so each rank copies piece k out, reduces piece k+1
and copies in piece k+2 (into piece k's input slabs, which nobody reads any
more), then meets the others at barrier k+2; piece k's result slab is only
overwritten after that barrier, when every rank has copied it out.  A
barrier is a futex barrier over per-rank counters in the region's first page
(:mod:`ringcomm.shm.barrier`, x86-64 Linux), else one empty message to every
peer over the existing data-plane sockets (tags with the top bit set, never
used by the ring).

What each rank sees, p = 3, Sum, one round::

    inputs      rank 0: [1, 2, 3]    rank 1: [10, 20, 30]   rank 2: [100, 200, 300]
    step 1      slab 0 = [_, 2, 3]   slab 1 = [10, _, 30]   slab 2 = [100, 200, _]
    step 2      rank 0 writes result[0:1] = 1+10+100, rank 1 result[1:2], rank 2 result[2:3]
    step 3      every rank: [111, 222, 333]

Every element is reduced once, by one rank, in rank order ``((x0 op x1) op x2) ...``
(the order rank 0's small-allreduce path uses), so all ranks get bitwise the
same result.  Per rank and per byte of buffer this moves about
``(p-1)/p (copy in) + 1 + 1/p (reduce) + 1 (copy out)`` buffer-sized reads and writes
instead of the ring's ``~2(p-1)/p`` slot copies plus the reduction's reads and
writes at every one of its ``2(p-1)`` steps.

The region (one file in /dev/shm, mode 0600, named
``ringcomm-<job>-<round>-allreduce`` so the launcher's clean-up of a killed job
finds it) is created by rank 0 at the first eligible op, mapped by the others
and unlinked by rank 0 as soon as every rank has mapped it.  Its pages are
reserved with ``posix_fallocate``, so a full /dev/shm is an error at setup (the
ranks agree to use the ring), never a SIGBUS later.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import numpy as np

from ..job import names
from ..shm import slots as shm, barrier as shm_barrier
from ..core import ring, routing
from .algorithms import Link
from .memory_threads import MIN_CHUNK_BYTES, MemoryThreads
from ..core.ops import ReduceOp, combine, reduce_into, scale_inplace

log = logging.getLogger("ringcomm.collectives.shm_allreduce")

#: Tags of this algorithm's messages: the top bit set (the ring's tags stay below 2**31).
BARRIER_TAG = 1 << 31
#: Tags of the one-time setup (rank 0 created / every rank mapped / verdict).
SETUP_TAG = BARRIER_TAG | (1 << 30)
#: Slabs are multiples of this many bytes, so every dtype's view is aligned.
ALIGN = 64

#: Work for :class:`MemoryThreads`: (elements, body(start, stop)) per copy or sum.
Jobs = list[tuple[int, Callable[[int, int], None]]]

_EMPTY = np.zeros(0, np.uint8)
_OK = np.ones(1, np.uint8)
_FAIL = np.zeros(1, np.uint8)


# -- pure arithmetic -----------------------------------------------------------


def slab_bytes_for(piece_bytes: int) -> int:
    """The slab size for a requested piece size: at least ``ALIGN``, rounded up to a multiple of it."""
    return max(ALIGN, -(-piece_bytes // ALIGN) * ALIGN)


def pieces(n: int, piece_elems: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each round's piece of an ``n``-element buffer (none when ``n == 0``).

        pieces(10, 4) -> [(0, 4), (4, 8), (8, 10)]
    """
    return ring.segments(0, n, piece_elems)


def owner_ranges(m: int, size: int) -> list[tuple[int, int]]:
    """Range of a piece of ``m`` elements that each rank reduces (rank r: entry r; some may be empty).

        owner_ranges(10, 3) -> [(0, 4), (4, 7), (7, 10)]
    """
    return ring.chunk_bounds(m, size)


def region_bytes(size: int, slab_bytes: int) -> int:
    """Bytes of the shared region: the barrier counters, then 2 sets x (``size`` input slabs + 1 result slab)."""
    return shm_barrier.header_bytes(size) + 2 * (size + 1) * slab_bytes


def slab_offset(set_: int, slab: int, size: int, slab_bytes: int) -> int:
    """Byte offset of input slab ``slab`` (0..size-1) or the result slab (``slab == size``) of set 0 or 1."""
    return shm_barrier.header_bytes(size) + (set_ * (size + 1) + slab) * slab_bytes


def region_path(job_id: str, round_: int) -> str:
    return names.shm_allreduce_region(job_id, round_)


# -- the shared region -----------------------------------------------------------


class Region(shm.MappedFile):
    """The mapped shared region of one job (see the module docstring for its layout)."""

    def __init__(self, path: str, size: int, slab_bytes: int, create: bool) -> None:
        super().__init__(path, region_bytes(size, slab_bytes), create, reserve=True)
        self.size, self.slab_bytes = size, slab_bytes

    def header(self) -> np.ndarray:
        """The barrier counters (:mod:`ringcomm.shm.barrier`), zero in a fresh region."""
        return self._bytes[:shm_barrier.header_bytes(self.size)]

    def view(self, set_: int, slab: int, dtype: np.dtype, n: int) -> np.ndarray:
        """The first ``n`` elements of a slab, as ``dtype``."""
        start = slab_offset(set_, slab, self.size, self.slab_bytes)
        return self._bytes[start:start + n * dtype.itemsize].view(dtype)


# -- the algorithm ---------------------------------------------------------------


class ShmAllreduce:
    """Allreduce through one shared region; every rank of the job holds one, on one host.

    ``allreduce`` is collective: every rank calls it with the same op, ``seq``
    and buffer length.  The first call sets the region up; if that fails on
    any rank, it returns False on every rank (the caller runs the ring) and so
    does every later call.
    """

    def __init__(self, job_id: str, round_: int, piece_bytes: int, peer_timeout: float = 30.0,
                 futex: bool | None = None, threads: int = 1, thread_min_bytes: int = MIN_CHUNK_BYTES) -> None:
        """``futex``: meet through :mod:`ringcomm.shm.barrier` (default: where it is available) rather
        than messages over the data plane.  ``threads``: this rank's copies and sums are cut into
        up to that many ranges of at least ``thread_min_bytes``, run at once
        (:mod:`.memory_threads`); the results are bitwise the same."""
        self.path = region_path(job_id, round_)
        self.slab_bytes = slab_bytes_for(piece_bytes)
        self.region: Region | None = None
        self.broken = False  # setup failed somewhere: the ring does every op
        self._rounds = 0  # rounds run so far (all ops): its parity picks the set
        self._futex = shm_barrier.available() if futex is None else futex
        self._meet: shm_barrier.ShmBarrier | None = None
        self._meetings = 0  # barriers so far (all ops): the futex barrier's numbers
        self._peer_timeout = peer_timeout
        self._work = MemoryThreads(threads)
        self.threads = self._work.threads
        self._min_chunk = thread_min_bytes

    def _barrier(self, link: Link, seq: int, tag: int, watch: Callable[[int], None] | None) -> None:
        """Returns once every rank has called it (with the same ``seq`` and ``tag``)."""
        if self._meet is not None:
            self._meetings += 1
            self._meet.wait(self._meetings, watch)
            return
        peers = [j for j in range(link.size) if j != link.rank]
        for j in peers:
            link.send(j, seq, tag, _EMPTY)
        for j in peers:
            link.recv(j, seq, tag)

    def _setup(self, link: Link, seq: int) -> bool:
        """Rank 0 creates the region, the others map it, rank 0 unlinks it; all agree on the outcome."""
        peers = range(1, link.size)
        ok = True
        if link.rank == 0:
            try:
                self.region = Region(self.path, link.size, self.slab_bytes, create=True)
            except OSError as exc:
                log.warning("shared-memory allreduce disabled: cannot create %s (%s); using the ring", self.path, exc)
                ok = False
            for j in peers:
                link.send(j, seq, SETUP_TAG, _OK if ok else _FAIL)
            for j in peers:  # every rank has mapped it (or failed to)
                ok = bool(np.frombuffer(link.recv(j, seq, SETUP_TAG | 1), np.uint8)[0]) and ok  # type: ignore[call-overload]
            if self.region is not None:
                self.region.unlink()
            for j in peers:
                link.send(j, seq, SETUP_TAG | 2, _OK if ok else _FAIL)
        else:
            created = bool(np.frombuffer(link.recv(0, seq, SETUP_TAG), np.uint8)[0])  # type: ignore[call-overload]
            mapped = False
            if created:
                try:
                    self.region = Region(self.path, link.size, self.slab_bytes, create=False)
                    mapped = True
                except OSError as exc:
                    log.warning("shared-memory allreduce disabled: cannot map %s (%s); using the ring", self.path, exc)
            link.send(0, seq, SETUP_TAG | 1, _OK if mapped else _FAIL)
            ok = bool(np.frombuffer(link.recv(0, seq, SETUP_TAG | 2), np.uint8)[0])  # type: ignore[call-overload]
        if not ok:
            self.broken = True
            if self.region is not None:
                self.region.close()
                self.region = None
        elif self._futex:
            assert self.region is not None
            self._meet = shm_barrier.ShmBarrier(self.region.header(), link.rank, link.size, self._peer_timeout)
        return ok

    def allreduce(
        self,
        link: Link,
        buf: np.ndarray,
        op: ReduceOp,
        seq: int,
        postscale: float = 1.0,
        src_buf: np.ndarray | None = None,
        marks: list[float] | None = None,
        watch: Callable[[int], None] | None = None,
    ) -> bool:
        """Reduce ``buf`` (1-D, contiguous) across the ranks of ``link`` (the job's, every time) in place.

        With ``src_buf`` the input is read from there and ``buf`` only written.
        ``postscale`` is applied once per element, by the rank that reduces it.
        With ``marks``, the ``time.perf_counter()`` at which this rank finished
        its last reduction is appended.  ``watch(j)``, called now and then
        while rank ``j`` is awaited at a barrier, raises if ``j`` is gone.  Returns False (and leaves ``buf``
        untouched) when the shared region is unavailable on some rank.

            rank 0: [1, 2, 3]   rank 1: [10, 20, 30]   rank 2: [100, 200, 300]
            ->   every rank: [111, 222, 333]
        """
        if self.broken:
            return False
        size, rank = link.size, link.rank
        inp = buf if src_buf is None else src_buf
        if buf.size == 0:
            return True
        if self.region is None and not self._setup(link, seq):
            return False
        region = self.region
        assert region is not None
        dtype = buf.dtype
        piece_elems = self.slab_bytes // dtype.itemsize
        ps = pieces(buf.size, piece_elems)
        first = self._rounds
        self._rounds += len(ps)

        def slab_ranges(k: int) -> tuple[int, int, int, int, int]:
            a, b = ps[k]
            lo, hi = owner_ranges(b - a, size)[rank]
            return (first + k) & 1, a, b, lo, hi

        def copy_in(k: int) -> Jobs:
            # Only the other ranks read this slab, and only outside this rank's own range: that
            # range this rank reduces straight from its input.
            s, a, b, lo, hi = slab_ranges(k)
            mine = region.view(s, rank, dtype, b - a)
            return [(lo, lambda x, y: np.copyto(mine[x:y], inp[a + x:a + y])),
                    (b - a - hi, lambda x, y: np.copyto(mine[hi + x:hi + y], inp[a + hi + x:a + hi + y]))]

        def reduce_own(k: int) -> Jobs:
            s, a, b, lo, hi = slab_ranges(k)
            m = b - a
            parts = [inp[a + lo:a + hi] if j == rank else region.view(s, j, dtype, m)[lo:hi] for j in range(size)]
            acc = region.view(s, size, dtype, m)[lo:hi]

            def part(x: int, y: int) -> None:
                combine(op, parts[0][x:y], parts[1][x:y], acc[x:y])
                for other in parts[2:]:
                    reduce_into(op, acc[x:y], other[x:y])
                scale_inplace(acc[x:y], postscale)
            return [(hi - lo, part)]

        def copy_out(k: int) -> Jobs:
            s, a, b, _, _ = slab_ranges(k)
            result = region.view(s, size, dtype, b - a)
            return [(b - a, lambda x, y: np.copyto(buf[a + x:a + y], result[x:y]))]

        # One barrier per round: barrier k+1 means every rank has reduced piece k (so it may be
        # copied out) and copied in piece k+1 (so it may be reduced).  Piece k+2 reuses piece k's
        # set; every rank wrote that set's result slab for piece k before barrier k+1 and
        # finished copying it out before barrier k+2, after which piece k+2 is reduced.  The work
        # between two barriers (copy piece k-1 out, reduce piece k, copy piece k+1 in) touches
        # three different slabs, so this rank's threads do it all at once.
        work, itemsize, min_chunk = self._work, dtype.itemsize, self._min_chunk
        work.spread(copy_in(0), itemsize, min_chunk)
        self._barrier(link, seq, BARRIER_TAG, watch)
        for k in range(len(ps)):
            jobs = (copy_out(k - 1) if k else []) + reduce_own(k) + (copy_in(k + 1) if k + 1 < len(ps) else [])
            work.spread(jobs, itemsize, min_chunk)
            if k + 1 == len(ps) and marks is not None:
                marks.append(time.perf_counter())
            self._barrier(link, seq, BARRIER_TAG | (k + 1), watch)
        work.spread(copy_out(len(ps) - 1), itemsize, min_chunk)
        link.flush()
        return True

    def close(self) -> None:
        self._work.close()
        self._meet = None  # its view of the counters would keep the mapping (and its fd) open
        if self.region is not None:
            self.region.unlink()  # gone already, unless this rank is rank 0 and setup was cut short
            self.region.close()
            self.region = None


def usable(size: int, hosts: Sequence[str], min_bytes: int, min_ranks: int) -> bool:
    """Whether a job of ``size`` ranks on ``hosts`` (one entry per rank) may use the shared-memory allreduce
    (:func:`routing.shm_possible`, and shared memory on this machine)."""
    return routing.shm_possible(size, hosts, min_bytes, min_ranks) and shm.available()
