"""Helpers for the launcher tests: run ``python -m ringcomm.launch.launcher`` and check processes are gone."""

from __future__ import annotations

import os
import pathlib
import queue
import re
import subprocess
import sys
import threading
import time

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


def launcher_env(**extra: str) -> dict[str, str]:
    """The test's environment without stray ``RINGCOMM_*`` variables, with the repo importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGCOMM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
    env.update(extra)
    return env


def launcher_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "ringcomm.launch.launcher", *args]


def run_launcher(*args: str, timeout: float = 30.0, **env: str) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run the launcher to completion; returns the result and the seconds it took."""
    start = time.monotonic()
    result = subprocess.run(
        launcher_cmd(*args), env=launcher_env(**env), capture_output=True, text=True, timeout=timeout,
        cwd=REPO_ROOT,
    )
    return result, time.monotonic() - start


def worker(code: str) -> list[str]:
    """A worker command running ``code`` in the test's Python."""
    return [sys.executable, "-c", code]


def spawned_pids(stderr: str) -> dict[int, int]:
    """rank -> pid from the launcher's ``-v`` lines."""
    return {int(r): int(p) for r, p in re.findall(r"ringcomm-run: rank (\d+): pid (\d+)", stderr)}


def alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie (a zombie has exited; only its entry remains)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    except OSError:
        pass
    else:
        return stat.rpartition(")")[2].split()[0] != "Z"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_gone(pids, timeout: float = 3.0) -> list[int]:
    """Wait until no pid in ``pids`` is alive; returns the ones still alive after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.02)


def kill_leftovers(pids) -> None:
    """Last-resort cleanup so a failing test does not leave processes behind."""
    for pid in pids:
        if alive(pid):
            try:
                os.kill(pid, 9)
            except OSError:
                pass


class LiveLauncher:
    """A launcher started in the background whose output lines are collected as they arrive."""

    def __init__(self, *args: str, **env: str) -> None:
        self.proc = subprocess.Popen(
            launcher_cmd(*args), env=launcher_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, cwd=REPO_ROOT,
        )
        self.lines: queue.Queue[tuple[str, str]] = queue.Queue()
        #: Lines consumed so far (by wait_for / finish), per stream.
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self._threads = [
            threading.Thread(target=self._read, args=(self.proc.stdout, "stdout"), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, "stderr"), daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _read(self, pipe, label: str) -> None:
        for line in pipe:
            self.lines.put((label, line))

    def _take(self, timeout: float) -> bool:
        try:
            label, line = self.lines.get(timeout=timeout)
        except queue.Empty:
            return False
        (self.stdout if label == "stdout" else self.stderr).append(line)
        return True

    def wait_for(self, pattern: str, count: int = 1, timeout: float = 10.0) -> list[re.Match]:
        """Wait until ``count`` output lines (either stream) match ``pattern``; returns the matches."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            seen = [m for line in self.stdout + self.stderr if (m := regex.search(line))]
            if len(seen) >= count:
                return seen
            if not self._take(max(0.0, deadline - time.monotonic())):
                raise AssertionError(
                    f"only {len(seen)} of {count} lines matched {pattern!r}; output so far:\n"
                    + "".join(self.stdout + self.stderr)
                )

    def finish(self, timeout: float = 15.0) -> int:
        """Wait for the launcher to exit and collect all its output; returns its exit status."""
        try:
            code = self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            for t in self._threads:
                t.join(5)
        while self._take(0.0):
            pass
        return code
