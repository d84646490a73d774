"""ringcomm-run with real worker processes (tiny ``python -c`` scripts)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from _launcher_helpers import (
    REPO_ROOT,
    LiveLauncher,
    alive,
    kill_leftovers,
    launcher_cmd,
    launcher_env,
    run_launcher,
    spawned_pids,
    wait_gone,
    worker,
)
from ringcomm.launch import launcher

pytestmark = pytest.mark.multiprocess

ENV_DUMP = """
import json, os, sys
keys = sorted(k for k in os.environ if k.startswith("RINGCOMM_")) + ["PYTHONUNBUFFERED"]
print(json.dumps({k: os.environ.get(k) for k in keys}))
print("err from", os.environ["RINGCOMM_RANK"], file=sys.stderr)
"""


@pytest.mark.timeout(30)
def test_three_ranks_prefix_output_and_get_their_environment(tmp_path):
    timeline = str(tmp_path / "timeline.json")
    result, _ = run_launcher(
        "-np", "3", "-H", "localhost:3", "--start-timeout", "7.5", "--timeline-filename", timeline,
        *worker(ENV_DUMP),
    )
    assert result.returncode == 0, result.stderr
    envs = {}
    for line in result.stdout.splitlines():
        m = re.fullmatch(r"\[(\d)\]<stdout>:(.*)", line)
        assert m, f"unprefixed stdout line {line!r}"
        envs[int(m.group(1))] = json.loads(m.group(2))
    assert sorted(envs) == [0, 1, 2]
    assert sorted(re.findall(r"^\[(\d)\]<stderr>:err from (\d)$", result.stderr, re.M)) == [
        ("0", "0"), ("1", "1"), ("2", "2")
    ]
    for rank, env in envs.items():
        assert env["RINGCOMM_RANK"] == env["RINGCOMM_LOCAL_RANK"] == str(rank)
        assert env["RINGCOMM_SIZE"] == env["RINGCOMM_LOCAL_SIZE"] == "3"
        assert (env["RINGCOMM_CROSS_RANK"], env["RINGCOMM_CROSS_SIZE"]) == ("0", "1")
        assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", env["RINGCOMM_RENDEZVOUS_ADDR"])
        assert re.fullmatch(r"[0-9a-f]{64}", env["RINGCOMM_SECRET"])
        assert re.fullmatch(r"[0-9a-f]{8}", env["RINGCOMM_JOB_ID"])
        assert float(env["RINGCOMM_START_TIMEOUT"]) == 7.5
        assert env["RINGCOMM_TIMELINE"] == timeline
        assert env["PYTHONUNBUFFERED"] == "1"
    for key in ("RINGCOMM_RENDEZVOUS_ADDR", "RINGCOMM_SECRET", "RINGCOMM_JOB_ID"):
        assert len({env[key] for env in envs.values()}) == 1, key


@pytest.mark.timeout(30)
def test_workers_assemble_through_the_launchers_rendezvous():
    code = """
import json, os
from ringcomm.net.rendezvous import register
rank, size = int(os.environ["RINGCOMM_RANK"]), int(os.environ["RINGCOMM_SIZE"])
table = register(os.environ["RINGCOMM_RENDEZVOUS_ADDR"], bytes.fromhex(os.environ["RINGCOMM_SECRET"]),
                 rank, size, {"rank": rank, "pid": os.getpid()}, timeout=20.0)
print(json.dumps([entry["rank"] for entry in table]))
"""
    result, _ = run_launcher("-np", "3", *worker(code))
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == [f"[{r}]<stdout>:[0, 1, 2]" for r in range(3)]


@pytest.mark.timeout(30)
def test_partial_lines_and_undecodable_bytes():
    code = r"""
