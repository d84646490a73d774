"""The inbox of a data plane: payloads taken by (seq, tag) in any order; repeats and stale ops refused."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ringcomm.core.inbox import Inbox
from ringcomm.errors import ProtocolError

pytestmark = pytest.mark.pure


@given(st.integers(1, 4), st.data())
def test_every_payload_of_an_op_is_taken_once_in_any_order(stride: int, data: st.DataObject) -> None:
    box = Inbox(stride)
    op = data.draw(st.integers(0, 5))
    keys = data.draw(st.lists(st.tuples(st.integers(op * stride, op * stride + stride - 1), st.integers(0, 3)),
                              unique=True, max_size=8))
    assert box.enter(1, op * stride + data.draw(st.integers(0, stride - 1))) == op * stride
    for seq, tag in keys:
        box.put(1, seq, tag, (seq, tag))
    for seq, tag in data.draw(st.permutations(keys)):
        with pytest.raises(ProtocolError, match="a second message"):
            box.put(1, seq, tag, "again")  # waiting under that key
        assert box.take(1, seq, tag) == (seq, tag)
        with pytest.raises(ProtocolError, match="a second message"):
            box.put(1, seq, tag, "again")  # taken in this op
    assert all(not box.has(1, s, t) for s, t in keys)


@given(st.integers(1, 4), st.integers(1, 6), st.integers(0, 3))
def test_once_an_op_is_entered_the_earlier_ones_are_stale(stride: int, op: int, tag: int) -> None:
    box = Inbox(stride)
    box.put(0, (op - 1) * stride, tag, "early")  # before the rank enters anything: kept
    assert box.enter(0, op * stride) == op * stride and box.enter(0, op * stride + stride - 1) is None
    with pytest.raises(ProtocolError, match="which is over"):
        box.put(0, (op - 1) * stride, tag + 1, "late")
    box.put(0, (op + 1) * stride, tag, "next op")  # a later op may arrive before it is entered
    assert box.has(0, (op + 1) * stride, tag) and not box.has(1, (op + 1) * stride, tag)  # per peer


def test_a_tag_is_taken_in_the_order_it_arrived_and_a_new_op_forgets_what_was_taken() -> None:
    box = Inbox(stride=1)
    box.enter(2, 7)
    box.put(2, 7, 3, "c")
    box.put(2, 8, 0, "other op")
    box.put(2, 7, 1, "a")
    assert box.take_op(2, 7) == (3, "c") and box.take_op(2, 7) == (1, "a") and box.take_op(2, 7) is None
    assert box.enter(2, 8) == 8
    assert box.take(2, 8, 0) == "other op"
    box.put(2, 9, 3, "same tag, next op")  # a key taken in an earlier op is not a repeat
    assert box.take_op(2, 9) == (3, "same tag, next op")
