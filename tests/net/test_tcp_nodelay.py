"""Every TCP connection of a job, data and control plane, has Nagle's algorithm off (TCP_NODELAY).

Two ranks on this machine that name different hosts (``RINGCOMM_HOSTNAME``) talk over TCP on
loopback instead of ipc sockets; each rank then lists its own connected TCP sockets.  With Nagle
on, a small message written after another would wait for the peer's delayed ACK (up to 40 ms).
"""

from __future__ import annotations

import re

import pytest

from conftest import WORKERS, remove_files_of, start_torchrun_job


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_every_tcp_connection_between_ranks_on_two_hosts_has_nodelay() -> None:
    hosts = [{"RINGCOMM_HOSTNAME": f"host{r}", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"} for r in range(2)]
    procs = start_torchrun_job([str(WORKERS / "nodelay_worker.py")], 2, rank_env=hosts)
    try:
        outs = [p.communicate(timeout=60)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
        remove_files_of([p.pid for p in procs])
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {rank}:\n{out[-3000:]}"
        found = re.findall(r"^TCP (.+) -> (.+) nodelay=(\d+)$", out, re.MULTILINE)
        # the data plane's connection to the other rank and the control plane's (rank 0 serves it)
        assert len(found) >= 2, f"rank {rank}: expected its data and control connections over TCP:\n{out[-3000:]}"
        assert all(int(nodelay) for *_, nodelay in found), f"rank {rank}: a TCP connection with Nagle on:\n{out}"
