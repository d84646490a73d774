"""Elastic jobs across two hosts: network namespaces joined by a veth link, workers on the other host started
through an ssh look-alike (see _netns.py), as ``ringcomm-run -H`` starts remote ranks.

The launcher runs in namespace ``a``; the discovery script prints a file the test (or rank 0) edits:

- the job starts with 2 workers on host a; host b:2 is added while it runs: at the next commit the job has
  4 workers, the 2 new ones on b started over ssh, all 4 with the state committed before the change;
- 4 workers, 2 per host; both workers on b are killed with SIGKILL: host b is blacklisted and the job goes
  on with the 2 on a, re-formed within seconds, and ends with the right result.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from _launcher_helpers import REPO_ROOT, launcher_cmd, launcher_env
from _netns import TwoHosts

pytestmark = pytest.mark.multiprocess

WORKER = str(Path(__file__).resolve().parents[1] / "workers" / "elastic_hosts_worker.py")
LINE = re.compile(r"\[(\d+)\]<stdout>:(ENTER|COMMIT|DONE|PID) worker=(\d+) host=(\S+)(?: rank=(\d+) size=(\d+) "
                  r"step=(\d+) (?:hash|value)=(\S+))?(?: pid=(\d+))?")


class Job:
    """``ringcomm-run -v --ssh-command FAKE ARGS...`` in namespace a; its stdout read line by line as it comes."""

    def __init__(self, hosts: TwoHosts, *args: str) -> None:
        argv = launcher_cmd("-v", "--ssh-command", str(hosts.ssh), *args)
        self.proc = subprocess.Popen(hosts.exec_argv("a", argv), env=launcher_env(), cwd=REPO_ROOT, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.lines: list[tuple[float, str]] = []
        self._cond = threading.Condition()
        self.err: list[str] = []
        self._readers = [threading.Thread(target=self._read, daemon=True),
                         threading.Thread(target=self._read_err, daemon=True)]
        for reader in self._readers:
            reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
                self._cond.notify_all()

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        self.err.extend(self.proc.stderr)

    def wait_for(self, test, timeout: float) -> list[dict]:
        """Wait until ``test(records)`` holds; returns the records then."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not test(self.records()):
                left = deadline - time.monotonic()
                assert left > 0 and self.proc.poll() is None, "\n".join(line for _, line in self.lines)[-4000:]
                self._cond.wait(min(left, 0.2))
            return self.records()

    def records(self) -> list[dict]:
        out = []
        for at, line in list(self.lines):
            m = LINE.search(line)
            if m:
                out.append(dict(at=at, kind=m[2], worker=int(m[3]), host=m[4], rank=int(m[5] or -1),
                                size=int(m[6] or 0), step=int(m[7] or 0), value=m[8], pid=int(m[9] or 0)))
        return out

    def finish(self, timeout: float) -> tuple[int, str, str]:
        self.proc.wait(timeout)
        for reader in self._readers:
            reader.join(5)
        return self.proc.returncode, "\n".join(line for _, line in self.lines), "".join(self.err)

    def kill(self) -> None:
        self.proc.kill()


def assert_nothing_left(hosts: TwoHosts) -> None:
    assert hosts.wait_empty() == {}, "processes left running in the namespaces"


@pytest.mark.timeout(90)
def test_a_host_added_by_the_discovery_script_joins_at_the_next_commit(hosts: TwoHosts, tmp_path: Path) -> None:
    a, b = hosts.addr["a"], hosts.addr["b"]
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"{a}:2\n")
    # the interface named: the driver listens on its address, every host's workers reach it there
    job = Job(hosts, "-np", "2", "--min-np", "2", "--max-np", "4", "--host-discovery-script", f"cat {hostfile}",
              "--network-interface", hosts.interface, "--elastic-timeout", "30", sys.executable, WORKER, "--steps", "40", "--sleep", "0.1",
              "--grow-line", f"{b}:2", "--grow-step", "3", "--hosts-file", str(hostfile))
    try:
        code, out, err = job.finish(timeout=80)
    finally:
        job.kill()
    assert code == 0, out[-3000:] + err[-3000:]
    assert "hosts changed" in err and "generation 1: 4 workers" in err, err
    assert f"driver store at tcp://{a}:" in err
    # the two new workers were started on b through the ssh, the first two here
    assert sorted(re.findall(r"worker (\d+): pid \d+ on (\S+?)( \(ssh\))?$", err, re.M)) == [
        ("0", a, ""), ("1", a, ""), ("2", b, " (ssh)"), ("3", b, " (ssh)")], err
    recs = job.records()
    last2 = [r for r in recs if r["kind"] == "COMMIT" and r["size"] == 2][-1]
    enter4 = [r for r in recs if r["kind"] == "ENTER" and r["size"] == 4]
    # every worker of the grown job entered with the state committed last before the change (synced from rank 0)
    assert sorted((r["worker"], r["host"]) for r in enter4) == [(0, a), (1, a), (2, b), (3, b)], out
    assert {(r["step"], r["value"]) for r in enter4} == {(last2["step"], last2["value"])}, out
    assert sorted(r["rank"] for r in enter4) == [0, 1, 2, 3]
    done = [r for r in recs if r["kind"] == "DONE"]
    assert sorted((r["worker"], r["size"], r["step"], r["value"]) for r in done) == [
        (w, 4, 40, "820") for w in range(4)], out
    lines = hosts.ssh_lines.read_text()  # the secret went through the ssh's input, not a command line
    assert lines.count("--secret-on-stdin") == 2 and "RINGCOMM_SECRET" not in lines
    assert_nothing_left(hosts)


