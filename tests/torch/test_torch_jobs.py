"""ringcomm_torch in real multi-process jobs started with the launcher (np 2 and 3).

Each job costs a few seconds of interpreter and torch start-up, so each worker
script packs many checks; see tests/workers/torch_*.py.
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


def run_job(np_: int, script: Path, *args: str, timeout: float = 100.0) -> str:
    """Run ``script`` under the launcher at ``np_`` ranks; return its output, failing with it on error."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "ringcomm.launch.launcher", "-np", str(np_), *rank_python(np_), str(script), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} exited with {proc.returncode}:\n{out[-6000:]}"
    return out


def assert_all_ranks_ok(out: str, np_: int) -> None:
    for r in range(np_):
        assert f"WORKER OK rank={r}" in out, out[-4000:]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("np_", [2, 3])
def test_collectives_gradients_errors_optimizer_and_broadcast_state(np_):
    """Every collective with values and gradients, mismatch errors, DistributedOptimizer equivalence
    with a one-process run, bitwise-identical ranks, broadcast_optimizer_state (see tests/workers/torch_*.py)."""
    assert_all_ranks_ok(run_job(np_, WORKERS / "torch_all_checks.py", timeout=140), np_)


def _peak_memory_resettable() -> bool:
    return os.access("/proc/self/clear_refs", os.W_OK) and os.path.exists("/proc/self/status")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("np_", [2, 3])
def test_large_single_tensors_values_and_what_they_allocate(np_):
    """4-40 MiB tensors: Horovod's arithmetic (Average, prescale/postscale, half, bfloat16, integers),
    broadcast from the last rank, allgather, grouped, a gradient; in-place ops hand back the same
    storage, and the peak resident memory of an op grows by one result at most
    (tests/workers/torch_large_tensors_worker.py)."""
    rss = _peak_memory_resettable()
    out = run_job(np_, WORKERS / "torch_large_tensors_worker.py", *(["rss"] if rss else []), timeout=140)
    assert_all_ranks_ok(out, np_)
    if not rss:
        pytest.skip("values checked; the peak-memory bound needs a writable /proc/self/clear_refs (Linux)")


@pytest.mark.timeout(120)
def test_digits_example_converges():
    pytest.importorskip("sklearn")
    out = run_job(2, ROOT / "examples" / "torch_digits.py", "--epochs", "6")
    last = [line for line in out.splitlines() if "test accuracy" in line][-1]
    acc = float(last.split("test accuracy")[1].split()[0].strip(":%"))
    assert acc > 90.0, out[-3000:]


@pytest.mark.timeout(60)
def test_synthetic_benchmark_runs():
    # one process without the launcher: the launcher path is covered above; this checks the script
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, str(ROOT / "examples" / "torch_synthetic_benchmark.py"), "--model", "mlp",
           "--batch-size", "16", "--num-warmup-batches", "1", "--num-batches-per-iter", "2", "--num-iters", "2",
           "--fp16-allreduce"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Total img/sec on 1 CPU(s)" in proc.stdout, proc.stdout


@pytest.mark.timeout(90)
def test_a_rank_lagging_50ms_does_not_slow_the_others_hooks():
    """Rank 1 sleeps 50 ms before each backward() while 30 ops per step are in flight: rank 0's
    submits return at once, its backward() stays within 1.5x of rank 1's, and the parameters end
    equal on both ranks (tests/workers/torch_lag_worker.py)."""
    out = run_job(2, WORKERS / "torch_lag_worker.py", "0.05", "8", timeout=80)
    assert_all_ranks_ok(out, 2)


@pytest.mark.timeout(150)
def test_the_device_test_files_pass_under_the_launcher():
    """The GPU check runs these files under the launcher at np 2 and 4; on a CPU machine their fake
    device tests run there too, so a test that only holds in one process fails here, not on a GPU."""
    files = ["tests/torch/test_cuda.py", "tests/torch/test_device_buckets.py", "tests/torch/test_device_return.py",
             "tests/torch/test_device_collectives.py"]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "ringcomm.launch.launcher", "-np", "2", *rank_python(2), "-m", "pytest", "-q",
           "-p", "no:cacheprovider", "-o", "addopts=", *files]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=140)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert out.count(" passed") >= 2, out[-3000:]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("np_,setting,wait", [(2, "1", "stream"), (3, "1", "stream"), (2, "1", "host"), (2, "0", "stream")],
                         ids=["np2", "np3", "np2-host-waits", "np2-off"])
