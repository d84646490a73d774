"""Which path an op takes (the lane, rank 0, shared memory, hierarchical, recursive doubling, the ring), with no I/O.

Every size rule that picks an op's path lives here, in :func:`route`; the places
that act on the answer ask it instead of comparing sizes themselves:

=====================================  ==========  ===========================================================
who asks                               ``where``   what it does with the answer
=====================================  ==========  ===========================================================
the lane (``core/lane.fast_nbytes``)   ``LANE``    posts the op fast when :attr:`Path.LANE`, else diverts it
the session (``Session.announce``)     ``ENGINE``  sends an op's data with its request when :attr:`Path.RANK0`
the coordinator's fusion key           ``ENGINE``  fuses rank 0's allreduces only with each other
the service (``_reduce``, ``_gather``) ``RANK0``   finishes a response from the payloads when :attr:`Path.RANK0`
the executor (``_allreduce``)          ``EXECUTE`` runs shared memory, hierarchical, doubling or the ring
=====================================  ==========  ===========================================================

The numbers come from one :class:`RouteLimits`, built once per job from the
settings and the job's size (:func:`limits_for`); what is known of the op where
it is asked is a :class:`PathFacts`.

    >>> lim = build_limits(4, 65536, 262144, 1 << 20, -1, lane_bytes=1 << 20)
    >>> route("allreduce", 4096, PathFacts(Where.LANE), lim)
    <Path.LANE: 'lane'>
    >>> route("allreduce", 4096, PathFacts(Where.ENGINE), lim)
    <Path.RANK0: 'rank0'>
    >>> route("allreduce", 100_000, PathFacts(Where.EXECUTE), lim)
    <Path.DOUBLING: 'doubling'>
    >>> route("allreduce", 2 << 20, PathFacts(Where.EXECUTE, shm=True), lim)
    <Path.SHM: 'shm'>
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import NamedTuple, Protocol

from . import wire
from .ops import ReduceOp

#: Kinds that move data; the others (barrier, join, shutdown, set management) complete on their response.
DATA_KINDS = (wire.ALLREDUCE, wire.ALLGATHER, wire.BROADCAST, wire.ALLTOALL, wire.REDUCESCATTER)
#: Collectives that only move data: the lane takes them up to its own bound for them (RouteLimits.lane_move_bytes).
MOVE_KINDS = frozenset({wire.BROADCAST, wire.ALLGATHER, wire.ALLTOALL})
#: Collectives the lane can finish from posted payloads.
LANE_KINDS = frozenset({wire.ALLREDUCE, wire.BROADCAST, wire.ALLGATHER, wire.ALLTOALL, wire.REDUCESCATTER,
                        wire.BARRIER})
#: Allreduces of at least this many bytes take the hierarchical path when it is on automatically.
HIERARCHICAL_MIN_BYTES = 1 << 20


class Path(enum.Enum):
    """The way an op's data goes."""

    LANE = "lane"  # the small-op lane: every rank finishes it from the payloads the others posted
    CONTROL = "control"  # no data moves: it completes on rank 0's response (barrier, join, shutdown, sets)
    RANK0 = "rank0"  # its data rides with the requests; rank 0 reduces or gathers it and answers with the result
    SHM = "shm"  # one shared-memory region (allreduces of the global set, every rank on one host)
    HIERARCHICAL = "hierarchical"  # reduce within each host, across hosts, share within
    DOUBLING = "doubling"  # recursive doubling: log2(N) exchanges of the whole buffer
    RING = "ring"  # the ring allreduce
    PEERS = "peers"  # any other kind's own algorithm between the set's ranks (allgatherv ring, broadcast, ...)


class Where(enum.Enum):
    """Where the question is asked: what is known of the op there."""

    LANE = "lane"  # a user thread on a rank with a lane: the op is not posted yet (``nbytes``: its buffers)
    ENGINE = "engine"  # the engine has it (no lane, or the lane diverted it): this rank's bytes of the op
    RANK0 = "rank0"  # rank 0 holds the response's payloads: ``nbytes`` is its whole data (fused ops summed)
    EXECUTE = "execute"  # a rank executes the response: ``PathFacts.carried`` says whether rank 0 answered with it


