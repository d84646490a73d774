"""Process supervision shared by ``ringcomm-run`` and its elastic driver.

Worker processes spawned in their own process group, their output pumped, their
groups stopped (SIGTERM, then SIGKILL after :data:`GRACE_SECONDS`); the
launcher's own signals caught as a list the main loop reads
(:class:`SignalCatcher`); a job's leftover files removed (:func:`remove_job_files`).

A rank on another host is a local ssh process (in its own group, like a local
rank) whose standard input is a pipe from the launcher: closing that pipe is
how the launcher asks the remote side (:mod:`ringcomm.launch.rexec`) to stop the
rank, since ssh forwards no signals.  SIGKILL to the ssh's group is the last
resort; the remote side then sees its input end as well.

Each worker runs in its own session (``start_new_session=True``), so
``os.killpg(worker.pid, sig)`` reaches the worker *and* everything it spawned
(unless a grandchild starts a session of its own, which no launcher can
track without cgroups).  A waiter thread per worker reaps it and records the
moment it exited, so the launcher can tell which rank failed first.
"""

from __future__ import annotations

import collections
import glob
import os
import queue
import signal
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import FrameType
from typing import IO

from ..job import names
from .lost import LostRanks

#: Lines of each rank (stdout and stderr together) kept for the failure report.
TAIL_LINES = 20
#: Seconds workers get between SIGTERM and SIGKILL.
GRACE_SECONDS = 3.0
#: Seconds a remote rank gets between SIGTERM and SIGKILL on its host (within the launcher's grace).
REMOTE_GRACE_SECONDS = GRACE_SECONDS - 1.0
#: Longest line the pump reads at once; longer lines are split (keeps memory bounded).
_MAX_LINE_BYTES = 64 * 1024

_print_lock = threading.Lock()


def emit(stream: IO[str], text: str) -> None:
    """Write ``text`` plus a newline to ``stream`` and flush; one writer at a time, never raises."""
    with _print_lock:
        try:
            try:
                stream.write(text + "\n")
            except UnicodeEncodeError:  # e.g. an ASCII-only terminal: show what cannot be encoded as escapes
                encoding = getattr(stream, "encoding", None) or "ascii"
                stream.write(text.encode(encoding, "backslashreplace").decode(encoding) + "\n")
            stream.flush()
        except (OSError, ValueError):  # closed pipe (e.g. `ringcomm-run ... | head`): keep the job going
            pass


