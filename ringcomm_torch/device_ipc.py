"""Reducing DistributedOptimizer's CUDA buckets on the device among the ranks of one host, through
CUDA IPC, instead of through pinned host memory.

At set-up (the optimizer's construction) the ranks of a job that all share one host gather each
other's GPU (one ``allgather_object``) and decide the path together (:func:`choose_path`, pure):
the device path where every pair of GPUs is the same or has peer access
(``torch.cuda.can_device_access_peer``), the op is Sum or Average, the compression leaves the
bucket as it is and ``RINGCOMM_DEVICE_IPC`` is on; the pinned path otherwise.  The choice and its
reason are logged once.  On the device path each bucket's flat buffer and two interprocess events
(*posted*, *done*) are shared once (torch's own sharing: ``reduce_tensor`` and its rebuild,
``Event(interprocess=True)``, ``ipc_handle()``, ``Event.from_ipc_handle``), the handles exchanged
with a second ``allgather_object``.  Then, each step, for a bucket of ``n`` ranks:

1. the hook packs the gradients into the flat buffer on the side stream, records *posted* and
   submits a one-element agreement op (the lane's or the engine's allreduce): it returns at once;
2. once every rank has posted (the agreement is done), a return thread queues on the side
   stream: a wait for each peer's *posted* event (a stream wait, not a host wait), the sum of
   this rank's shard over every rank's buffer **in rank order** (so every rank gets the same
   bits), Horovod's prescale, postscale and Average, a copy of the summed shard into every
   rank's buffer, and *done*; then it submits a second agreement op;
3. ``synchronize()`` waits for that agreement (every rank has queued its shards) and makes the
   side stream wait for every rank's *done*, then the current stream for the side stream.

The current stream of every rank thus waits for every rank's *done* before the next backward
writes into its buffer, so no rank reads or writes a buffer that another still uses.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

import ringcomm as _rc
from ringcomm.core.ops import Average, Sum

from .buckets import DeviceBucket
from .device import DeviceService
from .device_ipc_ops import ipc_for
from .handles import Handle

__all__ = ["choose_path", "rank_row", "shard_bounds", "sum_shard", "partial_sum", "wide_dtype", "host_groups", "agree",
           "IpcBucket", "share_buckets", "log_once"]

_log = logging.getLogger(__name__)
_logged = threading.Event()


def choose_path(enabled: bool, size: int, local_size: int, devices: Sequence[int],
                reachable: Sequence[Sequence[bool]], op_ok: bool, flat_ok: bool) -> tuple[bool, str]:
    """Whether the ranks reduce their buckets on the device, and why (pure; every rank decides
    alike from the same gathered values).

    >>> choose_path(True, 2, 2, [0, 0], [[True, True], [True, True]], True, True)
    (True, 'the 2 ranks share a host, and their GPUs are one or have peer access')
    >>> choose_path(False, 2, 2, [0, 0], [[True] * 2] * 2, True, True)[1]
    'RINGCOMM_DEVICE_IPC=0'
    """
    if not enabled:
        return False, "RINGCOMM_DEVICE_IPC=0"
    if size < 2:
        return False, "a job of one rank"
    if local_size != size:
        return False, f"the ranks span hosts ({local_size} of {size} on this one)"
    if not op_ok:
        return False, "the op is neither Sum nor Average"
    if not flat_ok:
        return False, "the compression changes the buckets' dtype"
    for i, row in enumerate(reachable):
        for j, ok in enumerate(row):
            if not ok:
                return False, (f"GPU {devices[i]} of rank {i} cannot access GPU {devices[j]} of rank {j} "
                               "(torch.cuda.can_device_access_peer)")
    return True, f"the {size} ranks share a host, and their GPUs are one or have peer access"


def log_once(use: bool, reason: str) -> None:
    if not _logged.is_set():
        _logged.set()
        _log.info("DistributedOptimizer reduces CUDA buckets %s: %s",
                  "on the device through CUDA IPC" if use else "through pinned host memory", reason)


def agree(name: str, process_set: Any) -> Any:
    """A one-element allreduce that completes once every rank has submitted it (returns at once)."""
    token = np.zeros(1, dtype=np.int32)
    return _rc.allreduce_async(token, op=Sum, name=name, out=token, process_set=process_set)


def rank_row(rank: int, size: int, value: int, dtype: Any = np.int32) -> np.ndarray:
    """``value`` at ``rank``'s index, zeros elsewhere: summed over the ranks (an allreduce), every
    rank's value, and 0 for a rank that has joined (it adds zeros).

    >>> rank_row(1, 3, 7).tolist()
    [0, 7, 0]
    """
    row = np.zeros(size, dtype=dtype)
    row[rank] = value
    return row


def shard_bounds(numel: int, rank: int, size: int) -> tuple[int, int]:
    """The elements ``[lo, hi)`` of a flat buffer whose sum ``rank`` computes (pure).

    >>> [shard_bounds(10, r, 3) for r in range(3)]
    [(0, 4), (4, 7), (7, 10)]
    """
    q, r = divmod(numel, size)
    lo = rank * q + min(rank, r)
    return lo, lo + q + (1 if rank < r else 0)


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums of ``dtype`` are made in: float32 for the half types, else ``dtype`` itself."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def partial_sum(ops: Any, side: Any, views: Sequence[torch.Tensor], lo: int, hi: int,
                prescale: float) -> torch.Tensor:
    """Queue on ``side`` and return: the sum of ``views[k][lo:hi]`` over ``views`` **in their order**
    (so whichever rank computes it, the bits are the same), each term times ``prescale``, in
    :func:`wide_dtype` (half-precision terms are summed in float32)."""
    wide = wide_dtype(views[0].dtype)
    with ops.on(side), torch.no_grad():
        acc = views[0][lo:hi].to(wide, copy=True)
        if prescale != 1.0:
            acc.mul_(prescale)
        for view in views[1:]:
            term = view[lo:hi].to(wide)
            acc.add_(term * prescale if prescale != 1.0 else term)
    return acc


def sum_shard(ops: Any, side: Any, views: Sequence[torch.Tensor], lo: int, hi: int, prescale: float,
              postscale: float, average: bool) -> None:
    """Queue on ``side``: the :func:`partial_sum` of every rank's view (in rank order) times
    ``postscale`` and divided by the ranks for Average (as the host path does), then its copy into
    every rank's view.  Half-precision terms are summed in float32 and rounded once."""
    if hi <= lo:
        return
    acc = partial_sum(ops, side, views, lo, hi, prescale)
    with ops.on(side), torch.no_grad():
        if postscale != 1.0:
            acc.mul_(postscale)
        if average:
            acc.div_(len(views))
    for view in views:
        ops.copy(view[lo:hi], acc, side)


