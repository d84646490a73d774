"""A rank killed mid-collective, no launcher to stop the others: every survivor raises naming it, fast.

Repeated to catch races (a send blocked on a dead peer hung most runs before sends had deadlines):
RINGCOMM_FAULT_REPEATS sets the repetitions per case (default 2; run with 5 or more before a release).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from conftest import WORKERS, remove_files_of, start_torchrun_job

REPEATS = int(os.environ.get("RINGCOMM_FAULT_REPEATS", "2"))


@pytest.mark.multiprocess
@pytest.mark.timeout(60 + 40 * REPEATS)
@pytest.mark.parametrize("op", ["allgather", "allreduce", "broadcast"])
def test_every_survivor_names_the_killed_rank_within_ten_seconds(op: str) -> None:
    for attempt in range(REPEATS):
        victim = (attempt + 1) % 4  # ranks 1, 2, 3, then rank 0 (the coordinator)
        procs = start_torchrun_job([str(WORKERS / "dead_peer_loop_worker.py")], 4, DEAD_PEER_OP=op)
        try:
            for p in procs:
                assert p.stdout.readline().strip() == "ready"
            time.sleep(0.5)
            killed_at = time.monotonic()
            procs[victim].send_signal(signal.SIGKILL)
            outs, took = {}, {}
            for r, p in enumerate(procs):
                if r != victim:
                    outs[r] = p.communicate(timeout=30)[0]
                    took[r] = time.monotonic() - killed_at
        finally:
            for p in procs:
                p.kill()
                p.wait()
            remove_files_of([p.pid for p in procs], [p.job_id for p in procs])
        print(f"{op}, victim {victim}: survivors raised after " + ", ".join(f"{t:.2f}" for t in took.values()) + " s")
        for r, out in outs.items():
            where = f"{op}, attempt {attempt + 1}, victim {victim}, survivor {r}"
            assert procs[r].returncode == 3, f"{where}: {out}"
            assert "PeerLostError" in out and f"lost rank {victim} " in out, f"{where}: {out}"
            assert took[r] < 10, f"{where}: took {took[r]:.1f} s"
