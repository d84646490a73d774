"""Fault injection: each failure is staged without a launcher, under ringcomm-run and in an elastic job.

The job must never hang and must name the rank that failed:

- a rank killed (SIGKILL) mid-loop, at every position: survivors raise naming it within 10 s
  (tests/jobs/test_dead_peer_without_launcher.py for the job without a launcher), the launcher's root
  cause is that rank, and an elastic job re-forms within 10 s;
- a rank that registers at the rendezvous and dies before connecting;
- a rank stopped (SIGSTOP), and a rank that ends its program (exit code 0) while the others still
  need it: survivors and the launcher name it;
- a rank refusing a call (bad arguments): tests/core/test_refused_calls.py and the job without a launcher
  below; in an elastic job such an error (and a mismatch) ends the job at once instead of re-forming;
- the launcher of an elastic job killed: no worker outlives it (tests/launch/test_launcher.py for a plain job);
- a job started without a launcher that listens beyond loopback refuses to start without RINGCOMM_SECRET.

RINGCOMM_FAULT_REPEATS sets the repetitions per case (default 1; run with 5 or more before a release,
to catch races that strike one run in a few).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _launcher_helpers import LiveLauncher, alive, kill_leftovers, run_launcher, wait_gone
from conftest import WORKERS, remove_files_of, start_torchrun_job

pytestmark = pytest.mark.multiprocess

REPEATS = int(os.environ.get("RINGCOMM_FAULT_REPEATS", "1"))
LOOP = str(WORKERS / "dead_peer_loop_worker.py")
ELASTIC = str(WORKERS / "elastic_fault_worker.py")
OPS = ["allgather", "allreduce", "broadcast"]


def _victims(n: int, start: int = 1) -> list[int]:
    """``n`` victims cycling over every position of 4 ranks, starting with ``start``."""
    return [(start + i) % 4 for i in range(n)]


def _finish_survivors(procs, victim: int, since: float, timeout: float = 60,
                      wait_victim: bool = False) -> tuple[dict, dict]:
    outs, took = {}, {}
    try:
        for r, p in enumerate(procs):
            if r != victim:
                try:
                    outs[r] = p.communicate(timeout=timeout)[0]
                except subprocess.TimeoutExpired:
                    raise AssertionError(f"rank {r} still ran {timeout} s after rank {victim}'s fault; its stacks:\n"
                                         + _stacks(p)) from None
                took[r] = time.monotonic() - since
        if wait_victim:
            procs[victim].wait(timeout=timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
            p.wait()
        remove_files_of([p.pid for p in procs], [p.job_id for p in procs])
    return outs, took


def _stacks(proc) -> str:
    """What a loop worker still running prints when asked for its threads' stacks (SIGUSR2), then ends."""
    proc.send_signal(signal.SIGCONT)
    proc.send_signal(signal.SIGUSR2)
    time.sleep(1.0)
    proc.kill()
    return proc.communicate()[0][-8000:]


