"""ringcomm-run with -H / --hostfile naming only this machine (no namespaces or root needed)."""

from __future__ import annotations

import json
import re

import pytest

from _launcher_helpers import run_launcher, worker

pytestmark = pytest.mark.multiprocess

ENV_DUMP = """
import json, os
keys = ["RINGCOMM_RANK", "RINGCOMM_LOCAL_RANK", "RINGCOMM_LOCAL_SIZE", "RINGCOMM_CROSS_RANK", "RINGCOMM_CROSS_SIZE",
        "RINGCOMM_HOSTNAME", "RINGCOMM_RENDEZVOUS_ADDR", "RINGCOMM_NETWORK_INTERFACE", "OMP_NUM_THREADS"]
print(json.dumps({k: os.environ.get(k) for k in keys}))
"""


def envs_of(stdout: str) -> dict[int, dict]:
    return {int(m.group(1)): json.loads(m.group(2)) for m in re.finditer(r"^\[(\d)\]<stdout>:(.*)$", stdout, re.M)}


@pytest.mark.timeout(30)
def test_hosts_that_are_this_machine_start_without_ssh_and_get_their_placement(tmp_path) -> None:
    """Two names for this machine are two hosts to ringcomm (tcp between them); no ssh is ever called."""
    result, _ = run_launcher("-np", "3", "-H", "localhost:2,127.0.0.1:2", "--ssh-command", "/bin/false",
                             "--network-interface", "lo", "-v", *worker(ENV_DUMP))
    assert result.returncode == 0, result.stderr
    envs = envs_of(result.stdout)
    got = [(e["RINGCOMM_LOCAL_RANK"], e["RINGCOMM_LOCAL_SIZE"], e["RINGCOMM_CROSS_RANK"], e["RINGCOMM_CROSS_SIZE"],
            e["RINGCOMM_HOSTNAME"], e["OMP_NUM_THREADS"]) for _, e in sorted(envs.items())]
    assert got == [("0", "2", "0", "2", "localhost", "1"), ("1", "2", "0", "2", "localhost", "1"),
                   ("0", "1", "1", "2", "127.0.0.1", None)]  # a rank alone on its host keeps all threads
    assert all(re.fullmatch(r"tcp://127\.0\.0\.1:\d+", e["RINGCOMM_RENDEZVOUS_ADDR"]) for e in envs.values())
    assert {e["RINGCOMM_NETWORK_INTERFACE"] for e in envs.values()} == {"lo"}
    assert "(ssh)" not in result.stderr


@pytest.mark.timeout(60)
def test_a_hostfile_job_computes_across_its_hosts(tmp_path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# this machine under two names\nlocalhost slots=1\n127.0.0.1 slots=1  # second\n")
    code = ("import numpy as np, ringcomm as rc; rc.init();"
            "print(rc.cross_rank(), rc.allreduce(np.full(300000, rc.rank() + 1.0), op=rc.Sum)[::100000].tolist())")
    result, _ = run_launcher("-np", "2", "--hostfile", str(hostfile), *worker(code), timeout=50)
    assert result.returncode == 0, result.stderr
    assert sorted(re.findall(r"<stdout>:(.*)", result.stdout)) == ["0 [3.0, 3.0, 3.0]", "1 [3.0, 3.0, 3.0]"]


@pytest.mark.timeout(30)
def test_an_unknown_host_is_a_clear_error() -> None:
    result, _ = run_launcher("-np", "1", "-H", "no-such-host.invalid:1", *worker("print(1)"))
    assert result.returncode == 2
    assert "cannot resolve host 'no-such-host.invalid'" in result.stderr
