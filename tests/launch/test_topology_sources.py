"""Topology from the environments of Slurm, Open MPI, PMI launchers and torchrun (no processes started).

``RINGCOMM_NETWORK_INTERFACE=lo`` keeps the address choice off name
resolution, so made-up node names (node01, ...) need not resolve here.
"""

from __future__ import annotations

import pytest

from ringcomm.job import topology
from ringcomm.job.config import Settings
from ringcomm.errors import InvalidInputError

pytestmark = pytest.mark.pure

# jobs whose ranks meet beyond loopback need an explicit secret (a derived one could be computed by anyone)
LO = {"RINGCOMM_NETWORK_INTERFACE": "lo", "RINGCOMM_SECRET": "5e" * 16}


def slurm(procid: int, localid: int, nodeid: int, **extra: str) -> dict[str, str]:
    """What srun -N 3 -n 5 sets for one task (node01: 2 tasks, node02: 2, node07: 1)."""
    env = {
        "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(localid), "SLURM_NODEID": str(nodeid),
        "SLURM_NTASKS": "5", "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "3",
        "SLURM_NODELIST": "node[01-02,07]", "SLURM_TASKS_PER_NODE": "2(x2),1", **LO,
    }
    env.update(extra)
    return env


def test_slurm_task_knows_its_place_and_rank_0s_host() -> None:
    topo = topology.from_env(slurm(3, 1, 1))
    assert (topo.rank, topo.size, topo.local_rank, topo.local_size, topo.cross_rank, topo.cross_size) == (
        3, 5, 1, 2, 1, 3)
    assert topo.source == "Slurm (srun)" and topo.hostname == "node02" and topo.addr == "127.0.0.1"
    port = topology.slurm_port(4242, 3)
    assert topo.rendezvous == f"tcp://node01:{port}" and not topo.host_rendezvous
    last = topology.from_env(slurm(4, 0, 2))
    assert (last.local_rank, last.local_size, last.cross_rank) == (0, 1, 2)
    first = topology.from_env(slurm(0, 0, 0))
    assert first.host_rendezvous and first.rendezvous_bind == "0.0.0.0"
    assert first.secret == topo.secret == last.secret and first.job_id == topo.job_id


def test_slurm_port_is_derived_per_step_unless_given() -> None:
    ports = {topology.slurm_port(job, step) for job in range(100, 140) for step in range(3)}
    assert len(ports) > 100 and all(20000 <= p < 32000 for p in ports)
    assert topology.from_env(slurm(1, 1, 0, MASTER_PORT="29999")).rendezvous == "tcp://node01:29999"
    given = slurm(1, 1, 0, MASTER_PORT="29999", RINGCOMM_RENDEZVOUS_PORT="31000", RINGCOMM_MASTER_ADDR="10.1.1.1")
    assert topology.from_env(given).rendezvous == "tcp://10.1.1.1:31000"


def test_slurm_step_variables_win_over_the_allocations() -> None:
    env = slurm(0, 0, 0, SLURM_STEP_NODELIST="node07", SLURM_STEP_NUM_TASKS="1", SLURM_STEP_TASKS_PER_NODE="1")
    topo = topology.from_env(env)
    assert (topo.size, topo.local_size, topo.cross_size, topo.rendezvous.split(":")[1]) == (1, 1, 1, "//127.0.0.1")  # a one-node step


def test_a_batch_script_without_srun_is_a_single_process() -> None:
    env = slurm(0, 0, 0)
    del env["SLURM_STEP_ID"]
    assert topology.from_env(env).source == "single"


@pytest.mark.parametrize(
    "missing, message",
    [("SLURM_NTASKS", "SLURM_NTASKS is not set; the environment from Slurm"),
     ("SLURM_LOCALID", "SLURM_LOCALID is not set"),
     ("SLURM_NODEID", "SLURM_NODEID is not set"),
     ("SLURM_NODELIST", "SLURM_NODELIST is not set"),
     ("SLURM_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE is not set"),
     ("SLURM_JOB_ID", "SLURM_JOB_ID is not set")],
)
def test_incomplete_slurm_environment_names_the_variable(missing: str, message: str) -> None:
    env = slurm(1, 1, 0)
    del env[missing]
    with pytest.raises(ValueError, match=message):
        topology.from_env(env)


def test_inconsistent_slurm_environment() -> None:
    with pytest.raises(ValueError, match="SLURM_NODEID=5 but SLURM_NODELIST='node\\[01-02,07\\]' lists 3 nodes"):
        topology.from_env(slurm(1, 1, 5))
    with pytest.raises(ValueError, match="local rank .* is 2 with local size 2"):
        topology.from_env(slurm(1, 2, 0))
    with pytest.raises(ValueError, match="node list"):
        topology.from_env(slurm(1, 1, 0, SLURM_NODELIST="node[01-"))


