"""Shared-memory files never outlive their job in a way that hurts the next one.

A file is named only once it is whole, its creator holds a lock on it for as long as it lives, and a
file under a name whose creator died is reclaimed by the next creator of that name.  The small-op
lane's region has no name at all until the ranks have met: a rank 0 killed while it waits for the
others leaves nothing, and the next job on the same address runs with the lane.  Files of a job
killed under names that never come again are swept by the next job's local rank 0.
"""

from __future__ import annotations

import glob
import os
import secrets
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, WORKERS, job_env, launch
from ringcomm.job import names
from ringcomm.shm import slots as shm

_MAKE = """
import sys, time
from ringcomm.shm import slots as shm
f = shm.MappedFile(sys.argv[1], 4096, create=True, named=sys.argv[2] == "named")
print("made", flush=True)
time.sleep(60)
"""


def _path() -> str:
    return os.path.join(names.SHM_DIR, f"ringcomm-test{secrets.token_hex(4)}-0-lane")


def _holder(path: str, named: bool) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _MAKE, path, "named" if named else "unnamed"],
                            stdout=subprocess.PIPE, text=True, env=job_env(), cwd=ROOT)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "made"
    return proc


def _kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)


@pytest.mark.skipif(not shm.available(), reason="no writable /dev/shm")
def test_a_dead_creators_file_is_reclaimed_and_a_live_ones_is_not() -> None:
    path = _path()
    live = _holder(path, named=True)
    try:
        with pytest.raises(FileExistsError, match="live process"):
            shm.MappedFile(path, 4096, create=True)
        assert os.path.exists(path)
    finally:
        _kill(live)
    assert os.path.exists(path)  # SIGKILL: the creator could not remove it
    mine = shm.MappedFile(path, 4096, create=True)  # ... but its lock died with it
    try:
        assert os.stat(path).st_size == 4096 and os.stat(path).st_ino == os.fstat(mine._lock_fd).st_ino
    finally:
        mine.unlink()
        mine.close()
    assert not os.path.exists(path)


@pytest.mark.skipif(not shm.available(), reason="no writable /dev/shm")
def test_an_unnamed_file_leaves_nothing_when_its_creator_is_killed_and_is_whole_once_named() -> None:
    path = _path()
    _kill(_holder(path, named=False))
    # only this test's names: jobs of tests running beside it come and go in the same folder
    assert [n for n in os.listdir(names.SHM_DIR) if n.startswith(os.path.basename(path))] == []
    f = shm.MappedFile(path, 8192, create=True, named=False)
    try:
        f.unlink()  # not its name yet: nothing to remove, and nothing removed
        assert not os.path.exists(path)
        f.name()
        other = shm.MappedFile(path, 8192, create=False)
        assert os.stat(path).st_size == 8192
        other.close()
    finally:
        f.unlink()
        f.close()


def _job_files(job_id: str) -> list[str]:
    return glob.glob(os.path.join(names.SHM_DIR, names.prefix(job_id) + "*"))


def _listening(port: int) -> bool:
    """Whether something on this host listens on TCP ``port`` (read from /proc/net/tcp)."""
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return any(int(row[1].rsplit(":", 1)[1], 16) == port and row[3] == "0A" for row in rows)


def _env(rank: int, port: int, secret: str) -> dict[str, str]:
    """Rank ``rank``'s environment in a two-rank job started torchrun-style, no launcher (rank 0 hosts
    the rendezvous on ``port``)."""
    return job_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", RINGCOMM_RENDEZVOUS_PORT=str(port),
                   RINGCOMM_SECRET=secret, RINGCOMM_START_TIMEOUT="30")


def _rank(rank: int, port: int, secret: str) -> subprocess.Popen:
    env = _env(rank, port, secret)
    return subprocess.Popen([sys.executable, str(WORKERS / "lane_probe_worker.py")], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
@pytest.mark.skipif(not shm.available() or not os.path.exists("/proc/net/tcp"), reason="no /dev/shm or /proc/net")
def test_rank_0_killed_in_rendezvous_leaves_nothing_and_the_next_job_has_the_lane() -> None:
    import socket

    from ringcomm.job import topology

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    port, secret = free, secrets.token_hex(16)
    job_id = topology.from_env(_env(0, port, secret)).job_id
    # rank 0 alone: it makes its lane region, then waits in the rendezvous for a rank 1 that is late
    first = _rank(0, port, secret)
    try:
        deadline = time.monotonic() + 30
        while not _listening(port) and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.05)
        assert _listening(port), "rank 0 never listened for the rendezvous"
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=10)
    assert _job_files(job_id) == []
    # the same job again (same address, port and secret: the same job id), both ranks this time
    ranks = [_rank(r, port, secret) for r in (0, 1)]
    outs = []
    for p in ranks:
        try:
            outs.append(p.communicate(timeout=60)[0])
        finally:
            p.kill()
    assert all(p.returncode == 0 for p in ranks), outs
    assert all("lane=on ok" in out for out in outs), outs
    assert _job_files(job_id) == []


