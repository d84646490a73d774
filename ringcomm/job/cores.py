"""What this process may use of its host's processors: the cores the engine's helpers and the
small-op lane's spinning are sized by.

The count is the CPU affinity, capped by the cgroup's CPU quota (a container with a CPU limit,
as Kubernetes sets, sees every core of the host in its affinity but may use only its quota).
"""

from __future__ import annotations

import os


def cores_from(affinity: int, cpu_max: str | None) -> int:
    """The cores a process may use: its CPU affinity, capped by a cgroup's CPU quota
    (``cpu.max``: ``"<quota> <period>"`` or ``"max <period>"``) rounded down, at least 1.

        cores_from(16, "max 100000") -> 16    cores_from(16, "250000 100000") -> 2    cores_from(4, None) -> 4
    """
    cores = max(1, affinity)
    fields = (cpu_max or "").split()
    if len(fields) == 2 and fields[0] != "max":
        try:
            quota, period = int(fields[0]), int(fields[1])
        except ValueError:
            return cores
        if quota > 0 and period > 0:
            cores = min(cores, max(1, quota // period))
    return cores


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return None


def available_cores(cgroup: str = "/sys/fs/cgroup") -> int:
    """This process's cores (:func:`cores_from` over its affinity and its cgroup's quota: cgroup v2's
    ``cpu.max``, else v1's ``cpu/cpu.cfs_quota_us`` and ``cpu/cpu.cfs_period_us``, where -1 is no quota)."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        affinity = os.cpu_count() or 1
    cpu_max = _read(os.path.join(cgroup, "cpu.max"))
    if cpu_max is None:
        quota, period = _read(os.path.join(cgroup, "cpu", "cpu.cfs_quota_us")), \
            _read(os.path.join(cgroup, "cpu", "cpu.cfs_period_us"))
        if quota is not None and period is not None:
            cpu_max = f"{'max' if quota.startswith('-') else quota} {period}"
    return cores_from(affinity, cpu_max)
