"""Horovod conformance tier: horovod.torch's behaviours, checked on ringcomm_torch at np 2 and 3.

Each job (tests/workers/conformance_*.py) packs one group of behaviours into one
multi-process run, so the tier costs a handful of interpreter start-ups:

- conformance_collectives.py: allreduce/allgather/broadcast/alltoall/reducescatter values for every dtype,
  pre/postscale bit for bit as Horovod computes on CPU (half in float32, ints in float64), ranks
  agreeing bit for bit, every gradient, mismatch and duplicate-name errors, alltoall splits errors,
  join with Average/allgather/broadcast, shutdown and re-init.
- conformance_training.py: broadcast_parameters/broadcast_optimizer_state for every torch.optim optimizer
  (from a checkpoint, hyper-parameter types, parameters without gradients), broadcast_object,
  allgather_object, fp16 compression, DistributedOptimizer naming (duplicates, missing,
  ``_parameter_names``), ranks stepping on different subgraphs, dynamic requires_grad, gradient
  clipping with synchronize/skip_synchronize and the step warning.
- conformance_recovery.py: a suite sharing one init() goes on in step after a failure: reducescatter(op=Adasum)
  refused on every dtype, join with each rank joining first (np 3: the early joiner skipped the
  others' unnamed ops), a refusal on one rank raised on all; with a stall shutdown, a rank that fails
  before a collective the others entered; DistributedOptimizer over a set some ranks are not in.
- conformance_adasum_sparse.py (np 2, 3, 4): Adasum allreduce / grouped allreduce / DistributedOptimizer against
  a NumPy pairwise tree (refused with NotImplementedError at np 3), sparse_allreduce_async and sparse
  gradients in DistributedOptimizer against the dense reduction.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _preload import rank_python

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).resolve().parents[1] / "workers"

pytestmark = pytest.mark.multiprocess


def run_job(np_: int, script: str, timeout: float, *args: str, **extra_env: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RINGCOMM_", "HOROVOD_"))}
    env.update(extra_env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "ringcomm.launch.launcher", "-np", str(np_), *rank_python(np_), str(WORKERS / script), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} exited with {proc.returncode}:\n{out[-6000:]}"
    for r in range(np_):
        assert f"CONFORMANCE OK rank={r}" in out, out[-4000:]
    return out


@pytest.mark.timeout(100)
@pytest.mark.parametrize("np_", [2, 3])
def test_collectives_scaling_gradients_errors_join(np_):
    run_job(np_, "conformance_collectives.py", timeout=90)


@pytest.mark.timeout(100)
@pytest.mark.parametrize("np_", [2, 3])
def test_optimizer_state_objects_and_naming(np_):
    run_job(np_, "conformance_training.py", timeout=90)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np_", [2, 3, 4])
def test_adasum_and_sparse_against_references(np_):
    """Adasum (allreduce, grouped, DistributedOptimizer) and sparse allreduce against NumPy/dense
    references; Adasum is refused at np 3 (not a power of two), as Horovod refuses it."""
    run_job(np_, "conformance_adasum_sparse.py", timeout=110)


@pytest.mark.timeout(100)
@pytest.mark.parametrize("np_", [2, 3])
def test_suite_goes_on_in_step_after_failures(np_):
    """Adasum reducescatter refused on every rank and dtype; join with each rank first, unnamed ops in
    step after it; a refusal on one rank raised on every rank; a check failing on one rank between
    collectives fails on every rank (rank 0 ends the others' wait); after each, the ranks agree."""
    run_job(np_, "conformance_recovery.py", 90, "suite", RINGCOMM_STALL_CHECK_SECONDS="2")


@pytest.mark.timeout(100)
@pytest.mark.parametrize("np_", [2, 3])
def test_rank_failing_before_a_collective_ends_the_others_wait(np_, tmp_path):
    """With a stall shutdown, the ranks waiting for a rank that failed before a collective raise
    StallError naming it and the op, and every rank goes on."""
    run_job(np_, "conformance_recovery.py", 90, "stall", RINGCOMM_STALL_CHECK_SECONDS="1", RINGCOMM_STALL_SHUTDOWN_SECONDS="3",
            RECOVERY_MARKER_DIR=str(tmp_path))


@pytest.mark.timeout(100)
@pytest.mark.parametrize("np_", [2, 3])
def test_optimizer_over_a_set_some_ranks_are_not_in(np_):
    """DistributedOptimizer(process_set=even ranks) built on every rank: members average, a rank
    outside the set (a single-rank set's complement at np 2) steps on its own gradients."""
    run_job(np_, "conformance_recovery.py", 90, "optimizer_sets", HOROVOD_DYNAMIC_PROCESS_SETS="1")