def test_buckets_and_single_tensors_reduce_on_the_device_through_the_fake_ipc(np_, setting, wait):
    """tests/torch/test_device_ipc.py and the three test_device_arena*.py files under the launcher
    (a 1 MiB arena, every size through it): bitwise alike on every rank and the pinned path's
    results within rounding, the root's bits for a broadcast, every rank's for an allgather, the
    sum in rank order for a reduce-scatter, FSDP2 training; no wait for a peer in backward
    or in the call, whichever waits
    (RINGCOMM_DEVICE_IPC_WAIT); RINGCOMM_DEVICE_IPC=0 falls back."""
    env = dict(os.environ, RINGCOMM_DEVICE_IPC=setting, RINGCOMM_DEVICE_IPC_ARENA_BYTES=str(1 << 20),
               RINGCOMM_DEVICE_IPC_MIN_BYTES="0", RINGCOMM_DEVICE_IPC_WAIT=wait)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "ringcomm.launch.launcher", "-np", str(np_), *rank_python(np_), "-m", "pytest", "-q",
           "-p", "no:cacheprovider", "-o", "addopts=", "tests/torch/test_device_ipc.py",
           "tests/torch/test_device_arena.py", "tests/torch/test_device_arena_broadcast.py",
           "tests/torch/test_device_arena_shards.py"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=190)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert out.count("65 passed, 1 skipped" if setting == "1" else "50 passed, 16 skipped") == np_, out[-3000:]


@pytest.mark.timeout(200)
def test_buckets_and_single_tensors_across_two_hosts_reduce_each_hosts_shards_on_the_device():
    """tests/torch/test_device_ipc.py and the three test_device_arena*.py files at np 4 as two hosts
    of two ranks each (interleaved): each host's ranks sum on the (fake) device, only each rank's
    shard goes through host memory, and every rank gets the same bits, within rounding of the
    pinned path; broadcasts, allgathers and reduce-scatters take pinned memory."""
    env = dict(os.environ, RINGCOMM_DEVICE_IPC="1", RINGCOMM_DEVICE_IPC_ARENA_BYTES=str(1 << 20),
               RINGCOMM_DEVICE_IPC_MIN_BYTES="0", ARENA_TEST_HOSTS="2")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "ringcomm.launch.launcher", "-np", "4", *rank_python(4), "-m", "pytest", "-q",
           "-p", "no:cacheprovider", "-o", "addopts=", "tests/torch/test_device_ipc.py",
           "tests/torch/test_device_arena.py", "tests/torch/test_device_arena_broadcast.py",
           "tests/torch/test_device_arena_shards.py"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=190)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert out.count("59 passed, 7 skipped") == 4, out[-3000:]



@pytest.mark.timeout(120)
def test_the_allreduce_phases_tool_times_each_path_on_the_fake_device():
    """tools/allreduce_phases.py (the GPU check's split of one CUDA allreduce) runs at np 2 on the
    fake device, through the arena and through pinned memory, and names the path it timed; with
    --profile, rank 0 lists the costliest functions per op (yappi's, on every thread, where the
    test environment has it; else cProfile's)."""
    env = dict(os.environ, RINGCOMM_DEVICE_IPC_MIN_BYTES="0")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    lines = {}
    for setting in ("1", "0"):
        env["RINGCOMM_DEVICE_IPC"] = setting
        cmd = [sys.executable, "-m", "ringcomm.launch.launcher", "-np", "2", *rank_python(2),
               "tools/allreduce_phases.py", "--sizes", "4K", "--ops", "5", "--profile", "20"]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        lines[setting] = [ln for ln in proc.stdout.splitlines() if "phases np=2" in ln]
        profile = [ln for ln in proc.stdout.splitlines() if "profile np=2 4K" in ln]
        listed = [ln for ln in proc.stdout.splitlines() if "    own " in ln and " calls/op " in ln]
        assert len(profile) == 1 and listed, proc.stdout[-4000:]
    assert len(lines["1"]) == 1 and " arena " in lines["1"][0] and " call " in lines["1"][0], lines
    assert len(lines["0"]) == 1 and " pinned " in lines["0"][0], lines


@pytest.mark.timeout(120)
def test_the_device_floor_tool_times_each_way_of_a_bare_exchange_on_the_fake_device():
    """tools/device_floor.py (the GPU check's floor for a small exchange, without ringcomm's work)
    runs at np 2 on the fake device: each host-side way, p50 and p99 on both ranks."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "ringcomm.launch.launcher", "-np", "2", *rank_python(2),
           "tools/device_floor.py", "--ops", "50"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = {ln.split("<stdout>:floor ", 1)[1][:16].strip(): ln for ln in proc.stdout.splitlines() if "<stdout>:floor " in ln}
    assert {"handshake", "copies alone", "copies together", "pinned exchange", "ipc events: CUDA"} <= set(rows), rows
    for way in ("handshake", "copies alone", "copies together", "pinned exchange"):
        numbers = [float(v) for v in rows[way].replace("|", "/").split(way, 1)[1].split("/")]
        assert len(numbers) == 4 and all(v > 0 for v in numbers), rows[way]
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("ringcomm-floor-")]  # the page is gone
