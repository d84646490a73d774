"""New host tensors for results and staging copies, backed by huge pages where the kernel has them.

The kernel maps a fresh block's pages at first touch.  torch's CPU allocator
leaves large blocks to 4 KiB pages, so the first write of a 1 GiB result takes
262,144 page faults; with ``madvise(MADV_HUGEPAGE)`` it takes 512, one per
2 MiB page.  NumPy advises its own arrays of 4 MiB and more so (the core's
results already have it); :func:`empty_host` does the same for the tensors
this package allocates and the core then fills: an out-of-place allreduce or
broadcast writes the result straight into one, and so does an allgather whose
ranks each give as many rows as this one.

Only advice: without transparent huge pages (another OS, THP set to ``never``)
nothing changes but the page size.

Where huge pages are not to be had (many VMs), a fresh block still costs a
fault per page, and in a VM often far more: the first write of a fresh 1 GiB
result took 0.3-2 s here, against 0.2 s into memory already mapped.  So large
blocks are reused, as torch's CUDA allocator reuses GPU memory: a block of
:data:`HUGE_PAGE_MIN_BYTES` or more whose tensors are all gone goes back to a
:class:`HostCache`, and the next request of its size takes it.  At most
``limit`` bytes of unused blocks are kept (``RINGCOMM_HOST_CACHE_BYTES``), each
for at most :data:`IDLE_SECONDS`; which block serves a request and which go is
decided by :class:`BlockPlan`, which holds sizes only.

Example (any rank)::

    out = empty_host((1 << 28,), torch.float32)   # 1 GiB, contiguous, on the CPU
    out.numpy()                                  # what the core writes into
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import mmap
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence

import numpy as np
import torch

__all__ = ["HUGE_PAGE_MIN_BYTES", "IDLE_SECONDS", "BlockPlan", "HostCache", "advise_huge_pages", "empty_host",
           "page_range"]

#: Blocks this large and up are advised (NumPy's threshold for its arrays).
HUGE_PAGE_MIN_BYTES = 4 << 20
_MADV_HUGEPAGE = 14  # Linux, every architecture
_PAGE = mmap.PAGESIZE

_madvise: Callable[[int, int, int], int] | None = None
_looked_up = False


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise`` through ctypes, looked up once (None off Linux or where libc lacks it)."""
    global _madvise, _looked_up
    if not _looked_up:
        _looked_up = True
        if sys.platform.startswith("linux"):
            try:
                fn = ctypes.CDLL(None, use_errno=True).madvise
            except (OSError, AttributeError):
                return None
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            fn.restype = ctypes.c_int
            _madvise = fn
    return _madvise


