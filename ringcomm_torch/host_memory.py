"""New host tensors for results and staging copies, backed by huge pages where the kernel has them.

The kernel maps a fresh block's pages at first touch.  torch's CPU allocator
leaves large blocks to 4 KiB pages, so the first write of a 1 GiB result takes
262,144 page faults; with ``madvise(MADV_HUGEPAGE)`` it takes 512, one per
2 MiB page.  NumPy advises its own arrays of 4 MiB and more so (the core's
results, e.g. an allgather's, already have it); :func:`empty_host` does the
same for the tensors this package allocates and the core then fills: an
out-of-place allreduce or broadcast writes the result straight into one.

Only advice: without transparent huge pages (another OS, THP set to ``never``)
nothing changes but the page size.

Example (any rank)::

    out = empty_host((1 << 28,), torch.float32)   # 1 GiB, contiguous, on the CPU
    out.numpy()                                  # what the core writes into
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Callable, Sequence

import torch

__all__ = ["HUGE_PAGE_MIN_BYTES", "advise_huge_pages", "empty_host", "page_range"]

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


def empty_host(shape: Sequence[int] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A new contiguous CPU tensor, its pages not yet touched, advised for huge pages when large."""
    out = torch.empty(tuple(shape), dtype=dtype)
    advise_huge_pages(out.data_ptr(), out.numel() * out.element_size())
    return out
