"""Elastic state and the ``run`` decorator, framework-agnostic (Horovod's ``horovod.common.elastic``).

A training function wrapped with :func:`run` is re-entered after every change
of membership::

    state = ObjectState(epoch=0, weights=w)

    @run
    def train(state):
        for state.epoch in range(state.epoch, 10):
            ...                      # collectives
            state.commit()           # save; raise HostsUpdatedInterrupt if hosts changed

    train(state)

What each rank sees when one of four workers dies in epoch 5 (last commit
after epoch 4):

- the three survivors get ``HorovodInternalError`` (``PeerLostError``) from a
  collective; ``run`` calls ``state.restore()`` (back to the epoch-4 commit),
  ``shutdown()`` and ``init()`` -- which waits for the driver's new world --
  then the reset callbacks, then ``state.sync()`` (rank 0's committed state to
  everyone) and calls ``train(state)`` again: now ``size() == 3``, and
  ``state.epoch == 5``.
- when the driver reports new hosts, every rank raises ``HostsUpdatedInterrupt``
  in the same ``commit()``; no restore is needed (the state was just saved);
  the new workers start ``train(state)`` after the same ``sync()``.
"""

from __future__ import annotations

import abc

import copy
import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from .. import api
from ..errors import HorovodInternalError, HostsUpdatedInterrupt, MismatchError, RendezvousError, StallError
from . import worker

__all__ = ["State", "ObjectState", "run", "run_fn"]

log = logging.getLogger("ringcomm.elastic")
F = TypeVar("F", bound=Callable[..., Any])
#: How often a reset is retried when the new world's rendezvous times out (a worker died during it).
_RESET_ATTEMPTS = 5


class State(abc.ABC):
    """Tracks what must survive a membership change; subclasses say how to save, restore and sync it.

    ``bcast_object(obj)`` returns rank 0's ``obj`` on every rank; ``get_rank()``
    is this process's rank (both default to ringcomm's own).
    """

    def __init__(self, bcast_object: Callable[[Any], Any] | None = None,
                 get_rank: Callable[[], int] | None = None) -> None:
        self._bcast_object = bcast_object or (lambda obj: api.broadcast_object(obj, 0))
        self._rank = get_rank or api.rank
        self._reset_callbacks: list[Callable[[], None]] = []
        #: Horovod's name for the driver's pending host notifications; its scripts poll
        #: ``state._host_messages.empty()`` to wait until the driver has seen a change of hosts.
        self._host_messages = HostNotices()

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Call ``callbacks`` after every reset (workers added or removed), before ``sync()``.

        Typical use: scale the learning rate to the new ``size()``.
        """
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state (the point a failure rolls back to), then :meth:`check_host_updates`.

        Collective: every rank must commit at the same step.
        """
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` on every rank when the driver found new (or lost) hosts.

        Rank 0 asks the driver; its answer is broadcast, so all ranks raise at the
        same step or none does.  Collective.
        """
        updated = worker.hosts_updated() if self._rank() == 0 else False
        if self._bcast_object(updated):
            raise HostsUpdatedInterrupt("the hosts of this elastic job changed; re-forming at this commit")

    @abc.abstractmethod
    def save(self) -> None:
        """Keep a copy of the current state in memory."""

    @abc.abstractmethod
    def restore(self) -> None:
        """Go back to the last saved state, undoing uncommitted changes."""

    @abc.abstractmethod
    def sync(self) -> None:
        """Make every rank's state rank 0's (collective)."""


class HostNotices:
    """Whether the driver has news of the hosts, read the way Horovod's queue of notifications is.

    ``empty()`` is False from the moment the elastic driver has found hosts added or removed
    since this process's world was formed (one question to the driver; always True outside an
    elastic job).  Reading it changes nothing: :meth:`State.check_host_updates` still raises
    ``HostsUpdatedInterrupt`` at the next commit.
    """

    def empty(self) -> bool:
        return not worker.hosts_updated()


class ObjectState(State):
    """State made of plain Python objects, given as keyword arguments and exposed as attributes.

        >>> state = ObjectState(epoch=0, best=None)
        >>> state.epoch = 3; state.restore(); state.epoch
        0
        >>> state.epoch = 3; state.save(); state.epoch = 4; state.restore(); state.epoch
        3

    Saved copies are deep copies, so mutating a list attribute does not change the commit.
    """

    def __init__(self, bcast_object: Callable[[Any], Any] | None = None,
                 get_rank: Callable[[], int] | None = None, **kwargs: Any) -> None:
        self._saved_state = copy.deepcopy(kwargs)
        self._set_attrs()
        super().__init__(bcast_object, get_rank)

    def save(self) -> None:
        self._saved_state = {attr: copy.deepcopy(getattr(self, attr)) for attr in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            setattr(self, attr, copy.deepcopy(value))


def _reset() -> None:
    """Leave the old world and join the driver's next one, retrying when its rendezvous fails."""
    for attempt in range(1, _RESET_ATTEMPTS + 1):
        api.shutdown()
        try:
            api.init()
            return
        except (worker.ElasticWaitError, worker.WorkerRemovedError):
            raise
        except RendezvousError as exc:  # a member died while the new world assembled: the driver re-forms
            if attempt == _RESET_ATTEMPTS:
                raise
            log.warning("re-forming the job failed (%s); trying again", exc)


def membership_failure(exc: BaseException) -> bool:
    """Whether ``exc`` means the job's membership changed (a worker was lost), so re-forming helps.

    A mismatch between the ranks' calls or a stall is a property of the program: the same
    ranks would fail the same way after a reset, so those end the job with their error.
    """
    return isinstance(exc, HorovodInternalError) and not isinstance(exc, (MismatchError, StallError))


def run_fn(func: F, reset: Callable[[], None]) -> F:
    """``func(state, ...)`` re-entered after each reset: restore on a lost worker, sync, call again."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        reset_required = False
        while True:
            try:
                if reset_required:
                    reset()
                    state.on_reset()
                state.sync()
                state.save()  # the synced state is the commit a failure before the next commit returns to
                return func(state, *args, **kwargs)
            except HorovodInternalError as exc:
                if not membership_failure(exc):
                    raise  # the ranks disagree or one stalled: re-forming would fail the same way again
                log.warning("a collective failed (%s); restoring the last commit and re-forming", exc)
                state.restore()
            except HostsUpdatedInterrupt:
                pass
            reset_required = True

    return wrapper  # type: ignore[return-value]


def run(func: F) -> F:
    """Decorator: make ``func(state, ...)`` survive membership changes (see the module docstring)."""
    return run_fn(func, _reset)
