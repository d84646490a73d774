"""What each rank sends and expects in the backend's exchanges (``all_to_all_single``,
``all_to_all``, ``scatter``, ``gather``): pure counts, no tensors, no I/O.

Each exchange is one core alltoall; a rank's ``splits`` are what it sends each rank, its
``received`` what it expects from each (the core's ``received_splits``).  The core checks the
two against each other on every rank, so sizes that do not fit fail the op everywhere instead of
on the one rank whose output they would not fill.  ``scatter`` and ``gather`` count elements
(their tensors travel flat); ``all_to_all_single`` counts rows of the first dimension.

    scatter_counts(rank=1, root=0, size=2, out_numel=3, part_numels=None)
    -> Counts(splits=[0, 0], received=[3, 0], keeps_own=False)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class Counts(NamedTuple):
    splits: list[int]  # what this rank sends each rank
    received: list[int]  # what it expects from each rank
    keeps_own: bool = False  # the scatter root copies its own part into its output instead of sending it


def single_receipts(size: int, out_shape: Sequence[int], in_shape: Sequence[int],
                    sizes: Sequence[int]) -> list[int] | str:
    """The rows an ``all_to_all_single`` output of ``out_shape`` takes from each of ``size`` ranks
    (``sizes``: its ``output_split_sizes``, or empty: an even share), or why it cannot take rows
    of an input of ``in_shape``.

        single_receipts(2, (4, 3), (6, 3), [])      -> [2, 2]
        single_receipts(2, (3,), (4,), [])          -> "the output's 3 rows do not split evenly ..."
    """
    if not in_shape or not out_shape:
        return "needs tensors with at least one dimension; reshape them, e.g. t.reshape(1)"
    rows = out_shape[0]
    if _numel(out_shape[1:]) != _numel(in_shape[1:]):
        return (f"the output's rows hold {_numel(out_shape[1:])} elements, the input's {_numel(in_shape[1:])}; "
                "both must have the same dimensions after the first")
    if not len(sizes):
        if rows % size:
            return (f"the output's {rows} rows do not split evenly over the group of {size}; pass "
                    "output_split_sizes with the rows each rank sends here")
        return [rows // size] * size
    want = [int(v) for v in sizes]
    if len(want) != size or min(want) < 0 or sum(want) != rows:
        return (f"output_split_sizes {want} must hold one count >= 0 per rank of the group of {size}, summing "
                f"to the output's {rows} rows")
    return want


def scatter_counts(rank: int, root: int, size: int, out_numel: int, part_numels: Sequence[int] | None) -> Counts:
    """``scatter`` from ``root``: the root (``part_numels``: its parts' sizes) sends part j to
    rank j and keeps its own when it fits its output; every other rank expects ``out_numel``
    elements from the root."""
    received = [0] * size
    received[root] = out_numel
    if rank != root or part_numels is None:
        return Counts([0] * size, received)
    splits = [int(n) for n in part_numels]
    if splits[root] == out_numel:
        splits[root] = received[root] = 0
        return Counts(splits, received, keeps_own=True)
    return Counts(splits, received)


def gather_counts(rank: int, root: int, size: int, in_numel: int, out_numels: Sequence[int] | None) -> Counts:
    """``gather`` to ``root``: every rank sends its ``in_numel`` elements to the root, which
    expects each output's size (``out_numels``) from its rank."""
    splits = [0] * size
    splits[root] = in_numel
    received = [int(n) for n in out_numels] if rank == root and out_numels is not None else [0] * size
    return Counts(splits, received)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
