"""The runtime of one process: ``init()``, ``shutdown()``, the job's layout and its process sets.

:func:`init` builds one :class:`~ringcomm.process_runtime.Runtime` (settings, topology, the
engine and its thread, the names of ops; :mod:`ringcomm.process_runtime`); every call that needs it asks :func:`current` (refused in a process
forked after ``init()``) or :func:`layout` (rank and size: answered there too).
The collectives themselves are in :mod:`ringcomm.api`.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any

from .job import config
from .core import wire
from .core.naming import OpCall
from .errors import (
    ForkedProcessError,
    InvalidInputError,
    InvalidTypeError,
    NotInitializedError,
    RendezvousAbortedError,
)
from .core.process_sets import ProcessSet, as_process_set, global_process_set, use_rank_source
from .process_runtime import Runtime as Runtime  # re-exported: the runtime init() makes

log = logging.getLogger("ringcomm.runtime")

_runtime: Runtime | None = None
_rounds = 0
_init_lock = threading.Lock()
_atexit_registered = False
_dying = threading.Event()  # the main thread died of an uncaught exception


def _leave_timeout() -> float:
    """How long ``shutdown()`` waits for the other ranks: not at all once the main thread died."""
    return 0.0 if _dying.is_set() else 10.0


def _install_excepthook() -> None:
    """Note an uncaught exception, so the exit-time shutdown leaves at once instead of waiting for peers.

    The peers then see this rank's connections close and fail with PeerLostError naming it.
    """
    previous = sys.excepthook

    def hook(exc_type, exc, tb):  # type: ignore[no-untyped-def]
        _dying.set()
        previous(exc_type, exc, tb)

    sys.excepthook = hook


#: Rounds an elastic worker's init() tries when the driver calls off the new world's rendezvous.
_ABORTED_ROUNDS_TRIED = 20


def _new_runtime(dynamic: bool, settings: config.Settings | None) -> Runtime:
    """A runtime for the next round; an elastic worker whose round the driver called off (a member died
    before it arrived) goes back to the driver for the next world at once."""
    global _rounds
    for attempt in range(1, _ABORTED_ROUNDS_TRIED + 1):
        try:
            rt = Runtime(_rounds, dynamic, settings)
        except RendezvousAbortedError as exc:
            _rounds += 1
            if attempt == _ABORTED_ROUNDS_TRIED:
                raise
            log.warning("%s; joining the launcher's next membership", exc)
            continue
        _rounds += 1
        return rt
    raise AssertionError("unreachable")


def init(process_sets: Sequence[ProcessSet] | str | None = None, *, settings: config.Settings | None = None) -> None:
    """Join the job described by the environment (``ringcomm-run``, torchrun, or none: size 1).

    Blocks until every rank has arrived (RINGCOMM_START_TIMEOUT).  Calling it
    again while initialized does nothing (with ``process_sets`` it raises: they
    could not be registered); after :func:`shutdown` it starts anew.

    ``process_sets``: a list of :class:`ProcessSet` to register now (the same
    list on every rank; they get ids 1, 2, ... in order), or ``"dynamic"`` to
    allow :func:`add_process_set` / :func:`remove_process_set` later.

    ``settings``: the :class:`~ringcomm.job.config.Settings` to run with instead of those the
    ``RINGCOMM_*`` / ``HOROVOD_*`` variables give (e.g. ``Settings.from_env()`` with changes)::

        rc.init(settings=dataclasses.replace(rc.Settings.from_env(), fusion_threshold=0))

    The job's layout (rank, size, rendezvous) always comes from the environment.
    """
    global _runtime, _atexit_registered
    if settings is not None and not isinstance(settings, config.Settings):
        raise InvalidTypeError(f"init(settings=...): expected a ringcomm.Settings, got {type(settings).__name__}")
    dynamic = isinstance(process_sets, str)
    if dynamic and process_sets != "dynamic":
        raise InvalidInputError(f"init(process_sets={process_sets!r}): pass a list of ProcessSet or 'dynamic'")
    if process_sets is None and (settings or config.Settings.from_env()).dynamic_process_sets:
        dynamic = True  # RINGCOMM_DYNAMIC_PROCESS_SETS / HOROVOD_DYNAMIC_PROCESS_SETS
    static = [] if dynamic or process_sets is None else [as_process_set(p, "init(process_sets=...)")
                                                          for p in process_sets]
    with _init_lock:
        if _runtime is not None:
            if process_sets is not None:  # silently dropping the sets would leave them unregistered
                raise InvalidInputError(
                    f"init(process_sets=...) on rank {_runtime.topo.rank}: ringcomm is already initialized, so "
                    "these process sets would not be registered; pass them to the first init(), or use "
                    "add_process_set() after init(process_sets='dynamic') (or shutdown() first)")
            return
        rt = _new_runtime(dynamic, settings)
        global_process_set.ranks = list(rt.all_ranks)
        global_process_set.registered_round = rt.round
        try:
            for ps in static:
                register(rt, ps, "init(process_sets=...)")
        except BaseException:
            rt.shutdown(_leave_timeout())
            raise
        _runtime = rt
        if not _atexit_registered:
            atexit.register(shutdown)
            _install_excepthook()
            _atexit_registered = True


def shutdown() -> None:
    """Leave the job: waits (briefly) for the other ranks, then closes every socket."""
    global _runtime
    with _init_lock:
        rt, _runtime = _runtime, None
    if rt is not None and rt.pid == os.getpid():
        rt.shutdown(_leave_timeout())
    # in a child forked after init() the engine's sockets belong to the parent: leave them alone


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Write a Chrome-trace timeline of rank 0's ops to ``file_path`` until :func:`stop_timeline`."""
    current("start_timeline").engine.start_timeline(file_path, mark_cycles)


