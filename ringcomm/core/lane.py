"""The small-op lane's decisions and arithmetic, with no I/O.

On one host, every op of the global process set a rank submits takes the
next index of that rank's lane (its k-th op: index k), and the rank posts it
in a slot: the op's key (a hash of what must agree across ranks), whether
the rank wants it *fast*, and for a fast op its payload.  Index k then
resolves the same way on every rank, from the slots alone:

- every rank's slot at k is fast with the same key: **fast**.  Each rank
  computes the result itself from the posted payloads, in rank order (so
  every rank holds bitwise the same result, and the same as rank 0's small
  path: :func:`reduce_ordered`); no message, no rank 0, no engine thread;
- some slot at k is not fast, or has another key, or a rank that will never
  post again (joined, shut down) has not posted k: **divert**.  Each rank
  hands its own k-th op to the engine, whose rank-0 negotiation matches ops
  by name in any order (and raises the mismatch errors);
- otherwise (a rank has not posted k yet): **wait**.

A divert is decided by one slot, so ranks may decide it early; a fast
index needs every slot.  Whether a rank wants an op fast is its own choice
(:func:`eligible`): ranks that choose differently only divert.

    >>> decide(7, [Seen(True, False, True, 7, 16), Seen(True, False, True, 7, 16)])
    'fast'
    >>> decide(7, [Seen(True, False, True, 7, 16), Seen(False, False, False, 0, 0)])
    'wait'
    >>> decide(7, [Seen(True, False, True, 7, 16), Seen(True, False, False, 7, 0)])
    'divert'
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np

from . import ops, ring, routing, wire
from ..errors import MismatchError
from .coordinator import unmet_receipts
from .ops import ReduceOp

#: Collectives the lane can finish from posted payloads.
FAST_KINDS = routing.LANE_KINDS

FAST, WAIT, DIVERT = "fast", "wait", "divert"

#: The type of an alltoall's splits at the head of its payload (:func:`payload`).
_SPLIT = np.dtype("<i8")
_BYTES = np.dtype(np.uint8)


class Seen(NamedTuple):
    """What a rank reads of one rank's lane at one index."""

    posted: bool  # the rank has posted this index
    off: bool  # the rank posts no more (joined or shut down)
    fast: bool  # its slot asks for the op to go fast
    key: int  # its slot's op key
    nbytes: int  # its payload's length


_SIGNATURES: dict[tuple[Any, ...], int] = {}
_KEYS: dict[wire.Request, int] = {}  # a training loop submits the same requests every step
_HEADS: dict[Any, np.ndarray] = {}  # an alltoall's head as it posts it, per splits and received_splits


def head_bytes(size: int) -> int:
    """The bytes an alltoall's head takes ahead of its rows in a job of ``size`` ranks (its splits
    and received splits, :func:`payload`): what the lane's entries hold beyond a payload bound."""
    return 2 * _SPLIT.itemsize * size


def op_key(req: wire.Request) -> int:
    """A 63-bit hash of what every rank's op at one index must share to run fast.

    Everything of the request but what may differ between ranks (an allgather's or an
    alltoall's first dimension, an alltoall's splits: each rank posts its splits with its
    rows; a broadcast's non-root buffers are the root's shape anyway).
    The name's part is a CRC and the rest's a cached BLAKE2b: both the same in
    every process (Python's ``hash`` of a string is not).

        op_key(Request("x", "allreduce", "float32", ((4,),))) == op_key(the same on another rank)
    """
    key = _KEYS.get(req)
    if key is not None:
        return key
    shapes: Any = req.shapes
    if req.kind == wire.ALLGATHER or req.kind == wire.ALLTOALL:
        shapes = tuple(s[1:] for s in req.shapes)
    sig = (req.kind, req.dtype, shapes, req.op, req.root, req.prescale, req.postscale)
    h = _SIGNATURES.get(sig)
    if h is None:
        if len(_SIGNATURES) > 4096:
            _SIGNATURES.clear()
        h = _SIGNATURES[sig] = int.from_bytes(hashlib.blake2b(repr(sig).encode(), digest_size=8).digest(), "little")
    key = (h ^ (zlib.crc32(req.name.encode()) << 29) ^ len(req.name)) >> 1
    if len(_KEYS) > 4096:
        _KEYS.clear()
    _KEYS[req] = key
    return key


