"""Where this process sits in the job, read once from the environment at ``init()``.

Sources, first match wins (the order matters: ``mpirun`` inside a Slurm
allocation also sets ``SLURM_*``; torchrun under Slurm sets both too):

0. ``ringcomm-run`` elastic mode: ``RINGCOMM_ELASTIC_WORKER`` -- the place in the newest
   world is asked from the launcher's driver (:mod:`ringcomm.elastic.worker`).
1. ``ringcomm-run``: ``RINGCOMM_RANK``, ``RINGCOMM_SIZE``, ... and ``RINGCOMM_RENDEZVOUS_ADDR``.
2. torchrun: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
   ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``.  Rank 0 hosts the
   rendezvous on ``MASTER_ADDR:(RINGCOMM_RENDEZVOUS_PORT or MASTER_PORT + 1)``
   (torchrun's own store may hold ``MASTER_PORT``; when ``MASTER_PORT + 1``
   is an ephemeral port, one derived from the job: :func:`torchrun_port`).
3. Open MPI's ``mpirun``: ``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``,
   ``OMPI_COMM_WORLD_LOCAL_RANK``, ``OMPI_COMM_WORLD_LOCAL_SIZE``.
4. MPICH / Intel MPI (hydra) and other PMI launchers: ``PMI_RANK``,
   ``PMI_SIZE`` (``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS`` when set) -- unless
   they are ``srun --mpi=pmi2``'s own, agreeing with ``SLURM_*`` (then 5).
   For 3 and 4 the rendezvous is at ``RINGCOMM_MASTER_ADDR`` (or
   ``MASTER_ADDR``) and ``RINGCOMM_RENDEZVOUS_PORT`` (or ``MASTER_PORT``) when
   set, else where the launcher's own variables say (:mod:`ringcomm.job.mpi_env`:
   127.0.0.1 when every rank is on one host, the launcher's host across hosts,
   a port derived from the launcher's job id); whatever the launcher does not
   say (the host index, for Open MPI) is worked out from every rank's host
   name at the rendezvous.
5. Slurm's ``srun``: ``SLURM_PROCID`` with ``SLURM_STEP_ID`` (a batch script
   itself has no step id and runs as a single process), ``SLURM_NTASKS``,
   ``SLURM_LOCALID``, ``SLURM_NODEID``, ``SLURM_STEP_NODELIST`` or
   ``SLURM_NODELIST``, ``SLURM_STEP_TASKS_PER_NODE`` or
   ``SLURM_TASKS_PER_NODE``.  Rank 0 runs on the first node of the list; the
   port is ``RINGCOMM_RENDEZVOUS_PORT``, ``MASTER_PORT``, or derived from
   ``SLURM_JOB_ID`` and ``SLURM_STEP_ID``.
6. Nothing: a single-process job (size 1).

Every rank binds its tcp sockets on, and advertises, the address of
``RINGCOMM_NETWORK_INTERFACE`` when set, else the local address that routes
toward the rendezvous host (:mod:`ringcomm.job.netaddr`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import secrets
import socket
from collections.abc import Mapping, Sequence

from . import hosts as _hosts
from . import mpi_env, netaddr
from ..errors import InvalidInputError

#: Placement fields a source may leave to be worked out from the rendezvous table.
PLACEMENT_FIELDS = ("local_rank", "local_size", "cross_rank", "cross_size")
log = logging.getLogger("ringcomm.job.topology")
_LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")


@dataclasses.dataclass(frozen=True)
class Topology:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    cross_rank: int = 0
    cross_size: int = 1
    rendezvous: str = ""  # tcp://host:port, "" for a single process
    host_rendezvous: bool = False  # this process (rank 0) must serve the rendezvous itself
    secret: bytes = b""
    job_id: str = ""
    hostname: str = ""
    source: str = "single"
    #: rendezvous round to register in (elastic jobs: the driver's generation); None: count init() calls
    round: int | None = None
    #: the IPv4 address this rank binds its tcp sockets on and gives the other ranks
    addr: str = "127.0.0.1"
    #: where rank 0 binds the rendezvous when ``host_rendezvous`` ("0.0.0.0": every interface)
    rendezvous_bind: str = "127.0.0.1"
    #: placement fields the source did not give: worked out from every rank's host at the rendezvous
    derive: tuple[str, ...] = ()


def _int(env: Mapping[str, str], key: str, default: int | None = None, src: str = "the launcher") -> int:
    raw = env.get(key)
    if raw is None:
        if default is None:
            raise InvalidInputError(f"{key} is not set; the environment from {src} is incomplete")
        return default
    try:
        return int(raw)
    except ValueError:
        raise InvalidInputError(f"{key}={raw!r} is not an integer") from None


def _check(rank: int, size: int, local_rank: int, local_size: int, src: str) -> None:
    if size < 1:
        raise InvalidInputError(f"world size from {src} is {size}; it must be >= 1 (check the launcher's -np)")
    if not 0 <= rank < size:
        raise InvalidInputError(
            f"rank from {src} is {rank} but the world size is {size}; ranks must be 0..{size - 1}"
        )
    if not 0 <= local_rank < max(local_size, 1):
        raise InvalidInputError(
            f"local rank from {src} is {local_rank} with local size {local_size}; "
            f"local ranks must be 0..{max(local_size, 1) - 1}"
        )


def secret_of(env: Mapping[str, str]) -> bytes:
    """The job's secret from ``RINGCOMM_SECRET`` (hex; empty when unset)."""
    try:
        return bytes.fromhex(env.get("RINGCOMM_SECRET", ""))
    except ValueError:
        raise InvalidInputError("RINGCOMM_SECRET must be hex") from None