import sys
sys.stdout.buffer.write(b"first\n\xff\xfe bytes\r\nno newline at the end")
sys.stdout.flush()
sys.stderr.write("e1\ne2")
"""
    result, _ = run_launcher("-np", "1", *worker(code))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "[0]<stdout>:first",
        "[0]<stdout>:\ufffd\ufffd bytes",
        "[0]<stdout>:no newline at the end",
    ]
    assert result.stderr.splitlines() == ["[0]<stderr>:e1", "[0]<stderr>:e2"]


@pytest.mark.timeout(30)
def test_a_failing_rank_stops_the_others_and_is_named_as_the_root_cause():
    code = """
import os, sys, time
rank = int(os.environ["RINGCOMM_RANK"])
if rank == 1:
    print("working on it")
    print("Traceback: something broke on rank 1", file=sys.stderr)
    sys.exit(3)
time.sleep(60)
"""
    result, elapsed = run_launcher("-v", "-np", "3", *worker(code))
    pids = spawned_pids(result.stderr)
    try:
        assert result.returncode == 3, result.stderr
        assert elapsed < 10
        assert sorted(pids) == [0, 1, 2]
        assert "ringcomm-run: job failed" in result.stderr
        assert f"root cause: rank 1 (pid {pids[1]}) exited with code 3" in result.stderr
        block = result.stderr.split("last lines of rank 1:")[1]
        assert "    working on it" in block and "    Traceback: something broke on rank 1" in block
        assert "stopped by ringcomm-run: ranks 0, 2" in result.stderr
        assert "rank 0 (pid" not in result.stderr.split("root cause")[1].split("stopped by")[0]
        assert wait_gone(pids.values()) == []
    finally:
        kill_leftovers(pids.values())


@pytest.mark.timeout(30)
def test_two_ranks_that_lost_each_other_while_both_ran_are_reported_as_a_lost_link():
    # what two ranks print when the network between them breaks: each names the other as lost, and
    # each ends with its own error code (the first exits a moment before the second)
    code = """
import os, sys, time
rank = int(os.environ["RINGCOMM_RANK"])
time.sleep(0.2 * (1 - rank))
print(f"ringcomm.errors.PeerLostError: rank {rank}: lost rank {1 - rank} (no data for 3 s)", file=sys.stderr)
sys.exit(3)
"""
    result, _ = run_launcher("-v", "-np", "2", *worker(code))
    pids = spawned_pids(result.stderr)
    try:
        assert result.returncode == 3, result.stderr
        cause = result.stderr.split("root cause:")[1].splitlines()[0]
        assert "rank 1 (pid" in cause and "lost its connection to rank 0" in cause, result.stderr
        assert "the link between them" in cause and "failed because of it" not in cause, result.stderr
        assert "rank 1 exited with code 3, rank 0 exited with code 3" in cause, result.stderr
    finally:
        kill_leftovers(pids.values())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("survivors_exit", ["0", "3"])
def test_a_stopped_rank_the_others_lost_is_ended_and_named_whatever_they_exit_with(survivors_exit):
    """Rank 1 stops itself (SIGSTOP); ranks 0 and 2 catch the PeerLostError and exit: the launcher, told by
    them which rank they lost, SIGKILLs it and names it as the root cause (it used to wait forever when
    they exited 0)."""
    worker_file = str(REPO_ROOT / "tests" / "workers" / "stop_self_worker.py")
    result, _ = run_launcher("-v", "-np", "3", sys.executable, worker_file, timeout=50,
                             RINGCOMM_PEER_TIMEOUT="3", SURVIVOR_EXIT=survivors_exit)
    ended = time.time()
    pids = spawned_pids(result.stderr)
    try:
        err = result.stderr
        assert result.returncode == 128 + signal.SIGKILL, err[-4000:]
        stopped_at = float(re.search(r"STOPPING at ([\d.]+)", result.stdout)[1])
        for r in (0, 2):
            assert f"CAUGHT rank={r} lost=1" in result.stdout, result.stdout[-4000:]
        assert "(its process is stopped); stopping it" in err, err[-4000:]
        cause = err.split("root cause:")[1].splitlines()[0]
        because = "reported losing it" if survivors_exit == "0" else "failed because of it"
        assert cause == (f" rank 1 (pid {pids[1]}) stopped answering (ranks 0, 2 {because}); ringcomm-run then "
                         "stopped it (was killed by signal SIGKILL)"), err[-4000:]
        assert ended - stopped_at < 15, f"the launcher ended {ended - stopped_at:.1f} s after the SIGSTOP"
        assert wait_gone(pids.values()) == []
    finally:
        kill_leftovers(pids.values())


@pytest.mark.timeout(30)
def test_a_rank_killed_by_a_signal():
    code = """