def _outputs(procs, timeout: float) -> list[str]:
    """Each process's output once all have ended (within ``timeout`` each); none is left running."""
    try:
        return [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _check_named(procs, outs: dict, took: dict, victim: int, where: str, limit: float) -> None:
    print(f"{where}: survivors raised after " + ", ".join(f"{t:.2f}" for t in took.values()) + " s")
    for r, out in outs.items():
        at = f"{where}, survivor {r}"
        assert procs[r].returncode == 3, f"{at}: {out}"
        assert "PeerLostError" in out and f"lost rank {victim} " in out, f"{at}: {out}"
        assert took[r] < limit, f"{at}: took {took[r]:.1f} s"


# -- without a launcher ---------------------------------------------------------------------------


@pytest.mark.timeout(90 + 60 * REPEATS)
def test_without_a_launcher_a_rank_dead_before_connecting_is_named() -> None:
    """It registered (the others have its address) but never connected: there is no connection to lose.

    Rank 0 also serves the rendezvous here (no launcher): when it dies the ranks still waiting for
    the rendezvous' answer time out there (RINGCOMM_START_TIMEOUT), saying it did not answer.
    """
    for attempt, victim in enumerate(_victims(REPEATS, start=2)):
        procs = start_torchrun_job([LOOP], 4, DEAD_PEER_OP=OPS[attempt % 3], DEAD_PEER_DIE_AFTER_REGISTER=str(victim),
                                   RINGCOMM_PEER_TIMEOUT="30", RINGCOMM_START_TIMEOUT="8")
        started = time.monotonic()
        outs, took = _finish_survivors(procs, victim, started)
        where = f"attempt {attempt + 1}, victim {victim}"
        if victim == 0:
            print(f"{where}: survivors ended after " + ", ".join(f"{t:.2f}" for t in took.values()) + " s")
            for r, out in outs.items():
                named = procs[r].returncode == 3 and "PeerLostError" in out and "lost rank 0 " in out
                timed_out = procs[r].returncode == 1 and "RendezvousTimeoutError" in out and "did not answer" in out
                assert (named or timed_out) and took[r] < 20, f"{where}, survivor {r} ({took[r]:.1f} s): {out}"
            continue
        _check_named(procs, outs, took, victim, where, 20)


@pytest.mark.timeout(90 + 60 * REPEATS)
@pytest.mark.parametrize("how", ["SIGSTOP", "exit 0"])
def test_without_a_launcher_a_stopped_or_finished_rank_is_named(how: str) -> None:
    for attempt, victim in enumerate(_victims(REPEATS)):
        procs = start_torchrun_job([LOOP], 4, DEAD_PEER_OP=OPS[attempt % 3], RINGCOMM_PEER_TIMEOUT="3")
        try:
            for p in procs:
                assert p.stdout.readline().strip() == "ready"
            time.sleep(0.3)
        except BaseException:
            _finish_survivors(procs, -1, time.monotonic(), timeout=1)
            raise
        since = time.monotonic()
        procs[victim].send_signal(signal.SIGSTOP if how == "SIGSTOP" else signal.SIGUSR1)
        outs, took = _finish_survivors(procs, victim, since, wait_victim=how == "exit 0")
        where = f"{how}, attempt {attempt + 1}, victim {victim}"
        if how == "SIGSTOP":  # found by its heartbeats: RINGCOMM_PEER_TIMEOUT (3 s) plus a slice
            _check_named(procs, outs, took, victim, where, 10)
            continue
        # a rank whose program ended submitted the collective shutdown: rank 0 fails the ops it never will
        print(f"{where}: survivors raised after " + ", ".join(f"{t:.2f}" for t in took.values()) + " s")
        assert procs[victim].returncode == 0, f"{where}: {procs[victim].stdout.read()}"
        for r, out in outs.items():
            assert procs[r].returncode == 3 and f"MismatchError: rank {victim} shut down" in out, f"{where}: {out}"
            assert took[r] < 10, f"{where}, survivor {r}: took {took[r]:.1f} s"


@pytest.mark.timeout(120 + 60 * REPEATS)
def test_without_a_launcher_every_rank_fails_a_refused_call_and_goes_on() -> None:
    for attempt in range(REPEATS):
        procs = start_torchrun_job([str(WORKERS / "refused_call_worker.py")], 3)
        outs = _outputs(procs, 100)
        for r, (p, out) in enumerate(zip(procs, outs, strict=True)):
            assert p.returncode == 0 and "REFUSALS OK" in out, f"attempt {attempt + 1}, rank {r}: {out[-3000:]}"


# -- under ringcomm-run ---------------------------------------------------------------------------


def _launched_loop(op: str, **env: str) -> tuple[LiveLauncher, dict[int, int]]:
    job = LiveLauncher("-v", "-np", "4", sys.executable, LOOP, DEAD_PEER_OP=op, **env)
    pids = {int(m[1]): int(m[2]) for m in job.wait_for(r"rank (\d+): pid (\d+)", 4, timeout=30)}
    job.wait_for(r"<stdout>:ready", 4, timeout=60)
    time.sleep(0.3)
    return job, pids


def _root_cause(job: LiveLauncher, pids: dict[int, int], code: int | None, since: float) -> tuple[str, float]:
    try:
        status = job.finish(timeout=40)
    finally:
        for pid in pids.values():
            if alive(pid):
                os.kill(pid, signal.SIGCONT)
        kill_leftovers(pids.values())
    took = time.monotonic() - since
    err = "".join(job.stderr)
    assert status == code if code is not None else status != 0, err[-4000:]
    m = re.search(r"root cause: rank (\d+)", err)
    assert m, err[-4000:]
    return m[1], took


@pytest.mark.timeout(60 + 60 * REPEATS)
@pytest.mark.parametrize("op", OPS)
def test_under_the_launcher_the_killed_rank_is_the_root_cause(op: str) -> None:
    for attempt, victim in enumerate(_victims(REPEATS, start=OPS.index(op) + 1)):
        job, pids = _launched_loop(op)
        since = time.monotonic()
        os.kill(pids[victim], signal.SIGKILL)
        named, took = _root_cause(job, pids, 137, since)
        where = f"{op}, attempt {attempt + 1}, victim {victim}"
        print(f"{where}: root cause rank {named}, the launcher ended {took:.2f} s after the kill")
        assert named == str(victim), f"{where}: {''.join(job.stderr)[-4000:]}"
        assert f"root cause: rank {victim} (pid {pids[victim]}) was killed by signal SIGKILL" in "".join(job.stderr)
        assert took < 15, f"{where}: took {took:.1f} s"


@pytest.mark.timeout(60 + 60 * REPEATS)
@pytest.mark.parametrize("how", ["SIGSTOP", "exit 0"])
def test_under_the_launcher_a_stopped_or_finished_rank_is_the_root_cause(how: str) -> None:
    for attempt, victim in enumerate(_victims(REPEATS, start=2)):
        job, pids = _launched_loop(OPS[attempt % 3], RINGCOMM_PEER_TIMEOUT="3")
        since = time.monotonic()
        os.kill(pids[victim], signal.SIGSTOP if how == "SIGSTOP" else signal.SIGUSR1)
        named, took = _root_cause(job, pids, None, since)
        err = "".join(job.stderr)
        print(f"{how}, attempt {attempt + 1}, victim {victim}: root cause rank {named}, launcher ended after {took:.2f} s")
        assert named == str(victim), f"{how}, attempt {attempt + 1}, victim {victim}: {err[-4000:]}"
        assert "failed because of it" in err.split("root cause:")[1].splitlines()[0], err[-4000:]
        assert took < 20, f"{how}, attempt {attempt + 1}: took {took:.1f} s"


@pytest.mark.timeout(60 + 40 * REPEATS)
def test_under_the_launcher_a_rank_dead_before_connecting_is_the_root_cause() -> None:
    for attempt, victim in enumerate(_victims(REPEATS, start=3)):
        job = LiveLauncher("-v", "-np", "4", sys.executable, LOOP, DEAD_PEER_OP="allreduce",
                           DEAD_PEER_DIE_AFTER_REGISTER=str(victim))
        pids = {int(m[1]): int(m[2]) for m in job.wait_for(r"rank (\d+): pid (\d+)", 4, timeout=30)}
        named, took = _root_cause(job, pids, 137, time.monotonic())
        print(f"dead before connecting, attempt {attempt + 1}, victim {victim}: root cause rank {named}")
        assert named == str(victim), f"attempt {attempt + 1}: {''.join(job.stderr)[-4000:]}"


# -- elastic jobs ---------------------------------------------------------------------------------


def _hosts(tmp_path: Path, n: int = 4) -> Path:
    hosts = tmp_path / "hosts"
    hosts.write_text("".join(f"127.0.0.{i + 1}:1\n" if i else "localhost:1\n" for i in range(n)))
    return hosts


def _elastic(tmp_path: Path, *worker_args: str, timeout: float = 100):
    hosts = _hosts(tmp_path)
    return run_launcher(
        "-v", "-np", "4", "--min-np", "2", "--max-np", "4", "--host-discovery-script", f"cat {hosts}",
        "--elastic-timeout", "20", sys.executable, ELASTIC, *worker_args, timeout=timeout,
    )


def _check_gone(stderr: str) -> None:
    pids = [int(p) for p in re.findall(r"worker \d+: pid (\d+)", stderr)]
    left = wait_gone(pids, timeout=5.0)
    kill_leftovers(left)
    assert pids and not left, f"workers still running after the launcher exited: {left}"


@pytest.mark.timeout(60 + 100 * REPEATS)
def test_elastic_survivors_re_form_within_ten_seconds_of_a_kill(tmp_path) -> None:
    for attempt, victim in enumerate(_victims(REPEATS)):
        op = OPS[attempt % 3]
        marker = tmp_path / f"killed{attempt}"
        result, _ = _elastic(tmp_path, "--op", op, "--kill-rank", str(victim), "--marker", str(marker))
        out = result.stdout + result.stderr
        where = f"{op}, attempt {attempt + 1}, victim {victim}"
        assert result.returncode == 0, f"{where}: {out[-4000:]}"
        _check_gone(result.stderr)
        killed_at = float(re.search(r"KILLED rank=\d+ at=([\d.]+)", out)[1])
        # the survivors' ranks in the next generation (the launcher may start a new worker beside them)
        gen1 = re.search(r"generation 1: \d+ workers \((.*)\)", result.stderr)
        assert gen1, f"{where}: {out[-4000:]}"
        survivors = {int(r) for w, r in re.findall(r"worker (\d+)@\S+ -> rank (\d+)", gen1[1])
                     if int(w) < 4 and int(w) != victim}
        assert len(survivors) == 3, f"{where}: {gen1[0]}"
        first = {}  # no step completes between the kill and the re-formation: the victim's is missing
        for m in re.finditer(r"STEP rank=(\d+) size=\d+ step=\d+ at=([\d.]+)", result.stdout):
            if float(m[2]) > killed_at and int(m[1]) in survivors:
                first.setdefault(int(m[1]), float(m[2]))
        assert sorted(first) == sorted(survivors), f"{where}: {out[-4000:]}"
        took = max(first.values()) - killed_at
        print(f"{where}: the survivors stepped again {took:.2f} s after the kill")
        assert took < 10, f"{where}: the survivors took {took:.1f} s to re-form"
        assert len(re.findall(r"DONE rank=\d+", result.stdout)) >= 3, f"{where}: {out[-4000:]}"


@pytest.mark.timeout(60 + 60 * REPEATS)
@pytest.mark.parametrize("fault", ["--mismatch-rank", "--refuse-rank"])
def test_elastic_a_programs_own_error_ends_the_job_without_re_forming(tmp_path, fault: str) -> None:
    for attempt in range(REPEATS):
        bad = 1 + attempt % 3
        result, took = _elastic(tmp_path, fault, str(bad), timeout=60)
        out = result.stdout + result.stderr
        where = f"{fault} {bad}, attempt {attempt + 1}"
        print(f"{where}: the job ended after {took:.2f} s")
        assert result.returncode != 0, f"{where}: {out[-4000:]}"
        _check_gone(result.stderr)
        assert "generation 1" not in result.stderr, f"{where}: re-formed: {out[-4000:]}"
        assert "MismatchError" in out and f"rank {bad}" in out, f"{where}: {out[-4000:]}"
        assert "DONE" not in result.stdout
        assert took < 40, f"{where}: took {took:.1f} s"


@pytest.mark.timeout(60 + 40 * REPEATS)
def test_elastic_no_worker_outlives_a_killed_launcher(tmp_path) -> None:
    hosts = _hosts(tmp_path, 3)
    for attempt in range(REPEATS):
        job = LiveLauncher("-v", "-np", "3", "--min-np", "2", "--host-discovery-script", f"cat {hosts}",
                           sys.executable, ELASTIC, "--steps", "100000", "--sleep", "0.01")
        pids = [int(m[1]) for m in job.wait_for(r"worker \d+: pid (\d+)", 3, timeout=30)]
        try:
            job.wait_for(r"STEP rank=\d+ size=3", 3, timeout=60)
            job.proc.send_signal(signal.SIGKILL)
            job.finish(timeout=10)
            left = wait_gone(pids, timeout=8.0)
        finally:
            kill_leftovers(pids)
        assert not left, f"attempt {attempt + 1}: workers outlived the launcher: {left}"


# -- the job's secret, without a launcher ----------------------------------------------------------

TINY_JOB = ("import numpy as np, ringcomm as rc; rc.init(); "
            "print('SUM', rc.allreduce(np.ones(2), op=rc.Sum, name='s').tolist(), flush=True); rc.shutdown()")


def _network_address() -> str | None:
    """An address of this machine beyond loopback, if it has one."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the outgoing interface
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") or ip == "0.0.0.0" else ip


@pytest.mark.timeout(120)
@pytest.mark.parametrize("extra", [{}, {"RINGCOMM_SECRET": "5ec4e7" * 4}, {"RINGCOMM_INSECURE": "1"}],
                         ids=["no secret", "secret", "insecure"])
def test_without_a_launcher_a_job_reachable_from_the_network_needs_a_secret(extra: dict[str, str]) -> None:
    import socket
    import subprocess

    from conftest import job_env

    addr = _network_address()
    if addr is None:
        pytest.skip("this machine has no address beyond loopback")
    with socket.socket() as s:
        s.bind((addr, 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(3):  # as torchrun starts them on two nodes: ranks 0-1 on this one, rank 2 on "another"
        env = job_env(RANK=str(r), WORLD_SIZE="3", LOCAL_RANK=str(r % 2), LOCAL_WORLD_SIZE="2",
                      GROUP_RANK=str(r // 2), MASTER_ADDR=addr, MASTER_PORT=str(port), **extra)
        procs.append(subprocess.Popen([sys.executable, "-c", TINY_JOB], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = _outputs(procs, 90)
    for r, (p, out) in enumerate(zip(procs, outs, strict=True)):
        if not extra:  # every rank refuses to start, at once, saying how to set a secret
            assert p.returncode != 0 and "has no RINGCOMM_SECRET" in out and "RINGCOMM_INSECURE=1" in out, out
        else:
            assert p.returncode == 0 and "SUM [3.0, 3.0]" in out, f"rank {r}: {out}"
            if "RINGCOMM_INSECURE" in extra:
                assert "RINGCOMM_INSECURE=1: the job's secret is derived" in out, out
