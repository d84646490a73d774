"""Start a worker that dies with the launcher: ``python -I .../ringcomm/launch/guard.py PPID -- COMMAND...``.

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
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

_PR_SET_PDEATHSIG = 1
#: Seconds a worker gets, after the launcher died and it got SIGTERM, before SIGKILL.
GRACE = 3.0


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


def _watch(worker: int, launcher: int) -> None:
    """In a forked child: once ``launcher`` is no longer ``worker``'s parent, SIGTERM, grace, SIGKILL."""
    _die_with_parent(signal.SIGKILL)  # the worker is this process's parent: never outlive it
    if os.getppid() != worker:
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # hold none of the launcher's pipes open
        os.dup2(devnull, fd)
    os.closerange(3, 65536)
    while _parent_of(worker) == launcher:
        time.sleep(0.5)
    if _parent_of(worker) != -1:
        try:
            os.kill(worker, signal.SIGTERM)
            deadline = time.monotonic() + GRACE
            while time.monotonic() < deadline and _parent_of(worker) != -1:
                time.sleep(0.1)
            os.kill(worker, signal.SIGKILL)
        except OSError:
            pass
    os._exit(0)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m ringcomm.launch.guard PPID -- COMMAND...", file=sys.stderr)
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
                _watch(me, parent)
            finally:
                os._exit(0)
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"ringcomm-run: cannot start {command[0]}: {exc}", file=sys.stderr)
        return 127 if isinstance(exc, FileNotFoundError) else 126
    return 0  # pragma: no cover - execvp does not return


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
