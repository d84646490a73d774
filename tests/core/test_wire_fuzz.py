"""Tier 1: every decoder of peer input is fuzzed — one error type, no crash, no hang, bounded memory.

The decoders are pure functions (wire.py), so hypothesis can throw millions of
shapes of garbage at them quickly: arbitrary bytes, truncated and oversized
frames, authenticated msgpack of the wrong structure, and well-formed messages
with one field of the wrong type or range.  Anything but a valid message must
raise :class:`ringcomm.ProtocolError` (which the engine drops and logs).
"""

from __future__ import annotations

import struct
import tracemalloc

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringcomm import ProtocolError
from ringcomm.core import wire
from ringcomm.core.wire import Request, Response

pytestmark = pytest.mark.pure

SECRET = b"k" * 32

#: Anything msgpack can carry, nested a little.
leaves = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
          | st.binary(max_size=8))
values = st.recursive(leaves, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=3), c, max_size=3),
                      max_leaves=16)

VALID_REQ = list(Request("g", wire.ALLREDUCE, "float32", ((2, 3),), 1, -1, 1.0, 1.0, None))
VALID_RESP = list(Response(wire.ALLTOALL, ("x",), "int8", splits=((1, 2), (3, 4)), first_dims=(1, 2)))


def _decode_all(obj: object) -> None:
    """Run every structured decoder on ``obj``; each either succeeds or raises ProtocolError."""
    for decode in (wire.request_from_wire, wire.response_from_wire, wire.parse_response_batch,
                   lambda o: wire.parse_request_batch(o, 4)):
        try:
            decode(obj)
        except ProtocolError:
            pass


@settings(max_examples=400)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_never_escape_as_anything_but_protocol_error(junk: bytes) -> None:
    with pytest.raises(ProtocolError):
        wire.unpack_control(SECRET, junk)
    # the same bytes with a valid tag: msgpack garbage, then structure garbage
    try:
        obj = wire.unpack_control(SECRET, wire.sign(SECRET, junk) + junk)
    except ProtocolError:
        return
    _decode_all(obj)


@settings(max_examples=300)
@given(values)
def test_authenticated_msgpack_of_any_structure_is_rejected_or_valid(obj: object) -> None:
    frame = wire.pack_control(SECRET, obj)
    _decode_all(wire.unpack_control(SECRET, frame))


@settings(max_examples=300)
@given(st.sampled_from(["request", "response"]), st.data())
def test_one_field_of_the_wrong_type_or_range_is_a_protocol_error(which: str, data) -> None:
    base, decode = (VALID_REQ, wire.request_from_wire) if which == "request" else (VALID_RESP, wire.response_from_wire)
    obj = list(base)
    i = data.draw(st.integers(0, len(obj) - 1))
    obj[i] = data.draw(values)
    obj = msgpack.unpackb(msgpack.packb(obj, use_bin_type=True), raw=False, strict_map_key=False)
    try:
        got = decode(obj)
    except ProtocolError:
        return
    # accepted: then every field has the type the engine relies on
    assert isinstance(got.kind, str) and got.kind in wire.KINDS
    assert type(got.op) is int and 0 <= got.op <= 5
    assert isinstance(got.dtype, str)
    if which == "request":
        assert all(type(d) is int and 0 <= d < 2**63 for s in got.shapes for d in s)
        assert got.splits is None or all(type(d) is int and d >= 0 for d in got.splits)
    else:
        assert all(isinstance(n, str) for n in got.names) and isinstance(got.data, bytes)
        assert all(type(d) is int and d >= 0 for d in got.numels + got.first_dims)


def test_the_decoders_tables_match_the_ops_module() -> None:
    """wire.py keeps its own copy of the op and dtype names (it imports no NumPy): they must agree."""
    from ringcomm.core import ops

    assert wire._OPS == {int(op) for op in ops.ReduceOp if op is not ops.ReduceOp.ADASUM}
    assert wire._DTYPES == set(ops.SUPPORTED_DTYPES) | {""}