@pytest.mark.skipif(not shm.available(), reason="no writable /dev/shm")
def test_files_of_dead_jobs_are_swept_whatever_their_name_and_live_ones_stay(tmp_path) -> None:
    """Another job's name never comes again, so no creator reclaims it: the sweep does, and only
    files whose creator is gone (here in a directory of the test's, laid out as /dev/shm)."""
    d = str(tmp_path)
    dead, live = (os.path.join(d, f"ringcomm-test{secrets.token_hex(4)}-0-lane") for _ in range(2))
    other = os.path.join(d, "someone-else")
    open(other, "w").close()
    killed = _holder(dead, named=True)
    _kill(killed)
    temp_dead = os.path.join(d, f"ringcomm-test{secrets.token_hex(4)}-0-allreduce.{killed.pid}.new")
    temp_live = os.path.join(d, f"ringcomm-test{secrets.token_hex(4)}-0-allreduce.{os.getpid()}.new")
    for p in (temp_dead, temp_live):
        open(p, "w").close()
    holder = _holder(live, named=True)
    try:
        removed = shm.reclaim_left_by_dead(d)
        assert sorted(removed) == sorted([(dead, 4096), (temp_dead, 0)])
        assert os.path.exists(live) and os.path.exists(temp_live) and os.path.exists(other)
        assert shm.reclaim_left_by_dead(d) == []  # nothing more to do
    finally:
        _kill(holder)


_KILLED_THEN_NEXT = """
import glob, json, os, secrets, signal, subprocess, sys
from ringcomm.job import names, topology
root = sys.argv[1]
job = [sys.executable, "-c", "import ringcomm, time; ringcomm.init(); print('up', flush=True); time.sleep(60)"]
port = str(29000 + secrets.randbelow(2000))
envs = [dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
             MASTER_ADDR="127.0.0.1", MASTER_PORT=port) for r in range(2)]
procs = [subprocess.Popen(job, stdout=subprocess.PIPE, text=True, cwd=root, env=env) for env in envs]
up = [p.stdout.readline().strip() == "up" for p in procs]
for p in procs:
    p.send_signal(signal.SIGKILL)
    p.wait(10)
left = glob.glob(os.path.join(names.SHM_DIR, names.prefix(topology.from_env(envs[0]).job_id) + "*"))
out = subprocess.run([sys.executable, "-m", "ringcomm.launch.launcher", "-np", "2", sys.executable, "-c",
                      "import ringcomm; ringcomm.init(); ringcomm.shutdown()"], capture_output=True, text=True,
                     timeout=40, cwd=root, env=dict(os.environ, RINGCOMM_LOG_LEVEL="INFO"))
print(json.dumps({"up": up, "left": left, "still": [p for p in left if os.path.exists(p)],
                  "rc": out.returncode, "stderr": out.stderr}))
"""


@pytest.mark.skipif(not shm.available(), reason="no writable /dev/shm")
@pytest.mark.timeout(60)
def test_a_job_started_without_the_launcher_removes_what_a_killed_one_left() -> None:
    """Two ranks started as torchrun starts them, both killed with SIGKILL once they have met: the
    lane's region keeps its name until every rank has posted, so it is left; the next job's
    init() removes it, and says so.  Any job's init() on the host would: where it can, the scenario
    runs with a /dev/shm of its own (``unshare -m``), so that jobs of tests beside it do not."""
    import json
    import shutil

    argv = [sys.executable, "-c", _KILLED_THEN_NEXT, str(ROOT)]
    if os.geteuid() == 0 and shutil.which("unshare"):
        argv = ["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=64m tmpfs {names.SHM_DIR} && exec \"$@\"",
                "-", *argv]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=55, env=job_env(), cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["up"] == [True, True] and seen["left"], f"the killed job left no file: nothing to check {seen}"
    assert seen["rc"] == 0 and seen["still"] == [], seen
    assert "[0]<stderr>:" in seen["stderr"] and "that jobs killed on this host had left" in seen["stderr"], seen


@pytest.mark.skipif(not shm.available(), reason="no writable /dev/shm")
@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_after_the_first_op_the_job_has_no_name_left_in_dev_shm() -> None:
    """The lane's region loses its name as soon as an op shows that every rank has it mapped, so
    from then on a job killed however leaves nothing there."""
    # rank 1 posts last: rank 0, which owns the name, has posted before every rank had
    code = ("import glob, os, time, numpy as np, ringcomm; ringcomm.init(); "
            "time.sleep(0.5 if ringcomm.rank() == 1 else 0); "
            "ringcomm.allreduce(np.ones(4), name='first'); time.sleep(0.5); "
            "job = os.environ['RINGCOMM_JOB_ID']; "
            "print('LEFT', sorted(glob.glob(f'/dev/shm/ringcomm-{job}-*')), flush=True); ringcomm.shutdown()")
    out = launch(2, ["-c", code], timeout=50)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("LEFT []") == 2, out.stdout
