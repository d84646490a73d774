"""The device arena's pure parts (no I/O, tested in memory): its ranges (:class:`Slots`) and
what each rank's row of an op's agreement holds, with the checks every rank makes alike on the
summed rows (:func:`signature`, :func:`disagreement`, :func:`root_disagreement`).
:mod:`.device_arena` is the shell that moves the bytes."""

from __future__ import annotations

import zlib

import numpy as np
import torch

__all__ = ["ARENA_ALIGN", "Slots", "SIGNATURE_DIMS", "ROW", "signature", "disagreement",
           "root_disagreement"]

#: Every range of an arena starts at a multiple of this many bytes (CUDA's own allocations do).
ARENA_ALIGN = 256


class Slots:
    """Ranges of an arena of ``capacity`` bytes, first fit (pure, no I/O).

    >>> s = Slots(1024, align=256)
    >>> s.take(100), s.take(300), s.take(700)
    (0, 256, None)
    >>> s.give(0); s.take(200)
    0
    """

    def __init__(self, capacity: int, align: int = ARENA_ALIGN) -> None:
        self.capacity = capacity
        self.align = align
        self._free: list[tuple[int, int]] = [(0, capacity)] if capacity > 0 else []  # (start, length), sorted
        self._taken: dict[int, int] = {}

    @property
    def free_bytes(self) -> int:
        return sum(length for _, length in self._free)

    def take(self, nbytes: int) -> int | None:
        """The start of a free range of at least ``nbytes`` (rounded up to the alignment), or None."""
        need = max(self.align, -(-nbytes // self.align) * self.align)
        for i, (start, length) in enumerate(self._free):
            if length >= need:
                if length == need:
                    del self._free[i]
                else:
                    self._free[i] = (start + need, length - need)
                self._taken[start] = need
                return start
        return None

    def give(self, start: int) -> None:
        """Free the range that :meth:`take` returned at ``start``, merged with free neighbours."""
        length = self._taken.pop(start)
        free = self._free
        i = 0
        while i < len(free) and free[i][0] < start:
            i += 1
        free.insert(i, (start, length))
        if i + 1 < len(free) and start + length == free[i + 1][0]:
            free[i] = (start, length + free.pop(i + 1)[1])
        if i > 0 and free[i - 1][0] + free[i - 1][1] == start:
            prev = free.pop(i - 1)
            free[i - 1] = (prev[0], prev[1] + free[i - 1][1])


#: Dimensions of a tensor's shape its agreement row carries one by one (a digest stands for the rest).
SIGNATURE_DIMS = 8
#: Entries of a rank's row in an op's agreement: its range's offset plus one (0: none), then the
#: tensor's :func:`signature`.  A broadcast's row holds the root rank between the two, and another
#: rank's first entry is 1 when it can read the root's arena, else 0.
ROW = 1 + 3 + SIGNATURE_DIMS
_DTYPES = {zlib.crc32(str(dt).encode()): str(dt).removeprefix("torch.")
           for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8,
                      torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128)}


def signature(t: torch.Tensor) -> list[int]:
    """``t``'s dtype, number of dimensions, first :data:`SIGNATURE_DIMS` sizes (zeros after the
    last) and a digest of the others, as integers (pure): ranks whose tensors differ in dtype or
    shape have different signatures.

    >>> signature(torch.zeros(2, 3))[1:5]
    [2, 2, 3, 0]
    """
    dims = list(t.shape)
    head = dims[:SIGNATURE_DIMS] + [0] * max(0, SIGNATURE_DIMS - len(dims))
    rest = zlib.crc32(repr(dims[SIGNATURE_DIMS:]).encode()) if len(dims) > SIGNATURE_DIMS else 0
    return [zlib.crc32(str(t.dtype).encode()), len(dims), *head, rest]


def disagreement(name: str, rows: np.ndarray, kind: str = "allreduce") -> str:
    """'' when every rank's :func:`signature` (``rows[k]``) is the same, else the message of the
    ``kind`` op's failure, naming each rank's dtype and shape (pure).

    >>> sig = lambda *shape: signature(torch.zeros(*shape))
    >>> disagreement("allreduce.x", np.array([sig(4, 6), sig(4, 6)]))
    ''
    >>> disagreement("allreduce.x", np.array([sig(4, 6), sig(24)]))[55:]
    'rank 0: float32 [4, 6], rank 1: float32 [24]. Pass a tensor of the same shape and dtype on every rank.'
    """
    if all((r == rows[0]).all() for r in rows[1:]):
        return ""

    def described(r: np.ndarray) -> str:
        ndim = int(r[1])
        dims = [int(d) for d in r[2:2 + min(ndim, SIGNATURE_DIMS)]] + (["..."] if ndim > SIGNATURE_DIMS else [])
        return f"{_DTYPES.get(int(r[0]), 'another dtype')} {dims}"
    ranks = ", ".join(f"rank {k}: {described(r)}" for k, r in enumerate(rows))
    return (f"{kind} '{name}': ranks disagree on the tensor: {ranks}. "
            "Pass a tensor of the same shape and dtype on every rank.")


def root_disagreement(name: str, roots: np.ndarray) -> str:
    """'' when every rank named the same root (``roots[k]``: rank ``k``'s), else the message of
    the broadcast's failure, naming each rank's (pure).

    >>> root_disagreement("broadcast.w", np.array([0, 0]))
    ''
    >>> root_disagreement("broadcast.w", np.array([0, 1]))
    "broadcast 'broadcast.w': ranks disagree on root_rank: rank 0: 0, rank 1: 1. Pass the same root_rank on every rank."
    """
    if (roots == roots[0]).all():
        return ""
    named = ", ".join(f"rank {k}: {int(r)}" for k, r in enumerate(roots))
    return (f"broadcast '{name}': ranks disagree on root_rank: {named}. "
            "Pass the same root_rank on every rank.")
