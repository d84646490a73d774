"""Worker side of an elastic job: learn this process's place in the newest world from the driver.

A worker started by the elastic driver has ``RINGCOMM_ELASTIC_WORKER`` (its
id) instead of ``RINGCOMM_RANK``/``RINGCOMM_SIZE``.  Each ``init()`` then goes
through :func:`topology_from_driver`:

1. it tells the driver it is waiting (key ``ready/<id>`` = the last generation
   it joined, -1 for none) in the driver's key-value store at
   ``RINGCOMM_RENDEZVOUS_ADDR``;
2. it waits for a generation newer than the one it last joined (key
   ``world/<g>``; ``world/current`` names the newest);
3. it returns that generation's rank, size, ... and the generation's own
   rendezvous address; the engine then registers there with ``round = g``.

What each worker sees when worker 1 of 3 dies (generation 0 -> 1)::

    worker 0: rank 0 of 3  -> PeerLostError -> init() -> rank 0 of 2
    worker 2: rank 2 of 3  -> PeerLostError -> init() -> rank 1 of 2

:func:`hosts_updated` tells rank 0 whether the driver found hosts that a
re-formed world would use (``TorchState.check_host_updates`` broadcasts it).
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import threading
import time
from collections.abc import Mapping
from typing import Any

import msgpack

from ..net import rendezvous
from ..job import topology
from ..errors import RendezvousError, RendezvousTimeoutError
from ..job.netaddr import is_loopback
from ..job.topology import Topology, pick_address

__all__ = ["World", "ElasticWaitError", "WorkerRemovedError", "topology_from_driver", "topology_from_env", "hosts_updated", "current_world", "WORKER_VAR", "TIMEOUT_VAR",
           "pack", "unpack"]

#: Set by the driver on every worker: its id.  Its presence makes init() ask the driver (topology_from_env).
WORKER_VAR = "RINGCOMM_ELASTIC_WORKER"
#: Seconds a worker waits for the driver to form the next world.
TIMEOUT_VAR = "RINGCOMM_ELASTIC_TIMEOUT"
#: Seconds of each wait for a key (so a worker notices a newer generation or a dead driver in time).
_KV_TIMEOUT = 5.0


class ElasticWaitError(RendezvousTimeoutError):
    """The driver published no new world in time (it is gone, or waits for --min-np workers)."""


class WorkerRemovedError(RendezvousError):
    """The driver left this worker out of the new world; the process should end."""


def pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


@dataclasses.dataclass(frozen=True)
class World:
    """One generation of the job's membership, as the driver published it."""

    gen: int
    rendezvous: str
    hosts_version: int
    #: worker id -> [rank, size, local_rank, local_size, cross_rank, cross_size, host]
    members: dict[int, list[Any]]

    @classmethod
    def decode(cls, data: bytes) -> "World":
        raw = unpack(data)
        return cls(int(raw["gen"]), str(raw["rendezvous"]), int(raw["hosts_version"]),
                   {int(k): list(v) for k, v in raw["members"].items()})

    def encode(self) -> bytes:
        return pack({"gen": self.gen, "rendezvous": self.rendezvous, "hosts_version": self.hosts_version,
                     "members": {int(k): v for k, v in self.members.items()}})


class _Membership:
    """What this process knows about its elastic job (one per process)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.world: World | None = None
        self.address = ""
        self.secret = b""


_membership = _Membership()


def current_world() -> World | None:
    """The world this process joined last (``None`` outside an elastic job)."""
    return _membership.world


def _get(address: str, secret: bytes, key: str, deadline: float) -> bytes:
    """The value of ``key``, waiting in steps until ``deadline`` (monotonic)."""
    while True:
        wait = min(_KV_TIMEOUT, deadline - time.monotonic())
        if wait <= 0:
            raise RendezvousTimeoutError(f"timed out waiting for {key!r}")
        try:
            return rendezvous.kv_get(address, secret, key, wait)
        except RendezvousTimeoutError:
            if time.monotonic() >= deadline:
                raise


def topology_from_driver(env: Mapping[str, str], hostname: str, secret: bytes, job_id: str) -> Topology:
    """Block until the driver publishes a world newer than the last one joined; this worker's place in it."""
    wid = int(env[WORKER_VAR])
    address = env.get("RINGCOMM_RENDEZVOUS_ADDR", "")
    if not address:
        raise RendezvousError(f"{WORKER_VAR} is set but RINGCOMM_RENDEZVOUS_ADDR is not; start with ringcomm-run")
    timeout = float(env.get(TIMEOUT_VAR, "600"))
    with _membership.lock:
        last = _membership.world.gen if _membership.world is not None else -1
        _membership.address, _membership.secret = address, secret
        deadline = time.monotonic() + timeout
        try:
            rendezvous.kv_set(address, secret, f"ready/{wid}", pack(last), _KV_TIMEOUT)
            if last >= 0:  # wait for the next generation; the driver may have published later ones since
                _get(address, secret, f"world/{last + 1}", deadline)
            # the driver writes world/<g> before world/current: never go below last + 1
            gen = max(last + 1, int(unpack(_get(address, secret, "world/current", deadline))))
            world = World.decode(_get(address, secret, f"world/{gen}", deadline))
        except RendezvousTimeoutError as exc:
            raise ElasticWaitError(
                f"elastic worker {wid}: no new membership from ringcomm-run's driver at {address} within "
                f"{timeout:.0f} s after generation {last} ({exc}); the launcher may be gone, or it is waiting "
                f"for enough workers (--min-np, --elastic-timeout)"
            ) from None
        if wid not in world.members:
            raise WorkerRemovedError(
                f"elastic worker {wid} is not part of generation {gen} of the job (the driver removed it: "
                "its host left the discovery output or the job is ending)"
            )
        _membership.world = world
    rank, size, local_rank, local_size, cross_rank, cross_size, host = world.members[wid]
    # the address other hosts reach this worker at: the one that routes toward the generation's rendezvous
    toward = world.rendezvous.partition("://")[2].rpartition(":")[0]
    return Topology(
        int(rank), int(size), int(local_rank), int(local_size), int(cross_rank), int(cross_size),
        rendezvous=world.rendezvous if int(size) > 1 else "", secret=secret, job_id=job_id,
        hostname=str(host) or hostname, source="elastic", round=gen,
        addr="127.0.0.1" if int(size) == 1 or is_loopback(toward) else pick_address(env, [toward]),
    )


def topology_from_env(environ: Mapping[str, str] | None = None) -> Topology:
    """This process's topology: from the elastic driver when it started the process (blocks), else
    from the environment alone (:func:`ringcomm.job.topology.from_env`)."""
    env = os.environ if environ is None else environ
    if topology.source_of(env) != "elastic":
        return topology.from_env(env)
    return topology_from_driver(env, topology.hostname_of(env), topology.secret_of(env),
                                env.get("RINGCOMM_JOB_ID", "") or secrets.token_hex(4))


def hosts_updated() -> bool:
    """True when the driver found hosts (or lost some) since this process's world was formed.

    Asks the driver's store (one round trip); ``False`` outside an elastic job.
    """
    world = _membership.world
    if world is None or not _membership.address:
        return False
    try:
        raw = rendezvous.kv_get(_membership.address, _membership.secret, "hosts_version", 0.0)
    except RendezvousError:
        return False
    return int(unpack(raw)) > world.hosts_version
