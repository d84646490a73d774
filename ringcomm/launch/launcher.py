"""``ringcomm-run``: start N workers on this machine or across hosts, relay their output, stop them all on failure.

Example::

    $ ringcomm-run -np 2 python -c "import os; print(os.environ['RINGCOMM_RANK'])"
    [0]<stdout>:0
    [1]<stdout>:1
    $ ringcomm-run -np 4 -H hostA:2,hostB:2 python train.py     # ranks 2, 3 over ssh on hostB

The launcher runs the job's :class:`~ringcomm.net.rendezvous.RendezvousServer`
(on 127.0.0.1 when every host is this one, else on the address that routes
to the other hosts, or ``--network-interface``'s) and gives every worker its
topology, the rendezvous address and the job's secret through ``RINGCOMM_*``
environment variables.  Ranks on other hosts are started with ``--ssh-command
HOST 'cd DIR && exec env VARS... python -m ringcomm.launch.rexec ... COMMAND'``
(:mod:`ringcomm.launch.remote`).  When a worker exits non-zero (or is killed), the
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
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from ..job import hosts as _hosts
from ..job import netaddr
from . import remote
from .supervise import (
    GRACE_SECONDS, REMOTE_GRACE_SECONDS, SignalCatcher, Worker, describe_exit, emit, exit_status, remove_job_files, spawn,
    stop_all, stop_lost,
)
from ..errors import InvalidInputError, RendezvousError
from ..job import config
from .args import build_parser, is_elastic, parse_args, plan_hosts
from .lost import LostRanks
from ..net.rendezvous import RendezvousServer

__all__ = ["main", "horovodrun_main", "build_parser", "parse_args", "worker_env", "run_job", "plan_hosts", "rendezvous_host",
           "output_paths"]

#: After the first failure, how long the launcher waits for other ranks to exit on their own.
SETTLE_SECONDS = 1.0
#: Seconds the launcher waits for the last output once every process is gone.
_DRAIN_SECONDS = 2.0
_PROG = "ringcomm-run"


# --------------------------------------------------------------------------- arguments (launch_args.py)


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


def _say(text: str, prog: str = _PROG) -> None:
    """``text`` on stderr after the command's name (``ringcomm-run``, or ``horovodrun`` as typed)."""
    emit(sys.stderr, f"{prog}: {text}")


class JobHooks(Protocol):
    """Calls into the caller of :func:`run_job` (``ringcomm.run`` uses them to pass data through the store)."""

    def started(self, address: str, secret: bytes) -> None:
        """The rendezvous server (and its key-value store) is up; no worker is started yet."""

    def finished(self, address: str, secret: bytes) -> None:
        """Every worker is gone; the server is still up."""


