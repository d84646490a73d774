"""Ring schedule: pure arithmetic, no I/O.

A buffer is cut into ``size`` chunks (lower ranks get the extra elements).
Scatter-reduce runs ``size - 1`` steps; at step ``s`` rank ``r`` sends chunk
``(r - s + shift) % size`` to its right neighbour and receives chunk
``(r - s - 1 + shift) % size`` from its left neighbour, folding it in.  After
the last step rank ``r`` holds the fully reduced chunk
``owned_chunk(r, size, shift)``; the allgather phase then passes the finished
chunks around the ring so every rank ends with the whole result.

The chunk a rank receives at step ``s`` is exactly the chunk it sends at step
``s + 1``, so the executor forwards each segment the moment it has reduced it
(a segment-level pipeline: no rank ever waits for a whole chunk).

Example (size 3, shift 0), what each rank does::

    step   rank 0          rank 1          rank 2
    sr 0   send 0 recv 2   send 1 recv 0   send 2 recv 1
    sr 1   send 2 recv 1   send 0 recv 2   send 1 recv 0
    owns   chunk 1         chunk 2         chunk 0
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np


class Step(NamedTuple):
    """One ring step on one rank: which chunk leaves to the right, which arrives from the left."""

    send_chunk: int
    recv_chunk: int


def split_sizes(length: int, parts: int) -> list[int]:
    """Sizes of ``parts`` near-equal pieces of ``length``; the first ``length % parts`` get one more.

    >>> split_sizes(7, 3)
    [3, 2, 2]
    """
    if parts <= 0:
        raise ValueError(f"parts must be >= 1, got {parts}")
    base, extra = divmod(length, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def offsets(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` for consecutive pieces of the given sizes."""
    bounds = []
    start = 0
    for n in sizes:
        bounds.append((start, start + n))
        start += n
    return bounds


def chunk_bounds(length: int, size: int) -> list[tuple[int, int]]:
    """Element ranges of the ``size`` ring chunks of a buffer of ``length`` elements."""
    return offsets(split_sizes(length, size))


def left(rank: int, size: int) -> int:
    return (rank - 1) % size


def right(rank: int, size: int) -> int:
    return (rank + 1) % size


def scatter_reduce_steps(rank: int, size: int, shift: int = 0) -> list[Step]:
    """The ``size - 1`` scatter-reduce steps of ``rank``."""
    return [Step((rank - s + shift) % size, (rank - s - 1 + shift) % size) for s in range(size - 1)]


def owned_chunk(rank: int, size: int, shift: int = 0) -> int:
    """The chunk ``rank`` holds fully reduced after scatter-reduce."""
    return (rank + 1 + shift) % size


def allgather_steps(rank: int, size: int, shift: int = 0) -> list[Step]:
    """The ``size - 1`` allgather steps of ``rank``, starting from ``owned_chunk(rank, size, shift)``."""
    return [Step((rank + 1 + shift - s) % size, (rank + shift - s) % size) for s in range(size - 1)]


#: Shift under which rank r owns chunk r (reducescatter, allgather).
OWN_CHUNK_SHIFT = -1


def segments(start: int, stop: int, seg_elems: int) -> list[tuple[int, int]]:
    """Split ``[start, stop)`` into pipeline segments of at most ``seg_elems`` elements (none if empty)."""
    seg_elems = max(1, seg_elems)
    return [(a, min(a + seg_elems, stop)) for a in range(start, stop, seg_elems)]


#: Bytes of stream payloads a rank may hold before it sums them: what a ring pass sends ahead over
#: a stream to another host (which queues the array itself, so its queue must not run dry while the
#: left neighbour's segments are late), and the spare receive buffers a stream keeps for them (8
#: segments of 4 MiB, 4 of 8 MiB).
STREAM_AHEAD_BYTES = 32 << 20


def one_per_host(hosts: Sequence[str]) -> bool:
    """Whether ranks on ``hosts`` (rank r's host) are at least two, each on a host of its own, so that
    every link between two of them joins two hosts.

        one_per_host(["a", "b", "c"]) -> True     one_per_host(["a", "b", "a"]) -> False
        one_per_host(["a"]) -> False
    """
    return len(hosts) >= 2 and len(set(hosts)) == len(hosts)


def simulate_allreduce(
    buffers: Sequence[np.ndarray],
    reduce: Callable[[np.ndarray, np.ndarray], None] = lambda d, s: np.add(d, s, out=d),
) -> list[np.ndarray]:
    """Run the ring schedule over in-memory buffers (one per rank), without sockets.

    Returns each rank's final buffer.  Used by tests to check the schedule itself;
    the executor runs the same steps over the network.
    """
    size = len(buffers)
    bufs = [b.copy() for b in buffers]
    if size == 1:
        return bufs
    bounds = chunk_bounds(len(bufs[0]), size)
    for phase in ("scatter", "gather"):
        for s in range(size - 1):
            # every rank sends at the same time: snapshot what is sent first
            sent = []
            for r in range(size):
                steps = scatter_reduce_steps(r, size) if phase == "scatter" else allgather_steps(r, size)
                a, b = bounds[steps[s].send_chunk]
                sent.append(bufs[r][a:b].copy())
            for r in range(size):
                steps = scatter_reduce_steps(r, size) if phase == "scatter" else allgather_steps(r, size)
                a, b = bounds[steps[s].recv_chunk]
                incoming = sent[left(r, size)]
                if phase == "scatter":
                    reduce(bufs[r][a:b], incoming)
                else:
                    bufs[r][a:b] = incoming
    return bufs