def stop_timeline() -> None:
    """Finish and close the timeline file."""
    current("stop_timeline").engine.stop_timeline()


def current_settings() -> config.Settings:
    """The settings in force: the running job's, or (before ``init()``) those the environment gives."""
    rt = _runtime
    return rt.settings if rt is not None else config.Settings.from_env()


def timeline_active() -> bool:
    """True while this rank is writing a timeline (so framework layers may add their own spans)."""
    rt = _runtime
    return rt is not None and rt.engine.timeline is not None


def timeline_span(name: str, phase: str, start: float, end: float, args: dict[str, Any] | None = None) -> None:
    """Add a ``phase`` span (``time.perf_counter()`` seconds) to op ``name``'s row of the timeline.

    For framework layers (e.g. ``ringcomm_torch``'s device<->host copies, with ``args`` such as
    the parameters a gradient bucket carries); a no-op when no timeline is being written.
    Safe from any thread.
    """
    rt = _runtime
    tl = rt.engine.timeline if rt is not None else None
    if tl is not None:
        tl.span(name, phase, start, end, args)


def is_initialized() -> bool:
    return _runtime is not None


def active() -> Runtime | None:
    """The runtime of this process, or None before ``init()`` and after ``shutdown()``."""
    return _runtime


def layout(what: str) -> Runtime:
    """The runtime, for questions about the job's layout (answered in forked children too)."""
    rt = _runtime
    if rt is None:
        raise NotInitializedError(f"ringcomm.{what}() needs ringcomm.init() first (or was called after shutdown())")
    return rt


def current(what: str) -> Runtime:
    """The runtime, for anything that needs its engine: refused in a process forked after init()."""
    rt = layout(what)
    if rt.pid != _pid:
        raise ForkedProcessError(
            f"ringcomm.{what}() on rank {rt.topo.rank}: this process (pid {os.getpid()}) was forked from the "
            f"rank's process (pid {rt.pid}) after init(), and the job's engine thread and sockets exist only "
            "there. Call collectives from the process that called init(); for worker processes that need "
            "them, start them with the 'spawn' or 'forkserver' method (multiprocessing.set_start_method, "
            "DataLoader(multiprocessing_context='spawn')). rank(), size() and the other layout queries work "
            "in forked children.")
    return rt


def _after_fork_in_child() -> None:
    # a lock held by another thread at the moment of fork() stays held forever in the child
    global _init_lock, _pid
    _init_lock = threading.Lock()
    _pid = os.getpid()


_pid = os.getpid()  # this process's, kept up to date across fork(): current() runs on every op


os.register_at_fork(after_in_child=_after_fork_in_child)


def rank() -> int:
    """This process's rank, 0..size()-1."""
    return layout("rank").topo.rank


def size() -> int:
    """Number of processes in the job."""
    return layout("size").topo.size


def local_rank() -> int:
    """Rank among the processes on this host (use it to pick a GPU)."""
    return layout("local_rank").topo.local_rank


def local_size() -> int:
    return layout("local_size").topo.local_size


def cross_rank() -> int:
    """Index of this host among the job's hosts."""
    return layout("cross_rank").topo.cross_rank


def cross_size() -> int:
    return layout("cross_size").topo.cross_size


def hostname() -> str:
    """This rank's host, as the job names it (``RINGCOMM_HOSTNAME``, the launcher's name, or the system's)."""
    return layout("hostname").topo.hostname


use_rank_source(rank)


# ---------------------------------------------------------------------------
# process sets