def run_job(args: argparse.Namespace, hooks: JobHooks | None = None) -> int:
    """Run the job described by parsed ``args``; returns the launcher's exit status.

    ``hooks`` (static jobs only) are told the rendezvous address and the job's secret when the
    server is up and again when every worker is gone.
    """
    prog = getattr(args, "prog", _PROG)

    def say(text: str) -> None:
        _say(text, prog)

    for notice in getattr(args, "notices", []):
        say(f"warning: {notice}")
    base_env = {**os.environ, **getattr(args, "settings_env", {})}
    if is_elastic(args):
        from . import elastic_driver as driver

        return driver.ElasticDriver(args, base_env).run()
    size = args.num_proc
    job_id = secrets.token_hex(4)
    secret = secrets.token_bytes(32)
    placements: list[_hosts.Placement] | None = getattr(args, "placements", None)
    interface: str | None = getattr(args, "network_interface", None)
    try:
        is_local = {p.host: netaddr.is_local_host(p.host) for p in placements or []}
        bind = rendezvous_host([h for h, local in is_local.items() if not local], interface)
        ports = config.port_range(base_env)
    except InvalidInputError as exc:
        say(str(exc))
        return 2
    try:
        output_dirs = _output_dirs(getattr(args, "output_filename", None), size)
    except OSError as exc:
        say(f"cannot create the --output-filename directories under {args.output_filename}: {exc}")
        return 2
    exits: queue.Queue[Worker] = queue.Queue()
    workers: list[Worker] = []
    catcher = SignalCatcher()
    catcher.install()
    spawn_status = 0
    first_failure: Worker | None = None
    leftovers: list[Worker] = []
    lost = LostRanks()
    try:
        try:
            server = RendezvousServer(size=size, secret=secret, host=bind, ports=ports)
        except RendezvousError as exc:
            say(f"cannot start the job: {exc}")
            return 2
        try:
            if hooks is not None:
                hooks.started(server.address, secret)
            if args.verbose:
                say(f"job {job_id}: {size} workers, rendezvous at {server.address}, command: "
                     f"{shlex.join(args.command)}")
            for rank in range(size):
                if catcher.received:
                    break
                place = placements[rank] if placements else None
                env = worker_env(base_env, rank, size, server.address, secret, job_id,
                                 args.start_timeout, args.timeline_filename, place, interface)
                host = place.host if place else ""
                try:
                    workers.append(_start_rank(args, rank, host, host != "" and not is_local[host], env, job_id,
                                               exits, output_dirs[rank] if output_dirs else None))
                except InvalidInputError as exc:
                    say(str(exc))
                    spawn_status = 2
                    break
                except OSError as exc:
                    program = args.ssh_command if host and not is_local[host] else shlex.join(args.command[:1])
                    say(f"cannot start {program} for rank {rank}{' on ' + host if host else ''}: {exc}")
                    spawn_status = 127 if isinstance(exc, FileNotFoundError) else 126
                    break
                if args.verbose:
                    where = f" on {host}" + (" (ssh)" if workers[-1].remote else "") if host else ""
                    say(f"rank {rank}: pid {workers[-1].pid}{where}")
            first_failure = _wait_for_end(workers, exits, catcher, stop_early=spawn_status != 0,
                                          lost=lost, reports=server.lost_reports, say=say)
            lost.update(server.lost_reports(), time.monotonic())  # a rank tells before it exits: all are in
            leftovers = [w for w in workers if w.exited.is_set() and w.group_alive()]
        finally:
            stop_all(workers, GRACE_SECONDS, hurry=lambda: len(catcher.received) > 1)
            try:
                if hooks is not None:
                    hooks.finished(server.address, secret)
            finally:
                server.close()
    finally:
        catcher.restore()
        # If anything above raised, stop_all may not have run yet; it is idempotent.
        stop_all(workers, 0.0)
        remove_job_files(job_id)
    deadline = time.monotonic() + _DRAIN_SECONDS
    for worker in workers:
        worker.join_output(deadline)

    if args.verbose:
        for worker in leftovers:
            say(f"rank {worker.rank} (pid {worker.pid}) exited but left processes in its group; stopped them")
    if first_failure is not None:
        first_failure = _root_cause(first_failure, workers, lost.reports)
        _report_failure(first_failure, workers, lost.reports, prog)
        return exit_status(first_failure.returncode or 0) or 1
    if catcher.received:
        signum = catcher.received[0]
        say(f"received {signal.Signals(signum).name}; stopped all {len(workers)} workers")
        return 128 + signum
    if spawn_status:
        return spawn_status
    if args.verbose:
        say(f"job {job_id}: all {size} ranks exited with code 0")
    return 0