def payload_nbytes(req: wire.Request, arrays: Sequence[np.ndarray], rank: int) -> int:
    """What this rank posts for a fast op (:func:`payload`): its buffers (a broadcast: the root's
    only; a barrier: nothing; an alltoall: its head first)."""
    return 0 if _posts_nothing(req, rank) else _posted_nbytes(req, arrays)


def _posts_nothing(req: wire.Request, rank: int) -> bool:
    return req.kind == wire.BARRIER or (req.kind == wire.BROADCAST and rank != req.root)


def _posted_nbytes(req: wire.Request, arrays: Sequence[np.ndarray]) -> int:
    """``arrays``' bytes, with an alltoall's head (:func:`payload`)."""
    nbytes = int(arrays[0].nbytes) if len(arrays) == 1 else sum(int(a.nbytes) for a in arrays)
    if req.kind == wire.ALLTOALL:
        nbytes += head_bytes(len(req.splits or ()))
    return nbytes


def payload(req: wire.Request, arrays: Sequence[np.ndarray]) -> Sequence[np.ndarray]:
    """What this rank posts for fast op ``req``, in order: its arrays; an alltoall's head first:
    its splits (one 64-bit count of rows per rank), so that each rank finds its block of every
    rank's rows whatever the others' splits, then the rows it expects from each rank (its
    ``received_splits``; -1 each where it did not say), which every rank checks (:func:`finish`).

        payload(Request("x", "alltoall", "float32", ((3,),), splits=(1, 2)), [a]) -> [[1, 2, -1, -1], a]
    """
    if req.kind != wire.ALLTOALL:
        return arrays
    key = (req.splits, req.received_splits)
    head = _HEADS.get(key)
    if head is None:
        if len(_HEADS) > 4096:
            _HEADS.clear()
        splits = req.splits or ()
        received = req.received_splits if req.received_splits is not None else (-1,) * len(splits)
        head = _HEADS[key] = np.asarray((*splits, *received), dtype=_SPLIT)
    return [head, *arrays]


def posted_dtype(req: wire.Request) -> np.dtype:
    """The dtype :func:`finish` reads ``req``'s posted payloads as: its own (:func:`dtype_of`), but
    bytes for an alltoall, whose payload starts with its head."""
    return _BYTES if req.kind == wire.ALLTOALL else dtype_of(req)


def eligible(req: wire.Request, arrays: Sequence[np.ndarray], rank: int, max_bytes: int,
             move_bytes: int = -1) -> bool:
    """Whether this rank asks for ``req`` to go fast (its own view; the others may differ)."""
    return fast_nbytes(req, arrays, rank, max_bytes, move_bytes) >= 0


def fast_nbytes(req: wire.Request, arrays: Sequence[np.ndarray], rank: int, max_bytes: int,
                move_bytes: int = -1) -> int:
    """What this rank posts if it asks to post fast for ``req`` (:func:`payload_nbytes`), or -1
    when it does not (:func:`eligible`; the rule is :func:`routing.route`'s, with ``max_bytes`` the
    bound, and ``move_bytes`` that of a broadcast, allgather or alltoall; -1: ``max_bytes``)."""
    kind = req.kind
    nbytes = _posted_nbytes(req, arrays)
    facts = routing.PathFacts(routing.Where.LANE, req.pset, req.op, bool(req.refused),
                              kind == wire.ALLGATHER and any(0 in s[1:] for s in req.shapes))
    limits = routing.RouteLimits(lane_bytes=max_bytes, lane_move_bytes=move_bytes)
    if routing.route(kind, nbytes, facts, limits) is not routing.Path.LANE:
        return -1
    return 0 if _posts_nothing(req, rank) else nbytes


def decide(key: int, seen: Sequence[Seen]) -> str:
    """How one index resolves, from every rank's slot there (this rank's included, with ``key``)."""
    waiting = False
    for s in seen:
        if s.posted:
            if not s.fast or s.key != key:
                return DIVERT
        elif s.off:
            return DIVERT
        else:
            waiting = True
    return WAIT if waiting else FAST


