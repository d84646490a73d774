"""The names of unnamed ops (``core/naming.py``), in memory: every rank that makes the same calls names them
alike, each process set and kind counts on its own, a join starts the count again, and a rank that skipped ops
rank 0 failed as stalled catches up with the others."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ringcomm.core import wire
from ringcomm.core.naming import WIRE_KINDS, OpCall, OpNames
from ringcomm.errors import InvalidInputError

pytestmark = pytest.mark.pure

KINDS = ["allreduce", "allgather", "broadcast", "grouped_allreduce", "add_process_set"]
#: one call: (kind, the user's name or None, process set)
calls = st.tuples(st.sampled_from(KINDS), st.one_of(st.none(), st.sampled_from(["w", "b.1", "grad"])),
                  st.integers(0, 3))


@given(st.lists(calls, max_size=60))
def test_unnamed_ops_are_numbered_from_0_per_set_and_kind_and_named_ones_take_no_number(seq) -> None:
    names = OpNames()
    seen: dict[tuple[int, str], int] = {}
    for kind, name, pset in seq:
        got = names.name(kind, name, pset)
        if name is not None:
            assert got == name
        else:
            n = seen.get((pset, kind), 0)
            assert got == f"{kind}.noname.{n}"
            seen[(pset, kind)] = n + 1


@given(st.lists(st.one_of(calls, st.just("join")), max_size=60))
def test_ranks_that_make_the_same_calls_and_joins_give_the_same_names(seq) -> None:
    ranks = [OpNames() for _ in range(3)]
    for call in seq:
        if call == "join":
            assert len({r.joined() for r in ranks}) == 1
        else:
            assert len({r.name(*call) for r in ranks}) == 1


@given(st.lists(st.sampled_from(KINDS), max_size=20), st.integers(1, 4), st.lists(st.sampled_from(KINDS), max_size=20))
def test_after_the_jth_join_unnamed_ops_count_from_0_as_kind_noname_j_n(before, joins, after) -> None:
    names = OpNames()
    for kind in before:
        names.name(kind, None, 0)
    for j in range(1, joins + 1):
        assert names.joined() == j
    counts: dict[str, int] = {}
    for kind in after:
        assert names.name(kind, None, 0) == f"{kind}.noname.{joins}.{counts.get(kind, 0)}"
        counts[kind] = counts.get(kind, 0) + 1


@given(st.lists(st.tuples(st.sampled_from(KINDS), st.integers(0, 2)), min_size=1, max_size=40),
       st.data(), st.integers(0, 2))
def test_a_rank_that_skipped_the_stalled_ops_names_its_next_op_as_the_others_do(ops, data, joins) -> None:
    """Rank 1 stops submitting after ``stop`` ops; rank 0 goes on, and the ops rank 1 never submitted are
    failed as stalled and reported to it: its next unnamed op of every kind and set pairs with rank 0's."""
    ahead, behind = OpNames(), OpNames()
    for _ in range(joins):
        ahead.joined(), behind.joined()
    stop = data.draw(st.integers(0, len(ops)))
    skipped = []
    for i, (kind, pset) in enumerate(ops):
        name = ahead.name(kind, None, pset)
        if i < stop:
            assert behind.name(kind, None, pset) == name
        else:
            skipped.append((pset, name))
    behind.caught_up(skipped)
    for kind in KINDS:
        for pset in range(3):
            assert behind.name(kind, None, pset) == ahead.name(kind, None, pset)


@given(st.sampled_from(KINDS), st.integers(0, 5), st.integers(0, 50))
def test_skipped_ops_that_were_named_or_numbered_before_the_last_join_do_not_move_the_count(kind, before, n) -> None:
    names = OpNames()
    names.joined()
    names.caught_up([(0, "grad"), (0, f"{kind}.named"), (0, f"{kind}.noname.{before + 2}.{n}")])
    assert names.name(kind, None, 0) == f"{kind}.noname.1.0"
    names.caught_up([(0, f"{kind}.noname.1.{n}")])  # since the last join: the count moves past it
    assert names.name(kind, None, 0) == f"{kind}.noname.1.{max(1, n + 1)}"


def test_the_count_only_moves_forward() -> None:
    names = OpNames()
    for _ in range(5):
        names.name("allreduce", None, 0)
    names.caught_up([(0, "allreduce.noname.2"), (1, "allreduce.noname.7")])  # behind this rank: no change
    assert names.name("allreduce", None, 0) == "allreduce.noname.5"
    assert names.name("allreduce", None, 1) == "allreduce.noname.8"  # another set: its own count


@pytest.mark.parametrize("bad", ["", 0, b"x", 1.5])
def test_a_name_that_is_not_a_non_empty_string_is_refused_with_the_kind_and_the_value(bad) -> None:
    with pytest.raises(InvalidInputError, match=rf"broadcast: name must be a non-empty string, got {bad!r}"):
        OpNames().name("broadcast", bad, 0)


def test_a_refused_call_names_its_op_kind_set_rank_and_reason_on_the_wire() -> None:
    call = OpCall(rank=2, kind=wire.BROADCAST, name="broadcast_object.noname.3", pset=1)
    req = call.refusal("broadcast_object 'x': root_rank=9 is out of range for a job of size 4; use 0..3")
    assert (req.name, req.kind, req.pset) == ("broadcast_object.noname.3", wire.BROADCAST, 1)
    assert req.refused == "rank 2: broadcast_object 'x': root_rank=9 is out of range for a job of size 4; use 0..3"
    assert wire.request_from_wire(list(req)) == req
    assert call.part("len") == OpCall(2, wire.BROADCAST, "broadcast_object.noname.3.len", 1)


def test_every_kind_of_call_submits_a_kind_of_the_wire() -> None:
    assert set(WIRE_KINDS.values()) <= set(wire.KINDS)
    assert {"allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "alltoall",
            "reducescatter", "grouped_reducescatter", "broadcast_object", "allgather_object"} <= set(WIRE_KINDS)
