"""Horovod's ``HOROVOD_*`` settings, read as the ``RINGCOMM_*`` settings they mean.  Pure.

Job files written for Horovod export ``HOROVOD_FUSION_THRESHOLD``,
``HOROVOD_TIMELINE``, ``HOROVOD_STALL_CHECK_TIME_SECONDS`` and the like; they
take effect here too.  When both names are set, the ``RINGCOMM_*`` one wins.
A ``HOROVOD_*`` variable that has no meaning here (a GPU library choice, the
autotuner, MPI threading) is reported by :func:`without_meaning`, so
``init()`` can warn about it instead of silently ignoring it; the variables
horovodrun sets for its own workers are neither settings nor warnings.

    translate({"HOROVOD_FUSION_THRESHOLD": "33554432", "HOROVOD_LOG_LEVEL": "trace"})
    -> {"RINGCOMM_FUSION_THRESHOLD": "33554432", "RINGCOMM_LOG_LEVEL": "DEBUG"}
"""

from __future__ import annotations

from collections.abc import Mapping

#: ``HOROVOD_X`` -> the ``RINGCOMM_Y`` setting it sets, value unchanged (same unit).
SAME = {
    "HOROVOD_FUSION_THRESHOLD": "RINGCOMM_FUSION_THRESHOLD",  # bytes
    "HOROVOD_CYCLE_TIME": "RINGCOMM_CYCLE_TIME",  # milliseconds
    "HOROVOD_CACHE_CAPACITY": "RINGCOMM_CACHE_CAPACITY",
    "HOROVOD_STALL_CHECK_TIME_SECONDS": "RINGCOMM_STALL_CHECK_SECONDS",
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "RINGCOMM_STALL_SHUTDOWN_SECONDS",
    "HOROVOD_TIMELINE_MARK_CYCLES": "RINGCOMM_TIMELINE_MARK_CYCLES",
    "HOROVOD_HIERARCHICAL_ALLREDUCE": "RINGCOMM_HIERARCHICAL_ALLREDUCE",
    "HOROVOD_DYNAMIC_PROCESS_SETS": "RINGCOMM_DYNAMIC_PROCESS_SETS",
    "HOROVOD_START_TIMEOUT": "RINGCOMM_START_TIMEOUT",
    "HOROVOD_GLOO_IFACE": "RINGCOMM_NETWORK_INTERFACE",
    "HOROVOD_GLOO_TIMEOUT_SECONDS": "RINGCOMM_PEER_TIMEOUT",  # as ringcomm-run --gloo-timeout-seconds
    "HOROVOD_CONTROLLER": "RINGCOMM_CONTROLLER",  # horovodrun --gloo / --mpi: gloo_enabled(), mpi_enabled()
    "HOROVOD_CPU_OPERATIONS": "RINGCOMM_CPU_OPERATIONS",
}
#: Read with a translation (see :func:`translate`).
TRANSLATED = frozenset({"HOROVOD_TIMELINE", "HOROVOD_LOG_LEVEL", "HOROVOD_STALL_CHECK_DISABLE"})
#: Set by horovodrun (and Horovod's elastic driver) for its workers: the job's layout, not settings.
JOB_VARS = frozenset({
    "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK",
    "HOROVOD_CROSS_SIZE", "HOROVOD_HOSTNAME", "HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_PORT",
    "HOROVOD_SECRET_KEY",
    "HOROVOD_ELASTIC", "HOROVOD_HOSTS", "HOROVOD_IFACE", "HOROVOD_LOG_HIDE_TIME", "HOROVOD_LOG_WITH_TIMESTAMP",
})
#: Horovod's log levels -> Python's.
_LEVELS = {"TRACE": "DEBUG", "DEBUG": "DEBUG", "INFO": "INFO", "WARNING": "WARNING", "ERROR": "ERROR",
           "FATAL": "CRITICAL"}


def _on(raw: str) -> bool:
    return raw.strip().lower() in ("1", "true", "yes", "on")


def translate(env: Mapping[str, str]) -> dict[str, str]:
    """The ``RINGCOMM_*`` variables that ``env``'s ``HOROVOD_*`` ones stand for, where not set already."""
    out: dict[str, str] = {}
    for key, target in SAME.items():
        if key in env:
            out[target] = env[key]
    timeline = env.get("HOROVOD_TIMELINE", "")
    if timeline and timeline.upper() != "DYNAMIC":  # DYNAMIC: started later by start_timeline()
        out["RINGCOMM_TIMELINE"] = timeline
    level = env.get("HOROVOD_LOG_LEVEL", "").strip().upper()
    if level:
        out["RINGCOMM_LOG_LEVEL"] = _LEVELS.get(level, level)
    if _on(env.get("HOROVOD_STALL_CHECK_DISABLE", "")):
        out["RINGCOMM_STALL_CHECK_SECONDS"] = "inf"
        out["RINGCOMM_STALL_SHUTDOWN_SECONDS"] = "0"
    return {k: v for k, v in out.items() if k not in env}


def source(target: str, env: Mapping[str, str]) -> str:
    """The ``HOROVOD_*`` name in ``env`` that :func:`translate` read ``target`` from (``target``
    itself when none), for messages that name what the user set."""
    return next((key for key, to in SAME.items() if to == target and key in env), target)


def without_meaning(env: Mapping[str, str]) -> list[str]:
    """``HOROVOD_*`` variables in ``env`` that change nothing here (for a warning), sorted."""
    return sorted(k for k in env if k.startswith("HOROVOD_") and k not in SAME and k not in TRANSLATED
                  and k not in JOB_VARS)
