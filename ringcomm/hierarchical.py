"""Hierarchical allreduce for jobs that span hosts: reduce within each host, across hosts, share within.

A flat ring over N ranks on H hosts pushes 2(N-1)/N of the buffer across
every host's link; reducing within the host first leaves 2(H-1)/H for the
link (1.5x less at 2 hosts x 2 ranks, 1.9x at 2 x 8).  With L ranks per host:

1. **within the host**: a ring reduce-scatter over the host's L ranks (the
   same-host pairs move data through shared memory) leaves local rank l with
   block l of the host's sum;
2. **across hosts**: local rank l of every host runs a ring allreduce of
   block l with its counterparts, so each local rank carries its own block
   across (L streams per host: no single connection or core carries it all);
3. **within the host**: a ring allgather gives every local rank every block.

Each block's final value is computed once, by the cross-host ring, and then
copied: every rank ends with bitwise the same result.  The sums are grouped
differently from a flat ring's, so the last bits may differ from it (as they
do between Horovod's flat and hierarchical modes).

:func:`plan` (pure) decides whether a process set's layout allows it: at
least two hosts, the same number (at least two) of the set's ranks on each.
:func:`choose` is the rule for when it is used.  The three phases use the
op's sequence number plus 0, 1 and 2 (the engine leaves room for them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from . import algorithms
from .core import ring
from .core.ops import ReduceOp

#: Phases of one op, each with a sequence number of its own: the engine numbers ops in steps of this.
PHASES = 4
#: Allreduces of at least this many bytes take the hierarchical path when it is on automatically.
AUTO_MIN_BYTES = 1 << 20


class HostPlan(NamedTuple):
    """One rank's view: the set ranks on its host and its counterparts on the other hosts."""

    local: tuple[int, ...]  # set ranks on this rank's host, in rank order
    cross: tuple[int, ...]  # set ranks with this rank's local index, one per host, hosts in order


def plan(hosts: Sequence[str], me: int) -> HostPlan | None:
    """The plan for set rank ``me`` given each set rank's host, or ``None`` when the layout does not allow it.

        plan(["a", "a", "b", "b"], 2) -> HostPlan(local=(2, 3), cross=(0, 2))
        plan(["a", "b", "a", "b"], 1) -> HostPlan(local=(1, 3), cross=(0, 1))
        plan(["a", "a", "b"], 0) -> None      (2 ranks on one host, 1 on the other)
    """
    groups: dict[str, list[int]] = {}
    for r, host in enumerate(hosts):
        groups.setdefault(host, []).append(r)
    sizes = {len(g) for g in groups.values()}
    if len(groups) < 2 or len(sizes) != 1 or sizes.pop() < 2:
        return None
    local = groups[hosts[me]]
    index = local.index(me)
    return HostPlan(tuple(local), tuple(g[index] for g in groups.values()))


def choose(setting: int, nbytes: int, host_plan: HostPlan | None, op: ReduceOp) -> bool:
    """Whether an allreduce of ``nbytes`` takes the hierarchical path.

    ``setting``: 1 forces it wherever the layout allows it, 0 never, -1 (default) from
    :data:`AUTO_MIN_BYTES` up.  Small allreduces gain nothing from it: their time is latency,
    and three phases cost more round trips than one ring.
    """
    if host_plan is None or setting == 0 or op is ReduceOp.ADASUM:
        return False
    return setting == 1 or nbytes >= AUTO_MIN_BYTES


def allreduce(link: algorithms.Link, host_plan: HostPlan, buf: np.ndarray, op: ReduceOp, seq: int, seg_elems: int,
              postscale: float = 1.0, src_buf: np.ndarray | None = None) -> None:
    """Reduce ``buf`` (1-D, contiguous) across every rank of ``link`` in place, host by host.

    Collective over ``link``'s ranks, each with its own :func:`plan`; ``seq`` .. ``seq + 2``
    number the three phases.  ``postscale`` is applied once, to each finished block.
    """
    if src_buf is not None:
        np.copyto(buf, src_buf)
    local = algorithms.SubLink(link, host_plan.local)
    cross = algorithms.SubLink(link, host_plan.cross)
    counts = ring.split_sizes(buf.size, local.size)
    start, stop = algorithms.ring_reducescatter(local, buf, counts, op, seq, seg_elems, 1.0)
    algorithms.ring_allreduce(cross, buf[start:stop], op, seq + 1, seg_elems, postscale)
    algorithms.ring_allgatherv(local, buf, counts, seq + 2, seg_elems)