class PathFacts(NamedTuple):
    """What is known of one op, and of the job, where its path is asked for (only what the rules read)."""

    where: Where = Where.ENGINE
    pset: int = 0  # the op's process set (0: every rank)
    op: int = int(ReduceOp.SUM)  # an allreduce's reduction (Adasum takes neither the lane nor the hierarchical path)
    refused: bool = False  # this rank refused the call: it fails on every member
    empty_rows: bool = False  # an allgather whose rows hold no bytes (posted payloads could not count them)
    carried: bool = False  # EXECUTE: rank 0 answered with the result
    shm: bool = False  # the shared-memory allreduce's region is up (every rank on one host)
    host_plan: bool = False  # the set's ranks are spread evenly over two hosts or more (hierarchical can run)


#: What the engine's side knows of an op (the session announcing it, the coordinator fusing it).
ENGINE_FACTS = PathFacts(Where.ENGINE)
#: What rank 0's service knows of a response whose payloads it holds.
RANK0_FACTS = PathFacts(Where.RANK0)


class RouteLimits(NamedTuple):
    """The sizes that pick a path, in bytes; built once per job (:func:`build_limits`, :func:`limits_for`)."""

    lane_bytes: int = 0  # this rank posts an op fast up to this (0: no lane)
    small_bytes: int = 0  # an allreduce up to this rides with its request to rank 0 (0 bytes included)
    small_gather_bytes: int = 0  # an allgather's part up to this does
    control_bytes: int = wire.CONTROL_DATA_BYTES  # rank 0 finishes at most one control frame's worth
    shm_min_bytes: int = 0  # the shared-memory allreduce from this size
    hierarchical: int = -1  # the setting: 1 wherever the hosts allow it, 0 never, -1 from hierarchical_min_bytes
    hierarchical_min_bytes: int = HIERARCHICAL_MIN_BYTES
    doubling_bytes: int = 0  # recursive doubling up to this
    lane_move_bytes: int = -1  # the lane's bound for MOVE_KINDS (-1: lane_bytes); 0 lane_bytes: no lane at all


class LimitSettings(Protocol):
    """What :func:`limits_for` reads of the job's settings (``ringcomm.job.config.Settings`` is one)."""

    @property
    def shm_allreduce_min_bytes(self) -> int: ...

    @property
    def hierarchical_allreduce(self) -> int: ...

    def small_allreduce_bytes_for(self, size: int) -> int: ...

    def doubling_allreduce_bytes_for(self, size: int) -> int: ...


# -- the limits, derived once ---------------------------------------------------


def small_bytes(size: int, bound: int) -> int:
    """The rank-0 path's bound in a job of ``size`` ranks, given the setting's ``bound``: payloads travel
    inside control frames, never more than one frame's share; a job of one rank has no rank-0 path.

        small_bytes(4, 65536) -> 65536    small_bytes(4, 1 << 30) -> CONTROL_DATA_BYTES    small_bytes(1, 65536) -> 0
    """
    return min(bound, wire.CONTROL_DATA_BYTES) if size > 1 else 0


def small_gather_bytes(small: int, size: int) -> int:
    """An allgather's part that goes through rank 0: its result is every rank's part, so up to
    ``1/size`` of the rank-0 path's bound ``small``."""
    return small // max(1, size)


def lane_bytes(region_bytes: int | None, setting_bytes: int | None) -> int:
    """This rank's bound for the lane: 0 without a region; a region's own bound (``setting_bytes``
    None: the lane across hosts, where each rank sizes its own); else the smaller of the setting and
    the region's entries (a shared region is rank 0's size).

        lane_bytes(None, 4096) -> 0    lane_bytes(8192, None) -> 8192    lane_bytes(8192, 4096) -> 4096
    """
    if region_bytes is None:
        return 0
    return region_bytes if setting_bytes is None else min(setting_bytes, region_bytes)


