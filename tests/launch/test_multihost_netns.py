"""ringcomm-run across two hosts: network namespaces joined by a veth link, ranks on the other host over
an ssh look-alike that starts them with an empty environment in another directory (see _netns.py).

The launcher runs in namespace ``a`` with ``-H a:2,b:2``: ranks 0, 1 start
directly, ranks 2, 3 through the fake ssh inside namespace ``b``.  The
namespaces share the file system but not the network, so ranks of different
hosts can only reach each other over the veth link.
"""

from __future__ import annotations

import glob
import json
import re
import signal
import subprocess
import sys
import tempfile
import threading

import pytest
import zmq

from _launcher_helpers import REPO_ROOT, launcher_cmd, launcher_env
from _netns import TwoHosts
from conftest import WORKERS

pytestmark = pytest.mark.multiprocess



def start(hosts: TwoHosts, *args: str, **env: str) -> subprocess.Popen[str]:
    """``ringcomm-run -v -H a:2,b:2 --ssh-command FAKE ARGS...`` inside namespace a (``env``: added to its environment)."""
    argv = launcher_cmd("-v", "--ssh-command", str(hosts.ssh), *args)
    return subprocess.Popen(hosts.exec_argv("a", argv), env=launcher_env(**env), cwd=REPO_ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def two_by_two(hosts: TwoHosts) -> list[str]:
    return ["-np", "4", "-H", f"{hosts.addr['a']}:2,{hosts.addr['b']}:2"]


def assert_nothing_left(hosts: TwoHosts, stderr: str) -> None:
    assert hosts.wait_empty() == {}, "processes left running in the namespaces"
    job = re.search(r"ringcomm-run: job ([0-9a-f]{8})", stderr).group(1)
    left = glob.glob(f"/dev/shm/ringcomm-{job}-*") + glob.glob(f"{tempfile.gettempdir()}/ringcomm-{job}-*")
    assert left == [], "job files left behind"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("encrypt", ["0", "1"])
def test_two_hosts_by_two_ranks_pass_the_collectives_across_the_link(hosts: TwoHosts, encrypt: str) -> None:
    """Also encrypted (RINGCOMM_ENCRYPT=1 reaches the remote ranks through the forwarded environment)."""
    if encrypt == "1" and not zmq.has("curve"):
        pytest.skip("this libzmq has no CURVE (built without libsodium)")
    proc = start(hosts, *two_by_two(hosts), "--ssh-port", "2222", "--ssh-identity-file", "/nonexistent/key",
                 sys.executable, str(WORKERS / "placement_worker.py"), RINGCOMM_ENCRYPT=encrypt)
    out, err = proc.communicate(timeout=50)
    assert proc.returncode == 0, out + err
    for rank in range(4):
        for case in range(8):
            assert f"[{rank}]<stdout>:CASE {case} OK" in out, out + err
    places = sorted((json.loads(line.split("PLACE ", 1)[1]) for line in out.splitlines() if "PLACE " in line),
                    key=lambda p: p["rank"])
    a, b = hosts.addr["a"], hosts.addr["b"]
    assert [(p["host"], p["addr"], p["local_rank"], p["local_size"], p["cross_rank"], p["cross_size"])
            for p in places] == [(a, a, 0, 2, 0, 2), (a, a, 1, 2, 0, 2), (b, b, 0, 2, 1, 2), (b, b, 1, 2, 1, 2)]
    # the ring sends to rank + 1: 1 -> 2 and 3 -> 0 cross the link (tcp), 0 -> 1 and 2 -> 3 use shared memory
    assert places[1]["stats"].get("inline", 0) > 0 and places[3]["stats"].get("inline", 0) > 0
    assert places[0]["stats"].get("shm", 0) > 0 and places[2]["stats"].get("shm", 0) > 0
    mechanism = zmq.CURVE if encrypt == "1" else zmq.PLAIN  # every data socket authenticated; encrypted if asked
    assert [(p["encrypted"], p["mechanisms"]) for p in places] == [(encrypt == "1", [mechanism])] * 4
    assert f"rendezvous at tcp://{a}:" in err
    assert re.findall(r"rank (\d): pid \d+ on (\S+)( \(ssh\))?", err) == [
        ("0", a, ""), ("1", a, ""), ("2", b, " (ssh)"), ("3", b, " (ssh)")]
    assert hosts.ssh_log.read_text().split("\n") == [f" -p 2222 -i /nonexistent/key {b}"] * 2 + [""]
    # the job's secret reached the remote ranks (they authenticated) through the ssh's input, never
    # through a command line that any user of either host could read in the process list
    lines = hosts.ssh_lines.read_text()
    assert lines.count("--secret-on-stdin") == 2 and "RINGCOMM_SECRET" not in lines
    assert_nothing_left(hosts, err)


@pytest.mark.timeout(60)
def test_the_lane_across_hosts_carries_the_small_collectives_over_the_link(hosts: TwoHosts) -> None:
    """With RINGCOMM_NET_LANE_BYTES set, small ops of the global set go through the lane between the
    hosts (every rank computes them); the large ones and the rest still pass through the engine."""
    proc = start(hosts, *two_by_two(hosts), sys.executable, str(WORKERS / "placement_worker.py"),
                 RINGCOMM_NET_LANE_BYTES="-1", RINGCOMM_LOG_LEVEL="DEBUG")
    out, err = proc.communicate(timeout=50)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    for rank in range(4):
        for case in range(8):
            assert f"[{rank}]<stdout>:CASE {case} OK" in out, out[-3000:] + err[-3000:]
        # case 0 (28 B) and the barrier go through the lane on every rank, on both hosts
        assert re.search(rf"\[{rank}\]<stderr>:.*rank {rank}: allreduce .*: 28 B, process set 0: small-op lane", err), \
            err[-3000:]
    assert_nothing_left(hosts, err)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode,piece", [("1", "0"), ("-1", "0"), ("1", "65536")])
def test_hierarchical_allreduce_across_two_hosts_is_right_and_alike_on_every_rank(hosts: TwoHosts, mode: str,
                                                                                   piece: str) -> None:
    """Forced on (every size) and automatic (from 1 MiB), in one piece or pipelined in pieces of 64 KiB
    (up to 8); ranks check results and compare digests."""
    proc = start(hosts, *two_by_two(hosts), sys.executable, str(WORKERS / "hierarchical_worker.py"),
                 RINGCOMM_HIERARCHICAL_ALLREDUCE=mode, RINGCOMM_HIERARCHICAL_PIECE_BYTES=piece)
    out, err = proc.communicate(timeout=110)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    counts = {int(m[0]): int(m[1]) for m in re.findall(r"HIER OK (\d) (\d+)", out)}
    assert sorted(counts) == [0, 1, 2, 3], out + err
    # 11 cases of 100,000 elements (0.4-0.8 MB: hierarchical only when forced) and 11 of 300,000 (over 1 MiB);
    # smaller ones travel with their requests to rank 0
    assert len(set(counts.values())) == 1, counts
    if mode == "1":
        assert counts[0] >= 22, counts
    else:
        assert 11 <= counts[0] < 22, counts
    assert_nothing_left(hosts, err)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stream_segment,encrypt,streamed", [
    (None, "0", {0: 5, 1: 3}), ("4194304", "0", {0: 9, 1: 6}), (None, "1", {0: 0, 1: 0})])
