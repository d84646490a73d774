"""The elastic driver: ``ringcomm-run --host-discovery-script ...`` keeps a job alive while workers come and go.

Generations.  The driver publishes numbered worlds (generations) in its
key-value store (a :class:`~ringcomm.net.rendezvous.RendezvousServer` at
``RINGCOMM_RENDEZVOUS_ADDR``): ``world/<g>`` holds every member's rank, size,
local and cross ranks, and the address of a fresh rendezvous for that
generation; ``world/current`` names the newest.  Workers learn their place
through :mod:`ringcomm.elastic.worker` at each ``init()``.

Re-forming, as Horovod does it: once something happened in generation ``g``
-- a worker exited, or one came back to the rendezvous (``ready/<id>`` = g,
after it caught a ``HorovodInternalError`` or a ``HostsUpdatedInterrupt``) --
the driver waits until *every* member of ``g`` has either exited or come back,
then:

- any member exited 0: the job is over (members still waiting are stopped);
  it succeeds unless one failed;
- every member failed: the job fails (root cause printed);
- else the members that came back keep their order (the new rank 0 holds the
  committed state everyone syncs from), new workers fill free slots of the
  discovered hosts up to ``--max-np`` (not on blacklisted hosts), and
  generation ``g + 1`` is published.  Below ``--min-np`` it waits for
  discovery to offer slots, and fails after ``--elastic-timeout`` seconds.

Where workers run: :mod:`ringcomm.launch.elastic_starter` starts them here, or on
other hosts through ``--ssh-command`` as ``ringcomm-run -H`` starts remote
ranks.  A member that fails before its generation's rendezvous completed
makes the driver call that rendezvous off
(:meth:`~ringcomm.net.rendezvous.RendezvousServer.abort`): the members waiting
there come back at once instead of after ``RINGCOMM_START_TIMEOUT``.  A failed
worker's host is blacklisted (``--blacklist-failures``, 1 by default, as
Horovod does).

New hosts while the job runs: the driver bumps ``hosts_version``; rank 0 sees
it at the next ``state.commit()`` / ``check_host_updates()``, every rank raises
``HostsUpdatedInterrupt`` there, comes back, and the new world includes the
new workers.
"""

from __future__ import annotations

import argparse
import os
import queue
import secrets
import shlex
import signal
import sys
import threading
import time

from .supervise import GRACE_SECONDS, SignalCatcher, Worker, describe_exit, emit, remove_job_files, stop_all, stop_lost
from ..errors import InvalidInputError, RendezvousError
from ..job import config
from ..job.ports import PortRange
from ..net.rendezvous import RendezvousServer, kv_set
from .elastic_discovery import DiscoveryError, FixedHosts, HostDiscoveryScript
from ..elastic.plan import Assignment, Blacklist, Member, assign_ranks, new_worker_hosts
from .elastic_starter import WorkerStarter
from .lost import LostRanks
from ..elastic.worker import World, pack, unpack

__all__ = ["ElasticDriver", "run"]

#: Seconds between runs of the discovery script.
DISCOVERY_INTERVAL = 1.0
#: Seconds between checks of the workers' state.
_TICK = 0.05
_PROG = "ringcomm-run"


#: Re-formations after which an elastic job fails when --reset-limit is not given.
DEFAULT_RESET_LIMIT = 100

class _Store(RendezvousServer):
    """The driver's key-value store; the driver also reads it directly (no socket round trip)."""

    def peek(self, key: str) -> bytes | None:
        with self._lock:
            return self._store.get(key)


class JobFailed(Exception):
    """The elastic job cannot go on; the message says why (printed by the driver)."""


