"""Real MPI launchers: Open MPI's mpirun and MPICH's mpiexec (hydra) start ringcomm jobs with no extra variables.

Debian installs both side by side: ``mpirun.openmpi`` (openmpi-bin) and ``mpiexec.mpich`` (mpich).
"""

from __future__ import annotations

import os
import socket

import pytest

from _tools import PYTHON, WORKER, assert_job_ok, env, need, results, run

pytestmark = [pytest.mark.multiprocess, pytest.mark.realtools]


def openmpi_env() -> dict[str, str]:
    # Open MPI refuses to start as root unless told twice
    extra = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"} if os.geteuid() == 0 else {}
    return env(**extra)


def mpirun(np_: int, *args: str) -> list[str]:
    return [need("mpirun.openmpi", "openmpi-bin"), "--oversubscribe", "-np", str(np_), PYTHON, WORKER, *args]


def mpiexec(np_: int, *args: str) -> list[str]:
    return [need("mpiexec.mpich", "mpich"), "-n", str(np_), PYTHON, WORKER, *args]


@pytest.mark.timeout(90)
def test_open_mpi_mpirun_on_one_host() -> None:
    proc = run(mpirun(3), timeout=60, env=openmpi_env())
    assert_job_ok(proc, 3, "OMPI")
    assert results(proc.stdout)[0]["rendezvous"].startswith("tcp://127.0.0.1:")


@pytest.mark.timeout(90)
def test_mpich_mpiexec_on_one_host() -> None:
    proc = run(mpiexec(3), timeout=60, env=env())
    assert_job_ok(proc, 3, "PMI")
    assert results(proc.stdout)[0]["rendezvous"].startswith("tcp://127.0.0.1:")


@pytest.mark.timeout(90)
def test_two_open_mpi_jobs_at_once_get_their_own_rendezvous() -> None:
    """The port comes from each mpirun's job id: two jobs side by side do not meet."""
    import subprocess

    procs = [subprocess.Popen(mpirun(2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=openmpi_env())
             for _ in range(2)]
    outs = [p.communicate(timeout=60) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert_job_ok(subprocess.CompletedProcess(p.args, p.returncode, out, err), 2, "OMPI")


@pytest.mark.timeout(90)
def test_a_killed_rank_under_mpirun_is_named() -> None:
    proc = run(mpirun(3, "--die-rank", "1"), timeout=60, env=openmpi_env())
    both = proc.stdout + proc.stderr
    assert proc.returncode != 0, both
    assert "lost rank 1" in both or "process rank 1 with PID" in both, both


@pytest.mark.timeout(90)
def test_a_killed_rank_under_mpiexec_stops_the_job() -> None:
    """hydra kills the other ranks with SIGKILL at once (they cannot say a word) and reports the signal."""
    proc = run(mpiexec(3, "--die-rank", "1"), timeout=60, env=env())
    both = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "BAD TERMINATION" in both and "Killed (signal 9)" in both, both


@pytest.mark.timeout(60)
def test_a_taken_rendezvous_port_names_the_variable() -> None:
    """RINGCOMM_RENDEZVOUS_PORT names a port another process holds: rank 0 says which variable to change."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = run(mpiexec(2), timeout=50, env=env(RINGCOMM_RENDEZVOUS_PORT=str(port), RINGCOMM_START_TIMEOUT="4"))
    assert proc.returncode != 0
    assert "Address already in use" in proc.stderr and "set RINGCOMM_RENDEZVOUS_PORT to a free port" in proc.stderr, (
        proc.stderr)


#: A job whose ranks meet beyond loopback needs its own secret (one derived from the job's facts could be
#: computed by anyone who can reach it): as a user's multi-host job script exports it.
ACROSS_HOSTS = {"RINGCOMM_SECRET": "c0ffee" * 6}


# Ranks told they are each on a host of their own (the local-size variables overridden in a shell
# around the worker) take the across-hosts path: the rendezvous is on the launcher's host, found in
# its own variables (mpirun's OMPI_MCA_orte_hnp_uri, hydra's --control-port), here this machine.
@pytest.mark.timeout(90)
def test_open_mpi_ranks_on_separate_hosts_meet_at_mpiruns_host() -> None:
    script = ("OMPI_COMM_WORLD_LOCAL_SIZE=1 OMPI_COMM_WORLD_LOCAL_RANK=0 OMPI_MCA_orte_num_nodes=3 "
              f"{PYTHON} {WORKER}")
    cmd = [need("mpirun.openmpi", "openmpi-bin"), "--oversubscribe", "-np", "3", "sh", "-c", script]
    proc = run(cmd, timeout=60, env={**openmpi_env(), **ACROSS_HOSTS})
    assert_job_ok(proc, 3, "OMPI")
    recs = results(proc.stdout)
    assert {r["local_size"] for r in recs} == {1}
    assert len({r["rendezvous"] for r in recs}) == 1 and "127.0.0.1" not in recs[0]["rendezvous"], recs


@pytest.mark.timeout(90)
def test_mpich_ranks_on_separate_hosts_meet_at_mpiexecs_host() -> None:
    script = f"MPI_LOCALNRANKS=1 MPI_LOCALRANKID=0 {PYTHON} {WORKER}"
    proc = run([need("mpiexec.mpich", "mpich"), "-n", "3", "sh", "-c", script], timeout=60,
               env={**env(), **ACROSS_HOSTS})
    assert_job_ok(proc, 3, "PMI")
    recs = results(proc.stdout)
    assert {r["local_size"] for r in recs} == {1}
    assert len({r["rendezvous"] for r in recs}) == 1 and "127.0.0.1" not in recs[0]["rendezvous"], recs


@pytest.mark.timeout(90)
def test_with_mpi4py_rank_0_tells_its_address_through_mpi() -> None:
    """mpirun's own host is wrong here (a made-up hnp uri): mpi4py's broadcast of rank 0's address wins."""
    pytest.importorskip("mpi4py", reason="mpi4py is not installed (pip install mpi4py)")
    which = run([PYTHON, "-c", "from mpi4py import MPI; print(MPI.Get_library_version())"], timeout=30,
                env=openmpi_env())
    if "Open MPI" not in which.stdout:
        pytest.skip(f"mpi4py here does not load Open MPI's library: {(which.stdout + which.stderr)[-200:]}")
    script = ("OMPI_COMM_WORLD_LOCAL_SIZE=1 OMPI_COMM_WORLD_LOCAL_RANK=0 OMPI_MCA_orte_num_nodes=3 "
              f"OMPI_MCA_orte_hnp_uri='1.0;tcp://10.255.255.1:1' {PYTHON} {WORKER}")
    cmd = [need("mpirun.openmpi", "openmpi-bin"), "--oversubscribe", "-np", "3", "sh", "-c", script]
    proc = run(cmd, timeout=60, env={**openmpi_env(), **ACROSS_HOSTS})
    assert_job_ok(proc, 3, "OMPI")
    assert "10.255.255.1" not in results(proc.stdout)[0]["rendezvous"]
