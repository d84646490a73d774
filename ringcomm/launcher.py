"""``ringcomm-run``: start N workers on this machine or across hosts, relay their output, stop them all on failure.

Example::

    $ ringcomm-run -np 2 python -c "import os; print(os.environ['RINGCOMM_RANK'])"
    [0]<stdout>:0
    [1]<stdout>:1
    $ ringcomm-run -np 4 -H hostA:2,hostB:2 python train.py     # ranks 2, 3 over ssh on hostB

The launcher runs the job's :class:`~ringcomm.rendezvous.RendezvousServer`
(on 127.0.0.1 when every host is this one, else on the address that routes
to the other hosts, or ``--network-interface``'s) and gives every worker its
topology, the rendezvous address and the job's secret through ``RINGCOMM_*``
environment variables.  Ranks on other hosts are started with ``--ssh-command
HOST 'cd DIR && exec env VARS... python -m ringcomm.rexec ... COMMAND'``
(:mod:`ringcomm.remote`).  When a worker exits non-zero (or is killed), the
others are stopped (SIGTERM, or closing a remote rank's ssh input; SIGKILL
after a grace period), and a root-cause block names the first failing rank,
its exit code and its last lines; the launcher exits with that rank's status.
"""

from __future__ import annotations

import argparse
import collections
import os
import queue
import re
import secrets
import shlex
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from types import FrameType

from . import hosts as _hosts
from . import netaddr, remote
from ._proc import Worker, describe_exit, emit, exit_status, spawn, stop_all
from .errors import InvalidInputError
from .rendezvous import RendezvousServer

__all__ = ["main", "build_parser", "parse_args", "worker_env", "run_job", "plan_hosts", "rendezvous_host"]

#: Seconds workers get between SIGTERM and SIGKILL.
GRACE_SECONDS = 3.0
#: After the first failure, how long the launcher waits for other ranks to exit on their own.
SETTLE_SECONDS = 1.0
#: Seconds a remote rank gets between SIGTERM and SIGKILL on its host (within the launcher's grace).
REMOTE_GRACE_SECONDS = GRACE_SECONDS - 1.0
#: Seconds the launcher waits for the last output once every process is gone.
_DRAIN_SECONDS = 2.0
_PROG = "ringcomm-run"


# --------------------------------------------------------------------------- arguments


def build_parser() -> argparse.ArgumentParser:
    """The ``ringcomm-run`` argument parser."""
    parser = argparse.ArgumentParser(
        prog=_PROG,
        allow_abbrev=False,
        description="Run COMMAND as N ringcomm workers on this machine or across hosts "
                    "(Horovod's horovodrun, for ringcomm).",
        epilog="examples: ringcomm-run -np 4 python train.py --epochs 3; "
               "ringcomm-run -np 8 -H node1:4,node2:4 python train.py",
    )
    from . import __version__

    parser.add_argument("--version", action="version", version=f"ringcomm-run (ringcomm) {__version__}")
    parser.add_argument("-np", "--num-proc", dest="num_proc", type=int, required=True, metavar="N",
                        help="number of worker processes to start (>= 1)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("-H", "--hosts", default=None, metavar="HOST:N,...",
                       help="hosts and their slots, filled in order, e.g. -H node1:4,node2:4 "
                            "(default: every rank on this machine)")
    where.add_argument("--hostfile", default=None, metavar="FILE",
                       help="hosts from FILE: one 'host slots=N' per line, '#' comments")
    parser.add_argument("--ssh-command", default="ssh", metavar="CMD",
                        help="program that runs a command on another host, called as CMD HOST 'COMMAND LINE' "
                             "(default: ssh); may hold options, e.g. 'ssh -o BatchMode=yes'")
    parser.add_argument("--ssh-port", type=int, default=None, metavar="PORT", help="passed to ssh as -p PORT")
    parser.add_argument("--ssh-identity-file", default=None, metavar="FILE", help="passed to ssh as -i FILE")
    parser.add_argument("--network-interface", default=None, metavar="NAME",
                        help="interface whose address ranks use to reach each other across hosts, on every "
                             "host (e.g. eth0; default: the one that routes to the other hosts); sets "
                             "RINGCOMM_NETWORK_INTERFACE")
    parser.add_argument("--start-timeout", type=float, default=None, metavar="SECONDS",
                        help="seconds every rank has to reach the rendezvous (default: $RINGCOMM_START_TIMEOUT "
                             "or 60); sets RINGCOMM_START_TIMEOUT")
    parser.add_argument("--timeline-filename", default=None, metavar="PATH",
                        help="write a Chrome-trace timeline of the collectives to PATH (sets RINGCOMM_TIMELINE)")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="print the job id, the rendezvous address and each worker's pid to stderr")
    _add_elastic_arguments(parser)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the program to run, with its arguments")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and validate ``argv``; exits with status 2 and a message that says what to pass."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if args.num_proc < 1:
        parser.error(f"-np must be at least 1 (the number of worker processes, e.g. -np 4), got {args.num_proc}")
    if args.start_timeout is not None and not args.start_timeout > 0:
        parser.error(f"--start-timeout must be > 0 seconds, got {args.start_timeout}")
    if args.ssh_port is not None and not 0 < args.ssh_port < 65536:
        parser.error(f"--ssh-port must be 1..65535, got {args.ssh_port}")
    try:
        args.placements = plan_hosts(args.hosts, args.hostfile, args.num_proc)
    except InvalidInputError as exc:
        parser.error(str(exc))
    except OSError as exc:
        parser.error(f"cannot read --hostfile {args.hostfile}: {exc.strerror or exc}")
    _check_elastic_arguments(parser, args)
    if not args.command:
        parser.error("no command given: put the program after the options, e.g. ringcomm-run -np 2 python train.py")
    return args


