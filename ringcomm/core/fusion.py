"""Fusion planning: which ready tensors share one buffer, at which offsets.  Pure.

Tensors are fused when they share a dtype and a reduction (op and scale
factors); a group never exceeds ``threshold`` bytes unless a single tensor
alone is larger (it then travels alone).  Order is preserved, so every rank
computes the same plan from the same ordered list.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple


class FusionItem(NamedTuple):
    """One tensor offered for fusion."""

    key: Hashable  # tensors fuse only with equal keys (dtype, op, scales)
    nbytes: int


def plan_fusion(items: Sequence[FusionItem], threshold: int) -> list[list[int]]:
    """Group item indices into fused buffers.

    Greedy in order: an item joins the most recent open group with its key if
    the group stays within ``threshold``; otherwise it opens a new group.

    >>> plan_fusion([FusionItem("f32", 40), FusionItem("f32", 40), FusionItem("f32", 40)], 100)
    [[0, 1], [2]]
    """
    groups: list[list[int]] = []
    open_group: dict[Hashable, int] = {}  # key -> index into groups
    used: list[int] = []
    for i, item in enumerate(items):
        g = open_group.get(item.key)
        if g is not None and used[g] + item.nbytes <= threshold:
            groups[g].append(i)
            used[g] += item.nbytes
            continue
        open_group[item.key] = len(groups)
        groups.append([i])
        used.append(item.nbytes)
    return groups