def ompi(rank: int, size: int = 4, **extra: str) -> dict[str, str]:
    env = {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(size),
           "OMPI_COMM_WORLD_LOCAL_RANK": str(rank % 2), "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
           "RINGCOMM_MASTER_ADDR": "node01", "RINGCOMM_RENDEZVOUS_PORT": "29400", **LO}
    env.update(extra)
    return env


def test_open_mpi_ranks_learn_their_host_index_at_the_rendezvous() -> None:
    topo = topology.from_env(ompi(3))
    assert (topo.rank, topo.size, topo.local_rank, topo.local_size) == (3, 4, 1, 2)
    assert topo.source == "Open MPI's mpirun" and topo.rendezvous == "tcp://node01:29400"
    assert topo.derive == ("cross_rank", "cross_size")
    placed = topology.with_placement(topo, ["n1", "n1", "n2", "n2"])
    assert (placed.cross_rank, placed.cross_size, placed.local_rank, placed.derive) == (1, 2, 1, ())
    assert topology.from_env(ompi(0)).host_rendezvous


def test_pmi_ranks_learn_everything_but_rank_and_size_at_the_rendezvous() -> None:
    env = {"PMI_RANK": "2", "PMI_SIZE": "3", "MASTER_ADDR": "node01", "MASTER_PORT": "29400", **LO}
    topo = topology.from_env(env)
    assert (topo.rank, topo.size, topo.rendezvous) == (2, 3, "tcp://node01:29400")
    assert topo.derive == topology.PLACEMENT_FIELDS
    placed = topology.with_placement(topo, ["n1", "n2", "n1"])
    assert (placed.local_rank, placed.local_size, placed.cross_rank, placed.cross_size) == (1, 2, 0, 2)
    hydra = topology.from_env({**env, "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1"})
    assert (hydra.local_rank, hydra.local_size, hydra.derive) == (0, 1, ("cross_rank", "cross_size"))


@pytest.mark.parametrize(
    "env, message",
    [
        ({"OMPI_COMM_WORLD_RANK": "0", "RINGCOMM_MASTER_ADDR": "h", "RINGCOMM_RENDEZVOUS_PORT": "1"},
         "OMPI_COMM_WORLD_SIZE is not set; the environment from Open MPI"),
        ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "RINGCOMM_RENDEZVOUS_PORT": "1"},
         "RINGCOMM_MASTER_ADDR is not set: started by Open MPI's mpirun"),
        ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "MASTER_ADDR": "h"},
         "RINGCOMM_RENDEZVOUS_PORT is not set"),
        ({"PMI_RANK": "0", "RINGCOMM_MASTER_ADDR": "h", "RINGCOMM_RENDEZVOUS_PORT": "1"}, "PMI_SIZE is not set"),
        ({"PMI_RANK": "3", "PMI_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "rank from PMI_RANK/PMI_SIZE"),
        ({"PMI_RANK": "0", "PMI_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "70000", **LO},
         "port 70000 is out of range"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1",
          "RINGCOMM_NETWORK_INTERFACE": "nosuch0"}, "network interface 'nosuch0' does not exist"),
    ],
)
def test_incomplete_mpi_environment_names_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        topology.from_env(env)


def test_the_most_specific_launcher_wins() -> None:
    """mpirun and torchrun inside a Slurm allocation also see SLURM_*; ringcomm-run's variables beat all."""
    under_slurm = slurm(0, 0, 0)
    assert topology.from_env({**under_slurm, **ompi(1)}).source == "Open MPI's mpirun"
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert topology.from_env({**under_slurm, **ompi(1), **torchrun}).source == "torchrun"
    mine = {"RINGCOMM_RANK": "0", "RINGCOMM_SIZE": "1"}
    assert topology.from_env({**under_slurm, **torchrun, **mine}).source == "ringcomm-run"


