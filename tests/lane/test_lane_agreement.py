"""Which ops a rank may post fast while others are in flight: only behind ops every rank posted alike.

One process plays rank 0 of a two-rank lane (conftest's ``lane_pair``) and rank 1 through a
second view of the region.  An op behind another that a peer posted at the same index is safe
to post fast; behind one the peer has not posted, or posted as another op, it is not (the
peer might wait for it in the engine while this rank waits for the peer's next post).
"""

from __future__ import annotations

import numpy as np
import pytest

from ringcomm.lane import driver
from ringcomm.lane.handle import LaneHandle
from ringcomm.shm import futex, slots as shm
from ringcomm.core import lane, wire
from ringcomm.handles import Entry

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not (futex.available() and shm.available()), reason="needs futexes and /dev/shm (Linux x86-64)"),
]


def small(name: str) -> Entry:
    x = np.ones(4, np.float32)
    return Entry(wire.Request(name, wire.ALLREDUCE, "float32", (x.shape,), 1), [x], LaneHandle(name))


def large(name: str) -> Entry:
    """Larger than the lane's 4 KiB: posted as an engine entry."""
    x = np.ones(2048, np.float32)
    return Entry(wire.Request(name, wire.ALLREDUCE, "float32", (x.shape,), 1), [x], LaneHandle(name))


def test_behind_an_engine_op_the_peer_posted_at_the_same_index_a_small_op_goes_fast(lane_pair):
    lane_driver, peer, _ = lane_pair
    x = large("x")
    assert not lane_driver.submit(x, others=0)  # False: the caller hands it to the engine
    peer.post(0, lane.op_key(x.req), False, ())
    assert lane_driver.submit(small("y"), others=1)


@pytest.mark.parametrize("peer_posts", ["nothing", "another op", "the same op, rewritten since"])
def test_behind_an_op_the_peer_did_not_post_at_that_index_a_small_op_goes_to_the_engine(lane_pair, peer_posts):
    lane_driver, peer, submitted = lane_pair
    x = large("x")
    assert not lane_driver.submit(x, others=0)
    if peer_posts == "another op":
        peer.post(0, lane.op_key(small("y").req), True, [np.ones(4, np.float32)])
    elif peer_posts == "the same op, rewritten since":
        for k in range(5):  # index 4 lives in index 0's entry (4 slots)
            peer.post(k, lane.op_key(x.req) if k == 0 else k, False, ())
        assert peer.key_at(1, 0) is None and peer.key_at(1, 4) == 4
    y = small("y")
    if peer_posts == "nothing":  # the peer may only be behind: queued, then to the engine in 2 ms
        assert lane_driver.submit(y, others=1)
        assert wait_for(lambda: y in submitted)
        assert lane_driver._region.key_at(0, 1) == lane.op_key(y.req)  # posted for the engine
    else:
        assert not lane_driver.submit(y, others=1)


def wait_for(cond, seconds: float = 10.0) -> bool:
    import time

    deadline = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def test_an_op_in_flight_the_lane_does_not_know_keeps_a_small_op_off_it(lane_pair):
    lane_driver, peer, _ = lane_pair
    # another process set's op, say: in flight, but never posted on the lane
    assert not lane_driver.submit(small("y"), others=1)


def test_behind_ops_both_ranks_posted_alike_fast_or_not_a_small_op_goes_fast(lane_pair, monkeypatch):
    lane_driver, peer, _ = lane_pair
    monkeypatch.setattr(driver, "AGREE_SECONDS", 0.0)  # not queued for a peer that may be behind
    a, b = small("a"), small("b")
    assert lane_driver.submit(a, others=0)  # pending, fast, at index 0
    assert not lane_driver.submit(b, others=1)  # the peer has not posted index 0 yet: b goes to the engine
    peer.post(0, lane.op_key(a.req), True, [np.ones(4, np.float32)])
    peer.post(1, lane.op_key(b.req), False, ())
    assert lane_driver.submit(small("c"), others=2)
    b.handle.set_result(None)  # a finished engine op no longer counts
    assert lane_driver.submit(small("d"), others=2) is False  # c (index 2) is not posted by the peer


def test_a_post_makes_the_wake_call_only_while_a_peer_sleeps_and_a_sleeper_wakes_at_once(lane_pair, monkeypatch):
    import threading
    import time

    lane_driver, peer, _ = lane_pair
    calls: list[int] = []
    real_wake = futex.wake
    monkeypatch.setattr(futex, "wake", lambda addr: (calls.append(addr), real_wake(addr)))
    x = np.ones(4, np.float32)
    peer.post(0, 7, True, [x])  # rank 0 sleeps on nothing: no system call
    assert calls == []
    woke: list[float] = []

    def sleeper() -> None:
        seen = lane_driver._region.posted(1)  # rank 0's thread sleeps on rank 1's word
        lane_driver._region.sleep_on_posted(1, seen, futex.timespec(20.0))
        woke.append(time.monotonic())

    t = threading.Thread(target=sleeper)
    t.start()
    deadline = time.monotonic() + 10
    while not lane_driver._region.sleeping(0) and time.monotonic() < deadline:
        time.sleep(0.001)  # until rank 0's sleeping word says so
    posted_at = time.monotonic()
    peer.post(1, 7, True, [x])
    t.join(10)
    assert len(calls) == 1 and woke and woke[0] - posted_at < 5.0  # not the 20 s timeout
    peer.post(2, 7, True, [x])
    assert len(calls) == 1  # the sleeper has left: its word is back to 0


