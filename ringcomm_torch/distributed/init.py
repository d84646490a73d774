"""Joining the ringcomm job from what torch.distributed hands a backend: a store, a rank and a size.

Three cases, in this order:

1. ringcomm is already initialized in this process (``hvd.init()`` came first): it is used
   as it is, provided its rank and size are torch's.
2. The process was started by ``ringcomm-run`` (``RINGCOMM_*`` variables) with torch's rank
   and size: ``ringcomm.init()`` joins the launcher's rendezvous, as a Horovod script would.
3. Anything else (torchrun, ``mp.spawn`` with ``init_method="tcp://..."`` or ``env://``,
   Slurm, a store built by hand): the ranks agree through torch's store.  Every rank
   tells rank 0 its host name; rank 0 starts a ringcomm rendezvous server on a free port and
   publishes its address, every rank's host name and the job's secret (``RINGCOMM_SECRET``
   when set, else a random one); every rank then runs ``ringcomm.init()`` with that address,
   its rank and its placement (local rank and size, host index) worked out from every rank's
   host name.  Each join is told apart by random nonces (:mod:`.store_join`), so a store that
   outlives an attempt (torchrun's, across ``--max-restarts``) never hands a restarted rank
   the last attempt's address; rank 0 removes the join's keys once every rank has joined.

The secret travels through torch's store, which has no authentication of its own: whoever
can reach the store can also join a gloo job; across hosts on an untrusted network, export
the same ``RINGCOMM_SECRET`` on every rank (then it is not sent through the store).

:func:`torch_env_for_ringcomm_run` gives torch's ``env://`` variables (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``...) to a process started by ``ringcomm-run``,
so that ``init_process_group("ringcomm")`` needs nothing else there.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import ringcomm as rc
from ringcomm.job import hosts as _hosts
from ringcomm.job import config, mpi_env, topology
from ringcomm.errors import InvalidInputError
from ringcomm.net.rendezvous import RendezvousServer

from . import store_join

__all__ = ["join", "leave", "torch_env_for_ringcomm_run", "store_plan"]

log = logging.getLogger("ringcomm.torch.distributed")
_lock = threading.Lock()
_server: RendezvousServer | None = None  # rank 0's rendezvous in case 3; lives as long as the job
#: How long the join through the store waits when neither torch's timeout nor the store's is known
_STORE_WAIT_SECONDS = 300.0


def torch_env_for_ringcomm_run(env: MutableMapping[str, str]) -> dict[str, str]:
    """Set (only where missing) torch's ``env://`` variables from ``ringcomm-run``'s; returns what was set.

    ``MASTER_PORT`` (rank 0's torch store) is derived from the job id, alike on every rank;
    ``MASTER_ADDR`` is 127.0.0.1 when every rank is on one host, else the launcher's host
    (set ``MASTER_ADDR`` yourself when rank 0 runs elsewhere).
    """
    if topology.source_of(env) != "ringcomm-run":
        return {}
    cross = int(env.get("RINGCOMM_CROSS_SIZE", "1") or 1)
    rdv = env.get("RINGCOMM_RENDEZVOUS_ADDR", "")
    master = "127.0.0.1" if cross <= 1 or not rdv else rdv.partition("://")[2].rpartition(":")[0].strip("[]")
    wanted = {
        "RANK": env.get("RINGCOMM_RANK", "0"),
        "WORLD_SIZE": env.get("RINGCOMM_SIZE", "1"),
        "LOCAL_RANK": env.get("RINGCOMM_LOCAL_RANK", env.get("RINGCOMM_RANK", "0")),
        "LOCAL_WORLD_SIZE": env.get("RINGCOMM_LOCAL_SIZE", env.get("RINGCOMM_SIZE", "1")),
        "GROUP_RANK": env.get("RINGCOMM_CROSS_RANK", "0"),
        "MASTER_ADDR": master,
        "MASTER_PORT": str(mpi_env.derived_port(f"ringcomm-run-torch-store:{env.get('RINGCOMM_JOB_ID', '')}")),
    }
    done = {}
    for key, value in wanted.items():
        if key not in env:
            env[key] = done[key] = value
    return done


def store_plan(rank: int, hostnames: list[str], rendezvous: str, secret: bytes, job_id: str) -> dict[str, str]:
    """The ``RINGCOMM_*`` variables that describe rank ``rank`` of the job (pure).

    >>> p = store_plan(2, ["a", "b", "a"], "tcp://127.0.0.1:5", b"k", "j")
    >>> p["RINGCOMM_LOCAL_RANK"], p["RINGCOMM_LOCAL_SIZE"], p["RINGCOMM_CROSS_RANK"], p["RINGCOMM_CROSS_SIZE"]
    ('1', '2', '0', '2')
    """
    place = _hosts.place_by_host(hostnames)[rank]
    return {
        "RINGCOMM_RANK": str(rank),
        "RINGCOMM_SIZE": str(len(hostnames)),
        "RINGCOMM_LOCAL_RANK": str(place.local_rank),
        "RINGCOMM_LOCAL_SIZE": str(place.local_size),
        "RINGCOMM_CROSS_RANK": str(place.cross_rank),
        "RINGCOMM_CROSS_SIZE": str(place.cross_size),
        "RINGCOMM_RENDEZVOUS_ADDR": rendezvous,
        "RINGCOMM_SECRET": secret.hex(),
        "RINGCOMM_JOB_ID": job_id,
        "RINGCOMM_HOSTNAME": hostnames[rank],
    }


@contextlib.contextmanager
def _environ(values: Mapping[str, str], hide: tuple[str, ...]) -> Iterator[None]:
    """``os.environ`` with ``values`` set and ``hide`` removed, restored afterwards."""
    saved = {k: os.environ.get(k) for k in (*values, *hide)}
    try:
        for k in hide:
            os.environ.pop(k, None)
        os.environ.update(values)
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _deadline(store: Any, timeout: datetime.timedelta | None) -> float:
    """When the join through the store gives up: the process group's timeout, else the store's own."""
    seconds = timeout.total_seconds() if timeout is not None else None
    if seconds is None:
        try:
            seconds = float(store.timeout.total_seconds())
        except (AttributeError, RuntimeError):
            seconds = _STORE_WAIT_SECONDS
    return time.monotonic() + (seconds if seconds > 0 else _STORE_WAIT_SECONDS)


def _through_store(store: Any, rank: int, size: int, timeout: datetime.timedelta | None) -> dict[str, str]:
    """Join through torch's store (:mod:`.store_join`): this join's values only, never an earlier attempt's."""
    global _server
    env = os.environ
    hostname = env.get("RINGCOMM_HOSTNAME") or socket.gethostname()
    deadline = _deadline(store, timeout)
    leader = store_join.Leader(size, secrets.token_hex(8), hostname)
    try:
        if rank == 0:
            hostnames = store_join.lead(store, leader, deadline)
        else:
            plan = store_join.follow(store, store_join.Follower(rank, secrets.token_hex(8), hostname), deadline)
    except store_join.JoinTimeout as exc:
        raise InvalidInputError(
            f"init_process_group('ringcomm') on rank {rank}: waited in torch's store for {exc.waiting_for} "
            "and gave up; check that every rank was started (world size) and reaches the store "
            "(MASTER_ADDR/MASTER_PORT or init_method)") from exc
    except RuntimeError as exc:  # torch's store errors (DistStoreError...): the store went away
        raise InvalidInputError(
            f"init_process_group('ringcomm') on rank {rank}: torch's store failed while the ranks joined: {exc}; "
            "check that the process that serves it (rank 0, or torchrun's agent) still runs") from exc
    if rank == 0:
        one_host = len(set(hostnames)) == 1
        others = [h for h in hostnames if h != hostname]
        secret = bytes.fromhex(env["RINGCOMM_SECRET"]) if env.get("RINGCOMM_SECRET") else secrets.token_bytes(16)
        if _server is not None:
            _server.close()
        _server = RendezvousServer(size, secret, host="127.0.0.1" if one_host else "0.0.0.0", port=0,
                                   ports=config.port_range(env))
        addr = "127.0.0.1" if one_host else topology.pick_address(env, others[:1])
        body = {"rendezvous": f"tcp://{addr}:{_server.address.rpartition(':')[2]}",
                "secret": "" if env.get("RINGCOMM_SECRET") else secret.hex(), "job": secrets.token_hex(4)}
        store.set(*leader.plan(body))
        plan = body
    else:
        hostnames = [str(h) for h in plan["hosts"]]
        secret = bytes.fromhex(plan["secret"] or env.get("RINGCOMM_SECRET", ""))
        if not secret:
            raise InvalidInputError(
                f"init_process_group('ringcomm') on rank {rank}: rank 0 has RINGCOMM_SECRET set but this rank "
                "has not; export the same RINGCOMM_SECRET on every rank")
    return store_plan(rank, hostnames, str(plan["rendezvous"]), secret, str(plan["job"]))


def _remove(store: Any, keys: list[str]) -> None:
    """Delete ``keys`` from the store, where the store can (a later join never reads them either way)."""
    for k in keys:
        try:
            store.delete_key(k)
        except (RuntimeError, NotImplementedError, AttributeError) as exc:
            log.debug("could not remove %s from torch's store: %s", k, exc)
            return


def join(store: Any, rank: int, size: int, timeout: datetime.timedelta | None = None) -> str:
    """Make sure ringcomm runs this process as rank ``rank`` of ``size``; returns how it was joined."""
    with _lock:
        if rc.is_initialized():
            if (rc.rank(), rc.size()) != (rank, size):
                raise InvalidInputError(
                    f"init_process_group('ringcomm'): ringcomm is already initialized as rank {rc.rank()} of "
                    f"{rc.size()}, but torch asks for rank {rank} of {size}; call ringcomm's shutdown() first "
                    "or start both from the same launcher")
            return "initialized"
        env = os.environ
        if (topology.source_of(env) == "ringcomm-run" and env.get("RINGCOMM_RANK") == str(rank)
                and env.get("RINGCOMM_SIZE") == str(size)):
            rc.init(process_sets="dynamic")
            return "ringcomm-run"
        if size == 1:
            with _environ({}, ("RINGCOMM_RANK", "RINGCOMM_SIZE", "RINGCOMM_ELASTIC_WORKER", "RANK", "WORLD_SIZE",
                               "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")):
                rc.init(process_sets="dynamic")
            return "single"
        plan = _through_store(store, rank, size, timeout)
        with _environ(plan, ("RINGCOMM_ELASTIC_WORKER",)):
            rc.init(process_sets="dynamic")
        if rank == 0:  # every rank has read the plan (it registered at its rendezvous): the keys are spent
            _remove(store, store_join.keys_of_join(size))
        return "store"


def leave() -> None:
    """Shut ringcomm down (collectively, as ``ringcomm.shutdown()``) and close rank 0's rendezvous server."""
    global _server
    with _lock:
        if rc.is_initialized():
            rc.shutdown()
        server, _server = _server, None
    if server is not None:
        server.close()
