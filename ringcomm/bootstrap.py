"""The wiring of one rank: its sockets bound, the ranks met at the rendezvous, its peers connected.

:func:`connect` does it once, when the engine is made, and returns a :class:`Wiring`: the record
of what it opened (the ZeroMQ context and its authentication thread, the data plane, the control
socket, the files of ``ipc://`` endpoints, the rendezvous server this rank hosts, the shared-memory
allreduce) and the rendezvous table.  The engine runs its loop over that record and closes it
(:meth:`Wiring.close`); nothing here calls the engine.  A job of one process has no peers:
:func:`alone` is its record, with nothing open.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from typing import Any, Protocol

import numpy as np
import zmq

from .collectives import hierarchical, shm_allreduce
from .core import ring, routing, wire
from .errors import InvalidInputError
from .job import config, hosts, identity
from .job.config import Settings
from .job.cores import available_cores
from .job.names import ipc_base, ipc_file, remove_files
from .job.ports import PortRange
from .job.topology import Topology
from .net import auth
from .net.control import Rank0Control
from .net.ports import bind_zmq
from .net.transport import DataPlane
from .shm import slots as shm_files

log = logging.getLogger("ringcomm.engine")  # the engine's set-up: logged where its loop logs


class LaneMeeting(Protocol):
    """What the wiring asks of the small-op lane at the rendezvous (the lane's owner,
    :class:`ringcomm.lane.owner.LaneOwner`, handed to the engine from above)."""

    def offer(self, job_id: str, round_: int, addr: str, shm_bytes: int, net_bytes: int,
              encrypt: bool, ports: PortRange | None = None, shm_move_bytes: int | None = None) -> dict[str, Any]:
        """Before the ranks meet: this rank's entries of the rendezvous table for the lane (its
        listening socket, if any, on a port of ``ports``)."""
        ...

    def accept(self, table: list[dict[str, Any]], secret: bytes, job_id: str, round_: int, start_timeout: float,
               peer_timeout: float) -> None:
        """Once every rank's offer is in ``table``: make the lane (or none)."""
        ...


class NullLink:
    """The link of a single-process job: never sends."""

    rank = 0
    size = 1

    def send(self, dst: int, seq: int, tag: int, arr: np.ndarray) -> None:  # pragma: no cover
        raise AssertionError("single-process job has no peers")

    def recv(self, src: int, seq: int, tag: int) -> object:  # pragma: no cover
        raise AssertionError("single-process job has no peers")

    def flush(self) -> None:
        pass


@dataclasses.dataclass
class Wiring:
    """What :func:`connect` opened for one rank, and the rendezvous table it got.

    ``link`` is the data plane (a :class:`NullLink` alone); ``ctrl`` the control socket (rank 0's
    ROUTER, the others' DEALER connected to it; None alone); ``peer_table`` every rank's entry,
    in rank order.
    """

    peer_table: list[dict]
    link: Any = dataclasses.field(default_factory=NullLink)
    ctx: zmq.Context | None = None
    zap: auth.ZapThread | None = None
    ctrl: zmq.Socket | None = None
    ipc_paths: list[str] = dataclasses.field(default_factory=list)
    server: Any = None  # a rendezvous.RendezvousServer on the rank that hosts it
    shm_ar: shm_allreduce.ShmAllreduce | None = None  # all ranks on one host: large allreduces

    def close(self, ctrl_linger_ms: int = 0) -> None:
        """Close everything in the record: the control socket after ``ctrl_linger_ms`` for answers
        not yet sent (rank 0's last ones, to ranks still connected)."""
        if self.shm_ar is not None:
            self.shm_ar.close()
        if isinstance(self.link, DataPlane):
            self.link.close()
        if self.ctrl is not None:
            self.ctrl.close(ctrl_linger_ms)
        remove_files(self.ipc_paths)
        if self.server is not None:
            self.server.close()
        if self.zap is not None:
            self.zap.stop()
        if self.ctx is not None:
            self.ctx.term()


def alone(hostname: str) -> Wiring:
    """The record of a job of one process: no sockets, and a table of this rank alone."""
    return Wiring(peer_table=[{"rank": 0, "host": hostname, "pid": os.getpid()}])


def connect(topo: Topology, settings: Settings, round_: int, limits: routing.RouteLimits, lane: LaneMeeting,
            control: Rank0Control | None) -> Wiring:
    """Bind this rank's sockets, meet the other ranks at the rendezvous and connect to them.

    ``lane`` offers and accepts the small-op lane at the rendezvous; ``control`` (rank 0's)
    gets the bound control socket, and the data plane runs its step while a receive waits.  On an
    error everything opened so far is closed before it propagates: a failed ``init()`` leaves no
    socket, context or file behind.
    """
    w = Wiring(peer_table=[])
    try:
        _connect(w, topo, settings, round_, limits, lane, control)
    except BaseException:
        w.close()
        raise
    return w


