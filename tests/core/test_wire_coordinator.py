"""Tier 1: wire codec, response cache and the coordinator state machine — pure."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringcomm.core import wire
from ringcomm.core.cache import ResponseCache
from ringcomm.core.coordinator import JOIN_NAME, Coordinator
from ringcomm.core.ops import ReduceOp
from ringcomm.core.wire import Request

pytestmark = pytest.mark.pure

SECRET = b"s" * 32
shapes = st.lists(st.lists(st.integers(0, 5), max_size=3).map(tuple), min_size=1, max_size=3).map(tuple)
requests = st.builds(
    Request,
    name=st.text(min_size=1, max_size=20),
    kind=st.sampled_from([wire.ALLREDUCE, wire.BROADCAST, wire.ALLGATHER, wire.ALLTOALL, wire.REDUCESCATTER]),
    dtype=st.sampled_from(["float32", "int64", "bool"]),
    shapes=shapes,
    op=st.sampled_from([0, 1, 3, 4, 5]),  # every ReduceOp but Adasum, which never travels
    root=st.integers(-1, 7),
    prescale=st.floats(allow_nan=False, allow_infinity=False),
    postscale=st.floats(allow_nan=False, allow_infinity=False),
    splits=st.none() | st.lists(st.integers(0, 9), max_size=4).map(tuple),
    pset=st.integers(0, 2**20),
    refused=st.text(max_size=8),
    set_ranks=st.lists(st.integers(0, 9), max_size=4).map(tuple),
    set_id=st.integers(-1, 2**20),
    received_splits=st.none() | st.lists(st.integers(0, 9), max_size=4).map(tuple),
)


@given(requests)
def test_request_round_trips_through_the_control_envelope(req: Request) -> None:
    (frame,) = wire.encode_requests(SECRET, 3, [(req, req.pset, None)])
    kind, rank, items = wire.unpack_control(SECRET, frame)
    assert (kind, rank) == ("req", 3)
    assert wire.request_from_wire(items[0]) == req


def test_response_round_trip() -> None:
    resp = wire.Response(wire.ALLTOALL, ("x",), dtype="int8", splits=((1, 2), (3, 4)), first_dims=(1, 2))
    (frame,) = wire.encode_responses(SECRET, [resp])
    (_, items) = wire.unpack_control(SECRET, frame)
    assert wire.response_from_wire(items[0]) == resp


@given(st.binary(min_size=32, max_size=32), st.binary(max_size=200))
def test_foreign_or_garbage_control_frames_are_rejected(tag: bytes, body: bytes) -> None:
    with pytest.raises(ValueError):
        wire.unpack_control(SECRET, tag + body)


def test_wrong_secret_is_rejected_and_frame_count_checked() -> None:
    frame = wire.pack_control(b"other" * 8, ["req", 1, []])
    with pytest.raises(ValueError, match="authentication"):
        wire.unpack_control(SECRET, frame)
    with pytest.raises(ValueError):
        wire.unpack_control(SECRET, frame[:10])
    with pytest.raises(ValueError):
        wire.unpack_control(SECRET, [frame])


@given(st.recursive(st.none() | st.integers() | st.text(), lambda c: st.lists(c, max_size=4), max_leaves=12))
def test_request_decoder_never_crashes_on_arbitrary_structures(obj: object) -> None:
    try:
        req = wire.request_from_wire(obj)
    except (ValueError, TypeError):
        return
    assert isinstance(req, Request)


def test_cache_ids_are_assigned_in_record_order_and_bounded() -> None:
    c = ResponseCache(2)
    a, b, d = (Request(n, wire.ALLREDUCE, "float32", ((3,),)) for n in "abd")
    c.record(a), c.record(b), c.record(a), c.record(d)
    assert c.lookup(a) == 0 and c.lookup(b) == 1 and c.lookup(d) is None
    assert c.get(1) == b
    with pytest.raises(KeyError):
        c.get(5)


def ar(name: str, shape=(4,), dtype="float32", op=ReduceOp.SUM) -> Request:
    return Request(name, wire.ALLREDUCE, dtype, (shape,), int(op))


@settings(max_examples=60)
@given(st.integers(1, 5), st.lists(st.text("abcdef", min_size=1, max_size=3), min_size=1, max_size=8, unique=True),
       st.randoms())
def test_any_submission_order_gives_one_global_order(size: int, names: list[str], rnd) -> None:
    coord = Coordinator(size, fusion_threshold=10**9)
    emitted: list[str] = []
    events = [(r, n) for r in range(size) for n in names]
    rnd.shuffle(events)
    for r, n in events:
        coord.submit(r, ar(n))
        for resp in coord.take_responses():
            assert not resp.error
            emitted.extend(resp.names)
    assert sorted(emitted) == sorted(names)  # every op exactly once
    assert coord.pending_names() == []


def test_ready_allreduces_are_fused_by_dtype_and_threshold() -> None:
    coord = Coordinator(2, fusion_threshold=40)
    for r in range(2):
        coord.submit(r, ar("a"))  # 16 bytes
        coord.submit(r, ar("b", dtype="float64"))
        coord.submit(r, ar("c"))
        coord.submit(r, ar("d", shape=(10,)))
    resps = coord.take_responses()
    # a and c are float32 (32 bytes together); d would exceed 40 bytes
    fused = {r.names for r in resps}
    assert ("a", "c") in fused and ("b",) in fused and ("d",) in fused
    for resp in resps:
        assert resp.numels == tuple(4 if n in "abc" else 10 for n in resp.names)


def test_mismatched_shape_names_the_ranks_and_values() -> None:
    coord = Coordinator(3, 10**9)
    coord.submit(0, ar("g", shape=(3,)))
    coord.submit(1, ar("g", shape=(4,)))
    coord.submit(2, ar("g", shape=(3,)))
    (resp,) = coord.take_responses()
    assert "shape" in resp.error and "rank 0 and rank 2 have (3,)" in resp.error and "rank 1 has (4,)" in resp.error


@pytest.mark.parametrize(
    "field,a,b,label",
    [
        ("dtype", "float32", "float64", "dtype"),
        ("op", int(ReduceOp.SUM), int(ReduceOp.MAX), "reduce op"),
    ],
)
def test_other_mismatches(field: str, a, b, label: str) -> None:
    coord = Coordinator(2, 10**9)
    coord.submit(0, ar("g")._replace(**{field: a}))
    coord.submit(1, ar("g")._replace(**{field: b}))
    (resp,) = coord.take_responses()
    assert label in resp.error and "rank 0" in resp.error and "rank 1" in resp.error


def test_broadcast_root_mismatch_and_allgather_trailing_dims() -> None:
    coord = Coordinator(2, 10**9)
    coord.submit(0, Request("b", wire.BROADCAST, "int8", ((2,),), 0, 0))
    coord.submit(1, Request("b", wire.BROADCAST, "int8", ((2,),), 0, 1))
    coord.submit(0, Request("g", wire.ALLGATHER, "int8", ((2, 3),)))
    coord.submit(1, Request("g", wire.ALLGATHER, "int8", ((5, 4),)))
    coord.submit(0, Request("h", wire.ALLGATHER, "int8", ((2, 3),)))
    coord.submit(1, Request("h", wire.ALLGATHER, "int8", ((5, 3),)))
    b, g, h = coord.take_responses()
    assert "root_rank" in b.error
    assert "after the first" in g.error and "(3,)" in g.error and "(4,)" in g.error
    assert not h.error and h.first_dims == (2, 5)


def test_join_lets_allreduce_proceed_and_reports_last_joined() -> None:
    coord = Coordinator(3, 10**9)
    coord.submit(1, Request(JOIN_NAME, wire.JOIN))
    coord.submit(0, ar("x"))
    assert coord.take_responses() == []
    coord.submit(2, ar("x"))
    (resp,) = coord.take_responses()
    assert resp.names == ("x",) and resp.joined == (1,) and not resp.error
    coord.submit(2, Request("bc", wire.BROADCAST, "int8", ((1,),), 0, 0))
    coord.submit(0, Request("bc", wire.BROADCAST, "int8", ((1,),), 0, 0))
    (bad,) = coord.take_responses()
    assert "joined" in bad.error
    coord.submit(2, Request(JOIN_NAME, wire.JOIN))
    coord.submit(0, Request(JOIN_NAME, wire.JOIN))
    (j,) = coord.take_responses()
    assert j.kind == wire.JOIN and j.last_joined == 0
    # join state resets: a later allreduce needs everyone again
    coord.submit(0, ar("y"))
    assert coord.take_responses() == []


def test_stall_report_names_missing_ranks() -> None:
    coord = Coordinator(3, 10**9)
    coord.submit(0, ar("slow"), now=0.0)
    coord.submit(2, ar("slow"), now=1.0)
    assert coord.stalled(now=30.0, after=60.0) == []
    (stall,) = coord.stalled(now=61.0, after=60.0)
    assert stall.name == "slow" and stall.missing == (1,) and stall.submitted == (0, 2)


def test_alltoall_response_carries_every_ranks_splits() -> None:
    coord = Coordinator(2, 10**9)
    coord.submit(0, Request("a", wire.ALLTOALL, "int8", ((3,),), splits=(1, 2)))
    coord.submit(1, Request("a", wire.ALLTOALL, "int8", ((2,),), splits=(2, 0)))
    (resp,) = coord.take_responses()
    assert resp.splits == ((1, 2), (2, 0)) and not resp.error


def test_an_alltoall_fails_on_every_rank_when_a_rank_expects_other_rows_than_it_is_sent() -> None:
    """A rank that says what it expects from each rank (``received_splits``) is checked against
    the others' splits: a mismatch is an error response (every rank's), naming the counts."""
    coord = Coordinator(3, 10**9, ranks=(0, 2, 5), pset=1)
    splits = {0: (1, 2, 0), 2: (0, 0, 3), 5: (2, 2, 2)}
    expect = {0: (1, 0, 2), 2: (2, 0, 1), 5: None}  # rank 2 (member 1) gets 2, 0, 2 rows
    for r in (0, 2, 5):
        coord.submit(r, Request("a", wire.ALLTOALL, "int8", ((sum(splits[r]),),), splits=splits[r], pset=1,
                                received_splits=expect[r]))
    (resp,) = coord.take_responses()
    assert resp.error.startswith("alltoall 'a' in process set 1 (ranks [0, 2, 5]): rank 2 expects [2, 0, 1] rows "
                                 "from ranks [0, 2, 5], which send it [2, 0, 2]."), resp.error
    expect[2] = (2, 0, 2)
    for r in (0, 2, 5):
        coord.submit(r, Request("b", wire.ALLTOALL, "int8", ((sum(splits[r]),),), splits=splits[r], pset=1,
                                received_splits=expect[r]))
    (resp,) = coord.take_responses()
    assert not resp.error and resp.splits == tuple(splits[r] for r in (0, 2, 5))
