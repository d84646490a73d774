"""Memory-bound work on large buffers (copies, elementwise reductions) split over a few threads.

One thread copies or adds only as fast as one core can move memory: on a host with cores to
spare, the shared-memory allreduce's copies and sums can go faster when each is cut into
contiguous ranges, one per thread.  NumPy releases the GIL inside its
copy and ufunc loops, so the ranges run at once.  Each element is still computed by the same
rank, with the same operands in the same order: the results are bitwise those of one thread.

The decisions (where to cut, which thread takes which range) are pure functions; :class:`MemoryThreads` only
runs the pieces.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from ..core import ring

#: A range below this many bytes is not worth handing to another thread (a hand-off costs tens
#: of microseconds; a copy of 1 MiB about a hundred).
MIN_CHUNK_BYTES = 1024 * 1024


def chunks(lo: int, hi: int, threads: int, itemsize: int, min_bytes: int = MIN_CHUNK_BYTES) -> list[tuple[int, int]]:
    """Cut ``[lo, hi)`` (elements of ``itemsize`` bytes) into contiguous ranges, in order: at most
    ``threads`` of them, each of at least ``min_bytes`` (one range when the whole is smaller; none
    when it is empty).

        chunks(0, 10, 3, 1, min_bytes=1) -> [(0, 4), (4, 7), (7, 10)]
        chunks(0, 10, 3, 1, min_bytes=4) -> [(0, 5), (5, 10)]
        chunks(5, 5, 3, 1) -> []
    """
    n = hi - lo
    if n <= 0:
        return []
    min_elems = max(1, -(-min_bytes // max(1, itemsize)))
    count = max(1, min(threads, n // min_elems))
    return [(lo + a, lo + b) for a, b in ring.chunk_bounds(n, count)]  # the ring's balanced split


def plan(sizes: Sequence[int], threads: int, itemsize: int, min_bytes: int = MIN_CHUNK_BYTES
         ) -> list[list[tuple[int, int, int]]]:
    """Several jobs (``sizes[j]`` elements each) cut by :func:`chunks` and dealt to at most
    ``threads`` threads, so that all of them run in one hand-off: thread ``t`` gets the list of
    ``(job, start, stop)`` it runs in order.  A job cut into fewer ranges than threads continues
    where the last one stopped, so small jobs do not all fall to the first thread.

        plan([8, 2], threads=2, itemsize=1, min_bytes=2) -> [[(0, 0, 4), (1, 0, 2)], [(0, 4, 8)]]
    """
    out: list[list[tuple[int, int, int]]] = [[] for _ in range(max(1, threads))]
    turn = 0
    for job, n in enumerate(sizes):
        for a, b in chunks(0, n, threads, itemsize, min_bytes):
            out[turn % len(out)].append((job, a, b))
            turn += 1
    return [work for work in out if work]


class MemoryThreads:
    """Runs a list of calls at once: the first on the caller's thread, the rest on ``threads - 1``
    helpers kept for the rank's lifetime.  With one thread it is a plain loop."""

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self._pool = ThreadPoolExecutor(self.threads - 1, "ringcomm-memory") if self.threads > 1 else None

    def run(self, calls: Sequence[Callable[[], None]]) -> None:
        """Call each of ``calls`` once and return when all have returned; the first error is raised
        (after every call has finished, so no helper still touches the buffers)."""
        if self._pool is None or len(calls) < 2:
            for call in calls:
                call()
            return
        futures = [self._pool.submit(call) for call in calls[1:]]
        error: BaseException | None = None
        try:
            calls[0]()
        except BaseException as exc:  # noqa: BLE001 - re-raised below, once the helpers are done
            error = exc
        for fut in futures:
            failed = fut.exception()
            if error is None and failed is not None:
                error = failed
        if error is not None:
            raise error

    def spread(self, jobs: Sequence[tuple[int, Callable[[int, int], None]]], itemsize: int,
               min_bytes: int = MIN_CHUNK_BYTES) -> None:
        """For each ``(n, body)`` of ``jobs``, ``body(a, b)`` over ranges that cover ``[0, n)``: all
        of them in one hand-off, dealt by :func:`plan`.  Returns when every range is done."""
        dealt = plan([n for n, _ in jobs], self.threads, itemsize, min_bytes)

        def call(work: list[tuple[int, int, int]]) -> Callable[[], None]:
            def run_all() -> None:
                for job, a, b in work:
                    jobs[job][1](a, b)
            return run_all
        self.run([call(work) for work in dealt])

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
