"""Start a worker that dies with the launcher: ``python -I .../ringcomm/launch/guard.py PPID [--reclaim GLOB] -- COMMAND...``.

The launcher starts every local worker (and every ssh to a remote host)
through this guard, run as a file so that it needs no import path.  It
asks the kernel for SIGTERM when its parent dies (``prctl(PR_SET_PDEATHSIG)``,
kept across ``exec``), checks the launcher (``PPID``) did not die in between,
and then *becomes* ``COMMAND`` with ``os.execvp``: same pid, no extra process.  So a launcher killed with
SIGKILL, which cannot stop its workers itself, still leaves no worker behind
(an ssh'd rank then loses its ssh, and ``ringcomm.launch.rexec`` on the remote host
stops it).  A worker that handles or ignores SIGTERM would survive that, so
before the exec the guard forks a small watcher: it dies with the worker (its
parent, by its own death signal), and if the launcher goes first it gives the
worker ``GRACE`` seconds after the SIGTERM, then SIGKILL.  Off Linux the guard
just execs.

The watcher also outlives the worker, by a moment: with ``--reclaim GLOB`` (the
job's shared-memory files, ``/dev/shm/ringcomm-JOB-*``), once the worker has
died, however it died, it removes every file there whose creator is dead (the
lock rule of :mod:`ringcomm.shm.reclaim`, loaded by its path), so a rank killed
while it held a named region (the small-op lane, a ring no peer had mapped yet)
leaves nothing in /dev/shm even when the launcher was killed too.  A live
rank's files are never touched.  The watcher leaves the worker's process group,
so the launcher counts only the worker and what it started, and it ignores the
SIGTERM of a launcher's stop: it ends with the worker.
"""

from __future__ import annotations

import ctypes
import errno
import importlib.util
import os
import signal
import sys
import time
from collections.abc import Callable
from types import FrameType

_PR_SET_PDEATHSIG = 1
#: Seconds a worker gets, after the launcher died and it got SIGTERM, before SIGKILL.
GRACE = 3.0
#: Seconds the watcher waits for the worker's last thread to exit before it removes the dead's files.
EXIT_WAIT = 10.0
#: What the kernel sends the watcher when the worker (its parent) dies.
_WORKER_GONE = signal.SIGUSR1
#: The module with the lock rule (standard library only), beside this file's folder.
_RECLAIM = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "shm", "reclaim.py")


class _WorkerGone(Exception):
    """Raised in the watcher by the signal the kernel sends when the worker dies."""


def _die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send ``sig`` when the parent exits; False where prctl is unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _parent_of(pid: int) -> int:
    """``pid``'s parent, or -1 once ``pid`` is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rpartition(b")")[2].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _exited(pid: int) -> bool:
    """Whether every thread of process ``pid`` has finished exiting (it is gone, or a zombie with no
    thread left), so the kernel has closed its files and dropped its locks.  The kernel signals a
    child when its parent *thread* exits; a process with more threads (numpy's, torch's) may still
    hold its files then."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        return True
    return threads == [str(pid)] and state in (b"Z", b"X")


def _reclaimer(pattern: str | None) -> Callable[[int], object]:
    """What removes the files matching ``pattern`` whose creators died, once ``worker`` has (nothing
    without a pattern, or where :mod:`ringcomm.shm.reclaim` cannot be loaded)."""
    spec = importlib.util.spec_from_file_location("ringcomm_guard_reclaim", _RECLAIM) if pattern else None
    if pattern is None or spec is None or spec.loader is None:
        return lambda worker: None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except (OSError, ImportError, SyntaxError):
        return lambda worker: None
    return lambda worker: module.reclaim_dead(pattern, {worker})


def _watch(worker: int, launcher: int, reclaim: str | None) -> None:
    """In a forked child: once ``launcher`` is no longer ``worker``'s parent, SIGTERM, grace, SIGKILL;
    once ``worker`` is gone, remove the dead's files matching ``reclaim``, and end."""

    over: list[bool] = []  # once set, the kernel's signal (sent at each reparenting) raises no more

    def gone(signum: int, frame: FrameType | None) -> None:
        if not over and os.getppid() != worker:
            over.append(True)
            raise _WorkerGone

    cleanup = _reclaimer(reclaim)
    try:
        signal.signal(_WORKER_GONE, gone)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a stop of the worker's group: end with the worker
        _die_with_parent(_WORKER_GONE)  # the worker is this process's parent: never outlive it for long
        if os.getppid() != worker:
            raise _WorkerGone
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):  # hold none of the launcher's pipes open
            os.dup2(devnull, fd)
        os.closerange(3, 65536)
        try:
            os.setpgid(0, 0)  # not one of the worker's group, whose end the launcher waits for
        except OSError:
            pass
        while _parent_of(worker) == launcher:
            time.sleep(0.5)
        if _parent_of(worker) != -1:
            try:
                os.kill(worker, signal.SIGTERM)
                deadline = time.monotonic() + GRACE
                while time.monotonic() < deadline and not _exited(worker):
                    time.sleep(0.1)
                os.kill(worker, signal.SIGKILL)
            except OSError:
                pass
        while os.getppid() == worker:  # it is dying: the kernel's signal is on its way
            time.sleep(0.1)
        over.append(True)
    except _WorkerGone:
        pass
    deadline = time.monotonic() + EXIT_WAIT
    while not _exited(worker) and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        cleanup(worker)
    except OSError:  # best effort: what is left, the launcher or the next job's init() removes
        pass
    os._exit(0)


def _cannot_start(program: str, exc: OSError, rank: str | None) -> str:
    """Why ``program`` could not be started, for the rank's own stderr (the launcher, ``ringcomm-run``
    or ``horovodrun``, then reports the rank's exit).

    >>> _cannot_start("./train.py", OSError(8, "Exec format error"), "1")
    "rank 1: cannot start ./train.py: [Errno 8] Exec format error; give the script a '#!' line, or run it through its interpreter (e.g. python ./train.py)"
    """
    who = f"rank {rank}: " if rank else ""
    hint = ""
    if exc.errno == errno.ENOEXEC:
        hint = f"; give the script a '#!' line, or run it through its interpreter (e.g. python {program})"
    return f"{who}cannot start {program}: {exc}{hint}"


def main(argv: list[str]) -> int:
    reclaim = None
    if len(argv) > 2 and argv[1] == "--reclaim":
        reclaim, argv = argv[2], [argv[0], *argv[3:]]
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m ringcomm.launch.guard PPID [--reclaim GLOB] -- COMMAND...", file=sys.stderr)
        return 2
    parent = int(argv[0])
    command = argv[2:]
    guarded = _die_with_parent()
    if os.getppid() != parent:  # the launcher died before the request took effect
        return 1
    if guarded:
        me = os.getpid()
        if os.fork() == 0:
            try:
                _watch(me, parent, reclaim)
            finally:
                os._exit(0)
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(_cannot_start(command[0], exc, os.environ.get("RINGCOMM_RANK")), file=sys.stderr)
        return 127 if isinstance(exc, FileNotFoundError) else 126
    return 0  # pragma: no cover - execvp does not return


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
