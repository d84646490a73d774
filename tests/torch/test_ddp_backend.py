"""The "ringcomm" torch.distributed backend in real jobs: DDP against gloo, every collective, comm hooks,
a rank killed mid-training, monitored_barrier; under ringcomm-run, torchrun and torch.multiprocessing.spawn.

Each job packs many checks (tests/workers/ddp_checks.py) since every rank pays torch's start-up.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from _preload import rank_python

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
CHECKS = Path(__file__).resolve().parents[1] / "workers" / "ddp_checks.py"

pytestmark = pytest.mark.multiprocess


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "RINGCOMM_RANK", "RINGCOMM_SIZE"):
        env.pop(key, None)
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(cmd: list[str], timeout: float, **extra: str) -> str:
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(**extra), capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} exited with {proc.returncode}:\n{out[-6000:]}"
    return out


def ringcomm_run(np_: int, *args: str, timeout: float = 90) -> str:
    return run([sys.executable, "-m", "ringcomm.launch.launcher", "-np", str(np_), *rank_python(np_), *args], timeout)


def torchrun(np_: int, *args: str, timeout: float = 90) -> str:
    return run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(np_),
                *args], timeout)


def assert_ok(out: str, mode: str, np_: int) -> None:
    for r in range(np_):
        assert f"{mode.upper()} OK rank={r}" in out, out[-5000:]


@pytest.mark.timeout(120)
def test_ddp_and_fsdp_equal_gloo_under_torchrun_np2():
    """DDP, DDP under torch.compile and FSDP2 on "ringcomm" and on gloo from one seed: the same
    parameters (1e-6); torchrun."""
    out = torchrun(2, str(CHECKS), "equiv,compile,fsdp")
    for mode in ("equiv", "compile", "fsdp"):
        assert_ok(out, mode, 2)


@pytest.mark.timeout(120)
def test_fsdp_and_hsdp_over_a_two_dimensional_mesh_equal_gloo_np4():
    """FSDP2 over a 1-D mesh and HSDP over a 2x2 one (DeviceMesh makes a group per row and per
    column through new_group): gloo's parameters within 1e-6; DTensor and functional collectives."""
    assert_ok(ringcomm_run(4, str(CHECKS), "fsdp", timeout=110), "fsdp", 4)


@pytest.mark.timeout(300)
def test_torchrun_restart_after_a_rank_is_killed_joins_the_new_attempt():
    """torchrun --max-restarts 1, np 3: rank 2 is killed on the first attempt; the restarted ranks join through
    the same store (torchrun's agent store outlives the attempt) and finish, never dialling the old rendezvous."""
    worker = Path(__file__).resolve().parents[1] / "workers" / "ddp_restart_once.py"
    out = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--max-restarts", "1",
               "--nproc-per-node", "3", str(worker)], 280)
    for r in range(3):
        assert f"JOINED rank={r} attempt=0" in out and f"DONE rank={r} attempt=1 sum=3" in out, out[-5000:]
    assert "RendezvousTimeoutError" not in out and "attempt=0 sum" not in out, out[-5000:]


@pytest.mark.timeout(120)
def test_ddp_fsdp_comm_hooks_and_monitored_barrier_under_ringcomm_run_np3():
    """Equivalence at np 3 (DDP, and FSDP2 with shards of uneven sizes); fp16_compress_hook and PowerSGD (which chains collectives inside future
    callbacks) on both backends; monitored_barrier names the rank that arrives late (rank 1)."""
    out = ringcomm_run(3, str(CHECKS), "equiv,fsdp,hooks,monitored")
    for mode in ("equiv", "fsdp", "hooks", "monitored"):
        assert_ok(out, mode, 3)
    assert "powersgd hook" in out and "fp16 hook" in out, out[-3000:]
    for r in (0, 2):
        line = [ln for ln in out.splitlines() if f"MONITORED rank={r}" in ln]
        assert line and "rank 1 did not arrive" in line[0], out[-3000:]


@pytest.mark.timeout(120)
def test_every_collective_matches_gloo_under_mp_spawn_np3():
    """allreduce (every op), coalesced, broadcast, allgather (+ into tensor, coalesced), reduce_scatter
    (+ tensor, coalesced), alltoall (+ single, splits), gather, scatter, reduce, barrier, objects, a
    new_group of some ranks; send refused by name.  mp.spawn with init_method="tcp://..."."""
    out = run([sys.executable, str(CHECKS), "collectives", "--spawn", "3", str(free_port())], 110)
    assert_ok(out, "collectives", 3)


@pytest.mark.timeout(150)
def test_the_backends_device_path_on_the_fake_device_matches_gloo_np2():
    """Every collective and DDP training with every tensor staged through the fake device's one
    service: gloo's results; no device wait but the stager's (tests/workers/ddp_checks.py)."""
    assert_ok(ringcomm_run(2, str(CHECKS), "device", timeout=140), "device", 2)


class _Rank:
    """One rank started with Slurm's variables, its output read by a thread."""

    def __init__(self, rank: int, world: int, port: int) -> None:
        self.lines: list[tuple[float, str]] = []
        # Slurm's variables (one step, one node), as a Slurm job script's ranks see them
        slurm = dict(SLURM_PROCID=str(rank), SLURM_NTASKS=str(world), SLURM_LOCALID=str(rank), SLURM_NODEID="0",
                     SLURM_JOB_ID="4242", SLURM_STEP_ID="0", SLURM_NODELIST="localhost",
                     SLURM_TASKS_PER_NODE=str(world))
        self.proc = subprocess.Popen(
            [sys.executable, str(CHECKS), "train"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, env=_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **slurm))
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip()))

    def find(self, pattern: str) -> tuple[float, str] | None:
        for t, line in list(self.lines):
            if re.search(pattern, line):
                return t, line
        return None


@pytest.mark.timeout(120)
def test_kill_9_of_a_rank_mid_training_fails_every_survivor_naming_it():
    """Ranks started as under Slurm (SLURM_PROCID/SLURM_NTASKS, init_method tcp://); rank 1 gets SIGKILL."""
    world, victim = 3, 1
    port = free_port()
    ranks = [_Rank(r, world, port) for r in range(world)]
    try:
        deadline = time.monotonic() + 90
        while not all(rk.find(r"STEP 10 ") for rk in ranks):
            assert time.monotonic() < deadline, "\n".join(ln for rk in ranks for _, ln in rk.lines)[-5000:]
            assert all(rk.proc.poll() is None for rk in ranks), "\n".join(ln for rk in ranks for _, ln in rk.lines)
            time.sleep(0.1)
        os.kill(ranks[victim].proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        for r, rk in enumerate(ranks):
            if r == victim:
                continue
            assert rk.proc.wait(timeout=30) == 3, "\n".join(ln for _, ln in rk.lines)[-4000:]
            found = rk.find("CAUGHT")
            assert found is not None, "\n".join(ln for _, ln in rk.lines)[-4000:]
            at, line = found
            # DDP's backward re-raises the backend's DistBackendError as a RuntimeError carrying its message
            assert f"rank {victim}" in line and "DistBackendError" in line, line
            assert at - killed_at < 10.0, f"rank {r} took {at - killed_at:.1f} s: {line}"
            print(f"rank {r} failed {at - killed_at:.2f} s after the kill: {line}")  # shown with pytest -s
            then = rk.find("THEN")
            assert then is not None and "DistBackendError" in then[1] and f"rank {victim}" in then[1], then
    finally:
        for rk in ranks:
            if rk.proc.poll() is None:
                rk.proc.kill()
                rk.proc.wait()
