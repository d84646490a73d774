"""Real torchrun (torch.distributed.run): ringcomm jobs under its standalone and static rendezvous."""

from __future__ import annotations

import socket

import pytest

from _tools import PYTHON, WORKER, assert_job_ok, env, module_missing, run

pytestmark = [pytest.mark.multiprocess, pytest.mark.realtools]


def torchrun(*args: str) -> list[str]:
    why = module_missing("torch.distributed.run", "torch")
    if why is not None:
        pytest.skip(why)
    return [PYTHON, "-m", "torch.distributed.run", *args]


@pytest.mark.timeout(120)
def test_torchrun_standalone_two_ranks() -> None:
    proc = run(torchrun("--standalone", "--nproc-per-node", "2", WORKER), timeout=100, env=env())
    assert_job_ok(proc, 2, "torchrun")


@pytest.mark.timeout(120)
def test_a_killed_rank_under_torchrun_is_named() -> None:
    proc = run(torchrun("--standalone", "--nproc-per-node", "3", WORKER, "--die-rank", "1"), timeout=100, env=env())
    both = proc.stdout + proc.stderr
    assert proc.returncode != 0, both
    assert "rank 1: pid" in both and "rank      : 1 (local_rank: 1)" in both, both


def _listen_below_the_ephemeral_range() -> socket.socket:
    for port in range(29001, 31999, 7):
        holder = socket.socket()
        try:
            holder.bind(("127.0.0.1", port))
            holder.listen()
            return holder
        except OSError:
            holder.close()
    pytest.skip("no free port in 29001..31999 to hold")


@pytest.mark.timeout(120)
def test_a_taken_rendezvous_port_names_ringcomm_rendezvous_port() -> None:
    """ringcomm's rendezvous takes MASTER_PORT + 1; when another job holds it, rank 0 names the fix."""
    with _listen_below_the_ephemeral_range() as holder:
        master_port = holder.getsockname()[1] - 1
        cmd = torchrun("--nnodes", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                       "--master-port", str(master_port), WORKER)
        proc = run(cmd, timeout=100, env=env(RINGCOMM_START_TIMEOUT="30"))
    both = proc.stdout + proc.stderr
    assert proc.returncode != 0, both
    assert "Address already in use" in both and "set RINGCOMM_RENDEZVOUS_PORT to a free port" in both, both


@pytest.mark.timeout(200)
def test_standalone_jobs_in_a_row_all_start() -> None:
    """--standalone picks MASTER_PORT among the ephemeral ports; ringcomm's port stays out of that range."""
    for _ in range(4):
        proc = run(torchrun("--standalone", "--nproc-per-node", "2", WORKER), timeout=100, env=env())
        assert_job_ok(proc, 2, "torchrun")