def test_valid_messages_still_decode() -> None:
    assert wire.request_from_wire(VALID_REQ) == Request(*VALID_REQ)
    assert wire.response_from_wire(list(VALID_RESP)) == Response(*VALID_RESP)
    # response-cache ids come back as (process set id, id); the global set's travel as bare ints
    assert wire.parse_request_batch(["req", 2, [VALID_REQ, 7, {"q": 3, "d": b"xy"}, {"s": 2, "c": 5},
                                                {"q": {"s": 1, "c": 0}, "d": b"z"}, {"q": 4, "w": 2.5}]], 4) == (
        2, [(Request(*VALID_REQ), None, 0.0), ((0, 7), None, 0.0), ((0, 3), b"xy", 0.0), ((2, 5), None, 0.0),
            ((1, 0), b"z", 0.0), ((0, 4), None, 2.5)])
    for bad in ({"s": 1}, {"s": -1, "c": 0}, {"s": 1, "c": "x"}, {"s": 1, "c": 0, "d": b""}, {"q": 3},
                {"q": 3, "w": -1.0}, {"q": 3, "w": float("inf")}, {"q": 3, "w": "1"}, {"q": 3, "d": 5}):
        with pytest.raises(ProtocolError):
            wire.parse_request_batch(["req", 2, [bad]], 4)


def test_every_response_the_coordinator_makes_passes_the_strict_decoder() -> None:
    """The strict decoder must accept all the coordinator emits: fused, error, stall, join, alltoall."""
    from ringcomm.core.coordinator import Coordinator

    coord = Coordinator(2, 1 << 20, small_bytes=1024)
    reqs = [
        Request("a", wire.ALLREDUCE, "float32", ((3,),), 1), Request("b", wire.ALLREDUCE, "float32", ((300,),), 1),
        Request("g", wire.ALLGATHER, "int8", ((2, 3),)), Request("t", wire.ALLTOALL, "bool", ((2,),), splits=(1, 1)),
        Request("c", wire.BROADCAST, "float64", ((),), root=1), Request("r", wire.REDUCESCATTER, "int64", ((4,),), 3),
        Request("k", wire.BARRIER),
    ]
    for q in reqs:
        coord.submit(0, q)
        coord.submit(1, q)
    coord.submit(0, Request("m", wire.ALLREDUCE, "float32", ((3,),), 1))
    coord.submit(1, Request("m", wire.ALLREDUCE, "float32", ((4,),), 1))  # a mismatch
    coord.submit(0, Request("s", wire.ALLREDUCE, "float32", ((3,),), 1))
    coord.fail("s", "stalled")
    coord.submit(0, Request("j", wire.JOIN))
    coord.submit(1, Request("j", wire.JOIN))
    resps = coord.take_responses()
    assert {r.error_kind for r in resps} == {"", "mismatch", "stall"}
    (frame,) = wire.encode_responses(SECRET, resps)
    assert wire.parse_response_batch(wire.unpack_control(SECRET, frame)) == resps


requests = st.builds(
    Request, name=st.text(max_size=6), kind=st.sampled_from(wire.KINDS),
    dtype=st.sampled_from(sorted(wire._DTYPES)), shapes=st.lists(st.lists(st.integers(0, 2**40), max_size=3)
                                                                 .map(tuple), max_size=3).map(tuple),
    op=st.sampled_from(sorted(wire._OPS)), root=st.integers(-1, 64), prescale=st.floats(allow_nan=False),
    postscale=st.floats(allow_nan=False),
    splits=st.none() | st.lists(st.integers(0, 99), max_size=4).map(tuple), pset=st.integers(0, 9),
    refused=st.text(max_size=4), set_ranks=st.lists(st.integers(0, 64), max_size=4).map(tuple),
    set_id=st.integers(-1, 9), received_splits=st.none() | st.lists(st.integers(0, 99), max_size=4).map(tuple),
)
items = st.lists(st.tuples(requests | st.integers(0, 2**40), st.integers(0, 9), st.none() | st.binary(max_size=16),
                           st.just(0.0) | st.floats(0.0, 1e6, exclude_min=True)),
                 max_size=8)


@settings(max_examples=200)
@given(items, st.integers(1, 7))
def test_encoded_request_batches_decode_to_what_was_sent(sent, rank: int) -> None:
    """Both halves of the codec agree: a rank's announcements come back item by item, in order."""
    got = []
    for frame in wire.encode_requests(SECRET, rank, sent):
        src, part = wire.parse_request_batch(wire.unpack_control(SECRET, frame), 8)
        assert src == rank
        got += part
    want = [(it if isinstance(it, Request) else (pset, it), data, waited) for it, pset, data, waited in sent]
    assert got == want


