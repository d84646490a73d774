"""Run a benchmark job (one or more processes) with a deadline, and always reap every process.

Each process starts in its own session, so ``os.killpg`` reaches it and its
children.  When one process fails the others are stopped (a gloo rank would
otherwise wait forever for its dead peer); on timeout all are stopped.
Stopping is SIGTERM, then SIGKILL after a grace period; every process is
waited for before :func:`run_job` returns, whatever happened.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

#: Seconds between SIGTERM and SIGKILL.  The ringcomm launcher itself gives its workers 3 s.
GRACE_SECONDS = 6.0
#: Lines of output kept for an error message.
TAIL_LINES = 25
#: ... of a job that timed out: enough for the stacks its workers printed just before (see ``_timing``).
TIMED_OUT_TAIL_LINES = 120


@dataclasses.dataclass
class JobResult:
    """How a job ended."""

    ok: bool
    returncodes: list[int | None]
    wall_s: float
    timed_out: bool
    #: Last lines of each process's output (stdout and stderr together).
    tails: list[str]

    def describe(self) -> str:
        """One paragraph saying why the job failed (empty if it did not)."""
        if self.ok:
            return ""
        why = "timed out" if self.timed_out else f"exit codes {self.returncodes}"
        parts = [f"job failed ({why}, {self.wall_s:.1f} s)"]
        for i, tail in enumerate(self.tails):
            if tail.strip():
                parts.append(f"--- process {i} output (last lines) ---\n{tail.rstrip()}")
        return "\n".join(parts)


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(procs: Sequence[subprocess.Popen[bytes]], grace: float) -> None:
    """SIGTERM every live process group, SIGKILL what is left after ``grace`` seconds, reap all."""
    for proc in procs:
        if proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in procs:
        if proc.poll() is None:
            _signal_group(proc, signal.SIGKILL)
        proc.wait()
        # Grandchildren left in the group (the process exited but a child did not): kill them too.
        _signal_group(proc, signal.SIGKILL)


def _tail(path: str, count: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max(16384, 200 * count)))
            lines = f.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-count:])


def run_job(commands: Sequence[Sequence[str]], env: Mapping[str, str], timeout: float,
            cwd: str | None = None) -> JobResult:
    """Start every command, wait until all exit 0, one fails, or ``timeout`` seconds pass.

    Output goes to temporary files (never a pipe that could fill up); their
    last lines come back in the result.  No process outlives this call.
    """
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[str] = []
    start = time.monotonic()
    timed_out = False
    failed = False
    with tempfile.TemporaryDirectory(prefix="ringcomm-bench-") as tmp:
        try:
            for i, cmd in enumerate(commands):
                log_path = os.path.join(tmp, f"proc{i}.log")
                logs.append(log_path)
                with open(log_path, "wb") as out:
                    procs.append(subprocess.Popen(list(cmd), env=dict(env), cwd=cwd, stdout=out,
                                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                  start_new_session=True))
            deadline = start + timeout
            while True:
                codes = [p.poll() for p in procs]
                if any(c not in (None, 0) for c in codes):
                    failed = True
                    break
                if all(c == 0 for c in codes):
                    break
                if time.monotonic() > deadline:
                    timed_out = True
                    break
                time.sleep(0.02)
        finally:
            # Failed peers: stop at once; a timeout: let the launcher clean up its workers first.
            _stop(procs, GRACE_SECONDS if timed_out else 2.0)
        wall = time.monotonic() - start
        codes = [p.returncode for p in procs]
        ok = not timed_out and not failed and len(procs) == len(commands) and all(c == 0 for c in codes)
        return JobResult(ok=ok, returncodes=codes, wall_s=wall, timed_out=timed_out,
                         tails=[_tail(p, TIMED_OUT_TAIL_LINES if timed_out else TAIL_LINES) for p in logs])


def job_record(result: JobResult, out: str, keep: Sequence[str] = (), **fields: Any) -> dict[str, Any]:
    """One benchmark job's record: ``fields``, whether it ran, its error, and rank 0's per-size results
    read from ``out`` (the JSON the worker wrote), with the keys ``keep`` of that JSON beside them; a job
    that ran but wrote none counts as failed."""
    record: dict[str, Any] = {**fields, "ok": result.ok, "error": None, "results": []}
    if result.ok:
        try:
            with open(out, encoding="utf-8") as f:
                payload = json.load(f)
            record["results"] = payload["results"]
            record.update((key, payload.get(key)) for key in keep)
        except (OSError, ValueError, KeyError) as exc:
            record.update(ok=False, error=f"no results from rank 0: {exc}")
    else:
        record["error"] = result.describe()
    return record