class ElasticDriver:
    """Runs one elastic job to its end; ``run()`` returns the launcher's exit status."""

    def __init__(self, args: argparse.Namespace, environ: dict[str, str] | None = None) -> None:
        self.args = args
        self.base_env = dict(os.environ if environ is None else environ)
        self.min_np: int = args.min_np if args.min_np is not None else args.num_proc
        self.max_np: int | None = args.max_np
        self.timeout: float = args.elastic_timeout
        fixed = getattr(args, "fixed_hosts", None)  # -H/--hostfile with --min-np and no discovery script
        self.discovery: HostDiscoveryScript | FixedHosts = (
            FixedHosts(fixed) if fixed is not None else HostDiscoveryScript(args.host_discovery_script,
                                                                            args.slots_per_host))
        self.blacklist = Blacklist(args.blacklist_failures, args.blacklist_cooldown)
        self.job_id = secrets.token_hex(4)
        self.secret = secrets.token_bytes(32)
        self.exits: queue.Queue[Worker] = queue.Queue()
        self.workers: dict[int, Worker] = {}  # every worker ever started, by id
        self.host_of: dict[int, str] = {}
        self.removed: set[int] = set()  # stopped by the driver on purpose (host gone, job over)
        #: the ranks this generation's workers reported lost, and the worker behind each rank
        self.lost = LostRanks()
        self._wid_of: dict[int, int] = {}
        self.failures: list[Worker] = []
        self.gen = -1
        self.members: list[Member] = []
        self.resets = 0
        self.hosts: dict[str, int] = {}
        self.hosts_version = 0
        self._published_version = 0
        self.starter = WorkerStarter(args, self.base_env, self.job_id, self.secret, self.timeout,
                                     self._limit())
        self._discovery_lock = threading.Lock()
        self._discovery_error: str | None = None
        self._stop = threading.Event()
        self._servers: list[RendezvousServer] = []
        self._bind = "127.0.0.1"
        self._ports: PortRange | None = None  # RINGCOMM_PORT_RANGE, for the store and each rendezvous
        self._unreachable: set[str] = set()
        self.store: _Store | None = None

    # ------------------------------------------------------------------ helpers

    def say(self, text: str) -> None:
        emit(sys.stderr, f"{getattr(self.args, 'prog', _PROG)}: {text}")

    def _limit(self) -> int:
        return self.max_np if self.max_np is not None else 1 << 30

    def _reachable(self, found: dict[str, int]) -> dict[str, int]:
        """``found`` less the hosts no route leads to from here (each reported once)."""
        hosts = {}
        for host, slots in found.items():
            try:
                self.starter.address_toward(host)
            except InvalidInputError as exc:
                if host not in self._unreachable:
                    self._unreachable.add(host)
                    self.say(f"host {host!r} from the discovery script is left out: {exc}")
                continue
            hosts[host] = slots
        return hosts

    def _refresh_hosts(self) -> None:
        try:
            hosts = self._reachable(self.discovery.find())
        except DiscoveryError as exc:
            with self._discovery_lock:
                if self._discovery_error != str(exc):
                    self.say(f"{exc}; keeping the last known hosts")
                self._discovery_error = str(exc)
            return
        with self._discovery_lock:
            self._discovery_error = None
            self.hosts = hosts

    def _discovery_loop(self) -> None:
        while not self._stop.wait(DISCOVERY_INTERVAL):
            self._refresh_hosts()

    def _running_members(self) -> list[Member]:
        return [m for m in self.members if not self.workers[m.wid].exited.is_set()]

    def _update_hosts_version(self) -> None:
        """Bump ``hosts_version`` when a new world would differ: free slots to fill, or a member's host gone."""
        with self._discovery_lock:
            hosts = dict(self.hosts)
        running = self._running_members()
        now = time.monotonic()
        grow = bool(new_worker_hosts(hosts, running, self.blacklist, now, self._limit()))
        gone = any(m.host not in hosts for m in running)
        if (grow or gone) and self._published_version == self.hosts_version:
            self.hosts_version += 1
            self._kv("hosts_version", pack(self.hosts_version))
            self.say(f"hosts changed ({', '.join(f'{h}:{n}' for h, n in hosts.items()) or 'none'}); "
                     "the workers re-form at their next commit")
        elif not grow and not gone:
            self._published_version = self.hosts_version

    def _kv(self, key: str, value: bytes) -> None:
        assert self.store is not None
        kv_set(f"tcp://127.0.0.1:{self.store.port}" if self._bind == "0.0.0.0" else self.store.address,
               self.secret, key, value, 10.0)

    def _start_worker(self, host: str, place: Assignment) -> Member:
        wid = len(self.workers)
        try:
            worker = self.starter.start(wid, host, self.exits, place)
        except InvalidInputError as exc:
            raise JobFailed(f"elastic job failed: cannot start worker {wid} on {host}: {exc}") from None
        except OSError as exc:
            program = self.args.ssh_command if self.starter.is_remote(host) else shlex.join(self.args.command[:1])
            raise JobFailed(f"elastic job failed: cannot start {program} for worker {wid} on {host}: {exc}") from None
        self.workers[wid] = worker
        self.host_of[wid] = host
        if self.args.verbose:
            self.say(f"worker {wid}: pid {worker.pid} on {host}{' (ssh)' if worker.remote else ''}")
        return Member(wid, host)

    def _remove(self, member: Member, why: str) -> None:
        self.removed.add(member.wid)
        # SIGTERM here (a remote worker: its ssh input closed), SIGKILL after the grace or at once for a
        # stopped process, which SIGTERM would never reach
        threading.Thread(target=stop_all, args=([self.workers[member.wid]], GRACE_SECONDS), daemon=True,
                         name=f"ringcomm-run-remove{member.wid}").start()
        self.say(f"worker {member.wid} on {member.host} removed from the job: {why}")

    def _stop_lost(self) -> None:
        """Stop the workers that this generation's ranks reported lost, as a fixed job's launcher does
        (:func:`~.supervise.stop_lost`).  Its end counts as a failure, so the job re-forms without it
        instead of waiting for it."""
        if not self._servers:
            return
        by_rank = {r: self.workers[wid] for r, wid in self._wid_of.items()}
        for rank, frozen in stop_lost(self.lost, by_rank, self._servers[-1].lost_reports()):
            wid, reporters = self._wid_of[rank], self.lost.reporters_of(rank)
            self.say(f"generation {self.gen}: rank{'s' if len(reporters) > 1 else ''} {', '.join(map(str, reporters))} "
                     f"lost worker {wid} (rank {rank}) on {self.host_of[wid]}"
                     f"{' (its process is stopped)' if frozen else ''}; stopping it")

    # ------------------------------------------------------------------ forming worlds

    def _publish(self, members: list[Member]) -> list[Assignment]:
        self.gen += 1
        try:
            server = RendezvousServer(size=len(members), secret=self.secret, host=self._bind, ports=self._ports)
        except RendezvousError as exc:
            raise JobFailed(f"elastic job failed: generation {self.gen}: {exc}") from None
        self._servers.append(server)
        while len(self._servers) > 2:  # the generation before last has completed (or been abandoned)
            self._servers.pop(0).close()
        assignments = assign_ranks(members)
        self.lost, self._wid_of = LostRanks(), {a.rank: a.wid for a in assignments}
        address = f"tcp://{self.starter.advertised(m.host for m in members)}:{server.port}"
        world = World(self.gen, address, self.hosts_version, {
            a.wid: [a.rank, a.size, a.local_rank, a.local_size, a.cross_rank, a.cross_size, a.host]
            for a in assignments
        })
        self.members = members
        self._published_version = self.hosts_version
        self._kv(f"world/{self.gen}", world.encode())
        self._kv("world/current", pack(self.gen))
        ranks = ", ".join(f"worker {a.wid}@{a.host} -> rank {a.rank}" for a in assignments)
        self.say(f"generation {self.gen}: {len(members)} workers ({ranks})")
        return assignments

    def _form(self, survivors: list[Member], target: int) -> bool:
        """Publish the next world: survivors first, then new workers; False while below --min-np."""
        self._refresh_hosts()
        with self._discovery_lock:
            hosts = dict(self.hosts)
        now = time.monotonic()
        kept, banned = [], []
        for m in survivors:
            if m.wid in self.removed:
                continue
            if m.host not in hosts:
                self._remove(m, "its host is no longer in the discovery output")
            elif self.blacklist.blacklisted(m.host, now):  # as Horovod: the job goes on without the host
                self._remove(m, "its host is blacklisted")
                banned.append(m)
            else:
                kept.append(m)
        if banned and not kept:
            raise JobFailed(f"elastic job failed: every surviving worker ran on a blacklisted host "
                            f"({', '.join(sorted({m.host for m in banned}))}), so none is left to pass the state "
                            "on to new workers; raise --blacklist-failures to keep a host after a failure")
        new_hosts = new_worker_hosts(hosts, kept, self.blacklist, now, max(target, len(kept)))
        if len(kept) + len(new_hosts) < self.min_np:
            return False
        new_members = [Member(len(self.workers) + i, h) for i, h in enumerate(new_hosts)]
        # publish before starting the new workers, so their first init() finds the world
        seats = {a.wid: a for a in self._publish(kept + new_members)}
        for m in new_members:
            started = self._start_worker(m.host, seats[m.wid])
            assert started.wid == m.wid
        return True

    def _wait_to_form(self, survivors: list[Member], target: int, why: str) -> None:
        """Form the next world, waiting up to --elastic-timeout for enough slots; raises JobFailed."""
        deadline = time.monotonic() + self.timeout
        announced = False
        while not self._form(survivors, target):
            if not announced:
                self.say(f"{why}: fewer than --min-np {self.min_np} workers can run ({len(survivors)} running); "
                         f"waiting up to {self.timeout:g} s (--elastic-timeout) for the discovery script to "
                         "offer more slots")
                announced = True
            if time.monotonic() >= deadline:
                raise JobFailed(self._below_min_message(survivors))
            self._check_signals()
            self._stop.wait(DISCOVERY_INTERVAL / 2)
            survivors = [m for m in survivors if not self.workers[m.wid].exited.is_set()]

    def _below_min_message(self, survivors: list[Member]) -> str:
        now = time.monotonic()
        with self._discovery_lock:
            hosts = dict(self.hosts)
            error = self._discovery_error
        shown = []
        for h, n in hosts.items():
            note = " (blacklisted: its workers kept failing)" if self.blacklist.blacklisted(h, now) else ""
            shown.append(f"{h}:{n}{note}")
        text = (f"elastic job failed: only {len(survivors)} worker(s) could run and --min-np is {self.min_np}; "
                f"no more slots appeared within --elastic-timeout {self.timeout:g} s. "
                f"Discovered hosts: {', '.join(shown) or 'none'}.")
        if error:
            text += f" Last discovery error: {error}."
        return text + " Offer more slots in the discovery script, or lower --min-np."

    # ------------------------------------------------------------------ main loop

    def _check_signals(self) -> None:
        if self.catcher.received:
            raise _Interrupted(self.catcher.received[0])

    def _is_ready(self, m: Member) -> bool:
        assert self.store is not None
        raw = self.store.peek(f"ready/{m.wid}")
        return raw is not None and unpack(raw) == self.gen

    def _record_exit(self, worker: Worker) -> None:
        if worker.rank in self.removed or worker.returncode == 0:
            return
        if self._servers and any(m.wid == worker.rank for m in self.members):
            # the others may be waiting for it at this generation's rendezvous: send them back to re-form
            # now, instead of after their RINGCOMM_START_TIMEOUT
            self._servers[-1].abort(f"worker {worker.rank} of generation {self.gen} on {self.host_of[worker.rank]} "
                                    f"{describe_exit(worker.returncode or 0)}; the launcher re-forms the job")
        self.failures.append(worker)
        host = self.host_of[worker.rank]
        self.say(f"worker {worker.rank} on {host} (pid {worker.pid}) {describe_exit(worker.returncode or 0)}")
        if self.blacklist.record_failure(host, time.monotonic()):
            until = self.blacklist.until(host) or time.monotonic()  # set by the failure just recorded
            self.say(f"host {host} blacklisted for {until - time.monotonic():.0f} s: "
                     f"{self.blacklist.failures} of its workers failed")

    def _loop(self) -> int | None:
        """Supervise the current generation until the job ends (its exit status) or re-forms (None)."""
        event_since: float | None = None
        while True:
            self._check_signals()
            self._stop_lost()
            try:
                while True:
                    self._record_exit(self.exits.get_nowait())
            except queue.Empty:
                pass
            states = {}
            for m in self.members:
                w = self.workers[m.wid]
                if w.exited.is_set():
                    states[m.wid] = "ok" if w.returncode == 0 else "failed"
                elif self._is_ready(m):
                    states[m.wid] = "ready"
                else:
                    states[m.wid] = "running"
            pending = [wid for wid, s in states.items() if s == "running"]
            if not pending:
                return self._settle(states)
            if len(pending) < len(states):
                if event_since is None:
                    event_since = time.monotonic()
                elif time.monotonic() - event_since > self.timeout:
                    for wid in pending:
                        self._remove(Member(wid, self.host_of[wid]),
                                     f"it did not come back to re-form the job within {self.timeout:g} s "
                                     "(--elastic-timeout) after the others did")
                        self.removed.discard(wid)  # its exit then counts as a failure
                    event_since = None
            else:
                event_since = None
                self._update_hosts_version()
            time.sleep(_TICK)

    def _settle(self, states: dict[int, str]) -> int | None:
        """Every member of this generation exited or came back: end the job or form the next world."""
        ok = [wid for wid, s in states.items() if s == "ok"]
        ready = [m for m in self.members if states[m.wid] == "ready"]
        if ok:
            for m in ready:
                self._remove(m, f"worker {ok[0]} finished the job while this one waited to re-form")
            return self._finish()
        if not ready:
            raise JobFailed("elastic job failed: every worker of the last generation failed")
        limit = DEFAULT_RESET_LIMIT if self.args.reset_limit is None else self.args.reset_limit
        if self.resets >= limit:
            raise JobFailed(f"elastic job failed: the job re-formed {self.resets} times, the --reset-limit "
                            f"({limit}{', the default' if self.args.reset_limit is None else ''})")
        self.resets += 1
        self._wait_to_form(ready, self._limit(), f"generation {self.gen} lost workers")
        return None

    def _finish(self) -> int:
        failed_now = [self.workers[m.wid] for m in self.members
                      if self.workers[m.wid].returncode not in (0, None) and m.wid not in self.removed]
        if failed_now:
            raise JobFailed(f"elastic job failed: worker {failed_now[0].rank} of the last generation failed "
                            "after another had finished")
        self.say(f"job {self.job_id}: done; {len(self.members)} workers of generation {self.gen} exited with "
                 f"code 0 ({self.resets} re-formations)")
        return 0

    def run(self) -> int:
        """Start the job, supervise it, stop everything; returns the exit status."""
        self.catcher = SignalCatcher()
        self.catcher.install()
        status = 1
        try:
            try:
                self._bind = self.starter.bind_host()
                self._ports = config.port_range(self.base_env)
                self.store = _Store(size=1, secret=self.secret, host=self._bind, ports=self._ports)
            except (InvalidInputError, RendezvousError) as exc:
                raise JobFailed(f"elastic job failed: {exc}") from None
            self.starter.store_port = self.store.port
            self._kv("hosts_version", pack(0))
            if self.args.verbose:
                self.say(f"job {self.job_id}: elastic, driver store at {self.store.address}, command: "
                         f"{shlex.join(self.args.command)}")
            self._refresh_hosts()
            with self._discovery_lock:
                if self._discovery_error is not None:
                    raise JobFailed(f"elastic job failed: {self._discovery_error}")
            threading.Thread(target=self._discovery_loop, name="ringcomm-discovery", daemon=True).start()
            # as Horovod: the first generation takes every slot offered, up to --max-np (-np is the default --min-np)
            self._wait_to_form([], self._limit(), "starting")
            while True:
                result = self._loop()
                if result is not None:
                    status = result
                    break
        except JobFailed as exc:
            self.say(str(exc))
            self._report_root_cause()
            status = 1
        except _Interrupted as exc:
            self.say(f"received {signal.Signals(exc.signum).name}; stopped all workers")
            status = 128 + exc.signum
        finally:
            self._stop.set()
            stop_all(list(self.workers.values()), GRACE_SECONDS, hurry=lambda: len(self.catcher.received) > 1)
            self.catcher.restore()
            for server in self._servers:
                server.close()
            if self.store is not None:
                self.store.close()
            remove_job_files(self.job_id)
            deadline = time.monotonic() + 2.0
            for worker in self.workers.values():
                worker.join_output(deadline)
        return status

    def _report_root_cause(self) -> None:
        if not self.failures:
            return
        root = self.failures[-1]
        lines = [f"  last failure: worker {root.rank} on {self.host_of[root.rank]} (pid {root.pid}) "
                 f"{describe_exit(root.returncode or 0)}", f"  last lines of worker {root.rank}:"]
        tail = root.last_lines()
        lines += [f"    {line}" for line in tail] if tail else ["    (no output)"]
        emit(sys.stderr, "\n".join(lines))


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def run(args: argparse.Namespace) -> int:
    """Entry point from ``ringcomm-run`` when ``--host-discovery-script`` is given."""
    return ElasticDriver(args).run()
