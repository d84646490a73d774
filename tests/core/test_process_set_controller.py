"""Tier 1: process sets in the pure core — the per-set controller and set rings over a parent link.

No sockets: the controller is fed requests directly; ``SubLink`` runs the real
ring algorithms over in-process queue links, one thread per rank.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_algorithms_inprocess import queue_links, run_ranks

from ringcomm.collectives import algorithms
from ringcomm.core import wire
from ringcomm.core.controller import Controller
from ringcomm.core.ops import ReduceOp
from ringcomm.core.wire import Request, Response

pytestmark = pytest.mark.pure


def ar(name: str, pset: int = 0, shape=(4,), dtype="float32") -> Request:
    return Request(name, wire.ALLREDUCE, dtype, (shape,), int(ReduceOp.SUM), pset=pset)


def add(ctl: Controller, ranks: tuple[int, ...], name: str = "add") -> Response:
    """Every rank asks to add ``ranks``; returns the (single) ADD response."""
    for r in range(ctl.size):
        ctl.submit(r, Request(name, wire.ADD_PSET, set_ranks=ranks))
    (resp, members), = ctl.take_responses()
    assert members == tuple(range(ctl.size))
    return resp


def test_adding_sets_numbers_them_in_order_and_rejects_bad_ranks() -> None:
    ctl = Controller(4, 10**9)
    assert add(ctl, (0, 2), "a1").set_id == 1
    assert add(ctl, (1, 3), "a2").set_id == 2
    assert ctl.members(1) == (0, 2) and ctl.members(2) == (1, 3)
    dup = add(ctl, (0, 2), "a3")
    assert "already exists (id 1)" in dup.error
    assert "already exists (id 0)" in add(ctl, (0, 1, 2, 3), "a4").error
    assert "out of range" in add(ctl, (2, 4), "a5").error
    assert "sorted and distinct" in add(ctl, (2, 1), "a6").error
    # the failed adds consumed no id
    assert add(ctl, (3,), "a7").set_id == 3


def test_ranks_must_agree_on_the_set_to_add() -> None:
    ctl = Controller(3, 10**9)
    ctl.submit(0, Request("a", wire.ADD_PSET, set_ranks=(0, 1)))
    ctl.submit(1, Request("a", wire.ADD_PSET, set_ranks=(0, 1)))
    ctl.submit(2, Request("a", wire.ADD_PSET, set_ranks=(0, 2)))
    (resp, _), = ctl.take_responses()
    assert "disagree on the ranks" in resp.error and "rank 2 has [0, 2]" in resp.error
    assert "Pass the same ranks on every rank." in resp.error
    assert list(ctl.sets) == [0]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=3, unique=True),
       st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=3, unique=True), st.randoms())
def test_disjoint_sets_negotiate_independently(names1: list[str], names2: list[str], rnd) -> None:
    """Whatever the interleaving, a set's op is released once *its* members announced it, never later."""
    ctl = Controller(4, fusion_threshold=1)  # no fusion: one response per op
    add(ctl, (0, 1), "s1")
    add(ctl, (2, 3), "s2")
    events = [(r, n, 1) for r in (0, 1) for n in names1] + [(r, n, 2) for r in (2, 3) for n in names2]
    rnd.shuffle(events)
    seen: dict[tuple[int, str], set[int]] = {}
    emitted: list[tuple[int, str]] = []
    for r, n, pset in events:
        ctl.submit(r, ar(n, pset))
        seen.setdefault((pset, n), set()).add(r)
        for resp, members in ctl.take_responses():
            assert not resp.error
            assert members == ((0, 1) if resp.pset == 1 else (2, 3))
            (name,) = resp.names
            emitted.append((resp.pset, name))
        # released exactly the ops all of whose members have announced them
        complete = {k for k, who in seen.items() if len(who) == 2}
        assert set(emitted) == complete
    assert sorted(emitted) == sorted([(1, n) for n in names1] + [(2, n) for n in names2])
    assert not ctl.has_pending()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sets(st.integers(0, 4), min_size=1), min_size=1, max_size=4), st.randoms())