def _start_rank(
    args: argparse.Namespace, rank: int, host: str, over_ssh: bool, env: Mapping[str, str], job_id: str,
    exits: "queue.Queue[Worker]", output_dir: str | None = None,
) -> Worker:
    """Start ``rank`` here with ``env``, or on ``host`` through ``--ssh-command`` with ``env`` on its command line."""
    timestamp = bool(getattr(args, "prefix_output_with_timestamp", False))
    if not over_ssh:
        return spawn(rank, args.command, env, exits, host, output_dir=output_dir, timestamp=timestamp)
    forwarded = remote.forwarded_env(env)
    secret = forwarded.pop("RINGCOMM_SECRET")  # never on a command line: it goes through the ssh's input
    line = remote.remote_command(os.getcwd(), forwarded, args.command, sys.executable, job_id, rank,
                                 REMOTE_GRACE_SECONDS, secret_on_stdin=True)
    argv = remote.ssh_argv(args.ssh_command, args.ssh_port, args.ssh_identity_file, host, line)
    worker = spawn(rank, argv, os.environ, exits, host, remote=True, output_dir=output_dir, timestamp=timestamp)
    worker.send_input(secret + "\n")
    return worker


def output_paths(directory: str, size: int) -> list[str]:
    """horovodrun's ``--output-filename`` layout: ``DIR/rank.<N>`` per rank, N zero-padded to the last rank's width.

        output_paths("logs", 12) -> ["logs/rank.00", "logs/rank.01", ..., "logs/rank.11"]
    """
    width = len(str(max(size - 1, 0)))
    return [os.path.join(directory, f"rank.{rank:0{width}d}") for rank in range(size)]


def _output_dirs(directory: str | None, size: int) -> list[str] | None:
    """Create the ``--output-filename`` directories (each rank writes ``stdout`` and ``stderr`` there)."""
    if directory is None:
        return None
    paths = output_paths(directory, size)
    for path in paths:
        os.makedirs(path, exist_ok=True)
    return paths


def _wait_for_end(
    workers: list[Worker], exits: "queue.Queue[Worker]", catcher: SignalCatcher, stop_early: bool,
    lost: LostRanks | None = None, reports: Callable[[], dict[int, int]] | None = None,
    say: Callable[[str], None] = _say,
) -> Worker | None:
    """Block until every worker exited 0 (-> None), one failed (-> the first), or a signal came.

    Meanwhile, a rank the others reported lost (``reports()``: reporting rank -> lost rank) is
    stopped as :class:`~.lost.LostRanks` decides; its end is then the job's failure.
    """
    finished = 0
    while finished < len(workers) and not stop_early and not catcher.received:
        if lost is not None and reports is not None:
            _stop_lost(workers, lost, reports(), say)
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
            if lost is not None and reports is not None:
                # the ranks that failed may have reported a lost rank just before they exited: it is
                # stopped as a lost rank (and said so), not only as one of the rest
                _stop_lost(workers, lost, reports(), say)
            failed = [w for w in workers if w.exited.is_set() and w.returncode != 0]
            return min(failed, key=lambda w: w.exited_at or 0.0)
    return None


def _stop_lost(workers: list[Worker], lost: LostRanks, reports: dict[int, int],
               say: Callable[[str], None] = _say) -> None:
    """Stop the ranks the job lost (:func:`~.supervise.stop_lost`), saying who lost which."""
    by_rank = {w.rank: w for w in workers}
    for rank, frozen in stop_lost(lost, by_rank, reports):
        reporters = lost.reporters_of(rank)
        say(f"rank{'s' if len(reporters) > 1 else ''} {', '.join(map(str, reporters))} lost "
             f"{by_rank[rank].describe()}{' (its process is stopped)' if frozen else ''}; stopping it")


