"""Each rank's *arena*: one shared device buffer (``RINGCOMM_DEVICE_IPC_ARENA_BYTES``) and two
interprocess events (*posted*, *done*), through which the per-tensor CUDA ops of
:mod:`.device_arena_ops` move among a host's ranks on the device (CUDA IPC) instead of through
pinned host memory: allreduces of at least ``RINGCOMM_DEVICE_IPC_MIN_BYTES`` (``hvd.allreduce`` and
its forms, SyncBatchNorm's backward sums, the ``"ringcomm"`` backend's, so DDP's buckets), and,
in a job on one host, broadcasts (DDP's buffers each forward), and the backend's allgathers and
reduce-scatters (FSDP's).

At the first op that may take this path the ranks share their arenas and events without
waiting: one allreduce of a row per rank holding its pickled handles, which a return thread
opens.  A rank offers ranges (:class:`~.device_arena_rows.Slots`) once it has opened every
peer's arena.  Until then, and whenever a tensor does not fit in what is free, it offers none,
and the op takes pinned memory on every rank.

The sharing is an allreduce, as every op's agreements are, because after ``hvd.join()`` only
allreduces proceed: a rank that has joined adds zeros, which read in the sharing as "try again
at the next op".
"""

from __future__ import annotations

import logging
import pickle
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import ringcomm as _rc
from ringcomm.core.ops import Average, Sum
from ringcomm.core.process_sets import global_process_set

from .device import DeviceService, FakeOps, service_for
from .device_arena_rows import Slots
from .device_ipc import choose_path, host_groups
from .device_ipc_ops import ipc_for

__all__ = ["Arena", "arena_for", "one_host_arena_for"]

_log = logging.getLogger(__name__)

#: Bytes each rank has for its pickled handles in the sharing op (CUDA's take well under 1 KiB).
SHARE_ROW_BYTES = 4096


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

    def opened_everywhere(self) -> None:
        """Every rank has opened every arena (an op's agreement offered ranges on every rank): the
        fake's files may go, once."""
        if not self._unlinked:
            self._unlinked = True
            self.ipc.opened()

    def view(self, k: int, offset: int, t: torch.Tensor) -> torch.Tensor:
        """Rank ``k``'s range at ``offset`` (``k`` on this host), flat, in ``t``'s dtype."""
        nbytes = t.numel() * t.element_size()
        peer = self.peers[k]
        assert peer is not None, f"rank {k} is on another host"
        return peer[offset:offset + nbytes].view(t.dtype)


_arenas: dict[int, Arena] = {}
_arenas_lock = threading.Lock()


def arena_for(t: torch.Tensor, op: Any, process_set: Any) -> Arena | None:
    """This rank's arena when an allreduce of ``t`` with ``op`` over ``process_set`` takes it (see
    :func:`~.device_arena_ops.allreduce`), else None.  Every input is alike on every rank of a valid
    op (the settings, the job's layout, the op, the set, the dtype, the size), so every rank decides alike."""
    if not _reduces(t, op):
        return None
    return _arena(t, process_set, one_host=False)


def one_host_arena_for(t: torch.Tensor, process_set: Any, op: Any = None) -> Arena | None:
    """This rank's arena when an op of ``t`` over ``process_set`` whose ranks read each other's
    arenas takes it (a broadcast, an allgather; a reduce-scatter with ``op``): every rank on one host;
    any dtype unless the op reduces; else None; alike on every rank, as :func:`arena_for`."""
    if not isinstance(t, torch.Tensor) or (op is not None and not _reduces(t, op)):
        return None
    return _arena(t, process_set, one_host=True)


def _reduces(t: Any, op: Any) -> bool:
    """Whether the device sums ``t`` for ``op``: Sum or Average of a floating-point tensor."""
    return op in (Sum, Average) and isinstance(t, torch.Tensor) and t.is_floating_point()


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
    # ranks that read each other's arenas: one host; an allreduce sums a host's ranks: two or more
    if n < 2 or (hosts != 1 if one_host else hosts == n):
        return None
    with _arenas_lock:
        arena = _arenas.get(id(svc.ops))
        if arena is None or arena.settings is not settings:
            arena = _arenas[id(svc.ops)] = Arena(svc, settings, _rc.api.rank(), n)
        return arena