def test_overlapping_sets_each_op_reaches_exactly_its_members_once(sets: list[set[int]], rnd) -> None:
    """Any sets (overlapping or not), any submission order: an op is emitted once, after its last
    member announced it, to exactly its members; each rank receives one consistent order."""
    ctl = Controller(5, fusion_threshold=10**9)
    ids = {}
    for i, members in enumerate(sets):
        ranks = tuple(sorted(members))
        resp = add(ctl, ranks, f"add{i}")
        if resp.error:  # the same ranks twice, or every rank: use the set registered first
            assert "already exists" in resp.error
            continue
        ids[resp.set_id] = ranks
    ids[0] = tuple(range(5))
    events = [(r, f"op{j}", pset) for pset, ranks in ids.items() for r in ranks for j in range(2)]
    rnd.shuffle(events)
    received: dict[int, list[tuple[int, tuple[str, ...]]]] = {r: [] for r in range(5)}
    announced: dict[tuple[int, str], set[int]] = {}
    for r, name, pset in events:
        ctl.submit(r, ar(name, pset))
        announced.setdefault((pset, name), set()).add(r)
        for resp, members in ctl.take_responses():
            assert not resp.error and members == ids[resp.pset]
            for n in resp.names:
                assert announced[(resp.pset, n)] == set(members)  # released once all members announced
            for m in members:
                received[m].append((resp.pset, resp.names))
    for pset, ranks in ids.items():
        for r in ranks:
            got = sorted(n for p, names in received[r] if p == pset for n in names)
            assert got == ["op0", "op1"]
    # two ranks see the ops they share in the same relative order
    for a in range(5):
        for b in range(a + 1, 5):
            common = [x for x in received[a] if x in received[b]]
            assert common == [x for x in received[b] if x in received[a]]
    assert not ctl.has_pending()


def test_rank_0_busy_answers_only_sets_without_it() -> None:
    ctl = Controller(4, 10**9)
    add(ctl, (2, 3))
    for r in range(4):
        ctl.submit(r, ar("g"))
    ctl.submit(2, ar("s", 1))
    ctl.submit(3, ar("s", 1))
    ((resp, members),) = ctl.take_responses(skip_member=0)
    assert resp.names == ("s",) and members == (2, 3)
    ((resp, members),) = ctl.take_responses()  # the global op waited for the next call
    assert resp.names == ("g",) and members == (0, 1, 2, 3)


def test_one_name_in_two_sets_is_two_ops() -> None:
    ctl = Controller(3, 10**9)
    add(ctl, (0, 1))
    ctl.submit(0, ar("x", 0))
    ctl.submit(1, ar("x", 1))
    ctl.submit(0, ar("x", 1))
    ((resp, members),) = ctl.take_responses()
    assert resp.pset == 1 and members == (0, 1)
    ctl.submit(1, ar("x", 0))
    ctl.submit(2, ar("x", 0))
    ((resp, members),) = ctl.take_responses()
    assert resp.pset == 0 and members == (0, 1, 2)


def test_set_responses_are_indexed_by_rank_within_the_set() -> None:
    ctl = Controller(4, 10**9)
    add(ctl, (1, 3))
    ctl.submit(3, Request("g", wire.ALLGATHER, "int8", ((5, 2),), pset=1))
    ctl.submit(1, Request("g", wire.ALLGATHER, "int8", ((2, 2),), pset=1))
    ctl.submit(1, Request("t", wire.ALLTOALL, "int8", ((3,),), splits=(1, 2), pset=1))
    ctl.submit(3, Request("t", wire.ALLTOALL, "int8", ((2,),), splits=(2, 0), pset=1))
    ctl.submit(1, Request("bad", wire.ALLTOALL, "int8", ((3,),), splits=(1, 1, 1), pset=1))
    ctl.submit(3, Request("bad", wire.ALLTOALL, "int8", ((3,),), splits=(1, 1, 1), pset=1))
    (g, _), (t, _), (bad, _) = ctl.take_responses()
    assert g.first_dims == (2, 5)  # set rank 0 is global rank 1
    assert t.splits == ((1, 2), (2, 0))
    assert "one entry per rank (2)" in bad.error


