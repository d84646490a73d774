"""The names of a job's resources on a host: one place builds them all.

Every file or endpoint a job creates starts with ``ringcomm-JOB-``:

============================================ =======================================================
``/dev/shm/ringcomm-JOB-ROUND-S-D``          shared-memory slots from rank S to rank D (shm.py)
``/dev/shm/ringcomm-JOB-ROUND-allreduce``    the shared-memory allreduce region (shm_allreduce.py)
``/dev/shm/ringcomm-JOB-ROUND-lane``         the small-op lane's region (shm_lane.py)
``/dev/shm/ringcomm-JOB-ROUND-lost-R``       which rank rank R lost, left as it failed for same-host
                                             peers it never connected to (peers.py)
``ringcomm-JOB-PID-rRANK-ROUND-data/-ctrl``  a process's ipc endpoints: abstract names on Linux,
                                             socket files in the temp dir elsewhere (transport.py)
============================================ =======================================================

so the launcher and the remote wrapper can find and remove what a dead job left, and a job's
local rank 0 removes at ``init()`` the shared-memory files of any job whose creator died
(:func:`ringcomm.shm.slots.reclaim_left_by_dead`).
"""

from __future__ import annotations

import os
import re
import sys
import tempfile

#: Where shared-memory files live.
SHM_DIR = "/dev/shm"
#: Linux has an abstract socket namespace: ipc endpoints there are names, not files, so a
#: process killed by SIGKILL leaves nothing behind.  Elsewhere they are files in the temp dir.
ABSTRACT_IPC = sys.platform.startswith("linux")


def prefix(job_id: str) -> str:
    """What every resource of job ``job_id`` is named after."""
    return f"ringcomm-{job_id}-"


def shm_ring(job_id: str, round_: int, src: int, dst: int) -> str:
    """The path of the shared-memory slots rank ``src`` writes to rank ``dst``."""
    return os.path.join(SHM_DIR, f"{prefix(job_id)}{round_}-{src}-{dst}")


def shm_allreduce_region(job_id: str, round_: int) -> str:
    """The path of the job's shared-memory allreduce region (created by rank 0)."""
    return os.path.join(SHM_DIR, f"{prefix(job_id)}{round_}-allreduce")


def shm_lane_region(job_id: str, round_: int) -> str:
    """The path of the job's small-op lane region (created by rank 0)."""
    return os.path.join(SHM_DIR, f"{prefix(job_id)}{round_}-lane")


def lost_notice(job_id: str, round_: int, rank: int) -> str:
    """The path of the notice rank ``rank`` leaves, as it fails, naming the rank it lost."""
    return os.path.join(SHM_DIR, f"{prefix(job_id)}{round_}-lost-{rank}")


def ipc_base(job_id: str, pid: int, rank: int, round_: int) -> str:
    """The prefix of a process's ipc endpoints.  Job id, rank and round make it unique among the
    job's ranks, also where ranks in separate pid namespaces (containers) share a network namespace
    and so one pid; the pid names the owner of a socket file for its removal (:func:`ipc_owner`)."""
    name = f"{prefix(job_id)}{pid}-r{rank}-{round_}"
    if ABSTRACT_IPC:
        return f"ipc://@{name}"
    return f"ipc://{tempfile.gettempdir()}/{name}"


def job_globs(job_id: str) -> list[str]:
    """Glob patterns of every file job ``job_id`` may leave on this host."""
    return [os.path.join(SHM_DIR, prefix(job_id) + "*"), os.path.join(tempfile.gettempdir(), prefix(job_id) + "*")]


def ipc_owner(job_id: str, basename: str) -> int | None:
    """The pid in an ipc socket file's name of job ``job_id`` (None for another name)."""
    m = re.match(rf"{re.escape(prefix(job_id))}(\d+)-", basename)
    return int(m.group(1)) if m else None


def is_rank_shm(job_id: str, basename: str, rank: int) -> bool:
    """Whether ``basename`` is shared memory that ``rank`` created: its rings and its notice of a lost rank,
    and on rank 0 the region."""
    own = rf"{rank}-\d+|lost-{rank}|allreduce" if rank == 0 else rf"{rank}-\d+|lost-{rank}"
    return re.fullmatch(rf"{re.escape(prefix(job_id))}\d+-({own})", basename) is not None


def ipc_file(endpoint: str) -> str | None:
    """The socket file behind an ipc endpoint, which its owner must remove; None if there is none."""
    if not endpoint.startswith("ipc://") or endpoint.startswith("ipc://@"):
        return None
    return endpoint[len("ipc://"):]


def remove_files(paths: list[str]) -> None:
    """Unlink files, ignoring ones already gone."""
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass
