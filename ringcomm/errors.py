"""One exception tree for ringcomm.

Every error subclasses :class:`RingcommError` *and* the matching builtin, so
``except ValueError`` keeps working for misuse and ``except RuntimeError`` for
failures inside a collective.  The Horovod names are aliases, so scripts that
``except hvd.HorovodInternalError`` need no change.
"""

from __future__ import annotations

import re


class RingcommError(Exception):
    """Base class of every error raised by ringcomm."""

    #: True once the ops of the call that raised this error are refused on every rank: the layer
    #: that refused them sets it, so that a layer around it does not refuse them a second time
    refused: bool = False


def name_rank(exc: BaseException, rank: int) -> None:
    """End ``exc``'s message with `` [raised on rank N]``, as an error of an op that failed on every
    rank reads on each, unless it names that rank already (``... in flight on rank 0``)."""
    message = str(exc)
    if not re.search(rf"\bon rank {rank}\b", message):
        exc.args = (f"{message} [raised on rank {rank}]",)


class NotInitializedError(RingcommError, ValueError):
    """A collective or topology query was made before ``init()`` or after ``shutdown()``."""


class InvalidInputError(RingcommError, ValueError):
    """The arguments of a call are wrong on this rank (caught before any communication)."""


class InvalidTypeError(RingcommError, TypeError):
    """An argument has an unsupported type or dtype."""


class InvalidSplitsError(InvalidTypeError, ValueError):
    """``alltoall`` splits that are not integers: a TypeError, and a ValueError as Horovod raises."""


class DuplicateNameError(InvalidInputError):
    """An op with this name is already in flight on this rank."""


class ProtocolError(RingcommError, ValueError):
    """A message that does not follow ringcomm's wire protocol: garbage, truncated, wrong types.

    Raised by every decoder (control envelope, requests, responses, data-plane
    messages); the engine drops such a message (logged at DEBUG) instead of failing.
    """


class HorovodInternalError(RingcommError, RuntimeError):
    """A collective failed after it was submitted (Horovod's name, kept for ``except`` clauses)."""


class MismatchError(HorovodInternalError):
    """Ranks submitted the same named op with different shapes, dtypes, ops or roots."""


class StallError(HorovodInternalError):
    """Some ranks never submitted an op within RINGCOMM_STALL_SHUTDOWN_SECONDS."""


class PeerLostError(HorovodInternalError):
    """A peer process died or stopped answering."""

    @property
    def lost_rank(self) -> int | None:
        """The rank the message names as lost (``rank 0: lost rank 3 (...)`` -> 3), if it names one."""
        found = re.search(r"\blost rank (\d+)", str(self))
        return int(found[1]) if found else None


class RendezvousError(RingcommError, RuntimeError):
    """The job could not assemble: wrong environment, a missing rank, a bad secret."""


class RendezvousTimeoutError(RendezvousError, TimeoutError):
    """Not every rank arrived at the rendezvous in time."""


class RendezvousAbortedError(RendezvousError):
    """The launcher called off this round of the rendezvous (an elastic member died before it arrived)."""


class ShutdownError(HorovodInternalError):
    """The runtime was shut down while this op was still pending."""


# Horovod calls the elastic-recovery signal HostsUpdatedInterrupt; exposed for parity.
class HostsUpdatedInterrupt(RingcommError, RuntimeError):
    """The set of hosts changed (elastic training)."""


class ForkedProcessError(RingcommError, RuntimeError):
    """A collective was called in a process forked after ``init()``: the job's engine lives in the parent."""


class UnsupportedError(InvalidInputError, NotImplementedError):
    """A valid request this build does not carry out (e.g. Adasum over a number of ranks that is not a
    power of two): a NotImplementedError, as Horovod raises."""