def register(rt: Runtime, ps: ProcessSet, what: str, call: OpCall | None = None) -> ProcessSet:
    """Register ``ps`` on every rank (a collective of the global set); sets its id.

    ``call``: the op, named before the arguments were checked: when this rank refuses them, rank 0
    hears of it and the call fails on every rank instead of leaving the others waiting.
    """
    if call is None:
        done = _check_new_set(rt, ps, what)
    else:
        with rt.refusing(call):
            done = _check_new_set(rt, ps, what)
    if done is not None:
        return done
    name = call.name if call is not None else rt.auto_name(wire.ADD_PSET, None)
    req = wire.Request(name, wire.ADD_PSET, set_ranks=tuple(ps.ranks or ()))
    ps.process_set_id = int(rt.submit(req, []).wait())
    ps.registered_round = rt.round
    return ps


def _check_new_set(rt: Runtime, ps: ProcessSet, what: str) -> ProcessSet | None:
    """Raise if ``ps`` cannot be registered; ``ps`` when it needs no new set; None when it must be added."""
    if ps.ranks is None:
        raise InvalidInputError(f"{what}: {ps!r} was removed; create a new ProcessSet")
    bad = [r for r in ps.ranks if r >= rt.topo.size]
    if not ps.ranks or bad:
        raise InvalidInputError(
            f"{what}: ranks {ps.ranks} do not form a process set of this job of size {rt.topo.size}; "
            f"use a non-empty list of ranks in 0..{rt.topo.size - 1}"
        )
    if tuple(ps.ranks) == rt.all_ranks:  # every rank: that is the global set (as in Horovod)
        ps.process_set_id, ps.registered_round = 0, rt.round
        return ps
    existing = rt.engine.find_set(tuple(ps.ranks))
    if existing is not None and what.startswith("init"):  # the same ranks twice in init(): one set
        ps.process_set_id, ps.registered_round = existing, rt.round
        return ps
    if existing is not None:  # every rank sees the same registry here: all raise alike
        raise InvalidInputError(f"{what}: a process set with ranks {ps.ranks} already exists (id {existing})")
    return None


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a new process set at run time; every rank must call it, with the same ranks, in the same order.

    Needs ``init(process_sets="dynamic")``.  Returns the registered set::

        odd = rc.add_process_set([1, 3])   # every rank: ProcessSet(process_set_id=1, ranks=[1, 3])
    """
    rt = current("add_process_set")
    if not rt.dynamic_sets:
        raise InvalidInputError(
            "add_process_set: process sets can be added at run time only after init(process_sets='dynamic'); "
            "or pass them to init(process_sets=[...])"
        )
    call = rt.name_op(wire.ADD_PSET, None)  # on every rank, before any check: a refusal names this op
    with rt.refusing(call):
        ps = as_process_set(process_set, "add_process_set")
        if (ps.process_set_id is not None and ps.registered_round == rt.round
                and rt.engine.set_ranks(ps.process_set_id)):
            raise InvalidInputError(f"add_process_set: {ps!r} is already registered")
    return register(rt, ps, "add_process_set", call)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a set on every rank (every rank calls it, in the same order); returns True when removed.

    The global set is never removed (returns False).  ``process_set`` is
    invalidated: its id and ranks become None.  Ops of the set that were still
    waiting for members fail.
    """
    rt = current("remove_process_set")
    if not rt.dynamic_sets:
        raise InvalidInputError("remove_process_set: needs init(process_sets='dynamic')")
    if not isinstance(process_set, ProcessSet):
        raise InvalidTypeError(f"remove_process_set: expected a ProcessSet, got {type(process_set).__name__}")
    if process_set is global_process_set or process_set.process_set_id == 0:
        return False
    pid = process_set.process_set_id
    if pid is None or process_set.registered_round != rt.round or rt.engine.set_ranks(pid) is None:
        raise InvalidInputError(f"remove_process_set: {process_set!r} is not a registered process set")
    req = wire.Request(rt.auto_name(wire.REMOVE_PSET, None), wire.REMOVE_PSET, set_id=pid)
    rt.submit(req, []).wait()
    process_set.invalidate()
    return True


def resolve_process_set(process_set: Any, what: str) -> tuple[int, tuple[int, ...]]:
    """``(set id, global ranks)`` of a registered set that includes this rank; raises otherwise.

    For layers above the core (ringcomm_torch) that check ``process_set=`` before staging data.
    """
    return current(what).resolve_set(process_set, what)


def process_set_ids() -> list[int]:
    """Ids of the registered process sets (0 is the global set)."""
    return current("process_set_ids").engine.set_ids()
