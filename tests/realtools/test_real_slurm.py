"""Real Slurm: a single-node cluster (munged, slurmctld, slurmd) started here runs ringcomm jobs.

Needs root and Debian's ``slurm-wlm`` and ``munge``; skips otherwise.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from _slurm import SlurmCluster, cluster_unavailable, missing_tools, mpi_plugin_missing
from _tools import HERE, PYTHON, WORKER, assert_job_ok, env, module_missing, results, run

pytestmark = [pytest.mark.multiprocess, pytest.mark.realtools]


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    why = cluster_unavailable(missing_tools(), os.geteuid() == 0, socket.gethostname())
    if why is not None:
        pytest.skip(why)
    # the daemons may still write a last log line while the directory goes
    with tempfile.TemporaryDirectory(prefix="ringcomm-slurm-", ignore_cleanup_errors=True) as root:
        with SlurmCluster(Path(root)) as c:
            yield c


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mpi", ["none", "pmi2", "pmix"])
def test_srun_with_each_mpi_plugin(cluster: SlurmCluster, mpi: str) -> None:
    """srun --mpi=X -n 2 python job.py: no variable set by hand; pmi2's PMI_RANK does not hide SLURM_*."""
    why = mpi_plugin_missing(mpi)
    if why:
        pytest.skip(why)
    proc = run(["srun", f"--mpi={mpi}", "-n", "2", PYTHON, WORKER], timeout=60, env=cluster.env(env()))
    assert_job_ok(proc, 2, "slurm")


@pytest.mark.timeout(90)
def test_sbatch_script_runs_srun(cluster: SlurmCluster, tmp_path: Path) -> None:
    script = tmp_path / "job.sh"
    out = tmp_path / "job.out"
    script.write_text(f"#!/bin/bash\n#SBATCH -n 3\n#SBATCH -o {out}\nsrun --mpi=pmi2 {PYTHON} {WORKER}\n")
    proc = run(["sbatch", "--wait", str(script)], timeout=70, env=cluster.env(env()), cwd=tmp_path)
    text = out.read_text() if out.exists() else ""
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{text}"
    assert_job_ok(type(proc)(proc.args, 0, text, ""), 3, "slurm")


@pytest.mark.timeout(90)
def test_a_killed_rank_under_srun_is_named(cluster: SlurmCluster) -> None:
    proc = run(["srun", "--mpi=pmi2", "-n", "3", PYTHON, WORKER, "--die-rank", "1"], timeout=60,
               env=cluster.env(env()))
    both = proc.stdout + proc.stderr
    assert proc.returncode != 0, both
    assert "PeerLostError: rank 0: lost rank 1" in both and "PeerLostError: rank 2: lost rank 1" in both, both


@pytest.mark.timeout(240)
def test_lightning_under_srun_matches_gloo(cluster: SlurmCluster, tmp_path: Path) -> None:
    """srun --ntasks-per-node 2 python lightning_job.py (Lightning refuses a bare -n): ringcomm trains as gloo."""
    why = module_missing("lightning", "frameworks")
    if why is not None:
        pytest.skip(why)
    digests = {}
    for backend in ("ringcomm", "gloo"):
        out = tmp_path / backend
        out.mkdir()
        proc = run(["srun", "--mpi=none", "-N", "1", "--ntasks-per-node", "2", PYTHON, str(HERE.parent / "workers" / "lightning_job.py"),
                    "--devices", "2", "--backend", backend, "--out", str(out)], timeout=100,
                   env=cluster.env(env(OMP_NUM_THREADS="1")), cwd=tmp_path)
        both = f"stdout:\n{proc.stdout[-5000:]}\nstderr:\n{proc.stderr[-5000:]}"
        recs = results(proc.stdout)
        assert proc.returncode == 0 and [r["rank"] for r in recs] == [0, 1], both
        for r in recs:
            assert r["backend"] == backend and r["gathered"] == [0, 1] and r["rank_mean"] == 0.5, both
            assert r["restored"] == r["digest"] and r["resumed_epoch"] == 3, both
        digests[backend] = {r["digest"] for r in recs}
    assert digests["ringcomm"] == digests["gloo"] and len(digests["gloo"]) == 1, digests