def reached(count: int, index: int) -> bool:
    """Whether a 32-bit post counter ``count`` shows index ``index`` posted (counters wrap at 2**32).

        reached(5, 4) -> True    reached(4, 4) -> False    reached(0, 2**32 - 1) -> True
    """
    return (count - (index + 1)) & 0xFFFFFFFF < 0x80000000


def first_unread(index: int, reads: Sequence[int], posts: Sequence[int], offs: Sequence[int]) -> int:
    """The first index at or after ``index`` that some rank may still read (``index`` itself when
    one may read it), from each rank's 32-bit counters: ``reads[r]`` (it has finished every index
    below it), ``posts[r]`` and whether it is off (``offs[r]``).  Every rank has finished every index
    below the answer, so the slots of those indices may be written again.

    A rank that is off (it has joined, stopped or closed) posts no more, and it reads only indices
    it posted itself, so an index at or past its last post is one it never reads: without this,
    the ranks still working would wait forever for a slot after ``slots`` more posts.

        first_unread(4, [6, 5], [6, 5], [0, 0]) -> 5
        first_unread(4, [3, 9], [5, 9], [0, 0]) -> 4       (rank 0 has not finished index 3)
        first_unread(7, [9, 3], [9, 3], [0, 1]) -> 9       (rank 1 went off after index 2)
    """
    lo = 0x80000000
    for r in range(len(reads)):
        ahead = (reads[r] - index) & 0xFFFFFFFF  # a rank that finished index is ahead by >= 1
        if ahead == 0 or ahead >= 0x80000000:
            if offs[r] and not reached(posts[r], index):  # off read first: then the post count is final
                continue  # it never posted index, and never will: it never reads it
            return index
        lo = min(lo, ahead)
    return index + lo


def still_missing(ranks: Sequence[int], matched: Sequence[int | None]) -> list[int] | None:
    """Those of ``ranks`` that have not posted an index yet, from each one's ``matched`` state at it
    (-1: not posted yet; None: posted something else, or went off; else its fast payload size); None
    as soon as one is None (the index is decided without waiting more)."""
    left = []
    for r, got in zip(ranks, matched):
        if got is None:
            return None
        if got < 0:
            left.append(r)
    return left


# -- the region a lane is driven over -----------------------------------------


@runtime_checkable
class LaneRegion(Protocol):
    """What the lane's driver (:mod:`ringcomm.lane.driver`) reads and writes: every rank's post
    counter, finished-reading counter and off flag, and its slots, one per index modulo ``slots``.

    A rank writes only its own counters and slots and reads everyone's.  Implemented by a shared
    file on one host (``ShmLane``), by TCP between hosts (``NetLane``) and by plain memory for
    ranks that are threads of one process (``MemoryLane``)."""

    #: True where a peer's post lands in this process's memory (re-reading a counter sees it at once).
    SPIN: bool
    rank: int
    size: int
    #: Slots per rank: index k lives in slot k % slots, rewritten once every rank has read index k.
    slots: int

    def posted(self, rank: int) -> int:
        """``rank``'s post counter (32 bits, wrapping): the indices it has posted."""
        ...

    def off(self, rank: int) -> bool:
        """Whether ``rank`` posts no more (joined or shut down)."""
        ...

    def seen(self, rank: int, index: int) -> Seen:
        """What ``rank``'s slot holds for ``index``."""
        ...

    def key_at(self, rank: int, index: int) -> int | None:
        """The key ``rank`` posted at ``index``; None if not posted yet or its slot was rewritten."""
        ...

    def fast_sizes(self, index: int, key: int, own_nbytes: int) -> list[int] | None:
        """Every rank's payload length at ``index`` once every peer posted it fast with ``key``, else None."""
        ...

    def still_missing(self, ranks: list[int], index: int, key: int) -> list[int] | None:
        """Those of ``ranks`` that have not posted ``index``; None once one posted something else or went off."""
        ...

    def typed_parts(self, index: int, sizes: Sequence[int], dtype: np.dtype) -> list[np.ndarray]:
        """Every rank's payload at ``index`` as arrays of ``dtype``, in rank order (valid until rewritten)."""
        ...

    def all_read_below(self, index: int) -> int:
        """The first index at or after ``index`` that some rank has not finished reading."""
        ...

    def set_read_below(self, count: int) -> None:
        """This rank has finished reading every index below ``count``."""
        ...

    def post(self, index: int, key: int, fast: bool, payload: Sequence[np.ndarray]) -> None:
        """Write this rank's slot for ``index`` (the arrays, concatenated) and publish it."""
        ...

    def set_off(self) -> None:
        """This rank posts no more: wake whoever waits on it, so they divert."""
        ...

    def reset(self) -> None:
        """Start this rank again from index 0 (only while no rank reads its counters)."""
        ...

    def unlink(self) -> None:
        """Remove the region's name once every rank has it (where it has one)."""
        ...

    def close(self) -> None:
        """Release the region (nothing reads it any more)."""
        ...

    def sleep_on_posted(self, rank: int, seen: int, timeout: Any) -> bool:
        """Sleep while ``rank``'s post counter holds ``seen`` and it is not off, ``timeout`` at most: a
        ``ringcomm.shm.futex.Timespec`` (``tv_sec``, ``tv_nsec``), made once by the driver, as the futex
        takes it (a type of the shared-memory layer, which the core does not import)."""
        ...


