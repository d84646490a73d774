"""Tier 3: whole jobs through ringcomm-run, as a user runs them."""

from __future__ import annotations

import time

import pytest

from conftest import ROOT, WORKERS, launch, remove_files_of, start_torchrun_job


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_numpy_example_runs_at_np4_and_converges() -> None:
    proc = launch(4, [str(ROOT / "examples" / "numpy_linear_regression.py"), "--steps", "100"], timeout=100)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "[0]<stdout>:4 ranks, 100 steps" in proc.stdout
    err = float(proc.stdout.split("max |w - truth| = ")[1].split()[0])
    assert err < 0.05


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_failing_rank_stops_the_job_and_is_named() -> None:
    start = time.monotonic()
    proc = launch(3, [str(WORKERS / "fail_worker.py")], timeout=50)
    assert proc.returncode == 1
    assert time.monotonic() - start < 30
    assert "root cause: rank 1" in proc.stderr
    assert "rank 1 failed on purpose" in proc.stderr


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_single_process_without_launcher(tmp_path) -> None:
    import subprocess
    import sys

    from conftest import job_env

    code = (
        "import numpy as np, ringcomm as rc; rc.init(); assert rc.size() == 1;"
        "print(rc.allreduce(np.arange(3.0)).tolist(), rc.alltoall(np.arange(2))[1].tolist());"
        "rc.shutdown(); rc.init(); print(rc.rank()); rc.shutdown()"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50, env=job_env())
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["[0.0, 1.0, 2.0] [2]", "0"]


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_torchrun_style_environment_without_the_launcher(tmp_path) -> None:
    """Processes started with torchrun's variables find each other (rank 0 hosts the rendezvous)."""
    import json


    cases = tmp_path / "cases.json"
    cases.write_text(json.dumps([{"kind": "allreduce", "dtype": "float32", "op": "sum", "shape": [5], "seed": 1},
                                 {"kind": "concurrent", "count": 5, "seed": 2}]))
    procs = start_torchrun_job([str(WORKERS / "collectives_worker.py"), str(cases)], 3)
    try:
        outs = [p.communicate(timeout=60)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r}: {out}"
        assert "CASE 1 OK" in out


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_no_shared_memory_or_socket_files_left_after_a_failed_job() -> None:
    import glob
    import tempfile

    proc = launch(3, [str(WORKERS / "fail_worker.py")], timeout=50)
    assert proc.returncode == 1
    job = proc.stdout.split("[0]<stdout>:job ")[1].split()[0]
    left = glob.glob(f"/dev/shm/ringcomm-{job}-*") + glob.glob(f"{tempfile.gettempdir()}/ringcomm-{job}-*")
    assert left == []


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_stall_is_reported_then_turned_into_an_error() -> None:
    proc = launch(3, [str(WORKERS / "stall_worker.py")], timeout=50,
                  RINGCOMM_STALL_CHECK_SECONDS="1", RINGCOMM_STALL_SHUTDOWN_SECONDS="3")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "stall: allreduce 'lonely' was submitted by ranks [0]" in proc.stderr
    assert "ranks [1, 2] have not submitted it" in proc.stderr
    assert "[0]<stdout>:stall error: stalled: allreduce 'lonely'" in proc.stdout
    assert "StallError" not in proc.stderr
    assert proc.stdout.count("after ok") == 3


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_rank_whose_peers_never_arrive_fails_init_cleanly(tmp_path) -> None:
    """init() times out with a message naming the missing ranks, and leaves no socket open."""
    import subprocess
    import sys

    from conftest import job_env
    from ringcomm.net.rendezvous import RendezvousServer

    secret = b"s" * 32
    with RendezvousServer(size=2, secret=secret) as server:
        code = (
            "import ringcomm as rc, threading\n"
            "try:\n"
            "    rc.init()\n"
            "except rc.RendezvousTimeoutError as e:\n"
            "    print('TIMEOUT', e)\n"
            "print('threads', sorted(t.name for t in threading.enumerate()))\n"
        )
        env = job_env(RINGCOMM_RANK="0", RINGCOMM_SIZE="2", RINGCOMM_RENDEZVOUS_ADDR=server.address,
                      RINGCOMM_SECRET=secret.hex(), RINGCOMM_JOB_ID="cafe0001", RINGCOMM_START_TIMEOUT="2")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=40, env=env)
    assert out.returncode == 0, out.stderr
    assert "TIMEOUT" in out.stdout and "missing: 1" in out.stdout and "RINGCOMM_START_TIMEOUT" in out.stdout
    assert "threads ['MainThread']" in out.stdout


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
@pytest.mark.parametrize("victim,elems,lane,hosts", [(0, 1000, "-1", 1), (1, 1000, "-1", 1), (2, 4 << 20, "-1", 1),
                                                      (1, 25_000, "0", 1), (2, 25_000, "0", 1),
                                                      (0, 4 << 20, "0", 2), (1, 4 << 20, "0", 2)])
