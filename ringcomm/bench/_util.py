"""Small helpers shared by the benchmark's orchestrators: sizes, statistics, environments, machine info."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

#: Directory holding the ``ringcomm`` package; put on workers' PYTHONPATH so a plain checkout works too.
PACKAGE_ROOT = Path(__file__).resolve().parents[2]

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_size(text: str) -> int:
    """``"4K"`` -> 4096, ``"64M"`` -> 67108864, ``"1G"``, ``"512"`` (bytes); binary units, case-insensitive."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 4K, 64K, 1M, 16M, 64M, 4096)")
    value = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if value <= 0:
        raise ValueError(f"size must be positive: {text!r}")
    return value


def format_size(nbytes: int) -> str:
    """4096 -> ``"4 KiB"``, 67108864 -> ``"64 MiB"``, 1000 -> ``"1000 B"``."""
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= factor and nbytes % factor == 0:
            return f"{nbytes // factor} {unit}"
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= factor:
            return f"{nbytes / factor:.1f} {unit}"
    return f"{nbytes} B"


def format_ms(seconds: float | None) -> str:
    """Milliseconds to three significant figures (a 4 KiB op and a 64 MiB one in one table); ``n/a`` for none."""
    return "n/a" if not seconds else f"{seconds * 1e3:.3g} ms"


def median(values: Iterable[float]) -> float:
    """Median of ``values`` (NaN when empty)."""
    data = list(values)
    return statistics.median(data) if data else float("nan")


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank) of ``values``; NaN for none."""
    if not values:
        return float("nan")
    data = sorted(values)
    k = max(0, min(len(data) - 1, round(q / 100 * (len(data) - 1))))
    return data[k]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the caller retries if it got taken since)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def worker_env(keep_ringcomm_knobs: bool, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for benchmark workers: one thread per rank, this package importable.

    ``RINGCOMM_*`` job variables are always dropped (the launcher sets them); the
    tuning knobs are kept only for ringcomm jobs (``keep_ringcomm_knobs``).
    """
    from ringcomm.job.config import TOPOLOGY_VARS

    env = {
        k: v for k, v in os.environ.items()
        if not k.startswith("RINGCOMM_") or (keep_ringcomm_knobs and k not in TOPOLOGY_VARS)
    }
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = "1"
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), env.get("PYTHONPATH", "")]))
    if extra:
        env.update(extra)
    return env


def ringcomm_knobs() -> dict[str, str]:
    """The ``RINGCOMM_*`` tuning knobs set in this environment (recorded with the results)."""
    from ringcomm.job.config import TOPOLOGY_VARS

    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("RINGCOMM_") and k not in TOPOLOGY_VARS}


def cpu_ticks(stat: str = "/proc/stat") -> tuple[int, int] | None:
    """This host's CPU time so far, in ticks: (stolen by the hypervisor, all), or None where the kernel
    does not say (not Linux, or a kernel without the steal column)."""
    try:
        with open(stat, encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    ticks = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal (guest counted in user)
    return ticks[7], sum(ticks)


def steal_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of this host's CPU time the hypervisor took between two :func:`cpu_ticks` samples.

    >>> steal_share((10, 1000), (60, 2000))
    0.05
    >>> steal_share(None, (60, 2000)) is None
    True
    """
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def steal_text(runs: Iterable[dict[str, Any]]) -> str | None:
    """A line on the hypervisor's share of the CPU over the jobs ``runs`` (their ``steal``), or None when
    no job has a figure.

    >>> steal_text([{"steal": 0.01}, {"steal": 0.2}, {"steal": None}])
    'CPU time the hypervisor took (steal) on the host that ran the benchmark, per job: median 10.5%, most 20.0% (2 jobs).'
    """
    shares = sorted(float(r["steal"]) for r in runs if isinstance(r.get("steal"), (int, float)))
    if not shares:
        return None
    return (f"CPU time the hypervisor took (steal) on the host that ran the benchmark, per job: median "
            f"{median(shares):.1%}, most {shares[-1]:.1%} ({len(shares)} jobs).")


def usable_cores() -> int | None:
    """The cores this process may run on (its affinity), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count()


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=PACKAGE_ROOT, capture_output=True,
                             text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=PACKAGE_ROOT,
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def machine_info() -> dict[str, object]:
    """Where and with what the numbers were taken: cores, CPU, Python and library versions, date."""
    try:
        import zmq

        libzmq: str | None = zmq.zmq_version()
    except ImportError:
        libzmq = None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "platform": platform.platform(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "usable_cores": usable_cores(),
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "ringcomm": _version("ringcomm"),
        "ringcomm_git": _git_commit(),
        "torch": _version("torch"),
        "pyzmq": _version("pyzmq"),
        "libzmq": libzmq,
        "numpy": _version("numpy"),
        "msgpack": _version("msgpack"),
        "horovod": _version("horovod"),
        "matplotlib": _version("matplotlib"),
        "ringcomm_knobs": ringcomm_knobs(),
    }


def cuda_missing() -> str | None:
    """``None`` when torch sees a CUDA device, else why ``--device cuda`` cannot run here."""
    try:
        import torch
    except ImportError as exc:
        return f"--device cuda needs torch with CUDA, and torch does not import ({exc})"
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        return (f"--device cuda needs a GPU that torch can see, and torch {torch.__version__} ({build}) sees none; "
                "run it on a machine with a CUDA GPU and a CUDA build of torch, or leave --device out")
    return None


def log(text: str) -> None:
    """Progress line on stderr (stdout is kept for the Markdown report)."""
    print(f"[bench] {text}", file=sys.stderr, flush=True)
