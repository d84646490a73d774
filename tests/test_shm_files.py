"""Shared-memory files never outlive their job in a way that hurts the next one.

A file is named only once it is whole, its creator holds a lock on it for as long as it lives, and a
file under a name whose creator died is reclaimed by the next creator of that name.  The small-op
lane's region has no name at all until the ranks have met: a rank 0 killed while it waits for the
others leaves nothing, and the next job on the same address runs with the lane.
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

from conftest import ROOT, WORKERS, job_env
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
    before = set(os.listdir(names.SHM_DIR))
    _kill(_holder(path, named=False))
    assert set(os.listdir(names.SHM_DIR)) - before == set()
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
