"""Start a worker that dies with the launcher: ``python -m ringcomm._parent_guard PPID -- COMMAND...``.

The launcher starts every local worker (and every ssh to a remote host)
through this guard.  It asks the kernel for SIGTERM when its parent dies
(``prctl(PR_SET_PDEATHSIG)``, kept across ``exec``), checks the launcher
(``PPID``) did not die in between, and then *becomes* ``COMMAND`` with
``os.execvp``: same pid, no extra process.  So a launcher killed with
SIGKILL, which cannot stop its workers itself, still leaves no worker behind
(an ssh'd rank then loses its ssh, and ``ringcomm.rexec`` on the remote host
stops it).  Off Linux the guard just execs.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def _die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send ``sig`` when the parent exits; False where prctl is unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m ringcomm._parent_guard PPID -- COMMAND...", file=sys.stderr)
        return 2
    parent = int(argv[0])
    command = argv[2:]
    _die_with_parent()
    if os.getppid() != parent:  # the launcher died before the request took effect
        return 1
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"ringcomm-run: cannot start {command[0]}: {exc}", file=sys.stderr)
        return 127 if isinstance(exc, FileNotFoundError) else 126
    return 0  # pragma: no cover - execvp does not return


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
