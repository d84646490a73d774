"""The lane across hosts in one process: lanes joined by socket pairs, or by ``accept()`` over loopback.

What a rank posts reaches every peer in order; a rank whose peer's buffer is full keeps reading,
so two ranks that post much to each other never wait for each other; a restart after a join
drops what was sent before it; a broken connection is not an error of the lane's own.
"""

from __future__ import annotations

import re
import socket
import threading
import time

import numpy as np
import pytest

from ringcomm.shm import futex
from ringcomm.lane import net_lane
from ringcomm.core import lane
from ringcomm.errors import HorovodInternalError, ProtocolError
from test_algorithms_inprocess import run_ranks

pytestmark = pytest.mark.timeout(60)


def mesh(size: int, payload: int = 1 << 20, peer_timeout: float = 10.0) -> list[net_lane.NetLane]:
    """``size`` lanes, each pair joined by a socket pair."""
    socks: list[dict[int, socket.socket]] = [{} for _ in range(size)]
    for a in range(size):
        for b in range(a + 1, size):
            socks[a][b], socks[b][a] = socket.socketpair()
    return [net_lane.NetLane(r, size, socks[r], payload, payload, peer_timeout) for r in range(size)]


@pytest.fixture
def three():
    lanes = mesh(3)
    yield lanes
    for x in lanes:
        x.close()


def wait_posted(x: net_lane.NetLane, rank: int, index: int) -> None:
    deadline = time.monotonic() + 5
    while not lane.reached(x.posted(rank), index):
        assert time.monotonic() < deadline, f"rank {rank}'s index {index} never arrived"
        x.sleep_on_posted(rank, x.posted(rank), futex.timespec(0.1))


def test_every_rank_reads_every_rank_s_slot_and_the_same_parts(three):
    arrays = [np.arange(6, dtype=np.float32) * (r + 1) for r in range(3)]
    for r, x in enumerate(three):
        x.post(0, 77, True, [arrays[r]])
    for r, x in enumerate(three):
        for peer in range(3):
            wait_posted(x, peer, 0)
        assert x.fast_sizes(0, 77, 24) == [24, 24, 24]
        assert x.fast_sizes(0, 78, 24) is None  # another key: not fast
        assert x.seen((r + 1) % 3, 0) == lane.Seen(True, False, True, 77, 24)
        parts = x.typed_parts(0, [24] * 3, np.dtype(np.float32))
        assert all(np.array_equal(p, a) for p, a in zip(parts, arrays))


def test_an_index_posted_for_the_engine_and_an_unposted_index_read_as_on_one_host(three):
    a, b, c = three
    b.post(0, 5, False, ())
    wait_posted(a, 1, 0)
    assert a.seen(1, 0) == lane.Seen(True, False, False, 5, 0)
    assert a.seen(2, 0) == lane.Seen(False, False, False, 0, 0)
    assert a.still_missing([1, 2], 0, 5) is None  # rank 1 posted it as an engine entry: decided
    assert a.still_missing([2], 0, 5) == [2]
    assert a.key_at(1, 0) == 5 and a.key_at(2, 0) is None


def test_off_reaches_the_peers_and_a_sleeper_wakes_for_it(three):
    a, b, _ = three
    woke: list[bool] = []
    t = threading.Thread(target=lambda: woke.append(a.sleep_on_posted(1, 0, futex.timespec(5.0))))
    t.start()
    time.sleep(0.05)
    started = time.monotonic()
    b.set_off()
    t.join(5)
    assert woke == [True] and time.monotonic() - started < 1.0
    assert a.off(1) and a.seen(1, 0) == lane.Seen(False, True, False, 0, 0)


def test_a_sleep_with_nothing_posted_ends_at_its_timeout(three):
    a = three[0]
    started = time.monotonic()
    assert a.sleep_on_posted(1, 0, futex.timespec(0.2)) is False
    assert 0.15 < time.monotonic() - started < 2.0


def test_two_ranks_posting_more_than_their_buffers_hold_to_each_other_both_finish():
    a, b = mesh(2, payload=256 * 1024)
    n, big = 120, [np.ones(64 * 1024, np.float32)]  # 30 MiB each way, far past the socket buffers
    errors: list[BaseException] = []

    def poster(x: net_lane.NetLane) -> None:
        try:
            for k in range(n):
                x.post(k, k, True, big)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=poster, args=(x,)) for x in (a, b)]
    for t in threads:
        t.start()
    for x, peer in ((a, 1), (b, 0)):  # a rank that has posted all reads what its peer sends
        wait_posted(x, peer, n - 1)
        assert x.posted(peer) == n
    for t in threads:
        t.join(30)
    assert not errors and not any(t.is_alive() for t in threads)
    a.close()
    b.close()


def test_slots_this_rank_finished_reading_are_dropped_once_newer_ones_arrive(three):
    a, b, _ = three
    for k in range(net_lane.KEEP + 10):
        b.post(k, 1000 + k, False, ())
    wait_posted(a, 1, net_lane.KEEP + 9)
    assert a.key_at(1, 0) == 1000  # not finished reading yet: kept
    a.set_read_below(net_lane.KEEP + 10)
    b.post(net_lane.KEEP + 10, 7, False, ())
    wait_posted(a, 1, net_lane.KEEP + 10)
    assert a.key_at(1, 0) is None and a.key_at(1, 10) == 1010