def test_mismatch_in_a_set_names_the_set_and_global_ranks() -> None:
    ctl = Controller(4, 10**9)
    add(ctl, (0, 2))
    ctl.submit(0, ar("m", 1, shape=(3,)))
    ctl.submit(2, ar("m", 1, shape=(4,)))
    ((resp, members),) = ctl.take_responses()
    assert members == (0, 2)
    assert resp.error == ("allreduce 'm' in process set 1 (ranks [0, 2]): ranks disagree on shape: "
                          "rank 0 has (3,); rank 2 has (4,). Pass the same shape on every rank.")


def test_requests_outside_a_set_are_answered_to_the_sender_only() -> None:
    ctl = Controller(3, 10**9)
    add(ctl, (0, 2))
    ctl.submit(1, ar("x", 1))
    ctl.submit(2, ar("y", 7))
    ctl.submit(0, Request("j", wire.JOIN, pset=1))
    (a, to_a), (b, to_b), (c, to_c) = ctl.take_responses()
    assert to_a == (1,) and "rank 1 is not a member of process set 1 (ranks [0, 2])" in a.error
    assert to_b == (2,) and "process set 7 is not registered" in b.error
    assert to_c == (0,) and "global process set only" in c.error


def test_removing_a_set_runs_agreed_ops_fails_waiting_ones_and_forgets_the_set() -> None:
    ctl = Controller(3, 10**9)
    add(ctl, (1, 2))
    ctl.submit(1, ar("done", 1))
    ctl.submit(2, ar("done", 1))
    ctl.submit(1, ar("waiting", 1))
    for r in range(3):
        ctl.submit(r, Request("rm", wire.REMOVE_PSET, set_id=1))
    out = ctl.take_responses()
    kinds = [(resp.names, resp.kind, bool(resp.error), members) for resp, members in out]
    assert kinds == [
        (("done",), wire.ALLREDUCE, False, (1, 2)),
        (("waiting",), wire.ALLREDUCE, True, (1, 2)),
        (("rm",), wire.REMOVE_PSET, False, (0, 1, 2)),
    ]
    assert "when the set was removed" in out[1][0].error
    assert 1 not in ctl.sets
    ctl.submit(2, ar("late", 1))
    ((late, to),) = ctl.take_responses()
    assert to == (2,) and "process set 1 was removed" in late.error
    for r in range(3):
        ctl.submit(r, Request("rm0", wire.REMOVE_PSET, set_id=0))
    ((resp, _),) = ctl.take_responses()
    assert "cannot be removed" in resp.error


def test_stalls_are_reported_per_set_with_global_ranks() -> None:
    ctl = Controller(4, 10**9)
    add(ctl, (1, 2, 3))
    ctl.submit(1, ar("slow", 1), now=0.0)
    ctl.submit(3, ar("slow", 1), now=1.0)
    ctl.submit(0, ar("slow", 0), now=5.0)
    assert ctl.stalled(now=30.0, after=60.0) == []
    ((pset, stall),) = ctl.stalled(now=61.0, after=60.0)
    assert pset == 1 and stall.submitted == (1, 3) and stall.missing == (2,)
    assert ctl.where(1) == " in process set 1 (ranks [1, 2, 3])"
    ctl.fail(1, "slow", "stalled: gave up")
    ((resp, members),) = ctl.take_responses()
    assert resp.error == "stalled: gave up" and resp.error_kind == "stall" and members == (1, 2, 3)
    assert [p for p, _ in ctl.stalled(now=100.0, after=60.0)] == [0]  # the global set's op still waits


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 6).flatmap(lambda n: st.tuples(st.just(n), st.sets(st.integers(0, n - 1), min_size=1))),
       st.integers(0, 40), st.integers(1, 7), st.integers(0, 2**16))
