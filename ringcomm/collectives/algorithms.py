"""Collective algorithms over a point-to-point link.  No sockets here.

Each function runs on every rank at once with the same arguments (apart from
the rank's own data) and talks only through ``link``:

- ``link.rank``, ``link.size``
- ``link.send(dst, seq, tag, arr)``: queue a 1-D contiguous array for ``dst``
  (may be zero-copy: the caller must not change ``arr`` until ``link.flush()``
  returns or the data provably arrived)
- ``link.recv(src, seq, tag) -> buffer``: the payload ``src`` sent with that tag
- ``link.recv_any(src, seq) -> (tag, buffer)``: the next payload of op ``seq`` from ``src``
- ``link.recv_first(wants) -> (i, tag, buffer)``: the next payload of any of several ops, ``wants``
  being ``(src, seq)`` pairs and ``i`` the index of the one it belongs to (several passes at once)
- ``link.flush()``: wait until every queued send has left this process
- ``link.reserve(dst, nbytes) -> uint8 array | None`` and ``link.commit(dst, seq, tag, view)``:
  write a payload straight into the outgoing buffer (shared memory) instead of sending a copy
- ``link.expect(src, seq, tag, view)`` (optional): where a payload goes, so that the link may read
  it straight there; ``recv`` then returns that memory, and the caller has nothing to copy

``seq`` numbers the op (the same on every rank) and ``tag`` numbers the message
within it, so messages that arrive early are kept until asked for.
The in-process tests run these functions over queues; the engine runs them
over ZeroMQ.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from ..core import ring
from ..core.lane import reduce_ordered
from ..errors import HorovodInternalError
from ..core.ops import ReduceOp, combine, reduce_into, scale_inplace


class Link(Protocol):
    rank: int
    size: int

    def send(self, dst: int, seq: int, tag: int, arr: np.ndarray) -> None: ...

    def recv(self, src: int, seq: int, tag: int) -> object: ...

    def recv_any(self, src: int, seq: int) -> tuple[int, object]: ...

    def recv_first(self, wants: Sequence[tuple[int, int]]) -> tuple[int, int, object]: ...

    def flush(self) -> None: ...

    def reserve(self, dst: int, nbytes: int) -> np.ndarray | None: ...

    def commit(self, dst: int, seq: int, tag: int, view: np.ndarray) -> None: ...

    # optional: ``queues_by_reference(dst, nbytes) -> bool``, whether a send of ``nbytes`` to ``dst``
    # queues the array itself (no copy, no slot), as a stream to another host does


def _tag(step: int, seg: int) -> int:
    return (step << 20) | seg


def _segs(bounds: tuple[int, int], seg_elems: int) -> list[tuple[int, int]]:
    return ring.segments(bounds[0], bounds[1], seg_elems)


class StreamError(HorovodInternalError):
    """A message of the wrong length arrived: the ranks' data streams are out of step."""


def _view(buf: object, dtype: np.dtype, n: int) -> np.ndarray:
    v = np.frombuffer(buf, dtype=dtype)  # type: ignore[call-overload]
    if v.size != n:
        raise StreamError(f"expected {n} elements of {dtype}, received {v.size}: data streams out of step")
    return v


#: How many first-step segments a rank sends before the first one arrives from its left
#: (afterwards one more per arrival), which bounds what is in flight on each link.
LOOKAHEAD = 2