# -- results -----------------------------------------------------------------

_DTYPES: dict[str, np.dtype] = {}
_REDUCE_OPS = {int(op): op for op in ReduceOp}


def reduce_ordered(op: ReduceOp, contribs: Sequence[np.ndarray], prescale: float, post_factor: float,
                   out: np.ndarray | None = None) -> np.ndarray:
    """``contribs`` (one flat array per rank, in rank order) reduced left to right, each prescaled
    first and the result postscaled: the arithmetic of rank 0's small path, so both paths agree bitwise.
    ``out`` (flat, of the contributions' dtype and length, aliasing none of them) receives it.

        reduce_ordered(Sum, [a([1., 2.]), a([3., 4.])], 1.0, 1.0) -> [4., 6.]
    """
    acc: np.ndarray | None = None
    if prescale == 1.0 and len(contribs) > 1:  # (c0 op c1) written straight out: the same values
        acc = np.empty_like(contribs[0]) if out is None else out
        ops.combine(op, contribs[0], contribs[1], acc)
        for contrib in contribs[2:]:
            ops.reduce_into(op, acc, contrib)
        ops.scale_inplace(acc, post_factor)
        return acc
    for contrib in contribs:
        if prescale != 1.0:
            contrib = contrib.copy()
            ops.scale_inplace(contrib, prescale)
        if acc is None:
            acc = contrib.copy()
        else:
            ops.reduce_into(op, acc, contrib)
    assert acc is not None, "reduce_ordered needs at least one contribution"
    ops.scale_inplace(acc, post_factor)
    if out is not None:
        out[...] = acc
        return out
    return acc


def split_out(flat: np.ndarray, arrays: Sequence[np.ndarray], outs: Sequence[np.ndarray | None],
              grouped: bool) -> Any:
    """The reduced ``flat`` buffer as the op's result: one array per input (into ``outs`` where given)."""
    results, pos = [], 0
    for i, a in enumerate(arrays):
        given = outs[i] if i < len(outs) else None
        part = flat[pos:pos + a.size].reshape(a.shape)
        pos += a.size
        if given is not None:
            given[...] = part
            part = given
        results.append(part)
    return results if grouped else results[0]


def dtype_of(req: wire.Request) -> np.dtype:
    """``req``'s dtype (cached: one lookup per op)."""
    return _DTYPES.get(req.dtype) or _DTYPES.setdefault(req.dtype, np.dtype(req.dtype))


