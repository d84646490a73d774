"""Which ops a rank may post fast while others are in flight: only behind ops every rank posted alike.

One process plays rank 0 of a two-rank lane (conftest's ``lane_pair``) and rank 1 through a
second view of the region.  An op behind another that a peer posted at the same index is safe
to post fast; behind one the peer has not posted, or posted as another op, it is not (the
peer might wait for it in the engine while this rank waits for the peer's next post).
"""

from __future__ import annotations

import numpy as np
import pytest

from ringcomm import fastpath, futex, shm
from ringcomm.core import lane, wire
from ringcomm.handles import Entry

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not (futex.available() and shm.available()), reason="needs futexes and /dev/shm (Linux x86-64)"),
]


def small(name: str) -> Entry:
    x = np.ones(4, np.float32)
    return Entry(wire.Request(name, wire.ALLREDUCE, "float32", (x.shape,), 1), [x], fastpath.LaneHandle(name))


def large(name: str) -> Entry:
    """Larger than the lane's 4 KiB: posted as an engine entry."""
    x = np.ones(2048, np.float32)
    return Entry(wire.Request(name, wire.ALLREDUCE, "float32", (x.shape,), 1), [x], fastpath.LaneHandle(name))


def test_behind_an_engine_op_the_peer_posted_at_the_same_index_a_small_op_goes_fast(lane_pair):
    fp, peer, _ = lane_pair
    x = large("x")
    assert not fp.submit(x, others=0)  # False: the caller hands it to the engine
    peer.post(0, lane.op_key(x.req), False, ())
    assert fp.submit(small("y"), others=1)


@pytest.mark.parametrize("peer_posts", ["nothing", "another op", "the same op, rewritten since"])
def test_behind_an_op_the_peer_did_not_post_at_that_index_a_small_op_goes_to_the_engine(lane_pair, peer_posts):
    fp, peer, _ = lane_pair
    x = large("x")
    assert not fp.submit(x, others=0)
    if peer_posts == "another op":
        peer.post(0, lane.op_key(small("y").req), True, [np.ones(4, np.float32)])
    elif peer_posts == "the same op, rewritten since":
        for k in range(5):  # index 4 lives in index 0's entry (4 slots)
            peer.post(k, lane.op_key(x.req) if k == 0 else k, False, ())
        assert peer.key_at(1, 0) is None and peer.key_at(1, 4) == 4
    assert not fp.submit(small("y"), others=1)


def test_an_op_in_flight_the_lane_does_not_know_keeps_a_small_op_off_it(lane_pair):
    fp, peer, _ = lane_pair
    # another process set's op, say: in flight, but never posted on the lane
    assert not fp.submit(small("y"), others=1)


def test_behind_ops_both_ranks_posted_alike_fast_or_not_a_small_op_goes_fast(lane_pair):
    fp, peer, _ = lane_pair
    a, b = small("a"), small("b")
    assert fp.submit(a, others=0)  # pending, fast, at index 0
    assert not fp.submit(b, others=1)  # the peer has not posted index 0 yet: b goes to the engine
    peer.post(0, lane.op_key(a.req), True, [np.ones(4, np.float32)])
    peer.post(1, lane.op_key(b.req), False, ())
    assert fp.submit(small("c"), others=2)
    b.handle.set_result(None)  # a finished engine op no longer counts
    assert fp.submit(small("d"), others=2) is False  # c (index 2) is not posted by the peer
