"""Reducing DistributedOptimizer's CUDA buckets on the device among the ranks of each host, through
CUDA IPC, instead of through pinned host memory.

At set-up (the optimizer's construction) the ranks gather each other's GPU and host (one
``allgather_object``), each decides for its host (:func:`choose_path`, pure given the peer-access
query): the device path where every pair of its host's GPUs is the same or has peer access
(``torch.cuda.can_device_access_peer``), some host has two ranks or more, the op is Sum or Average,
the compression leaves the bucket as it is and ``RINGCOMM_DEVICE_IPC`` is on; the pinned path
otherwise.  A second gather makes the choice the same on every rank; it and its reason are logged
once.  On the device path each bucket's flat buffer and two interprocess events (*posted*,
*done*) are shared once with the host's other ranks (torch's own sharing: ``reduce_tensor`` and
its rebuild, ``Event(interprocess=True)``, ``ipc_handle()``, ``Event.from_ipc_handle``), the
handles exchanged with a third ``allgather_object``.  Then, each step, for a bucket of ``n`` ranks:

1. the hook packs the gradients into the flat buffer on the side stream, records *posted* and
   submits a one-element agreement op (the lane's or the engine's allreduce): it returns at once;
2. once every rank has posted (the agreement is done), a return thread queues on the side
   stream: a wait for each peer's *posted* event (a stream wait, not a host wait; with
   ``RINGCOMM_DEVICE_IPC_WAIT=host`` the return thread waits for it instead), the sum of
   this rank's shard over every rank's buffer **in rank order** (so every rank gets the same
   bits), Horovod's prescale, postscale and Average, a copy of the summed shard into every
   rank's buffer, and *done*; then it submits a second agreement op.  In a job that spans hosts
   the shard is summed over the host's buffers, and only it goes through pinned memory, where one
   allreduce of every rank sums the hosts' shards (:func:`across_hosts`);
3. ``synchronize()`` waits for that agreement (every rank has queued its shards) and makes the
   side stream wait for every rank's *done*, then the current stream for the side stream.

The current stream of every rank thus waits for every rank's *done* before the next backward
writes into its buffer, so no rank reads or writes a buffer that another still uses.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

import ringcomm as _rc
from ringcomm import api as _core_api
from ringcomm.core.ops import Average, Sum
from ringcomm.errors import HorovodInternalError

from .buckets import DeviceBucket
from .device import DeviceService
from .device_ipc_ops import ipc_for
from .handles import Handle

__all__ = ["refusal", "choose_path", "host_groups", "rank_row", "shard_bounds", "wide_dtype", "stage_dtype",
           "partial_sum",
           "sum_shard", "OnDevice", "wait_for_peers", "agree", "agree_done", "across_hosts", "IpcBucket", "share_buckets", "log_once"]

_log = logging.getLogger(__name__)
_logged = threading.Event()


def refusal(enabled: bool, size: int, elastic: bool = False) -> str | None:
    """Why no job of ``size`` ranks with the setting ``enabled`` (``elastic``: whose ranks may
    change) reduces its buckets on the device, if so."""
    if not enabled:
        return "RINGCOMM_DEVICE_IPC=0"
    if size < 2:
        return "a job of one rank"
    if elastic:  # a worker that joins later would make its optimizer alone: no collective at that point
        return "an elastic job (its ranks change, and the buckets are shared when the optimizer is made)"
    return None


def choose_path(enabled: bool, hosts: Sequence[str], rank: int, devices: Sequence[int],
                reachable: Callable[[int, int], bool], op_ok: bool, flat_ok: bool) -> tuple[bool, str]:
    """Whether ``rank`` reduces on the device with the ranks of its host, and why (pure given
    ``reachable``; the ranks of a host decide alike from the same gathered values).

    ``hosts[k]`` and ``devices[k]`` are rank k's host and GPU; ``reachable(a, b)`` whether GPU ``a``
    can access GPU ``b`` on this host.  Across hosts, each rank's shard of its host's sum goes
    through pinned memory; a host with one rank takes part with its whole tensor as its shard.

    >>> choose_path(True, ["h", "h"], 0, [0, 0], lambda a, b: True, True, True)
    (True, 'the 2 ranks share a host, and their GPUs are one or have peer access')
    >>> choose_path(True, ["a", "b", "a", "b"], 1, [0] * 4, lambda a, b: True, True, True)[1][:40]
    'the job spans 2 hosts: the ranks of each'
    >>> choose_path(True, ["a", "b"], 0, [0, 0], lambda a, b: True, True, True)[1]
    'each of the 2 ranks is alone on its host'
    """
    why = refusal(enabled, len(hosts))
    if why is not None:
        return False, why
    groups = host_groups(hosts)
    if len(groups) == len(hosts):
        return False, f"each of the {len(hosts)} ranks is alone on its host"
    if not op_ok:
        return False, "the op is neither Sum nor Average"
    if not flat_ok:
        return False, "the compression changes the buckets' dtype"
    local = next(g for g in groups if rank in g)
    for i in local:
        for j in local:
            if not reachable(devices[i], devices[j]):
                return False, (f"GPU {devices[i]} of rank {i} cannot access GPU {devices[j]} of rank {j} "
                               "(torch.cuda.can_device_access_peer)")
    if len(groups) == 1:
        return True, f"the {len(hosts)} ranks share a host, and their GPUs are one or have peer access"
    return True, (f"the job spans {len(groups)} hosts: the ranks of each host sum on their GPUs (one GPU or "
                  "peer access), and only each rank's shard of its host's sum goes through pinned memory "
                  "and the network")


def log_once(use: bool, reason: str) -> None:
    if not _logged.is_set():
        _logged.set()
        _log.info("DistributedOptimizer reduces CUDA buckets %s: %s",
                  "on the device through CUDA IPC" if use else "through pinned host memory", reason)


def wait_for_peers(ops: Any, stream: Any, events: Sequence[Any], rank: int) -> None:
    """``stream`` runs nothing more until every other rank's event in ``events`` (in rank order;
    None for another host's rank) has happened.  By default (``RINGCOMM_DEVICE_IPC_WAIT=stream``)
    the stream waits and the host does not; with ``host`` the calling thread (a return thread, or
    the one in ``synchronize()``) waits for each event first, so no stream of this process waits
    on another process's work."""
    on_host = _rc.api.current_settings().device_ipc_wait == "host"
    for k, ev in enumerate(events):
        if k != rank and ev is not None:
            if on_host:
                ops.wait_event(ev)
            else:
                ops.stream_wait(stream, ev)


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