def _connect(w: Wiring, topo: Topology, st: Settings, round_: int, limits: routing.RouteLimits, lane: LaneMeeting,
             control: Rank0Control | None) -> None:
    """:func:`connect`'s steps, each filling ``w`` as soon as it opens something (so that it closes)."""
    from .net import rendezvous

    rank, size = topo.rank, topo.size
    # every connection to this process proves it holds the job secret before it is attached
    creds = auth.Credentials.derive(topo.secret, "job", encrypt=st.encrypt)
    ctx = w.ctx = zmq.Context(io_threads=st.io_threads)
    w.zap = auth.ZapThread(ctx, creds, f"rank {rank}")  # before the first bind
    link = DataPlane(
        ctx, rank, size, st.zero_copy_min_bytes, st.peer_timeout, st.socket_buffer_bytes,
        shm_slots=st.shm_slots, shm_slot_bytes=st.segment_bytes, shm_min_bytes=st.shm_min_bytes,
        job_id=topo.job_id, round_=round_, max_payload_bytes=max(st.segment_bytes, st.stream_segment_bytes),
        credentials=creds,
        seq_stride=hierarchical.PHASES, stream_min_bytes=st.stream_min_bytes,
        cross_memory_min_bytes=st.cross_memory_min_bytes,
    )
    w.link = link  # from here on, close() closes it
    base = ipc_base(topo.job_id, os.getpid(), rank, round_)
    data_eps = link.bind(base + "-data", topo.addr, st.listen_ports)
    if topo.local_rank == 0 and shm_files.available():
        _reclaim_left_by_dead(rank)
    lane_offers = lane.offer(topo.job_id, round_, topo.addr, st.shm_lane_bytes_for(size),
                             st.net_lane_bytes_for(size), st.encrypt, st.listen_ports,
                             shm_move_bytes=st.shm_lane_move_bytes_for(size))
    info: dict[str, Any] = {
        "rank": rank, "host": topo.hostname, "pid": os.getpid(), "data": data_eps,
        # which ranks of this host name can share memory, sockets and pids (separate containers cannot)
        "machine": identity.machine(), "pidns": identity.pid_namespace(),
        "streams": link.listen_streams(topo.addr, st.listen_ports),  # where peers on other hosts stream payloads to it, or None
        "encrypt": st.encrypt,  # ranks that disagree could never connect: found at init, below
        "agreed": config.agreed(st),  # how ops are cut: every rank must hold the same (checked below)
        # "lane": rank 0: the small-op lane's path; the others: whether they can map one;
        # "net_lane": where this rank listens for the lane across hosts, or False
        **lane_offers,
    }
    if rank == 0:
        ctrl = w.ctrl = ctx.socket(zmq.ROUTER)
        ctrl.setsockopt(zmq.LINGER, 0)
        ctrl.setsockopt(zmq.MAXMSGSIZE, wire.MAX_CONTROL_BYTES + wire.TAG_BYTES)
        ctrl.setsockopt(zmq.ROUTER_MANDATORY, 1)
        creds.apply_server(ctrl)
        ctrl.bind(base + "-ctrl")
        ipc_ep = ctrl.getsockopt_string(zmq.LAST_ENDPOINT)
        path = ipc_file(ipc_ep)
        if path is not None:
            w.ipc_paths.append(path)
        info["ctrl"] = [ipc_ep, bind_zmq(ctrl, topo.addr, st.listen_ports, "rank 0's control socket")]
        if topo.host_rendezvous:
            port = int(topo.rendezvous.rpartition(":")[2])
            w.server = rendezvous.RendezvousServer(size, topo.secret, host=topo.rendezvous_bind, port=port)
    else:
        ctrl = w.ctrl = ctx.socket(zmq.DEALER)
        ctrl.setsockopt(zmq.LINGER, 0)
        ctrl.setsockopt(zmq.MAXMSGSIZE, wire.MAX_CONTROL_BYTES + wire.TAG_BYTES)
        ctrl.setsockopt(zmq.IDENTITY, f"rank{rank}".encode())
        creds.apply_client(ctrl)
    if control is not None:
        control.socket = ctrl
        link.serve_while_waiting(control)
    table = rendezvous.register(
        topo.rendezvous, topo.secret, rank, size, info, st.start_timeout, round=round_,
        progress=_print_waiting if rank == 0 else None,
    )
    w.peer_table = table = _as_placed(table, rank)
    host = table[rank]["host"]
    _check_same_security(table, rank)
    config.check_agreed(table, rank)
    unused = config.segment_setting_unused(os.environ, ring.one_per_host([p["host"] for p in table]))
    if unused and rank == 0:
        log.warning("rank 0: %s", unused)
    for peer in table:
        r = int(peer["rank"])
        same_host = peer["host"] == host
        if r != rank:
            # a pid this rank can look up: same host and same pid namespace (containers each have their own)
            visible = peer.get("pid") if same_host and peer.get("pidns") == table[rank].get("pidns") else None
            link.connect(r, peer["data"], same_host, f"host {peer['host']}, pid {peer['pid']}", visible,
                         stream=peer.get("streams"))
    if shm_allreduce.usable(size, [p["host"] for p in table], st.shm_allreduce_min_bytes,
                            st.shm_allreduce_min_ranks):
        w.shm_ar = shm_allreduce.ShmAllreduce(topo.job_id, round_, st.shm_allreduce_piece_bytes,
                                              st.peer_timeout, threads=st.shm_allreduce_threads_for(
                                                  size, available_cores()))
    lane.accept(table, topo.secret, topo.job_id, round_, st.start_timeout, st.peer_timeout)
    if rank != 0:
        root = table[0]
        ctrl.connect(root["ctrl"][0] if root["host"] == host else root["ctrl"][1])
    if log.isEnabledFor(logging.DEBUG):
        _log_setup(topo, st, limits, table, info, w.shm_ar)