def build_limits(size: int, small_allreduce_bytes: int, doubling_bytes: int, shm_min_bytes: int, hierarchical: int,
           lane_bytes: int = 0) -> RouteLimits:
    """The limits of a job of ``size`` ranks, from the settings' values for that size."""
    small = small_bytes(size, small_allreduce_bytes)
    return RouteLimits(lane_bytes, small, small_gather_bytes(small, size), wire.CONTROL_DATA_BYTES, shm_min_bytes,
                       hierarchical, HIERARCHICAL_MIN_BYTES, doubling_bytes)


def limits_for(settings: LimitSettings, size: int) -> RouteLimits:
    """The limits of a job of ``size`` ranks under ``settings`` (the lane's bound is the lane's own)."""
    return build_limits(size, settings.small_allreduce_bytes_for(size), settings.doubling_allreduce_bytes_for(size),
                  settings.shm_allreduce_min_bytes, settings.hierarchical_allreduce)


def shm_possible(size: int, hosts: Sequence[str], min_bytes: int, min_ranks: int) -> bool:
    """Whether a job of ``size`` ranks on ``hosts`` (one entry per rank) may set up the shared-memory
    allreduce (the caller also needs shared memory on this machine): on, two ranks or more (at least
    ``min_ranks``), all on one host."""
    return min_bytes > 0 and size >= max(2, min_ranks) and len(set(hosts)) == 1


# -- the rule -------------------------------------------------------------------


def route(kind: str, nbytes: int, facts: PathFacts, limits: RouteLimits) -> Path:
    """The path of an op of ``kind`` and ``nbytes``, given what is known where it is asked (``facts``).

    In order: the lane (asked from the lane only), no data (:attr:`Path.CONTROL`), rank 0,
    another kind's own algorithm, and for an allreduce shared memory, hierarchical, recursive
    doubling, the ring.
    """
    where = facts.where
    if where is Where.LANE and _lane(kind, nbytes, facts, limits):
        return Path.LANE
    if kind not in DATA_KINDS:
        return Path.CONTROL
    if _rank0(kind, nbytes, facts, limits):
        return Path.RANK0
    if kind != wire.ALLREDUCE:
        return Path.PEERS
    if facts.shm and facts.pset == 0 and nbytes >= limits.shm_min_bytes:
        return Path.SHM
    if (facts.host_plan and limits.hierarchical != 0 and facts.op != ReduceOp.ADASUM
            and (limits.hierarchical == 1 or nbytes >= limits.hierarchical_min_bytes)):
        return Path.HIERARCHICAL
    if nbytes <= limits.doubling_bytes:
        return Path.DOUBLING
    return Path.RING


def _lane(kind: str, nbytes: int, facts: PathFacts, limits: RouteLimits) -> bool:
    """Whether this rank asks for the lane: an eligible kind of the global set, within its bound (a
    barrier posts nothing; a broadcast's non-root ranks post nothing but check the root's size alike;
    a kind that only moves data has a bound of its own)."""
    bound = limits.lane_bytes
    if facts.pset != 0 or kind not in LANE_KINDS or facts.refused or bound <= 0:
        return False
    if kind in MOVE_KINDS and limits.lane_move_bytes >= 0:
        bound = limits.lane_move_bytes
    if kind == wire.ALLREDUCE and facts.op == ReduceOp.ADASUM:
        return False
    if kind == wire.ALLGATHER and facts.empty_rows:
        return False  # rows of no bytes: the payloads could not tell how many each rank sent
    return kind == wire.BARRIER or nbytes <= bound


def _rank0(kind: str, nbytes: int, facts: PathFacts, limits: RouteLimits) -> bool:
    """Whether rank 0 finishes the op (an allreduce or an allgather) from the payloads sent with the requests."""
    if kind != wire.ALLREDUCE and kind != wire.ALLGATHER:
        return False
    if facts.where is Where.EXECUTE:
        return facts.carried
    if facts.where is Where.RANK0:  # the whole response: what one control frame carries
        return nbytes <= limits.control_bytes
    return nbytes <= (limits.small_bytes if kind == wire.ALLREDUCE else limits.small_gather_bytes)