def test_torchrun_group_rank_gives_the_host_index() -> None:
    env = {"RANK": "5", "WORLD_SIZE": "6", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    topo = topology.from_env(env)
    assert (topo.cross_rank, topo.cross_size, topo.addr, topo.rendezvous_bind) == (1, 2, "127.0.0.1", "127.0.0.1")


def test_job_variables_are_not_mistaken_for_unknown_settings() -> None:
    env = {"RINGCOMM_RENDEZVOUS_PORT": "29400", "RINGCOMM_MASTER_ADDR": "h", "RINGCOMM_NETWORK_INTERFACE": "lo"}
    assert Settings.from_env(env) == Settings()


# ---------------------------------------------------------------- which launcher, and where rank 0 is (pure)

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from ringcomm.job import mpi_env  # noqa: E402


def srun_pmi2(procid: int, ntasks: int, job: int = 77, step: int = 0) -> dict[str, str]:
    """What srun --mpi=pmi2 sets: SLURM_* and its own PMI_* (PMI_JOBID is JOB.STEP)."""
    env = slurm(procid, procid, 0, SLURM_NTASKS=str(ntasks), SLURM_JOB_ID=str(job), SLURM_STEP_ID=str(step),
                SLURM_NODELIST="node01", SLURM_TASKS_PER_NODE=str(ntasks))
    env.update({"PMI_RANK": str(procid), "PMI_SIZE": str(ntasks), "PMI_FD": "13", "PMI_JOBID": f"{job}.{step}"})
    return env


def test_srun_mpi_pmi2_is_a_slurm_job() -> None:
    topo = topology.from_env(srun_pmi2(1, 2))
    assert topo.source == "Slurm (srun)" and (topo.rank, topo.size) == (1, 2)
    assert topo.rendezvous == f"tcp://127.0.0.1:{topology.slurm_port(77, 0)}"  # one node: loopback
    without_jobid = srun_pmi2(1, 2)
    del without_jobid["PMI_JOBID"]  # PMI-1 plugins: rank and size agree with Slurm's
    assert topology.source_of(without_jobid) == "slurm"


def test_hydra_inside_a_slurm_step_is_a_pmi_job() -> None:
    """mpiexec in a batch script: hydra's proxies run as srun tasks (one per node), the ranks are hydra's."""
    env = slurm(0, 0, 0, SLURM_NTASKS="3")
    env.update({"PMI_RANK": "4", "PMI_SIZE": "6", "PMI_FD": "7"})
    assert topology.source_of(env) == "PMI"


launcher_vars = st.fixed_dictionaries(
    {},
    optional={
        "RINGCOMM_ELASTIC_WORKER": st.just("1"), "RINGCOMM_RANK": st.just("0"), "RANK": st.just("0"),
        "WORLD_SIZE": st.just("2"), "OMPI_COMM_WORLD_RANK": st.just("0"), "PMI_RANK": st.sampled_from(["0", "1"]),
        "PMI_SIZE": st.sampled_from(["2", "4"]), "PMI_JOBID": st.sampled_from(["5.0", "5.1", "kvs_1"]),
        "SLURM_PROCID": st.sampled_from(["0", "1"]), "SLURM_STEP_ID": st.sampled_from(["0", "1"]),
        "SLURM_JOB_ID": st.just("5"), "SLURM_NTASKS": st.sampled_from(["2", "4"]),
    },
)


@given(launcher_vars)
def test_source_of_follows_the_documented_order(env: dict[str, str]) -> None:
    got = topology.source_of(env)
    slurm_step = "SLURM_PROCID" in env and "SLURM_STEP_ID" in env
    if "RINGCOMM_ELASTIC_WORKER" in env:
        assert got == "elastic"
    elif "RINGCOMM_RANK" in env:
        assert got == "ringcomm-run"
    elif "RANK" in env and "WORLD_SIZE" in env:
        assert got == "torchrun"
    elif "OMPI_COMM_WORLD_RANK" in env:
        assert got == "OMPI"
    elif "PMI_RANK" in env:
        if not slurm_step:
            assert got == "PMI"
        elif "PMI_JOBID" in env:  # srun's own PMI-2 says JOB.STEP; anything else is a launcher in the step
            own = env["PMI_JOBID"] == f"{env.get('SLURM_JOB_ID')}.{env['SLURM_STEP_ID']}"
            assert got == ("slurm" if own else "PMI")
        else:
            agree = env["PMI_RANK"] == env["SLURM_PROCID"] and env.get("PMI_SIZE") == env.get("SLURM_NTASKS")
            assert got == ("slurm" if agree else "PMI")
    else:
        assert got == ("slurm" if slurm_step else "single")


def ompi_bare(rank: int, size: int, local_size: int, **extra: str) -> dict[str, str]:
    """What Open MPI 4.1's mpirun sets (no RINGCOMM_* variables)."""
    env = {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(size),
           "OMPI_COMM_WORLD_LOCAL_RANK": str(rank % local_size), "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size),
           "OMPI_MCA_ess_base_jobid": "1881276417", "OMPI_MCA_orte_num_nodes": str(-(-size // local_size)),
           "OMPI_MCA_orte_hnp_uri": "1881276416.0;tcp://10.0.0.5,192.0.2.2:39307;tcp6://[fd00::2]:48475", **LO}
    env.update(extra)
    return env


def test_mpirun_on_one_host_needs_no_variable() -> None:
    topos = [topology.from_env(ompi_bare(r, 3, 3)) for r in range(3)]
    port = mpi_env.derived_port("mpi:1881276417")
    assert {t.rendezvous for t in topos} == {f"tcp://127.0.0.1:{port}"}
    assert topos[0].host_rendezvous and not topos[1].host_rendezvous
    assert len({t.secret for t in topos}) == 1 and len({t.job_id for t in topos}) == 1


def test_mpirun_across_hosts_meets_on_mpiruns_host() -> None:
    topo = topology.from_env(ompi_bare(3, 4, 2))
    assert topo.rendezvous == f"tcp://10.0.0.5:{mpi_env.derived_port('mpi:1881276417')}"
    # rank 0 is not on 10.0.0.5 here: it says so, naming the variables that fix it
    with pytest.raises(ValueError, match="rank 0 runs on .* but the launcher runs on 10.0.0.5 .*RINGCOMM_MASTER_ADDR"):
        topology.from_env(ompi_bare(0, 4, 2))
    given_ = topology.from_env(ompi_bare(0, 4, 2, RINGCOMM_MASTER_ADDR="127.0.0.1"))
    assert given_.rendezvous == f"tcp://127.0.0.1:{mpi_env.derived_port('mpi:1881276417')}"


@given(
    flavour=st.sampled_from(["OMPI", "PMI"]),
    size=st.integers(1, 64),
    local=st.one_of(st.none(), st.integers(1, 64)),
    job=st.sampled_from(["", "1881276417"]),
    control=st.sampled_from(["", "node01:40589"]),
    master=st.sampled_from(["", "10.1.1.1"]),
    port=st.sampled_from(["", "29400"]),
    hnp=st.sampled_from(["", "1.0;tcp://10.0.0.5:1"]),
)
def test_mpi_plan_decides_from_the_environment_alone(
    flavour: str, size: int, local: int | None, job: str, control: str, master: str, port: str, hnp: str
) -> None:
    env = {k: v for k, v in {"OMPI_MCA_ess_base_jobid": job, "RINGCOMM_MASTER_ADDR": master,
                             "RINGCOMM_RENDEZVOUS_PORT": port, "OMPI_MCA_orte_hnp_uri": hnp}.items() if v}
    job_known = bool(job) if flavour == "OMPI" else bool(control)
    launcher_host = ("10.0.0.5" if hnp else "") if flavour == "OMPI" else control.partition(":")[0]
    try:
        plan = mpi_env.plan(env, flavour, local, size, control if flavour == "PMI" else "")
    except ValueError as exc:
        assert "RINGCOMM_" in str(exc)
        assert not (master and port)
        assert (not port and not job_known) or (not master and local != size and not launcher_host)
        return
    assert plan.port == (int(port) if port else mpi_env.derived_port(f"mpi:{job if flavour == 'OMPI' else control}"))
    assert mpi_env.PORT_BASE <= plan.port < mpi_env.PORT_BASE + mpi_env.PORT_SPAN or port
    if master:
        assert plan.master == master and not plan.check_on_rank0
    elif local == size:
        assert plan.master == "127.0.0.1" and not plan.check_on_rank0
    else:
        assert plan.master == launcher_host and plan.check_on_rank0


def test_hydra_control_port_is_read_from_the_proxy_ancestor(tmp_path) -> None:
    """A fake /proc: rank (pid 30) <- sh (pid 20) <- hydra_pmi_proxy (pid 10)."""
    for pid, ppid, argv in [(30, 20, ["python"]), (20, 10, ["sh", "-c", "x"]),
                            (10, 1, ["/usr/bin/hydra_pmi_proxy", "--control-port", "node01:40589", "--proxy-id", "0"])]:
        d = tmp_path / str(pid)
        d.mkdir()
        (d / "stat").write_text(f"{pid} (some (odd) name) S {ppid} 1 1")
        (d / "cmdline").write_bytes("\0".join(argv).encode() + b"\0")
    assert mpi_env.hydra_control_port(30, proc=str(tmp_path)) == "node01:40589"
    assert mpi_env.hydra_control_port(20, proc=str(tmp_path)) == "node01:40589"
    assert mpi_env.hydra_control_port(10, proc=str(tmp_path)) == ""
    assert mpi_env.hydra_control_port(99, proc=str(tmp_path)) == ""


def test_hnp_uri_gives_mpiruns_first_ipv4_address() -> None:
    assert mpi_env.hnp_host("1881276416.0;tcp://192.0.2.2,10.0.0.1:39307;tcp6://[fd00::2]:48475") == "192.0.2.2"
    assert mpi_env.hnp_host("1881276416.0;tcp6://[fd00::2]:48475") == ""
    assert mpi_env.hnp_host("") == ""


def test_torchrun_port_stays_out_of_the_ephemeral_range() -> None:
    assert topology.torchrun_port("node01", 29500, "x") == 29501
    derived = topology.torchrun_port("127.0.0.1", 41721, "run-a")
    assert 20000 <= derived < 32000 and derived == topology.torchrun_port("127.0.0.1", 41721, "run-a")
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "41721",
           "TORCHELASTIC_RUN_ID": "run-a"}
    assert topology.from_env(env).rendezvous == f"tcp://127.0.0.1:{derived}"
    assert topology.from_env({**env, "RINGCOMM_RENDEZVOUS_PORT": "45000"}).rendezvous == "tcp://127.0.0.1:45000"


def test_a_job_beyond_loopback_needs_a_secret_or_an_explicit_opt_out(caplog) -> None:
    env = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.5",
           "MASTER_PORT": "29500", "RINGCOMM_NETWORK_INTERFACE": "lo"}
    with pytest.raises(InvalidInputError, match="RINGCOMM_SECRET") as info:
        topology.from_env(env)
    assert "RINGCOMM_INSECURE=1" in str(info.value) and "10.0.0.5" in str(info.value)
    assert topology.from_env({**env, "RINGCOMM_SECRET": "ab" * 16}).secret == bytes.fromhex("ab" * 16)
    with caplog.at_level("WARNING", logger="ringcomm.job.topology"):
        assert topology.from_env({**env, "RINGCOMM_INSECURE": "1"}).secret
    assert "RINGCOMM_INSECURE=1" in caplog.text
    for bad in (slurm(3, 1, 1), ompi(1)):  # Slurm and MPI facts are visible to other users too
        with pytest.raises(InvalidInputError, match="RINGCOMM_SECRET"):
            topology.from_env({k: v for k, v in bad.items() if k != "RINGCOMM_SECRET"})


def test_single_host_jobs_stay_on_loopback_without_a_secret() -> None:
    standalone = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                  "MASTER_ADDR": "workstation.example", "MASTER_PORT": "29500"}
    topo = topology.from_env(standalone)
    assert topo.rendezvous.startswith("tcp://127.0.0.1:") and topo.rendezvous_bind == "127.0.0.1"
    one_node = slurm(1, 1, 0, SLURM_NTASKS="2", SLURM_NODELIST="node01", SLURM_TASKS_PER_NODE="2")
    del one_node["RINGCOMM_SECRET"]
    assert topology.from_env(one_node).rendezvous.startswith("tcp://127.0.0.1:")