def host_groups(hosts: Sequence[str]) -> list[tuple[int, ...]]:
    """The ranks of each host (``hosts[r]``: rank r's), hosts in order of their first rank (pure).

    >>> host_groups(["a", "b", "a", "b", "c"])
    [(0, 2), (1, 3), (4,)]
    """
    groups: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        groups.setdefault(host, []).append(rank)
    return [tuple(g) for g in groups.values()]


class IpcBucket(DeviceBucket):
    """A device bucket whose flat buffer every rank of the host reads and writes (module docstring)."""

    def __init__(self, params: Sequence[torch.Tensor], names: Sequence[str], service: DeviceService) -> None:
        super().__init__(params, names, service)
        self.ipc = ipc_for(service.ops)
        self._in_place = True
        self._own: tuple[Any, Any] = (None, None)
        self.rank = 0
        self.size = 1
        self.peers: list[torch.Tensor] = []  # every rank's flat buffer, in rank order (this one's own)
        self.posted: list[Any] = []  # every rank's events, in rank order
        self.done: list[Any] = []

    def _allocate(self) -> torch.Tensor:
        return self.ipc.shared_flat(self.numel, self.dtype, self.device)

    def mine(self) -> tuple[Any, Any, Any]:
        """This rank's shared buffer and events, as handles another process opens."""
        ipc, side = self.ipc, self.service.side
        flat = self._flat_buffer()
        self._own = (ipc.event(), ipc.event())
        for ev in self._own:
            self.ops.record(ev, side)  # created on the device, so that it has a handle
        return ipc.share(flat), ipc.event_handle(self._own[0]), ipc.event_handle(self._own[1])

    def open(self, rank: int, handles: Sequence[tuple[Any, Any, Any]]) -> None:
        """Open every other rank's buffer and events (``handles``: every rank's :meth:`mine`)."""
        ipc, dev = self.ipc, self.device
        self.rank, self.size = rank, len(handles)
        self.peers = [self._flat_buffer() if k == rank else ipc.open_shared(h[0], dev) for k, h in enumerate(handles)]
        self.posted = [self._own[0] if k == rank else ipc.open_event(h[1], dev) for k, h in enumerate(handles)]
        self.done = [self._own[1] if k == rank else ipc.open_event(h[2], dev) for k, h in enumerate(handles)]

    def start(self, grads: list[torch.Tensor], *, name: str, op: Any, compression: Any, prescale: float,
              postscale: float, process_set: Any) -> Handle:
        """Queue the pack and *posted*, submit the agreement; returns at once (module docstring)."""
        ops, svc = self.ops, self.service
        side = svc.after(svc.current())
        flat = self._flat_buffer()
        self._pack(flat, grads, side)
        grads, back_into = self._become_views(grads)
        ops.record(self.posted[self.rank], side)
        core_name = f"allreduce.{name}"
        lo, hi = shard_bounds(self.numel, self.rank, self.size)
        average = op == Average

        def reduce(raw: Any) -> Any:  # on a return thread, once every rank has posted
            if not np.asarray(raw).all():  # a rank has joined (it adds zeros): the pinned path, on every rank
                return self._through_host(side, f"{core_name}.host", op, prescale, postscale, process_set)
            for k, ev in enumerate(self.posted):
                if k != self.rank:
                    ops.stream_wait(side, ev)
            sum_shard(ops, side, self.peers, lo, hi, prescale, postscale, average)
            ops.record(self.done[self.rank], side)
            return agree(f"{core_name}.done", process_set)

        posted = rank_row(self.rank, self.size, 1)
        returning = svc.then(_rc.allreduce_async(posted, op=Sum, name=f"{core_name}.posted", out=posted,
                                                 process_set=process_set), reduce, core_name)

        def finish(done: Any) -> list[torch.Tensor]:  # synchronize(): every rank queued its shards
            if isinstance(done, _Home):  # the flat buffer came back from the host on the side stream
                ops.stream_wait(side, done.back.wait())
            else:
                done.wait()
                for k, ev in enumerate(self.done):
                    if k != self.rank:
                        ops.stream_wait(side, ev)
            if back_into:
                ops.unpack_parts([self._parts[i] for i in back_into], [grads[i] for i in back_into], side)
            ops.stream_wait(svc.current(), svc.mark())
            return grads

        return Handle("allreduce", name, returning, finish, None, int(flat.numel() * flat.element_size()))


    def _through_host(self, side: Any, name: str, op: Any, prescale: float, postscale: float,
                      process_set: Any) -> _Home:
        """On a return thread: reduce the flat buffer through its pinned buffer, as a
        :class:`DeviceBucket` does (the copies on the side stream, the op on the stager)."""
        ops, svc = self.ops, self.service
        flat, host = self._buffers(self.dtype)
        ops.copy(host, flat, side)
        array = host.numpy()
        staging = svc.start(svc.mark(), lambda: _rc.allreduce_async(
            array, op=op, name=name, prescale_factor=prescale, postscale_factor=postscale, out=array,
            process_set=process_set), name)

        def home(_raw: Any) -> Any:
            ops.copy(flat, host, side)
            return svc.mark()
        return _Home(svc.then(staging, home, name))


