"""Shared helpers of the real-tool tests: find a tool or skip, run a command with a deadline, parse results."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
WORKER = str(HERE.parent / "workers" / "realtools_job_worker.py")


def tool_missing(tool: str, package: str, which: Callable[[str], str | None] = shutil.which) -> str | None:
    """Why ``tool`` cannot be run here (the Debian package to install), or None when it is on PATH."""
    if which(tool) is None:
        return f"{tool} is not installed (apt-get install {package}); .ci/run installs it"
    return None


def module_missing(module: str, extra: str, find_spec: Callable[[str], object] = importlib.util.find_spec) -> str | None:
    """Why ``module`` cannot be imported here (the ringcomm extra that brings it), or None when it can."""
    try:
        found = find_spec(module)
    except (ImportError, ValueError):  # a parent package that is missing or broken
        found = None
    if found is None:
        return f"{module} is not installed (pip install 'ringcomm[{extra}]'); .ci/run installs it"
    return None


def need(tool: str, package: str) -> str:
    """The path of ``tool``; skips the test, naming the package to install, when it is absent."""
    why = tool_missing(tool, package)
    if why is not None:
        pytest.skip(why)
    return shutil.which(tool) or tool


def env(**extra: str) -> dict[str, str]:
    """The test's environment without RINGCOMM_* and launcher variables, with the repository importable."""
    drop = ("RINGCOMM_", "OMPI_", "PMI_", "PMIX_", "SLURM_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    out = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    out["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out.update(extra)
    return out


def run(cmd: list[str], timeout: float, **kwargs: object) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` to completion within ``timeout`` s (its whole process group is killed past it)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **kwargs)  # type: ignore[call-overload]
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        raise AssertionError(f"{cmd[0]} did not finish within {timeout} s\nstdout:\n{out}\nstderr:\n{err}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def results(text: str) -> list[dict]:
    """The ``RESULT {...}`` records the worker printed, by rank."""
    # a launcher that merges the ranks' output may join two records on one line
    recs = [json.loads(m) for m in re.findall(r"RESULT (\{[^{}]*\})", text)]
    return sorted(recs, key=lambda r: r["rank"])


def assert_job_ok(proc: subprocess.CompletedProcess[str], size: int, source: str) -> None:
    both = f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == 0, both
    recs = results(proc.stdout)
    assert [r["rank"] for r in recs] == list(range(size)), both
    assert all(r["size"] == size and r["sum"] == size * (size + 1) / 2 for r in recs), both
    assert {r["source"] for r in recs} == {source}, both


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PYTHON = sys.executable