def _root_cause(first: Worker, workers: list[Worker], reports: Mapping[int, int] | None = None) -> Worker:
    """The rank that failed on its own, not one that only reported losing a peer.

    When a rank dies, its peers raise PeerLostError within moments and may exit
    at nearly the same time; the earliest such exit is not the cause.
    """
    reports = reports or {}
    # a rank signalled by the launcher may still have exited with its own error code first
    failed = sorted(
        (w for w in workers if w.returncode is not None and w.returncode != 0
         # a remote rank's ssh exits with a positive code when the launcher stopped it: not a cause
         and (not w.stopped_by_launcher or (w.returncode > 0 and not w.remote))),
        key=lambda w: w.exited_at or 0.0,
    )
    for worker in failed:
        if (blamed_rank(worker) is None and worker.rank not in reports
                and not any("PeerLostError" in line for line in worker.last_lines())):
            return worker
    # Two ranks that lost each other while both ran: the link broke; name the one that saw it first.
    if failed and link_lost_between(failed[0], workers) is not None:
        return failed[0]
    # Every failed rank only failed because of another one: the cause is the rank they name (one
    # stopped, or one that ended its program early with code 0: not a failure in the launcher's eyes).
    by_rank = {w.rank: w for w in workers}
    named = collections.Counter(r for w in failed if (r := blamed_rank(w)) is not None and r in by_rank)
    named.update(r for r in reports.values() if r in by_rank)  # told the launcher, whatever their exit codes
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


def link_lost_between(root: Worker, workers: list[Worker]) -> Worker | None:
    """The rank whose connection to ``root`` broke while both ran, if that is what failed the job.

    Each of the two names the other as lost, and each exited with its own error (neither was
    killed, nor stopped by the launcher): both processes were alive, so what died is the link
    between them (a network split, a firewall), not a rank.
    """
    other = next((w for w in workers if w.rank == blamed_rank(root) and w is not root), None)
    if other is None or blamed_rank(other) != root.rank:
        return None
    if any(w.stopped_by_launcher or w.returncode is None or w.returncode <= 0 for w in (root, other)):
        return None
    return other


def _report_failure(root: Worker, workers: list[Worker], reports: Mapping[int, int] | None = None,
                    prog: str = _PROG) -> None:
    """Print the torchrun-style root-cause block to stderr."""
    reports = reports or {}
    blaming = [w for w in workers if w is not root and (blamed_rank(w) == root.rank or reports.get(w.rank) == root.rank)]
    reporters = [str(w.rank) for w in blaming]
    # ranks that caught the error and exited 0 did not fail: they reported losing it
    failing = all(w.returncode not in (0, None) for w in blaming)
    because = f"rank{'s' if len(reporters) > 1 else ''} {', '.join(reporters)} " + (
        "failed because of it" if failing else "reported losing it")
    other = link_lost_between(root, workers)
    if other is not None:
        where = f" ({root.host} - {other.host})" if root.host != other.host else ""
        cause = (f"lost its connection to rank {other.rank}, and rank {other.rank} lost its connection to it "
                 f"while both processes ran: the link between them{where} broke (a network split, a firewall or "
                 f"a host that stopped routing); rank {root.rank} {describe_exit(root.returncode or 0)}, rank "
                 f"{other.rank} {describe_exit(other.returncode or 0)}")
    elif reporters and root.stopped_by_launcher:
        cause = f"stopped answering ({because}); {prog} then stopped it ({describe_exit(root.returncode or 0)})"
    elif reporters:
        cause = f"{describe_exit(root.returncode or 0)}; {because}"
    else:
        cause = describe_exit(root.returncode or 0)
    lines = [
        f"{prog}: job failed",
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
        lines.append(f"  stopped by {prog}: rank{'s' if len(stopped) > 1 else ''} {', '.join(stopped)}")
    emit(sys.stderr, "\n".join(lines))


def main(argv: Sequence[str] | None = None, prog: str = _PROG) -> int:
    """Entry point of ``ringcomm-run``; returns the exit status (the console script passes it to ``sys.exit``).

    ``prog``: the name usage errors carry (see :func:`horovodrun_main`).
    """
    try:
        args = parse_args(argv, prog)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    return run_job(args)


def horovodrun_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``horovodrun`` (the ``horovod`` compat distribution): ``ringcomm-run`` whose usage errors
    and ``--version`` say ``horovodrun``, the command the user typed."""
    return main(argv, prog="horovodrun")


if __name__ == "__main__":
    sys.exit(main())
