"""Tier 1: the pure core (ring schedule, fusion plan) — no sockets, no threads."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ringcomm.core import ring
from ringcomm.core.fusion import FusionItem, plan_fusion

pytestmark = pytest.mark.pure


@given(st.integers(0, 10_000), st.integers(1, 16))
def test_split_sizes_cover_length_evenly(length: int, parts: int) -> None:
    sizes = ring.split_sizes(length, parts)
    assert len(sizes) == parts and sum(sizes) == length
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # lower ranks get the extra


@pytest.mark.parametrize("size", range(1, 9))
@pytest.mark.parametrize("length", [0, 1, 3, 7, 8, 13, 64, 101])
def test_simulated_ring_gives_every_rank_the_sum(size: int, length: int) -> None:
    rng = np.random.default_rng(size * 1000 + length)
    bufs = [rng.integers(-100, 100, length).astype(np.int64) for _ in range(size)]
    expected = np.sum(bufs, axis=0) if length else np.zeros(0, np.int64)
    for out in ring.simulate_allreduce(bufs):
        np.testing.assert_array_equal(out, expected)


@given(st.integers(1, 8), st.integers(-3, 3))
def test_every_chunk_is_sent_once_per_phase(size: int, shift: int) -> None:
    for rank in range(size):
        sr = ring.scatter_reduce_steps(rank, size, shift)
        ag = ring.allgather_steps(rank, size, shift)
        assert len(sr) == len(ag) == size - 1
        owned = ring.owned_chunk(rank, size, shift)
        # scatter: every chunk but the first one sent is received exactly once
        if sr:
            assert sorted(s.recv_chunk for s in sr) == sorted(set(range(size)) - {sr[0].send_chunk})
        # what is received at step s is forwarded at step s+1
        for a, b in zip(sr, sr[1:]):
            assert a.recv_chunk == b.send_chunk
        if sr:
            assert sr[-1].recv_chunk == owned == ag[0].send_chunk
        # left neighbour sends exactly what this rank expects
        left = ring.left(rank, size)
        for mine, theirs in zip(sr, ring.scatter_reduce_steps(left, size, shift)):
            assert mine.recv_chunk == theirs.send_chunk
        for mine, theirs in zip(ag, ring.allgather_steps(left, size, shift)):
            assert mine.recv_chunk == theirs.send_chunk


def test_own_chunk_shift_makes_rank_own_its_block() -> None:
    for size in range(1, 8):
        for rank in range(size):
            assert ring.owned_chunk(rank, size, ring.OWN_CHUNK_SHIFT) == rank


@given(st.integers(0, 500), st.integers(0, 500), st.integers(1, 64))
def test_segments_tile_the_range(start: int, extra: int, seg: int) -> None:
    stop = start + extra
    segs = ring.segments(start, stop, seg)
    assert [a for a, _ in segs] == list(range(start, stop, seg))
    assert all(0 < b - a <= seg for a, b in segs)
    if segs:
        assert segs[0][0] == start and segs[-1][1] == stop


@given(st.lists(st.sampled_from("abcd"), max_size=6), st.randoms())
def test_ranks_are_one_per_host_when_no_two_share_a_host_whatever_their_order(hosts: list[str], rnd) -> None:
    apart = ring.one_per_host(hosts)
    assert apart == (len(hosts) >= 2 and all(hosts.count(h) == 1 for h in hosts))
    shuffled = list(hosts)
    rnd.shuffle(shuffled)
    assert ring.one_per_host(shuffled) == apart
    if apart:  # then every link joins two hosts, the ring's included
        assert all(hosts[r] != hosts[(r + 1) % len(hosts)] for r in range(len(hosts)))


items = st.lists(st.tuples(st.sampled_from(["f32", "f64", "i8"]), st.integers(0, 300)), max_size=40)


@given(items, st.integers(1, 1000))
def test_fusion_plan_partitions_and_respects_keys_and_threshold(raw: list, threshold: int) -> None:
    fitems = [FusionItem(k, n) for k, n in raw]
    groups = plan_fusion(fitems, threshold)
    flat = [i for g in groups for i in g]
    assert sorted(flat) == list(range(len(fitems)))
    for g in groups:
        assert g == sorted(g)
        assert len({fitems[i].key for i in g}) == 1
        total = sum(fitems[i].nbytes for i in g)
        assert total <= threshold or len(g) == 1


def test_fusion_is_deterministic_and_orders_groups_by_first_member() -> None:
    fitems = [FusionItem("a", 10), FusionItem("b", 10), FusionItem("a", 10), FusionItem("b", 95)]
    assert plan_fusion(fitems, 100) == [[0, 2], [1], [3]]
    assert plan_fusion(fitems, 100) == plan_fusion(list(fitems), 100)


def test_element_offsets() -> None:
    assert ring.offsets([2, 0, 3]) == [(0, 2), (2, 2), (2, 5)]


def test_small_allreduce_bound_grows_with_the_job_then_caps_rank0s_share_unless_set() -> None:
    from ringcomm.job.config import Settings
    from ringcomm.errors import InvalidInputError

    auto = Settings()
    assert [auto.small_allreduce_bytes_for(p) for p in (1, 2, 3, 4, 5, 6, 8, 16, 64)] == \
        [16384, 16384, 32768, 65536, 131072, 131072, 131072, 65536, 16384]
    assert Settings.from_env({"RINGCOMM_SMALL_ALLREDUCE_BYTES": "0"}).small_allreduce_bytes_for(2) == 0
    assert Settings.from_env({"RINGCOMM_SMALL_ALLREDUCE_BYTES": "4096"}).small_allreduce_bytes_for(8) == 4096
    with pytest.raises(InvalidInputError):
        Settings.from_env({"RINGCOMM_SMALL_ALLREDUCE_BYTES": "-2"})


def test_doubling_bound_is_256_kib_by_default_off_at_zero_and_agreed_across_ranks() -> None:
    from ringcomm.job.config import AGREED, Settings
    from ringcomm.errors import InvalidInputError

    assert [Settings().doubling_allreduce_bytes_for(p) for p in (1, 2, 3, 64)] == [0, 262144, 262144, 262144]
    assert Settings.from_env({"RINGCOMM_DOUBLING_ALLREDUCE_BYTES": "0"}).doubling_allreduce_bytes_for(4) == 0
    assert Settings.from_env({"RINGCOMM_DOUBLING_ALLREDUCE_BYTES": "65536"}).doubling_allreduce_bytes_for(4) == 65536
    with pytest.raises(InvalidInputError, match="RINGCOMM_DOUBLING_ALLREDUCE_BYTES"):
        Settings.from_env({"RINGCOMM_DOUBLING_ALLREDUCE_BYTES": "-2"})
    assert "doubling_allreduce_bytes" in AGREED  # ranks that chose differently would wait for each other