def test_ring_algorithms_over_a_subset_of_a_job(job_and_set, n: int, seg: int, seed: int) -> None:
    """SubLink: the real ring over set ranks, every message on the parent's pairwise queues."""
    size, members = job_and_set
    ranks = tuple(sorted(members))
    links = queue_links(size)
    rng = np.random.default_rng(seed)
    inputs = {r: rng.integers(0, 9, n).astype("int64") for r in ranks}
    rows = [int(rng.integers(0, 4)) for _ in ranks]
    seq = (5 << 40) | 3  # a set's sequence numbers carry its id in the high bits

    def fn(link, _index):
        r = link.rank  # the global rank
        sub = algorithms.SubLink(link, ranks)
        assert sub.rank == ranks.index(r) and sub.size == len(ranks)
        summed = inputs[r].copy()
        algorithms.ring_allreduce(sub, summed, ReduceOp.SUM, seq, seg)
        out = np.empty(sum(rows), "int64")
        start = sum(rows[: sub.rank])
        out[start:start + rows[sub.rank]] = r
        algorithms.ring_allgatherv(sub, out, rows, seq + 1, seg)
        b = inputs[r].copy() if sub.rank == len(ranks) - 1 else np.zeros(n, "int64")
        algorithms.broadcast(sub, b, len(ranks) - 1, seq + 2, seg)
        return summed, out, b

    results = run_ranks([links[r] for r in ranks], fn)
    expected_sum = np.sum([inputs[r] for r in ranks], axis=0) if n else np.zeros(0, "int64")
    expected_gather = np.repeat(np.array(ranks, dtype="int64"), rows)
    for summed, gathered, b in results:
        np.testing.assert_array_equal(summed, expected_sum)
        np.testing.assert_array_equal(gathered, expected_gather)
        np.testing.assert_array_equal(b, inputs[ranks[-1]])
    outsiders = [r for r in range(size) if r not in ranks]
    for r in range(size):  # nothing was sent to or from ranks outside the set
        for o in outsiders:
            assert links[r]._boxes[(r, o)].empty() and links[r]._boxes[(o, r)].empty()


def test_sublink_refuses_a_rank_outside_the_set() -> None:
    links = queue_links(3)
    with pytest.raises(ValueError):
        algorithms.SubLink(links[1], (0, 2))


def test_a_rank_that_shut_down_fails_the_ops_it_never_submitted_in_its_sets_only() -> None:
    from ringcomm.core.coordinator import SHUTDOWN_NAME

    ctl = Controller(3, 10**9)
    assert add(ctl, (0, 2), "a1").set_id == 1  # a set without rank 1
    x = Request("x", wire.ALLREDUCE, "float32", ((4,),), 1)
    done = Request("done", wire.ALLREDUCE, "float32", ((4,),), 1)
    for r in (0, 1):
        ctl.submit(r, done)  # rank 1 submitted this one before it left: it runs once rank 2 comes
    ctl.submit(0, x)
    ctl.submit(2, x)
    ctl.submit(0, Request("y", wire.ALLREDUCE, "float32", ((4,),), 1, pset=1))
    ctl.submit(1, Request(SHUTDOWN_NAME, wire.SHUTDOWN))
    (resp, ranks), = ctl.take_responses()
    assert resp.names == ("x",) and ranks == (0, 1, 2) and resp.error_kind == "mismatch"
    assert resp.error.startswith("rank 1 shut down (its program ended, or it called shutdown()) while rank(s) "
                                 "[0, 2] waited for it in allreduce 'x'")
    # later ops that need rank 1 fail at once; the set without it goes on
    ctl.submit(2, Request("z", wire.ALLREDUCE, "float32", ((4,),), 1))
    ctl.submit(2, Request("y", wire.ALLREDUCE, "float32", ((4,),), 1, pset=1))
    ctl.submit(2, done)
    got = {(r.names, r.pset): r.error for r, _ in ctl.take_responses()}
    assert got[(("y",), 1)] == "" and got[(("done",), 0)] == ""
    assert got[(("z",), 0)].startswith("rank 1 shut down")
    # the shutdown itself completes once every rank submitted it
    for r in (0, 2):
        ctl.submit(r, Request(SHUTDOWN_NAME, wire.SHUTDOWN))
    (resp, _), = ctl.take_responses()
    assert resp.kind == wire.SHUTDOWN and not resp.error
