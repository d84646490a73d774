"""The lane's frames across hosts: a stream cut anywhere reads back as the frames that were sent."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringcomm.core.lane_frames import SLOT, HEAD, OFF, FrameReader, slot_frame, slot_head, off_frame
from ringcomm.errors import ProtocolError

pytestmark = pytest.mark.pure

frames = st.lists(st.one_of(
    st.tuples(st.just(SLOT), st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1), st.integers(0, 2**63 - 1),
              st.booleans(), st.binary(max_size=300)),
    st.tuples(st.just(OFF), st.integers(0, 2**32 - 1), st.just(0), st.just(0), st.just(False), st.just(b"")),
), max_size=12)


def encode(f) -> bytes:
    kind, epoch, index, key, fast, payload = f
    return slot_frame(epoch, index, key, fast, payload) if kind == SLOT else off_frame(epoch)


@settings(max_examples=300, deadline=None)
@given(frames, st.lists(st.integers(0, 5000), max_size=8))
def test_a_stream_cut_at_any_points_reads_back_as_the_frames_sent(sent, cuts):
    stream = b"".join(encode(f) for f in sent)
    reader = FrameReader(max_payload=300)
    got, last = [], 0
    for cut in sorted(c % (len(stream) + 1) for c in cuts) + [len(stream)]:
        got += reader.feed(stream[last:cut])
        last = cut
    assert [tuple(f) for f in got] == [(k, e, i, key, fast, p) for k, e, i, key, fast, p in sent]
    assert reader.pending == 0


def test_a_head_and_its_payload_sent_apart_read_as_one_frame():
    reader = FrameReader(max_payload=16)
    assert reader.feed(slot_head(3, 9, 42, True, 4)) == []
    assert reader.pending == HEAD.size
    (frame,) = reader.feed(b"abcd")
    assert (frame.epoch, frame.lane_index, frame.key, frame.fast, frame.payload) == (3, 9, 42, True, b"abcd")


@pytest.mark.parametrize("bad", [
    HEAD.pack(7, 0, 0, 0, 0, 0),  # no such kind
    HEAD.pack(SLOT, 0, 0, 0, 2, 0),  # fast is a flag
    HEAD.pack(SLOT, 0, 0, 0, 1, 17),  # more than the largest payload any rank posts
])
def test_a_malformed_head_is_a_protocol_error(bad):
    with pytest.raises(ProtocolError, match="small-op lane frame"):
        FrameReader(max_payload=16).feed(bad)
