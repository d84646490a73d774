"""Elastic jobs end to end (``ringcomm-run --host-discovery-script``), hosts as localhost aliases.

- a worker of 4 is killed (SIGKILL) mid-training: the other 3 roll back to the last commit, re-form and
  finish; after the recovery every rank holds exactly the committed model and optimizer state;
- the discovery script offers one more slot: a new worker joins at the next commit and gets the state;
- below --min-np (the other host blacklisted) the job waits --elastic-timeout, then fails cleanly.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest

from _launcher_helpers import kill_leftovers, run_launcher, wait_gone

pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).resolve().parent
TORCH_WORKER = str(HERE.parent / "workers" / "torch_elastic_worker.py")
NP_WORKER = str(HERE.parent / "workers" / "elastic_np_worker.py")
LINE = re.compile(r"\[(\d+)\]<stdout>:(SYNC|COMMIT|DONE) worker=(\d+) rank=(\d+) size=(\d+) step=(\d+) hash=(\w+)")


def records(stdout: str) -> list[dict]:
    out = []
    for m in LINE.finditer(stdout):
        out.append(dict(kind=m[2], worker=int(m[3]), rank=int(m[4]), size=int(m[5]), step=int(m[6]), hash=m[7]))
    return out


def worker_pids(stderr: str) -> list[int]:
    return [int(p) for p in re.findall(r"worker \d+: pid (\d+)", stderr)]


def check_all_gone(stderr: str) -> None:
    pids = worker_pids(stderr)
    assert pids, stderr
    left = wait_gone(pids, timeout=5.0)
    kill_leftovers(left)
    assert not left, f"workers still running after the launcher exited: {left}"


@pytest.mark.timeout(150)
def test_lost_worker_training_continues_from_the_last_commit(tmp_path):
    pytest.importorskip("torch")  # the workers train a torch model
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:1\n127.0.0.2:1\n127.0.0.3:1\n127.0.0.4:1\n")
    result, _ = run_launcher(
        "-v", "-np", "4", "--min-np", "2", "--max-np", "4", "--host-discovery-script", f"cat {hosts}",
        "--elastic-timeout", "30", sys.executable, TORCH_WORKER, "--epochs", "2", "--commit-every", "4",
        "--kill-rank", "1", "--kill-step", "10", "--marker", str(tmp_path / "killed"), "--hosts-file", str(hosts),
        timeout=140,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    check_all_gone(result.stderr)
    assert "KILL worker=1 rank=1 step=10" in result.stdout
    assert "generation 1: 3 workers" in result.stderr, out
    recs = records(result.stdout)
    # before the loss: 4 ranks; the last commit before step 10 is step 8, the same state on every rank
    commits4 = [r for r in recs if r["kind"] == "COMMIT" and r["size"] == 4 and r["step"] == 8]
    assert len(commits4) == 4 and len({r["hash"] for r in commits4}) == 1, out
    committed = commits4[0]["hash"]
    # the survivors (progress past step 8 was lost with the worker) restored it and synced: equal everywhere
    syncs3 = [r for r in recs if r["kind"] == "SYNC" and r["size"] == 3]
    assert sorted(r["worker"] for r in syncs3) == [0, 2, 3], out
    assert {(r["step"], r["hash"]) for r in syncs3} == {(8, committed)}, out
    assert sorted(r["rank"] for r in syncs3) == [0, 1, 2]
    # ... and finished: 64 samples were done in epoch 1 at the commit; 128 left over 3 ranks of 8 -> 6 steps
    done = [r for r in recs if r["kind"] == "DONE"]
    assert len(done) == 3 and {(r["size"], r["step"]) for r in done} == {(3, 14)}, out
    assert len({r["hash"] for r in done}) == 1


@pytest.mark.timeout(150)
def test_discovered_slot_grows_the_job_at_the_next_commit(tmp_path):
    """With RINGCOMM_PORT_RANGE set, the driver's store and every generation's rendezvous listen in it."""
    pytest.importorskip("torch")  # the workers train a torch model
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:1\n127.0.0.2:1\n")
    low = 24000 + (os.getpid() % 400) * 10  # ports below the ephemeral range; a taken one is skipped
    result, _ = run_launcher(
        "-v", "-np", "2", "--min-np", "2", "--max-np", "3", "--host-discovery-script", f"cat {hosts}",
        "--elastic-timeout", "30", sys.executable, TORCH_WORKER, "--epochs", "1", "--commit-every", "2",
        "--sleep", "0.05", "--grow-host", "127.0.0.3", "--grow-step", "3", "--grow-to", "3",
        "--hosts-file", str(hosts), timeout=140, RINGCOMM_PORT_RANGE=f"{low}-{low + 99}",
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    store_port = int(re.search(r"driver store at tcp://[^:]+:(\d+)", result.stderr).group(1))
    assert low <= store_port <= low + 99, out
    check_all_gone(result.stderr)
    assert "hosts changed" in result.stderr and "generation 1: 3 workers" in result.stderr, out
    recs = records(result.stdout)
    last2 = [r for r in recs if r["kind"] == "COMMIT" and r["size"] == 2][-1]
    syncs3 = [r for r in recs if r["kind"] == "SYNC" and r["size"] == 3]
    # the new worker 2 started from other random weights; sync() gave it the commit the others stopped at
    assert sorted(r["worker"] for r in syncs3) == [0, 1, 2], out
    assert {(r["step"], r["hash"]) for r in syncs3} == {(last2["step"], last2["hash"])}, out
    done = [r for r in recs if r["kind"] == "DONE"]
    assert len(done) == 3 and {r["size"] for r in done} == {3} and len({r["hash"] for r in done}) == 1, out


@pytest.mark.timeout(90)
def test_a_stopped_worker_is_killed_on_the_survivors_reports_and_the_job_goes_on(tmp_path):
    """A worker whose process is stopped (SIGSTOP: a wedged machine) never exits and never re-forms: the
    survivors' loss reports get it killed at once, not after --elastic-timeout, and the job finishes."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:1\n127.0.0.2:1\n127.0.0.3:1\n")
    result, elapsed = run_launcher(
        "-v", "-np", "3", "--min-np", "2", "--max-np", "3", "--host-discovery-script", f"cat {hosts}",
        "--elastic-timeout", "60", sys.executable, NP_WORKER, "--steps", "12", "--sleep", "0.1",
        "--freeze-host", "127.0.0.2", timeout=80, RINGCOMM_PEER_TIMEOUT="3",
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    check_all_gone(result.stderr)
    assert "[1]<stdout>:FREEZE rank=1" in out, out
    # a stopped process is stopped on the first survivor's report: the other's may come before or after
    assert re.search(r"generation 0: (rank 0|rank 2|ranks 0, 2) lost worker 1 \(rank 1\) on 127\.0\.0\.2 "
                     r"\(its process is stopped\); stopping it", result.stderr), out
    assert "worker 1 on 127.0.0.2" in result.stderr and "killed by signal SIGKILL" in result.stderr, out
    assert "generation 1: 2 workers" in result.stderr and "did not come back" not in result.stderr, out
    assert sorted(re.findall(r"DONE rank=(\d) size=2 step=12", result.stdout)) == ["0", "1"], out
    assert elapsed < 45, f"{elapsed:.1f} s: the stopped worker was waited for ({out})"


@pytest.mark.timeout(60)
def test_below_min_np_waits_for_the_elastic_timeout_then_fails_cleanly(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:1\n127.0.0.2:1\n")
    result, elapsed = run_launcher(
        "-v", "-np", "2", "--min-np", "2", "--blacklist-failures", "1", "--host-discovery-script", f"cat {hosts}",
        "--elastic-timeout", "3", sys.executable, NP_WORKER, "--fail-host", "127.0.0.2", timeout=50,
    )
    err = result.stderr
    assert result.returncode == 1, result.stdout + err
    check_all_gone(err)
    assert "host 127.0.0.2 blacklisted" in err
    assert "waiting up to 3 s (--elastic-timeout)" in err
    assert ("elastic job failed: only 1 worker(s) could run and --min-np is 2; no more slots appeared within "
            "--elastic-timeout 3 s. Discovered hosts: localhost:1, 127.0.0.2:1 (blacklisted") in err
    assert "RuntimeError: worker on 127.0.0.2 fails on purpose" in err  # the root cause's last lines
    assert elapsed >= 3.0
    assert "DONE" not in result.stdout


@pytest.mark.timeout(120)
def test_rank_0_sees_the_drivers_notice_and_workers_are_told_where_they_started(tmp_path):
    """Horovod's elastic scenario scripts: ``state._host_messages.empty()`` turns False once the driver has
    seen a new host, and HOROVOD_HOSTNAME / HOROVOD_RANK / HOROVOD_SIZE give each worker's start."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    result, _ = run_launcher(
        "-v", "-np", "2", "--min-np", "2", "--max-np", "3", "--host-discovery-script", f"cat {hosts}",
        "--elastic-timeout", "30", sys.executable, str(HERE.parent / "workers" / "elastic_notice_worker.py"),
        "--hosts-file", str(hosts), "--add", "127.0.0.2:1", timeout=110,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    check_all_gone(result.stderr)
    assert re.search(r"NOTICED after=\d", result.stdout), out
    ends = sorted(re.findall(r"END host=(\S+) start_rank=(\d) start_size=(\d) rank=(\d) size=(\d) epochs=(\d)",
                             result.stdout))
    assert ends == [("127.0.0.2", "2", "3", "2", "3", "3"), ("localhost", "0", "2", "0", "3", "3"),
                    ("localhost", "1", "2", "1", "3", "3")], out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("discovery", ["script", "fixed hosts"])
def test_a_failed_worker_takes_its_hosts_other_workers_out_of_the_job(tmp_path, discovery):
    """As Horovod: the failure blacklists the host, and the job goes on with the other host's workers only.
    With -H and --min-np instead of a discovery script (horovodrun's fault tolerance without scaling) too."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n127.0.0.2:2\n")
    where = ["--host-discovery-script", f"cat {hosts}"] if discovery == "script" else ["-H", "localhost:2,127.0.0.2:2"]
    result, _ = run_launcher(
        "-v", "-np", "4", "--min-np", "2", *where, "--elastic-timeout", "30",
        sys.executable, NP_WORKER, "--steps", "8", "--fail-start-ranks", "0", timeout=110,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    check_all_gone(result.stderr)
    assert "host localhost blacklisted" in result.stderr, out
    assert "worker 1 on localhost removed from the job: its host is blacklisted" in result.stderr, out
    assert "generation 1: 2 workers (worker 2@127.0.0.2 -> rank 0, worker 3@127.0.0.2 -> rank 1)" in result.stderr
    done = sorted(re.findall(r"\[(\d)\]<stdout>:DONE rank=(\d) size=(\d) step=8", result.stdout))
    assert done == [("2", "0", "2"), ("3", "1", "2")], out


@pytest.mark.timeout(120)
def test_the_job_fails_at_once_when_every_survivor_is_on_a_blacklisted_host(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n127.0.0.2:2\n")
    start = time.monotonic()
    result, _ = run_launcher(
        "-v", "-np", "4", "--min-np", "2", "--host-discovery-script", f"cat {hosts}", "--elastic-timeout", "100",
        sys.executable, NP_WORKER, "--steps", "8", "--fail-start-ranks", "0", "2", timeout=110,
    )
    assert result.returncode != 0
    check_all_gone(result.stderr)
    assert ("elastic job failed: every surviving worker ran on a blacklisted host (127.0.0.2, localhost), so none "
            "is left to pass the state on") in result.stderr, result.stdout + result.stderr
    assert time.monotonic() - start < 80  # not after --elastic-timeout


@pytest.mark.timeout(90)
def test_the_first_generation_takes_every_offered_slot_up_to_max_np(tmp_path):
    """As Horovod: -np is the least to start with; 4 slots offered and --max-np 3 give 3 workers at once."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n127.0.0.2:2\n")
    result, _ = run_launcher(
        "-v", "-np", "2", "--max-np", "3", "--host-discovery-script", f"cat {hosts}", "--elastic-timeout", "30",
        sys.executable, NP_WORKER, "--steps", "3", timeout=80,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    check_all_gone(result.stderr)
    assert "generation 0: 3 workers (worker 0@localhost -> rank 0, worker 1@localhost -> rank 1, " \
           "worker 2@127.0.0.2 -> rank 2)" in result.stderr, out
    assert "generation 1" not in result.stderr, out
    assert len(re.findall(r"DONE rank=\d size=3 step=3", result.stdout)) == 3, out