def _add_elastic_arguments(parser: argparse.ArgumentParser) -> None:
    """Elastic mode (``--host-discovery-script``): see :mod:`ringcomm.elastic.driver`."""
    group = parser.add_argument_group("elastic training (with --host-discovery-script)")
    group.add_argument("--host-discovery-script", default=None, metavar="SCRIPT",
                       help="run elastically: SCRIPT prints the available hosts as host:slots lines; polled "
                            "every second; workers come and go as it changes")
    group.add_argument("--min-np", type=int, default=None, metavar="N",
                       help="fewest workers to run with (default: -np)")
    group.add_argument("--max-np", type=int, default=None, metavar="N",
                       help="most workers to run with (default: every discovered slot)")
    group.add_argument("--slots-per-host", type=int, default=1, metavar="N",
                       help="slots of a discovered host printed without :slots (default: 1)")
    group.add_argument("--elastic-timeout", type=float, default=600.0, metavar="SECONDS",
                       help="how long to wait for --min-np workers before failing (default: 600)")
    group.add_argument("--reset-limit", type=int, default=None, metavar="N",
                       help="fail after the job re-formed N times (default: 100; 0: fail at the first loss)")
    group.add_argument("--blacklist-failures", type=int, default=3, metavar="N",
                       help="blacklist a host once N of its workers failed (default: 3)")
    group.add_argument("--blacklist-cooldown", type=float, default=60.0, metavar="SECONDS",
                       help="a blacklisted host gets no new workers for this long, doubled each time (default: 60)")


def _check_elastic_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.host_discovery_script is None:
        given = [flag for flag, value in (("--min-np", args.min_np), ("--max-np", args.max_np),
                                          ("--reset-limit", args.reset_limit)) if value is not None]
        if given:
            parser.error(f"{', '.join(given)} need --host-discovery-script (elastic mode)")
        return
    if args.hosts is not None or args.hostfile is not None:
        parser.error("-H/--hostfile and --host-discovery-script exclude each other: in elastic mode the script "
                     "names the hosts")
    min_np = args.min_np if args.min_np is not None else args.num_proc
    if min_np < 1:
        parser.error(f"--min-np must be at least 1, got {min_np}")
    if min_np > args.num_proc:
        parser.error(f"--min-np {min_np} is larger than -np {args.num_proc}")
    if args.max_np is not None and args.max_np < args.num_proc:
        parser.error(f"--max-np {args.max_np} is smaller than -np {args.num_proc}")
    if args.slots_per_host < 1:
        parser.error(f"--slots-per-host must be at least 1, got {args.slots_per_host}")
    if not args.elastic_timeout > 0:
        parser.error(f"--elastic-timeout must be > 0 seconds, got {args.elastic_timeout}")
    if args.reset_limit is not None and args.reset_limit < 0:
        parser.error(f"--reset-limit must be >= 0, got {args.reset_limit}")
    if args.blacklist_failures < 1 or args.blacklist_cooldown < 0:
        parser.error("--blacklist-failures must be >= 1 and --blacklist-cooldown >= 0")