import os, signal, time
if os.environ["RINGCOMM_RANK"] == "0":
    print("going down", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(60)
"""
    result, elapsed = run_launcher("-v", "-np", "2", *worker(code))
    pids = spawned_pids(result.stderr)
    try:
        assert result.returncode == 128 + signal.SIGKILL, result.stderr
        assert elapsed < 10
        assert f"root cause: rank 0 (pid {pids[0]}) was killed by signal SIGKILL" in result.stderr
        assert "    going down" in result.stderr
        assert wait_gone(pids.values()) == []
    finally:
        kill_leftovers(pids.values())


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "argv, message",
    [
        (["-np", "0", "python"], "-np must be at least 1"),
        (["-np", "-2", "python"], "-np must be at least 1"),
        (["python", "x.py"], "-np"),
        (["-np", "2"], "no command given"),
        (["-np", "2", "-H", "host1:2,host1:2", "python"], "host 'host1' is listed twice"),
        (["-np", "2", "-H", "host1:x", "python"], "'host1:x' is not host:slots"),
        (["-np", "2", "-H", "a:1", "--hostfile", "f", "python"], "not allowed with argument"),
        (["-np", "2", "--hostfile", "/nonexistent/hosts", "python"], "cannot read --hostfile /nonexistent/hosts"),
        (["-np", "2", "--ssh-port", "0", "python"], "--ssh-port must be 1..65535"),
        (["-np", "3", "-H", "localhost:2", "python"], "needs 3 slots"),
        (["-np", "2", "--start-timeout", "0", "python"], "--start-timeout must be > 0"),
    ],
)
def test_usage_errors_say_what_to_pass(argv, message, capsys):
    assert launcher.main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.timeout(30)
def test_np_zero_from_the_command_line():
    result, _ = run_launcher("-np", "0", *worker("print('never')"))
    assert result.returncode == 2
    assert "-np must be at least 1" in result.stderr
    assert result.stdout == ""


@pytest.mark.timeout(30)
def test_missing_program_is_reported():
    result, _ = run_launcher("-np", "2", "/nonexistent/ringcomm-test-program")
    assert result.returncode == 127
    assert "cannot start /nonexistent/ringcomm-test-program" in result.stderr


@pytest.mark.timeout(30)
def test_a_script_without_a_shebang_line_is_reported_by_rank_with_the_fix(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('never')\n")  # executable, but no '#!' line: exec fails with ENOEXEC
    script.chmod(0o755)
    result, _ = run_launcher("-np", "2", str(script))
    assert result.returncode == 126, result.stderr
    for rank in (0, 1):
        assert (f"[{rank}]<stderr>:rank {rank}: cannot start {script}: [Errno 8] Exec format error; give the "
                f"script a '#!' line, or run it through its interpreter (e.g. python {script})") in result.stderr
    assert "ringcomm-run: job failed" in result.stderr and "never" not in result.stdout


SPAWN_CHILD = """
import os, subprocess, sys, time
rank = int(os.environ["RINGCOMM_RANK"])
child = subprocess.Popen(["sleep", "60"])
print(f"rank {rank} child {child.pid}", flush=True)
"""


@pytest.mark.timeout(30)
def test_children_of_workers_are_not_orphaned_when_the_job_succeeds():
    result, elapsed = run_launcher("-v", "-np", "2", *worker(SPAWN_CHILD))  # workers exit, children keep running
    children = [int(p) for p in re.findall(r"child (\d+)", result.stdout)]
    try:
        assert result.returncode == 0, result.stderr
        assert len(children) == 2
        assert elapsed < 10
        assert "left processes in its group" in result.stderr
        assert wait_gone(children) == []
    finally:
        kill_leftovers(children)


@pytest.mark.timeout(30)
def test_children_of_workers_are_not_orphaned_when_a_rank_fails(tmp_path):
    flag = tmp_path / "rank0-ready"
    code = SPAWN_CHILD + f"""
flag = {str(flag)!r}
if rank == 0:
    open(flag, "w").close()
    time.sleep(60)
while not os.path.exists(flag):
    time.sleep(0.01)
sys.exit(4)
"""
    result, elapsed = run_launcher("-v", "-np", "2", *worker(code))
    children = [int(p) for p in re.findall(r"child (\d+)", result.stdout)]
    pids = list(spawned_pids(result.stderr).values())
    try:
        assert result.returncode == 4, result.stderr
        assert elapsed < 10
        assert "root cause: rank 1" in result.stderr
        assert len(children) == 2 and len(pids) == 2
        assert wait_gone(children + pids) == []
    finally:
        kill_leftovers(children + pids)


READY_AND_WAIT = """
import os, signal, subprocess, sys, time
rank = int(os.environ["RINGCOMM_RANK"])
if rank == 0 and len(sys.argv) > 1:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)   # a stubborn worker: only SIGKILL stops it
child = subprocess.Popen(["sleep", "60"])
print(f"rank {rank} pid {os.getpid()} child {child.pid} ready", flush=True)
time.sleep(60)
"""


def _start_and_wait_ready(np_: int, *extra: str) -> tuple[LiveLauncher, list[int]]:
    live = LiveLauncher("-np", str(np_), *worker(READY_AND_WAIT), *extra)
    matches = live.wait_for(r"pid (\d+) child (\d+) ready", count=np_)
    return live, [int(p) for m in matches for p in m.groups()]


@pytest.mark.timeout(30)
def test_ctrl_c_to_the_launcher_stops_every_process():
    live, pids = _start_and_wait_ready(3)
    try:
        assert all(alive(p) for p in pids)
        live.proc.send_signal(signal.SIGINT)
        assert live.finish(timeout=10) == 130
        assert "received SIGINT" in "".join(live.stderr)
        assert "job failed" not in "".join(live.stderr)  # ranks stopped by the launcher are not a failure
        assert wait_gone(pids) == []
    finally:
        kill_leftovers(pids)


@pytest.mark.timeout(30)
def test_sigterm_to_the_launcher_escalates_to_sigkill_after_the_grace():
    live, pids = _start_and_wait_ready(2, "stubborn")
    try:
        live.proc.send_signal(signal.SIGTERM)
        assert live.finish(timeout=15) == 143
        assert wait_gone(pids) == []
    finally:
        kill_leftovers(pids)


@pytest.mark.timeout(30)
def test_verbose_prints_job_id_address_and_pids():
    result, _ = run_launcher("-v", "-np", "2", *worker("pass"))
    assert result.returncode == 0, result.stderr
    assert re.search(r"job [0-9a-f]{8}: 2 workers, rendezvous at tcp://127\.0\.0\.1:\d+", result.stderr)
    assert sorted(spawned_pids(result.stderr)) == [0, 1]


@pytest.mark.timeout(10)
def test_exit_descriptions():
    from ringcomm.launch.supervise import describe_exit, exit_status

    assert describe_exit(3) == "exited with code 3"
    assert describe_exit(-signal.SIGSEGV) == "was killed by signal SIGSEGV"
    assert exit_status(3) == 3 and exit_status(-signal.SIGKILL) == 137


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
@pytest.mark.timeout(10)
def test_alive_helper_sees_our_own_process():
    assert alive(os.getpid())


@pytest.mark.timeout(30)
def test_output_survives_a_launcher_that_cannot_encode_it():
    code = 'import sys; sys.stdout.buffer.write(b"caf\\xc3\\xa9\\n")'
    result, _ = run_launcher("-np", "1", *worker(code), PYTHONIOENCODING="ascii")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "[0]<stdout>:caf\\xe9\n"


@pytest.mark.timeout(30)
def test_a_sigkilled_launcher_leaves_no_worker_running():
    """SIGKILL gives the launcher no chance to stop anyone: its workers get SIGTERM from the kernel."""
    live, pids = _start_and_wait_ready(2)
    workers = pids[0::2]  # (pid, child) pairs: the ranks themselves
    try:
        assert all(alive(p) for p in workers)
        live.proc.kill()
        live.proc.wait(10)
        assert wait_gone(workers, timeout=10) == []
    finally:
        kill_leftovers(pids)


@pytest.mark.timeout(40)
def test_a_worker_that_ignores_sigterm_does_not_outlive_a_sigkilled_launcher():
    """The kernel's SIGTERM is not enough for a stubborn worker: the guard's watcher follows with SIGKILL."""
    code = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(60)")
    proc = subprocess.Popen(launcher_cmd("-v", "-np", "2", sys.executable, "-c", code), env=launcher_env(),
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(2):
            assert "ready" in proc.stdout.readline()
        time.sleep(0.5)
        workers = [p for p in _children_pids(proc.pid)]
        assert len(workers) >= 2, workers
        proc.kill()
        proc.wait(10)
        assert wait_gone(workers, timeout=15) == [], "a worker outlived the launcher"
    finally:
        proc.kill()


def _children_pids(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
@pytest.mark.timeout(40)
def test_ps_shows_each_guard_as_a_short_line_that_names_the_rank_command():
    """The guard's watcher lives as long as the rank: ``ps`` shows the guard's file and the command, not its source."""
    from ringcomm.launch import guard

    code = "import time; print('ready', flush=True); time.sleep(30)"
    proc = subprocess.Popen(launcher_cmd("-np", "1", sys.executable, "-c", code), env=launcher_env(),
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "ready" in proc.stdout.readline()
        ranks = _children_pids(proc.pid)
        assert len(ranks) == 1, ranks
        with open(f"/proc/{ranks[0]}/cmdline", "rb") as f:
            assert f.read().split(b"\0")[:3] == [sys.executable.encode(), b"-c", code.encode()]
        watchers = _children_pids(ranks[0])
        assert len(watchers) == 1, watchers
        with open(f"/proc/{watchers[0]}/cmdline", "rb") as f:
            line = f.read().rstrip(b"\0").split(b"\0")
        assert line[:5] == [sys.executable.encode(), b"-I", os.path.abspath(guard.__file__).encode(),
                            str(proc.pid).encode(), b"--reclaim"], line
        assert re.fullmatch(rb"/dev/shm/ringcomm-[0-9a-f]+-\*", line[5]), line  # what the rank may leave there
        assert line[6:] == [b"--", sys.executable.encode(), b"-c", code.encode()], line
        assert len(b" ".join(line)) < 300 + len(code), line
    finally:
        proc.kill()
        proc.wait(10)


def test_starting_the_launcher_loads_neither_numpy_nor_the_runtime() -> None:
    """``ringcomm-run`` imports only what starting a job needs (the package's names load on first
    use), so that it starts on a fraction of a rank's CPU, also from a slow shared file system."""
    code = ("import sys, ringcomm.launch.launcher, ringcomm.launch.elastic_driver\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('numpy', 'torch') or m in "
            "('ringcomm.api', 'ringcomm.engine', 'ringcomm.runtime')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=launcher_env())
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout
