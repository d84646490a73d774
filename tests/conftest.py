"""Shared fixtures: launching real ringcomm jobs with a deadline."""

from __future__ import annotations

import compileall
import importlib.util
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# CI and this machine are shared 2-core boxes: a per-example time limit only measures the neighbours.
# Multi-process tests have pytest-timeout deadlines instead.
settings.register_profile("ringcomm", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ringcomm")

ROOT = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"

# Without torch installed (the core needs only numpy, pyzmq and msgpack), "import torch" would find
# this folder's torch/ tests as a namespace package, and pytest.importorskip("torch") would not skip:
# make the import fail, so that every torch test skips.
def _torch_missing() -> bool:
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):  # a test's finder that hides torch
        return False
    return spec is None or spec.origin in (None, "namespace")


HAS_TORCH = not _torch_missing()
if not HAS_TORCH:
    sys.modules["torch"] = None  # type: ignore[assignment]
#: For a test whose processes use torch (its ranks, gloo): skipped where torch is not installed.
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed (pip install 'ringcomm[torch]')")


def pytest_configure(config: pytest.Config) -> None:
    """Compile the project's modules once, before any test starts a process: every rank of every job
    imports them, and where PYTHONDONTWRITEBYTECODE is set (as in many CI images) each process would
    otherwise compile them again from source (a quarter of a second per process here)."""
    for folder in ("ringcomm", "ringcomm_torch", "tests"):
        try:
            compileall.compile_dir(str(ROOT / folder), quiet=2, workers=1)
        except OSError:  # a read-only checkout: the processes compile for themselves, as before
            pass


#: Hosts the device tests' ranks name (``ARENA_TEST_HOSTS``; 1: the host's own name): rank r on host r % TEST_HOSTS.
TEST_HOSTS = int(os.environ.get("ARENA_TEST_HOSTS", "1"))


def name_test_host() -> None:
    """Before ``init()``: this rank names its host as ``ARENA_TEST_HOSTS`` asks (nothing for one host)."""
    if TEST_HOSTS > 1:
        os.environ["RINGCOMM_HOSTNAME"] = f"arenahost{int(os.environ.get('RINGCOMM_RANK', '0')) % TEST_HOSTS}"


# before any test module can call init(): under ARENA_TEST_HOSTS every test file of a rank then
# names the same host, whichever file's test starts the runtime first
name_test_host()


def timeline_phases(path: Path, row: str) -> list[str]:
    """The phases on op ``row``'s row of the timeline file at ``path``, in time order."""
    import json

    events = json.loads(Path(path).read_text())
    rows = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    pid = next(p for p, name in rows.items() if name == row)
    return [e["name"] for e in sorted((e for e in events if e.get("pid") == pid and e["ph"] == "X"),
                                      key=lambda e: e["ts"])]


def hosts_of_job(size: int) -> int:
    """How many hosts a job of ``size`` ranks spans under ``ARENA_TEST_HOSTS``."""
    return min(TEST_HOSTS, size)


def settle_arena(arena, seconds: float = 60.0) -> None:
    """Start sharing a device arena (``ringcomm_torch.device_arena.Arena``) where no op did yet, and
    wait until every rank's has settled: shared (``"ready"``) or given up (``"off"``)."""
    import time

    import ringcomm_torch as hvd

    arena.start()
    deadline = time.monotonic() + seconds
    while not all(hvd.allgather_object(arena.state in ("ready", "off"))):
        assert time.monotonic() < deadline, arena.state
        time.sleep(0.01)


@pytest.fixture(scope="module")
def ops():
    """One fake device with IPC (``ringcomm_torch.device.FakeOps(ipc=True)``) for a whole test module,
    standing in for every tensor's device: its arena is shared once, as a GPU's is."""
    from ringcomm_torch import device

    fake = device.FakeOps(ipc=True)
    with device.override(fake):
        yield fake


class Untouched:
    """No pinned buffer taken on the fake device ``ops`` (``ringcomm_torch.device.FakeOps``) and no
    op started after a wait for its copy to pinned memory (by the stager or a blocking caller)
    since made."""

    def __init__(self, ops) -> None:
        from ringcomm_torch.device_threads import stager

        self.ops, self.stager = ops, stager
        self.pinned = ops.pinned_allocations
        self.started = stager.started

    def __bool__(self) -> bool:
        return self.ops.pinned_allocations == self.pinned and self.stager.started == self.started


def job_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGCOMM_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def launch(np_: int, args: list[str], timeout: float = 60, *, preload: bool = False,
           **env: str) -> subprocess.CompletedProcess:
    """Run ``ringcomm-run -np N python ARGS...``; kills the job if it outlives ``timeout``.

    ``preload=True``: the ranks start with torch already imported (``tests/_preload.py``), for jobs
    whose checks are about what the program does, not about its process."""
    from _preload import rank_python

    python = rank_python(np_) if preload else [sys.executable]
    cmd = [sys.executable, "-m", "ringcomm.launch.launcher", "-np", str(np_), *python, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=job_env(**env), cwd=ROOT)


@pytest.fixture
def run_job():
    return launch