class _Home:
    """A bucket reduced through host memory instead (a rank had joined): ``back`` gives the event
    of the copy home."""

    __slots__ = ("back",)

    def __init__(self, back: Any) -> None:
        self.back = back


def share_buckets(buckets: Sequence[IpcBucket], rank: int, size: int, local_size: int, enabled: bool,
                  op_ok: bool, flat_ok: bool, process_set: Any) -> bool:
    """Set-up, on every rank of the job at once: decide the path (:func:`choose_path`, logged
    once) and, for the device path, share every bucket's buffer and events.  Returns the choice."""
    svc = buckets[0].service if buckets else None
    device = -1 if svc is None else (svc.device.index or 0)
    devices = [int(d) for d in _rc.allgather_object(device, name="device_ipc.devices", process_set=process_set)]
    counts = _rc.allgather_object(len(buckets), name="device_ipc.buckets", process_set=process_set)
    ipc = ipc_for(svc.ops) if svc is not None else None
    reachable = [[ipc is not None and min(devices) >= 0 and ipc.peer_access(a, b) for b in devices]
                 for a in devices]
    use, reason = choose_path(enabled, size, local_size, devices, reachable, op_ok, flat_ok)
    if use and len(set(counts)) != 1:
        use, reason = False, f"the ranks form different numbers of CUDA buckets ({counts})"
    log_once(use, reason)
    if not use:
        return False
    # a rank that cannot share or open a handle says so, and every rank keeps the pinned path
    mine: Any = None
    try:
        mine = [b.mine() for b in buckets]
        problem = None
    except Exception as exc:  # noqa: BLE001 - reported to every rank, which all fall back
        problem = f"{type(exc).__name__}: {exc}"
    every = _rc.allgather_object((mine, problem), name="device_ipc.handles", process_set=process_set)
    assert ipc is not None
    if _fell_back(every):
        ipc.opened()  # nobody will open this rank's handles
        return False
    problem = None
    try:
        for i, b in enumerate(buckets):
            b.open(rank, [every[k][0][i] for k in range(size)])
    except Exception as exc:  # noqa: BLE001
        problem = f"{type(exc).__name__}: {exc}"
    opened = _rc.allgather_object((None, problem), name="device_ipc.opened", process_set=process_set)
    ipc.opened()  # every rank has opened every handle (or given up)
    return not _fell_back(opened)


def _fell_back(every: Sequence[tuple[Any, str | None]]) -> bool:
    """Whether a rank reported a problem (each rank's ``(value, problem)``); logs the first."""
    for k, (_, problem) in enumerate(every):
        if problem is not None:
            _log.warning("DistributedOptimizer reduces CUDA buckets through pinned host memory: rank %d could "
                         "not share its buckets through CUDA IPC (%s); set RINGCOMM_DEVICE_IPC=0 to skip trying",
                         k, problem)
            return True
    return False