def page_range(addr: int, nbytes: int, page: int = _PAGE) -> tuple[int, int]:
    """``(start, length)`` of the whole pages inside ``[addr, addr + nbytes)`` (length 0: none).

        page_range(4100, 10000, 4096) -> (8192, 4096)
    """
    start = -(-addr // page) * page
    end = (addr + nbytes) // page * page
    return start, max(0, end - start)


def advise_huge_pages(addr: int, nbytes: int) -> bool:
    """Ask the kernel to back the whole pages of ``[addr, addr + nbytes)`` with huge pages; True if
    it took the advice.  Below :data:`HUGE_PAGE_MIN_BYTES`, or off Linux, nothing is asked."""
    if nbytes < HUGE_PAGE_MIN_BYTES:
        return False
    madvise = _libc_madvise()
    if madvise is None:
        return False
    start, length = page_range(addr, nbytes)
    return length > 0 and madvise(start, length, _MADV_HUGEPAGE) == 0


#: Seconds an unused block is kept for a later request of its size.
IDLE_SECONDS = 60.0
#: Block sizes are rounded up to this, so requests of nearly the same size share blocks.
BLOCK_ROUND = 2 << 20


class BlockPlan:
    """Which unused block serves a request, and which unused blocks go: sizes and keys only, no memory.

    ``limit``: bytes of unused blocks kept at most (0: none); a block idle for ``idle`` seconds goes.

        plan = BlockPlan(limit=8 << 20)
        plan.give(1, 4 << 20, now=0)    -> []     (kept)
        plan.take(4 << 20, now=1)       -> 1      (reused)
        plan.take(4 << 20, now=1)       -> None   (none unused: the caller makes a new block)
    """

    def __init__(self, limit: int, idle: float = IDLE_SECONDS) -> None:
        self.limit = limit
        self.idle = idle
        self._unused: dict[int, tuple[int, float]] = {}  # key -> (size, when it was given back), oldest first
        self.unused_bytes = 0

    def take(self, size: int, now: float) -> int | None:
        """The key of an unused block of exactly ``size`` bytes (the most recently given back), or None."""
        for key in reversed(self._unused):
            if self._unused[key][0] == size:
                self.unused_bytes -= size
                del self._unused[key]
                return key
        return None

    def give(self, key: int, size: int, now: float) -> list[int]:
        """Block ``key`` of ``size`` bytes is unused again; returns the keys of the blocks to free now
        (``key`` itself when it alone is over the limit)."""
        self._unused[key] = (size, now)
        self.unused_bytes += size
        return self.expire(now)

    def expire(self, now: float) -> list[int]:
        """Drop the blocks idle too long, then the oldest until the limit holds; returns their keys."""
        gone = []
        for key, (size, since) in list(self._unused.items()):
            if self.unused_bytes <= self.limit and now - since < self.idle:
                break
            del self._unused[key]
            self.unused_bytes -= size
            gone.append(key)
        return gone


class HostCache:
    """Large CPU tensors from reused blocks (see the module's text).

    A tensor it hands out is a view of a NumPy block; when the last tensor sharing that memory is
    gone, a finaliser puts the block's key on a queue (no lock: it may run in any thread, in the
    middle of anything), and the next request hands the queued blocks to the :class:`BlockPlan`.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._plan = BlockPlan(0)
        self._blocks: dict[int, np.ndarray] = {}
        self._returned: collections.deque[tuple[int, int]] = collections.deque()
        self._keys = itertools.count()
        self._lock = threading.Lock()
        self._clock = clock
        #: blocks made and requests served from an unused block, for tests and the performance page
        self.made = self.reused = 0

    def empty(self, shape: Sequence[int] | torch.Size, dtype: torch.dtype, limit: int) -> torch.Tensor:
        """A contiguous CPU tensor of ``shape`` and ``dtype``, its contents undefined; from a reused
        block when one of its size is unused and ``limit`` allows keeping blocks."""
        shape = tuple(shape)
        nbytes = dtype.itemsize
        for n in shape:
            nbytes *= n
        size = -(-nbytes // BLOCK_ROUND) * BLOCK_ROUND
        if nbytes < HUGE_PAGE_MIN_BYTES:
            return torch.empty(shape, dtype=dtype)
        if size > limit:  # too large to keep: a block of its own, and the limit applied to the others
            self.trim(limit)
            out = torch.empty(shape, dtype=dtype)
            advise_huge_pages(out.data_ptr(), nbytes)
            return out
        with self._lock:
            now = self._clock()
            self._plan.limit = limit
            self._settle(now)
            key = self._plan.take(size, now)
            if key is None:
                key = next(self._keys)
                self._blocks[key] = block = np.empty(size, dtype=np.uint8)  # NumPy advises it for huge pages
                self.made += 1
            else:
                block = self._blocks[key]
                self.reused += 1
        view = block[:nbytes]
        weakref.finalize(view, self._returned.append, (key, size))
        return torch.from_numpy(view).view(dtype).reshape(shape)

    def trim(self, limit: int) -> None:
        """Apply ``limit`` now: free the unused blocks beyond it, and those idle too long."""
        with self._lock:
            self._plan.limit = limit
            self._settle(self._clock())

    def _settle(self, now: float) -> None:
        """With the lock held: take in the blocks given back since, and free what the plan lets go."""
        gone = self._plan.expire(now)
        while self._returned:
            key, size = self._returned.popleft()
            gone += self._plan.give(key, size, now)
        for key in gone:
            del self._blocks[key]

    @property
    def unused_bytes(self) -> int:
        """Bytes held in unused blocks (the blocks given back since the last request not counted yet)."""
        return self._plan.unused_bytes


#: The process's cache of large host blocks (every rank is one process).
CACHE = HostCache()


def empty_host(shape: Sequence[int] | torch.Size, dtype: torch.dtype, cache_bytes: int = 0) -> torch.Tensor:
    """A new contiguous CPU tensor, its pages not yet touched, advised for huge pages when large; with
    ``cache_bytes`` > 0, a large one comes from :data:`CACHE` (a reused block when one is unused)."""
    if cache_bytes > 0:
        return CACHE.empty(shape, dtype, cache_bytes)
    out = torch.empty(tuple(shape), dtype=dtype)
    advise_huge_pages(out.data_ptr(), out.numel() * out.element_size())
    return out
