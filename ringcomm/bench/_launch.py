"""Command lines that start one benchmark job of each system, and whether Horovod is usable here."""

from __future__ import annotations

import functools
import importlib.util
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from . import _procs, _util

#: Systems in the order they run within one repeat (and appear in reports).
SYSTEMS = ("ringcomm", "gloo", "horovod")
#: ringcomm with RINGCOMM_ENCRYPT=1 (``--encrypt``): the same worker, CURVE on every connection.
ENCRYPTED = "ringcomm-encrypted"

_python: list[str] = [sys.executable]


def use_python(command: Sequence[str]) -> None:
    """Start every rank's Python with ``command`` (``--rank-python``; default: this interpreter)."""
    _python[:] = list(command) or [sys.executable]


def python() -> list[str]:
    """The command that starts a rank's Python (:func:`use_python`)."""
    return list(_python)


def ringcomm_commands(np_: int, module: str, args: Sequence[str]) -> list[list[str]]:
    """One command: the ringcomm launcher starting ``np_`` copies of ``python -m module args``."""
    return [[sys.executable, "-m", "ringcomm.launch.launcher", "-np", str(np_), *python(), "-m", module, *args]]


def gloo_commands(np_: int, module: str, args: Sequence[str], port: int) -> list[list[str]]:
    """``np_`` commands, one per rank, meeting at tcp://127.0.0.1:port."""
    return [[*python(), "-m", module, "--rank", str(r), "--world-size", str(np_), "--port", str(port), *args]
            for r in range(np_)]


def _horovodrun() -> str | None:
    beside = Path(sys.executable).with_name("horovodrun")
    return str(beside) if beside.exists() else shutil.which("horovodrun")


def horovod_commands(np_: int, module: str, args: Sequence[str]) -> list[list[str]]:
    """One command: ``horovodrun --gloo`` starting ``np_`` copies of ``python -m module args``."""
    runner = _horovodrun()
    if runner is None:
        raise RuntimeError("horovodrun not found")
    return [[runner, "-np", str(np_), "-H", f"localhost:{np_}", "--gloo", *python(), "-m", module, *args]]


def torch_status() -> str | None:
    """``None`` if torch is installed here, else why gloo and the torch benchmarks are skipped (the
    core needs only numpy, pyzmq and msgpack)."""
    try:
        found = importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        found = False
    return None if found else "torch is not installed here: pip install torch"


def skip_gloo(systems: list[str], notes: list[str]) -> None:
    """Take gloo out of ``systems`` where torch is missing, with a note saying why."""
    why = torch_status() if "gloo" in systems else None
    if why is not None:
        systems.remove("gloo")
        notes.append(f"gloo skipped (it comes with torch): {why}")


@functools.cache
def horovod_status() -> str | None:
    """``None`` if ``import horovod.torch`` works and horovodrun exists, else why Horovod is skipped."""
    try:
        probe = subprocess.run([*python(), "-c", "import horovod, horovod.torch; print(horovod.__version__)"],
                               capture_output=True, text=True, timeout=120, env=_util.worker_env(False))
    except (OSError, subprocess.SubprocessError) as exc:
        return f"cannot check for Horovod: {exc}"
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["import failed"])[-1]
        return f"horovod.torch not importable ({last})"
    version = probe.stdout.strip()
    if "+ringcomm" in version:
        return f"horovod {version} is ringcomm's compat distribution (compat/horovod), not Horovod"
    if _horovodrun() is None:
        return "horovod.torch imports but horovodrun is not on PATH"
    return None


def run_system(system: str, np_: int, module: str, args: Sequence[str], timeout: float) -> _procs.JobResult:
    """Run one job of ``system`` with ``np_`` ranks; a gloo job whose port was taken is retried once."""
    if system == "ringcomm":
        return _procs.run_job(ringcomm_commands(np_, module, args), _util.worker_env(True), timeout)
    if system == ENCRYPTED:
        env = _util.worker_env(True, {"RINGCOMM_ENCRYPT": "1"})
        return _procs.run_job(ringcomm_commands(np_, module, args), env, timeout)
    if system == "horovod":
        return _procs.run_job(horovod_commands(np_, module, args), _util.worker_env(False), timeout)
    if system == "gloo":
        env = _util.worker_env(False)
        result = _procs.run_job(gloo_commands(np_, module, args, _util.free_port()), env, timeout)
        if not result.ok and any("address already in use" in t.lower() for t in result.tails):
            _util.log("gloo: the rendezvous port was taken meanwhile; retrying on another port")
            result = _procs.run_job(gloo_commands(np_, module, args, _util.free_port()), env, timeout)
        elif result.timed_out:
            # gloo has no deadline of its own at its rendezvous (a stray peer on the port, a lost
            # connection): it waits 30 minutes.  One retry on a fresh port tells that from a slow job.
            _util.log(f"gloo: the job timed out after {timeout:g} s; retrying once on another port")
            result = _procs.run_job(gloo_commands(np_, module, args, _util.free_port()), env, timeout)
        return result
    raise ValueError(f"unknown system {system!r}")
