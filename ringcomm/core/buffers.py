"""Receive buffers given back after use and taken again for the next payload of their size.

A fresh NumPy buffer costs a page fault per 4 KiB the first time it is
written, on every payload; a buffer read into again costs none.  The pool
keeps given-back buffers up to a byte bound (or one payload, where that is
larger).  It takes no lock: a caller shared by threads holds its own.
"""

from __future__ import annotations

import numpy as np

__all__ = ["SpareBuffers"]


class SpareBuffers:
    """Buffers kept for reuse, by byte count, up to ``limit_bytes`` in all (or one buffer larger than that)."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self._spare: dict[int, list[np.ndarray]] = {}
        self.kept_bytes = 0

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer of ``nbytes``: one given back, else a fresh one."""
        spare = self._spare.get(nbytes)
        if spare:
            self.kept_bytes -= nbytes
            return spare.pop()
        return np.empty(nbytes, np.uint8)

    def give(self, buf: np.ndarray) -> None:
        """``buf`` is no longer used: keep it for a later :meth:`take` of its size, within the bound."""
        if self.kept_bytes + buf.nbytes <= max(self.limit_bytes, buf.nbytes):
            self._spare.setdefault(buf.nbytes, []).append(buf)
            self.kept_bytes += buf.nbytes

    def clear(self) -> None:
        self._spare.clear()
        self.kept_bytes = 0