def plan_hosts(hosts: str | None, hostfile: str | None, num_proc: int) -> list[_hosts.Placement] | None:
    """Where each rank runs, from ``-H`` or ``--hostfile``; ``None`` without either (all on this machine)."""
    if hosts is not None:
        return _hosts.assign(_hosts.parse_hosts(hosts), num_proc)
    if hostfile is not None:
        with open(hostfile, encoding="utf-8") as f:
            return _hosts.assign(_hosts.parse_hostfile(f.read(), hostfile), num_proc)
    return None


def rendezvous_host(remote_hosts: Sequence[str], interface: str | None) -> str:
    """The address the launcher serves the rendezvous on: reachable from ``remote_hosts``.

    127.0.0.1 when every rank is on this machine; else ``interface``'s address,
    or the local address that routes to the first remote host.
    """
    if not remote_hosts:
        return "127.0.0.1"
    if interface:
        return netaddr.interface_address(interface)
    return netaddr.route_source(remote_hosts[0])


# --------------------------------------------------------------------------- job


def worker_env(
    base: Mapping[str, str],
    rank: int,
    size: int,
    address: str,
    secret: bytes,
    job_id: str,
    start_timeout: float | None = None,
    timeline: str | None = None,
    placement: _hosts.Placement | None = None,
    interface: str | None = None,
) -> dict[str, str]:
    """``base`` plus the ``RINGCOMM_*`` variables rank ``rank`` needs.

    Without ``placement`` every rank is on this host; with it, the rank's host
    name becomes ``RINGCOMM_HOSTNAME`` (ranks with equal names talk over ipc and
    shared memory, others over tcp).
    """
    place = placement or _hosts.Placement(rank, "", rank, size, 0, 1)
    env = dict(base)
    env.update(
        RINGCOMM_RANK=str(rank),
        RINGCOMM_SIZE=str(size),
        RINGCOMM_LOCAL_RANK=str(place.local_rank),
        RINGCOMM_LOCAL_SIZE=str(place.local_size),
        RINGCOMM_CROSS_RANK=str(place.cross_rank),
        RINGCOMM_CROSS_SIZE=str(place.cross_size),
        RINGCOMM_RENDEZVOUS_ADDR=address,
        RINGCOMM_SECRET=secret.hex(),
        RINGCOMM_JOB_ID=job_id,
        PYTHONUNBUFFERED="1",
        # what horovodrun tells its workers, for scripts (and tests) written against it
        HOROVOD_RANK=str(rank),
        HOROVOD_SIZE=str(size),
        HOROVOD_LOCAL_RANK=str(place.local_rank),
        HOROVOD_LOCAL_SIZE=str(place.local_size),
        HOROVOD_CROSS_RANK=str(place.cross_rank),
        HOROVOD_CROSS_SIZE=str(place.cross_size),
    )
    if place.host:
        env["RINGCOMM_HOSTNAME"] = env["HOROVOD_HOSTNAME"] = place.host
    if place.local_size > 1 and "OMP_NUM_THREADS" not in base:
        # as torchrun does: N ranks x all-core thread pools oversubscribe the machine
        env["OMP_NUM_THREADS"] = "1"
    if start_timeout is not None:
        env["RINGCOMM_START_TIMEOUT"] = repr(float(start_timeout))
    if timeline is not None:
        env["RINGCOMM_TIMELINE"] = timeline
    if interface is not None:
        env["RINGCOMM_NETWORK_INTERFACE"] = interface
    return env