def _literal_loopback(host: str) -> bool:
    return host.lower() in _LOOPBACK_NAMES or netaddr.is_loopback(host)


def pick_address(env: Mapping[str, str], toward: Sequence[str]) -> str:
    """The address this rank binds and advertises: ``RINGCOMM_NETWORK_INTERFACE``'s, or one that routes.

    ``toward``: hosts the other ranks run on (the rendezvous host first).  The
    first one that routes through a non-loopback address decides.  When every
    one routes through loopback although one is named by a non-loopback name
    (a hostname that /etc/hosts maps to 127.0.1.1, on the rendezvous host
    itself), the default route's address is used, so other hosts can reach us.
    """
    iface = env.get("RINGCOMM_NETWORK_INTERFACE", "") or env.get("HOROVOD_GLOO_IFACE", "")
    if iface:
        return netaddr.interface_address(iface)
    for host in toward:
        addr = netaddr.route_source(host)
        if not netaddr.is_loopback(addr):
            return addr
    if any(not _literal_loopback(h) for h in toward):
        return netaddr.default_source() or "127.0.0.1"
    return "127.0.0.1"


def _host_of(address: str) -> str:
    """``tcp://host:port`` -> ``host`` (brackets of an IPv6 literal removed)."""
    hostport = address.partition("://")[2] or address
    return hostport.rpartition(":")[0].strip("[]")


def _derived_secret(env: Mapping[str, str], seed: str, master: str, source: str) -> bytes:
    """The job's secret when no launcher hands one out: ``RINGCOMM_SECRET``, or one derived from ``seed``.

    A derived secret is made of facts every rank can compute, and so can anyone else who
    sees the job (its address, port and size): fine for a job confined to loopback, not for
    one that listens on the network.  There a stranger could compute it and take a rank's
    place, so such a job needs ``RINGCOMM_SECRET`` (or ``RINGCOMM_INSECURE=1``, logged).
    """
    if "RINGCOMM_SECRET" in env:
        try:
            return bytes.fromhex(env["RINGCOMM_SECRET"])
        except ValueError:
            raise InvalidInputError("RINGCOMM_SECRET must be hex") from None
    if not _literal_loopback(master):
        if env.get("RINGCOMM_INSECURE", "").strip().lower() not in ("1", "true", "yes", "on"):
            raise InvalidInputError(
                f"this job ({source}) listens on the network (its rendezvous is at {master}), but has no "
                "RINGCOMM_SECRET: a secret derived from the job's address, port and size could be computed by "
                "anyone who can reach it, and a stranger could join the job. Export the same random secret on "
                "every rank, e.g. RINGCOMM_SECRET=$(python -c 'import secrets; print(secrets.token_hex(16))') "
                "in the job script before the launcher, or set RINGCOMM_INSECURE=1 to accept the risk on a "
                "trusted network.")
        log.warning("RINGCOMM_INSECURE=1: the job's secret is derived from its address, port and size (%s, "
                    "rendezvous at %s); anyone who can reach the job can compute it", source, master)
    return hashlib.sha256(seed.encode()).digest()


def _rendezvous_at(master: str, port: int, rank: int) -> dict[str, object]:
    if not 0 < port < 65536:
        raise InvalidInputError(f"rendezvous port {port} is out of range (1..65535)")
    bracketed = f"[{master}]" if ":" in master else master
    return {
        "rendezvous": f"tcp://{bracketed}:{port}",
        "host_rendezvous": rank == 0,
        "rendezvous_bind": "127.0.0.1" if _literal_loopback(master) else "0.0.0.0",
    }