def test_one_rank_per_host_sends_stream_segments_across_the_link(hosts: TwoHosts, stream_segment: str | None,
                                                                 encrypt: str, streamed: dict[int, int]) -> None:
    """Each rank on a host of its own: every link is a stream, and ring segments are 8 MiB by default.
    12 MiB allreduce (chunks of 6 MiB: 2 payloads per rank, 4 in 4 MiB segments), 6 MiB allgather block
    (1, or 2), 12 MiB broadcast from rank 0 (8 + 4 MiB, or 3 x 4 MiB; rank 1 forwards nothing).
    Encrypted, the same segments travel on the ZeroMQ sockets (no streams) and arrive as right."""
    if encrypt == "1" and not zmq.has("curve"):
        pytest.skip("this libzmq has no CURVE (built without libsodium)")
    env = {"RINGCOMM_ENCRYPT": encrypt}
    if stream_segment is not None:
        env["RINGCOMM_STREAM_SEGMENT_BYTES"] = stream_segment
    proc = start(hosts, "-np", "2", "-H", f"{hosts.addr['a']}:1,{hosts.addr['b']}:1", sys.executable,
                 str(WORKERS / "stream_segments_worker.py"), **env)
    out, err = proc.communicate(timeout=110)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    seen = [json.loads(line.split("SEGMENTS ", 1)[1]) for line in out.splitlines() if "SEGMENTS " in line]
    assert {p["rank"]: p["stream"] for p in seen} == streamed, out + err
    assert {p["stream_segment"] for p in seen} == {int(stream_segment or 8 << 20)}
    assert_nothing_left(hosts, err)


FAIL_ON_HOST_B = """
import os, time
import numpy as np
import ringcomm as rc
rc.init()
for _ in range(3):
    rc.allreduce(np.ones(8), name="warm")
if rc.rank() == 3:
    raise RuntimeError("rank 3 failed on purpose on " + os.environ["RINGCOMM_HOSTNAME"])
print("rank", rc.rank(), "sleeps", flush=True)
time.sleep(60)   # not inside a collective: only the launcher can stop it
"""


