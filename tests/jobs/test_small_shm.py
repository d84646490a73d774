"""A job in a container with a small /dev/shm (Docker's default is 64 MB) runs right, is never killed
by SIGBUS, and leaves /dev/shm empty, even when its launcher is killed while it starts.

Every shared-memory region reserves its pages when it is made, or that path falls back (sockets,
the ring) with one warning that says what it needed, what was free and what to change; the slot
rings between ranks are sized from the room there is (:mod:`ringcomm.shm.space`).  The jobs here
run as root in a private mount namespace (``unshare -m``) with their own small tmpfs on /dev/shm,
so what they leave there is theirs alone.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
from hypothesis import given, strategies as st

from conftest import ROOT, WORKERS, job_env
from ringcomm.job import names
from ringcomm.shm import slots as shm, space

MiB = 1 << 20
SEGMENT = 4 * MiB  # RINGCOMM_SEGMENT_BYTES's default: the slot size the rings ask for


# --------------------------------------------------------------------------- sizing, in memory


@given(slots=st.integers(1, 64), slot_bytes=st.integers(1024, 64 * MiB), min_bytes=st.integers(0, 8 * MiB),
       free=st.integers(0, 1 << 40), local=st.integers(1, 64))
def test_a_ring_fits_its_share_and_its_receiver_reads_its_shape_from_its_size(
        slots: int, slot_bytes: int, min_bytes: int, free: int, local: int) -> None:
    got = space.ring_geometry(slots, slot_bytes, min_bytes, free, local)
    share = free // (space.SHARE * local)
    if got is None:  # not even one page (or one smallest payload) fits the share
        assert share < slot_bytes and share // space.PAGE * space.PAGE < max(space.PAGE, min_bytes)
        return
    assert 1 <= got.slots <= slots and got.nbytes <= share
    if share >= slot_bytes:  # whole slots: as many as asked for and fit
        assert got.slot_bytes == slot_bytes and got.slots == min(slots, share // slot_bytes)
    else:  # one smaller slot of whole pages, for the payloads that fit it
        assert got.slots == 1 and got.slot_bytes % space.PAGE == 0
        assert max(space.PAGE, min_bytes) <= got.slot_bytes <= share < slot_bytes
    assert space.geometry_of(got.nbytes, slot_bytes) == got


@given(slots=st.integers(1, 16), free=st.integers(0, 1 << 36), more=st.integers(0, 1 << 36), local=st.integers(1, 16))
def test_more_room_never_makes_a_smaller_ring(slots: int, free: int, more: int, local: int) -> None:
    small = space.ring_geometry(slots, SEGMENT, 65536, free, local)
    large = space.ring_geometry(slots, SEGMENT, 65536, free + more, local)
    assert (small.nbytes if small else 0) <= (large.nbytes if large else 0)


@given(file_bytes=st.integers(-1, 1 << 34), slot_bytes=st.integers(1024, 64 * MiB))
def test_a_file_of_a_size_no_sender_makes_is_no_ring(file_bytes: int, slot_bytes: int) -> None:
    shape = space.geometry_of(file_bytes, slot_bytes)
    if shape is not None:
        assert shape.nbytes == file_bytes and shape.slots >= 1
        assert shape.slot_bytes == slot_bytes or (shape.slots == 1 and file_bytes % space.PAGE == 0)


def test_the_sizes_the_rings_take_in_common_containers() -> None:
    """np=4 after the small-op lane took its 16 MiB of a 64 MB /dev/shm: one whole slot each; np=2 in
    8 MB: one 2 MiB slot (larger segments go through the socket); in 1 MB: no ring."""
    assert space.ring_geometry(4, SEGMENT, 65536, 48 * MiB, 4) == space.RingGeometry(1, SEGMENT)
    assert space.ring_geometry(4, SEGMENT, 65536, 8 * MiB, 2) == space.RingGeometry(1, 2 * MiB)
    assert space.ring_geometry(4, SEGMENT, 65536, 1 * MiB, 2) == space.RingGeometry(1, 256 * 1024)
    assert space.ring_geometry(4, SEGMENT, 65536, 256 * 1024, 4) is None
    assert space.ring_geometry(4, SEGMENT, 65536, 24 << 30, 8) == space.RingGeometry(4, SEGMENT)


def test_the_message_names_the_path_the_bytes_and_the_fix() -> None:
    ring = names.shm_ring("abc", 0, 1, 2)
    text = space.no_space_text(ring, 16 * MiB, 3 * MiB)
    for part in (ring, "16777216 B", "3145728 B", "--shm-size", "emptyDir", "medium: Memory", "RINGCOMM_SHM_SLOTS"):
        assert part in text, (part, text)
    assert "RINGCOMM_SHM_LANE_BYTES" in space.no_space_text(names.shm_lane_region("abc", 0), 1, 0)
    assert "RINGCOMM_SHM_ALLREDUCE_PIECE_BYTES" in space.no_space_text(names.shm_allreduce_region("abc", 0), 1, 0)
    short = space.short_ring_text(ring, space.RingGeometry(4, SEGMENT), space.RingGeometry(1, MiB), 8 * MiB)
    assert "1 slot of 1.0 MiB" in short and "larger payloads go through the socket" in short
    assert "128.0 KiB (131072 B)" in space.short_ring_text(ring, space.RingGeometry(4, SEGMENT),
                                                           space.RingGeometry(1, 131072), MiB)


@pytest.mark.skipif(not shm.available(), reason="needs a writable /dev/shm")
@pytest.mark.timeout(60)
def test_the_sender_decides_the_ring_and_a_receiver_without_slots_of_its_own_reads_it(tmp_path) -> None:
    """Rank 0 sends through shared memory (RINGCOMM_SHM_SLOTS=2), rank 1 through its socket only (0): each
    reads what the other sends.  A receiver used to bound notifications by its own slot count and
    dropped every one of a peer that had slots while it had none, then waited for the peer timeout."""
    import numpy as np
    import zmq

    from ringcomm.net.auth import Credentials, ZapThread
    from ringcomm.net.transport import DataPlane

    ctx = zmq.Context()
    creds = Credentials.derive(b"k" * 32, "job", encrypt=False)
    zap = ZapThread(ctx, creds, "test")
    planes = [DataPlane(ctx, r, 2, 1 << 30, peer_timeout=5.0, shm_slots=slots, shm_slot_bytes=65536, shm_min_bytes=4096,
                        job_id=f"decide{os.getpid()}", credentials=creds) for r, slots in enumerate([2, 0])]
    try:
        tables = [p.bind(f"ipc://{tmp_path}/d{r}", "127.0.0.1") for r, p in enumerate(planes)]
        for r, p in enumerate(planes):
            p.connect(1 - r, tables[1 - r], same_host=True, description=f"rank {1 - r}")
        payload = np.arange(4096, dtype=np.float64)  # 32 KiB: between the bounds, into a slot
        rounds = 4
        for seq in range(rounds):  # more sends than slots: the acks come back
            planes[0].send(1, seq, 0, payload + seq)
            planes[1].send(0, seq, 0, payload - seq)
            assert np.array_equal(np.frombuffer(planes[1].recv(0, seq, 0), np.float64), payload + seq)
            assert np.array_equal(np.frombuffer(planes[0].recv(1, seq, 0), np.float64), payload - seq)
        # The receiver acks a slot when it next reads (the view it returned is in use until then), and the
        # sender never waits for an ack: a send that finds both slots taken goes inline.  The first send's
        # ack leaves with the receiver's second read, ahead of its third message: whether it is in when
        # the third send goes is up to the scheduler, but the sender reads past it in the third round, so
        # at least three of four sends use the ring, and every other one is a counted fallback.
        sent = planes[0].stats
        assert sent["shm"] >= 3 and sent["shm"] + sent["shm_full"] == rounds and sent["inline"] == sent["shm_full"]
        assert planes[1].stats["shm"] == 0 and planes[1].stats["inline"] == rounds
        assert planes[1].stats["dropped"] == 0
    finally:
        for p in planes:
            p.close()
        zap.stop()
        ctx.term()


# --------------------------------------------------------------------------- a private, small /dev/shm


def _why_no_private_shm() -> str | None:
    if not sys.platform.startswith("linux"):
        return "needs Linux mount namespaces"
    if os.geteuid() != 0:
        return "needs root to mount a private tmpfs on /dev/shm (unshare -m)"
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return "needs unshare and mount (util-linux)"
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"cannot mount a private tmpfs on /dev/shm: {probe.stderr.strip()}"
    return None


_NO_PRIVATE_SHM = _why_no_private_shm()
needs_private_shm = pytest.mark.skipif(_NO_PRIVATE_SHM is not None, reason=str(_NO_PRIVATE_SHM))


def _in_small_shm(mb: int, script: str, timeout: float) -> str:
    """Run ``script`` (bash) with a private /dev/shm of ``mb`` MB; its output, then ``RC=`` its status and
    ``LEFT=[...]`` what it left in /dev/shm."""
    body = (f"mount -t tmpfs -o size={mb}m tmpfs {names.SHM_DIR} || exit 99\n{script}\n"
            f"echo RC=$?\necho \"LEFT=[$(ls -A {names.SHM_DIR})]\"")
    done = subprocess.run(["unshare", "-m", "bash", "-c", body], capture_output=True, text=True, timeout=timeout,
                          env=job_env(), cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


#: (/dev/shm MB, ranks, payload bytes, options): the bar (64 MB np=4 up to 64 MiB; 8 MB np=2 at 16 MiB;
#: 1 MB at 1 and 16 MiB) and a small training loop, with few jobs.
JOBS = [
    (64, 4, [4096, MiB, 16 * MiB, 64 * MiB], []),
    (8, 2, [4096, 16 * MiB], ["--torch"]),
    (8, 4, [4096, MiB], ["--no-ring-on-rank", "1"]),
    (1, 2, [MiB, 16 * MiB], []),
    (1, 4, [4096, MiB, 16 * MiB], []),
]


@needs_private_shm
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mb,np_,sizes,options", JOBS, ids=[f"{j[0]}MB-np{j[1]}" for j in JOBS])
def test_a_job_in_a_small_dev_shm_is_right_and_leaves_it_empty(mb: int, np_: int, sizes: list[int],
                                                               options: list[str]) -> None:
    if "--torch" in options:
        pytest.importorskip("torch")
    worker = WORKERS / "small_shm_worker.py"
    command = " ".join([sys.executable, "-m", "ringcomm.launch.launcher", "-np", str(np_), sys.executable,
                        str(worker), *options, *map(str, sizes)])
    out = _in_small_shm(mb, command, timeout=280)
    assert "RC=0" in out and "SIGBUS" not in out, out[-4000:]
    assert all(f"SMALLSHM OK rank={r} " in out for r in range(np_)), out[-4000:]
    assert all(f"SMALLSHM {n} B right " in out for n in sizes), out[-4000:]
    assert "LEFT=[]" in out, out[-4000:]
    lines = out.splitlines()
    for r in range(np_):  # a rank whose rings fell short says so once, with what to change
        said = [ln for ln in lines if ln.startswith(f"[{r}]<stderr>:rank {r}: {names.SHM_DIR}/ringcomm-")]
        assert len(said) <= 1 and all("--shm-size" in ln and "RINGCOMM_SHM_SLOTS" in ln for ln in said), said
    if mb == 1:  # no room for the lane nor a whole slot: said, with the fix
        assert "small-op lane disabled" in out and "so larger payloads go through the socket" in out, out[-4000:]
    if mb == 64:  # the lane keeps its base size there (its larger slots would not fit a quarter of the room)
        assert "small-op lane disabled" not in out, out[-4000:]


@needs_private_shm
@pytest.mark.timeout(60)
def test_a_region_that_does_not_fit_fails_at_creation_with_the_fix_not_sigbus_at_first_write() -> None:
    code = textwrap.dedent(f"""
        import errno
        from ringcomm.shm import slots as shm
        path = {names.shm_ring("fit", 0, 0, 1)!r}
        try:
            shm.SlotRing(path, 4, {SEGMENT}, create=True)
        except OSError as exc:
            print("REFUSED", exc.errno == errno.ENOSPC, exc)
        ring = shm.SlotRing(path, 1, {256 * 1024}, create=True)
        ring.slot(0, {256 * 1024})[...] = 7  # every page reserved: the write cannot fault
        ring.unlink(); ring.close()
        print("WROTE")
    """)
    out = _in_small_shm(1, shlex.join([sys.executable, "-c", code]), timeout=50)
    assert "REFUSED True" in out and "WROTE" in out and "RC=0" in out, out
    assert "16777216 B" in out and "--shm-size" in out and "RINGCOMM_SHM_SLOTS" in out, out
    assert "LEFT=[]" in out, out


# --------------------------------------------------------------------------- nothing left when killed


_HOLD = """
import sys, time
from ringcomm.shm import slots as shm
f = shm.MappedFile(sys.argv[1], 65536, create=True, reserve=True)
print("made", flush=True)
time.sleep(60)
"""


def _gone_within(path: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not os.path.exists(path)


def test_the_launcher_asks_each_local_ranks_guard_to_remove_its_jobs_shared_memory() -> None:
    from ringcomm.launch import guard
    from ringcomm.launch.supervise import guard_command

    head = [sys.executable, "-I", os.path.abspath(guard.__file__), "7"]
    assert guard_command(7, ["prog", "x"], "ab12") == [*head, "--reclaim", names.job_globs("ab12")[0], "--", "prog", "x"]
    assert guard_command(7, ["prog"]) == [*head, "--", "prog"]  # an ssh to another host: nothing here to remove


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the guard's watcher needs Linux (prctl)")
@pytest.mark.timeout(60)
@pytest.mark.parametrize("killed", ["rank", "launcher"])
def test_the_guard_removes_what_its_rank_left_when_it_dies(tmp_path, killed: str) -> None:
    """A rank killed with SIGKILL (or by its launcher's death) cannot remove its named files; its guard's
    watcher, which outlives it, does, and only the dead's: a live process's file stays.  (In a folder of
    this test's own: every job's init() also sweeps /dev/shm of dead creators' files.)"""
    from ringcomm.launch import guard

    path, live_path = str(tmp_path / "ringcomm-job-0-lane"), str(tmp_path / "ringcomm-job-0-allreduce")
    rank_cmd = [sys.executable, "-c", _HOLD, path]
    launcher_code = textwrap.dedent(f"""
        import os, subprocess, sys, time
        p = subprocess.Popen([sys.executable, "-I", {os.path.abspath(guard.__file__)!r}, str(os.getpid()), "--reclaim",
                              {str(tmp_path / "ringcomm-job-*")!r}, "--", *{rank_cmd!r}], stdout=subprocess.PIPE, text=True)
        print(p.stdout.readline().strip(), p.pid, flush=True)
        time.sleep(60)
    """)  # a stand-in for ringcomm-run: starts the rank under the guard, then waits
    live = subprocess.Popen([sys.executable, "-c", _HOLD, live_path], stdout=subprocess.PIPE, text=True,
                            env=job_env(), cwd=ROOT)
    launcher = subprocess.Popen([sys.executable, "-c", launcher_code], stdout=subprocess.PIPE, text=True,
                                env=job_env(), cwd=ROOT)
    rank = -1
    try:
        assert live.stdout is not None and live.stdout.readline().strip() == "made"
        assert launcher.stdout is not None
        made, rank_pid = launcher.stdout.readline().split()
        rank = int(rank_pid)
        assert made == "made" and os.path.exists(path)
        os.kill(rank if killed == "rank" else launcher.pid, signal.SIGKILL)
        assert _gone_within(path, 15), f"{path} outlived its creator"
        assert os.path.exists(live_path)  # its creator lives: not the guard's to remove
    finally:
        for proc in (launcher, live):
            proc.kill()
            proc.wait(10)
        if rank > 0:
            try:
                os.kill(rank, signal.SIGKILL)
            except ProcessLookupError:
                pass


_MAIN_THREAD_EXITS = """
import ctypes, os, platform, sys, threading, time
from ringcomm.shm import slots as shm
f = shm.MappedFile(sys.argv[1], 65536, create=True, reserve=True)
threading.Thread(target=lambda: (time.sleep(float(sys.argv[2])), os._exit(0))).start()
print("made", flush=True)
ctypes.CDLL(None).syscall({"x86_64": 60, "aarch64": 93}[platform.machine()], 0)  # exit(2): this thread only
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "aarch64"),
                    reason="the guard's watcher needs Linux (prctl); the test ends one thread by its syscall number")
@pytest.mark.timeout(60)
def test_the_guard_waits_for_a_ranks_last_thread_before_it_judges_its_files() -> None:
    """The kernel tells the watcher when the rank's first thread exits; a thread still running holds the
    rank's files (and their locks) until it ends.  The watcher neither removes a file too early nor gives
    up on it: it waits for the last thread, then removes it."""
    from ringcomm.launch import guard

    with tempfile.TemporaryDirectory(dir=names.SHM_DIR if os.path.isdir(names.SHM_DIR) else None) as folder:
        path = os.path.join(folder, "ringcomm-job-0-lane")
        rank = subprocess.Popen([sys.executable, "-I", os.path.abspath(guard.__file__), str(os.getpid()), "--reclaim",
                                 os.path.join(folder, "ringcomm-job-*"), "--", sys.executable, "-c",
                                 _MAIN_THREAD_EXITS, path, "3"], stdout=subprocess.PIPE, text=True, env=job_env(),
                                cwd=ROOT)
        try:
            assert rank.stdout is not None and rank.stdout.readline().strip() == "made"
            time.sleep(1.0)
            assert not guard._exited(rank.pid)  # its main thread is gone, another one lives
            assert os.path.exists(path)  # held by the live thread: not the watcher's to remove
            assert _gone_within(path, 15), f"{path} outlived its creator's last thread"
        finally:
            rank.kill()
            rank.wait(10)
        assert guard._exited(rank.pid)


_KILL_DRIVER = """
import json, os, queue, subprocess, sys, threading, time
worker, moments = sys.argv[1], sys.argv[2:]

def ancestors():
    pid, found = os.getpid(), set()
    while pid > 1:
        found.add(str(pid))
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rpartition(")")[2].split()[1])
    return found

def running():
    found = []
    for pid in set(filter(str.isdigit, os.listdir("/proc"))) - ancestors():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if worker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found

def wait_for(lines, what, deadline, heard):
    while time.monotonic() < deadline:
        if what == "named" and os.listdir("/dev/shm"):
            return True
        try:
            line = lines.get(timeout=0.005)
        except queue.Empty:
            continue
        if line is None:
            heard.append("(the launcher's output ended)")
            return False
        heard.append(line.rstrip())
        if what in line:
            return True
    heard.append(f"(not within the deadline: {what!r})")
    return False

results = []
for moment in moments:
    launcher = subprocess.Popen([sys.executable, "-m", "ringcomm.launch.launcher", "-v", "-np", "4", sys.executable,
                                 worker, "--pause", "3", "--repeat", "1000", str(1 << 20), str(16 << 20)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in launcher.stdout] + [lines.put(None)], daemon=True).start()
    deadline = time.monotonic() + 90
    what, _, delay = moment.partition("+")
    heard = []  # the launcher's lines until the moment: shown when it was not reached
    reached = (wait_for(lines, "rank 3: pid", deadline, heard)
               and (what == "rank 3: pid" or wait_for(lines, what, deadline, heard)))
    time.sleep(float(delay or 0))
    seen = sorted(os.listdir("/dev/shm"))
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 30
    while running() and time.monotonic() < deadline:
        time.sleep(0.1)
    results.append({"moment": moment, "reached": reached, "seen": seen, "left": sorted(os.listdir("/dev/shm")),
                    "running": running(), "heard": [] if reached else heard[-40:]})
print("RESULTS", json.dumps(results))
"""


@needs_private_shm
@pytest.mark.timeout(400)
def test_a_launcher_killed_while_the_job_starts_leaves_dev_shm_empty(tmp_path) -> None:
    """SIGKILL to ringcomm-run at several moments after it started 4 ranks: as they import, once a file
    appears in /dev/shm (the small-op lane, named once the ranks met), once init() returned (the lane
    still named: no op ran yet), during the first large ops.  Once the ranks are gone /dev/shm is
    empty, and nobody is left."""
    worker = tmp_path / "kill_me_worker.py"  # a name of this test's own, to find its processes by
    shutil.copy(WORKERS / "small_shm_worker.py", worker)
    driver = tmp_path / "driver.py"
    driver.write_text(_KILL_DRIVER)
    moments = ["rank 3: pid", "rank 3: pid+1", "named", "named+0.05", "SMALLSHM up", "SMALLSHM 1048576 B right"]
    out = _in_small_shm(64, shlex.join([sys.executable, str(driver), str(worker), *moments]), timeout=380)
    line = next((ln for ln in out.splitlines() if ln.startswith("RESULTS ")), None)
    assert line is not None, out[-4000:]
    results = json.loads(line[len("RESULTS "):])
    unreached = [r for r in results if not r["reached"]]
    assert not unreached, "moments not reached, with the launcher's output until then:\n" + json.dumps(unreached, indent=1)
    assert all(r["seen"] for r in results if r["moment"] in ("named", "SMALLSHM up")), results  # files to leave
    assert [r["running"] for r in results] == [[]] * len(moments), results
    assert [r["left"] for r in results] == [[]] * len(moments), results
    assert "LEFT=[]" in out, out[-2000:]