def stage_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a host's shard crosses hosts in: float16 itself (the engine sums float16, as it does
    for the pinned path, so the bytes on the wire stay half of float32's); bfloat16 as float32 (the
    engine has no bfloat16 sum: the pinned path widens it too); any other dtype itself."""
    return torch.float32 if dtype is torch.bfloat16 else dtype


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


class OnDevice:
    """A reduction queued on the device: ``done``, the agreement that every rank queued its shard
    (a row per rank, 1 where it failed), and ``error``, this rank's failure, if any."""

    __slots__ = ("done", "error")

    def __init__(self, done: Any, error: BaseException | None) -> None:
        self.done, self.error = done, error

    def check(self, op_name: str, rank: int, kind: str = "allreduce", task: str = "reduce their shard") -> None:
        """Wait for the agreement; raise on every rank if a rank could not queue its part (``task``)."""
        failed = [k for k, v in enumerate(np.asarray(self.done.wait()).reshape(-1)) if v]
        if failed:
            raise HorovodInternalError(
                f"{kind} {op_name!r} on rank {rank}: rank(s) {failed} could not {task} on the GPU "
                f"({self.error or 'see their log'}); set RINGCOMM_DEVICE_IPC=0 to take pinned host "
                "memory instead") from self.error


def agree_done(rank: int, size: int, name: str, error: BaseException | None, process_set: Any) -> OnDevice:
    """Submit the agreement that ends a reduction on the device (returns at once)."""
    status = rank_row(rank, size, 0 if error is None else 1)
    return OnDevice(_rc.allreduce_async(status, op=Sum, name=name, process_set=process_set), error)


