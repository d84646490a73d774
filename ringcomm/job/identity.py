"""Which ranks that report one host name can share memory, sockets and process ids.

A host name alone does not say so. Containers that share the host's network (``docker run
--net=host``, Kubernetes pods with ``hostNetwork``) report the machine's name, but each has its own
``/dev/shm`` and its own pid namespace; two machines may also carry the same name. Each rank
publishes what it sees at the rendezvous (:func:`machine`, :func:`pid_namespace`), and
:func:`ringcomm.job.hosts.separate_by_machine` treats ranks of one name but different machines as
separate hosts, the way NCCL compares the host's boot id and ``/dev/shm``'s device.
"""

from __future__ import annotations

import os

from .names import SHM_DIR

__all__ = ["machine", "pid_namespace"]

_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def machine() -> list[str | int]:
    """``[boot id, /dev/shm's device, network namespace]`` as this process sees them (``""``/0 where
    unreadable).  Ranks with equal values can open each other's shared-memory files and ipc sockets."""
    try:
        with open(_BOOT_ID) as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return [boot, _stat(SHM_DIR, "st_dev"), _stat("/proc/self/ns/net", "st_ino")]


def pid_namespace() -> int:
    """The inode of this process's pid namespace (0 where unreadable): ranks in one namespace on one
    machine can see each other's pids."""
    return _stat("/proc/self/ns/pid", "st_ino")


def _stat(path: str, field: str) -> int:
    try:
        return int(getattr(os.stat(path), field))
    except OSError:
        return 0