def test_survivors_of_a_killed_rank_raise_naming_it(victim: int, elems: int, lane: str, hosts: int) -> None:
    """Without a launcher to stop them, the survivors notice within seconds and name the lost rank
    (also when they wait for it at the shared-memory allreduce's barriers: 32 MiB allreduces; in
    recursive doubling's exchanges: 200 KB with the lane off, rank 2 handing its data to rank 0; and
    with ranks on two hosts, where 32 MiB allreduces stream their segments over TCP between them)."""
    import signal

    procs = start_torchrun_job([str(WORKERS / "peer_loss_worker.py")], 3, PEER_LOSS_ELEMS=str(elems),
                               RINGCOMM_SHM_LANE_BYTES=lane,
                               rank_env=[{"RINGCOMM_HOSTNAME": f"host{r % hosts}"} for r in range(3)])
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        time.sleep(1.0)
        killed_at = time.monotonic()
        procs[victim].send_signal(signal.SIGKILL)
        outs = {}
        for r, p in enumerate(procs):
            if r != victim:
                outs[r] = p.communicate(timeout=30)[0]
        elapsed = time.monotonic() - killed_at
    finally:
        for p in procs:
            p.kill()
            p.wait()
        remove_files_of([p.pid for p in procs])
    assert elapsed < 15
    for r, out in outs.items():
        assert procs[r].returncode == 3, out
        assert f"lost rank {victim}" in out or f"no data from rank {victim}" in out, out
        assert "PeerLostError" in out


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_clean_shutdowns_report_no_lost_peers() -> None:
    """Ranks leave at slightly different times at shutdown; that is not a lost peer."""
    for _ in range(4):
        proc = launch(4, [str(ROOT / "examples" / "numpy_linear_regression.py"), "--steps", "5"], timeout=60)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "lost rank" not in proc.stderr and "Error" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
