"""The device arena's ranges (:class:`ringcomm_torch.device_arena_rows.Slots`), its shards and its
grouping of ranks by host: pure, in memory."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")

from ringcomm_torch.device_arena_rows import Slots  # noqa: E402
from ringcomm_torch.device_ipc import host_groups, shard_bounds  # noqa: E402

ALIGN = 256


def rounded(nbytes: int) -> int:
    return max(ALIGN, -(-nbytes // ALIGN) * ALIGN)


def test_a_range_is_aligned_and_rounded_up_and_a_full_arena_says_none():
    s = Slots(4096, align=ALIGN)
    assert s.take(1) == 0
    assert s.take(257) == 256  # the first took one aligned unit
    assert s.take(0) == 768  # an empty tensor still takes a unit: every range has a distinct start
    assert s.take(4096) is None
    assert s.free_bytes == 4096 - 1024


def test_freed_neighbours_merge_so_a_large_range_fits_again():
    s = Slots(1024, align=ALIGN)
    starts = [s.take(256) for _ in range(4)]
    assert starts == [0, 256, 512, 768] and s.take(1) is None
    for start in (256, 768, 512, 0):
        s.give(start)
    assert s.take(1024) == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 3000), st.integers(0, 50)), max_size=60))
def test_ranges_in_use_never_overlap_and_every_byte_is_free_or_taken(steps):
    cap = 8192
    s = Slots(cap, align=ALIGN)
    held: dict[int, int] = {}  # start -> bytes asked
    for take, nbytes, pick in steps:
        if take or not held:
            start = s.take(nbytes)
            if start is None:  # no gap between the ranges in use is large enough
                edges = sorted((a, a + rounded(n)) for a, n in held.items())
                gaps = [b[0] - a[1] for a, b in zip([(0, 0)] + edges, edges + [(cap, cap)])]
                assert max(gaps) < rounded(nbytes), (gaps, nbytes)
                continue
            assert start % ALIGN == 0 and start + nbytes <= cap
            for other, n in held.items():
                assert start + max(nbytes, 1) <= other or other + max(n, 1) <= start, (start, other)
            held[start] = nbytes
        else:
            start = sorted(held)[pick % len(held)]
            s.give(start)
            del held[start]
        used = sum(rounded(n) for n in held.values())
        assert s.free_bytes + used == cap
    for start in list(held):
        s.give(start)
    assert s.take(cap) == 0  # all of it merged back into one range


@given(st.integers(0, 10_000), st.integers(1, 16))
def test_the_shards_cover_the_buffer_once_in_rank_order(numel, size):
    bounds = [shard_bounds(numel, r, size) for r in range(size)]
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert max(hi - lo for lo, hi in bounds) - min(hi - lo for lo, hi in bounds) <= 1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from("abcd"), min_size=1, max_size=12), st.integers(0, 500))
def test_across_hosts_each_element_is_summed_once_per_host_and_every_rank_reads_the_same_grouping(hosts, numel):
    """What the arena's allreduce across hosts relies on: each host's ranks split the tensor into
    shards that cover it once, so the hosts' buffers (a shard each, zeros elsewhere) sum to one
    term per host for every element."""
    groups = host_groups(hosts)
    assert sorted(r for g in groups for r in g) == list(range(len(hosts)))
    assert len(groups) == len(set(hosts))
    for g in groups:
        assert list(g) == sorted(g) and len({hosts[r] for r in g}) == 1
        terms = [0] * numel
        for index in range(len(g)):
            lo, hi = shard_bounds(numel, index, len(g))
            for i in range(lo, hi):
                terms[i] += 1
        assert terms == [1] * numel
    assert [g[0] for g in groups] == sorted(g[0] for g in groups)  # hosts in order of their first rank