@pytest.mark.timeout(60)
def test_a_failing_remote_rank_stops_every_rank_on_both_hosts(hosts: TwoHosts) -> None:
    proc = start(hosts, *two_by_two(hosts), sys.executable, "-c", FAIL_ON_HOST_B)
    out, err = proc.communicate(timeout=50)
    assert proc.returncode == 1, out + err
    b = hosts.addr["b"]
    assert re.search(rf"root cause: rank 3 on {re.escape(b)} \(ssh pid \d+\) exited with code 1", err), err
    assert f"RuntimeError: rank 3 failed on purpose on {b}" in err.split("root cause:")[1]
    assert "stopped by ringcomm-run: ranks 0, 1, 2" in err
    assert_nothing_left(hosts, err)


SLEEPER = """
import time
import ringcomm as rc
rc.init()
print("ready", rc.rank(), rc.runtime.active().topo.addr, flush=True)
time.sleep(60)
"""


def wait_for_lines(proc: subprocess.Popen[str], pattern: str, count: int, timeout: float) -> list[str]:
    """Read ``proc``'s stdout until ``count`` lines match ``pattern``; returns them."""
    found: list[str] = []
    done = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            if re.search(pattern, line):
                found.append(line.strip())
                if len(found) == count:
                    break
        done.set()

    threading.Thread(target=read, daemon=True).start()
    assert done.wait(timeout), f"only {found} matched {pattern!r}"
    return found


@pytest.mark.timeout(60)
def test_ctrl_c_stops_ranks_on_both_hosts_with_a_chosen_interface(hosts: TwoHosts) -> None:
    proc = start(hosts, *two_by_two(hosts), "--network-interface", hosts.interface, sys.executable, "-c", SLEEPER)
    try:
        ready = wait_for_lines(proc, r"<stdout>:ready", 4, 40)
        a, b = hosts.addr["a"], hosts.addr["b"]
        assert sorted(line.split(":", 1)[1] for line in ready) == [
            f"ready 0 {a}", f"ready 1 {a}", f"ready 2 {b}", f"ready 3 {b}"]
        proc.send_signal(signal.SIGINT)
        err = proc.communicate(timeout=20)[1]
        assert proc.returncode == 128 + signal.SIGINT, err
        assert "received SIGINT; stopped all 4 workers" in err
        assert_nothing_left(hosts, err)
    finally:
        proc.kill()


@pytest.mark.timeout(60)
def test_ranks_on_the_remote_host_end_when_the_launcher_is_killed_outright(hosts: TwoHosts) -> None:
    """SIGKILL leaves the launcher no chance to clean up: the remote side sees its input end and stops."""
    proc = start(hosts, *two_by_two(hosts), sys.executable, "-c", SLEEPER)
    try:
        wait_for_lines(proc, r"<stdout>:ready", 4, 40)
        assert len(hosts.pids("b")) >= 2
        proc.kill()
        proc.wait(10)
        assert hosts.wait_empty(timeout=8.0, sides=("b",)) == {}, "ranks left running on host b"
    finally:
        proc.kill()


@pytest.mark.timeout(60)
def test_a_host_ssh_cannot_reach_fails_the_job_with_the_ssh_message(hosts: TwoHosts) -> None:
    ghost = hosts.addr["a"].rsplit(".", 1)[0] + ".7"
    proc = start(hosts, "-np", "2", "-H", f"{hosts.addr['a']}:1,{ghost}:1", sys.executable, "-c", SLEEPER)
    out, err = proc.communicate(timeout=50)
    assert proc.returncode == 255, out + err
    assert re.search(rf"root cause: rank 1 on {re.escape(ghost)} \(ssh pid \d+\) exited with code 255", err), err
    assert f"Could not resolve hostname {ghost}" in err.split("root cause:")[1]
    assert "stopped by ringcomm-run: rank 0" in err
    assert_nothing_left(hosts, err)



@pytest.mark.timeout(60)
def test_a_missing_ssh_program_is_reported(hosts: TwoHosts) -> None:
    proc = start(hosts, "-np", "2", "-H", f"{hosts.addr['a']}:1,{hosts.addr['b']}:1",
                 "--ssh-command", "/nonexistent/ssh -o BatchMode=yes", sys.executable, "-c", SLEEPER)
    out, err = proc.communicate(timeout=50)
    assert proc.returncode == 127, out + err
    assert f"cannot start /nonexistent/ssh -o BatchMode=yes for rank 1 on {hosts.addr['b']}:" in err
    assert_nothing_left(hosts, err)
