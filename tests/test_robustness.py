"""Tier 3: issue 6's fault catalogue in real jobs — bad input across ranks, big control traffic,
long runs, files left by killed ranks, jobs side by side.  Every test has a deadline."""

from __future__ import annotations

import pytest

from conftest import WORKERS, launch

CATALOGUE = [
    "shape", "dtype", "op", "root", "collective", "allgather trailing dims", "alltoall trailing dims",
    "reducescatter shape", "root out of range", "negative root", "splits wrong length", "splits negative",
    "splits not summing", "splits float", "reducescatter 0-d", "non-contiguous", "object dtype",
    "unsupported dtype", "not an array", "duplicate in-flight name", "collective before init",
    "collective after shutdown", "init with RINGCOMM_SIZE=0", "init with RINGCOMM_RANK=",
]


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
@pytest.mark.parametrize("world", [2, 3])
def test_bad_input_catalogue_raises_clear_errors_and_the_job_goes_on(world: int) -> None:
    """Each case of issue 6 §3 in one job: the right exception on the right ranks, a message naming
    the problem and the fix, and a following collective that works (checked inside the worker)."""
    proc = launch(world, [str(WORKERS / "bad_input_worker.py")], timeout=80)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for r in range(world):
        for label in CATALOGUE:
            assert f"[{r}]<stdout>:CASE {label}" in proc.stdout, (r, label, proc.stdout[-3000:])
        assert f"[{r}]<stdout>:CATALOGUE OK" in proc.stdout


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_a_cycle_of_many_small_allreduces_larger_than_one_control_frame() -> None:
    """Finding of the fuzzing work: 700 small allreduces answered in one cycle made a 90 MiB response
    frame, over the 64 MiB control limit; the other ranks dropped it and waited forever.  Batches are
    now split (and rank 0 reduces at most one frame's share itself)."""
    proc = launch(3, [str(WORKERS / "many_small_worker.py"), "700"], timeout=80, RINGCOMM_CYCLE_TIME="1000")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("many small ok") == 3
