"""Where this process sits in the job, read once from the environment at ``init()``.

Sources, first match wins:

1. ``ringcomm-run``: ``RINGCOMM_RANK``, ``RINGCOMM_SIZE``, ... and ``RINGCOMM_RENDEZVOUS_ADDR``.
2. torchrun: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
   ``MASTER_ADDR``, ``MASTER_PORT``.  Rank 0 hosts the rendezvous on
   ``MASTER_ADDR:(RINGCOMM_RENDEZVOUS_PORT or MASTER_PORT + 1)`` (torchrun's own
   store may hold ``MASTER_PORT``).
3. Nothing: a single-process job (size 1).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import secrets
import socket
from collections.abc import Mapping

from .errors import InvalidInputError


@dataclasses.dataclass(frozen=True)
class Topology:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    cross_rank: int = 0
    cross_size: int = 1
    rendezvous: str = ""  # tcp://host:port, "" for a single process
    host_rendezvous: bool = False  # this process (rank 0) must serve the rendezvous itself
    secret: bytes = b""
    job_id: str = ""
    hostname: str = ""
    source: str = "single"


def _int(env: Mapping[str, str], key: str, default: int | None = None) -> int:
    raw = env.get(key)
    if raw is None:
        if default is None:
            raise InvalidInputError(f"{key} is not set; the launcher environment is incomplete")
        return default
    try:
        return int(raw)
    except ValueError:
        raise InvalidInputError(f"{key}={raw!r} is not an integer") from None


def _check(rank: int, size: int, local_rank: int, local_size: int, src: str) -> None:
    if size < 1:
        raise InvalidInputError(f"world size from {src} is {size}; it must be >= 1 (check the launcher's -np)")
    if not 0 <= rank < size:
        raise InvalidInputError(
            f"rank from {src} is {rank} but the world size is {size}; ranks must be 0..{size - 1}"
        )
    if not 0 <= local_rank < max(local_size, 1):
        raise InvalidInputError(
            f"local rank from {src} is {local_rank} with local size {local_size}; "
            f"local ranks must be 0..{max(local_size, 1) - 1}"
        )


def from_env(environ: Mapping[str, str] | None = None) -> Topology:
    """Read the topology; raises InvalidInputError for an inconsistent environment."""
    env = os.environ if environ is None else environ
    hostname = env.get("RINGCOMM_HOSTNAME") or socket.gethostname()
    if "RINGCOMM_RANK" in env or "RINGCOMM_SIZE" in env:
        rank, size = _int(env, "RINGCOMM_RANK"), _int(env, "RINGCOMM_SIZE")
        local_rank = _int(env, "RINGCOMM_LOCAL_RANK", rank)
        local_size = _int(env, "RINGCOMM_LOCAL_SIZE", size)
        _check(rank, size, local_rank, local_size, "RINGCOMM_RANK/RINGCOMM_SIZE")
        addr = env.get("RINGCOMM_RENDEZVOUS_ADDR", "")
        if size > 1 and not addr:
            raise InvalidInputError("RINGCOMM_RENDEZVOUS_ADDR is not set; start the job with ringcomm-run")
        secret_hex = env.get("RINGCOMM_SECRET", "")
        try:
            secret = bytes.fromhex(secret_hex)
        except ValueError:
            raise InvalidInputError("RINGCOMM_SECRET must be hex") from None
        return Topology(
            rank, size, local_rank, local_size,
            _int(env, "RINGCOMM_CROSS_RANK", 0), _int(env, "RINGCOMM_CROSS_SIZE", 1),
            rendezvous=addr, secret=secret, job_id=env.get("RINGCOMM_JOB_ID", "") or secrets.token_hex(4),
            hostname=hostname, source="ringcomm-run",
        )
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, size = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local_rank = _int(env, "LOCAL_RANK", rank)
        local_size = _int(env, "LOCAL_WORLD_SIZE", size)
        _check(rank, size, local_rank, local_size, "RANK/WORLD_SIZE (torchrun)")
        master = env.get("MASTER_ADDR", "127.0.0.1")
        port = _int(env, "RINGCOMM_RENDEZVOUS_PORT", _int(env, "MASTER_PORT", 29500) + 1)
        if "RINGCOMM_SECRET" in env:
            secret = bytes.fromhex(env["RINGCOMM_SECRET"])
        else:
            # No launcher to hand out a secret: derive one every rank can compute.
            seed = f"{master}:{port}:{size}:{env.get('TORCHELASTIC_RUN_ID', '')}"
            secret = hashlib.sha256(seed.encode()).digest()
        # Names of sockets and shared memory carry the job id.  The rendezvous address is part of
        # it, so two jobs on one host that share a RINGCOMM_SECRET still get different names.
        job = hashlib.sha256(secret + f"{master}:{port}".encode()).hexdigest()[:8]
        cross_size = max(1, size // max(local_size, 1))
        return Topology(
            rank, size, local_rank, local_size, rank // max(local_size, 1), cross_size,
            rendezvous=f"tcp://{master}:{port}", host_rendezvous=(rank == 0), secret=secret,
            job_id=job, hostname=hostname, source="torchrun",
        )
    return Topology(hostname=hostname, job_id=secrets.token_hex(4), secret=secrets.token_bytes(16))