def _as_placed(table: list[dict], rank: int) -> list[dict]:
    """The rendezvous table with each rank's host as :func:`~ringcomm.job.hosts.separate_by_machine` has it:
    ranks of one host name in separate containers, or on separate machines, are separate hosts."""
    names = [str(p["host"]) for p in table]
    machines = [p.get("machine") or [] for p in table]
    if rank == 0:
        notice = hosts.separation_notice(names, machines)
        if notice:
            log.warning("rank 0: %s", notice)
    return [dict(p, host=label) for p, label in zip(table, hosts.separate_by_machine(names, machines), strict=True)]


def _log_setup(topo: Topology, st: Settings, lim: routing.RouteLimits, table: list[dict], info: dict[str, Any],
               shm_ar: shm_allreduce.ShmAllreduce | None) -> None:
    """DEBUG: the transports this rank chose for each peer and the thresholds that pick an op's path."""
    rank, host = topo.rank, table[topo.rank]["host"]
    local = [int(p["rank"]) for p in table if p["host"] == host and int(p["rank"]) != rank]
    remote = [int(p["rank"]) for p in table if p["host"] != host]
    shm = (f"shared-memory slots ({st.shm_slots} x {st.segment_bytes} B) for payloads from {st.shm_min_bytes} B"
           if st.shm_slots > 0 and local else "no shared-memory slots")
    log.debug("rank %d: data plane: same-host peers %s over ipc sockets with %s; other-host peers %s over tcp "
              "(%s); zero-copy sends from %d B; %s", rank, local, shm, remote, topo.addr,
              st.zero_copy_min_bytes, "CURVE-encrypted" if st.encrypt else "authenticated, not encrypted")
    if rank == 0:
        log.debug("rank 0: control plane: serving the other ranks on %s", info.get("ctrl"))
    else:
        via = "ipc" if table[0]["host"] == host else "tcp"
        log.debug("rank %d: control plane: connected to rank 0 over %s", rank, via)
    # lim: the same numbers core/routing.py decides with
    hier = {1: "whenever the hosts allow it", 0: "off", -1: f"from {lim.hierarchical_min_bytes} B when the hosts allow it"}
    log.debug("rank %d: paths: allreduces up to %d B go through rank 0 in one round trip (allgather parts up "
              "to %d B); larger ones up to %d B by recursive doubling, the rest by the ring in %d B segments (%d B where "
              "each rank is on a host of its own)%s; "
              "hierarchical allreduce %s (%d host(s)); ops fused up to %d B, cycle time %g ms", rank,
              lim.small_bytes, lim.small_gather_bytes, lim.doubling_bytes, st.segment_bytes, st.stream_segment_bytes,
              f", or one shared-memory region from {lim.shm_min_bytes} B (all ranks on this host; "
              f"{shm_ar.threads} thread(s) per rank)"
              if shm_ar is not None else "; no shared-memory allreduce (not every rank on one host, "
              "or switched off)", hier.get(lim.hierarchical, str(lim.hierarchical)),
              len({p["host"] for p in table}), st.fusion_threshold, st.cycle_time)


def _check_same_security(table: list[dict], rank: int) -> None:
    """Raise when ranks disagree on ``RINGCOMM_ENCRYPT``: their handshakes would fail for ever."""
    flags = {int(peer["rank"]): bool(peer.get("encrypt", False)) for peer in table}
    if len(set(flags.values())) > 1:
        on = [r for r, f in sorted(flags.items()) if f]
        off = [r for r, f in sorted(flags.items()) if not f]
        raise InvalidInputError(
            f"rank {rank}: ranks {on} run with RINGCOMM_ENCRYPT=1 and ranks {off} without; encrypted and "
            f"plain sockets cannot connect. Set RINGCOMM_ENCRYPT to the same value on every rank."
        )


def _reclaim_left_by_dead(rank: int) -> None:
    """Remove the shared-memory files that jobs killed on this host before they could remove them
    left (a job started without ``ringcomm-run``, which cleans up after its own, has nobody else to)."""
    removed = shm_files.reclaim_left_by_dead()
    if removed:
        log.info("rank %d: removed %d shared-memory file(s), %.1f MiB, that jobs killed on this host had left: %s",
                 rank, len(removed), sum(n for _, n in removed) / 2**20, ", ".join(p for p, _ in removed))


def _print_waiting(line: str) -> None:
    """Rank 0's report of the ranks still missing at the rendezvous: on stderr, whatever the logging setup."""
    print(f"ringcomm: rank 0: {line}", file=sys.stderr, flush=True)