def test_an_elastic_worker_is_not_read_from_the_environment_alone() -> None:
    """Its place comes from the driver over the network: topology stays a reader of variables."""
    env = {"RINGCOMM_ELASTIC_WORKER": "3", "RINGCOMM_RENDEZVOUS_ADDR": "tcp://127.0.0.1:1"}
    with pytest.raises(InvalidInputError, match="RINGCOMM_ELASTIC_WORKER=3 .*topology_from_env"):
        topology.from_env(env)
    assert topology.hostname_of({"RINGCOMM_HOSTNAME": "node7"}) == "node7"
    assert topology.secret_of({"RINGCOMM_SECRET": "0a0b"}) == b"\n\x0b"


@pytest.mark.parametrize(("launcher", "library", "matches"), [
    ("OMPI", "Open MPI v4.1.4, package: Debian OpenMPI", True),
    ("OMPI", "MPICH Version:\t4.0\nMPICH Release date: ...", False),
    ("PMI", "MPICH Version:\t4.0", True),
    ("PMI", "Intel(R) MPI Library 2021.10 for Linux* OS", True),
    ("PMI", "Open MPI v4.1.4, package: Debian OpenMPI", False),
])
def test_mpi4py_is_used_only_when_its_library_belongs_to_the_launcher(
        launcher: str, library: str, matches: bool) -> None:
    assert mpi_env.library_matches(launcher, library) is matches


def test_an_ipv6_rendezvous_host_is_refused_at_once_naming_what_to_give_instead() -> None:
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "::1",
           "MASTER_PORT": "29500", "RINGCOMM_SECRET": "5e" * 16}
    with pytest.raises(InvalidInputError, match=r"cannot resolve host '::1' to an IPv4 address.*sockets are IPv4.*"
                                                r"MASTER_ADDR.*RINGCOMM_NETWORK_INTERFACE"):
        topology.from_env(env)
