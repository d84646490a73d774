"""How far a ring pass sends ahead of its arrivals, and that results stay right where a link queues
the caller's arrays themselves (as a stream to another host does) and the pass sends far ahead.

``RefLink`` queues each array by reference and reads it only when the receiver takes it, later than
a real stream reads it: a pass that wrote into memory it had queued and not yet seen arrive would
deliver the wrong values here.  It also reads payloads straight into the memory the receiver named
with ``expect``, as the streams do.
"""

from __future__ import annotations

import queue

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringcomm.collectives import algorithms
from ringcomm.core import ring
from ringcomm.core.ops import ReduceOp
from test_algorithms_inprocess import QueueLink, make_inputs, queue_links, ring_allreduce_rank, run_ranks

pytestmark = pytest.mark.pure


class RefLink(QueueLink):
    """A :class:`QueueLink` whose sends queue the array itself, as a stream queues it."""

    def __init__(self, rank: int, size: int, boxes: dict) -> None:
        super().__init__(rank, size, boxes)
        self.placed: dict[tuple[int, int, int], np.ndarray] = {}

    def queues_by_reference(self, dst: int, nbytes: int) -> bool:
        return True

    def send(self, dst: int, seq: int, tag: int, arr: np.ndarray) -> None:
        self._boxes[(self.rank, dst)].put((seq, tag, arr))  # read when taken, not now

    def expect(self, src: int, seq: int, tag: int, view: np.ndarray) -> None:
        self.placed[(src, seq, tag)] = view

    def _arrived(self, src: int, seq: int, tag: int, item: object) -> object:
        """Read the queued array now; into the memory ``expect`` named, if it named some."""
        assert isinstance(item, np.ndarray)
        data = item.view(np.uint8).reshape(-1)
        view = self.placed.pop((src, seq, tag), None)
        if view is not None and view.nbytes == data.nbytes:
            view.view(np.uint8).reshape(-1)[...] = data
            return view
        return data.tobytes()


def ref_links(size: int) -> list[RefLink]:
    boxes = {(a, b): queue.Queue() for a in range(size) for b in range(size)}
    return [RefLink(r, size, boxes) for r in range(size)]


def test_a_pass_sends_further_ahead_where_the_link_queues_by_reference(monkeypatch) -> None:
    monkeypatch.setattr(ring, "STREAM_AHEAD_BYTES", 48)  # 6 segments of 2 float32
    n, seg = 64, 2  # each of the 2 chunks is 16 segments
    copying, referencing = queue_links(2)[0], ref_links(2)[0]
    for link, ahead in ((copying, algorithms.LOOKAHEAD), (referencing, 6)):
        algorithms.allreduce_pass(link, np.ones(n, np.float32), ReduceOp.SUM, 0, seg).start()
        sent = link._boxes[(0, 1)].qsize()
        assert sent == ahead < 16, (type(link).__name__, sent)


def test_a_stream_lookahead_is_a_number_of_bytes_and_never_below_the_copying_one() -> None:
    link = ref_links(2)[0]
    assert ring.STREAM_AHEAD_BYTES == 32 << 20
    assert [algorithms.lookahead(link, 1, n) for n in (4 << 20, 8 << 20, 12 << 20, 64 << 20, 1 << 10)] == [
        8, 4, 2, algorithms.LOOKAHEAD, 32 << 10]
    assert algorithms.lookahead(queue_links(2)[0], 1, 8 << 20) == algorithms.LOOKAHEAD


def test_the_lookahead_is_asked_of_the_link_through_a_process_set() -> None:
    link = ref_links(4)[1]
    sub = algorithms.SubLink(link, (1, 3))
    assert algorithms.lookahead(sub, 1, 4 << 20) == 8
    assert algorithms.lookahead(algorithms.SubLink(queue_links(4)[1], (1, 3)), 1, 4 << 20) == algorithms.LOOKAHEAD


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 5), st.integers(0, 200), st.sampled_from(["int32", "float32", "float64"]),
       st.sampled_from([ReduceOp.SUM, ReduceOp.MAX]), st.integers(1, 6), st.booleans(), st.integers(0, 2**16))
def test_allreduce_is_right_when_every_segment_is_queued_by_reference(size, n, dtype, op, seg, separate_input,
                                                                      seed) -> None:
    inputs = make_inputs(size, n, dtype, seed)
    expected = (np.sum if op is ReduceOp.SUM else np.max)(np.stack(inputs), axis=0).astype(dtype)
    outs = run_ranks(ref_links(size), ring_allreduce_rank(inputs, op, seg, separate_input))
    for out in outs:
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)  # summed in ring order, not numpy's
        assert out.tobytes() == outs[0].tobytes()  # the same bits on every rank


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 5), st.lists(st.integers(0, 40), min_size=5, max_size=5), st.integers(1, 6))
def test_allgatherv_and_reducescatter_are_right_when_segments_are_queued_by_reference(size, counts5, seg) -> None:
    counts = counts5[:size]
    parts = [np.arange(c, dtype=np.float64) + 100 * r for r, c in enumerate(counts)]

    def gather(link, r):
        out = np.zeros(sum(counts), np.float64)
        out[sum(counts[:r]):sum(counts[:r + 1])] = parts[r]
        algorithms.ring_allgatherv(link, out, counts, 0, seg)
        return out

    for out in run_ranks(ref_links(size), gather):
        np.testing.assert_array_equal(out, np.concatenate(parts))

    inputs = [np.arange(sum(counts), dtype=np.float64) * (r + 1) for r in range(size)]

    def scatter(link, r):
        buf = inputs[r].copy()
        a, b = algorithms.ring_reducescatter(link, buf, counts, ReduceOp.SUM, 1, seg)
        return buf[a:b].copy()

    total = np.sum(np.stack(inputs), axis=0)
    for r, out in enumerate(run_ranks(ref_links(size), scatter)):
        np.testing.assert_array_equal(out, total[sum(counts[:r]):sum(counts[:r + 1])])


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 5), st.data(), st.integers(1, 6))
def test_an_alltoall_reads_each_segment_straight_into_its_place_where_the_link_can(size, data, seg) -> None:
    splits = [data.draw(st.lists(st.integers(0, 9), min_size=size, max_size=size)) for _ in range(size)]
    sends = [np.arange(sum(s), dtype=np.float32) + 100 * r for r, s in enumerate(splits)]
    links = ref_links(size)
    placed = []
    for link in links:  # count the segments the link reads into the memory the alltoall named
        def arrived(src, seq, tag, item, link=link, base=RefLink._arrived):
            got = base(link, src, seq, tag, item)
            placed.append(isinstance(got, np.ndarray))
            return got
        link._arrived = arrived

    def fn(link, r):
        recv = [splits[i][r] for i in range(size)]
        out = np.full(sum(recv), -1, np.float32)
        cut = ring.offsets(splits[r]), ring.offsets(recv)
        algorithms.alltoall(link, [sends[r][a:b] for a, b in cut[0]], [out[a:b] for a, b in cut[1]], 0, seg)
        return out

    for r, out in enumerate(run_ranks(links, fn)):
        want = [sends[i][ring.offsets(splits[i])[r][0]:ring.offsets(splits[i])[r][1]] for i in range(size)]
        np.testing.assert_array_equal(out, np.concatenate(want))
    assert all(placed)  # every segment from another rank: none was copied again
