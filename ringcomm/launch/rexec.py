"""The remote end of a rank started over ssh: run it, and stop it when the launcher goes away.

``python -m ringcomm.launch.rexec --grace 2 --job JOB --rank 2 -- python train.py``
(:func:`ringcomm.launch.remote.remote_command` builds that line) starts the command
in a process group of its own, with its output going where this process's
goes (back through ssh), and:

- when this process's standard input reaches end of file -- ``ringcomm-run``
  closed the ssh's input, or the ssh connection died -- or it receives
  SIGTERM/SIGHUP/SIGINT, it sends SIGTERM to the command's whole group, and
  SIGKILL after ``--grace`` seconds;
- when the command exits, it stops whatever the command left running in its
  group the same way, removes the job's socket and shared-memory files that
  dead ranks left on this host, and exits with the command's status (128 + N
  for a command killed by signal N, which it also reports on stderr, since ssh
  cannot carry a signal).

ssh forwards no signals, so the end of the input is the one message that
always arrives: even if the launcher is killed with SIGKILL, its pipes close.
"""

from __future__ import annotations

import argparse
import glob
import os
import select
import signal
import socket
import subprocess
import sys
from ..job import names
from ..shm.reclaim import process_alive
import threading
import time
from collections.abc import Sequence
from types import FrameType

__all__ = ["main", "stop_group", "remove_job_files"]

_PROG = "ringcomm.launch.rexec"


def _group_alive(pgid: int) -> bool:
    """True while a process of group ``pgid`` runs (zombies do not count)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if not os.path.isdir("/proc/self"):
        return True
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    fields = f.read().rpartition(b")")[2].split()
            except OSError:
                continue
            if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != b"Z":
                return True
    return False


def stop_group(pgid: int, grace: float) -> None:
    """SIGTERM process group ``pgid``, SIGKILL it if anything is left after ``grace`` s, wait until it is gone."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not _group_alive(pgid):
                return
            time.sleep(0.02)


def remove_job_files(job_id: str, rank: int) -> list[str]:
    """Remove job ``job_id``'s files on this host that no live process owns; returns what was removed.

    ipc socket files carry their owner's pid (``ringcomm-JOB-PID-...``) and are removed once that
    pid is gone; shared-memory rings ``ringcomm-JOB-ROUND-SRC-DST`` and notices of a lost rank
    ``ringcomm-JOB-ROUND-lost-SRC`` are removed when ``SRC`` is ``rank`` (this wrapper's rank, whose
    process is gone by now), and by rank 0's wrapper the shared-memory allreduce region
    ``ringcomm-JOB-ROUND-allreduce``.
    """
    removed = []
    shm_glob, tmp_glob = names.job_globs(job_id)
    for path in glob.glob(tmp_glob):
        owner = names.ipc_owner(job_id, os.path.basename(path))
        if owner is not None and not process_alive(owner):
            removed.append(path)
    # rank 0 also creates the job-wide allreduce region ``ringcomm-JOB-ROUND-allreduce`` (shm_allreduce.py)
    removed += [p for p in glob.glob(shm_glob) if names.is_rank_shm(job_id, os.path.basename(p), rank)]
    for path in removed:
        try:
            os.unlink(path)
        except OSError:
            pass
    return removed


#: Seconds to wait for the secret line the launcher writes into the ssh's input.
SECRET_TIMEOUT = 60.0


def read_secret(fd: int, timeout: float) -> str | None:
    """The first line on ``fd``: hex digits only (the launcher writes ``RINGCOMM_SECRET`` and a newline).

    Reads byte by byte so nothing after the line is consumed (the rest of the input is
    watched for its end).  None on end of input, a timeout, or anything but hex.
    """
    deadline = time.monotonic() + timeout
    line = b""
    while len(line) <= 256:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        byte = os.read(fd, 1)
        if not byte:
            return None
        if byte == b"\n":
            text = line.decode("ascii", "replace").strip()
            return text if text and all(c in "0123456789abcdefABCDEF" for c in text) else None
        line += byte
    return None


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=_PROG, description="run a ringcomm rank on this host for ringcomm-run")
    parser.add_argument("--grace", type=float, default=2.0, help="seconds between SIGTERM and SIGKILL")
    parser.add_argument("--job", default="", help="the job id, to remove files dead ranks left behind")
    parser.add_argument("--rank", type=int, default=-1, help="the rank this command runs as")
    parser.add_argument("--secret-on-stdin", action="store_true",
                        help="read RINGCOMM_SECRET from the first line of standard input (not the command line, "
                             "which every user of both hosts can see in the process list)")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        parser.error("no command given")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns its exit status (128 + N when killed by signal N)."""
    args = _parse(sys.argv[1:] if argv is None else argv)
    host = socket.gethostname()
    env = dict(os.environ)
    if args.secret_on_stdin:
        secret = read_secret(0, SECRET_TIMEOUT)
        if secret is None:
            print(f"{_PROG}: no job secret arrived on standard input within {SECRET_TIMEOUT:g} s on {host}",
                  file=sys.stderr, flush=True)
            return 2
        env["RINGCOMM_SECRET"] = secret
    try:
        child = subprocess.Popen(args.command, stdin=subprocess.DEVNULL, start_new_session=True, env=env)
    except OSError as exc:
        print(f"{_PROG}: cannot start {args.command[0]!r} on {host}: {exc}", file=sys.stderr, flush=True)
        return 127 if isinstance(exc, FileNotFoundError) else 126
    stop = threading.Event()
    ended = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, on_signal)

    def watch_input() -> None:
        try:
            while os.read(0, 65536):
                pass
        except OSError:
            pass
        stop.set()

    def reap() -> None:
        child.wait()
        ended.set()
        stop.set()

    threading.Thread(target=watch_input, name="rexec-stdin", daemon=True).start()
    threading.Thread(target=reap, name="rexec-reap", daemon=True).start()
    while not stop.wait(0.5):
        pass  # a timed wait, so that signal handlers run promptly on the main thread
    stopped = not ended.is_set()
    stop_group(child.pid, args.grace)  # the command on a stop; what it left behind when it exited
    ended.wait(5.0)
    if args.job:
        remove_job_files(args.job, args.rank)
    code = child.returncode
    if code is None:
        return 128 + signal.SIGKILL
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        if not stopped:
            who = f"rank {args.rank}" if args.rank >= 0 else "the command"  # elastic workers change rank
            print(f"{_PROG}: {who} (pid {child.pid}) on {host} was killed by {name}",
                  file=sys.stderr, flush=True)
        return 128 - code
    return code


if __name__ == "__main__":
    sys.exit(main())
