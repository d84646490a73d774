"""Per-tensor CUDA allreduces (``hvd.allreduce`` and its async and in-place forms, SyncBatchNorm's
backward sums, the ``"ringcomm"`` backend's) of at least ``RINGCOMM_DEVICE_IPC_MIN_BYTES``, reduced on the device among each host's ranks through CUDA IPC, as
:mod:`.device_ipc` reduces the optimizer's buckets, instead of through pinned host memory; and
per-tensor CUDA broadcasts of that size in a job on one host (``hvd.broadcast``, the backend's,
so DDP's buffers each forward), copied from the root's arena on the device.

Each rank has one shared device buffer, its *arena* (``RINGCOMM_DEVICE_IPC_ARENA_BYTES``), and two
interprocess events (*posted*, *done*).  At the first CUDA allreduce that may take this path the
ranks share them without waiting: one allreduce of a row per rank holding its pickled handles,
which a return thread opens.  A rank offers ranges once it has opened every peer's arena.  Until
then, and whenever a tensor does not fit in what is free, it offers none.  Each op, for ``n`` ranks:

1. the caller's thread takes a range of its arena (:class:`Slots`), queues the tensor's copy into
   it on the side stream, records *posted*, and submits the op's agreement: an allreduce of one
   row per rank: its range's offset plus one, or 0 when it has no room, and the tensor's
   signature.  It returns at once;
2. on a return thread, once every rank has offered: if any offered none, every rank reduces the op
   through pinned host memory instead (the same result; the caller's ``fallback``).  Otherwise
   the side stream waits for every peer's *posted* event (or, with ``RINGCOMM_DEVICE_IPC_WAIT=host``,
   the return thread does), sums this rank's shard of the tensor
   over every rank's range in rank order (so every rank gets the same bits; Horovod's prescale,
   postscale and Average as on the host), copies the sum into every rank's range, records
   *done*, and submits a second agreement: whether each rank queued its shard;
   In a job that spans hosts, each rank sums its shard over its own host's ranges only, and
   that shard alone goes to pinned memory: one allreduce of every rank sums each host's
   shards (:meth:`Arena._across_hosts`), the shard comes back to this rank's range, and
   from there to the host's other ranges on the device.  The device-to-host and
   host-to-device bytes fall by the host's number of ranks;
3. ``synchronize()`` waits for that agreement, makes the side stream wait for every peer's
   *done* (or waits for them itself, as above), copies the range into the result on the side stream, and makes the stream that
   consumes the result wait for that copy.  The range is free again at once: whatever writes into
   it next is queued on the same side stream, after those waits.

A broadcast (:meth:`Arena.broadcast`) has the same two agreements.  Only the root takes a range and
copies its tensor in; its row holds the range's offset plus one, another rank's 1 (it can read
the root's arena) or 0, then the root rank and the signature.  Once every rank can, each other
rank's side stream waits for the root's *posted*, copies the root's range into its result and
records *done*; the root's ``synchronize()`` makes its side stream wait for every *done* before
the range is taken again.  No thread waits for the device, so DDP's forward, which waits for its
buffers' broadcast, does not wait for the GPU to finish the last step.

The agreements are allreduces because after ``hvd.join()`` only allreduces proceed: a rank that
has joined adds zeros, which read as "no room" (the op then takes the pinned path, where that rank
adds zeros, as Horovod has it) or, in the sharing, as "try again at the next op".

Both agreements are ordinary core ops named after the op, so a rank that submits something else
under that name (a host tensor, an integer dtype) fails the op on every rank with a
``MismatchError``, as a mismatch does on the pinned path.  The first agreement's row also carries
the tensor's dtype and shape (:func:`signature`): ranks that pass the same bytes in another shape
or dtype fail it on every rank alike (:func:`disagreement`).  Stream waits capture an event's latest
record, and every record a wait refers to was queued before the wait, so no two side streams can
wait for each other.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import ringcomm as _rc
from ringcomm import api as _core_api
from ringcomm.core.ops import Average, Sum
from ringcomm.core.process_sets import global_process_set
from ringcomm.errors import MismatchError

from .device import DeviceService, FakeOps, service_for
from .device_arena_rows import BROADCAST_ROW, ROW, Slots, disagreement, root_disagreement, signature
from .device_ipc import (OnDevice, across_hosts, agree_done, choose_path, host_groups, shard_bounds,
                         stage_dtype, sum_shard, wait_for_peers)
from .device_ipc_ops import ipc_for
from .handles import Handle

__all__ = ["Arena", "arena_for", "broadcast_arena_for"]

_log = logging.getLogger(__name__)

#: Bytes each rank has for its pickled handles in the sharing op (CUDA's take well under 1 KiB).
SHARE_ROW_BYTES = 4096


class _Range:
    """One op's range of this rank's arena, given back once (by whichever comes first)."""

    __slots__ = ("arena", "offset")

    def __init__(self, arena: Arena, offset: int) -> None:
        self.arena, self.offset = arena, offset

    def give(self) -> None:
        if self.offset >= 0:
            offset, self.offset = self.offset, -1
            self.arena.give(offset)


class Arena:
    """One rank's shared device buffer for the per-tensor allreduces of the global process set
    (see the module docstring).  ``state``: ``"new"``, ``"sharing"``, ``"ready"`` or ``"off"``."""

    def __init__(self, service: DeviceService, settings: Any, rank: int, size: int) -> None:
        self.service = service
        self.ops = service.ops
        self.settings = settings  # the job this arena belongs to (a new job makes a new arena)
        self.rank, self.size = rank, size
        self.local: tuple[int, ...] = ()  # the ranks on this rank's host (set once shared)
        self.staged_bytes = 0  # bytes this rank copied to pinned host memory for ops across hosts
        self.ipc = ipc_for(service.ops, own=True)
        self.slots = Slots(int(settings.device_ipc_arena_bytes))
        self.state = "new"
        self.reason = ""
        self._lock = threading.Lock()
        self.flat: torch.Tensor | None = None
        # every rank's arena and events, in rank order (this one's own; None for another host's rank)
        self.peers: list[torch.Tensor | None] = []
        self.posted: list[Any] = []
        self.done: list[Any] = []
        self._own: tuple[Any, Any] = (None, None)
        self._unlinked = False

    # -- sharing, once ---------------------------------------------------------------

    def _share(self) -> None:
        """Offer this rank's arena and events to the others (returns at once; see the module docstring)."""
        ipc, svc = self.ipc, self.service
        mine: Any = None
        problem = None
        try:
            if self.flat is None:  # made once, even if the sharing is tried again
                self.flat = ipc.shared_flat(self.slots.capacity, torch.uint8, svc.device)
                self._own = (ipc.event(), ipc.event())
                for ev in self._own:
                    self.ops.record(ev, svc.side)  # created on the device, so that it has a handle
            mine = (ipc.share(self.flat), ipc.event_handle(self._own[0]), ipc.event_handle(self._own[1]),
                    svc.device.index or 0, _rc.api.hostname())
        except Exception as exc:  # noqa: BLE001 - every rank learns it and keeps the pinned path
            problem = f"{type(exc).__name__}: {exc}"
        rows = np.zeros((self.size, SHARE_ROW_BYTES), dtype=np.uint8)
        blob = pickle.dumps((mine, problem))
        if len(blob) > SHARE_ROW_BYTES - 4:
            blob = pickle.dumps((None, f"its handles take {len(blob)} bytes, more than {SHARE_ROW_BYTES - 4}"))
        rows[self.rank, :4] = np.frombuffer(len(blob).to_bytes(4, "little"), dtype=np.uint8)
        rows[self.rank, 4:4 + len(blob)] = np.frombuffer(blob, dtype=np.uint8)
        try:  # an allreduce, as each op's agreement is: a rank that has joined adds an empty row
            every = _rc.allreduce_async(rows, op=Sum, name="device_arena.share", out=rows)
        except Exception as exc:  # noqa: BLE001 - e.g. the job is ending: the pinned path stays
            self._settle(False, f"sharing the arenas failed ({type(exc).__name__}: {exc})")
            return
        svc.then(every, self._guarded(self._open), "device_arena.share")

    def _guarded(self, step: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def run(raw: Any) -> Any:
            try:
                return step(raw)
            except BaseException as exc:  # noqa: BLE001 - the sharing failed: the pinned path stays
                self._settle(False, f"sharing the arenas failed ({type(exc).__name__}: {exc})")
                return None
        return run

    def _open(self, raw: Any) -> None:
        """On a return thread: every rank's handles are here; decide the path alike, open the peers'.

        No rank waits for the others to have opened: this rank offers ranges once it has opened
        every peer's arena, and an op takes the device path only when every rank offered one."""
        rows = np.asarray(raw, dtype=np.uint8).reshape(self.size, SHARE_ROW_BYTES)
        every: list[tuple[Any, str | None]] = []
        for k in range(self.size):
            n = int.from_bytes(rows[k, :4].tobytes(), "little")
            if n == 0:  # a rank that had joined: try again at the next op
                with self._lock:
                    self.state = "new"
                return
            every.append(pickle.loads(rows[k, 4:4 + n].tobytes()))
        for k, (_, problem) in enumerate(every):
            if problem is not None:
                self._settle(False, f"rank {k} could not share its arena ({problem})")
                return
        hosts = [str(m[4]) for m, _ in every]
        use, reason = choose_path(True, hosts, self.rank, [int(m[3]) for m, _ in every], self.ipc.peer_access,
                                  True, True)
        local = next(g for g in host_groups(hosts) if self.rank in g)
        if use:
            try:
                dev = self.service.device
                assert self.flat is not None
                self.peers = [self.flat if k == self.rank else self.ipc.open_shared(m[0], dev) if k in local else None
                              for k, (m, _) in enumerate(every)]
                self.posted = [self._own[0] if k == self.rank else self.ipc.open_event(m[1], dev) if k in local
                               else None for k, (m, _) in enumerate(every)]
                self.done = [self._own[1] if k == self.rank else self.ipc.open_event(m[2], dev) if k in local
                             else None for k, (m, _) in enumerate(every)]
                self.local = local
            except Exception as exc:  # noqa: BLE001 - this rank offers no range: every op takes the pinned path
                use, reason = False, f"rank {self.rank} could not open a peer's arena ({type(exc).__name__}: {exc})"
        self._settle(use, reason)

    def _settle(self, use: bool, reason: str) -> None:
        with self._lock:
            self.state, self.reason = ("ready" if use else "off"), reason
        level = logging.INFO if use or "RINGCOMM_DEVICE_IPC" in reason else logging.WARNING
        _log.log(level, "rank %d: per-tensor CUDA allreduces go %s: %s%s", self.rank,
                 "through the GPUs (CUDA IPC)" if use else "through pinned host memory", reason,
                 "" if use else "; set RINGCOMM_DEVICE_IPC=0 to skip trying")

    # -- ranges -----------------------------------------------------------------------

    def start(self) -> None:
        """Start sharing this arena with the other ranks, unless that started already (returns at once)."""
        with self._lock:
            if self.state != "new":
                return
            self.state = "sharing"
        self._share()

    def offer(self, t: torch.Tensor) -> int:
        """The offset of a range of this arena for ``t``, or -1 (not shared yet, another device, or
        full); the first call starts the sharing."""
        with self._lock:
            state = self.state
            if state == "ready" and t.device == self.service.device:
                offset = self.slots.take(t.numel() * t.element_size())
                return -1 if offset is None else offset
        if state == "new":
            self.start()
        return -1

    def readable(self, t: torch.Tensor) -> bool:
        """Whether this rank has opened every peer's arena, for ``t``'s device; the first call
        starts the sharing."""
        with self._lock:
            state = self.state
            if state == "ready":
                return t.device == self.service.device
        if state == "new":
            self.start()
        return False

    def give(self, offset: int) -> None:
        with self._lock:
            self.slots.give(offset)

    def _opened_everywhere(self) -> None:
        """Every rank has opened every arena (an op's agreement offered ranges on every rank): the
        fake's files may go, once."""
        if not self._unlinked:
            self._unlinked = True
            self.ipc.opened()

    def _view(self, k: int, offset: int, t: torch.Tensor) -> torch.Tensor:
        """Rank ``k``'s range at ``offset`` (``k`` on this host), flat, in ``t``'s dtype."""
        nbytes = t.numel() * t.element_size()
        peer = self.peers[k]
        assert peer is not None, f"rank {k} is on another host"
        return peer[offset:offset + nbytes].view(t.dtype)

    # -- one op -------------------------------------------------------------------------

    def allreduce(self, t: torch.Tensor, *, in_place: bool, core_name: str, name: str | None, average: bool,
                  prescale: float, postscale: float, fallback: Callable[[str], Handle],
                  consumer: Any = None) -> Handle:
        """Start reducing ``t`` (see the module docstring); ``fallback(core_name)`` starts the same op
        through pinned host memory and returns its handle.  ``consumer``: the stream that uses the
        result (default: the current one in ``synchronize()``).  Returns at once."""
        ops, svc = self.ops, self.service
        offset = self.offer(t)
        held = _Range(self, offset)
        # t's producers have finished before anything on the side stream reads it, here or, on the
        # pinned path, on the return thread
        side = svc.after(svc.current())
        if offset >= 0:
            t0 = time.perf_counter()
            ops.pack_parts([self._view(self.rank, offset, t).view(t.shape)], [t], side)
            ops.record(self.posted[self.rank], side)
            _span(ops, core_name, "MEMCPY_IN_ARENA", t0, self.posted[self.rank])
        row = np.zeros((self.size, ROW), dtype=np.int64)  # a rank that has joined adds zeros
        row[self.rank] = [offset + 1, *signature(t)]
        agreement = _rc.allreduce_async(row, op=Sum, name=core_name)

        def reduce(raw: Any) -> Any:  # on a return thread, once every rank has offered
            rows = np.asarray(raw).reshape(self.size, ROW)
            offsets = [int(v) - 1 for v in rows[:, 0]]  # a rank that has joined: -1
            if min(offsets) < 0:
                held.give()  # nobody reads it: the op goes through host memory on every rank
                return fallback(f"{core_name}.host")
            problem = disagreement(core_name, rows[:, 1:])  # alike on every rank: the same rows
            if problem:
                return MismatchError(problem)
            self._opened_everywhere()
            if len(self.local) < self.size:
                return self._across_hosts(t, offsets, side, core_name, prescale, postscale, average)
            error = None
            t0 = time.perf_counter()
            try:
                wait_for_peers(ops, side, self.posted, self.rank)
                lo, hi = shard_bounds(t.numel(), self.rank, self.size)
                views = [self._view(k, off, t) for k, off in enumerate(offsets)]
                sum_shard(ops, side, views, lo, hi, prescale, postscale, average)
                ops.record(self.done[self.rank], side)
            except Exception as exc:  # noqa: BLE001 - reported to every rank by the second agreement
                error = exc
            _span(ops, core_name, "IPC_REDUCE", t0)
            return agree_done(self.rank, self.size, f"{core_name}.done", error, global_process_set)

        returning = svc.then(agreement, reduce, core_name)

        def finish(result: Any) -> torch.Tensor:  # synchronize()
            if isinstance(result, Handle):
                return result.wait()
            if isinstance(result, MismatchError):
                raise result
            if not isinstance(result, OnDevice):  # across hosts: the hosts' allreduce comes first
                result = result.wait()
            result.check(core_name, self.rank)
            t0 = time.perf_counter()
            wait_for_peers(ops, side, self.done, self.rank)
            target = t if in_place else torch.empty(t.shape, dtype=t.dtype, device=t.device)
            ops.copy(target, self._view(self.rank, held.offset, t).view(t.shape), side)
            copied = svc.mark()
            ops.stream_wait(svc.current() if consumer is None else consumer, copied)
            _span(ops, core_name, "MEMCPY_OUT_ARENA", t0, copied)
            return target

        return Handle("allreduce", name, returning, finish, held.give, t.numel() * t.element_size())

    def broadcast(self, t: torch.Tensor, *, root: int, in_place: bool, core_name: str, name: str | None,
                  fallback: Callable[[str], Handle], consumer: Any = None) -> Handle:
        """Start copying rank ``root``'s ``t`` into every rank's result on the device (see the module
        docstring; every rank is on this host); ``fallback(core_name)`` starts the same op through
        pinned host memory and returns its handle.  ``consumer``: as for :meth:`allreduce`.
        Returns at once."""
        ops, svc = self.ops, self.service
        mine = self.rank == root
        offset = self.offer(t) if mine else (0 if self.readable(t) else -1)
        if offset >= 0 and len(self.local) < self.size:  # a rank on another host cannot read the root's arena
            if mine:
                self.give(offset)
            offset = -1
        held = _Range(self, offset if mine else -1)
        side = svc.after(svc.current())  # t's producers (and a result's earlier readers) come first
        if mine and offset >= 0:
            t0 = time.perf_counter()
            ops.pack_parts([self._view(self.rank, offset, t).view(t.shape)], [t], side)
            ops.record(self.posted[self.rank], side)
            _span(ops, core_name, "MEMCPY_IN_ARENA", t0, self.posted[self.rank])
        target = t if in_place else torch.empty(t.shape, dtype=t.dtype, device=t.device)
        row = np.zeros((self.size, BROADCAST_ROW), dtype=np.int64)  # a rank that has joined adds zeros
        row[self.rank] = [offset + 1, root, *signature(t)]
        agreement = _rc.allreduce_async(row, op=Sum, name=core_name)

        def copy(raw: Any) -> Any:  # on a return thread, once every rank has offered
            rows = np.asarray(raw).reshape(self.size, BROADCAST_ROW)
            if (rows[:, 0] <= 0).any():  # the root has no room, or a rank cannot read it, or has joined
                held.give()
                return fallback(f"{core_name}.host")
            problem = (root_disagreement(core_name, rows[:, 1])
                       or disagreement(core_name, rows[:, 2:], "broadcast"))  # alike on every rank
            if problem:
                return MismatchError(problem)
            self._opened_everywhere()
            error = None
            t0 = time.perf_counter()
            try:
                source = self._view(root, int(rows[root, 0]) - 1, t).view(t.shape)
                if not mine:
                    wait_for_peers(ops, side, [ev if k == root else None for k, ev in enumerate(self.posted)],
                                   self.rank)
                if not (mine and in_place):
                    ops.copy(target, source, side)
            except Exception as exc:  # noqa: BLE001 - reported to every rank by the second agreement
                error = exc
            ops.record(self.done[self.rank], side)  # the root's range may be taken again after it
            if not (mine and in_place):
                _span(ops, core_name, "MEMCPY_OUT_ARENA", t0)
            return agree_done(self.rank, self.size, f"{core_name}.done", error, global_process_set)

        returning = svc.then(agreement, copy, core_name)

        def finish(result: Any) -> torch.Tensor:  # synchronize()
            if isinstance(result, Handle):
                return result.wait()
            if isinstance(result, MismatchError):
                raise result
            if not (mine and in_place):  # a root's own tensor in place is as it was
                ops.stream_wait(svc.current() if consumer is None else consumer, svc.mark())
            if mine:  # every rank has read the range before anything is written into it again
                wait_for_peers(ops, side, self.done, self.rank)
            result.check(core_name, self.rank, "broadcast", "copy the root's tensor")
            return target

        return Handle("broadcast", name, returning, finish, held.give, t.numel() * t.element_size())

    def _across_hosts(self, t: torch.Tensor, offsets: list[int], side: Any, core_name: str, prescale: float,
                      postscale: float, average: bool) -> Any:
        """On a return thread, in a job that spans hosts: :func:`~.device_ipc.across_hosts` over this
        host's ranges, through a pinned buffer of the pool (returns at once)."""
        svc, local = self.service, self.local
        stage = stage_dtype(t.dtype)
        nbytes = t.numel() * torch.empty((), dtype=stage).element_size()
        buf = svc.pool.acquire(nbytes)
        me = local.index(self.rank)
        lo, hi = shard_bounds(t.numel(), me, len(local))
        self.staged_bytes += (hi - lo) * (nbytes // max(1, t.numel()))

        def prepare() -> list[torch.Tensor]:
            wait_for_peers(self.ops, side, self.posted, self.rank)  # None for another host's ranks
            return [self._view(k, offsets[k], t) for k in local]

        return across_hosts(svc, side, prepare, me, buf[:nbytes].view(stage), prescale, postscale, average, self.rank,
                            self.size, self.done[self.rank], core_name, global_process_set, lambda: svc.release(buf))


def _span(ops: Any, core_name: str, phase: str, start: float, event: Any = None) -> None:
    """With a timeline: ``phase`` on the op's row from ``start`` until now, after waiting for
    ``event`` (so that a copy's span is the copy itself, as the pinned path's are); else nothing."""
    if _core_api.timeline_active():
        if event is not None:
            ops.wait_event(event)
        _core_api.timeline_span(core_name, phase, start, time.perf_counter())


_arenas: dict[int, Arena] = {}
_arenas_lock = threading.Lock()


def arena_for(t: torch.Tensor, op: Any, process_set: Any) -> Arena | None:
    """This rank's arena when an allreduce of ``t`` with ``op`` over ``process_set`` takes the
    agreement of the module docstring, else None.  Every input is alike on every rank of a valid
    op (the settings, the job's layout, the op, the set, the dtype), so every rank decides alike."""
    if op not in (Sum, Average) or not isinstance(t, torch.Tensor) or not t.is_floating_point():
        return None
    return _arena(t, process_set, one_host=False)


def broadcast_arena_for(t: torch.Tensor, process_set: Any) -> Arena | None:
    """This rank's arena when a broadcast of ``t`` over ``process_set`` is copied through the
    root's arena (every rank on one host; any dtype: only bytes move), else None; alike on every
    rank, as :func:`arena_for`."""
    if not isinstance(t, torch.Tensor):
        return None
    return _arena(t, process_set, one_host=True)


def _arena(t: torch.Tensor, process_set: Any, one_host: bool) -> Arena | None:
    """This rank's arena for a per-tensor op of ``t`` over ``process_set`` where some host has two
    ranks or more (``one_host``: where every rank is on one host), the kind of op aside."""
    settings = _rc.api.current_settings()
    if not settings.device_ipc or t.layout is not torch.strided or t.numel() == 0:
        return None
    if t.numel() * t.element_size() < settings.device_ipc_min_bytes:  # small: through pinned memory
        return None
    if process_set is not global_process_set and getattr(process_set, "process_set_id", None) != 0:
        return None
    svc = service_for(t)
    if svc is None or (isinstance(svc.ops, FakeOps) and not svc.ops.ipc):
        return None
    n = _rc.api.size()
    hosts = _rc.api.cross_size()
    # a broadcast's other ranks read the root's arena: one host; an allreduce sums a host's ranks: two or more
    if n < 2 or (hosts != 1 if one_host else hosts == n):
        return None
    with _arenas_lock:
        arena = _arenas.get(id(svc.ops))
        if arena is None or arena.settings is not settings:
            arena = _arenas[id(svc.ops)] = Arena(svc, settings, _rc.api.rank(), n)
        return arena
