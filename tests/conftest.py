"""Shared fixtures: launching real ringcomm jobs with a deadline."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"


def job_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGCOMM_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def launch(np_: int, args: list[str], timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    """Run ``ringcomm-run -np N python ARGS...``; kills the job if it outlives ``timeout``."""
    cmd = [sys.executable, "-m", "ringcomm.launcher", "-np", str(np_), sys.executable, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=job_env(**env), cwd=ROOT)


@pytest.fixture
def run_job():
    return launch


def remove_files_of(pids: list[int]) -> None:
    """Remove the ipc socket files of killed ranks (a killed process cannot remove its own)."""
    import glob
    import tempfile

    for pid in pids:
        for path in glob.glob(f"{tempfile.gettempdir()}/ringcomm-*-{pid}-*"):
            try:
                os.unlink(path)
            except OSError:
                pass
