"""RINGCOMM_PORT_RANGE: every TCP port a job listens on (ranks and launcher) is one of the range's.

The range's parsing and the order ports are tried in are pure (``ringcomm/job/ports.py``); the
binds (``ringcomm/net/ports.py``) skip a port another socket holds and name the range when none is
left.  Jobs on one host and across two network namespaces then check every listening socket of
every rank, read from /proc, and the launcher's rendezvous.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import socket
import subprocess
import sys

import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st

from _launcher_helpers import REPO_ROOT, launcher_cmd, launcher_env, run_launcher
from conftest import WORKERS
from ringcomm.errors import InvalidInputError, RendezvousError
from ringcomm.job import config, ports
from ringcomm.job.ports import PortRange
from ringcomm.net.ports import bind_plain, bind_zmq

PORTS_WORKER = str(WORKERS / "ports_worker.py")


# -- the range (pure) -----------------------------------------------------------------------------

@given(st.integers(1, 65535), st.integers(0, 300), st.integers(0, 10_000))
def test_a_range_parses_and_offers_each_of_its_ports_once_from_the_start_asked(low: int, width: int,
                                                                                start: int) -> None:
    high = min(65535, low + width)
    r = ports.parse(f" {low}-{high} ")
    assert r == PortRange(low, high) and str(r) == f"{low}-{high}" and r.size == high - low + 1
    order = r.candidates(start)
    assert sorted(order) == list(range(low, high + 1))
    assert order[0] == low + start % r.size
    assert all(b == a + 1 or (a == high and b == low) for a, b in zip(order, order[1:]))


def test_an_empty_range_is_none_and_a_malformed_one_says_what_to_write() -> None:
    assert ports.parse("") is None and ports.parse("  ") is None
    assert ports.parse("40000") == PortRange(40000, 40000)
    for bad in ("40000-", "a-b", "40000:40010", "0-10", "50000-40000", "65000-70000"):
        with pytest.raises(ValueError, match="RINGCOMM_PORT_RANGE"):
            ports.parse(bad)
    with pytest.raises(InvalidInputError, match=r"RINGCOMM_PORT_RANGE='40000:40010': use LOW-HIGH"):
        config.Settings.from_env({"RINGCOMM_PORT_RANGE": "40000:40010"})
    with pytest.raises(InvalidInputError, match="LOW <= HIGH"):
        config.port_range({"RINGCOMM_PORT_RANGE": "9-8"})
    assert config.Settings.from_env({"RINGCOMM_PORT_RANGE": "40000-40099"}).listen_ports == PortRange(40000, 40099)
    assert config.Settings.from_env({}).listen_ports is None and config.port_range({}) is None


def test_the_ports_a_host_needs_count_data_stream_and_control_sockets() -> None:
    # 4 ranks on one host: data sockets 3 + 2 + 1 + 0, a stream socket each, rank 0's control, the rendezvous
    assert ports.ports_needed(4, range(4)) == 6 + 4 + 1 + 1
    assert ports.ports_needed(4, [2, 3]) == 1 + 2
    assert ports.ports_needed(4, [0, 1], net_lane=True, launcher=False) == 3 + 2 + 4 + 1


# -- binding ----------------------------------------------------------------------------------------

def free_block(width: int) -> PortRange:
    """``width`` consecutive ports below the ephemeral range that nothing holds now."""
    for _ in range(200):
        low = random.randrange(20000, 32000 - width)
        with contextlib.ExitStack() as held:
            try:
                for port in range(low, low + width):
                    s = held.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return PortRange(low, low + width - 1)
    raise AssertionError("no free block of ports")


def hold(port: int) -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen(1)
    return s


def test_a_plain_listener_takes_a_free_port_of_the_range_past_those_held() -> None:
    r = free_block(4)
    held = [hold(p) for p in (r.low, r.low + 1, r.low + 3)]
    try:
        for _ in range(3):  # wherever it starts in the range, only one port is free
            with socket.socket() as s:
                assert bind_plain(s, "127.0.0.1", r, "a test listener") == r.low + 2
                s.listen(1)
        with socket.socket() as s:
            assert 0 < bind_plain(s, "127.0.0.1", None, "a test listener") != r.low + 2  # no range: any port
    finally:
        for s in held:
            s.close()


def test_a_zmq_socket_takes_a_free_port_of_the_range_and_says_when_none_is_left() -> None:
    r = free_block(2)
    ctx = zmq.Context()
    try:
        first, second, third = (ctx.socket(zmq.ROUTER) for _ in range(3))
        endpoints = {bind_zmq(first, "127.0.0.1", r, "socket one"), bind_zmq(second, "127.0.0.1", r, "socket two")}
        assert endpoints == {f"tcp://127.0.0.1:{r.low}", f"tcp://127.0.0.1:{r.high}"}
        with pytest.raises(RendezvousError) as err:
            bind_zmq(third, "127.0.0.1", r, "rank 5's data socket for rank 7")
        assert str(err.value).startswith(f"rank 5's data socket for rank 7: no free TCP port on 127.0.0.1 in "
                                         f"RINGCOMM_PORT_RANGE={r} (2 ports, every one taken)")
        assert "widen the range on every host, or unset it" in str(err.value)
        with socket.socket() as s:
            with pytest.raises(RendezvousError, match=f"RINGCOMM_PORT_RANGE={r}"):
                bind_plain(s, "127.0.0.1", r, "a plain one")
        for s in (first, second, third):
            s.close(0)
    finally:
        ctx.term()


def test_the_stream_and_lane_listeners_take_ports_of_the_range() -> None:
    from ringcomm.lane import net_lane
    from ringcomm.net.streams import Streams

    r = free_block(3)
    streams = Streams(0, 2, b"k" * 32, "job", 0, min_bytes=1, max_payload=1 << 20, timeout=1.0)
    try:
        address = streams.listen("127.0.0.1", r)
        assert address is not None and r.low <= int(address[1]) <= r.high
    finally:
        streams.close()
    listener, offer = net_lane.offer(1, 2, "127.0.0.1", 4096, False, r)
    try:
        assert listener is not None and r.low <= offer[1] <= r.high and offer[1] == listener.getsockname()[1]
    finally:
        if listener is not None:
            listener.close()
    held = [hold(p) for p in range(r.low, r.high + 1)]
    try:  # none free: each is left off, as when it cannot listen at all (the job goes on without it)
        streams = Streams(0, 2, b"k" * 32, "job", 0, min_bytes=1, max_payload=1 << 20, timeout=1.0)
        assert streams.listen("127.0.0.1", r) is None
        streams.close()
        assert net_lane.offer(1, 2, "127.0.0.1", 4096, False, r) == (None, False)
    finally:
        for s in held:
            s.close()


# -- jobs ---------------------------------------------------------------------------------------

def ports_of(out: str) -> dict[int, list[int]]:
    found = {}
    for line in out.splitlines():
        if "PORTS " in line:
            entry = json.loads(line.split("PORTS ", 1)[1])
            found[entry["rank"]] = entry["ports"]
    return found


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_every_port_a_job_on_one_host_listens_on_is_in_the_range() -> None:
    r = free_block(30)
    result, _ = run_launcher("-v", "-np", "3", sys.executable, PORTS_WORKER, timeout=50,
                             RINGCOMM_PORT_RANGE=str(r))
    assert result.returncode == 0, result.stdout + result.stderr
    found = ports_of(result.stdout)
    assert sorted(found) == [0, 1, 2], result.stdout + result.stderr
    rendezvous = int(re.search(r"rendezvous at tcp://[^:]+:(\d+)", result.stderr).group(1))
    every = [rendezvous] + [p for rank in found for p in found[rank]]
    # rank 0: data sockets for ranks 1 and 2, its control socket, its stream socket; rank 1: one data
    # socket and its stream socket; rank 2: its stream socket
    assert [len(found[r_]) for r_ in range(3)] == [4, 2, 1], found
    assert all(r.low <= p <= r.high for p in every) and len(set(every)) == len(every), (r, rendezvous, found)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_range_too_small_for_the_job_fails_it_naming_the_range() -> None:
    r = free_block(2)
    result, _ = run_launcher("-np", "3", sys.executable, PORTS_WORKER, timeout=50, RINGCOMM_PORT_RANGE=str(r))
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert f"no free TCP port on 127.0.0.1 in RINGCOMM_PORT_RANGE={r} (2 ports, every one taken)" in out, out
    assert "widen the range on every host" in out and "PORTS " not in out


@pytest.mark.multiprocess
@pytest.mark.timeout(30)
def test_the_launcher_says_so_when_no_port_of_the_range_is_free_for_its_rendezvous() -> None:
    r = free_block(2)
    held = [hold(p) for p in (r.low, r.high)]
    try:
        result, took = run_launcher("-np", "2", sys.executable, PORTS_WORKER, timeout=25, RINGCOMM_PORT_RANGE=str(r))
    finally:
        for s in held:
            s.close()
    assert result.returncode == 2, result.stdout + result.stderr
    assert (f"cannot start the job: the rendezvous: no free TCP port on 127.0.0.1 in RINGCOMM_PORT_RANGE={r}"
            in result.stderr), result.stderr
    held = [hold(p) for p in (r.low, r.high)]
    try:  # an elastic job: its driver's store finds none either
        elastic, _ = run_launcher("-np", "2", "--min-np", "2", "--host-discovery-script", "echo localhost:2",
                                  sys.executable, PORTS_WORKER, timeout=25, RINGCOMM_PORT_RANGE=str(r))
    finally:
        for s in held:
            s.close()
    assert elastic.returncode != 0 and re.search(
        rf"elastic job failed: the rendezvous: no free TCP port on \S+ in RINGCOMM_PORT_RANGE={r} ",
        elastic.stderr), elastic.stderr
    bad, _ = run_launcher("-np", "2", sys.executable, PORTS_WORKER, timeout=25, RINGCOMM_PORT_RANGE="40000:40010")
    assert bad.returncode == 2 and "RINGCOMM_PORT_RANGE='40000:40010': use LOW-HIGH" in bad.stderr, bad.stderr


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_across_two_hosts_the_streams_lane_and_data_sockets_all_listen_in_the_range(hosts) -> None:  # type: ignore[no-untyped-def]
    r = free_block(40)
    argv = launcher_cmd("-v", "--ssh-command", str(hosts.ssh), "-np", "4", "-H",
                        f"{hosts.addr['a']}:2,{hosts.addr['b']}:2", sys.executable, PORTS_WORKER)
    proc = subprocess.run(hosts.exec_argv("a", argv), env=launcher_env(RINGCOMM_PORT_RANGE=str(r),
                                                                       RINGCOMM_NET_LANE_BYTES="-1"),
                          cwd=REPO_ROOT, text=True, capture_output=True, timeout=80)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = ports_of(proc.stdout)
    # each rank: a data socket per higher rank and its stream socket; rank 0 its control socket (the lane's
    # listeners, in the range too, are closed once its connections are made)
    assert [len(found.get(rank, [])) for rank in range(4)] == [3 + 2, 2 + 1, 1 + 1, 0 + 1], proc.stdout + proc.stderr
    rendezvous = int(re.search(r"rendezvous at tcp://[^:]+:(\d+)", proc.stderr).group(1))
    assert all(r.low <= p <= r.high for p in [rendezvous] + [p for v in found.values() for p in v]), (r, found)