def test_after_a_restart_frames_sent_before_it_are_dropped():
    a, b = mesh(2)
    b.post(0, 1, False, ())
    b.set_off()
    a.reset()  # the stale frames are still unread in a's socket
    b.reset()
    b.post(0, 2, True, [np.ones(2, np.int32)])
    wait_posted(a, 1, 0)
    assert a.seen(1, 0) == lane.Seen(True, False, True, 2, 8) and not a.off(1)
    a.close()
    b.close()


def test_a_frame_of_a_later_restart_is_a_protocol_error():
    a, b = mesh(2)
    b.reset()
    b.post(0, 1, False, ())
    with pytest.raises(ProtocolError, match="restart"):
        a.sleep_on_posted(1, 0, futex.timespec(2.0))
    a.close()
    b.close()


def test_a_peer_whose_connection_breaks_is_read_no_more(three):
    a, b, _ = three
    b.close()
    assert a.sleep_on_posted(1, 0, futex.timespec(0.2)) is False  # the engine reports the lost peer
    assert 1 in a._lost
    a.post(0, 3, False, ())  # the others still get it
    wait_posted(three[2], 0, 0)


def test_accept_connects_every_pair_and_refuses_a_stranger_first():
    offers = [net_lane.offer(r, 3, "127.0.0.1", 4096, encrypt=False) for r in range(3)]
    table = [{"rank": r, "host": f"h{r % 2}", "net_lane": o} for r, (_, o) in enumerate(offers)]
    stranger = socket.create_connection(("127.0.0.1", offers[0][1][1]))
    stranger.sendall(b"\x01\x00\x00\x00" + b"x" * 32)  # claims to be rank 1, without the secret
    lanes = run_ranks([lst for lst, _ in offers],  # every rank connects at once, each on its thread
                      lambda listener, r: net_lane.accept(listener, table, r, b"s" * 32, "job", 0, 10.0, 10.0))
    try:
        assert stranger.recv(10) == b""  # closed unanswered
        for r, x in enumerate(lanes):
            x.post(0, 9, True, [np.full(3, r, np.int16)])
        for x in lanes:
            for peer in range(3):
                wait_posted(x, peer, 0)
            assert x.fast_sizes(0, 9, 6) == [6, 6, 6]
            for sock in x._socks.values():
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        stranger.close()
        for x in lanes:
            x.close()


def test_no_lane_on_one_host_with_encryption_or_when_a_rank_has_it_off():
    assert net_lane.offer(0, 2, "127.0.0.1", 4096, encrypt=True) == (None, False)
    assert net_lane.offer(0, 2, "127.0.0.1", 0, encrypt=False) == (None, False)
    listener, offer = net_lane.offer(0, 2, "127.0.0.1", 4096, encrypt=False)
    one_host = [{"rank": 0, "host": "h", "net_lane": offer}, {"rank": 1, "host": "h", "net_lane": offer}]
    assert net_lane.accept(listener, one_host, 0, b"s", "job", 0, 1.0, 1.0) is None
    assert listener.fileno() == -1  # closed
    listener, offer = net_lane.offer(0, 2, "127.0.0.1", 4096, encrypt=False)
    one_off = [{"rank": 0, "host": "a", "net_lane": offer}, {"rank": 1, "host": "b", "net_lane": False}]
    assert net_lane.accept(listener, one_off, 0, b"s", "job", 0, 1.0, 1.0) is None


def test_a_peer_that_never_connects_is_named_with_the_fix():
    listener, offer = net_lane.offer(1, 2, "127.0.0.1", 4096, encrypt=False)
    gone = socket.socket()
    gone.bind(("127.0.0.1", 0))  # bound, never listening: connecting is refused
    table = [{"rank": 0, "host": "a", "net_lane": ["127.0.0.1", gone.getsockname()[1], 4096]},
             {"rank": 1, "host": "b", "net_lane": offer}]
    with pytest.raises(HorovodInternalError, match=r"rank 1: cannot connect the small-op lane .* rank 0 at "
                                                   r".*RINGCOMM_NET_LANE_BYTES=0"):
        net_lane.accept(listener, table, 1, b"s", "job", 0, 2.0, 1.0)
    gone.close()


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_a_rank_killed_while_a_peer_waits_in_the_lane_is_reported_by_name():
    from conftest import WORKERS, launch

    proc = launch(2, [str(WORKERS / "net_lane_kill_worker.py")], timeout=60)
    found = re.search(r"\[0\]<stdout>:RAISED (\w+) after ([\d.]+) s: (.*)", proc.stdout)
    assert found, proc.stdout[-3000:] + proc.stderr[-3000:]
    kind, seconds, text = found.groups()
    assert kind == "PeerLostError" and "rank 1" in text and float(seconds) < 15, found.group(0)
    assert "allreduce 'y' was waiting in the small-op lane for rank(s) [1]" in text, found.group(0)
