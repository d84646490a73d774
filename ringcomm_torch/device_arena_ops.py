"""The per-tensor CUDA ops that move through the host's shared device arenas
(:mod:`.device_arena`) instead of pinned host memory, each two agreements among the ranks and
device work queued on the side stream in between; no thread waits for the device.

An allreduce (:func:`allreduce`), for ``n`` ranks:

1. the caller's thread takes a range of its arena, queues the tensor's copy into it on the side
   stream, records *posted*, and submits the op's agreement: an allreduce of one row per rank
   (:mod:`.device_arena_rows`): its range's offset plus one, or 0 when it has no room, and the
   tensor's signature.  It returns at once;
2. on a return thread, once every rank has offered: if any offered none, every rank runs the op
   through pinned host memory instead (the same result; the caller's ``fallback``).  Otherwise
   the side stream waits for every peer's *posted* event (or, with ``RINGCOMM_DEVICE_IPC_WAIT=host``,
   the return thread does), sums this rank's shard of the tensor over every rank's range in rank
   order (so every rank gets the same bits; Horovod's prescale, postscale and Average as on the
   host), copies the sum into every rank's range, records *done*, and submits a second agreement:
   whether each rank queued its part.  In a job that spans hosts, each rank sums its shard over
   its own host's ranges only, and that shard alone goes to pinned memory: one allreduce of every
   rank sums each host's shards (:func:`_across_hosts`), the shard comes back to this rank's
   range, and from there to the host's other ranges on the device.  The device-to-host and
   host-to-device bytes fall by the host's number of ranks;
3. ``synchronize()`` waits for that agreement, makes the side stream wait for every peer's
   *done* (or waits for them itself, as above), copies the range into the result on the side
   stream, and makes the stream that consumes the result wait for that copy.  The range is free
   again at once: whatever writes into it next is queued on the same side stream, after those waits.

In a job on one host, a broadcast, an allgather and a reduce-scatter have the same two
agreements (:func:`_on_one_host`): the ranks whose data is read take ranges and copy their tensors
in; the others read them.  A broadcast's root alone takes a range; another rank's row holds 1 (it
can read the root's arena) or 0, and every row the root rank.  Each rank's side stream waits for
the *posted* of the ranks it reads, copies (the root's tensor; every rank's, into the output's
parts in rank order) or sums (its own block of every rank's tensor, in rank order) into its result,
and records *done*; ``synchronize()`` waits for the second agreement, then makes the side stream
wait for every *done* before this rank's range is taken again.  So DDP's forward, which waits for
its buffers' broadcast, does not wait for the GPU to finish the last step.

Both agreements are ordinary core ops named after the op, so a rank that submits something else
under that name (a host tensor, an integer dtype) fails the op on every rank with a
``MismatchError``, as a mismatch does on the pinned path.  The first agreement's row also carries
the tensor's dtype and shape: ranks that pass the same bytes in another shape or dtype fail it on
every rank alike.  A rank that has joined adds zeros to an agreement, which read as "no room": the
op takes the pinned path, where that rank adds zeros, as Horovod has it.  Stream waits capture an
event's latest record, and every record a wait refers to was queued before the wait (a peer's
*done* is waited for only once the second agreement says the peer recorded it), so no two side
streams can wait for each other.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

import ringcomm as _rc
from ringcomm import api as _core_api
from ringcomm.core.ops import Sum
from ringcomm.core.process_sets import global_process_set
from ringcomm.errors import MismatchError

from .device_arena import Arena
from .device_arena_rows import ROW, disagreement, root_disagreement, signature
from .device_ipc import (OnDevice, across_hosts, agree_done, partial_sum, shard_bounds, stage_dtype, sum_shard,
                         wait_for_peers)
from .handles import Handle

__all__ = ["allreduce", "broadcast", "allgather", "reduce_scatter"]


class _Range:
    """One op's range of this rank's arena, given back once (by whichever comes first)."""

    __slots__ = ("arena", "offset")

    def __init__(self, arena: Arena, offset: int) -> None:
        self.arena, self.offset = arena, offset

    def give(self) -> None:
        if self.offset >= 0:
            offset, self.offset = self.offset, -1
            self.arena.give(offset)


def allreduce(arena: Arena, t: torch.Tensor, *, in_place: bool, core_name: str, name: str | None, average: bool,
              prescale: float, postscale: float, fallback: Callable[[str], Handle],
              consumer: Any = None) -> Handle:
    """Start reducing ``t`` (see the module docstring) through ``arena``; ``fallback(core_name)`` starts the same op
    through pinned host memory and returns its handle.  ``consumer``: the stream that uses the
    result (default: the current one in ``synchronize()``).  Returns at once."""
    ops, svc = arena.ops, arena.service
    offset = arena.offer(t)
    held = _Range(arena, offset)
    side, _, agreement = _post(arena, t, offset, True, [], core_name)

    def reduce(raw: Any) -> Any:  # on a return thread, once every rank has offered
        rows = np.asarray(raw).reshape(arena.size, ROW)
        offsets = [int(v) - 1 for v in rows[:, 0]]  # a rank that has joined: -1
        if min(offsets) < 0:
            held.give()  # nobody reads it: the op goes through host memory on every rank
            return fallback(f"{core_name}.host")
        problem = disagreement(core_name, rows[:, 1:])  # alike on every rank: the same rows
        if problem:
            return MismatchError(problem)
        arena.opened_everywhere()
        if len(arena.local) < arena.size:
            return _across_hosts(arena, t, offsets, side, core_name, prescale, postscale, average)
        error = None
        t0 = time.perf_counter()
        try:
            wait_for_peers(ops, side, arena.posted, arena.rank)
            lo, hi = shard_bounds(t.numel(), arena.rank, arena.size)
            views = [arena.view(k, off, t) for k, off in enumerate(offsets)]
            sum_shard(ops, side, views, lo, hi, prescale, postscale, average)
            ops.record(arena.done[arena.rank], side)
        except Exception as exc:  # noqa: BLE001 - reported to every rank by the second agreement
            error = exc
        _span(ops, core_name, "IPC_REDUCE", t0)
        return agree_done(arena.rank, arena.size, f"{core_name}.done", error, global_process_set)

    returning = svc.then(agreement, reduce, core_name)

    def finish(result: Any) -> torch.Tensor:  # synchronize()
        if isinstance(result, Handle):
            return result.wait()
        if isinstance(result, MismatchError):
            raise result
        if not isinstance(result, OnDevice):  # across hosts: the hosts' allreduce comes first
            result = result.wait()
        result.check(core_name, arena.rank)
        t0 = time.perf_counter()
        wait_for_peers(ops, side, arena.done, arena.rank)
        target = t if in_place else torch.empty(t.shape, dtype=t.dtype, device=t.device)
        ops.copy(target, arena.view(arena.rank, held.offset, t).view(t.shape), side)
        copied = svc.mark()
        ops.stream_wait(svc.current() if consumer is None else consumer, copied)
        _span(ops, core_name, "MEMCPY_OUT_ARENA", t0, copied)
        return target

    return Handle("allreduce", name, returning, finish, held.give, t.numel() * t.element_size())


def broadcast(arena: Arena, t: torch.Tensor, *, root: int, in_place: bool, core_name: str, name: str | None,
              fallback: Callable[[str], Handle], consumer: Any = None) -> Handle:
    """Start copying rank ``root``'s ``t`` into every rank's result on the device (see the module
    docstring; every rank is on this host); ``fallback(core_name)`` starts the same op through
    pinned host memory and returns its handle.  ``consumer``: as for :func:`allreduce`.
    Returns at once."""
    mine = arena.rank == root
    target = t if in_place else torch.empty(t.shape, dtype=t.dtype, device=t.device)

    def check(rows: np.ndarray) -> str:
        return root_disagreement(core_name, rows[:, 1]) or disagreement(core_name, rows[:, 2:], "broadcast")

    def work(rows: np.ndarray, side: Any) -> None:
        if not mine:
            wait_for_peers(arena.ops, side, [ev if k == root else None for k, ev in enumerate(arena.posted)],
                           arena.rank)
        if not (mine and in_place):  # a root's own tensor in place is as it was
            arena.ops.copy(target, arena.view(root, int(rows[root, 0]) - 1, t).view(t.shape), side)

    return _on_one_host(arena, t, "broadcast", [root], core_name, name, mine, check, work, lambda: target,
                        "MEMCPY_OUT_ARENA", "copy the root's tensor", fallback, consumer)


def allgather(arena: Arena, t: torch.Tensor, parts: Sequence[torch.Tensor], *, core_name: str, name: str | None,
              fallback: Callable[[str], Handle], consumer: Any = None,
              copy_into: tuple[torch.Tensor, torch.Tensor] | None = None) -> Handle:
    """Start copying every rank's ``t`` (the same shape and dtype on every rank) into ``parts``,
    one tensor of ``t``'s size per rank in rank order, on the device (see the module docstring;
    every rank is on this host); ``synchronize()`` returns ``parts``.  ``copy_into``:
    ``(destination, source)``, a last copy (into an output that is not contiguous, from the tensor
    whose views ``parts`` are).  ``fallback`` and ``consumer``: as for :func:`broadcast`.  Returns at once."""

    def work(rows: np.ndarray, side: Any) -> None:
        wait_for_peers(arena.ops, side, arena.posted, arena.rank)
        for k, part in enumerate(parts):
            arena.ops.copy(part, arena.view(k, int(rows[k, 0]) - 1, t).view(part.shape), side)
        if copy_into is not None:
            arena.ops.copy(copy_into[0], copy_into[1].view(copy_into[0].shape), side)

    return _on_one_host(arena, t, "allgather", [], core_name, name, True,
                        lambda rows: disagreement(core_name, rows[:, 1:], "allgather"), work, lambda: parts,
                        "MEMCPY_OUT_ARENA", "copy the others' tensors", fallback, consumer)


def reduce_scatter(arena: Arena, t: torch.Tensor, out: torch.Tensor, *, average: bool, core_name: str,
                   name: str | None, fallback: Callable[[str], Handle], consumer: Any = None) -> Handle:
    """Start summing (``average``: and dividing by the ranks) every rank's ``t`` (the same shape
    and dtype on every rank, ``out.numel()`` elements per rank) and writing this rank's block of
    the sum (the ``rank``-th run of ``out.numel()`` elements of the flat tensor) into ``out``, on
    the device (see the module docstring; every rank is on this host); the terms are added in rank
    order, half-precision ones in float32.  ``fallback`` and ``consumer``: as for :func:`broadcast`.
    Returns at once."""
    m = out.numel()

    def work(rows: np.ndarray, side: Any) -> None:
        wait_for_peers(arena.ops, side, arena.posted, arena.rank)
        views = [arena.view(k, int(rows[k, 0]) - 1, t) for k in range(arena.size)]
        acc = partial_sum(arena.ops, side, views, arena.rank * m, (arena.rank + 1) * m, 1.0)
        if average:
            with arena.ops.on(side), torch.no_grad():
                acc.div_(arena.size)
        arena.ops.copy(out, acc.view(out.shape), side)

    return _on_one_host(arena, t, "reducescatter", [], core_name, name, True,
                        lambda rows: disagreement(core_name, rows[:, 1:], "reducescatter"), work, lambda: out,
                        "IPC_REDUCE", "sum their block", fallback, consumer)


def _on_one_host(arena: Arena, t: torch.Tensor, kind: str, head: list[int], core_name: str, name: str | None,
                 offers: bool, check: Callable[[np.ndarray], str], work: Callable[[np.ndarray, Any], None],
                 result: Callable[[], Any], phase: str, task: str, fallback: Callable[[str], Handle],
                 consumer: Any) -> Handle:
    """The two agreements of a ``kind`` op among one host's ranks (see the module docstring).
    ``offers``: whether this rank's ``t`` is read (it takes a range and copies ``t`` in); ``head``:
    what its row holds after the offset and before ``t``'s signature; ``check(rows)``: '' when the
    summed rows agree, else the op's failure (alike on every rank); ``work(rows, side)``: on a
    return thread, queue this rank's part on the side stream (the timeline's ``phase``); ``result()``:
    what ``synchronize()`` returns; ``task``: what a rank that failed could not do, for the error."""
    ops, svc = arena.ops, arena.service
    offset = arena.offer(t) if offers else (0 if arena.readable(t) else -1)
    if offset >= 0 and len(arena.local) < arena.size:  # a rank on another host cannot read this arena
        if offers:
            arena.give(offset)
        offset = -1
    held = _Range(arena, offset if offers else -1)
    side, width, agreement = _post(arena, t, offset, offers, head, core_name)

    def start(raw: Any) -> Any:  # on a return thread, once every rank has offered
        rows = np.asarray(raw).reshape(arena.size, width)
        if (rows[:, 0] <= 0).any():  # a rank has no room, or cannot read the arenas, or has joined
            held.give()
            return fallback(f"{core_name}.host")
        problem = check(rows)
        if problem:
            return MismatchError(problem)
        arena.opened_everywhere()
        error = None
        t0 = time.perf_counter()
        try:
            work(rows, side)
        except Exception as exc:  # noqa: BLE001 - reported to every rank by the second agreement
            error = exc
        ops.record(arena.done[arena.rank], side)  # the ranges read may be taken again after it
        _span(ops, core_name, phase, t0)
        return agree_done(arena.rank, arena.size, f"{core_name}.done", error, global_process_set)

    returning = svc.then(agreement, start, core_name)

    def finish(done: Any) -> Any:  # synchronize()
        if isinstance(done, Handle):
            return done.wait()
        if isinstance(done, MismatchError):
            raise done
        done.check(core_name, arena.rank, kind, task)  # every rank has recorded its *done* by now
        ops.stream_wait(svc.current() if consumer is None else consumer, svc.mark())
        if held.offset >= 0:  # every rank has read this range before anything is written into it again
            wait_for_peers(ops, side, arena.done, arena.rank)
        return result()

    return Handle(kind, name, returning, finish, held.give, t.numel() * t.element_size())


def _post(arena: Arena, t: torch.Tensor, offset: int, copies: bool, head: list[int],
          core_name: str) -> tuple[Any, int, Any]:
    """What every op of the arenas starts with: a side stream that follows ``t``'s producers (and
    a result's earlier readers), on which ``t`` is copied into this rank's range at ``offset``
    (when ``copies`` and it has one) and its *posted* event recorded; and the first agreement, a
    sum of the ranks' rows ``[offset + 1, *head, *signature(t)]`` (a rank that has joined adds
    zeros).  Returns ``(side stream, row width, the agreement's handle)``."""
    ops = arena.ops
    side = arena.service.after(arena.service.current())
    if copies and offset >= 0:
        t0 = time.perf_counter()
        ops.pack_parts([arena.view(arena.rank, offset, t).view(t.shape)], [t], side)
        ops.record(arena.posted[arena.rank], side)
        _span(ops, core_name, "MEMCPY_IN_ARENA", t0, arena.posted[arena.rank])
    width = ROW + len(head)
    row = np.zeros((arena.size, width), dtype=np.int64)
    row[arena.rank] = [offset + 1, *head, *signature(t)]
    return side, width, _rc.allreduce_async(row, op=Sum, name=core_name)


def _across_hosts(arena: Arena, t: torch.Tensor, offsets: list[int], side: Any, core_name: str, prescale: float,
                  postscale: float, average: bool) -> Any:
    """On a return thread, in a job that spans hosts: :func:`~.device_ipc.across_hosts` over this
    host's ranges, through a pinned buffer of the pool (returns at once)."""
    svc, local = arena.service, arena.local
    stage = stage_dtype(t.dtype)
    nbytes = t.numel() * torch.empty((), dtype=stage).element_size()
    buf = svc.pool.acquire(nbytes)
    me = local.index(arena.rank)
    lo, hi = shard_bounds(t.numel(), me, len(local))
    arena.staged_bytes += (hi - lo) * (nbytes // max(1, t.numel()))

    def prepare() -> list[torch.Tensor]:
        wait_for_peers(arena.ops, side, arena.posted, arena.rank)  # None for another host's ranks
        return [arena.view(k, offsets[k], t) for k in local]

    return across_hosts(svc, side, prepare, me, buf[:nbytes].view(stage), prescale, postscale, average, arena.rank,
                        arena.size, arena.done[arena.rank], core_name, global_process_set, lambda: svc.release(buf))


def _span(ops: Any, core_name: str, phase: str, start: float, event: Any = None) -> None:
    """With a timeline: ``phase`` on the op's row from ``start`` until now, after waiting for
    ``event`` (so that a copy's span is the copy itself, as the pinned path's are); else nothing."""
    if _core_api.timeline_active():
        if event is not None:
            ops.wait_event(event)
        _core_api.timeline_span(core_name, phase, start, time.perf_counter())