def finish(req: wire.Request, arrays: Sequence[np.ndarray], outs: Sequence[np.ndarray | None], grouped: bool,
           parts: Sequence[np.ndarray], size: int, *, rank: int) -> Any:
    """The result of fast op ``req`` on ``rank`` (of ``size``), from ``parts``: every rank's posted
    payload, flat, viewed as :func:`posted_dtype`, in rank order.
    ``arrays``/``outs``/``grouped`` are this rank's submission.  No result aliases a part (they are
    views of the lane's slots).  An alltoall's rows are every rank's block for this rank, in rank
    order, with how many rows came from each rank (each rank's part starts with its splits:
    :func:`payload`).  A reducescatter's block is this rank's rows of the first
    dimension as the engine splits them (:func:`ring.split_sizes`), reduced over the ranks in rank
    order as an allreduce is.
    """
    kind = req.kind
    if kind == wire.BARRIER:
        return None
    if kind == wire.ALLREDUCE:
        op = _REDUCE_OPS[req.op]
        post = ops.postscale(op, size, req.postscale)
        given = outs[0] if not grouped and outs else None
        if given is not None and given.flags.c_contiguous:  # reduced straight into the caller's buffer
            reduce_ordered(op, parts, req.prescale, post, given if given.ndim == 1 else given.reshape(-1))
            return given
        return split_out(reduce_ordered(op, parts, req.prescale, post), arrays, outs, grouped)
    if kind == wire.ALLTOALL:
        return _alltoall(req, arrays[0], outs, parts, size, rank)
    (arr,) = arrays
    if kind == wire.BROADCAST:
        out = outs[0] if outs and outs[0] is not None else None
        src = parts[req.root].reshape(arr.shape)
        if out is None:
            return src.copy()
        if out is not src:
            np.copyto(out, src)
        return out
    if kind == wire.ALLGATHER:
        rest = arr.shape[1:]
        row = int(np.prod(rest, dtype=np.int64))
        out = ops.result_array(outs[0] if outs else None, (sum(p.size for p in parts) // row, *rest), parts[0].dtype)
        np.concatenate(parts, out=out.reshape(-1))
        return out
    if kind == wire.REDUCESCATTER:
        rest = arr.shape[1:]
        row = int(np.prod(rest, dtype=np.int64))
        rows = ring.split_sizes(arr.shape[0], size)
        lo = sum(rows[:rank]) * row
        hi = lo + rows[rank] * row
        op = _REDUCE_OPS[req.op]
        block = reduce_ordered(op, [p[lo:hi] for p in parts], req.prescale, ops.postscale(op, size, req.postscale))
        return block.reshape(rows[rank], *rest)
    raise ValueError(f"the lane cannot finish {kind!r} fast")  # pragma: no cover - eligible() keeps them out


def _alltoall(req: wire.Request, arr: np.ndarray, outs: Sequence[np.ndarray | None], parts: Sequence[np.ndarray],
              size: int, rank: int) -> tuple[Any, np.ndarray]:
    """This rank's rows of a fast alltoall, and how many came from each rank, from every rank's
    posted bytes (its head, then its rows: :func:`payload`): into ``outs``, one output per rank
    (:func:`ops.per_rank`), each taking that rank's rows; else into the caller's one ``out``,
    where they fit it (:func:`ops.result_array`).  Raises :class:`MismatchError` on every rank
    when a rank expects other rows than the ranks send it (:func:`coordinator.unmet_receipts`)."""
    head = head_bytes(size)
    dtype = dtype_of(req)
    row = int(np.prod(arr.shape[1:], dtype=np.int64)) * dtype.itemsize  # bytes per row
    heads = [p[:head].view(_SPLIT) for p in parts]
    if any(h[size] >= 0 for h in heads):  # a rank said what it expects: every rank checks the same
        splits = [h[:size].tolist() for h in heads]
        expected = [h[size:].tolist() if h[size] >= 0 else None for h in heads]
        why = unmet_receipts(req.name, "", splits, expected, range(size))
        if why:
            raise MismatchError(f"{why} [raised on rank {rank}]")
    blocks, got = [], []
    for p, h in zip(parts, heads):
        n = int(h[rank])
        lo = head + int(h[:rank].sum()) * row
        got.append(n)
        blocks.append(p[lo:lo + n * row])
    counts = np.array(got, dtype=np.int64)
    if ops.per_rank(outs, size):
        for o, b in zip(outs, blocks):
            assert o is not None
            o.reshape(-1).view(_BYTES)[...] = b
        return list(outs), counts
    out = ops.result_array(outs[0] if outs else None, (sum(got), *arr.shape[1:]), dtype)
    np.concatenate(blocks, out=out.reshape(-1).view(_BYTES))
    return out, counts