@pytest.mark.timeout(90)
def test_a_host_whose_workers_are_killed_is_dropped_and_the_job_goes_on(hosts: TwoHosts, tmp_path: Path) -> None:
    a, b = hosts.addr["a"], hosts.addr["b"]
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"{a}:2\n{b}:2\n")
    job = Job(hosts, "-np", "4", "--min-np", "2", "--host-discovery-script", f"cat {hostfile}",
              "--elastic-timeout", "30", sys.executable, WORKER, "--steps", "60", "--sleep", "0.1")
    try:
        recs = job.wait_for(lambda rs: len({r["worker"] for r in rs if r["kind"] == "COMMIT" and r["size"] == 4
                                            and r["step"] >= 5}) == 4, timeout=50)
        on_b = [r["pid"] for r in recs if r["kind"] == "PID" and r["host"] == b]
        assert len(on_b) == 2
        killed_at = time.monotonic()
        for pid in on_b:
            os.kill(pid, signal.SIGKILL)
        recs = job.wait_for(lambda rs: len([r for r in rs if r["kind"] == "ENTER" and r["size"] == 2]) == 2,
                            timeout=30)
        reformed = max(r["at"] for r in recs if r["kind"] == "ENTER" and r["size"] == 2) - killed_at
        print(f"re-formed {reformed:.2f} s after the kill")
        code, out, err = job.finish(timeout=40)
    finally:
        job.kill()
    assert code == 0, out[-3000:] + err[-3000:]
    assert reformed < 10.0, f"re-formed {reformed:.1f} s after the kill\n{err}"
    assert f"host {b} blacklisted" in err and "generation 1: 2 workers" in err, err
    recs = job.records()
    enter2 = [r for r in recs if r["kind"] == "ENTER" and r["size"] == 2]
    assert sorted((r["worker"], r["host"], r["rank"]) for r in enter2) == [(0, a, 0), (1, a, 1)], out
    # the survivors went back to the last commit both had made (the same one), then finished the steps
    assert len({(r["step"], r["value"]) for r in enter2}) == 1
    done = [r for r in recs if r["kind"] == "DONE"]
    assert sorted((r["worker"], r["size"], r["step"], r["value"]) for r in done) == [
        (0, 2, 60, "1830"), (1, 2, 60, "1830")], out
    assert_nothing_left(hosts)


@pytest.mark.timeout(60)
def test_workers_on_the_remote_host_end_when_the_launcher_is_killed_outright(hosts: TwoHosts, tmp_path: Path) -> None:
    """SIGKILL leaves the driver no chance to stop anything: the remote side sees the ssh's input end."""
    a, b = hosts.addr["a"], hosts.addr["b"]
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"{a}:1\n{b}:2\n")
    job = Job(hosts, "-np", "3", "--host-discovery-script", f"cat {hostfile}", sys.executable, WORKER,
              "--steps", "100000", "--sleep", "0.1")
    try:
        job.wait_for(lambda rs: len({r["worker"] for r in rs if r["kind"] == "COMMIT" and r["size"] == 3}) == 3,
                     timeout=40)
        assert len(hosts.pids("b")) >= 2
        job.kill()
        job.proc.wait(10)
        assert hosts.wait_empty(timeout=10.0, sides=("b",)) == {}, "workers left running on host b"
    finally:
        job.kill()


@pytest.mark.timeout(60)
def test_a_host_ssh_cannot_reach_is_blacklisted_and_the_job_starts_without_it(hosts: TwoHosts,
                                                                             tmp_path: Path) -> None:
    """Its ssh fails before the worker reaches the rendezvous: the others do not wait out the start timeout."""
    a = hosts.addr["a"]
    ghost = a.rsplit(".", 1)[0] + ".7"  # on the link's subnet (a route leads there), but no such host
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"{a}:2\n{ghost}:1\n")
    start = time.monotonic()
    job = Job(hosts, "-np", "3", "--min-np", "2", "--start-timeout", "60", "--host-discovery-script",
              f"cat {hostfile}", "--elastic-timeout", "30", sys.executable, WORKER, "--steps", "10", "--sleep", "0.05")
    try:
        code, out, err = job.finish(timeout=50)
    finally:
        job.kill()
    assert code == 0, out[-3000:] + err[-3000:]
    assert time.monotonic() - start < 30, err
    assert re.search(rf"worker 2 on {re.escape(ghost)} \(pid \d+\) exited with code 255", err), err
    assert f"Could not resolve hostname {ghost}" in err and f"host {ghost} blacklisted" in err, err
    assert f"generation 1: 2 workers (worker 0@{a} -> rank 0, worker 1@{a} -> rank 1)" in err, err
    done = [r for r in job.records() if r["kind"] == "DONE"]
    assert sorted((r["worker"], r["size"], r["value"]) for r in done) == [(0, 2, "55"), (1, 2, "55")], out
    assert_nothing_left(hosts)