def test_request_batches_split_before_the_payload_bound(monkeypatch) -> None:
    monkeypatch.setattr(wire, "CONTROL_DATA_BYTES", 10)
    sent = [(Request(f"n{i}", wire.ALLREDUCE), 0, b"x" * 4) for i in range(5)] + [(3, 0, None)]
    frames = wire.encode_requests(SECRET, 1, sent)
    sizes = [len(wire.parse_request_batch(wire.unpack_control(SECRET, f), 2)[1]) for f in frames]
    assert sizes == [2, 2, 2]  # two payloads of 4 fit in 10; the cache id carries no data


@settings(max_examples=200)
@given(st.lists(st.binary(max_size=12), max_size=12))
def test_response_batches_keep_the_data_of_a_frame_within_the_bound(monkeypatch_data) -> None:
    bound = 16
    resps = [Response(wire.ALLREDUCE, (f"n{i}",), data=d) for i, d in enumerate(monkeypatch_data)]
    old, wire.CONTROL_DATA_BYTES = wire.CONTROL_DATA_BYTES, bound
    try:
        batches = wire.response_batches(resps)
    finally:
        wire.CONTROL_DATA_BYTES = old
    assert [r for b in batches for r in b] == resps  # same order, nothing lost
    for b in batches:
        assert len(b) == 1 or sum(len(r.data) for r in b) <= bound


def test_set_management_messages_carry_their_own_fields() -> None:
    add = Request("a", wire.ADD_PSET, set_ranks=(0, 2))
    rm = Request("r", wire.REMOVE_PSET, set_id=3)
    assert wire.request_from_wire(list(add)).set_ranks == (0, 2)
    assert wire.request_from_wire(list(rm)).set_id == 3
    resp = Response(wire.ADD_PSET, ("a",), set_id=1, set_ranks=(0, 2))
    assert wire.response_from_wire(list(resp)) == resp
    for bad in (-2, "1", 2**63):
        with pytest.raises(ProtocolError):
            wire.request_from_wire(list(rm._replace(set_id=bad)))
    with pytest.raises(ProtocolError):
        wire.response_from_wire(list(resp._replace(set_ranks=(0, -1))))


@pytest.mark.parametrize(
    "obj,field",
    [
        (["n", "allreduce", "float32", [[2**63]]], "shapes"),  # larger than int64
        (["n", "allreduce", "float32", [[-1]]], "shapes"),
        (["n", "allreduce", "float32", [[True]]], "shapes"),  # a bool is not a dimension
        (["n", "allreduce", "object"], "dtype"),
        (["n", "allreduce", "float32", [], 99], "op"),
        (["n", "allreduce", "float32", [], 1, -2], "root"),
        (["n", "allreduce", "float32", [], 1, 0, "2"], "prescale"),
        (["n", "alltoall", "float32", [[3]], 1, 0, 1.0, 1.0, [1.5]], "splits"),
        ([7, "allreduce"], "name"),
        (["n", "allgatherish"], "kind"),
    ],
)
def test_wrong_fields_name_the_field(obj: list, field: str) -> None:
    with pytest.raises(ProtocolError, match=f"field '{field}'"):
        wire.request_from_wire(obj)


def test_deeply_nested_lists_cannot_exhaust_the_stack() -> None:
    """Finding: the old decoder recursed into nested lists, so an authenticated body nested
    1000 deep (msgpack allows 1024) raised RecursionError in the engine thread and killed it."""
    deep: list = ["leaf"]
    for _ in range(1000):
        deep = [deep]
    frame = wire.pack_control(SECRET, ["req", 1, [["n", "allreduce", "float32", deep]]])
    with pytest.raises(ProtocolError):
        wire.parse_request_batch(wire.unpack_control(SECRET, frame), 2)
    with pytest.raises(ProtocolError):
        wire.parse_response_batch(wire.unpack_control(SECRET, wire.pack_control(SECRET, ["resp", [deep]])))


@pytest.mark.parametrize("announced", [2**31 - 1, 2**32 - 1])
@pytest.mark.parametrize("prefix", [b"\xc6", b"\xdb", b"\xdd", b"\xdf"])  # bin32, str32, array32, map32
def test_oversized_length_prefixes_allocate_nothing(prefix: bytes, announced: int) -> None:
    """A msgpack length field announcing 4 GiB in a 40-byte body is refused without allocating it."""
    body = prefix + struct.pack(">I", announced) + b"\x00" * 8
    frame = wire.sign(SECRET, body) + body
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError):
            wire.unpack_control(SECRET, frame)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_a_frame_larger_than_the_limit_is_refused_before_the_tag_is_computed() -> None:
    with pytest.raises(ProtocolError, match="larger than"):
        wire.unpack_control(SECRET, bytes(wire.MAX_CONTROL_BYTES + wire.TAG_BYTES + 1))