@pytest.mark.parametrize("hosts", [1, 2])
def test_a_stopped_rank_is_detected_by_heartbeats(hosts: int) -> None:
    """SIGSTOP keeps the process and its sockets alive; heartbeats still expose it (with two hosts,
    while 32 MiB allreduces stream to and from it: its streams stay open and stop moving)."""
    import signal

    procs = start_torchrun_job([str(WORKERS / "peer_loss_worker.py")], 3, RINGCOMM_PEER_TIMEOUT="3",
                               PEER_LOSS_ELEMS=str(1000 if hosts == 1 else 4 << 20),
                               rank_env=[{"RINGCOMM_HOSTNAME": f"host{r % hosts}"} for r in range(3)])
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        time.sleep(1.0)
        stopped_at = time.monotonic()
        procs[1].send_signal(signal.SIGSTOP)
        outs = {r: procs[r].communicate(timeout=40)[0] for r in (0, 2)}
        elapsed = time.monotonic() - stopped_at
    finally:
        for p in procs:
            p.kill()
            p.wait()
        remove_files_of([p.pid for p in procs])
    assert elapsed < 15
    for r, out in outs.items():
        assert procs[r].returncode == 3 and "PeerLostError" in out, out
    assert any("lost rank 1" in out for out in outs.values()), outs


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_fifty_init_shutdown_cycles_leak_nothing() -> None:
    proc = launch(2, [str(WORKERS / "cycles_worker.py")], timeout=100)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.count("fds/threads after 5") == 2


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_a_clean_job_leaves_no_socket_or_shared_memory_files(tmp_path) -> None:
    """Without a launcher to clean up after them, ranks remove their ipc and shared-memory files."""
    import glob
    import tempfile


    secret = "ab" * 16
    procs = start_torchrun_job([str(WORKERS / "cycles_worker.py")], 3, RINGCOMM_SECRET=secret, CYCLES="10")
    job = procs[0].job_id
    outs = [p.communicate(timeout=80)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    left = glob.glob(f"{tempfile.gettempdir()}/ringcomm-{job}-*") + glob.glob(f"/dev/shm/ringcomm-{job}-*")
    assert left == []


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_garbage_and_half_open_connections_to_every_port_leave_results_correct(tmp_path) -> None:
    """A stranger's bytes on the job's tcp ports are dropped by ZeroMQ; the running job never notices.

    Raw bytes, and ZeroMQ peers that speak the protocol but lack the job's secret: no security at all,
    or PLAIN with a wrong password, each sending well-formed data and control messages.
    """
    import json
    import socket
    import struct
    import subprocess
    import sys

    import zmq

    from conftest import job_env
    from ringcomm.core import wire

    # the job runs until the garbage is sent (a fixed count may end first), and through the engine
    # (the lane would leave the sockets under test idle)
    stop_file = tmp_path / "stop"
    cmd = [sys.executable, "-m", "ringcomm.launch.launcher", "-np", "3", sys.executable,
           str(WORKERS / "garbage_target_worker.py"), str(tmp_path), "300", str(stop_file)]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=job_env(RINGCOMM_SHM_LANE_BYTES="0"), cwd=ROOT)
    half_open: list[socket.socket] = []
    zmq_ctx = zmq.Context()
    strangers: list[zmq.Socket] = []
    try:
        deadline = time.monotonic() + 30
        while len(list(tmp_path.glob("ports-*.json"))) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.3)
        ports = []
        for f in tmp_path.glob("ports-*.json"):
            ports += [int(ep.rsplit(":", 1)[1]) for ep in json.loads(f.read_text())]
        assert len(ports) >= 4  # rank 0: 2 data + ctrl; rank 1: 1 data
        rng = __import__("random").Random(7)
        for port in ports:
            for payload in (
                bytes(rng.getrandbits(8) for _ in range(4096)),  # random bytes
                b"\xff" + struct.pack(">Q", 2**62) + b"\x7f" + b"\x00" * 54,  # greeting announcing 4 EiB
                b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f\x03\x00NULL" + b"\x00" * 48 + b"\x04\xff" + b"\x00" * 8,
            ):
                with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                    s.sendall(payload)
            half = socket.create_connection(("127.0.0.1", port), timeout=2)  # left open, silent
            half_open.append(half)
        forged_ctrl = [wire.pack_control(b"not the job's secret", ["req", 1, []])]
        for port in ports:
            for kind, password in ((zmq.PAIR, None), (zmq.PAIR, b"guess"), (zmq.DEALER, None), (zmq.DEALER, b"guess")):
                sock = zmq_ctx.socket(kind)
                sock.setsockopt(zmq.LINGER, 0)
                if password is not None:
                    sock.plain_username, sock.plain_password = b"ringcomm", password
                strangers.append(sock)  # closed in the finally below, or zmq_ctx.term() would wait for it
                sock.connect(f"tcp://127.0.0.1:{port}")
                for seq in range(0, 200, 7):  # well-formed inline data for ops the job will run
                    forged_data = [struct.pack("<cQI", b"I", seq, 0), b"\x00" * 4096]
                    try:
                        sock.send_multipart(forged_data if kind == zmq.PAIR else forged_ctrl, zmq.NOBLOCK)
                    except zmq.Again:  # a PAIR has no pipe until its connection is up (or refused): skip
                        break
        time.sleep(0.5)  # their handshakes fail meanwhile; the NULL ones keep retrying until the end
        stop_file.touch()
        out, err = job.communicate(timeout=60)
    finally:
        for sock in strangers:
            sock.close(0)
        zmq_ctx.term()
        for s in half_open:
            s.close()
        if job.poll() is None:
            job.terminate()  # the launcher stops its workers on SIGTERM (SIGKILL would orphan them)
            try:
                job.wait(15)
            except subprocess.TimeoutExpired:
                job.kill()
    assert job.returncode == 0, out[-2000:] + err[-2000:]
    for r in range(3):
        assert f"[{r}]<stdout>:rank {r} ok after" in out
