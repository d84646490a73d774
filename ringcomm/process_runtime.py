"""The runtime object of one process: what ``init()`` builds, and what it does for every op.

A :class:`Runtime` holds the settings, the topology, the dispatcher (the engine and the small-op
lane: :class:`~ringcomm.dispatch.Dispatcher`), the names of the ops in flight and the naming of
unnamed ones (:class:`~ringcomm.core.naming.OpNames`).  Each collective names its call
(:meth:`Runtime.name_op`), checks its arguments inside :meth:`Runtime.refusing` and submits
(:meth:`Runtime.submit`), which takes the name and hands the op to the dispatcher.
:mod:`ringcomm.runtime` makes the one runtime of the process and answers the calls that need it.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from .core import wire
from .core.naming import WIRE_KINDS, ClaimedName, OpCall, OpNames
from .core.process_sets import ProcessSet, global_process_set
from .elastic import worker as elastic_worker
from .dispatch import Dispatcher
from .errors import DuplicateNameError, InvalidInputError, InvalidTypeError, name_rank
from .handles import Handle
from .job import config, horovod_env, logsetup, topology

log = logging.getLogger("ringcomm.runtime")  # init()'s story is told under the runtime's name
#: How long a rank that refused a call waits for rank 0 to answer the refusal on every rank
#: (the others have submitted the op by then in a program in step; no longer than that)
_REFUSAL_ANSWER_SECONDS = 2.0


class Runtime:
    """Everything ``init()`` creates: topology, settings, the dispatcher and its engine, process sets and
    the in-flight names."""

    def __init__(self, round_: int, dynamic_sets: bool = False, settings: config.Settings | None = None) -> None:
        self.settings = settings if settings is not None else config.Settings.from_env()
        logsetup.apply_level(self.settings.log_level)  # only when RINGCOMM_LOG_LEVEL is given
        for name in horovod_env.without_meaning(os.environ):
            log.warning(
                "%s is set but has no meaning in ringcomm (ignored); see the environment variables page "
                "for the HOROVOD_* settings ringcomm reads", name)
        if log.isEnabledFor(logging.DEBUG):
            changed = {f.name: getattr(self.settings, f.name) for f in dataclasses.fields(self.settings)
                       if getattr(self.settings, f.name) != f.default}
            log.debug("init(): settings other than the defaults: %s", changed or "none")
        self.topo = elastic_worker.topology_from_env()  # the environment's, or the elastic driver's
        _log_topology(self.topo)
        self.round = round_
        self.pid = os.getpid()  # a child forked after init() shares none of the engine's threads or sockets
        self.dynamic_sets = dynamic_sets
        self.all_ranks = tuple(range(self.topo.size))
        # the small-op lane's owner and the engine (which meets the other ranks and makes the lane)
        self.dispatcher = Dispatcher.connect(self.topo, self.settings,
                                             round_ if self.topo.round is None else self.topo.round)
        self.engine = self.dispatcher.engine
        # what the launcher did not say (e.g. Open MPI's host index) follows from every rank's host
        self.topo = topology.with_placement(self.topo, [str(p["host"]) for p in self.engine.peer_table])
        log.debug("rank %d: placement: local rank %d of %d, cross rank %d of %d (%d host(s) in the job)",
                  self.topo.rank, self.topo.local_rank, self.topo.local_size, self.topo.cross_rank,
                  self.topo.cross_size, len({str(p["host"]) for p in self.engine.peer_table}))
        # the engine's thread, then the lane's driver: small ops of the global set skip the engine
        self.dispatcher.start()
        self._lock = threading.Lock()
        self._names: set[tuple[int, str]] = set()
        self._claimed: set[tuple[int, str]] = set()  # of those, names taken before their op is submitted
        self._naming = OpNames()  # the names of unnamed ops (under the lock)

    def auto_name(self, kind: str, name: str | None, pset: int = 0) -> str:
        """``name``, or the next ``kind.noname.N`` of this process set (see :class:`~ringcomm.core.naming.OpNames`).

        Before an unnamed op is numbered, the ops rank 0 failed as stalled that this rank skipped
        are counted, so that its number pairs with the others'.
        """
        if name is not None:
            name = self._naming.name(kind, name, pset)
        else:
            skipped = self.engine.skipped_ops
            with self._lock:
                self._naming.caught_up(_drained(skipped))
                name = self._naming.name(kind, None, pset)
        return name

    def name_op(self, kind: str, name: str | None, pset: int = 0) -> OpCall:
        """Name a call of kind ``kind`` (as :meth:`auto_name`), before its arguments are checked: the
        :class:`~ringcomm.core.naming.OpCall` to refuse if they are (:meth:`refusing`)."""
        return OpCall(self.topo.rank, WIRE_KINDS[kind], self.auto_name(kind, name, pset), pset)

    def refusing(self, call: OpCall) -> Refusing:
        """Within the block, the checks of ``call``'s arguments and its submission: an
        InvalidInputError or InvalidTypeError raised there is refused on every member of the op
        (:meth:`refuse`), then propagates (a DuplicateNameError is not: the name is taken here,
        and the op in flight under it is the others' to pair with)."""
        return Refusing(self, call)

    @property
    def rank(self) -> int:
        """This process's rank in the job."""
        return self.topo.rank

    def refuse(self, call: OpCall, reason: str) -> None:
        """Tell rank 0 this rank will not run the op of ``call``, and why: it fails on every member with
        the reason, so the others do not wait for this rank (nothing waits for this rank's own handle).

        The one way a call is refused: the core API's checks through :meth:`refusing`, layers above
        the core through ``ringcomm.api.refuse_call``."""
        name = call.name
        try:
            handle = self.dispatcher.refuse(call.refusal(reason))
        except Exception as exc:  # the engine is gone: the caller's own error says enough
            log.debug("rank %d: could not report the refused op %r: %s", self.topo.rank, name, exc)
            return
        # Wait (briefly) until rank 0 has answered the refusal on every rank: a program that ends on
        # this rank's error must not leave before that answer, or the others would see only a lost
        # peer (and an elastic job would re-form instead of ending with the error).
        try:
            handle.wait(_REFUSAL_ANSWER_SECONDS)
        except Exception as exc:  # the answer is the refusal's own error (expected), or none came in time
            log.debug("rank %d: the refused op %r: %s", self.topo.rank, name, exc)

    def resolve_set(self, process_set: Any, what: str) -> tuple[int, tuple[int, ...]]:
        """``(set id, global ranks)`` of ``process_set``; raises unless it is registered and has this rank."""
        if process_set is None or process_set is global_process_set:
            return 0, self.all_ranks
        if not isinstance(process_set, ProcessSet):
            raise InvalidTypeError(f"{what}: process_set must be a ProcessSet, got {type(process_set).__name__}")
        pid = process_set.process_set_id
        if pid == 0:
            return 0, self.all_ranks
        ranks = self.engine.set_ranks(pid) if pid is not None and process_set.registered_round == self.round else None
        if pid is None or ranks is None or process_set.ranks is None or tuple(process_set.ranks) != ranks:
            raise InvalidInputError(
                f"{what}: {process_set!r} is not a registered process set of this job; pass it to "
                "init(process_sets=[...]) or add_process_set() (on every rank) first"
            )
        if self.topo.rank not in ranks:
            raise InvalidInputError(
                f"{what}: rank {self.topo.rank} is not in process set {pid} (ranks {list(ranks)}); "
                "only its members may run collectives on it (check ps.included() first)"
            )
        return pid, ranks

    def _duplicate(self, kind: str, name: str, pset: int) -> DuplicateNameError:
        return DuplicateNameError(
            f"{kind}: an op named {name!r} is already in flight on rank {self.topo.rank}"
            f"{' in process set %d' % pset if pset else ''}; wait for it (synchronize) or use another name"
        )

    def claim_name(self, kind: str, name: str, pset: int) -> ClaimedName:
        """Take ``name`` for an op that is submitted later, from another thread (a layer above
        that first copies the op's data): a second op of that name raises now, as it would if
        this one were submitted already.  The op submitted under the returned name uses the
        claim; any other op of that name raises until the claimed op is done or the claim dropped."""
        key = (pset, name)
        with self._lock:
            if key in self._names:
                raise self._duplicate(kind, name, pset)
            self._names.add(key)
            self._claimed.add(key)
        return ClaimedName(name)

    def drop_claim(self, name: str, pset: int) -> None:
        """Give back a claimed name whose op was never submitted (nothing if it was)."""
        key = (pset, name)
        with self._lock:
            if key in self._claimed:
                self._claimed.discard(key)
                self._names.discard(key)

    def submit(self, req: wire.Request, arrays: list[np.ndarray], outs: list[np.ndarray | None] | None = None,
               grouped: bool = False) -> Handle:
        name = req.name
        claimed = type(name) is ClaimedName  # the op whose name was claimed when it was made
        if claimed:
            name = str(name)
            req = req._replace(name=name)
        key = (req.pset, name)
        with self._lock:
            if claimed and key in self._claimed:
                self._claimed.discard(key)
            elif key in self._names:
                raise self._duplicate(req.kind, name, req.pset)
            self._names.add(key)
        # the name is free again once the op finishes: one set operation, atomic on its own (only
        # the check and the add above must happen together)
        release = functools.partial(self._names.discard, key)
        try:  # with the count of this rank's other ops in flight
            return self.dispatcher.submit(req, arrays, outs or [], grouped, release, len(self._names) - 1)
        except BaseException:
            release()
            raise

    def after_join(self) -> None:
        """Every rank has joined: unnamed ops are numbered from 0 again (see :meth:`auto_name`) and
        the small-op lane, off since this rank joined, starts again.

        Every rank runs the lane's barrier, a rank without a lane too (the lane's owner sees to it):
        ranks may disagree on having one (a rank that could not map rank 0's region runs without
        it), and a rank that skipped the barrier would leave the others waiting in it.
        """
        with self._lock:
            name = f"ringcomm.lane.rejoin.{self._naming.joined()}"

        def barrier() -> None:
            self.submit(wire.Request(name, wire.BARRIER), []).wait()
        self.dispatcher.reopen_after_join(barrier)

    def shutdown(self, timeout: float) -> None:
        """Leave the job, waiting up to ``timeout`` for the other ranks (0: not at all)."""
        self.dispatcher.shutdown(timeout)  # the lane, then the engine


class Refusing:
    """The block of :meth:`Runtime.refusing`: refuses ``call`` on the errors raised in it that a
    refusal covers, then lets them propagate.  A class rather than a ``@contextmanager``: it runs once
    per op."""

    __slots__ = ("call", "runtime")

    def __init__(self, runtime: Runtime, call: OpCall) -> None:
        self.runtime, self.call = runtime, call

    def __enter__(self) -> OpCall:
        return self.call

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if (isinstance(exc, (InvalidInputError, InvalidTypeError)) and not isinstance(exc, DuplicateNameError)
                and not exc.refused):
            self.runtime.refuse(self.call, str(exc))
            exc.refused = True
            name_rank(exc, self.runtime.rank)


def _drained(queue: collections.deque[tuple[int, str]]) -> Iterator[tuple[int, str]]:
    """The items of ``queue``, each taken off it, until it is empty (the engine's thread appends)."""
    while queue:
        yield queue.popleft()


def _log_topology(topo: topology.Topology) -> None:
    """DEBUG: where this rank's place in the job came from, and where it will meet the others."""
    if not log.isEnabledFor(logging.DEBUG):
        return
    if topo.size == 1:
        log.debug("rank 0 of 1 (topology: %s): a single process; no sockets, no rendezvous", topo.source)
        return
    derived = f"; {', '.join(topo.derive)} worked out at the rendezvous" if topo.derive else ""
    hosting = f", hosted by this rank on {topo.rendezvous_bind}" if topo.host_rendezvous else ""
    log.debug("rank %d of %d (topology: %s%s), host %s, job %s: binds and advertises %s; rendezvous %s%s",
              topo.rank, topo.size, topo.source, derived, topo.hostname, topo.job_id, topo.addr,
              topo.rendezvous, hosting)