class _SignalCatcher:
    """Turns SIGINT/SIGTERM/SIGHUP into a list the main loop reads (handlers only set state)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread; run_job still cleans up
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)  # type: ignore[arg-type]
        self._previous.clear()


def _say(text: str) -> None:
    emit(sys.stderr, f"{_PROG}: {text}")


def _remove_job_files(job_id: str) -> None:
    """Shared-memory rings and ipc sockets of a job whose workers died before cleaning up."""
    import glob
    import tempfile

    for pattern in (f"/dev/shm/ringcomm-{job_id}-*", os.path.join(tempfile.gettempdir(), f"ringcomm-{job_id}-*")):
        for path in glob.glob(pattern):
            try:
                os.unlink(path)
            except OSError:
                pass


def run_job(args: argparse.Namespace) -> int:
    """Run the job described by parsed ``args``; returns the launcher's exit status."""
    if getattr(args, "host_discovery_script", None) is not None:
        from .elastic import driver

        return driver.run(args)
    size = args.num_proc
    job_id = secrets.token_hex(4)
    secret = secrets.token_bytes(32)
    placements: list[_hosts.Placement] | None = getattr(args, "placements", None)
    interface: str | None = getattr(args, "network_interface", None)
    try:
        is_local = {p.host: netaddr.is_local_host(p.host) for p in placements or []}
        bind = rendezvous_host([h for h, local in is_local.items() if not local], interface)
    except InvalidInputError as exc:
        _say(str(exc))
        return 2
    exits: queue.Queue[Worker] = queue.Queue()
    workers: list[Worker] = []
    catcher = _SignalCatcher()
    catcher.install()
    spawn_status = 0
    first_failure: Worker | None = None
    leftovers: list[Worker] = []
    try:
        server = RendezvousServer(size=size, secret=secret, host=bind)
        try:
            if args.verbose:
                _say(f"job {job_id}: {size} workers, rendezvous at {server.address}, command: "
                     f"{shlex.join(args.command)}")
            for rank in range(size):
                if catcher.received:
                    break
                place = placements[rank] if placements else None
                env = worker_env(os.environ, rank, size, server.address, secret, job_id,
                                 args.start_timeout, args.timeline_filename, place, interface)
                host = place.host if place else ""
                try:
                    workers.append(_start_rank(args, rank, host, host != "" and not is_local[host], env, job_id,
                                               exits))
                except InvalidInputError as exc:
                    _say(str(exc))
                    spawn_status = 2
                    break
                except OSError as exc:
                    program = args.ssh_command if host and not is_local[host] else shlex.join(args.command[:1])
                    _say(f"cannot start {program} for rank {rank}{' on ' + host if host else ''}: {exc}")
                    spawn_status = 127 if isinstance(exc, FileNotFoundError) else 126
                    break
                if args.verbose:
                    where = f" on {host}" + (" (ssh)" if workers[-1].remote else "") if host else ""
                    _say(f"rank {rank}: pid {workers[-1].pid}{where}")
            first_failure = _wait_for_end(workers, exits, catcher, stop_early=spawn_status != 0)
            leftovers = [w for w in workers if w.exited.is_set() and w.group_alive()]
        finally:
            stop_all(workers, GRACE_SECONDS, hurry=lambda: len(catcher.received) > 1)
            server.close()
    finally:
        catcher.restore()
        # If anything above raised, stop_all may not have run yet; it is idempotent.
        stop_all(workers, 0.0)
        _remove_job_files(job_id)
    deadline = time.monotonic() + _DRAIN_SECONDS
    for worker in workers:
        worker.join_output(deadline)

    if args.verbose:
        for worker in leftovers:
            _say(f"rank {worker.rank} (pid {worker.pid}) exited but left processes in its group; stopped them")
    if first_failure is not None:
        first_failure = _root_cause(first_failure, workers)
        _report_failure(first_failure, workers)
        return exit_status(first_failure.returncode or 0) or 1
    if catcher.received:
        signum = catcher.received[0]
        _say(f"received {signal.Signals(signum).name}; stopped all {len(workers)} workers")
        return 128 + signum
    if spawn_status:
        return spawn_status
    if args.verbose:
        _say(f"job {job_id}: all {size} ranks exited with code 0")
    return 0


def _start_rank(
    args: argparse.Namespace, rank: int, host: str, over_ssh: bool, env: Mapping[str, str], job_id: str,
    exits: "queue.Queue[Worker]",
) -> Worker:
    """Start ``rank`` here with ``env``, or on ``host`` through ``--ssh-command`` with ``env`` on its command line."""
    if not over_ssh:
        return spawn(rank, args.command, env, exits, host)
    forwarded = remote.forwarded_env(env)
    secret = forwarded.pop("RINGCOMM_SECRET")  # never on a command line: it goes through the ssh's input
    line = remote.remote_command(os.getcwd(), forwarded, args.command, sys.executable, job_id, rank,
                                 REMOTE_GRACE_SECONDS, secret_on_stdin=True)
    argv = remote.ssh_argv(args.ssh_command, args.ssh_port, args.ssh_identity_file, host, line)
    worker = spawn(rank, argv, os.environ, exits, host, remote=True)
    worker.send_input(secret + "\n")
    return worker