def lookahead(link: object, dst: int, nbytes: int) -> int:
    """How many first-step segments of ``nbytes`` a pass sends to ``dst`` ahead of its arrivals: where
    the link queues a send by reference (a stream to another host), as many as fit in
    :data:`ringcomm.core.ring.STREAM_AHEAD_BYTES` (at least :data:`LOOKAHEAD`)."""
    by_reference = getattr(link, "queues_by_reference", None)
    if by_reference is not None and by_reference(dst, nbytes):
        return max(LOOKAHEAD, ring.STREAM_AHEAD_BYTES // max(1, nbytes))
    return LOOKAHEAD


_STEP_SHIFT = 20
_SEG_MASK = (1 << _STEP_SHIFT) - 1


def _expect(link: Link, seq: int, out: np.ndarray, segs: Sequence[list[tuple[int, int]]], steps: range) -> None:
    """Tell ``link`` where the segments of ring ``steps`` go in ``out``, if it can read them straight there.

    Only for steps whose region of ``out`` nothing reads or writes until its segment arrives: that
    region's earlier sends have left by then (the segment depends on them having arrived)."""
    expect = getattr(link, "expect", None)
    if expect is None:
        return
    src = ring.left(link.rank, link.size)
    for s in steps:
        for k, (a, b) in enumerate(segs[s]):
            expect(src, seq, _tag(s, k), out[a:b])


def _expect_each(link: Link, src: int, seq: int, buf: np.ndarray, segs: Sequence[tuple[int, int]]) -> None:
    """Tell ``link`` that segment ``k`` of op ``seq`` from ``src`` goes to ``buf[segs[k]]`` (a region nothing
    reads or writes until it arrives), if it can read it straight there."""
    expect = getattr(link, "expect", None)
    if expect is not None:
        for k, (a, b) in enumerate(segs):
            expect(src, seq, k, buf[a:b])


def _same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    return a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and a.nbytes == b.nbytes


class _Feeder:
    """Sends a step's segments lazily, paced by arrivals, so few are ever in flight."""

    def __init__(self, link: Link, dst: int, seq: int, step: int, src: np.ndarray, segs: list[tuple[int, int]]) -> None:
        self.link, self.dst, self.seq, self.step, self.src, self.segs = link, dst, seq, step, src, segs
        self.sent = 0
        #: how many segments it sends ahead of the arrivals from the left (:func:`lookahead`)
        self.ahead = lookahead(link, dst, (segs[0][1] - segs[0][0]) * src.itemsize) if segs else LOOKAHEAD

    def advance(self, upto: int) -> None:
        upto = min(upto, len(self.segs))
        while self.sent < upto:
            a, b = self.segs[self.sent]
            self.link.send(self.dst, self.seq, _tag(self.step, self.sent), self.src[a:b])
            self.sent += 1

    def finish(self) -> None:
        self.advance(len(self.segs))


class RingPass:
    """One ring pass of op ``seq`` over ``link`` as a state machine, so one thread can run several at once.

    ``start()`` queues the first segments; ``feed(tag, payload)`` handles one payload of op ``seq``
    from ``src`` (the left neighbour), in whatever order they arrive, and forwards it; ``done`` once
    every segment arrived; ``sent_all`` once every segment this rank sends in the pass is queued.
    ``recv_chunks[s]`` is the chunk received at ring step ``s``; ``on_segment(s, a, b, payload)``
    handles one segment; ``on_done()`` runs once, when the last one has been handled.  Handling
    segments in arrival order keeps every link drained, so shared-memory slots are handed back promptly.
    """

    def __init__(self, link: Link, seq: int, bounds: Sequence[tuple[int, int]], seg_elems: int,
                 recv_chunks: Sequence[int], first: _Feeder, on_segment: Callable[[int, int, int, object], None],
                 on_done: Callable[[], None] | None = None) -> None:
        self.link, self.seq = link, seq
        self.src = ring.left(link.rank, link.size)
        self.segs = [_segs(bounds[c], seg_elems) for c in recv_chunks]  #: the segments received at each step
        self._first, self._on_segment, self._on_done = first, on_segment, on_done
        self.remaining = sum(len(x) for x in self.segs)
        # arrivals that make this rank send something: every step's but the last's
        self._forwards = self.remaining - (len(self.segs[-1]) if self.segs else 0)
        self._first_expected = len(self.segs[0]) if self.segs else 0
        self._first_seen = 0
        self.started = self.done = False

    @property
    def sent_all(self) -> bool:
        return self.started and self._forwards == 0 and self._first.sent == len(self._first.segs)

    def start(self) -> None:
        self.started = True
        self._first.advance(self._first.ahead if self._first_expected else len(self._first.segs))
        if not self.remaining:
            self._finish()

    def feed(self, tag: int, payload: object) -> None:
        s, k = tag >> _STEP_SHIFT, tag & _SEG_MASK
        if self.done or s >= len(self.segs) or k >= len(self.segs[s]):
            raise StreamError(f"rank {self.link.rank}: op {self.seq} has no segment {k} of ring step {s} (tag {tag}) "
                              f"for rank {self.src} to send: data streams out of step")
        a, b = self.segs[s][k]
        self._on_segment(s, a, b, payload)
        self.remaining -= 1
        if s < len(self.segs) - 1:
            self._forwards -= 1
        if s == 0:
            self._first_seen += 1
            self._first.advance(self._first_seen + self._first.ahead if self._first_seen < self._first_expected
                                else len(self._first.segs))
        if not self.remaining:
            self._finish()

    def _finish(self) -> None:
        self._first.finish()
        self.done = True
        if self._on_done is not None:
            self._on_done()

    def run(self) -> None:
        """Run the pass alone, to the end, and wait until what it sent has left (``link.flush()``)."""
        self.start()
        while not self.done:
            self.feed(*self.link.recv_any(self.src, self.seq))
        self.link.flush()


def ring_allreduce(
    link: Link,
    buf: np.ndarray,
    op: ReduceOp,
    seq: int,
    seg_elems: int,
    postscale: float = 1.0,
    src_buf: np.ndarray | None = None,
    marks: list[float] | None = None,
) -> None:
    """Reduce ``buf`` (1-D, contiguous) across ranks in place; every rank ends with the result.

    With ``src_buf`` the input is read from there and ``buf`` is only written
    (no copy-in: each chunk is first touched when it is reduced or received).
    With ``marks`` (the timeline), the ``time.perf_counter()`` at which this
    rank finished reducing its own chunk (the end of its scatter-reduce) is
    appended to it.

    Pipelined by segment: a rank forwards each segment as soon as it has folded
    in its own contribution.  ``postscale`` is applied once per chunk, by the
    chunk's owner, before it is passed around.

        rank 0: [1, 2, 3]   rank 1: [10, 20, 30]   ->   both: [11, 22, 33]
    """
    inp = buf if src_buf is None else src_buf
    if link.size == 1 or buf.size == 0:
        if inp is not buf:
            buf[...] = inp
        scale_inplace(buf, postscale)
        return
    allreduce_pass(link, buf, op, seq, seg_elems, postscale, src_buf, marks).run()


def doubling_plan(rank: int, size: int) -> tuple[int | None, bool, list[int]]:
    """Who ``rank`` talks to in a recursive-doubling allreduce of ``size`` ranks: ``(fold, folds_in,
    partners)``.  With p the largest power of two <= size, ranks p.. first hand their data to rank - p
    (``fold``: that rank; ``folds_in``: False) and later receive the result from it; ranks below
    size - p take that data in (``fold``: rank + p; ``folds_in``: True); ranks below p then exchange
    with ``rank ^ 1``, ``rank ^ 2``, ... (``partners``: log2(p) of them).  No I/O.

        doubling_plan(0, 4) -> (None, False, [1, 2])    doubling_plan(4, 5) -> (0, False, [])
        doubling_plan(0, 5) -> (4, True, [1, 2])
    """
    p = 1 << (size.bit_length() - 1)
    if rank >= p:
        return rank - p, False, []
    partners, step = [], 1
    while step < p:
        partners.append(rank ^ step)
        step <<= 1
    return (rank + p, True, partners) if rank < size - p else (None, False, partners)


def doubling_allreduce(link: Link, buf: np.ndarray, op: ReduceOp, seq: int, seg_elems: int,
                       postscale: float = 1.0, src_buf: np.ndarray | None = None) -> None:
    """Reduce ``buf`` (1-D, contiguous) across ranks in place by recursive doubling (:func:`doubling_plan`):
    log2(size) exchanges of the whole buffer instead of the ring's 2(size - 1) steps of 1/size of it,
    so fewer waits for the network where a message's latency, not its bytes, is the cost.

    Every pair combines the lower rank's data first (``op(low, high)``), so both ends hold the same
    bits even where ``op`` tells equal values apart (min/max of -0.0 and 0.0): every rank ends with
    bitwise the same result.  ``postscale`` is applied once, at the end.

        rank 0: [1, 2]   rank 1: [10, 20]   rank 2: [100, 200]   ->   all: [111, 222]
    """
    if src_buf is not None and src_buf is not buf:
        buf[...] = src_buf
    size, rank = link.size, link.rank
    if size == 1 or buf.size == 0:
        scale_inplace(buf, postscale)
        return
    fold, folds_in, partners = doubling_plan(rank, size)
    segs = ring.segments(0, buf.size, seg_elems)

    def send_all(dst: int, step: int) -> None:
        for k, (a, b) in enumerate(segs):
            link.send(dst, seq, _tag(step, k), buf[a:b])

    def take(src: int, step: int, low_first: bool) -> None:
        for k, (a, b) in enumerate(segs):
            got = _view(link.recv(src, seq, _tag(step, k)), buf.dtype, b - a)
            mine = buf[a:b]
            # op(low, high) on both ends of the pair; numpy reads each element before writing it
            combine(op, mine, got, mine) if low_first else combine(op, got, mine, mine)

    if fold is not None and not folds_in:  # a rank past the power of two: hand over, get the result
        send_all(fold, 0)
        for k, (a, b) in enumerate(segs):
            buf[a:b] = _view(link.recv(fold, seq, _tag(_RESULT_STEP, k)), buf.dtype, b - a)
        link.flush()
        return
    if fold is not None:
        take(fold, 0, low_first=True)
    for i, partner in enumerate(partners, start=1):
        send_all(partner, i)
        link.flush()  # the send may read buf in place: it must have left before buf changes
        take(partner, i, low_first=rank < partner)
    scale_inplace(buf, postscale)
    if fold is not None:
        send_all(fold, _RESULT_STEP)
    link.flush()


#: The step number of the result a recursive-doubling allreduce hands back to a folded rank.
_RESULT_STEP = 63


def allreduce_pass(link: Link, buf: np.ndarray, op: ReduceOp, seq: int, seg_elems: int, postscale: float = 1.0,
                   src_buf: np.ndarray | None = None, marks: list[float] | None = None) -> RingPass:
    """:func:`ring_allreduce` as a :class:`RingPass`, not yet started (``link.size`` >= 2)."""
    size, rank = link.size, link.rank
    inp = buf if src_buf is None else src_buf
    bounds = ring.chunk_bounds(buf.size, size)
    sr = ring.scatter_reduce_steps(rank, size)
    ag = ring.allgather_steps(rank, size)
    dst = ring.right(rank, size)
    n_sr = size - 1
    own_left = [len(_segs(bounds[sr[-1].recv_chunk], seg_elems))]  # segments until the own chunk is done

    def on_segment(s: int, a: int, b: int, payload: object) -> None:
        seg = buf[a:b]
        incoming = _view(payload, buf.dtype, b - a)
        if s < n_sr - 1:  # scatter-reduce: own contribution + the partial sum, on to the right
            slot = link.reserve(dst, seg.nbytes)
            if slot is not None:  # the partial sum is only needed by the right neighbour: write it there
                combine(op, inp[a:b], incoming, slot.view(buf.dtype))
                link.commit(dst, seq, _tag(s + 1, k_of(a, s)), slot)
            else:
                combine(op, inp[a:b], incoming, seg)
                link.send(dst, seq, _tag(s + 1, k_of(a, s)), seg)
        elif s == n_sr - 1:  # the last contribution: this rank owns the finished chunk
            combine(op, inp[a:b], incoming, seg)
            scale_inplace(seg, postscale)
            link.send(dst, seq, _tag(s + 1, k_of(a, s)), seg)  # allgather step 0
            if marks is not None:
                own_left[0] -= 1
                if not own_left[0]:
                    marks.append(time.perf_counter())
        else:  # allgather: a finished segment (already in place if the link read it there)
            if not _same_memory(incoming, seg):
                seg[...] = incoming
            if s + 1 < 2 * n_sr:
                link.send(dst, seq, _tag(s + 1, k_of(a, s)), seg)

    recv_chunks = [st.recv_chunk for st in sr] + [st.recv_chunk for st in ag]

    def k_of(a: int, s: int) -> int:
        return (a - bounds[recv_chunks[s]][0]) // seg_elems

    first = _Feeder(link, dst, seq, 0, inp, _segs(bounds[sr[0].send_chunk], seg_elems))
    pass_ = RingPass(link, seq, bounds, seg_elems, recv_chunks, first, on_segment)
    _expect(link, seq, buf, pass_.segs, range(n_sr, 2 * n_sr))
    return pass_


def ring_allgatherv(link: Link, out: np.ndarray, counts: Sequence[int], seq: int, seg_elems: int) -> None:
    """Every rank's block of ``out`` (1-D; rank r's block has ``counts[r]`` elements, already
    filled in on rank r) ends up on every rank.

        rank 0: [a, _, _]   rank 1: [_, b, c]   (counts [1, 2])   ->   both: [a, b, c]
    """
    if link.size > 1:
        allgatherv_pass(link, out, counts, seq, seg_elems).run()


def allgatherv_pass(link: Link, out: np.ndarray, counts: Sequence[int], seq: int, seg_elems: int) -> RingPass:
    """:func:`ring_allgatherv` as a :class:`RingPass`, not yet started (``link.size`` >= 2)."""
    size, rank = link.size, link.rank
    bounds = ring.offsets(counts)
    steps = ring.allgather_steps(rank, size, ring.OWN_CHUNK_SHIFT)
    dst = ring.right(rank, size)
    recv_chunks = [st.recv_chunk for st in steps]

    def on_segment(s: int, a: int, b: int, payload: object) -> None:
        seg = out[a:b]
        incoming = _view(payload, out.dtype, b - a)
        if not _same_memory(incoming, seg):  # already in place if the link read it there
            seg[...] = incoming
        if s + 1 < len(steps):
            link.send(dst, seq, _tag(s + 1, (a - bounds[recv_chunks[s]][0]) // seg_elems), seg)

    first = _Feeder(link, dst, seq, 0, out, _segs(bounds[steps[0].send_chunk], seg_elems))
    pass_ = RingPass(link, seq, bounds, seg_elems, recv_chunks, first, on_segment)
    _expect(link, seq, out, pass_.segs, range(len(steps)))
    return pass_


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
    mine = ring.offsets(counts)[link.rank]
    if link.size == 1:
        scale_inplace(buf[mine[0]:mine[1]], postscale)
        return mine
    reducescatter_pass(link, buf, counts, op, seq, seg_elems, postscale).run()
    return mine


def direct_reducescatter(link: Link, inp: np.ndarray, counts: Sequence[int], op: ReduceOp, seq: int,
                         seg_elems: int, prescale: float = 1.0, postscale: float = 1.0) -> np.ndarray:
    """Reduce-scatter ``inp`` (1-D, contiguous, read only): this rank sends rank j its block j
    (``ring.offsets(counts)``), then reduces its own block over every rank's in rank order, segment
    by segment as they arrive, with :func:`~ringcomm.core.lane.reduce_ordered`'s arithmetic (so the
    lane's reducescatter gives the same bits).  Returns this rank's block, a new array."""
    size, rank = link.size, link.rank
    bounds = ring.offsets(counts)
    for off in range(1, size):
        dst = (rank + off) % size
        for k, (a, b) in enumerate(ring.segments(*bounds[dst], seg_elems)):
            link.send(dst, seq, k, inp[a:b])
    lo, hi = bounds[rank]
    out = np.empty(hi - lo, dtype=inp.dtype)
    for k, (a, b) in enumerate(ring.segments(lo, hi, seg_elems)):
        parts = [inp[a:b] if src == rank else _view(link.recv(src, seq, k), inp.dtype, b - a) for src in range(size)]
        reduce_ordered(op, parts, prescale, postscale, out[a - lo:b - lo])
    link.flush()
    return out


def reducescatter_pass(link: Link, buf: np.ndarray, counts: Sequence[int], op: ReduceOp, seq: int, seg_elems: int,
                       postscale: float = 1.0, src_buf: np.ndarray | None = None) -> RingPass:
    """:func:`ring_reducescatter` as a :class:`RingPass`, not yet started (``link.size`` >= 2); this
    rank's block is ``ring.offsets(counts)[link.rank]``.  With ``src_buf`` the input is read from
    there and only the blocks this rank receives are written in ``buf`` (no copy-in)."""
    size, rank = link.size, link.rank
    inp = buf if src_buf is None else src_buf
    bounds = ring.offsets(counts)
    mine = bounds[rank]
    sr = ring.scatter_reduce_steps(rank, size, ring.OWN_CHUNK_SHIFT)
    dst = ring.right(rank, size)
    recv_chunks = [st.recv_chunk for st in sr]

    def on_segment(s: int, a: int, b: int, payload: object) -> None:
        seg = buf[a:b]
        incoming = _view(payload, buf.dtype, b - a)
        if inp is buf:
            reduce_into(op, seg, incoming)
        else:
            combine(op, inp[a:b], incoming, seg)
        if s + 1 < len(sr):
            link.send(dst, seq, _tag(s + 1, (a - bounds[recv_chunks[s]][0]) // seg_elems), seg)

    first = _Feeder(link, dst, seq, 0, inp, _segs(bounds[sr[0].send_chunk], seg_elems))
    return RingPass(link, seq, bounds, seg_elems, recv_chunks, first, on_segment,
                    lambda: scale_inplace(buf[mine[0]:mine[1]], postscale))


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
            _expect_each(link, root, seq, buf, segs)
            for k, (a, b) in enumerate(segs):
                seg = buf[a:b]
                incoming = _view(link.recv(root, seq, k), buf.dtype, b - a)
                if not _same_memory(incoming, seg):
                    seg[...] = incoming
        link.flush()
        return
    pos = (rank - root) % size
    nxt = (rank + 1) % size if pos < size - 1 else None
    prev = (rank - 1) % size
    if pos > 0:
        _expect_each(link, prev, seq, buf, segs)
    for k, (a, b) in enumerate(segs):
        seg = buf[a:b]
        if pos > 0:
            incoming = _view(link.recv(prev, seq, k), buf.dtype, b - a)
            if not _same_memory(incoming, seg):  # already in place if the link read it there
                seg[...] = incoming
        if nxt is not None:
            link.send(nxt, seq, k, seg)
    link.flush()


def alltoall(link: Link, sends: Sequence[np.ndarray], outs: Sequence[np.ndarray], seq: int,
                    seg_elems: int) -> None:
    """``sends[j]`` goes to rank j; ``outs[i]`` receives what rank i sends here (1-D arrays, one
    per rank, in rank order).  Where the link can read a segment straight into its place in
    ``outs[i]``, it does."""
    size, rank = link.size, link.rank
    for off in range(1, size):
        src = (rank - off) % size
        _expect_each(link, src, seq, outs[src], ring.segments(0, outs[src].size, seg_elems))
    for off in range(1, size):
        dst = (rank + off) % size
        send = sends[dst]
        for k, (a, b) in enumerate(ring.segments(0, send.size, seg_elems)):
            link.send(dst, seq, k, send[a:b])
    outs[rank][...] = sends[rank]
    for off in range(1, size):
        src = (rank - off) % size
        out = outs[src]
        for k, (a, b) in enumerate(ring.segments(0, out.size, seg_elems)):
            incoming = _view(link.recv(src, seq, k), out.dtype, b - a)
            if not _same_memory(incoming, out[a:b]):  # already in place if the link read it there
                out[a:b] = incoming
    link.flush()


class SubLink:
    """The link of a process set: ranks ``0..len(ranks)-1`` of the set over the job's own link.

    Ring neighbours are neighbours within the set; every message travels over
    the parent link's existing pairwise connection between the two global
    ranks, so a set needs no sockets of its own.  What each member sees (set
    ranks ``[1, 3]`` of a 4-rank job)::

        global rank 1: SubLink(link, (1, 3)).rank == 0, .size == 2; send(1, ...) goes to global rank 3
        global rank 3: SubLink(link, (1, 3)).rank == 1
    """

    def __init__(self, parent: Link, ranks: Sequence[int]) -> None:
        self.parent = parent
        self.ranks = tuple(ranks)
        self.rank = self.ranks.index(parent.rank)
        self.size = len(self.ranks)

    def send(self, dst: int, seq: int, tag: int, arr: np.ndarray) -> None:
        self.parent.send(self.ranks[dst], seq, tag, arr)

    def recv(self, src: int, seq: int, tag: int) -> object:
        return self.parent.recv(self.ranks[src], seq, tag)

    def recv_any(self, src: int, seq: int) -> tuple[int, object]:
        return self.parent.recv_any(self.ranks[src], seq)

    def recv_first(self, wants: Sequence[tuple[int, int]]) -> tuple[int, int, object]:
        return self.parent.recv_first([(self.ranks[src], seq) for src, seq in wants])

    def expect(self, src: int, seq: int, tag: int, view: np.ndarray) -> None:
        expect = getattr(self.parent, "expect", None)
        if expect is not None:
            expect(self.ranks[src], seq, tag, view)

    def flush(self) -> None:
        self.parent.flush()

    def queues_by_reference(self, dst: int, nbytes: int) -> bool:
        by_reference = getattr(self.parent, "queues_by_reference", None)
        return by_reference is not None and by_reference(self.ranks[dst], nbytes)

    def reserve(self, dst: int, nbytes: int) -> np.ndarray | None:
        reserve = getattr(self.parent, "reserve", None)
        return None if reserve is None else reserve(self.ranks[dst], nbytes)

    def commit(self, dst: int, seq: int, tag: int, view: np.ndarray) -> None:
        self.parent.commit(self.ranks[dst], seq, tag, view)