def across_hosts(svc: DeviceService, side: Any, prepare: Callable[[], list[torch.Tensor]], me: int,
                 host: torch.Tensor, prescale: float, postscale: float, average: bool, rank: int, size: int,
                 done: Any, name: str, process_set: Any, release: Callable[[], None]) -> Any:
    """On a return thread, in a job that spans hosts: reduce one tensor whose host's copies are
    ``prepare()`` (this host's ranks' flat views, in rank order, once the side stream waits for
    their *posted* events; this rank's is ``[me]``).  Returns at once: what ``wait()`` turns into the
    :class:`OnDevice` of the op.

    This rank sums its shard over the host's views on the device (:func:`partial_sum`) and copies
    only that shard into ``host`` (pinned, the tensor's size, in :func:`stage_dtype`), whose other
    elements are zeros; one allreduce of every rank (named ``name``.hosts) then sums one shard per
    host into every element, whichever path the engine takes.  Back on a return thread, the shard
    is scaled on the host (Horovod's postscale and Average, the same bits on every rank), copied
    into this rank's view, from there into the host's other views on the device, and *done* is
    recorded.  ``release()`` runs once the copies from ``host`` are queued."""
    ops = svc.ops
    error: BaseException | None = None
    views: list[torch.Tensor] = []
    lo = hi = 0
    try:
        views = prepare()
        lo, hi = shard_bounds(views[me].numel(), me, len(views))
        if hi > lo:
            part = partial_sum(ops, side, views, lo, hi, prescale)
            if part.dtype != host.dtype:  # float16: summed in float32 on the device, rounded once here
                with ops.on(side), torch.no_grad():
                    part = part.to(host.dtype)
            ops.copy(host[lo:hi], part, side)
    except Exception as exc:  # noqa: BLE001 - this rank adds zeros; the agreement reports it
        error = exc
    with torch.no_grad():  # host memory the device does not touch: the rest of the tensor adds nothing
        if error is not None:
            host.zero_()
        else:
            host[:lo].zero_()
            host[hi:].zero_()
    arr = host.numpy()
    staging = svc.start(svc.mark(), lambda: _rc.allreduce_async(arr, op=Sum, name=f"{name}.hosts", out=arr,
                                                                  process_set=process_set), f"{name}.hosts")

    def back(_raw: Any) -> OnDevice:  # on a return thread, once every host's shards are summed
        err = error
        try:
            if err is None and hi > lo:
                part = host[lo:hi]
                with torch.no_grad():
                    if postscale != 1.0:
                        part.mul_(postscale)
                    if average:
                        part.div_(size)
                own = views[me][lo:hi]
                ops.copy(own, part, side)  # the shard back to the device, once
                for k, view in enumerate(views):
                    if k != me:
                        ops.copy(view[lo:hi], own, side)  # and to the host's other ranks, device to device
            if err is None:
                ops.record(done, side)
        except Exception as exc:  # noqa: BLE001 - reported to every rank by the agreement
            err = exc
        release()
        return agree_done(rank, size, f"{name}.done", err, process_set)

    return svc.then(staging, back, name)


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
        self.local: tuple[int, ...] = ()  # the ranks on this rank's host
        # every rank's flat buffer and events, in rank order (this one's own; None for another host's rank)
        self.peers: list[torch.Tensor | None] = []
        self.posted: list[Any] = []
        self.done: list[Any] = []
        self._wide: torch.Tensor | None = None  # the pinned buffer of the reductions across hosts
        self.staged_bytes = 0  # bytes this rank copied to pinned host memory for them
        self.job: Any = None  # the settings of the job whose ranks share this bucket (set by open())

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

    def open(self, rank: int, local: tuple[int, ...], handles: Sequence[tuple[Any, Any, Any] | None]) -> None:
        """Open the buffer and events of every other rank of ``local`` (this host's ranks;
        ``handles``: every rank's :meth:`mine`, None for another host's)."""
        ipc, dev = self.ipc, self.device
        self.rank, self.size, self.local = rank, len(handles), local
        self.job = _rc.api.current_settings()  # the job these handles belong to

        def opened(k: int, h: Any, i: int, own: Any, open_: Callable[[Any, torch.device], Any]) -> Any:
            return own if k == rank else open_(h[i], dev) if k in local else None
        self.peers = [opened(k, h, 0, self._flat_buffer(), ipc.open_shared) for k, h in enumerate(handles)]
        self.posted = [opened(k, h, 1, self._own[0], ipc.open_event) for k, h in enumerate(handles)]
        self.done = [opened(k, h, 2, self._own[1], ipc.open_event) for k, h in enumerate(handles)]

    def start(self, grads: list[torch.Tensor], *, name: str, op: Any, compression: Any, prescale: float,
              postscale: float, process_set: Any) -> Handle:
        """Queue the pack and *posted*, submit the agreement; returns at once (module docstring)."""
        ops, svc = self.ops, self.service
        t0 = time.perf_counter()
        side = svc.after(svc.current())
        flat = self._flat_buffer()
        self._pack(flat, grads, side)
        grads, back_into = self._become_views(grads)
        ops.record(self.posted[self.rank], side)
        core_name = f"allreduce.{name}"
        self._span(core_name, "BUCKET_PACK", t0)
        lo, hi = shard_bounds(self.numel, self.rank, self.size)
        average = op == Average

        def reduce(raw: Any) -> Any:  # on a return thread, once every rank has posted
            if not np.asarray(raw).all():  # a rank has joined (it adds zeros): the pinned path, on every rank
                return self._through_host(side, f"{core_name}.host", op, prescale, postscale, process_set)
            if len(self.local) < self.size:
                return self._across_hosts(side, core_name, prescale, postscale, average, process_set)
            t1 = time.perf_counter()
            wait_for_peers(ops, side, self.posted, self.rank)
            sum_shard(ops, side, self._host_buffers(), lo, hi, prescale, postscale, average)
            ops.record(self.done[self.rank], side)
            self._span(core_name, "IPC_REDUCE", t1)
            return agree(f"{core_name}.done", process_set)

        posted = rank_row(self.rank, self.size, 1)
        returning = svc.then(_rc.allreduce_async(posted, op=Sum, name=f"{core_name}.posted", out=posted,
                                                 process_set=process_set), reduce, core_name)

        def finish(done: Any) -> list[torch.Tensor]:  # synchronize(): every rank queued its shards
            t2 = time.perf_counter()
            if isinstance(done, _Home):  # the flat buffer came back from the host on the side stream
                ops.stream_wait(side, done.back.wait())
            else:
                if isinstance(done, _Across):  # the hosts' allreduce came first
                    done.reduced.wait().check(core_name, self.rank)
                else:
                    done.wait()
                wait_for_peers(ops, side, self.done, self.rank)
            if back_into:
                ops.unpack_parts([self._parts[i] for i in back_into], [grads[i] for i in back_into], side)
            ops.stream_wait(svc.current(), svc.mark())
            self._span(core_name, "BUCKET_UNPACK", t2)
            return grads

        return Handle("allreduce", name, returning, finish, None, int(flat.numel() * flat.element_size()))

    def _span(self, core_name: str, phase: str, start: float) -> None:
        """With a timeline: ``phase`` from ``start`` until now on the bucket's row, with its parameters."""
        if _core_api.timeline_active():
            _core_api.timeline_span(core_name, phase, start, time.perf_counter(), {"parameters": self.names})

    def _host_buffers(self) -> list[torch.Tensor]:
        """The flat buffers of this host's ranks, in rank order."""
        return [b for k in self.local if (b := self.peers[k]) is not None]

    def _across_hosts(self, side: Any, name: str, prescale: float, postscale: float, average: bool,
                      process_set: Any) -> _Across:
        """On a return thread, in a job that spans hosts: :func:`across_hosts` over this host's
        buffers, through a pinned buffer the bucket keeps (returns at once)."""
        local, stage = self.local, stage_dtype(self.dtype)
        nbytes = self.numel * torch.empty((), dtype=stage).element_size()
        if self._wide is None:
            self._wide = self.service.pool.allocate(nbytes)  # kept for the bucket's life
        me = local.index(self.rank)
        lo, hi = shard_bounds(self.numel, me, len(local))
        self.staged_bytes += (hi - lo) * (nbytes // max(1, self.numel))

        def prepare() -> list[torch.Tensor]:
            wait_for_peers(self.ops, side, self.posted, self.rank)  # None for another host's ranks
            return self._host_buffers()

        return _Across(across_hosts(self.service, side, prepare, me, self._wide[:nbytes].view(stage), prescale,
                                    postscale, average, self.rank, self.size, self.done[self.rank], name,
                                    process_set, lambda: None))

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


class _Across:
    """A bucket reduced across hosts: ``reduced.wait()`` gives its :class:`OnDevice`."""

    __slots__ = ("reduced",)

    def __init__(self, reduced: Any) -> None:
        self.reduced = reduced


class _Home:
    """A bucket reduced through host memory instead (a rank had joined): ``back`` gives the event
    of the copy home."""

    __slots__ = ("back",)

    def __init__(self, back: Any) -> None:
        self.back = back


def share_buckets(buckets: Sequence[IpcBucket], rank: int, size: int, op_ok: bool, flat_ok: bool,
                  process_set: Any) -> bool:
    """Set-up, on every rank of the job at once: decide the path (:func:`choose_path` on each host,
    then every rank's verdict: all take it or none; logged once) and, for the device path, share
    every bucket's buffer and events with the ranks of its host.  Returns the choice."""
    svc = buckets[0].service if buckets else None
    device = -1 if svc is None else (svc.device.index or 0)
    every_rank = _rc.allgather_object((device, _rc.api.hostname(), len(buckets)), name="device_ipc.devices",
                                      process_set=process_set)
    devices = [int(d) for d, _, _ in every_rank]
    hosts = [str(h) for _, h, _ in every_rank]
    counts = [int(c) for _, _, c in every_rank]
    ipc = ipc_for(svc.ops) if svc is not None else None

    def reachable(a: int, b: int) -> bool:
        return ipc is not None and min(a, b) >= 0 and ipc.peer_access(a, b)

    use, reason = choose_path(True, hosts, rank, devices, reachable, op_ok, flat_ok)
    if use and len(set(counts)) != 1:
        use, reason = False, f"the ranks form different numbers of CUDA buckets ({counts})"
    verdicts = _rc.allgather_object((use, reason), name="device_ipc.verdicts", process_set=process_set)
    refused = [(k, why) for k, (ok, why) in enumerate(verdicts) if not ok]
    if refused:  # the same choice on every rank: the ops' names differ between the two paths
        k, why = refused[0]
        use, reason = False, why if all(w == why for _, w in verdicts) else f"rank {k}: {why}"
    log_once(use, reason)
    if not use:
        return False
    local = next(g for g in host_groups(hosts) if rank in g)
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
            b.open(rank, local, [every[k][0][i] if k in local else None for k in range(size)])
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