# -- data-plane messages ------------------------------------------------------


@settings(max_examples=500)
@given(st.binary(max_size=40), st.integers(0, 4), st.integers(0, 16), st.integers(0, 1 << 21))
def test_data_messages_parse_or_raise_protocol_error(head: bytes, nframes: int, slots: int, slot_bytes: int) -> None:
    try:
        msg = wire.parse_data(head, nframes, slots, slot_bytes)
    except ProtocolError:
        return
    assert msg.kind in (b"S", b"I", b"A", b"L", b"R", b"B", b"P", b"Y")
    if msg.kind == b"L":
        assert 0 <= msg.lost < 2**32
    elif msg.kind in (b"S", b"A"):
        assert 0 <= msg.slot < slots  # never an index outside the ring
    elif msg.kind == b"P":
        assert len(msg.token) == 16
    if msg.kind == b"S":
        assert msg.nbytes <= slot_bytes


@settings(max_examples=200)
@given(st.sampled_from([wire.NOTE, wire.INLINE, wire.ACK, wire.LOST, wire.REF, wire.READ, wire.PROBE,
                        wire.PROBE_ANSWER]), st.data())
def test_truncated_or_extended_data_headers_are_rejected(layout: struct.Struct, data) -> None:
    kind = {wire.NOTE: b"S", wire.INLINE: b"I", wire.ACK: b"A", wire.LOST: b"L", wire.REF: b"R", wire.READ: b"B",
            wire.PROBE: b"P", wire.PROBE_ANSWER: b"Y"}[layout]
    head = kind + bytes(layout.size - 1)
    good_frames = 2 if kind == b"I" else 1
    assert wire.parse_data(head, good_frames, 8, 1 << 20).kind == kind
    cut = data.draw(st.integers(0, layout.size - 1))
    with pytest.raises(ProtocolError):
        wire.parse_data(head[:cut], good_frames, 8, 1 << 20)
    with pytest.raises(ProtocolError):
        wire.parse_data(head + data.draw(st.binary(min_size=1, max_size=8)), good_frames, 8, 1 << 20)
    with pytest.raises(ProtocolError):
        wire.parse_data(head, good_frames + 1, 8, 1 << 20)


@given(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.integers(0, 2**32 - 1),
       st.binary(min_size=16, max_size=16), st.booleans())
def test_messages_of_reading_a_peers_memory_round_trip(address: int, n: int, seq: int, tag: int, token: bytes,
                                                        ok: bool) -> None:
    ref = wire.parse_data(wire.REF.pack(b"R", address, n, seq, tag), 1, 8, 1 << 20)
    assert (ref.kind, ref.address, ref.nbytes, ref.seq, ref.tag) == (b"R", address, n, seq, tag)
    probe = wire.parse_data(wire.PROBE.pack(b"P", address, token), 1, 8, 1 << 20)
    assert (probe.kind, probe.address, probe.token) == (b"P", address, token)
    assert wire.parse_data(wire.PROBE_ANSWER.pack(b"Y", ok), 1, 8, 1 << 20).ok is ok
    assert wire.parse_data(wire.READ.pack(b"B"), 1, 8, 1 << 20).kind == b"B"


@pytest.mark.parametrize(
    "head,pattern",
    [
        (wire.NOTE.pack(b"S", 8, 10, 0, 0), "slot 8"),  # past the last slot
        (wire.NOTE.pack(b"S", 0, (1 << 20) + 1, 0, 0), "bytes"),  # longer than a slot
        (wire.ACK.pack(b"A", 65535), "slot 65535"),
    ],
)
def test_shared_memory_indices_are_bounded(head: bytes, pattern: str) -> None:
    """Finding: slot numbers and lengths from a notification were used unchecked, so a bad one
    silently read past the ring (an empty or short view: wrong results, not an error)."""
    with pytest.raises(ProtocolError, match=pattern):
        wire.parse_data(head, 1, 8, 1 << 20)
