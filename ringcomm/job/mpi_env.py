"""Where rank 0's rendezvous is when Open MPI's ``mpirun`` or a hydra ``mpiexec`` started the job.

Neither launcher tells a rank its rank 0's address, but each says enough:

* every rank on one host (Open MPI: ``OMPI_COMM_WORLD_LOCAL_SIZE`` equals the
  world size, or ``OMPI_MCA_orte_num_nodes`` is 1; hydra: ``MPI_LOCALNRANKS``
  equals ``PMI_SIZE``): the rendezvous is on 127.0.0.1;
* across hosts: on the launcher's host -- Open MPI's ``mpirun`` publishes its
  own address in ``OMPI_MCA_orte_hnp_uri``; hydra's proxies are started with
  ``--control-port HOST:PORT`` naming ``mpiexec``'s host.  With the usual
  mapping (ranks placed host by host, ``mpirun`` started on the first host of
  the allocation) rank 0 runs there; rank 0 checks it and says what to set
  when it does not.  When mpi4py is importable and runs the launcher's MPI
  (its world has this job's size), rank 0 tells every rank its address
  through MPI instead (:func:`rank0_address_from_mpi4py`): no guess.

The port is derived from the launcher's job id (the same on every rank, new
for every ``mpirun``), in the range Slurm jobs use.  ``RINGCOMM_MASTER_ADDR``
/ ``MASTER_ADDR`` and ``RINGCOMM_RENDEZVOUS_PORT`` / ``MASTER_PORT`` always win.

:func:`plan` is pure (the environment and the launcher facts in, a decision
out); :func:`hydra_control_port` is the one read of the process tree.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping

from ..errors import InvalidInputError

#: Ports derived from a job id fall in [PORT_BASE, PORT_BASE + PORT_SPAN): below Linux's ephemeral range.
PORT_BASE, PORT_SPAN = 20000, 12000
_FIX = (
    "set RINGCOMM_MASTER_ADDR to rank 0's host and RINGCOMM_RENDEZVOUS_PORT to a free port there on every "
    "rank (mpirun -x RINGCOMM_MASTER_ADDR=node01 -x RINGCOMM_RENDEZVOUS_PORT=29400; "
    "mpiexec -genv RINGCOMM_MASTER_ADDR node01 -genv RINGCOMM_RENDEZVOUS_PORT 29400)"
)


def derived_port(seed: str) -> int:
    """A port every rank computes alike from ``seed`` (a job id)."""
    digest = hashlib.sha256(seed.encode()).digest()
    return PORT_BASE + int.from_bytes(digest[:4], "big") % PORT_SPAN


@dataclasses.dataclass(frozen=True)
class Plan:
    master: str  # rank 0's host (an address or a name)
    port: int
    job: str  # the launcher's job id ("" when the user gave both address and port)
    #: True when rank 0 must check that ``master`` is one of its own addresses (a guess from the launcher's host)
    check_on_rank0: bool
    why: str  # how the address was found, for DEBUG logs and error messages


def hnp_host(uri: str) -> str:
    """The first IPv4 address in Open MPI's ``OMPI_MCA_orte_hnp_uri`` (``JOB.0;tcp://A,B:PORT;tcp6://...``)."""
    for part in uri.split(";")[1:]:
        if part.startswith("tcp://"):
            return part[len("tcp://"):].rpartition(":")[0].split(",")[0]
    return ""


def _given_port(env: Mapping[str, str]) -> int | None:
    for key in ("RINGCOMM_RENDEZVOUS_PORT", "MASTER_PORT"):
        if key in env:
            try:
                return int(env[key])
            except ValueError:
                raise InvalidInputError(f"{key}={env[key]!r} is not an integer") from None
    return None


