"""A barrier for the ranks of one host, through counters in a shared mapping and Linux futexes.

The shared-memory allreduce meets once per piece.  Over ZeroMQ a meeting is a
message to every peer and back through each side's I/O thread: about 150 us
per barrier on this 2-core machine (a 64 MiB allreduce cut into 256 KiB pieces
paid more in barriers than in arithmetic).  Here each rank owns one 32-bit
counter in the shared region (its own cache line); barrier ``b`` is::

    rank r:  counter[r] = b;  futex_wake(counter[r])
             for every other rank j: wait until counter[j] >= b

A waiter first re-reads the counter a few times (the peer is usually about to
arrive), then sleeps in ``futex_wait`` on the peer's counter, which releases
the GIL (a ctypes call) and wakes when the peer stores and wakes, or after a
slice, when it asks ``watch`` whether the peer is gone (a dead peer never
arrives; the data plane's connection monitors know) and enforces the peer
timeout.

What each rank sees, p = 2::

    rank 0: wait(1) -> returns once rank 1 has called wait(1)
    rank 1: wait(1) -> returns once rank 0 has called wait(1)

Memory order: the data a rank wrote before storing its counter must be
visible to a peer that has seen the counter.  x86-64 keeps stores in order
(and glibc's non-temporal memcpy ends with ``sfence``), so this holds with
plain stores; other architectures need fences Python cannot issue, and
:func:`available` is False there (the caller keeps the message barrier).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from . import futex
from ..errors import PeerLostError

#: Bytes per rank's counter: one cache line, so ranks never write the same line.
STRIDE = 64
#: Re-reads of a peer's counter before sleeping on it.
SPINS = 100
#: Seconds one futex sleep lasts before the waiter checks on the peer.
SLICE = 0.1



def available() -> bool:
    """Whether this platform gets the futex barrier (Linux on x86-64: ordered stores, a known syscall)."""
    return futex.available()


def header_bytes(size: int) -> int:
    """Bytes the counters of ``size`` ranks take, rounded up to a page so what follows stays aligned."""
    return -(-size * STRIDE // 4096) * 4096


def reached(value: int, number: int) -> bool:
    """Whether counter ``value`` is at or past barrier ``number``, modulo 2**32.

        reached(5, 5) -> True    reached(4, 5) -> False    reached(1, 2**32 - 1) -> True
    """
    return (value - number) & 0xFFFFFFFF < 0x80000000


class ShmBarrier:
    """Numbered barriers among the ``size`` ranks that share ``header`` (:func:`header_bytes` of a mapping).

    Every rank calls :meth:`wait` with the same increasing numbers; counters
    start at 0 (a fresh mapping), so the first number is 1.
    """

    def __init__(self, header: np.ndarray, rank: int, size: int, peer_timeout: float) -> None:
        if header.nbytes < size * STRIDE or header.ctypes.data % STRIDE:
            raise ValueError("the barrier header must be cache-line aligned and hold every rank's counter")
        self.rank, self.size = rank, size
        self._header = header  # keeps the mapping's memory referenced while the counters are in use
        self._words = header[: size * STRIDE].view(np.uint32)[:: STRIDE // 4]
        self._base = header.ctypes.data
        self._timeout = peer_timeout

    def _addr(self, rank: int) -> int:
        return self._base + rank * STRIDE

    def wait(self, number: int, watch: Callable[[int], None] | None = None) -> None:
        """Arrive at barrier ``number`` and return once every rank has arrived.

        ``watch(j)`` is called about every :data:`SLICE` seconds while rank
        ``j`` is awaited; it raises if ``j`` is known to be gone.  After the
        peer timeout without ``j`` arriving this raises :class:`PeerLostError`.
        """
        words, rank = self._words, self.rank
        number &= 0xFFFFFFFF
        words[rank] = number
        futex.wake(self._addr(rank))
        for j in range(self.size):
            if j != rank:
                self._await(j, number, watch)

    def _await(self, j: int, number: int, watch: Callable[[int], None] | None) -> None:
        words = self._words
        for _ in range(SPINS):
            if reached(int(words[j]), number):
                return
        addr = self._addr(j)
        slice_ = futex.timespec(SLICE)
        start = time.monotonic()
        while True:
            seen = int(words[j])
            if reached(seen, number):
                return
            # sleeps only while the counter still holds ``seen`` (else returns at once)
            if not futex.wait(addr, seen, slice_):
                if watch is not None:
                    watch(j)
                if time.monotonic() - start > self._timeout:
                    raise PeerLostError(
                        f"rank {self.rank}: rank {j} did not reach shared-memory barrier {number} within "
                        f"{self._timeout:.0f} s; the peer hangs or is stopped. Raise RINGCOMM_PEER_TIMEOUT "
                        "if it is only slow."
                    )