def _from_ringcomm_run(env: Mapping[str, str], hostname: str) -> Topology:
    rank, size = _int(env, "RINGCOMM_RANK"), _int(env, "RINGCOMM_SIZE")
    local_rank = _int(env, "RINGCOMM_LOCAL_RANK", rank)
    local_size = _int(env, "RINGCOMM_LOCAL_SIZE", size)
    _check(rank, size, local_rank, local_size, "RINGCOMM_RANK/RINGCOMM_SIZE")
    addr = env.get("RINGCOMM_RENDEZVOUS_ADDR", "")
    if size > 1 and not addr:
        raise InvalidInputError("RINGCOMM_RENDEZVOUS_ADDR is not set; start the job with ringcomm-run")
    secret_hex = env.get("RINGCOMM_SECRET", "")
    try:
        secret = bytes.fromhex(secret_hex)
    except ValueError:
        raise InvalidInputError("RINGCOMM_SECRET must be hex") from None
    return Topology(
        rank, size, local_rank, local_size,
        _int(env, "RINGCOMM_CROSS_RANK", 0), _int(env, "RINGCOMM_CROSS_SIZE", 1),
        rendezvous=addr, secret=secret, job_id=env.get("RINGCOMM_JOB_ID", "") or secrets.token_hex(4),
        hostname=hostname, source="ringcomm-run",
        addr=pick_address(env, [_host_of(addr)]) if size > 1 else "127.0.0.1",
    )


#: Linux's default ephemeral range starts here: any outgoing connection or bind to port 0 may hold a port above.
_EPHEMERAL_FROM = 32768


def torchrun_port(master: str, master_port: int, run_id: str) -> int:
    """Rank 0's rendezvous port under torchrun: ``MASTER_PORT + 1``, out of the ephemeral range.

    torchrun's store holds ``MASTER_PORT``.  ``--standalone`` picks it among the ephemeral ports,
    where the next one is often taken by some connection: then the port is derived instead from
    the master address, port and run id (in 20000-31999, like Slurm's), alike on every rank.
    """
    if master_port + 1 < _EPHEMERAL_FROM:
        return master_port + 1
    return mpi_env.derived_port(f"torchrun:{master}:{master_port}:{run_id}")