class Worker:
    """One rank's process: its pipes' pump threads, its last lines, and how it ended."""

    def __init__(
        self, rank: int, popen: subprocess.Popen[bytes], exits: "queue.Queue[Worker]", host: str = "",
        remote: bool = False, output_dir: str | None = None, timestamp: bool = False,
    ) -> None:
        self.rank = rank
        #: the host the rank runs on ("" when the job has no host list)
        self.host = host
        #: True when the process is the ssh that runs the rank on ``host``
        self.remote = remote
        self.popen = popen
        self.pid = popen.pid
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        #: True once the launcher sent this worker a signal (it is then never the root cause).
        self.stopped_by_launcher = False
        self.returncode: int | None = None
        self.exited_at: float | None = None
        self.exited = threading.Event()
        self._tail_lock = threading.Lock()
        #: prefix each relayed line with the time it arrived (horovodrun's --prefix-output-with-timestamp)
        self.timestamp = timestamp
        # --output-filename: each stream also goes to output_dir/stdout and output_dir/stderr
        self._copies: dict[str, IO[str]] = {}
        if output_dir is not None:
            for label in ("stdout", "stderr"):
                self._copies[label] = open(os.path.join(output_dir, label), "w", encoding="utf-8")
        self._pumps = [
            threading.Thread(target=self._pump, args=(popen.stdout, "stdout"), daemon=True),
            threading.Thread(target=self._pump, args=(popen.stderr, "stderr"), daemon=True),
        ]
        for pump in self._pumps:
            pump.name = f"ringcomm-run-rank{rank}-{pump.name}"
            pump.start()
        self._exits = exits
        threading.Thread(target=self._wait, name=f"ringcomm-run-wait{rank}", daemon=True).start()

    def _pump(self, pipe: IO[bytes] | None, label: str) -> None:
        """Copy ``pipe`` line by line to the launcher's stream ``label`` as ``[rank]<label>:line``.

        With ``timestamp`` the line starts with ``time.asctime()`` as horovodrun's do; with an
        output directory the same text also goes to its file ``label``.
        """
        copy = self._copies.get(label)
        if pipe is None:
            return
        try:
            while True:
                raw = pipe.readline(_MAX_LINE_BYTES)
                if not raw:
                    break
                line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                with self._tail_lock:
                    self.tail.append(line)
                text = f"{time.asctime() if self.timestamp else ''}[{self.rank}]<{label}>:{line}"
                # Looked up per line: the launcher's streams may be swapped (tests, redirection).
                emit(sys.stdout if label == "stdout" else sys.stderr, text)
                if copy is not None:
                    emit(copy, text)
        except (OSError, ValueError):
            pass
        finally:
            if copy is not None:
                try:
                    copy.close()
                except OSError:
                    pass
            try:
                pipe.close()
            except OSError:
                pass

    def _wait(self) -> None:
        self.returncode = self.popen.wait()
        self.exited_at = time.monotonic()
        self.exited.set()
        self._exits.put(self)

    def last_lines(self) -> list[str]:
        """A copy of the kept lines, oldest first."""
        with self._tail_lock:
            return list(self.tail)

    def describe(self) -> str:
        """``rank 2 (pid 4711)``, or ``rank 2 on hostB (ssh pid 4711)`` for a remote rank."""
        if self.remote:
            return f"rank {self.rank} on {self.host} (ssh pid {self.pid})"
        return f"rank {self.rank} (pid {self.pid})"

    def terminate(self) -> None:
        """Ask the rank to stop: SIGTERM to its group, or close a remote rank's input (ssh forwards no signals)."""
        if self.remote:
            self._close_input()
        else:
            self.signal_group(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the local process group (a remote rank's ssh; its remote side then sees its input end)."""
        self._close_input()
        self.signal_group(signal.SIGKILL)

    def send_input(self, text: str) -> None:
        """Write ``text`` to a remote rank's ssh input (the pipe stays open: its end stops the rank)."""
        stdin = self.popen.stdin
        if stdin is None:
            raise ValueError(f"rank {self.rank}: only a remote rank's ssh has an input to write to")
        try:
            stdin.write(text.encode())
            stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # the ssh is already gone: its exit is reported like any other

    def _close_input(self) -> None:
        if self.popen.stdin is not None:
            try:
                self.popen.stdin.close()
            except OSError:
                pass

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the worker's whole process group; no error if it is already gone."""
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def is_frozen(self) -> bool:
        """True while the local rank's process is stopped (SIGSTOP, a debugger): SIGTERM would wait for a
        SIGCONT, so only SIGKILL ends it.  False for a remote rank, and where /proc is not there."""
        if self.remote or self.exited.is_set():
            return False
        try:
            with open(f"/proc/{self.pid}/stat", "rb") as f:
                return f.read().rpartition(b")")[2].split()[0] in (b"T", b"t")
        except (OSError, IndexError):
            return False

    def group_alive(self) -> bool:
        """True while the worker or anything left in its process group still runs."""
        return not self.exited.is_set() or bool(live_groups([self.pid]))

    def join_output(self, deadline: float) -> None:
        """Wait (until ``deadline``, monotonic) for the pump threads to reach end of file."""
        for pump in self._pumps:
            pump.join(max(0.0, deadline - time.monotonic()))


def live_groups(pgids: Iterable[int]) -> set[int]:
    """The process groups in ``pgids`` that still hold a process that is not a zombie.

    ``killpg(pgid, 0)`` alone also counts zombies: a killed grandchild stays one
    until init reaps it, which some container inits do slowly or never.  So on
    Linux a group that ``killpg`` finds is confirmed by one scan of ``/proc``.
    """
    found = set()
    for pgid in pgids:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            continue
        except PermissionError:
            pass
        found.add(pgid)
    if not found or not os.path.isdir("/proc/self"):
        return found
    running = set()
    with os.scandir("/proc") as entries:
        for entry in entries:
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    fields = f.read().rpartition(b")")[2].split()
                state, pgrp = fields[0], int(fields[2])
            except (OSError, IndexError, ValueError):
                continue  # exited while we looked
            if pgrp in found and state != b"Z":
                running.add(pgrp)
    return running


def guard_command(parent: int, command: Sequence[str], job_id: str = "") -> list[str]:
    """The command line that runs ``command`` under :mod:`ringcomm.launch.guard` for launcher ``parent``.

    The guard runs as a file (``python -I .../ringcomm/launch/guard.py PPID -- COMMAND...``): ``-I``
    keeps the job's PYTHONPATH and the guard's own folder off its import path (it needs only the
    standard library), and ``ps`` shows a short line that names the command.  With ``job_id`` it
    also removes what the worker leaves in /dev/shm when it dies (``--reclaim``).
    """
    from . import guard

    reclaim = ["--reclaim", names.job_globs(job_id)[0]] if job_id else []
    return [sys.executable, "-I", os.path.abspath(guard.__file__), str(parent), *reclaim, "--", *command]


def _check_runnable(program: str, env: Mapping[str, str]) -> None:
    """Raise what ``Popen`` would (FileNotFoundError, PermissionError) if ``program`` cannot be run."""
    if os.sep in program:
        if not os.path.exists(program):
            raise FileNotFoundError(2, "No such file or directory", program)
        if os.path.isdir(program) or not os.access(program, os.X_OK):
            raise PermissionError(13, "Permission denied", program)
    elif shutil.which(program, path=env.get("PATH", os.defpath)) is None:
        raise FileNotFoundError(2, "No such file or directory", program)


def spawn(
    rank: int, command: Sequence[str], env: Mapping[str, str], exits: "queue.Queue[Worker]", host: str = "",
    remote: bool = False, output_dir: str | None = None, timestamp: bool = False,
) -> Worker:
    """Start ``command`` as rank ``rank`` in a new session with piped output.

    It runs through :mod:`ringcomm.launch.guard`, so it gets SIGTERM if the launcher dies, and the
    shared-memory files of job ``env["RINGCOMM_JOB_ID"]`` it leaves are removed when it dies.

    ``remote``: ``command`` is an ssh to ``host``; its input stays open (a pipe) until the rank is stopped.
    ``output_dir``: an existing directory that gets copies of the output (``stdout``, ``stderr``);
    ``timestamp``: relayed lines start with the time (see :class:`Worker`).
    """
    _check_runnable(command[0], env)
    popen = subprocess.Popen(
        guard_command(os.getpid(), command, env.get("RINGCOMM_JOB_ID", "")),
        env=dict(env),
        stdin=subprocess.PIPE if remote else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    return Worker(rank, popen, exits, host, remote, output_dir, timestamp)


def stop_all(workers: Iterable[Worker], grace: float, hurry: Callable[[], bool] = lambda: False) -> list[Worker]:
    """SIGTERM every live process group, SIGKILL what is left after ``grace`` s; returns groups that needed it.

    Workers still running when this is called are marked ``stopped_by_launcher``; a stopped
    process (SIGSTOP) gets SIGKILL at once, as SIGTERM would not reach it.
    ``hurry()`` turning true (e.g. a second Ctrl-C) skips the rest of the grace.
    """
    workers = list(workers)
    signalled = []
    for worker in workers:
        if worker.group_alive():
            if not worker.exited.is_set():
                worker.stopped_by_launcher = True
            signalled.append(worker)
            worker.kill() if worker.is_frozen() else worker.terminate()
    deadline = time.monotonic() + grace
    while _any_alive(signalled) and time.monotonic() < deadline and not hurry():
        time.sleep(0.02)
    for worker in signalled:
        if worker.group_alive():
            worker.kill()
    # SIGKILL cannot be ignored; this only waits for the kernel (and for the waiter threads to reap).
    deadline = time.monotonic() + 5.0
    while _any_alive(signalled) and time.monotonic() < deadline:
        time.sleep(0.01)
    return signalled


def stop_lost(lost: LostRanks, by_rank: Mapping[int, Worker], reports: Mapping[int, int]) -> list[tuple[int, bool]]:
    """Stop the ranks the job lost, as ``lost`` decides from the ranks' ``reports`` (reporting rank ->
    lost rank): :func:`stop_all` in a thread (a stopped process SIGKILL at once, another SIGTERM,
    then SIGKILL after the grace).  ``by_rank``: the workers of this job's ranks.  Returns
    ``(rank, frozen)`` for each rank stopped now, for the caller to say so."""
    now = time.monotonic()
    lost.update(reports, now)
    reported = [r for r in lost.reported() if r in by_rank]
    if not reported:
        return []
    running = {r for r, w in by_rank.items() if not w.exited.is_set()}
    frozen = {r for r in reported if by_rank[r].is_frozen()}
    stopped = lost.to_stop(running, frozen, now)
    for rank in stopped:
        by_rank[rank].stopped_by_launcher = True
        threading.Thread(target=stop_all, args=([by_rank[rank]], GRACE_SECONDS), daemon=True,
                         name=f"ringcomm-run-stop{rank}").start()
    return [(rank, rank in frozen) for rank in stopped]


def _any_alive(workers: list[Worker]) -> bool:
    if any(not w.exited.is_set() for w in workers):
        return True
    return bool(live_groups(w.pid for w in workers))


def describe_exit(returncode: int) -> str:
    """``exited with code 3`` / ``was killed by signal SIGKILL``."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"was killed by signal {name}"


def exit_status(returncode: int) -> int:
    """Shell-style status of a child's return code: the code itself, or 128 + signal number."""
    return returncode if returncode >= 0 else 128 - returncode


class SignalCatcher:
    """Turns SIGINT/SIGTERM/SIGHUP into a list the main loop reads (handlers only set state)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread; the caller still cleans up
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)  # type: ignore[arg-type]
        self._previous.clear()


def remove_job_files(job_id: str) -> None:
    """Shared-memory rings and ipc sockets of a job whose workers died before cleaning up."""
    for pattern in names.job_globs(job_id):
        for path in glob.glob(pattern):
            try:
                os.unlink(path)
            except OSError:
                pass
