"""Collective algorithms over a point-to-point link.  No sockets here.

Each function runs on every rank at once with the same arguments (apart from
the rank's own data) and talks only through ``link``:

- ``link.rank``, ``link.size``
- ``link.send(dst, seq, tag, arr)``: queue a 1-D contiguous array for ``dst``
  (may be zero-copy: the caller must not change ``arr`` until ``link.flush()``
  returns or the data provably arrived)
- ``link.recv(src, seq, tag) -> buffer``: the payload ``src`` sent with that tag
- ``link.flush()``: wait until every queued send has left this process

``seq`` numbers the op (the same on every rank) and ``tag`` numbers the message
within it, so messages that arrive early are kept until asked for.
The in-process tests run these functions over queues; the engine runs them
over ZeroMQ.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from . import ring
from .ops import ReduceOp, combine, reduce_into, scale_inplace


class Link(Protocol):
    rank: int
    size: int

    def send(self, dst: int, seq: int, tag: int, arr: np.ndarray) -> None: ...

    def recv(self, src: int, seq: int, tag: int) -> object: ...

    def flush(self) -> None: ...


def _tag(step: int, seg: int) -> int:
    return (step << 20) | seg


def _segs(bounds: tuple[int, int], seg_elems: int) -> list[tuple[int, int]]:
    return ring.segments(bounds[0], bounds[1], seg_elems)


class StreamError(RuntimeError):
    """A message of the wrong length arrived: the ranks' data streams are out of step."""


def _view(buf: object, dtype: np.dtype, n: int) -> np.ndarray:
    v = np.frombuffer(buf, dtype=dtype)  # type: ignore[call-overload]
    if v.size != n:
        raise StreamError(f"expected {n} elements of {dtype}, received {v.size}: data streams out of step")
    return v


def ring_allreduce(
    link: Link,
    buf: np.ndarray,
    op: ReduceOp,
    seq: int,
    seg_elems: int,
    postscale: float = 1.0,
    src_buf: np.ndarray | None = None,
) -> None:
    """Reduce ``buf`` (1-D, contiguous) across ranks in place; every rank ends with the result.

    With ``src_buf`` the input is read from there and ``buf`` is only written
    (no copy-in: each chunk is first touched when it is reduced or received).

    Pipelined by segment: a rank forwards each segment as soon as it has folded
    in its own contribution.  ``postscale`` is applied once per chunk, by the
    chunk's owner, before it is passed around.

        rank 0: [1, 2, 3]   rank 1: [10, 20, 30]   ->   both: [11, 22, 33]
    """
    size, rank = link.size, link.rank
    inp = buf if src_buf is None else src_buf
    if size == 1 or buf.size == 0:
        if inp is not buf:
            buf[...] = inp
        scale_inplace(buf, postscale)
        return
    bounds = ring.chunk_bounds(buf.size, size)
    sr = ring.scatter_reduce_steps(rank, size)
    ag = ring.allgather_steps(rank, size)
    dst, src = ring.right(rank, size), ring.left(rank, size)
    last = size - 2
    for k, (a, b) in enumerate(_segs(bounds[sr[0].send_chunk], seg_elems)):
        link.send(dst, seq, _tag(0, k), inp[a:b])
    for s, step in enumerate(sr):
        for k, (a, b) in enumerate(_segs(bounds[step.recv_chunk], seg_elems)):
            seg = buf[a:b]
            incoming = _view(link.recv(src, seq, _tag(s, k)), buf.dtype, b - a)
            combine(op, inp[a:b], incoming, seg)  # this rank's own contribution + the partial sum
            if s == last:
                scale_inplace(seg, postscale)
            link.send(dst, seq, _tag(s + 1, k), seg)  # s+1 == size-1 is allgather step 0
    _gather_phase(link, buf, bounds, ag, seq, seg_elems, step_base=size - 1, first_sent=True)
    link.flush()


def _gather_phase(
    link: Link,
    buf: np.ndarray,
    bounds: Sequence[tuple[int, int]],
    steps: Sequence[ring.Step],
    seq: int,
    seg_elems: int,
    step_base: int,
    first_sent: bool,
) -> None:
    """Pass finished chunks around the ring; each received segment is forwarded at once."""
    size, rank = link.size, link.rank
    dst, src = ring.right(rank, size), ring.left(rank, size)
    if not first_sent:
        for k, (a, b) in enumerate(_segs(bounds[steps[0].send_chunk], seg_elems)):
            link.send(dst, seq, _tag(step_base, k), buf[a:b])
    for s, step in enumerate(steps):
        for k, (a, b) in enumerate(_segs(bounds[step.recv_chunk], seg_elems)):
            seg = buf[a:b]
            seg[...] = _view(link.recv(src, seq, _tag(step_base + s, k)), buf.dtype, b - a)
            if s + 1 < len(steps):
                link.send(dst, seq, _tag(step_base + s + 1, k), seg)