def plan(env: Mapping[str, str], flavour: str, local_size: int | None, size: int, hydra_control: str = "") -> Plan:
    """Rank 0's rendezvous address for an MPI-started job.

    ``flavour``: ``"OMPI"`` or ``"PMI"``; ``local_size``: the ranks on this host
    when the launcher says (None: it does not); ``hydra_control``: the
    ``HOST:PORT`` hydra's proxy was started with ("" when not under hydra).
    Raises :class:`InvalidInputError` naming what to set when nothing tells.
    """
    src = "Open MPI's mpirun" if flavour == "OMPI" else "a PMI launcher (mpirun/mpiexec)"
    if flavour == "OMPI":
        job = env.get("OMPI_MCA_ess_base_jobid", "") or env.get("PMIX_NAMESPACE", "")
        all_local = local_size == size or env.get("OMPI_MCA_orte_num_nodes") == "1"
        launcher_host, fact = hnp_host(env.get("OMPI_MCA_orte_hnp_uri", "")), "OMPI_MCA_orte_hnp_uri"
    else:
        job = hydra_control or env.get("PMI_PORT", "") or env.get("PMI_JOBID", "")
        all_local = local_size == size
        launcher_host, fact = hydra_control.rpartition(":")[0], "hydra's --control-port"
    master = env.get("RINGCOMM_MASTER_ADDR") or env.get("MASTER_ADDR") or ""
    port = _given_port(env)
    if master and port is not None:
        return Plan(master, port, "", False, "RINGCOMM_MASTER_ADDR/MASTER_ADDR and the port as given")
    if port is None and not job:
        what = "RINGCOMM_RENDEZVOUS_PORT" if master else "RINGCOMM_MASTER_ADDR"
        raise InvalidInputError(
            f"{what} is not set: started by {src}, which gives no job id to derive the rendezvous from; {_FIX}"
        )
    port = derived_port(f"mpi:{job}") if port is None else port
    if master:
        return Plan(master, port, job, False, "RINGCOMM_MASTER_ADDR/MASTER_ADDR as given")
    if all_local:
        return Plan("127.0.0.1", port, job, False, "every rank is on this host")
    if not launcher_host:
        raise InvalidInputError(
            f"RINGCOMM_MASTER_ADDR is not set: started by {src} across hosts, and {fact} does not say where "
            f"the launcher runs; {_FIX}"
        )
    return Plan(launcher_host, port, job, True, f"from {fact}")


def rank0_elsewhere_message(p: Plan, my_addresses: list[str], hostname: str) -> str:
    return (
        f"rank 0 runs on {hostname} ({', '.join(my_addresses) or 'no address'}) but the launcher runs on "
        f"{p.master} ({p.why}), where the other ranks look for the rendezvous: start mpirun/mpiexec on rank 0's "
        f"host, or {_FIX}"
    )


def hydra_control_port(pid: int, proc: str = "/proc", depth: int = 8) -> str:
    """``HOST:PORT`` from the ``--control-port`` of the nearest ancestor started with one (hydra's proxy)."""
    for _ in range(depth):
        try:
            with open(f"{proc}/{pid}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
            pid = int(stat.rpartition(")")[2].split()[1])  # the field after the state is the parent pid
            with open(f"{proc}/{pid}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except (OSError, ValueError, IndexError):
            return ""
        if "--control-port" in argv:
            i = argv.index("--control-port")
            return argv[i + 1] if i + 1 < len(argv) else ""
        if pid <= 1:
            return ""
    return ""


def library_matches(launcher: str, library_version: str) -> bool:
    """Whether an MPI library (``MPI_Get_library_version``) belongs to a launcher family.

    ``launcher`` is ``"OMPI"`` (Open MPI's ``mpirun``) or ``"PMI"`` (a hydra
    ``mpiexec``: MPICH, Intel MPI, MVAPICH).  An Open MPI library under hydra
    would start as a singleton, and several singletons at once race on Open
    MPI's session directory, so the pairing is checked before ``MPI_Init``.
    """
    is_open_mpi = "Open MPI" in library_version
    return is_open_mpi if launcher == "OMPI" else not is_open_mpi


def rank0_address_from_mpi4py(rank: int, size: int, mine: str, launcher: str) -> str | None:
    """Rank 0's ``mine``, broadcast by MPI itself; None when mpi4py is absent or runs another MPI.

    Collective: every rank of the job calls it (they all took the same decision to).
    MPI is initialised only when mpi4py's library matches the ``launcher``
    family (:func:`library_matches`); mpi4py then finalises it at exit.
    """
    import importlib.util

    if importlib.util.find_spec("mpi4py") is None:
        return None
    try:
        import mpi4py

        initialize, finalize = mpi4py.rc.initialize, mpi4py.rc.finalize
        mpi4py.rc.initialize = False
        try:
            from mpi4py import MPI
        finally:
            mpi4py.rc.initialize = initialize
        if not MPI.Is_initialized():
            if not library_matches(launcher, MPI.Get_library_version()):
                return None
            MPI.Init()
            if finalize is not False:  # what mpi4py would have done had it initialised MPI itself
                import atexit

                def finalize_at_exit() -> None:
                    if not MPI.Is_finalized():
                        MPI.Finalize()

                atexit.register(finalize_at_exit)
    except Exception:  # noqa: BLE001 - a broken or mismatched MPI library: fall back to the launcher's facts
        return None
    comm = MPI.COMM_WORLD
    if comm.Get_size() != size or comm.Get_rank() != rank:  # another MPI's mpi4py: a world of one
        return None
    return str(comm.bcast(mine if rank == 0 else None, root=0))
