"""What the lane's driver keeps and leans on: its states, the engine side it diverts to, its op records.

The driver (:mod:`ringcomm.lane.driver`) holds one :class:`State`; an op a rank submits is
a :class:`Queued` record until it takes an index, then (if it went fast) a :class:`Pending`
one until the index resolves.  What the driver needs of the engine is :class:`EngineSide`,
handed to it as one object: it calls down into the engine, never into its private state.
"""

from __future__ import annotations

import enum
import threading
from typing import Protocol

from ..core import lane, wire
from ..handles import Entry, Handle


class State(enum.Enum):
    """Where this rank's side of the lane stands.

    OPEN: posts every op of the global set.  OFF: posts no more (an op waited past the stall
    deadline, or rank 0 failed one as stalled); what it submits goes to the engine.  CLOSING: ``close()`` or a join began: posts no more and
    resolves what it posted fast.  CLOSED: that is over; only a restart after a join reopens it.
    """

    OPEN = "open"
    OFF = "off"
    CLOSING = "closing"
    CLOSED = "closed"


class EngineSide(Protocol):
    """What the lane needs of the engine: the one way its ops reach the engine, and two facts.

    The engine (:class:`ringcomm.engine.Engine`) is one; a test passes a fake."""

    def submit(self, entry: Entry) -> Handle:
        """Hand ``entry`` to the engine (rank 0 negotiates it); raises once the engine has failed."""
        ...

    @property
    def failure(self) -> BaseException | None:
        """The engine's error once it has failed (a lost peer), else None."""
        ...

    @property
    def timeline_active(self) -> bool:
        """True while a timeline is written: this rank then posts nothing fast (the engine times ops)."""
        ...

    def lane_stalled(self, name: str) -> None:
        """Op ``name`` waited in the lane past the stall deadline: have every rank stop posting."""
        ...


class Queued:
    """An op submitted, not yet posted (the slot of its index is still read, or a peer is behind)."""

    __slots__ = ("entry", "key", "nbytes", "others", "deadline", "posted", "fast")

    def __init__(self, entry: Entry, key: int, nbytes: int, others: int, deadline: float) -> None:
        self.entry, self.key, self.nbytes, self.others, self.deadline = entry, key, nbytes, others, deadline
        self.posted = self.fast = False  # set once posted: fast, or for the engine


class Pending:
    """An op posted fast, its index not resolved yet (``warned``: stall warnings given for it;
    ``reported``: it waited past the stall deadline and the engine was told)."""

    __slots__ = ("entry", "key", "posted_at", "nbytes", "warned", "reported")

    def __init__(self, entry: Entry, key: int, posted_at: float, nbytes: int) -> None:
        self.entry, self.key, self.posted_at, self.nbytes = entry, key, posted_at, nbytes
        self.warned, self.reported = 0, False

    @property
    def own(self) -> lane.Seen:
        """This rank's slot, as the others read it."""
        return lane.Seen(True, False, True, self.key, self.nbytes)


def reacquire(cond: threading.Condition) -> None:
    """Take ``cond``'s lock back after waiting without it, even if a signal handler raises meanwhile.

    A blocked ``acquire()`` on the main thread runs signal handlers; one that raises (SIGINT's
    KeyboardInterrupt, a handler calling ``sys.exit``) makes it return *without* the lock, and the
    caller's ``with`` would then release the lock another thread holds (the sweeper, mid-op): the
    lock ends up taken by no one and ``shutdown()`` waits for it forever.  The handler's exception
    is raised once the lock is held."""
    raised: BaseException | None = None
    while True:
        try:
            cond.acquire()
            break
        except BaseException as exc:  # noqa: BLE001 - re-raised below, with the lock held
            raised = exc
    if raised is not None:
        raise raised


def naming(err: BaseException, req: wire.Request, missing: list[int]) -> BaseException:
    """The engine's failure, for an op it ends while the op waits in the lane: the engine's message
    lists only the ops it holds, so this one adds the lane's op and the ranks it waited for."""
    try:
        named = type(err)(f"{err}; {req.kind} {req.name!r} was waiting in the small-op lane for "
                          f"rank(s) {missing}")
    except Exception:  # noqa: BLE001 - an error type that takes other arguments: keep it as it is
        return err
    named.__cause__ = err.__cause__
    return named
