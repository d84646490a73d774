"""Tier 3: process sets in real jobs (NumPy core at np 3 and 4, torch layer and SyncBatchNorm at np 2 and 3).

One job per world size runs every check (see the workers); each rank checks
its own results against a reference and prints a marker per phase.
"""

from __future__ import annotations

import pytest

from conftest import ROOT, WORKERS, launch

TORCH_WORKERS = ROOT / "tests" / "workers"


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [3, 4])
def test_process_sets_in_a_real_job(world: int) -> None:
    proc = launch(world, [str(WORKERS / "process_sets_worker.py")], timeout=140,
                  RINGCOMM_STALL_CHECK_SECONDS="1", RINGCOMM_SEGMENT_BYTES="65536")
    out = proc.stdout
    assert proc.returncode == 0, f"job failed (np={world}):\n{out[-4000:]}\n{proc.stderr[-4000:]}"
    for r in range(world):
        for phase in ("subset", "errors", "static", "overlap", "concurrent", "dynamic"):
            assert f"[{r}]<stdout>:PHASE {phase} OK" in out, (r, phase, out[-3000:])
        assert f"[{r}]<stdout>:ALL OK" in out
    # rank 0 reported the stalled op of set A by set and global ranks, while set B ran on
    assert ("stall: allreduce 'lonely' in process set 3 (ranks [0, 1]) was submitted by ranks [0]"
            in proc.stderr), proc.stderr[-3000:]
    assert "but ranks [1] have not submitted it" in proc.stderr


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [2, 3])
def test_torch_process_sets_and_sync_batch_norm(world: int) -> None:
    """Torch collectives and gradients on a subset, DistributedOptimizer on a subset, SyncBatchNorm vs.
    one BatchNorm over the concatenated batch (see tests/workers/torch_process_sets_worker.py)."""
    pytest.importorskip("torch")
    proc = launch(world, [str(TORCH_WORKERS / "torch_process_sets_worker.py")], timeout=140, preload=True,
                  OMP_NUM_THREADS="1")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"job failed (np={world}):\n{out[-6000:]}"
    for r in range(world):
        assert f"[{r}]<stdout>:WORKER OK rank={r}" in out, out[-3000:]