def init_ranks_apart(job_id: str, env_of_rank: list[dict[str, str]]) -> list[tuple[int, str]]:
    """Start one process per entry of ``env_of_rank`` that only calls ``init()`` (printing ``REFUSED
    <message>`` if it raises ``ValueError``) against a rendezvous server of this process; returns each
    rank's (exit code, output)."""
    from ringcomm.net.rendezvous import RendezvousServer

    size, secret = len(env_of_rank), os.urandom(32)
    code = "import ringcomm as rc\ntry:\n    rc.init()\nexcept ValueError as e:\n    print('REFUSED', e)\n"
    with RendezvousServer(size=size, secret=secret) as server:
        procs = [subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=job_env(RINGCOMM_RANK=str(r), RINGCOMM_SIZE=str(size), RINGCOMM_RENDEZVOUS_ADDR=server.address,
                        RINGCOMM_SECRET=secret.hex(), RINGCOMM_JOB_ID=job_id, **extra),
        ) for r, extra in enumerate(env_of_rank)]
        try:
            outs = [p.communicate(timeout=40)[0] for p in procs]
        finally:
            for p in procs:
                p.kill()
                p.wait()
    return [(p.returncode, out) for p, out in zip(procs, outs)]


def remove_files_of(pids: list[int], job_ids: Sequence[str] = ()) -> None:
    """Remove the ipc socket files of killed ranks (a killed process cannot remove its own), and what
    the ended jobs ``job_ids`` left in /dev/shm that no live process holds (a failing rank's notice file)."""
    import glob
    import tempfile

    from ringcomm.job import names
    from ringcomm.shm.reclaim import reclaim_dead

    for pid in pids:
        for path in glob.glob(f"{tempfile.gettempdir()}/ringcomm-*-{pid}-*"):
            try:
                os.unlink(path)
            except OSError:
                pass
    for job in set(job_ids):
        reclaim_dead(os.path.join(names.SHM_DIR, names.prefix(job) + "*"))


def start_torchrun_job(args: list[str], world: int, rank_env: Sequence[dict[str, str]] = (),
                       wrap: Sequence[Sequence[str]] = (), **env: str) -> list[subprocess.Popen]:
    """Start ``world`` ranks the way torchrun would (RANK, WORLD_SIZE, MASTER_ADDR/PORT), no launcher.

    ``rank_env[r]``, where given, is added to rank r's environment last (e.g. its own host name);
    ``wrap[r]``, where given, is the command rank r's Python runs under (e.g. ``unshare ...``).

    Each process's stdout and stderr come back merged in ``proc.stdout`` (text); ``proc.job_id``
    is the job id ringcomm derives (the prefix of the job's socket and shared-memory names).
    """
    import socket

    from ringcomm.job import topology

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(world):
        penv = job_env(RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port - 1), **env)
        penv.update(rank_env[r] if r < len(rank_env) else {})
        proc = subprocess.Popen([*(wrap[r] if r < len(wrap) else ()), sys.executable, *args], env=penv,
                                stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        proc.job_id = topology.from_env(penv).job_id  # type: ignore[attr-defined]
        procs.append(proc)
    return procs


_NETNS_REASON: list[str | None] = []


@pytest.fixture
def hosts(tmp_path: Path):  # type: ignore[no-untyped-def]
    """Two "hosts" (fresh network namespaces joined by veth), removed with anything still running in
    them when the test ends; skips, naming what is missing, where namespaces cannot be made."""
    from _netns import TwoHosts, unavailable_reason

    if not _NETNS_REASON:
        _NETNS_REASON.append(unavailable_reason())
    if _NETNS_REASON[0] is not None:
        pytest.skip(_NETNS_REASON[0])
    two = TwoHosts(tmp_path)
    try:
        yield two
    finally:
        two.close()


class RecordingEngine:
    """The engine side of a lane driver in a test: records the ops handed to it in ``diverted``."""

    def __init__(self, diverted: list | None = None) -> None:
        self.diverted = [] if diverted is None else diverted
        self.failure: BaseException | None = None
        self.timeline_active = False

    def submit(self, entry):
        if self.failure is not None:
            raise self.failure
        self.diverted.append(entry)
        return entry.handle


@pytest.fixture
def lane_pair():
    """Rank 0's LaneDriver over a fresh two-rank lane (4 slots of 4 KiB), rank 1's view of it, and
    the list of entries rank 0 handed to the engine."""
    import uuid

    from ringcomm.lane import driver, shm_lane
    from ringcomm.job import names
    from ringcomm.handles import Entry

    path = os.path.join(names.SHM_DIR, f"ringcomm-test-{uuid.uuid4().hex}-lane")
    mine = shm_lane.ShmLane(path, 0, 2, 4, 4096, create=True)
    peer = shm_lane.ShmLane(path, 1, 2, 4, 4096, create=False)
    submitted: list[Entry] = []
    lane_driver = driver.LaneDriver(mine, RecordingEngine(submitted), 4096, 0.0, 0.0)
    try:
        yield lane_driver, peer, submitted
    finally:
        lane_driver.close(timeout=1.0)
        peer.close()
        mine.close()
        if os.path.exists(path):
            os.unlink(path)


@pytest.fixture
def foreign_waits(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the threads that queue a wait for a peer's event on the fake device (its IPC),
    or wait for one themselves (``RINGCOMM_DEVICE_IPC_WAIT=host``), in order, from now until the
    test ends."""
    import threading

    from ringcomm_torch.device import FakeOps
    from ringcomm_torch.device_ipc_ops import FakeIpcEvent

    waits: list[str] = []
    real, real_host = FakeIpcEvent.on_stream_wait, FakeOps.wait_event

    def noted(self: FakeIpcEvent) -> None:
        if self.foreign:
            waits.append(threading.current_thread().name)
        real(self)

    def noted_host(self: FakeOps, event: object) -> None:
        if isinstance(event, FakeIpcEvent) and event.foreign:
            waits.append(threading.current_thread().name)
        real_host(self, event)

    monkeypatch.setattr(FakeIpcEvent, "on_stream_wait", noted)
    monkeypatch.setattr(FakeOps, "wait_event", noted_host)
    return waits