def ring_allgatherv(link: Link, out: np.ndarray, counts: Sequence[int], seq: int, seg_elems: int) -> None:
    """Every rank's block of ``out`` (1-D; rank r's block has ``counts[r]`` elements, already
    filled in on rank r) ends up on every rank.

        rank 0: [a, _, _]   rank 1: [_, b, c]   (counts [1, 2])   ->   both: [a, b, c]
    """
    size, rank = link.size, link.rank
    if size == 1:
        return
    bounds = ring.offsets(counts)
    steps = ring.allgather_steps(rank, size, ring.OWN_CHUNK_SHIFT)
    _gather_phase(link, out, bounds, steps, seq, seg_elems, step_base=0, first_sent=False)
    link.flush()


def ring_reducescatter(
    link: Link,
    buf: np.ndarray,
    counts: Sequence[int],
    op: ReduceOp,
    seq: int,
    seg_elems: int,
    postscale: float = 1.0,
) -> tuple[int, int]:
    """Scatter-reduce ``buf`` (1-D, contiguous, modified) so rank r holds the reduced block r.

    Returns ``(start, stop)`` of this rank's block in ``buf`` (already post-scaled).
    """
    size, rank = link.size, link.rank
    bounds = ring.offsets(counts)
    mine = bounds[rank]
    if size == 1:
        scale_inplace(buf[mine[0]:mine[1]], postscale)
        return mine
    sr = ring.scatter_reduce_steps(rank, size, ring.OWN_CHUNK_SHIFT)
    dst, src = ring.right(rank, size), ring.left(rank, size)
    last = size - 2
    for k, (a, b) in enumerate(_segs(bounds[sr[0].send_chunk], seg_elems)):
        link.send(dst, seq, _tag(0, k), buf[a:b])
    for s, step in enumerate(sr):
        for k, (a, b) in enumerate(_segs(bounds[step.recv_chunk], seg_elems)):
            seg = buf[a:b]
            reduce_into(op, seg, _view(link.recv(src, seq, _tag(s, k)), buf.dtype, b - a))
            if s < last:
                link.send(dst, seq, _tag(s + 1, k), seg)
    scale_inplace(buf[mine[0]:mine[1]], postscale)
    link.flush()
    return mine


#: Broadcasts up to this many bytes go straight from the root to every rank.
DIRECT_BROADCAST_BYTES = 256 * 1024


def broadcast(link: Link, buf: np.ndarray, root: int, seq: int, seg_elems: int) -> None:
    """Copy the root's ``buf`` into every rank's ``buf`` (1-D, contiguous).

    Small payloads go directly from the root (one hop); large ones flow down a
    pipelined chain root -> root+1 -> ... so the root sends the data only once.
    """
    size, rank = link.size, link.rank
    if size == 1 or buf.size == 0:
        return
    segs = ring.segments(0, buf.size, seg_elems)
    if buf.nbytes <= DIRECT_BROADCAST_BYTES:
        if rank == root:
            for dst in range(size):
                if dst != root:
                    for k, (a, b) in enumerate(segs):
                        link.send(dst, seq, k, buf[a:b])
        else:
            for k, (a, b) in enumerate(segs):
                buf[a:b] = _view(link.recv(root, seq, k), buf.dtype, b - a)
        link.flush()
        return
    pos = (rank - root) % size
    nxt = (rank + 1) % size if pos < size - 1 else None
    prev = (rank - 1) % size
    for k, (a, b) in enumerate(segs):
        seg = buf[a:b]
        if pos > 0:
            seg[...] = _view(link.recv(prev, seq, k), buf.dtype, b - a)
        if nxt is not None:
            link.send(nxt, seq, k, seg)
    link.flush()


def alltoall(
    link: Link,
    send: np.ndarray,
    send_counts: Sequence[int],
    out: np.ndarray,
    recv_counts: Sequence[int],
    seq: int,
    seg_elems: int,
) -> None:
    """Block j of ``send`` goes to rank j; block i of ``out`` comes from rank i (all 1-D)."""
    size, rank = link.size, link.rank
    sb, rb = ring.offsets(send_counts), ring.offsets(recv_counts)
    for off in range(1, size):
        dst = (rank + off) % size
        for k, (a, b) in enumerate(ring.segments(*sb[dst], seg_elems)):
            link.send(dst, seq, k, send[a:b])
    a, b = sb[rank]
    c, d = rb[rank]
    out[c:d] = send[a:b]
    for off in range(1, size):
        src = (rank - off) % size
        for k, (a, b) in enumerate(ring.segments(*rb[src], seg_elems)):
            out[a:b] = _view(link.recv(src, seq, k), out.dtype, b - a)
    link.flush()