def _from_torchrun(env: Mapping[str, str], hostname: str) -> Topology:
    src = "torchrun (RANK/WORLD_SIZE)"
    rank, size = _int(env, "RANK", src=src), _int(env, "WORLD_SIZE", src=src)
    local_rank = _int(env, "LOCAL_RANK", rank)
    local_size = _int(env, "LOCAL_WORLD_SIZE", size)
    _check(rank, size, local_rank, local_size, "RANK/WORLD_SIZE (torchrun)")
    master = env.get("MASTER_ADDR", "127.0.0.1")
    port = _int(env, "RINGCOMM_RENDEZVOUS_PORT", torchrun_port(
        master, _int(env, "MASTER_PORT", 29500, src), env.get("TORCHELASTIC_RUN_ID", "")))
    if local_size == size and "RINGCOMM_MASTER_ADDR" not in env:
        master = "127.0.0.1"  # every rank on this host (torchrun --standalone, one node): stay on loopback
    secret = _derived_secret(env, f"{master}:{port}:{size}:{env.get('TORCHELASTIC_RUN_ID', '')}", master, "torchrun")
    cross_size = max(1, -(-size // max(local_size, 1)))
    cross_rank = _int(env, "GROUP_RANK", rank // max(local_size, 1))
    where = _rendezvous_at(master, port, rank)
    return Topology(
        rank, size, local_rank, local_size, cross_rank, cross_size,
        # names of sockets and shared memory carry the job id; with the rendezvous address in it, two
        # jobs on one host that share a RINGCOMM_SECRET still get different names
        secret=secret, job_id=hashlib.sha256(secret + f"{master}:{port}".encode()).hexdigest()[:8],
        hostname=hostname, source="torchrun",
        addr=pick_address(env, [master]), **where,  # type: ignore[arg-type]
    )


def _from_mpi(env: Mapping[str, str], hostname: str, prefix: str) -> Topology:
    if prefix == "OMPI":
        src = "Open MPI's mpirun"
        keys = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE")
    else:
        src = "a PMI launcher (mpirun/mpiexec)"
        keys = ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
    rank, size = _int(env, keys[0], src=src), _int(env, keys[1], src=src)
    derive: tuple[str, ...] = ("cross_rank", "cross_size")
    if keys[2] in env:
        local_rank, local_size = _int(env, keys[2], src=src), _int(env, keys[3], src=src)
    else:
        local_rank, local_size, derive = 0, 1, PLACEMENT_FIELDS
    _check(rank, size, local_rank, local_size, f"{keys[0]}/{keys[1]} ({src})")
    control = "" if prefix == "OMPI" else mpi_env.hydra_control_port(os.getpid())
    where_from = mpi_env.plan(env, prefix, local_size if keys[2] in env else None, size, control)
    master, port = where_from.master, where_from.port
    told = mpi_env.rank0_address_from_mpi4py(rank, size, pick_address(env, [master]), prefix) if (
        where_from.check_on_rank0) else None
    if told:
        master = told
    elif where_from.check_on_rank0 and rank == 0 and not _is_mine(master):
        mine = [a for a in {netaddr.default_source() or ""} if a]
        raise InvalidInputError(mpi_env.rank0_elsewhere_message(where_from, mine, hostname))
    jobid = env.get("OMPI_MCA_ess_base_jobid", "") or env.get("PMI_ID", "") or where_from.job
    secret = _derived_secret(env, f"mpi:{master}:{port}:{size}:{jobid}", master, src)
    where = _rendezvous_at(master, port, rank)
    return Topology(
        rank, size, local_rank, local_size, 0, 1,
        secret=secret, job_id=hashlib.sha256(secret + f"{master}:{port}".encode()).hexdigest()[:8],
        hostname=hostname, source=src,
        addr=pick_address(env, [master]), derive=derive, **where,  # type: ignore[arg-type]
    )


def _is_mine(host: str) -> bool:
    """True if ``host`` names an address of this machine (the kernel sends to it from itself)."""
    try:
        addr = netaddr.resolve(host)
        return netaddr.is_loopback(addr) or netaddr.route_source(addr) == addr
    except (OSError, InvalidInputError):
        return False


def slurm_port(job_id: int, step_id: int) -> int:
    """The rendezvous port every task of Slurm step ``job_id.step_id`` derives alike."""
    return mpi_env.derived_port(f"{job_id}.{step_id}")  # below Linux's ephemeral range


def _from_slurm(env: Mapping[str, str], hostname: str) -> Topology:
    src = "Slurm (srun)"
    rank = _int(env, "SLURM_PROCID", src=src)
    size = _int(env, "SLURM_STEP_NUM_TASKS", _int(env, "SLURM_NTASKS", src=src))
    local_rank = _int(env, "SLURM_LOCALID", src=src)
    node_key = "SLURM_STEP_NODELIST" if "SLURM_STEP_NODELIST" in env else "SLURM_NODELIST"
    if node_key not in env:
        raise InvalidInputError(f"SLURM_NODELIST is not set; the environment from {src} is incomplete")
    nodes = _hosts.expand_nodelist(env[node_key])
    node_id = _int(env, "SLURM_NODEID", src=src)
    if not 0 <= node_id < len(nodes):
        raise InvalidInputError(f"SLURM_NODEID={node_id} but {node_key}={env[node_key]!r} lists {len(nodes)} nodes")
    tasks_key = "SLURM_STEP_TASKS_PER_NODE" if "SLURM_STEP_TASKS_PER_NODE" in env else "SLURM_TASKS_PER_NODE"
    if tasks_key in env:
        per_node = _hosts.expand_tasks_per_node(env[tasks_key])
        if len(per_node) < len(nodes):
            raise InvalidInputError(f"{tasks_key}={env[tasks_key]!r} covers {len(per_node)} of {len(nodes)} nodes")
        local_size = per_node[node_id]
    else:
        raise InvalidInputError(f"SLURM_TASKS_PER_NODE is not set; the environment from {src} is incomplete")
    _check(rank, size, local_rank, local_size, f"SLURM_PROCID/SLURM_NTASKS ({src})")
    job, step = _int(env, "SLURM_JOB_ID", src=src), _int(env, "SLURM_STEP_ID", src=src)
    master = env.get("RINGCOMM_MASTER_ADDR") or env.get("MASTER_ADDR") or (
        "127.0.0.1" if len(nodes) == 1 else nodes[0])  # one node: the job stays on loopback
    if "RINGCOMM_RENDEZVOUS_PORT" in env:
        port = _int(env, "RINGCOMM_RENDEZVOUS_PORT")
    else:
        port = _int(env, "MASTER_PORT", slurm_port(job, step))
    secret = _derived_secret(env, f"slurm:{job}.{step}:{master}:{port}:{size}", master, src)
    others = [n for n in nodes if n != nodes[node_id]]
    toward = [master] if nodes[node_id] != master else [master, *others[:1]]
    where = _rendezvous_at(master, port, rank)
    return Topology(
        rank, size, local_rank, local_size, node_id, len(nodes),
        secret=secret, job_id=hashlib.sha256(secret + f"{master}:{port}".encode()).hexdigest()[:8],
        hostname=nodes[node_id], source=src,
        addr=pick_address(env, toward), **where,  # type: ignore[arg-type]
    )


def _srun_own_pmi(env: Mapping[str, str]) -> bool:
    """True when ``PMI_*`` were set by ``srun --mpi=pmi2`` itself, not by a PMI launcher run inside a step."""
    if "PMI_JOBID" in env:  # srun's PMI-2 plugin: "JOB.STEP"
        return env["PMI_JOBID"] == f"{env.get('SLURM_JOB_ID')}.{env.get('SLURM_STEP_ID')}"
    slurm_size = env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS"))
    return env.get("PMI_RANK") == env.get("SLURM_PROCID") and env.get("PMI_SIZE") == slurm_size


def source_of(env: Mapping[str, str]) -> str:
    """Which launcher's variables describe this process (pure: reads ``env`` only).

    One of ``"elastic"``, ``"ringcomm-run"``, ``"torchrun"``, ``"OMPI"``, ``"PMI"``, ``"slurm"``,
    ``"single"``.  A launcher started inside another's job wins over the outer one: ``mpirun``,
    ``mpiexec`` or torchrun inside a Slurm step also see ``SLURM_*``.  ``srun --mpi=pmi2`` sets
    ``PMI_RANK`` itself, agreeing with ``SLURM_PROCID`` (and ``PMI_JOBID`` = ``JOB.STEP``): Slurm's
    complete description wins then; a hydra ``mpiexec`` whose proxies srun started does not agree.
    """
    if env.get("RINGCOMM_ELASTIC_WORKER"):
        return "elastic"
    if "RINGCOMM_RANK" in env or "RINGCOMM_SIZE" in env:
        return "ringcomm-run"
    if "RANK" in env and "WORLD_SIZE" in env:
        return "torchrun"
    if "OMPI_COMM_WORLD_RANK" in env:
        return "OMPI"
    slurm_step = "SLURM_PROCID" in env and "SLURM_STEP_ID" in env
    if "PMI_RANK" in env and not (slurm_step and _srun_own_pmi(env)):
        return "PMI"
    return "slurm" if slurm_step else "single"


def hostname_of(env: Mapping[str, str]) -> str:
    """This host's name: ``RINGCOMM_HOSTNAME`` (the launcher's name for it), else the system's."""
    return env.get("RINGCOMM_HOSTNAME") or socket.gethostname()


def from_env(environ: Mapping[str, str] | None = None) -> Topology:
    """Read the topology from the environment alone; raises InvalidInputError for an inconsistent one.

    An elastic worker's place is not in its environment: the driver hands it out over the network
    (:func:`ringcomm.elastic.worker.topology_from_env`, which ``init()`` calls for such a process).
    """
    env = os.environ if environ is None else environ
    hostname = hostname_of(env)
    source = source_of(env)
    if source == "elastic":
        raise InvalidInputError(
            f"RINGCOMM_ELASTIC_WORKER={env.get('RINGCOMM_ELASTIC_WORKER')} is set: this process is an elastic "
            "worker, whose rank comes from ringcomm-run's driver, not from the environment; read it with "
            "ringcomm.elastic.worker.topology_from_env() (init() does), or unset the variable")
    if source == "ringcomm-run":
        return _from_ringcomm_run(env, hostname)
    if source == "torchrun":
        return _from_torchrun(env, hostname)
    if source in ("OMPI", "PMI"):
        return _from_mpi(env, hostname, source)
    if source == "slurm":
        topo = _from_slurm(env, hostname)
        return dataclasses.replace(topo, hostname=env.get("RINGCOMM_HOSTNAME") or topo.hostname)
    return Topology(hostname=hostname, job_id=secrets.token_hex(4), secret=secrets.token_bytes(16))


def with_placement(topo: Topology, hosts: Sequence[str]) -> Topology:
    """``topo`` with the fields in ``topo.derive`` worked out from every rank's host (rank order)."""
    if not topo.derive:
        return topo
    mine = _hosts.place_by_host(list(hosts))[topo.rank]
    return dataclasses.replace(topo, derive=(), **{f: getattr(mine, f) for f in topo.derive})
