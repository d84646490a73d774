"""Real torchrun (torch.distributed.run): ringcomm jobs under its standalone and static rendezvous."""

from __future__ import annotations

import socket

import pytest

from _tools import PYTHON, WORKER, assert_job_ok, env, free_port, run

pytestmark = [pytest.mark.multiprocess, pytest.mark.realtools]


def torchrun(*args: str) -> list[str]:
    pytest.importorskip("torch.distributed.run", reason="torch is not installed (pip install 'ringcomm[torch]')")
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


@pytest.mark.timeout(120)
def test_a_taken_rendezvous_port_names_ringcomm_rendezvous_port() -> None:
    """ringcomm's rendezvous takes MASTER_PORT + 1; when another job holds it, rank 0 names the fix."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        master_port = taken - 1
        if master_port < 1024:
            pytest.skip("the OS gave a port too low to leave room below it")
        try:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", master_port))
        except OSError:
            master_port, taken = free_port(), None  # no room below: fall back to an explicit clash below
        cmd = torchrun("--nnodes", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                       "--master-port", str(master_port), WORKER)
        extra = {} if taken else {"RINGCOMM_RENDEZVOUS_PORT": str(holder.getsockname()[1])}
        proc = run(cmd, timeout=100, env=env(RINGCOMM_START_TIMEOUT="30", **extra))
    both = proc.stdout + proc.stderr
    assert proc.returncode != 0, both
    assert "Address already in use" in both and "set RINGCOMM_RENDEZVOUS_PORT to a free port" in both, both