def _wait_for_end(
    workers: list[Worker], exits: "queue.Queue[Worker]", catcher: _SignalCatcher, stop_early: bool
) -> Worker | None:
    """Block until every worker exited 0 (-> None), one failed (-> the first), or a signal came."""
    finished = 0
    while finished < len(workers) and not stop_early and not catcher.received:
        try:
            worker = exits.get(timeout=0.1)
        except queue.Empty:
            continue
        finished += 1
        if worker.returncode != 0:
            # When one rank dies its peers fail moments later (PeerLostError), and the rank that
            # really failed may still be exiting: let them settle briefly, so every rank that
            # exits on its own is seen with its own exit code before the rest are stopped.
            deadline = time.monotonic() + SETTLE_SECONDS
            while time.monotonic() < deadline and not all(w.exited.is_set() for w in workers):
                time.sleep(0.05)
            failed = [w for w in workers if w.exited.is_set() and w.returncode != 0]
            return min(failed, key=lambda w: w.exited_at or 0.0)
    return None


def _root_cause(first: Worker, workers: list[Worker]) -> Worker:
    """The rank that failed on its own, not one that only reported losing a peer.

    When a rank dies, its peers raise PeerLostError within moments and may exit
    at nearly the same time; the earliest such exit is not the cause.
    """
    # a rank signalled by the launcher may still have exited with its own error code first
    failed = sorted(
        (w for w in workers if w.returncode is not None and w.returncode != 0
         # a remote rank's ssh exits with a positive code when the launcher stopped it: not a cause
         and (not w.stopped_by_launcher or (w.returncode > 0 and not w.remote))),
        key=lambda w: w.exited_at or 0.0,
    )
    for worker in failed:
        if blamed_rank(worker) is None and not any("PeerLostError" in line for line in worker.last_lines()):
            return worker
    # Every failed rank only failed because of another one: the cause is the rank they name (one
    # stopped, or one that ended its program early with code 0: not a failure in the launcher's eyes).
    by_rank = {w.rank: w for w in workers}
    named = collections.Counter(r for w in failed if (r := blamed_rank(w)) is not None and r in by_rank)
    if named:
        return by_rank[named.most_common(1)[0][0]]
    return first


#: The errors by which a rank names another as the cause: it lost it, or it shut down or refused the
#: call the others waited in
_BLAMES = re.compile(r"PeerLostError: rank \d+: lost rank (\d+)|MismatchError: rank (\d+) (?:shut down|refused the call)")


def blamed_rank(worker: Worker) -> int | None:
    """The rank a worker's last lines name as the cause of its failure, if any."""
    for line in reversed(worker.last_lines()):
        if m := _BLAMES.search(line):
            return int(m[1] or m[2])
    return None


def _report_failure(root: Worker, workers: list[Worker]) -> None:
    """Print the torchrun-style root-cause block to stderr."""
    reporters = [str(w.rank) for w in workers if w is not root and blamed_rank(w) == root.rank]
    because = f"rank{'s' if len(reporters) > 1 else ''} {', '.join(reporters)} failed because of it"
    if reporters and root.stopped_by_launcher:
        cause = f"stopped answering ({because}); {_PROG} then stopped it ({describe_exit(root.returncode or 0)})"
    elif reporters:
        cause = f"{describe_exit(root.returncode or 0)}; {because}"
    else:
        cause = describe_exit(root.returncode or 0)
    lines = [
        f"{_PROG}: job failed",
        f"  root cause: {root.describe()} {cause}",
        f"  last lines of rank {root.rank}:",
    ]
    tail = root.last_lines()
    lines += [f"    {line}" for line in tail] if tail else ["    (no output)"]
    for worker in workers:
        if worker is not root and not worker.stopped_by_launcher and worker.returncode not in (0, None):
            lines.append(f"  also failed: {worker.describe()} {describe_exit(worker.returncode)}")
    stopped = [str(w.rank) for w in workers if w.stopped_by_launcher]
    if stopped:
        lines.append(f"  stopped by {_PROG}: rank{'s' if len(stopped) > 1 else ''} {', '.join(stopped)}")
    emit(sys.stderr, "\n".join(lines))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``ringcomm-run``; returns the exit status (the console script passes it to ``sys.exit``)."""
    try:
        args = parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    return run_job(args)


if __name__ == "__main__":
    sys.exit(main())
