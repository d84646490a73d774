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
:func:`choose` is the rule for when it is used.  A large buffer is cut into
pieces whose phases overlap (:mod:`ringcomm.core.pipeline`: the phases within
the host of one piece run while the link carries another); :func:`pieces_for`
says how many.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from . import algorithms
from ..core import pipeline, ring, routing, wire
from ..core.ops import ReduceOp

#: Sequence numbers of one op (a pass each): the engine numbers ops in steps of this.
PHASES = 32
#: At most this many pieces (three passes each, one sequence number per pass).
MAX_PIECES = 8
#: Allreduces of at least this many bytes take the hierarchical path when it is on automatically.
AUTO_MIN_BYTES = routing.HIERARCHICAL_MIN_BYTES


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
    """Whether an allreduce of ``nbytes`` takes the hierarchical path (the rule is :func:`routing.route`'s).

    ``setting``: 1 forces it wherever the layout allows it, 0 never, -1 (default) from
    :data:`AUTO_MIN_BYTES` up.  Small allreduces gain nothing from it: their time is latency,
    and three phases cost more round trips than one ring.
    """
    facts = routing.PathFacts(routing.Where.EXECUTE, op=op, host_plan=host_plan is not None)
    path = routing.route(wire.ALLREDUCE, nbytes, facts, routing.RouteLimits(hierarchical=setting))
    return path is routing.Path.HIERARCHICAL


def pieces_for(nbytes: int, piece_bytes: int) -> int:
    """How many pieces an allreduce of ``nbytes`` is cut into: one per ``piece_bytes``, at most
    :data:`MAX_PIECES` (``piece_bytes`` 0: one piece, no pipelining).

        pieces_for(64 << 20, 8 << 20) -> 8      pieces_for(4 << 20, 8 << 20) -> 1
    """
    if piece_bytes <= 0:
        return 1
    return max(1, min(MAX_PIECES, nbytes // piece_bytes))


def allreduce(link: algorithms.Link, host_plan: HostPlan, buf: np.ndarray, op: ReduceOp, seq: int, seg_elems: int,
              postscale: float = 1.0, src_buf: np.ndarray | None = None, pieces: int = 1) -> None:
    """Reduce ``buf`` (1-D, contiguous) across every rank of ``link`` in place, host by host.

    Collective over ``link``'s ranks, each with its own :func:`plan` and the same ``pieces``
    (1 to :data:`MAX_PIECES`): the buffer is cut into that many pieces whose passes overlap
    (:mod:`ringcomm.core.pipeline`); ``seq`` onwards numbers the passes.  ``postscale`` is
    applied once, to each finished block.
    """
    if not 1 <= pieces <= MAX_PIECES:
        raise ValueError(f"pieces must be 1 to {MAX_PIECES}, got {pieces}")
    local = algorithms.SubLink(link, host_plan.local)
    cross = algorithms.SubLink(link, host_plan.cross)
    passes: dict[tuple[int, int], tuple[algorithms.SubLink, algorithms.RingPass]] = {}
    for c, (a, b) in enumerate(ring.chunk_bounds(buf.size, pieces)):
        piece = buf[a:b]
        counts = ring.split_sizes(piece.size, local.size)
        start, stop = ring.offsets(counts)[local.rank]
        passes[(pipeline.RS, c)] = local, algorithms.reducescatter_pass(
            local, piece, counts, op, seq + pipeline.seq_offset(pipeline.RS, c), seg_elems,
            src_buf=None if src_buf is None else src_buf[a:b])  # read there: no copy-in
        passes[(pipeline.AR, c)] = cross, algorithms.allreduce_pass(
            cross, piece[start:stop], op, seq + pipeline.seq_offset(pipeline.AR, c), seg_elems, postscale)
        passes[(pipeline.AG, c)] = local, algorithms.allgatherv_pass(
            local, piece, counts, seq + pipeline.seq_offset(pipeline.AG, c), seg_elems)
    schedule = pipeline.PieceSchedule(pieces)
    running: list[tuple[int, int]] = []
    wants: list[tuple[int, int]] = []  # (source in link's ranks, seq) of each running pass
    sending: set[tuple[int, int]] = set()  # cross-host passes not yet known to have queued all they send

    def advance() -> None:
        """Start what the schedule allows (a pass with nothing to receive is over at once)."""
        while ready := schedule.ready():
            for key in ready:
                sub, p = passes[key]
                p.start()
                if p.done:
                    schedule.finished(*key)
                    continue
                running.append(key)
                wants.append((sub.ranks[p.src], p.seq))
                if key[0] == pipeline.AR:
                    sending.add(key)

    advance()
    while running:
        i, tag, payload = link.recv_first(wants)
        key = running[i]
        p = passes[key][1]
        p.feed(tag, payload)
        if p.done:
            del running[i], wants[i]
            sending.discard(key)
            schedule.finished(*key)
        elif key in sending and p.sent_all:  # the next piece's cross-host pass may start
            sending.discard(key)
            schedule.sent_all(*key)
        else:
            continue
        advance()
    link.flush()
