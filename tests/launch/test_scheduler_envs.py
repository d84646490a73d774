"""Jobs started without ringcomm-run: processes get the variables Slurm's srun, Open MPI's mpirun or a PMI
launcher (MPICH / Intel MPI) would set, and must find each other and compute correct results."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from conftest import WORKERS, job_env
from ringcomm.job import topology

pytestmark = pytest.mark.multiprocess

WORKER = str(WORKERS / "placement_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(envs: list[dict[str, str]], timeout: float = 60) -> list[dict]:
    """Start one worker per environment (all at once), wait for all; returns each rank's PLACE record."""
    procs = [subprocess.Popen([sys.executable, WORKER], env=job_env(**env), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for env in envs]
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    places = []
    for i, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"process {i}:\n{out}"
        assert all(f"CASE {c} OK" in out for c in range(8)), out
        places.append(json.loads(out.split("PLACE ", 1)[1].splitlines()[0]))
    return sorted(places, key=lambda p: p["rank"])


def _slurm_job_with_a_free_derived_port() -> int:
    for job in range(7000, 7100):
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", topology.slurm_port(job, 0)))
            return job
        except OSError:
            continue
    raise AssertionError("no Slurm job id in 7000..7099 derives a free port")


@pytest.mark.timeout(90)
def test_srun_two_nodes_two_tasks_each() -> None:
    """srun -N 2 -n 4: the nodes are 'localhost' and '127.0.0.1' -- two names, so the ranks of different
    nodes talk over tcp as on two machines; the port is derived from the job and step ids."""
    job = _slurm_job_with_a_free_derived_port()
    envs = [
        {"SLURM_PROCID": str(r), "SLURM_LOCALID": str(r % 2), "SLURM_NODEID": str(r // 2), "SLURM_NTASKS": "4",
         "SLURM_JOB_ID": str(job), "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "localhost,127.0.0.1",
         "SLURM_NODELIST": "localhost,127.0.0.1,other[1-3]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
         "SLURM_TASKS_PER_NODE": "2(x2),4(x3)"}
        for r in range(4)
    ]
    places = run_ranks(envs)
    assert [(p["local_rank"], p["local_size"], p["cross_rank"], p["cross_size"]) for p in places] == [
        (0, 2, 0, 2), (1, 2, 0, 2), (0, 2, 1, 2), (1, 2, 1, 2)]
    assert [p["host"] for p in places] == ["localhost", "localhost", "127.0.0.1", "127.0.0.1"]
    assert {p["source"] for p in places} == {"Slurm (srun)"}
    # the ring sends to rank + 1: ranks 1 and 3 send to the other node (inline, tcp), 0 and 2 on their node
    assert places[1]["stats"].get("inline", 0) > 0 and places[3]["stats"].get("inline", 0) > 0
    assert places[0]["stats"].get("shm", 0) > 0 and places[2]["stats"].get("shm", 0) > 0


@pytest.mark.timeout(90)
def test_open_mpi_mpirun_environment() -> None:
    """mpirun -np 4 -x RINGCOMM_MASTER_ADDR=127.0.0.1 -x RINGCOMM_RENDEZVOUS_PORT=P python worker.py"""
    port = str(free_port())
    envs = [{"OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": str(r),
             "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "RINGCOMM_MASTER_ADDR": "127.0.0.1",
             "RINGCOMM_RENDEZVOUS_PORT": port} for r in range(4)]
    places = run_ranks(envs)
    assert [(p["local_rank"], p["cross_rank"], p["cross_size"]) for p in places] == [
        (0, 0, 1), (1, 0, 1), (2, 0, 1), (3, 0, 1)]  # the host index came from the rendezvous
    assert {p["source"] for p in places} == {"Open MPI's mpirun"}


@pytest.mark.timeout(90)
def test_pmi_launcher_environment_places_ranks_by_host() -> None:
    """mpiexec (hydra) sets PMI_RANK/PMI_SIZE; two hosts named by RINGCOMM_HOSTNAME, ranks interleaved."""
    port = str(free_port())
    hosts = ["hostA", "hostB", "hostA", "hostB"]
    # one flat ring (the hierarchical allreduce, on for 2 x 2 jobs, would pair same-host ranks on purpose)
    envs = [{"PMI_RANK": str(r), "PMI_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
             "RINGCOMM_HOSTNAME": hosts[r], "RINGCOMM_HIERARCHICAL_ALLREDUCE": "0"} for r in range(4)]
    places = run_ranks(envs)
    assert [(p["local_rank"], p["local_size"], p["cross_rank"], p["cross_size"]) for p in places] == [
        (0, 2, 0, 2), (0, 2, 1, 2), (1, 2, 0, 2), (1, 2, 1, 2)]
    assert all(p["stats"].get("inline", 0) > 0 and not p["stats"].get("shm") for p in places)  # no neighbours


@pytest.mark.timeout(60)
def test_an_incomplete_mpi_environment_fails_init_naming_the_variable() -> None:
    env = job_env(OMPI_COMM_WORLD_RANK="1", OMPI_COMM_WORLD_SIZE="2")
    out = subprocess.run([sys.executable, "-c", "import ringcomm as rc; rc.init()"], env=env, capture_output=True,
                         text=True, timeout=50)
    assert out.returncode == 1
    assert "RINGCOMM_MASTER_ADDR is not set: started by Open MPI's mpirun" in out.stderr