def test_the_wait_checks_off_peers_that_posted_the_same_op_and_stops_at_anything_else(lane_pair):
    lane_driver, peer, _ = lane_pair
    region, x = lane_driver._region, np.ones(4, np.float32)
    assert region.still_missing([1], 0, 7) == [1]
    peer.post(0, 7, True, [x])
    assert region.still_missing([1], 0, 7) == []
    peer.post(1, 8, True, [x])  # another op at index 1
    assert region.still_missing([1], 1, 7) is None
    peer.post(2, 7, False, ())  # the same op, but for the engine
    assert region.still_missing([1], 2, 7) is None
    peer.set_off()
    assert region.still_missing([1], 3, 7) is None


def test_slots_are_free_below_the_slowest_ranks_read_count(lane_pair):
    lane_driver, peer, _ = lane_pair
    region = lane_driver._region
    region.set_read_below(6)
    peer.set_read_below(4)
    assert region.all_read_below(2) == 4 and region.all_read_below(4) == 4 and region.all_read_below(5) == 5
    region.set_read_below(2**32 - 1)  # counters wrap: index 2**32 - 2 finished, 2**32 - 1 not
    peer.set_read_below(2**32 - 1)
    assert region.all_read_below(2**32 - 3) == 2**32 - 1


def test_typed_payload_views_are_made_once_per_slot_and_show_each_rewrite(lane_pair):
    lane_driver, peer, _ = lane_pair
    region, f32 = lane_driver._region, np.dtype(np.float32)
    for index, value in ((1, 1.0), (5, 2.0)):  # 4 slots: index 5 rewrites index 1's slots
        region.post(index, 7, True, [np.full(4, value, np.float32)])
        peer.post(index, 7, True, [np.full(4, -value, np.float32)])
        parts = region.typed_parts(index, [16, 16], f32)
        assert [p.tolist() for p in parts] == [[value] * 4, [-value] * 4]
    assert region.typed_parts(1, [16, 16], f32) is parts  # the same views, not new ones
    assert [p.dtype for p in region.typed_parts(1, [8, 8], np.dtype(np.float64))] == [np.float64] * 2


def test_a_small_op_behind_an_op_a_peer_posts_a_moment_later_is_queued_and_goes_fast(lane_pair, monkeypatch):
    import threading

    lane_driver, peer, submitted = lane_pair
    monkeypatch.setattr(driver, "AGREE_SECONDS", 30.0)
    # the sweeper would otherwise finish "a" the moment the peer posts it, and "b" would then find
    # fewer ops in flight than it was submitted behind: it goes to the engine, the safe side
    monkeypatch.setattr(driver, "SWEEP_SECONDS", 60.0)
    a = small("a")
    assert lane_driver.submit(a, others=0)  # index 0, pending
    returned, posted = threading.Event(), threading.Event()

    def post_once_b_is_submitted() -> None:  # or after 10 s, if the submit waits for this post
        returned.wait(10.0)
        peer.post(0, lane.op_key(a.req), True, [np.ones(4, np.float32)])
        posted.set()

    poster = threading.Thread(target=post_once_b_is_submitted, daemon=True)
    poster.start()
    b = small("b")
    assert lane_driver.submit(b, others=1)  # queued: the submit does not wait for the peer
    assert not posted.is_set(), "the submit waited for the peer's post"
    returned.set()
    poster.join()
    assert wait_for(lambda: b.handle.index == 1)  # posted fast once the peer posted index 0
    assert not submitted and peer.seen(0, 1).fast


def test_a_queued_op_whose_peer_does_not_post_goes_to_the_engine_after_the_bound(lane_pair, monkeypatch):
    import time

    lane_driver, peer, submitted = lane_pair
    # bounds far apart: a loaded machine may stall a thread for a few hundred milliseconds
    monkeypatch.setattr(driver, "AGREE_SECONDS", 2.0)
    assert lane_driver.submit(small("a"), others=0)
    started = time.monotonic()
    b = small("b")
    assert lane_driver.submit(b, others=1)
    assert time.monotonic() - started < 1.0  # the submit returns at once, not after the bound
    assert wait_for(lambda: b in submitted)
    assert 2.0 <= time.monotonic() - started < 20
    peer.post(0, lane.op_key(small("x").req), True, [np.ones(4, np.float32)])  # another op at index 0
    started = time.monotonic()
    assert not lane_driver.submit(small("c"), others=2)  # decided at once: no wait for a peer that disagrees
    assert time.monotonic() - started < 1.0


def test_with_every_slot_still_read_by_a_lagging_peer_submits_return_at_once_and_post_in_order(lane_pair):
    import time

    lane_driver, peer, submitted = lane_pair
    entries = [large(f"op{i}") for i in range(10)]  # 4 slots: the 5th post needs the peer to read index 0
    started = time.monotonic()
    returned = [lane_driver.submit(e, others=i) for i, e in enumerate(entries)]
    assert time.monotonic() - started < 0.5  # no submit waited for the peer
    # the first four posted (the caller hands them to the engine), the rest queued
    assert returned[:4] == [False] * 4 and all(returned[4:]) and not submitted
    time.sleep(0.05)
    assert not submitted  # the sweeper posts nothing while the peer still reads index 0
    peer.set_read_below(10)  # the peer has read every entry: the sweeper posts the rest, in order
    assert wait_for(lambda: len(submitted) == 6)
    assert [e.req.name for e in submitted] == [f"op{i}" for i in range(4, 10)]
    assert [peer.key_at(0, k) for k in range(6, 10)] == [lane.op_key(e.req) for e in entries[6:]]
